//! TCP backend (the default): one tokio `TcpStream` per connection, optionally K
//! connections per peer ([`connect_pool`]) carrying K transfers concurrently.
//!
//! Invariants:
//! - an uncompressed layer frame is written with `write_vectored` straight from the caller's
//!   region slices (header, K regions, V regions, trailer) using a fixed on-stack `IoSlice`
//!   array: no concatenation and no heap allocation per frame (a compressed one is written
//!   from the sender's reused staging buffer); with frame MACs on, each region is hashed
//!   just before the `writev` that sends it (batches of at most 256 KiB, still in cache);
//! - the receiver reads payload straight into the sink's region slices;
//! - every read and write is bounded by [`Timeouts::io`] (first byte of a transfer: `idle`),
//!   connect by `connect`, the handshake by `handshake`;
//! - [`TcpInbound`] exists only after a successful handshake.

use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

use crate::config::{Timeouts, TransferConfig};
use crate::error::{Error, Result};
use crate::handshake;
use crate::layout::KvLayout;
use crate::protocol::frame::MAC_LEN;
use crate::protocol::integrity::{sender_auth, FrameAuth, FrameMac, SessionKey};
use crate::protocol::receive::MAC_GROUP_BYTES;
use crate::protocol::send::{ReceiverCore, SenderCore};
use crate::protocol::transport::FrameTransport;
use crate::protocol::{HEADER_LEN, IDLE};

/// Most `IoSlice`s handed to one `writev` call.
const MAX_IOV: usize = 64;
/// Most bytes discarded while draining after an error.
const MAX_DRAIN_BYTES: u64 = 256 << 20;

async fn bounded<T>(
    t: Duration,
    during: &'static str,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(t, f).await {
        Err(_) => Err(Error::Timeout { during, after: t }),
        Ok(r) => r.map_err(|e| Error::io(during, e)),
    }
}

/// [`FrameTransport`] over a TCP stream.
#[derive(Debug)]
pub(crate) struct TcpTransport {
    stream: TcpStream,
    t: Timeouts,
    /// The frame key the handshake gave this connection.
    pub(crate) key: SessionKey,
}

impl TcpTransport {
    /// Resolves when the peer closed the connection (EOF or an error), never because data
    /// arrived: lets a transport that moves payload elsewhere (rdma) notice a vanished peer.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) async fn closed(&self) {
        let mut one = [0u8; 1];
        match self.stream.peek(&mut one).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }

    /// Resolves when the peer sent something (a reply) or closed the connection.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) async fn replied(&self) {
        let mut one = [0u8; 1];
        let _ = self.stream.peek(&mut one).await;
    }
}

impl TcpTransport {
    /// Writes header, K regions, V regions and `tail` with `writev`, never concatenating.
    /// With `mac`, each region is hashed when it first joins a batch, and batches hold at
    /// most [`MAC_GROUP_BYTES`] so that it is still in cache when the kernel copies it.
    async fn write_parts<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        tail: &[u8],
        mut mac: Option<&mut FrameMac>,
    ) -> Result<()> {
        let parts = 2 + k.len() + v.len();
        let cap = if mac.is_some() {
            MAC_GROUP_BYTES
        } else {
            usize::MAX
        };
        // Parts below `hashed` went into the MAC already (header and tail never do).
        let mut hashed = 1usize;
        let (mut idx, mut off) = (0usize, 0usize);
        while idx < parts {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let (mut cnt, mut bytes) = (0, 0usize);
            let (mut j, mut o) = (idx, off);
            while cnt < MAX_IOV && j < parts && (cnt == 0 || bytes < cap) {
                let p = part(j, header, k, v, tail);
                if o < p.len() {
                    iov[cnt] = IoSlice::new(&p[o..]);
                    cnt += 1;
                    bytes += p.len() - o;
                }
                if let Some(m) = mac.as_deref_mut() {
                    if j == hashed && j < parts - 1 {
                        m.update(p);
                        hashed += 1;
                    }
                }
                j += 1;
                o = 0;
            }
            if cnt == 0 {
                break;
            }
            let mut left = bounded(
                self.t.io,
                "sending a layer",
                self.stream.write_vectored(&iov[..cnt]),
            )
            .await?;
            if left == 0 {
                return Err(Error::PeerClosed {
                    during: "sending a layer",
                });
            }
            while left > 0 && idx < parts {
                let avail = part(idx, header, k, v, tail).len() - off;
                if left >= avail {
                    left -= avail;
                    idx += 1;
                    off = 0;
                } else {
                    off += left;
                    left = 0;
                }
            }
        }
        Ok(())
    }
}

