//! Same-host backend: the frame protocol runs over a unix socket (the doorbell), while layer
//! payload goes through a shared-memory ring of `slots` slots of `slot_bytes` each.
//!
//! After the usual handshake, the receiver creates the ring file (random name, mode 0600,
//! see the `mapping` module) and sends `SETUP` (80 bytes: slots u32, reserved u32, slot_bytes u64,
//! name_len u8, name [u8; 63]); the sender maps it and answers `READY` (8 bytes: status u8,
//! reserved [u8; 7]); the receiver then unlinks the file. Per layer the sender writes the
//! LAYER header on the socket, copies the regions into slots (round robin) and rings a CHUNK
//! doorbell per filled slot; the receiver copies each chunk straight into the sink regions
//! and returns the slot with a CREDIT.
//!
//! Invariants: a slot is written by the sender only between receiving its CREDIT (or
//! initially) and ringing its CHUNK, and read by the receiver only between that CHUNK and
//! its CREDIT; chunks never span two layers; CHUNK slot numbers and lengths are validated
//! before any access; every socket wait is bounded by a timeout.

pub(crate) mod mapping;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::api::{KvReceiver, KvSender, TransferReceipt};
use crate::config::{Timeouts, TransferConfig};
use crate::error::{Error, Result};
use crate::handshake;
use crate::layout::{KvLayout, TransferDesc};
use crate::protocol::frame::{FrameHeader, Verdict, TAG_CHUNK, TAG_CREDIT, VERDICT_FIXED_LEN};
use crate::protocol::send::{ReceiverCore, SenderCore};
use crate::protocol::transport::FrameTransport;
use crate::protocol::{HEADER_LEN, IDLE, MAX_REASON_LEN};
use crate::sink::KvSink;
use mapping::ShmMapping;

const SETUP_LEN: usize = 80;
const READY_LEN: usize = 8;
/// Largest slot count a receiver may ask for.
pub const MAX_SLOTS: u32 = 64;
/// Smallest / largest slot size.
pub const SLOT_BYTES_RANGE: (usize, usize) = (4096, 1 << 30);

/// Shared-memory ring options (chosen by the receiver).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmOptions {
    /// Directory of the ring file; both sides must use the same one.
    pub dir: PathBuf,
    /// Number of slots (>= 2 lets copy-in and copy-out overlap).
    pub slots: u32,
    /// Bytes per slot.
    pub slot_bytes: usize,
}

impl Default for ShmOptions {
    fn default() -> Self {
        let shm = Path::new("/dev/shm");
        ShmOptions {
            dir: if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            },
            slots: 8,
            slot_bytes: 1 << 20,
        }
    }
}

impl ShmOptions {
    fn validate(&self) -> Result<()> {
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(Error::InvalidArgument(format!(
                "shm slots must be 1..={MAX_SLOTS}"
            )));
        }
        if self.slot_bytes < SLOT_BYTES_RANGE.0 || self.slot_bytes > SLOT_BYTES_RANGE.1 {
            return Err(Error::InvalidArgument(format!(
                "shm slot_bytes must be {}..={}",
                SLOT_BYTES_RANGE.0, SLOT_BYTES_RANGE.1
            )));
        }
        Ok(())
    }

    fn ring_len(&self) -> Result<usize> {
        (self.slots as usize)
            .checked_mul(self.slot_bytes)
            .ok_or_else(|| Error::InvalidArgument("shm ring size overflows".into()))
    }
}

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

/// [`FrameTransport`] over a unix socket plus the shared ring.
#[derive(Debug)]
pub(crate) struct ShmTransport {
    sock: UnixStream,
    t: Timeouts,
    map: ShmMapping,
    slots: u32,
    slot_bytes: usize,
    // Receiver side: the chunk being consumed.
    rx_slot: u32,
    rx_off: usize,
    rx_rem: usize,
    rx_seq: u64,
    // Sender side: slot sequence numbers filled / credited.
    tx_seq: u64,
    tx_credited: u64,
}

impl ShmTransport {
    fn new(sock: UnixStream, t: Timeouts, map: ShmMapping, opts: &ShmOptions) -> Self {
        ShmTransport {
            sock,
            t,
            map,
            slots: opts.slots,
            slot_bytes: opts.slot_bytes,
            rx_slot: 0,
            rx_off: 0,
            rx_rem: 0,
            rx_seq: 0,
            tx_seq: 0,
            tx_credited: 0,
        }
    }

