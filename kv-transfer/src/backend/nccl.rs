//! NCCL backend (cargo feature `nccl`): control frames (handshake, BEGIN, END, VERDICT) go
//! over an authenticated TCP connection exactly as in the tcp backend; LAYER payload goes
//! GPU to GPU with NCCL point-to-point send/recv through a device staging buffer.
//!
//! CUDA and NCCL are loaded at run time (`cudarc` with `dynamic-loading`), or linked at start
//! in a build with the engine's CUDA (feature `cuda`): [`probe`] checks that both libraries
//! are there and the device count first and returns [`Error::BackendUnavailable`] with a
//! clear reason when something is missing.
//!
//! After the handshake the receiver (rank 0) creates the NCCL unique id and sends its 128
//! bytes on the control connection; both sides then join a 2-rank communicator.
//!
//! Invariants: host regions are copied into the staging buffer with `memcpy_htod` and out of
//! it with `memcpy_dtoh` straight into the sink regions; every device wait polls a CUDA event
//! with a deadline ([`crate::Timeouts::io`]); the communicator is aborted (dropped) on error.
//! This module and `backend::shm::mapping` are the only ones with `unsafe` code.
#![allow(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};
use tokio::net::{TcpListener, ToSocketAddrs};

use crate::backend::tcp::{accept_authenticated, connect_transport, TcpTransport};
use crate::config::TransferConfig;
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::protocol::integrity::{sender_auth, FrameAuth};
use crate::protocol::send::{ReceiverCore, SenderCore};
use crate::protocol::transport::FrameTransport;
use crate::protocol::HEADER_LEN;

const NCCL_ID_LEN: usize = 128;

/// What [`probe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclInfo {
    /// Number of CUDA devices.
    pub devices: usize,
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        backend: "nccl",
        reason: reason.into(),
    }
}

/// Checks that the CUDA driver and NCCL libraries load and that `device` exists.
pub fn probe(device: usize) -> Result<NcclInfo> {
    libraries_present()?;
    let n = CudaContext::device_count()
        .map_err(|e| unavailable(format!("CUDA initialisation failed: {e:?}")))?;
    let n = usize::try_from(n).unwrap_or(0);
    if device >= n {
        return Err(unavailable(format!(
            "CUDA device {device} requested, {n} device(s) present"
        )));
    }
    Ok(NcclInfo { devices: n })
}

/// Whether libcuda and libnccl load. With run-time loading (the default) a missing library
/// would panic at the first call, so it is checked here first.
#[cfg(not(feature = "cuda"))]
fn libraries_present() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the library under its candidate names
    // and drops the handle; it has no preconditions and touches no shared state.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver library (libcuda.so) was not found; is an NVIDIA driver installed?",
        ));
    }
    // SAFETY: as above, for libnccl.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(unavailable(
            "the NCCL library (libnccl.so) was not found; install NCCL or use the tcp backend",
        ));
    }
    Ok(())
}

/// In a build that links CUDA (feature `cuda`) the loader resolved both libraries before
/// `main`: a process without them never starts.
#[cfg(feature = "cuda")]
fn libraries_present() -> Result<()> {
    Ok(())
}

/// NCCL options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Size of the device staging buffer (payload moves in chunks of at most this size).
    pub staging_bytes: usize,
    /// How often a device wait re-checks completion.
    pub poll_interval: Duration,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: 0,
            staging_bytes: 64 << 20,
            poll_interval: Duration::from_micros(50),
        }
    }
}

/// Device-side state: stream, communicator and staging buffer.
struct Device {
    stream: Arc<CudaStream>,
    comm: Comm,
    staging: CudaSlice<u8>,
    peer: i32,
    timeout: Duration,
    poll: Duration,
}

// SAFETY: `Comm` holds a raw `ncclComm_t`, which NCCL allows to be used from any thread as
// long as calls on it are not concurrent. `Device` is only ever reached through `&mut` of its
// single owner (a sender or receiver), so calls are serialised; cudarc binds the CUDA context
// to the calling thread before every driver call.
unsafe impl Send for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("peer", &self.peer)
            .field("staging_bytes", &self.staging.len())
            .finish()
    }
}

fn cuda(during: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| unavailable(format!("CUDA error while {during}: {e:?}"))
}

fn nccl(during: &'static str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> Error {
    move |e| unavailable(format!("NCCL error while {during}: {e:?}"))
}

