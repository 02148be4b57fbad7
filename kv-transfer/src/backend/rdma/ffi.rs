//! Bindings to `shim.c` and [`Ucx`], the safe owner of one UCX context, worker and (sender
//! side) endpoint.
//!
//! Longer than 600 lines on purpose: every `unsafe` call into UCX and the invariants that
//! make them sound stay in this one file, so that a review of the FFI reads one place.
//!
//! Invariants that make the `unsafe` sound:
//! - a posted operation's buffer and its completion record ([`Op`]) stay borrowed / in place
//!   until UCX reports it complete, or UCX is gone: [`Posted`] holds both, and its `Drop`
//!   cancels receives (closes the endpoint for sends), progresses the worker for a bounded
//!   time, and destroys the whole worker if operations are still pending then, so a dropped
//!   future never leaves UCX writing into, or reading from, memory that was handed back;
//! - a `Posted` that was leaked (`mem::forget` of a pinned future) leaves `in_flight`
//!   non-zero: the worker is then never progressed nor destroyed again, so UCX cannot touch
//!   the leaked operations' buffers (all its transports here move data only inside
//!   progress calls);
//! - the worker is used in `UCS_THREAD_MODE_SERIALIZED`: every call goes through `&mut Ucx`,
//!   so calls never overlap even though the owner may move between threads;
//! - the worker's event fd is deregistered from tokio before the worker is destroyed.
//!
//! This module, `backend::nccl` and `backend::shm::mapping` are the crate's only `unsafe` code.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::future::Future;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{self, NonNull};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::error::{Error, Result};

/// Opaque `duet_ucx_t`.
#[repr(C)]
struct Handle {
    _private: [u8; 0],
}

/// `duet_ucx_op_t`: written by the shim's completion callbacks.
#[repr(C)]
#[derive(Debug, Default)]
struct Op {
    done: c_int,
    status: c_int,
    length: u64,
}

