//! RDMA backend (cargo feature `rdma`) through UCX, the library NIXL builds on: control frames
//! (handshake, BEGIN, LAYER headers, END, VERDICT, trailers) go over an authenticated TCP
//! connection exactly as in the tcp backend; layer payload goes as UCX tag messages, received
//! straight into the reserved blocks (UCX picks RDMA verbs where a device exists, and its
//! rendezvous protocol then moves large regions with zero copies; on these machines it runs
//! over its tcp and shared-memory transports).
//!
//! After the handshake the receiver creates its UCX worker and sends its address on the
//! control connection (u32 length, bytes); the sender creates an endpoint to it. Each region
//! the sender passes (one per block for K, then for V; one staged buffer for a compressed
//! layer) is one tag message, numbered by a per-connection counter that both sides advance in
//! the same order; the receiver posts one receive per destination slice, and a message that
//! does not fill its slice exactly fails the transfer.
//!
//! Invariants: no byte reaches the sink before the handshake succeeded (the worker address is
//! only sent after it); every wait is bounded by [`crate::Timeouts::io`]; a dropped transfer
//! cancels its receives before the sink regions are handed back (see `ffi`).

mod ffi;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

use crate::backend::tcp::{
    accept_authenticated, accept_idle, accept_transport, connect_transport, TcpTransport,
};
use crate::config::TransferConfig;
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::protocol::integrity::{sender_auth, FrameAuth};
use crate::protocol::send::{ReceiverCore, SenderCore};
use crate::protocol::transport::FrameTransport;
use crate::protocol::HEADER_LEN;
use ffi::Ucx;

/// Largest worker address accepted from a peer.
const MAX_ADDRESS_LEN: usize = 64 << 10;

/// UCX options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RdmaOptions {
    /// UCX transports, in `UCX_TLS` syntax (`rc,ud`, `tcp`, `shm`, ...); empty lets UCX choose
    /// (it also reads `UCX_*` environment variables).
    pub tls: String,
}

/// Checks that UCX starts with `opts` (library present, transports available).
pub fn probe(opts: &RdmaOptions) -> Result<()> {
    Ucx::open(&opts.tls).map(drop)
}

/// Control over TCP, payload over UCX.
#[derive(Debug)]
pub(crate) struct RdmaTransport {
    ctl: TcpTransport,
    ucx: Ucx,
    tag: u64,
    io_timeout: Duration,
}

impl RdmaTransport {
    /// Receives the next messages into `bufs`; a sender whose control connection closes
    /// fails the wait at once (its receives are cancelled) instead of at the timeout, as long
    /// as nothing is queued on it (the peek that notices the EOF stops at queued bytes; the
    /// timeout then applies).
    async fn recv(&mut self, bufs: &mut [&mut [u8]]) -> Result<()> {
        let first = self.tag;
        self.tag += bufs.len() as u64;
        tokio::select! {
            r = self.ucx.recv_all(first, bufs, self.io_timeout) => r,
            () = self.ctl.closed() => Err(Error::PeerClosed { during: "receiving KV over UCX" }),
        }
    }
}

impl FrameTransport for RdmaTransport {
    // Every wait on the control connection keeps the UCX worker progressing (see
    // `Ucx::progressing`).
    async fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        self.ucx.progressing(self.ctl.read_idle(buf)).await
    }

    async fn read_ctl(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        self.ucx.progressing(self.ctl.read_ctl(buf, during)).await
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        self.recv(&mut [dst]).await
    }

    async fn read_payload_vectored(&mut self, bufs: &mut [&mut [u8]]) -> Result<()> {
        self.recv(bufs).await
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
        let regions: Vec<&[u8]> = k.iter().chain(v).map(|r| r.as_ref()).collect();
        let first = self.tag;
        self.tag += regions.len() as u64;
        // The receiver says nothing on the control connection during a transfer unless it
        // rejected it (VERDICT) or went away; either way these sends will never be received.
        // Dropping them closes the endpoint (later posts fail with `Broken`), and the sender
        // core's early-reply check right after this returns reads the verdict or the EOF.
        tokio::select! {
            r = self.ucx.send_all(first, &regions, self.io_timeout) => r?,
            () = self.ctl.replied() => {}
        }
        if let Some(t) = trailer {
            self.ctl.write_ctl(&t, "sending a MAC trailer").await?;
        }
        Ok(())
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        self.ucx.progressing(self.ctl.read_reply_header(buf)).await
    }

    async fn poll_early_reply(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<bool> {
        self.ctl.poll_early_reply(buf).await
    }

    async fn shutdown_and_drain(&mut self) {
        self.ctl.shutdown_and_drain().await
    }
}