    fn slot_of(&self, seq: u64) -> u32 {
        (seq % u64::from(self.slots)) as u32
    }

    async fn sock_read(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        bounded(self.t.io, during, self.sock.read_exact(buf)).await?;
        Ok(())
    }

    async fn sock_write(&mut self, buf: &[u8], during: &'static str) -> Result<()> {
        bounded(self.t.io, during, self.sock.write_all(buf)).await
    }

    /// Reads a VERDICT body after `hdr` and turns it into the sender-side error.
    async fn verdict_error(&mut self, hdr: &[u8; HEADER_LEN]) -> Error {
        let h = match FrameHeader::decode(hdr) {
            Ok(h) => h,
            Err(e) => return e,
        };
        let n = match Verdict::body_len(&h) {
            Ok(n) => n,
            Err(e) => return e,
        };
        let mut body = [0u8; VERDICT_FIXED_LEN + MAX_REASON_LEN];
        if let Err(e) = self.sock_read(&mut body[..n], "reading the verdict").await {
            return e;
        }
        match Verdict::decode_body(&body[..n]) {
            Ok(Verdict {
                error: Some(class),
                reason,
                ..
            }) => Error::Rejected { class, reason },
            Ok(_) => Error::malformed("VERDICT", "success before END"),
            Err(e) => e,
        }
    }

    /// Sender: accounts one CREDIT header.
    fn take_credit(&mut self, h: &FrameHeader) -> Result<()> {
        if h.len != 0 || h.crc() || self.tx_credited >= self.tx_seq {
            return Err(Error::malformed("CREDIT", "unexpected credit"));
        }
        if h.arg != self.slot_of(self.tx_credited) {
            return Err(Error::malformed("CREDIT", "slots credited out of order"));
        }
        self.tx_credited += 1;
        Ok(())
    }

    /// Sender: waits until a slot is free.
    async fn wait_slot(&mut self) -> Result<()> {
        while self.tx_seq - self.tx_credited >= u64::from(self.slots) {
            let mut hdr = [0u8; HEADER_LEN];
            self.sock_read(&mut hdr, "waiting for a free shm slot")
                .await?;
            let h = FrameHeader::decode(&hdr)?;
            if h.tag == TAG_CREDIT {
                self.take_credit(&h)?;
            } else {
                return Err(self.verdict_error(&hdr).await);
            }
        }
        Ok(())
    }

    /// Sender: rings the doorbell for the slot being filled.
    async fn ring(&mut self, len: usize) -> Result<()> {
        let slot = self.slot_of(self.tx_seq);
        let h = FrameHeader::new(TAG_CHUNK, false, slot, len as u64).encode();
        self.sock_write(&h, "ringing the shm doorbell").await?;
        self.tx_seq += 1;
        Ok(())
    }
}