fn part<'a, R: AsRef<[u8]>>(
    i: usize,
    header: &'a [u8],
    k: &'a [R],
    v: &'a [R],
    trailer: &'a [u8],
) -> &'a [u8] {
    // Parts: header, every K region, every V region (the two lists may differ in length:
    // a compressed layer is one staged buffer), trailer.
    let (nk, nv) = (k.len(), v.len());
    let empty: &[u8] = &[];
    if i == 0 {
        header
    } else if i <= nk {
        k.get(i - 1).map_or(empty, AsRef::as_ref)
    } else if i <= nk + nv {
        v.get(i - 1 - nk).map_or(empty, AsRef::as_ref)
    } else {
        trailer
    }
}

impl FrameTransport for TcpTransport {
    async fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        let n = bounded(self.t.idle, IDLE, self.stream.read(&mut buf[..1])).await?;
        if n == 0 {
            return Err(Error::PeerClosed { during: IDLE });
        }
        self.read_ctl(&mut buf[1..], "reading a frame header").await
    }

    async fn read_ctl(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        bounded(self.t.io, during, self.stream.read_exact(buf)).await?;
        Ok(())
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        self.read_ctl(dst, "reading layer payload").await
    }

    async fn read_payload_vectored(&mut self, bufs: &mut [&mut [u8]]) -> Result<()> {
        const DURING: &str = "reading layer payload";
        let (mut idx, mut off) = (0usize, 0usize);
        while idx < bufs.len() {
            let mut got = {
                let mut iov: [IoSliceMut<'_>; MAX_IOV] =
                    std::array::from_fn(|_| IoSliceMut::new(&mut []));
                let mut cnt = 0;
                for (i, b) in bufs[idx..].iter_mut().enumerate() {
                    if cnt == MAX_IOV {
                        break;
                    }
                    let start = if i == 0 { off } else { 0 };
                    if let Some(rest) = b.get_mut(start..).filter(|r| !r.is_empty()) {
                        iov[cnt] = IoSliceMut::new(rest);
                        cnt += 1;
                    }
                }
                if cnt == 0 {
                    return Ok(());
                }
                loop {
                    bounded(self.t.io, DURING, self.stream.readable()).await?;
                    match self.stream.try_read_vectored(&mut iov[..cnt]) {
                        Ok(0) => return Err(Error::PeerClosed { during: DURING }),
                        Ok(n) => break n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(e) => return Err(Error::io(DURING, e)),
                    }
                }
            };
            while got > 0 && idx < bufs.len() {
                let avail = bufs[idx].len() - off;
                if got >= avail {
                    got -= avail;
                    idx += 1;
                    off = 0;
                } else {
                    off += got;
                    got = 0;
                }
            }
            while idx < bufs.len() && bufs[idx].len() == off {
                idx += 1;
                off = 0;
            }
        }
        Ok(())
    }

    async fn write_ctl(&mut self, buf: &[u8], during: &'static str) -> Result<()> {
        bounded(self.t.io, during, self.stream.write_all(buf)).await
    }

    async fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; MAC_LEN]>,
    ) -> Result<()> {
        let tr = trailer.unwrap_or_default();
        let tr: &[u8] = if trailer.is_some() { &tr } else { &[] };
        self.write_parts(header, k, v, tr, None).await
    }

    /// Hashes each region just before the `writev` that sends it (batches of at most
    /// `MAC_GROUP_BYTES`, so the bytes are still in cache when the kernel copies them), then
    /// sends the trailer.
    async fn write_layer_mac<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        mac: Option<FrameMac>,
    ) -> Result<()> {
        let Some(mut mac) = mac else {
            return self.write_parts(header, k, v, &[], None).await;
        };
        self.write_parts(header, k, v, &[], Some(&mut mac)).await?;
        let t = mac.finish();
        self.write_ctl(&t, "sending a MAC trailer").await
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        self.read_ctl(buf, "waiting for the verdict").await
    }

    async fn poll_early_reply(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<bool> {
        match self.stream.try_read(buf) {
            Ok(0) => Err(Error::PeerClosed {
                during: "sending a transfer",
            }),
            Ok(n) => {
                self.read_ctl(&mut buf[n..], "reading the verdict").await?;
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(Error::io("sending a transfer", e)),
        }
    }

    async fn shutdown_and_drain(&mut self) {
        let _ = self.stream.shutdown().await;
        let mut scratch = vec![0u8; 64 * 1024];
        let stream = &mut self.stream;
        let _ = tokio::time::timeout(self.t.drain, async move {
            let mut total = 0u64;
            while total < MAX_DRAIN_BYTES {
                match stream.read(&mut scratch).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n as u64,
                }
            }
        })
        .await;
    }
}