/// Accepts RDMA connections (decode side).
#[derive(Debug)]
pub struct RdmaReceiver {
    listener: TcpListener,
    cfg: TransferConfig,
    opts: RdmaOptions,
}

impl RdmaReceiver {
    /// Checks that UCX starts, then serves on `listener` (the control channel).
    pub fn new(listener: TcpListener, cfg: TransferConfig, opts: RdmaOptions) -> Result<Self> {
        probe(&opts)?;
        Ok(RdmaReceiver {
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

    /// Accepts one connection, authenticates it and hands the sender this side's UCX address.
    pub async fn accept(&self) -> Result<RdmaInbound> {
        let ctl = accept_authenticated(&self.listener, &self.cfg).await?;
        self.setup().finish(ctl).await
    }

    /// Waits (up to the idle timeout) for the next control connection, not yet authenticated:
    /// an accept loop hands it to [`RdmaSetup::run`] in a task of its own, so a slow peer
    /// never holds up the next accept.
    pub async fn accept_stream(&self) -> Result<(TcpStream, SocketAddr)> {
        accept_idle(&self.listener, &self.cfg).await
    }

    /// What [`RdmaSetup::run`] needs to finish an accepted connection.
    pub fn setup(&self) -> RdmaSetup {
        RdmaSetup {
            cfg: self.cfg.clone(),
            opts: self.opts.clone(),
        }
    }
}

/// The handshake of one accepted control connection, detached from the receiver.
#[derive(Debug, Clone)]
pub struct RdmaSetup {
    cfg: TransferConfig,
    opts: RdmaOptions,
}

impl RdmaSetup {
    /// Authenticates the peer, then (only then) opens this side's UCX worker and sends its
    /// address.
    pub async fn run(self, stream: TcpStream) -> Result<RdmaInbound> {
        let ctl = accept_transport(stream, &self.cfg).await?;
        self.finish(ctl).await
    }

    async fn finish(self, mut ctl: TcpTransport) -> Result<RdmaInbound> {
        let t = self.cfg.timeouts;
        let mut ucx = Ucx::open(&self.opts.tls)?;
        let addr = ucx.address()?;
        let mut msg = Vec::with_capacity(4 + addr.len());
        msg.extend_from_slice(&(addr.len() as u32).to_le_bytes());
        msg.extend_from_slice(&addr);
        ctl.write_ctl(&msg, "sending the UCX worker address")
            .await?;
        let auth = FrameAuth::new(&ctl.key);
        Ok(RdmaInbound {
            core: ReceiverCore::new(
                RdmaTransport {
                    ctl,
                    ucx,
                    tag: 0,
                    io_timeout: t.io,
                },
                self.cfg.layout,
                auth,
                self.cfg.integrity.on(),
            ),
        })
    }
}

/// An authenticated RDMA inbound connection.
#[derive(Debug)]
pub struct RdmaInbound {
    core: ReceiverCore<RdmaTransport>,
}

impl RdmaInbound {
    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

via_core!(receiver RdmaInbound);

/// RDMA outbound connection (prefill side).
#[derive(Debug)]
pub struct RdmaSender {
    core: SenderCore<RdmaTransport>,
}

impl RdmaSender {
    /// Connects the control channel, authenticates, and opens a UCX endpoint to the
    /// receiver's worker.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        cfg: &TransferConfig,
        opts: &RdmaOptions,
    ) -> Result<Self> {
        let mut ucx = Ucx::open(&opts.tls)?;
        let mut ctl = connect_transport(addr, cfg).await?;
        let mut len = [0u8; 4];
        ctl.read_ctl(&mut len, "reading the UCX worker address")
            .await?;
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 || len > MAX_ADDRESS_LEN {
            return Err(Error::Oversized {
                what: "UCX worker address",
                len: len as u64,
                limit: MAX_ADDRESS_LEN as u64,
            });
        }
        let mut peer = vec![0u8; len];
        ctl.read_ctl(&mut peer, "reading the UCX worker address")
            .await?;
        ucx.connect(&peer)?;
        let auth = sender_auth(cfg.integrity, &ctl.key);
        Ok(RdmaSender {
            core: SenderCore::new(
                RdmaTransport {
                    ctl,
                    ucx,
                    tag: 0,
                    io_timeout: cfg.timeouts.io,
                },
                cfg.layout,
                auth,
            )
            .configured(cfg),
        })
    }

    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

via_core!(sender RdmaSender);