extern "C" {
    fn duet_ucx_status_string(status: c_int) -> *const c_char;
    fn duet_ucx_open(
        tls: *const c_char,
        out: *mut *mut Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn duet_ucx_close(h: *mut Handle);
    fn duet_ucx_ep_close(h: *mut Handle);
    fn duet_ucx_address(h: *mut Handle, addr: *mut *mut c_void, len: *mut usize) -> c_int;
    fn duet_ucx_address_free(h: *mut Handle, addr: *mut c_void);
    fn duet_ucx_connect(h: *mut Handle, addr: *const c_void) -> c_int;
    fn duet_ucx_ep_failed(h: *const Handle) -> c_int;
    fn duet_ucx_efd(h: *mut Handle, fd: *mut c_int) -> c_int;
    fn duet_ucx_progress(h: *mut Handle) -> c_uint;
    fn duet_ucx_arm(h: *mut Handle) -> c_int;
    fn duet_ucx_send(
        h: *mut Handle,
        tag: u64,
        buf: *const c_void,
        len: usize,
        op: *mut Op,
        req: *mut *mut c_void,
    ) -> c_int;
    fn duet_ucx_recv(
        h: *mut Handle,
        tag: u64,
        buf: *mut c_void,
        len: usize,
        op: *mut Op,
        req: *mut *mut c_void,
    ) -> c_int;
    fn duet_ucx_flush(h: *mut Handle, op: *mut Op, req: *mut *mut c_void) -> c_int;
    fn duet_ucx_cancel(h: *mut Handle, req: *mut c_void);
    fn duet_ucx_free(req: *mut c_void);
}

/// Most operations in flight per wait: bounds the requests and completion records a layer
/// holds at once (a layer of a long prompt has hundreds of regions).
const WINDOW: usize = 64;

/// `UCS_ERR_MESSAGE_TRUNCATED`: a message longer than the buffer posted for it.
const UCS_ERR_MESSAGE_TRUNCATED: c_int = -9;

/// UCX's name for a status code.
fn status_name(status: c_int) -> String {
    // SAFETY: `ucs_status_string` returns a pointer to a static NUL-terminated string for
    // every value (unknown ones included).
    let p = unsafe { duet_ucx_status_string(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, static and NUL-terminated (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn unavailable(reason: String) -> Error {
    Error::BackendUnavailable {
        backend: "rdma",
        reason,
    }
}

fn ucx_error(during: &'static str, status: c_int) -> Error {
    Error::io(
        during,
        std::io::Error::other(format!("UCX: {}", status_name(status))),
    )
}

/// The worker's event fd, owned by UCX (never closed here).
#[derive(Debug)]
struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// One UCX context + worker (+ endpoint once connected).
#[derive(Debug)]
pub(crate) struct Ucx {
    h: NonNull<Handle>,
    efd: Option<AsyncFd<EventFd>>,
    /// No more operations may be posted (endpoint closed after a dropped send).
    broken: bool,
    /// The worker was destroyed (pending operations would not complete): no call may touch
    /// the handle again.
    dead: bool,
    /// Operations posted and not yet completed or reclaimed by their `Posted`.
    in_flight: usize,
}

// SAFETY: the worker runs in UCS_THREAD_MODE_SERIALIZED, which allows calls from any thread
// as long as they do not overlap; every call goes through `&mut Ucx` (or `Drop`), so they
// cannot.
unsafe impl Send for Ucx {}

impl Ucx {
    /// Creates a context and worker restricted to the UCX transports `tls` (UCX_TLS syntax,
    /// e.g. `tcp`, `shm`, `rc,ud`; empty = UCX's own choice).
    pub(crate) fn open(tls: &str) -> Result<Ucx> {
        let tls =
            CString::new(tls).map_err(|_| Error::InvalidArgument("UCX_TLS has a NUL".into()))?;
        let mut h: *mut Handle = ptr::null_mut();
        let mut err = [0 as c_char; 256];
        // SAFETY: `tls` is NUL-terminated, `h` and `err` are valid for writes of their sizes.
        let rc = unsafe { duet_ucx_open(tls.as_ptr(), &mut h, err.as_mut_ptr(), err.len()) };
        let Some(h) = NonNull::new(h).filter(|_| rc == 0) else {
            // SAFETY: the shim NUL-terminates what it writes (snprintf) and `err` starts zeroed.
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            return Err(unavailable(format!("UCX could not start: {msg}")));
        };
        let mut ucx = Ucx {
            h,
            efd: None,
            broken: false,
            dead: false,
            in_flight: 0,
        };
        let mut fd: c_int = -1;
        // SAFETY: the handle is live; `fd` is valid for a write.
        let rc = unsafe { duet_ucx_efd(ucx.h.as_ptr(), &mut fd) };
        if rc != 0 {
            return Err(unavailable(format!(
                "UCX worker has no event fd: {}",
                status_name(rc)
            )));
        }
        // SAFETY: `fd` is the worker's open event fd; the worker (and so the fd) outlives the
        // `AsyncFd`, which `Drop for Ucx` releases before closing the worker.
        let efd = unsafe { AsyncFd::register_with_interest(EventFd(fd), Interest::READABLE) }
            .map_err(|e| {
                Error::io(
                    "registering the UCX event fd",
                    std::io::Error::other(e.to_string()),
                )
            })?;
        ucx.efd = Some(efd);
        Ok(ucx)
    }

    /// This worker's address, for the peer's [`Ucx::connect`].
    pub(crate) fn address(&mut self) -> Result<Vec<u8>> {
        let mut p: *mut c_void = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: the handle is live; `p` and `len` are valid for writes.
        let rc = unsafe { duet_ucx_address(self.h.as_ptr(), &mut p, &mut len) };
        if rc != 0 || p.is_null() {
            return Err(unavailable(format!(
                "reading the UCX worker address: {}",
                status_name(rc)
            )));
        }
        // SAFETY: UCX returned `len` readable bytes at `p`, released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }.to_vec();
        // SAFETY: `p` came from `duet_ucx_address` on this handle and is released once.
        unsafe { duet_ucx_address_free(self.h.as_ptr(), p) };
        Ok(bytes)
    }

    /// Creates the endpoint to a peer worker address (sender side).
    pub(crate) fn connect(&mut self, addr: &[u8]) -> Result<()> {
        // SAFETY: the handle is live and `addr` is a readable worker address blob; UCX copies
        // what it needs during the call.
        let rc = unsafe { duet_ucx_connect(self.h.as_ptr(), addr.as_ptr().cast()) };
        if rc != 0 {
            return Err(unavailable(format!(
                "connecting to the peer's UCX worker: {}",
                status_name(rc)
            )));
        }
        Ok(())
    }

    fn progress(&mut self) {
        if self.dead {
            return;
        }
        // SAFETY: the handle is live (not dead); calls are serialised by `&mut self`.
        while unsafe { duet_ucx_progress(self.h.as_ptr()) } > 0 {}
    }

    /// Destroys the worker now (operations still pending are dropped with it).
    fn kill(&mut self) {
        if self.dead {
            return;
        }
        self.efd = None;
        // SAFETY: the handle is live and closed exactly once (`dead` guards every later use).
        unsafe { duet_ucx_close(self.h.as_ptr()) };
        self.dead = true;
        self.broken = true;
        self.in_flight = 0;
    }

    /// Sleeps until the worker's fd signals, or 1 ms in case a transport delivers without
    /// signalling (UCX's shared-memory transports).
    async fn nap(&mut self, max: Duration) {
        if let Some(efd) = &self.efd {
            let slice = max.min(Duration::from_millis(1));
            if let Ok(Ok(mut g)) = tokio::time::timeout(slice, efd.readable()).await {
                g.clear_ready();
            }
        }
    }

    /// Keeps the worker progressing until the future is dropped. A completed receive does
    /// not mean UCX is done: its rendezvous acknowledgement to the sender may still be queued
    /// in this worker, and the sender's sends complete only once it goes out; without this,
    /// a receiver blocked on the control connection while the sender waits for those
    /// acknowledgements deadlocks (seen over UCX's shared-memory transports).
    async fn progress_while_idle(&mut self) -> std::convert::Infallible {
        loop {
            if self.dead || self.in_flight != 0 {
                // Dead, or a leaked batch: never progress again (see the module docs).
                return std::future::pending().await;
            }
            self.progress();
            // SAFETY: the handle is live.
            match unsafe { duet_ucx_arm(self.h.as_ptr()) } {
                1 => tokio::task::yield_now().await,
                _ => self.nap(Duration::from_millis(1)).await,
            }
        }
    }

    /// Runs `f` (a wait on the control connection) while keeping the worker progressing.
    pub(crate) async fn progressing<T>(&mut self, f: impl Future<Output = T>) -> T {
        tokio::select! {
            r = f => r,
            never = self.progress_while_idle() => match never {},
        }
    }

    /// Sends each buffer as one tag message, tags `first_tag..`, and waits for all of them.
    pub(crate) async fn send_all(
        &mut self,
        first_tag: u64,
        bufs: &[&[u8]],
        timeout: Duration,
    ) -> Result<()> {
        for (w, chunk) in bufs.chunks(WINDOW).enumerate() {
            let mut posted = Posted::new(self, chunk.len(), Kind::Send)?;
            for (i, b) in chunk.iter().enumerate() {
                let tag = first_tag + (w * WINDOW + i) as u64;
                posted.post(tag, b.as_ptr().cast_mut(), b.len())?;
            }
            posted.wait(timeout, "sending KV over UCX").await?;
        }
        // A completed send may still sit in the transport's buffers, and nothing progresses
        // this worker until the next layer: flush so the receiver gets it now.
        let mut posted = Posted::new(self, 1, Kind::Flush)?;
        posted.post(0, ptr::null_mut(), 0)?;
        posted
            .wait(timeout, "flushing KV to the peer over UCX")
            .await
    }

    /// Receives one tag message into each buffer (tags `first_tag..`); every message must fill
    /// its buffer exactly.
    pub(crate) async fn recv_all(
        &mut self,
        first_tag: u64,
        bufs: &mut [&mut [u8]],
        timeout: Duration,
    ) -> Result<()> {
        for (w, chunk) in bufs.chunks_mut(WINDOW).enumerate() {
            let mut posted = Posted::new(self, chunk.len(), Kind::Recv)?;
            for (i, b) in chunk.iter_mut().enumerate() {
                let tag = first_tag + (w * WINDOW + i) as u64;
                posted.post(tag, b.as_mut_ptr(), b.len())?;
            }
            posted.wait(timeout, "receiving KV over UCX").await?;
            for (op, b) in posted.ops.iter().zip(chunk.iter()) {
                if op.length != b.len() as u64 {
                    return Err(Error::malformed(
                        "UCX message",
                        format!("{} bytes for a {}-byte region", op.length, b.len()),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Drop for Ucx {
    fn drop(&mut self) {
        if self.in_flight != 0 {
            // A leaked batch: destroying the worker could still complete its operations
            // into memory that is gone; leak the worker instead.
            tracing::warn!(
                in_flight = self.in_flight,
                "leaking a UCX worker with operations in flight"
            );
            return;
        }
        // Deregisters the event fd before the worker that owns it goes away.
        self.kill();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Recv,
    Flush,
}

/// A UCX request handle (null when the operation completed at once).
#[derive(Debug, Clone, Copy)]
struct Req(*mut c_void);

// SAFETY: a request handle is only used through its `Posted`, which is reached through
// `&mut` (serialised, see `Ucx`), so moving it to another thread with its owner is sound.
unsafe impl Send for Req {}

/// Operations in flight. The buffers they use are borrowed for `'b` by the caller of
/// `send_all` / `recv_all`, which cannot return (or be dropped) before this value is.
struct Posted<'u, 'b> {
    ucx: &'u mut Ucx,
    kind: Kind,
    /// Completion records; boxed so their addresses never move while UCX may write them.
    ops: Box<[Op]>,
    reqs: Vec<Req>,
    _bufs: PhantomData<&'b mut [u8]>,
}

impl<'u> Posted<'u, '_> {
    fn new(ucx: &'u mut Ucx, n: usize, kind: Kind) -> Result<Self> {
        if ucx.broken || ucx.dead || ucx.in_flight != 0 {
            return Err(Error::Broken);
        }
        Ok(Posted {
            ucx,
            kind,
            ops: (0..n).map(|_| Op::default()).collect(),
            reqs: Vec::with_capacity(n),
            _bufs: PhantomData,
        })
    }

    fn post(&mut self, tag: u64, buf: *mut u8, len: usize) -> Result<()> {
        if self.ucx.broken || self.ucx.dead {
            return Err(Error::Broken);
        }
        let i = self.reqs.len();
        let op: *mut Op = &mut self.ops[i];
        let mut req: *mut c_void = ptr::null_mut();
        let h = self.ucx.h.as_ptr();
        // SAFETY: the handle is live; `buf` is valid for `len` bytes for `'b` (borrowed by the
        // caller) and `op` stays in place in `self.ops` until this value is dropped, which
        // waits for completion first.
        let rc = unsafe {
            match self.kind {
                Kind::Send => duet_ucx_send(h, tag, buf.cast_const().cast(), len, op, &mut req),
                Kind::Recv => duet_ucx_recv(h, tag, buf.cast(), len, op, &mut req),
                Kind::Flush => duet_ucx_flush(h, op, &mut req),
            }
        };
        self.reqs.push(Req(req));
        if !req.is_null() {
            self.ucx.in_flight += 1;
        }
        if rc != 0 {
            // Never posted: complete its record so that waits and `Drop` do not wait for it.
            self.ops[i].status = rc;
            self.ops[i].done = 1;
            let during = match self.kind {
                Kind::Send => "posting a UCX send",
                Kind::Recv => "posting a UCX receive",
                Kind::Flush => "flushing a UCX endpoint",
            };
            return Err(ucx_error(during, rc));
        }
        Ok(())
    }

    fn done(&self, i: usize) -> bool {
        // SAFETY: `ops[i]` is a live, aligned `Op`; the callback that writes it runs inside
        // `duet_ucx_progress` on this thread, a volatile read only keeps the compiler from
        // caching the value across those calls.
        unsafe { ptr::read_volatile(&self.ops[i].done) != 0 }
    }

    fn all_done(&self) -> bool {
        (0..self.reqs.len()).all(|i| self.done(i))
    }

    fn first_error(&self) -> Option<c_int> {
        self.ops[..self.reqs.len()]
            .iter()
            .map(|op| op.status)
            .find(|&s| s != 0)
    }

    async fn wait(&mut self, timeout: Duration, during: &'static str) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.ucx.progress();
            if self.all_done() {
                return match self.first_error() {
                    None => Ok(()),
                    Some(UCS_ERR_MESSAGE_TRUNCATED) => Err(Error::malformed(
                        "UCX message",
                        "longer than the region it was received into",
                    )),
                    Some(s) => Err(ucx_error(during, s)),
                };
            }
            // SAFETY: the handle is live (operations are pending, so it was not killed).
            if self.kind != Kind::Recv && unsafe { duet_ucx_ep_failed(self.ucx.h.as_ptr()) } != 0 {
                return Err(Error::PeerClosed { during });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    during,
                    after: timeout,
                });
            }
            // SAFETY: the handle is live.
            match unsafe { duet_ucx_arm(self.ucx.h.as_ptr()) } {
                0 => self.ucx.nap(deadline - now).await,
                1 => tokio::task::yield_now().await,
                s => return Err(ucx_error(during, s)),
            }
        }
    }
}

impl Drop for Posted<'_, '_> {
    fn drop(&mut self) {
        let posted = self.reqs.iter().filter(|r| !r.0.is_null()).count();
        if self.ucx.dead {
            // The worker (and every request) went away with `kill`.
            return;
        }
        let h = self.ucx.h.as_ptr();
        if !self.all_done() {
            match self.kind {
                Kind::Recv => {
                    for i in 0..self.reqs.len() {
                        if !self.reqs[i].0.is_null() && !self.done(i) {
                            // SAFETY: a live request of this worker, not yet freed.
                            unsafe { duet_ucx_cancel(h, self.reqs[i].0) };
                        }
                    }
                }
                Kind::Send | Kind::Flush => {
                    // Sends cannot be cancelled: closing the endpoint completes them (forced
                    // where the peer mode allows it) and leaves the connection unusable.
                    self.ucx.broken = true;
                    // SAFETY: the handle is live; the shim closes the endpoint once.
                    unsafe { duet_ucx_ep_close(h) };
                }
            }
            // A receive already matched to a large message is not cancelled by UCX; give it
            // a moment, then destroy the worker, which takes every pending operation with it.
            let start = Instant::now();
            while !self.all_done() && start.elapsed() < Duration::from_millis(200) {
                self.ucx.progress();
                std::thread::yield_now();
            }
            if !self.all_done() {
                tracing::warn!("UCX operations still pending after cancel; destroying the worker");
                self.ucx.kill();
                return;
            }
        }
        for &Req(r) in &self.reqs {
            if !r.is_null() {
                // SAFETY: a request returned by a post on this live worker, completed, freed
                // once.
                unsafe { duet_ucx_free(r) };
            }
        }
        self.ucx.in_flight -= posted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair over UCX tcp: (sender, receiver).
    fn pair() -> (Ucx, Ucx) {
        let mut rx = Ucx::open("tcp").unwrap();
        let mut tx = Ucx::open("tcp").unwrap();
        let addr = rx.address().unwrap();
        tx.connect(&addr).unwrap();
        (tx, rx)
    }

    async fn exchange(tx: &mut Ucx, rx: &mut Ucx, tag: u64, byte: u8) -> Result<Vec<u8>> {
        let src = vec![byte; 20_000];
        let mut dst = vec![0u8; 20_000];
        let t = Duration::from_secs(5);
        let srcs = [&src[..]];
        let mut dsts = [&mut dst[..]];
        let (s, r) = tokio::join!(tx.send_all(tag, &srcs, t), rx.recv_all(tag, &mut dsts, t));
        s?;
        r?;
        Ok(dst)
    }

    #[tokio::test]
    async fn a_timed_out_receive_is_cancelled_and_the_worker_stays_usable() {
        let (mut tx, mut rx) = pair();
        let mut dst = [0u8; 64];
        let e = rx
            .recv_all(7, &mut [&mut dst[..]], Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(!rx.dead && rx.in_flight == 0);
        // Tag 7 was cancelled: a later message with it is a new match.
        assert_eq!(
            exchange(&mut tx, &mut rx, 7, 5).await.unwrap(),
            vec![5u8; 20_000]
        );
    }

    #[tokio::test]
    async fn a_short_message_is_malformed() {
        let (mut tx, mut rx) = pair();
        let src = [1u8; 10];
        let mut dst = [0u8; 64];
        let t = Duration::from_secs(5);
        let srcs = [&src[..]];
        let mut dsts = [&mut dst[..]];
        let (s, r) = tokio::join!(tx.send_all(0, &srcs, t), rx.recv_all(0, &mut dsts, t));
        s.unwrap();
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Malformed { .. }), "{e}");
    }

    #[tokio::test]
    async fn a_leaked_receive_stops_the_worker_for_good() {
        let (mut tx, mut rx) = pair();
        // Leaked on purpose: the leaked receive may still own it.
        let dst: &'static mut [u8] = Box::leak(vec![0u8; 64].into_boxed_slice());
        let bufs: &'static mut [&'static mut [u8]] = Box::leak(Box::new([dst]));
        {
            let mut fut = Box::pin(rx.recv_all(9, bufs, Duration::from_secs(5)));
            tokio::select! {
                biased;
                _ = &mut fut => panic!("nothing was sent"),
                () = std::future::ready(()) => {}
            }
            std::mem::forget(fut);
        }
        assert_eq!(rx.in_flight, 1);
        // The receiver refuses to touch the worker again; the sender's message is never taken.
        let src = [3u8; 64];
        let mut other = [0u8; 64];
        let t = Duration::from_millis(200);
        let srcs = [&src[..]];
        let mut dsts = [&mut other[..]];
        let (s, r) = tokio::join!(tx.send_all(1, &srcs, t), rx.recv_all(1, &mut dsts, t));
        assert!(matches!(r, Err(Error::Broken)), "{r:?}");
        assert!(s.is_err());
        assert_eq!(other, [0u8; 64]);
    }
}