/// Connects and authenticates; the raw transport (used by backends that reuse TCP as their
/// control channel).
pub(crate) async fn connect_transport(
    addr: impl ToSocketAddrs,
    cfg: &TransferConfig,
) -> Result<TcpTransport> {
    let t = cfg.timeouts;
    let mut stream = bounded(t.connect, "connecting", TcpStream::connect(addr)).await?;
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("configuring the socket", e))?;
    let key = handshake::client(&mut stream, &cfg.layout, &cfg.secret, t.handshake).await?;
    Ok(TcpTransport { stream, t, key })
}

/// Accepts one connection on `listener` (waiting up to `timeouts.idle`) and runs the receiver
/// handshake on it: the control channel of the nccl and rdma backends.
#[cfg_attr(not(any(feature = "nccl", feature = "rdma")), allow(dead_code))]
pub(crate) async fn accept_authenticated(
    listener: &TcpListener,
    cfg: &TransferConfig,
) -> Result<TcpTransport> {
    let (stream, _) = accept_idle(listener, cfg).await?;
    accept_transport(stream, cfg).await
}

/// The next connection on `listener`, waiting up to `cfg.timeouts.idle`; not yet
/// authenticated.
pub(crate) async fn accept_idle(
    listener: &TcpListener,
    cfg: &TransferConfig,
) -> Result<(TcpStream, SocketAddr)> {
    bounded(
        cfg.timeouts.idle,
        "waiting for a connection",
        listener.accept(),
    )
    .await
}

/// Runs the receiver handshake on an accepted stream; the raw transport.
pub(crate) async fn accept_transport(
    mut stream: TcpStream,
    cfg: &TransferConfig,
) -> Result<TcpTransport> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("configuring the socket", e))?;
    let key = handshake::server(
        &mut stream,
        &cfg.layout,
        &cfg.secret,
        cfg.timeouts.handshake,
    )
    .await?;
    Ok(TcpTransport {
        stream,
        t: cfg.timeouts,
        key,
    })
}

/// Accepts authenticated inbound connections (decode side).
#[derive(Debug)]
pub struct TcpReceiver {
    listener: TcpListener,
    cfg: TransferConfig,
}

impl TcpReceiver {
    /// Serves on an already bound listener (bind `127.0.0.1:0` in tests).
    pub fn new(listener: TcpListener, cfg: TransferConfig) -> Self {
        TcpReceiver { listener, cfg }
    }

    /// Address the listener is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::io("reading the listener address", e))
    }

    /// Accepts one TCP connection (waiting up to `timeouts.idle`) without the handshake;
    /// finish it with [`TcpInbound::handshake`], typically in a spawned task.
    pub async fn accept_stream(&self) -> Result<(TcpStream, SocketAddr)> {
        accept_idle(&self.listener, &self.cfg).await
    }

    /// Accepts one connection and runs the handshake on it.
    pub async fn accept(&self) -> Result<TcpInbound> {
        let (stream, peer) = self.accept_stream().await?;
        TcpInbound::handshake(stream, peer, &self.cfg).await
    }

    /// This receiver's configuration.
    pub fn config(&self) -> &TransferConfig {
        &self.cfg
    }
}

/// An authenticated inbound connection; receives transfers into a [`KvSink`].
#[derive(Debug)]
pub struct TcpInbound {
    core: ReceiverCore<TcpTransport>,
    peer: SocketAddr,
}

impl TcpInbound {
    /// Runs the receiver side of the handshake on an accepted stream.
    pub async fn handshake(
        stream: TcpStream,
        peer: SocketAddr,
        cfg: &TransferConfig,
    ) -> Result<TcpInbound> {
        let io = accept_transport(stream, cfg).await?;
        let auth = FrameAuth::new(&io.key);
        Ok(TcpInbound {
            core: ReceiverCore::new(io, cfg.layout, auth, cfg.integrity.on()),
            peer,
        })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

via_core!(receiver TcpInbound);

/// Outbound connection (prefill side).
#[derive(Debug)]
pub struct TcpSender {
    core: SenderCore<TcpTransport>,
}

impl TcpSender {
    /// Connects to `addr` and authenticates.
    pub async fn connect(addr: impl ToSocketAddrs, cfg: &TransferConfig) -> Result<TcpSender> {
        let io = connect_transport(addr, cfg).await?;
        let auth = sender_auth(cfg.integrity, &io.key);
        Ok(TcpSender {
            core: SenderCore::new(io, cfg.layout, auth).configured(cfg),
        })
    }

    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

/// Opens `k` authenticated connections to the same receiver; use one per concurrent
/// transfer (the receiver accepts each and serves it in its own task).
pub async fn connect_pool(
    addr: SocketAddr,
    cfg: &TransferConfig,
    k: usize,
) -> Result<Vec<TcpSender>> {
    if k == 0 {
        return Err(Error::InvalidArgument(
            "pool size must be at least 1".into(),
        ));
    }
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        out.push(TcpSender::connect(addr, cfg).await?);
    }
    Ok(out)
}

via_core!(sender TcpSender);