impl Device {
    /// Joins the 2-rank communicator (blocking; run on a blocking thread).
    fn open(opts: NcclOptions, rank: usize, id: Id, timeout: Duration) -> Result<Device> {
        let ctx = CudaContext::new(opts.device).map_err(cuda("opening the device"))?;
        let stream = ctx.default_stream();
        let staging = stream
            .alloc_zeros::<u8>(opts.staging_bytes)
            .map_err(cuda("allocating the staging buffer"))?;
        let comm = Comm::from_rank(stream.clone(), rank, 2, id)
            .map_err(nccl("joining the communicator"))?;
        Ok(Device {
            stream,
            comm,
            staging,
            peer: if rank == 0 { 1 } else { 0 },
            timeout,
            poll: opts.poll_interval,
        })
    }

    fn record(&self, during: &'static str) -> Result<CudaEvent> {
        self.stream.record_event(None).map_err(cuda(during))
    }
}

/// Waits for `ev` with a deadline.
async fn wait(
    ev: CudaEvent,
    timeout: Duration,
    poll: Duration,
    during: &'static str,
) -> Result<()> {
    let start = Instant::now();
    loop {
        match ev.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) if start.elapsed() >= timeout => {
                return Err(Error::Timeout {
                    during,
                    after: timeout,
                })
            }
            Ok(false) => tokio::time::sleep(poll).await,
            Err(e) => return Err(cuda(during)(e)),
        }
    }
}

/// Control over TCP, payload over NCCL.
#[derive(Debug)]
pub(crate) struct NcclTransport {
    ctl: TcpTransport,
    dev: Device,
    rx_remaining: u64,
    rx_staged: usize,
    rx_off: usize,
}

impl NcclTransport {
    async fn device_wait(&mut self, during: &'static str) -> Result<()> {
        let ev = self.dev.record(during)?;
        wait(ev, self.dev.timeout, self.dev.poll, during).await
    }

    async fn send_staged(&mut self, len: usize) -> Result<()> {
        let view = self.dev.staging.slice(0..len);
        self.dev
            .comm
            .send(&view, self.dev.peer)
            .map_err(nccl("sending a chunk"))?;
        self.device_wait("sending a chunk over NCCL").await
    }
}

impl FrameTransport for NcclTransport {
    async fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        self.ctl.read_idle(buf).await
    }

    async fn read_ctl(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        self.ctl.read_ctl(buf, during).await
    }

    async fn begin_payload(&mut self, len: u64) -> Result<()> {
        self.rx_remaining = len;
        self.rx_staged = 0;
        self.rx_off = 0;
        Ok(())
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        let mut filled = 0;
        while filled < dst.len() {
            if self.rx_staged == self.rx_off {
                let n = (self.dev.staging.len() as u64).min(self.rx_remaining) as usize;
                if n == 0 {
                    return Err(Error::malformed("LAYER", "payload longer than announced"));
                }
                let mut view = self.dev.staging.slice_mut(0..n);
                self.dev
                    .comm
                    .recv(&mut view, self.dev.peer)
                    .map_err(nccl("receiving a chunk"))?;
                self.device_wait("receiving a chunk over NCCL").await?;
                self.rx_remaining -= n as u64;
                self.rx_staged = n;
                self.rx_off = 0;
            }
            let m = (self.rx_staged - self.rx_off).min(dst.len() - filled);
            let view = self.dev.staging.slice(self.rx_off..self.rx_off + m);
            self.dev
                .stream
                .memcpy_dtoh(&view, &mut dst[filled..filled + m])
                .map_err(cuda("copying to the host"))?;
            self.device_wait("copying to the host").await?;
            filled += m;
            self.rx_off += m;
        }
        Ok(())
    }

    async fn write_ctl(&mut self, buf: &[u8], during: &'static str) -> Result<()> {
        self.ctl.write_ctl(buf, during).await
    }

    async fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; crate::protocol::MAC_LEN]>,
    ) -> Result<()> {
        self.ctl.write_ctl(header, "sending a layer header").await?;
        let cap = self.dev.staging.len();
        let mut fill = 0usize;
        for region in k.iter().chain(v) {
            let mut src = region.as_ref();
            while !src.is_empty() {
                let n = (cap - fill).min(src.len());
                let mut view = self.dev.staging.slice_mut(fill..fill + n);
                self.dev
                    .stream
                    .memcpy_htod(&src[..n], &mut view)
                    .map_err(cuda("copying to the device"))?;
                fill += n;
                src = &src[n..];
                if fill == cap {
                    self.send_staged(fill).await?;
                    fill = 0;
                }
            }
        }
        if fill > 0 {
            self.send_staged(fill).await?;
        }
        if let Some(t) = trailer {
            self.ctl.write_ctl(&t, "sending a MAC trailer").await?;
        }
        Ok(())
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        self.ctl.read_reply_header(buf).await
    }

    async fn poll_early_reply(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<bool> {
        self.ctl.poll_early_reply(buf).await
    }

    async fn shutdown_and_drain(&mut self) {
        self.ctl.shutdown_and_drain().await
    }
}