impl FrameTransport for ShmTransport {
    async fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        let n = bounded(self.t.idle, IDLE, self.sock.read(&mut buf[..1])).await?;
        if n == 0 {
            return Err(Error::PeerClosed { during: IDLE });
        }
        self.read_ctl(&mut buf[1..], "reading a frame header").await
    }

    async fn read_ctl(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        if self.rx_rem != 0 {
            return Err(Error::malformed(
                "CHUNK",
                "chunk extends past the layer payload",
            ));
        }
        self.sock_read(buf, during).await
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        let mut filled = 0;
        while filled < dst.len() {
            if self.rx_rem == 0 {
                let mut hdr = [0u8; HEADER_LEN];
                self.sock_read(&mut hdr, "waiting for a shm doorbell")
                    .await?;
                let h = FrameHeader::decode(&hdr)?;
                if h.tag != TAG_CHUNK {
                    return Err(Error::UnexpectedFrame {
                        expected: "CHUNK",
                        tag: h.tag,
                    });
                }
                if h.crc() || h.arg != self.slot_of(self.rx_seq) {
                    return Err(Error::malformed("CHUNK", "wrong slot or flags"));
                }
                if h.len == 0 || h.len > self.slot_bytes as u64 {
                    return Err(Error::Oversized {
                        what: "shm chunk",
                        len: h.len,
                        limit: self.slot_bytes as u64,
                    });
                }
                self.rx_slot = h.arg;
                self.rx_off = 0;
                self.rx_rem = h.len as usize;
            }
            let n = self.rx_rem.min(dst.len() - filled);
            let at = self.rx_slot as usize * self.slot_bytes + self.rx_off;
            self.map.read_at(at, &mut dst[filled..filled + n])?;
            filled += n;
            self.rx_off += n;
            self.rx_rem -= n;
            if self.rx_rem == 0 {
                let credit = FrameHeader::new(TAG_CREDIT, false, self.rx_slot, 0).encode();
                self.sock_write(&credit, "returning a shm slot").await?;
                self.rx_seq += 1;
            }
        }
        Ok(())
    }

    async fn write_ctl(&mut self, buf: &[u8], during: &'static str) -> Result<()> {
        self.sock_write(buf, during).await
    }

    async fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; 4]>,
    ) -> Result<()> {
        self.sock_write(header, "sending a layer header").await?;
        let mut fill = 0usize;
        for region in k.iter().chain(v) {
            let mut src = region.as_ref();
            while !src.is_empty() {
                if fill == 0 {
                    self.wait_slot().await?;
                }
                let n = (self.slot_bytes - fill).min(src.len());
                let at = self.slot_of(self.tx_seq) as usize * self.slot_bytes + fill;
                self.map.write_at(at, &src[..n])?;
                fill += n;
                src = &src[n..];
                if fill == self.slot_bytes {
                    self.ring(fill).await?;
                    fill = 0;
                }
            }
        }
        if fill > 0 {
            self.ring(fill).await?;
        }
        if let Some(t) = trailer {
            self.sock_write(&t, "sending a crc32c trailer").await?;
        }
        Ok(())
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        loop {
            self.sock_read(buf, "waiting for the verdict").await?;
            let h = FrameHeader::decode(buf)?;
            if h.tag != TAG_CREDIT {
                return Ok(());
            }
            self.take_credit(&h)?;
        }
    }

    async fn poll_early_reply(&mut self, _buf: &mut [u8; HEADER_LEN]) -> Result<bool> {
        // Early rejections surface while waiting for slot credits.
        Ok(false)
    }

    async fn shutdown_and_drain(&mut self) {
        let _ = self.sock.shutdown().await;
        let mut scratch = [0u8; 4096];
        let sock = &mut self.sock;
        let _ = tokio::time::timeout(self.t.drain, async move {
            while let Ok(n) = sock.read(&mut scratch).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }
}

/// Accepts same-host connections on a unix socket (decode side).
#[derive(Debug)]
pub struct ShmReceiver {
    listener: UnixListener,
    path: PathBuf,
    cfg: TransferConfig,
    opts: ShmOptions,
}

impl ShmReceiver {
    /// Binds the doorbell socket at `path` (which must not exist).
    pub fn bind(path: impl AsRef<Path>, cfg: TransferConfig, opts: ShmOptions) -> Result<Self> {
        opts.validate()?;
        let path = path.as_ref().to_path_buf();
        let listener =
            UnixListener::bind(&path).map_err(|e| Error::io("binding the unix socket", e))?;
        Ok(ShmReceiver {
            listener,
            path,
            cfg,
            opts,
        })
    }

    /// The socket path senders connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts one connection, authenticates it and sets up its ring.
    pub async fn accept(&self) -> Result<ShmInbound> {
        let t = self.cfg.timeouts;
        let (mut sock, _) =
            bounded(t.idle, "waiting for a connection", self.listener.accept()).await?;
        handshake::server(&mut sock, &self.cfg.layout, &self.cfg.secret, t.handshake).await?;
        let (mut map, name) = ShmMapping::create(&self.opts.dir, self.opts.ring_len()?)?;
        let mut setup = [0u8; SETUP_LEN];
        setup[0..4].copy_from_slice(&self.opts.slots.to_le_bytes());
        setup[8..16].copy_from_slice(&(self.opts.slot_bytes as u64).to_le_bytes());
        setup[16] = name.len() as u8;
        setup[17..17 + name.len()].copy_from_slice(name.as_bytes());
        bounded(t.handshake, "sending shm setup", sock.write_all(&setup)).await?;
        let mut ready = [0u8; READY_LEN];
        let r = bounded(
            t.handshake,
            "waiting for shm ready",
            sock.read_exact(&mut ready),
        )
        .await;
        map.unlink();
        r?;
        if ready[0] != 0 {
            return Err(Error::BackendUnavailable {
                backend: "shm",
                reason: "the sender could not map the shared ring".into(),
            });
        }
        let io = ShmTransport::new(sock, t, map, &self.opts);
        Ok(ShmInbound {
            core: ReceiverCore::new(io, self.cfg.layout, self.cfg.checksum),
        })
    }
}

impl Drop for ShmReceiver {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// An authenticated same-host inbound connection.
#[derive(Debug)]
pub struct ShmInbound {
    core: ReceiverCore<ShmTransport>,
}

impl ShmInbound {
    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

impl KvReceiver for ShmInbound {
    async fn receive<S: KvSink + Send>(&mut self, sink: &mut S) -> Result<TransferReceipt> {
        self.core.receive(sink).await
    }
}

/// Same-host outbound connection (prefill side).
#[derive(Debug)]
pub struct ShmSender {
    core: SenderCore<ShmTransport>,
}

impl ShmSender {
    /// Connects to the receiver's socket, authenticates and maps its ring (found in `dir`).
    pub async fn connect(path: impl AsRef<Path>, cfg: &TransferConfig, dir: &Path) -> Result<Self> {
        let t = cfg.timeouts;
        let mut sock = bounded(t.connect, "connecting", UnixStream::connect(path.as_ref())).await?;
        handshake::client(&mut sock, &cfg.layout, &cfg.secret, t.handshake).await?;
        let mut setup = [0u8; SETUP_LEN];
        bounded(
            t.handshake,
            "reading shm setup",
            sock.read_exact(&mut setup),
        )
        .await?;
        let opened = parse_setup(&setup, dir).and_then(|(opts, name)| {
            let map = ShmMapping::open(dir, &name, opts.ring_len()?)?;
            Ok((opts, map))
        });
        let status = [u8::from(opened.is_err()), 0, 0, 0, 0, 0, 0, 0];
        bounded(t.handshake, "sending shm ready", sock.write_all(&status)).await?;
        let (opts, map) = opened?;
        Ok(ShmSender {
            core: SenderCore::new(
                ShmTransport::new(sock, t, map, &opts),
                cfg.layout,
                cfg.checksum,
            )
            .with_compression(cfg.compression),
        })
    }

    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }
}

fn parse_setup(b: &[u8; SETUP_LEN], dir: &Path) -> Result<(ShmOptions, String)> {
    let slots = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut sb = [0u8; 8];
    sb.copy_from_slice(&b[8..16]);
    let slot_bytes = usize::try_from(u64::from_le_bytes(sb))
        .map_err(|_| Error::malformed("shm setup", "slot size"))?;
    let name_len = usize::from(b[16]);
    if b[4..8].iter().any(|&x| x != 0) || name_len > SETUP_LEN - 17 {
        return Err(Error::malformed(
            "shm setup",
            "reserved bytes or name length",
        ));
    }
    let name = std::str::from_utf8(&b[17..17 + name_len])
        .map_err(|_| Error::malformed("shm setup", "name is not UTF-8"))?
        .to_string();
    let opts = ShmOptions {
        dir: dir.to_path_buf(),
        slots,
        slot_bytes,
    };
    opts.validate()
        .map_err(|_| Error::malformed("shm setup", "slot count or size out of range"))?;
    Ok((opts, name))
}

impl KvSender for ShmSender {
    async fn begin(&mut self, desc: TransferDesc) -> Result<()> {
        self.core.begin(desc).await
    }

    async fn send_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        layer: u32,
        k: &[R],
        v: &[R],
    ) -> Result<()> {
        self.core.send_layer(layer, k, v).await
    }

    async fn finish(&mut self) -> Result<TransferReceipt> {
        self.core.finish().await
    }

    async fn abort(&mut self) -> Result<()> {
        self.core.abort().await
    }
}