async fn open_device(opts: NcclOptions, rank: usize, id: Id, timeout: Duration) -> Result<Device> {
    let join = tokio::task::spawn_blocking(move || Device::open(opts, rank, id, timeout));
    match tokio::time::timeout(timeout, join).await {
        Err(_) => Err(Error::Timeout {
            during: "joining the NCCL communicator",
            after: timeout,
        }),
        Ok(Err(e)) => Err(Error::Internal(format!("NCCL setup task failed: {e}"))),
        Ok(Ok(r)) => r,
    }
}

/// Accepts NCCL connections (decode side, rank 0).
#[derive(Debug)]
pub struct NcclReceiver {
    listener: TcpListener,
    cfg: TransferConfig,
    opts: NcclOptions,
}

impl NcclReceiver {
    /// Checks CUDA/NCCL availability, then serves on `listener` (the control channel).
    pub fn new(listener: TcpListener, cfg: TransferConfig, opts: NcclOptions) -> Result<Self> {
        probe(opts.device)?;
        Ok(NcclReceiver {
            listener,
            cfg,
            opts,
        })
    }

    /// Control-channel address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::io("reading the listener address", e))
    }

    /// Accepts one connection, authenticates it and joins the communicator.
    pub async fn accept(&self) -> Result<NcclInbound> {
        let t = self.cfg.timeouts;
        let mut ctl = accept_authenticated(&self.listener, &self.cfg).await?;
        let id = Id::new().map_err(nccl("creating the unique id"))?;
        let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
        ctl.write_ctl(&bytes, "sending the NCCL id").await?;
        let dev = open_device(self.opts, 0, id, t.handshake).await?;
        let auth = FrameAuth::new(&ctl.key);
        Ok(NcclInbound {
            core: ReceiverCore::new(
                NcclTransport {
                    ctl,
                    dev,
                    rx_remaining: 0,
                    rx_staged: 0,
                    rx_off: 0,
                },
                self.cfg.layout,
                auth,
                self.cfg.integrity.on(),
            ),
        })
    }
}

/// An authenticated NCCL inbound connection.
#[derive(Debug)]
pub struct NcclInbound {
    core: ReceiverCore<NcclTransport>,
}

impl NcclInbound {
    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

via_core!(receiver NcclInbound);

/// NCCL outbound connection (prefill side, rank 1).
#[derive(Debug)]
pub struct NcclSender {
    core: SenderCore<NcclTransport>,
}

impl NcclSender {
    /// Checks CUDA/NCCL availability, connects the control channel, authenticates and joins
    /// the communicator.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        cfg: &TransferConfig,
        opts: NcclOptions,
    ) -> Result<Self> {
        probe(opts.device)?;
        let mut ctl = connect_transport(addr, cfg).await?;
        let mut raw = [0u8; NCCL_ID_LEN];
        ctl.read_ctl(&mut raw, "reading the NCCL id").await?;
        let mut internal = [0 as std::ffi::c_char; NCCL_ID_LEN];
        for (d, s) in internal.iter_mut().zip(raw) {
            *d = s as std::ffi::c_char;
        }
        let dev = open_device(opts, 1, Id::uninit(internal), cfg.timeouts.handshake).await?;
        let auth = sender_auth(cfg.integrity, &ctl.key);
        Ok(NcclSender {
            core: SenderCore::new(
                NcclTransport {
                    ctl,
                    dev,
                    rx_remaining: 0,
                    rx_staged: 0,
                    rx_off: 0,
                },
                cfg.layout,
                auth,
            )
            .configured(cfg),
        })
    }
}

via_core!(sender NcclSender);
