//! Same-host backend: the frame protocol runs over a unix socket (the doorbell), while layer
//! payload moves in one of two ways ([`ShmMode`]):
//!
//! - **pull** (preferred): the sender names its regions' addresses in a PULL frame and the
//!   receiver copies them straight into the reserved blocks with `process_vm_readv(2)`, one
//!   copy per byte (the `pull` module);
//! - **ring** (fallback when the sender's memory cannot be read, e.g. ptrace forbidden): a
//!   shared-memory ring of `slots` slots of `slot_bytes` each, copied in by the sender and
//!   out by the receiver. The ring file is mode 0600, so processes of different users cannot
//!   share it: their set-up fails (the workers then fall back to tcp, see `Connector`). A
//!   ring that will be used is backed with memory before the sender may write it, so a full
//!   directory fails the set-up instead of raising SIGBUS.
//!
//! After the usual handshake, the receiver creates the ring file (random name, mode 0600,
//! see the `mapping` module) and sends `SETUP` (80 bytes: slots u32, reserved u32, slot_bytes
//! u64, name_len u8, name [u8; 62], pull offered u8); the sender maps it and answers `READY`
//! (8 bytes: status u8, pull accepted u8, reserved [u8; 6]). When both offered pull, the
//! sender sends `OFFER` (32 bytes: address and length of a random nonce, the nonce) and the
//! receiver answers `MODE` (8 bytes: 1 pull when it could read that nonce from the sender's
//! pid, as the kernel reports it for the socket, else 0 ring). The receiver then unlinks the
//! file. Older peers ignore the offer bytes (senders never checked SETUP's name tail,
//! receivers never checked READY's reserved bytes), so mixed versions fall back to the ring.
//! A sender with a send arena (the `arena` module) sets READY byte 2; a receiver that
//! chose pull then sets MODE byte 1 (only then: older senders accept no other MODE), and the
//! sender sends `ARENA` (16 bytes: its address u64 and length u64, with the memfd attached as
//! `SCM_RIGHTS`). The receiver maps it read-only and copies every PULL whose regions all lie
//! in it with a memcpy; an arena it cannot use (size not sealed, wrong size) is logged and
//! pulled from with `process_vm_readv` as before.
//!
//! Ring: per layer the sender writes the LAYER header on the socket, copies the regions into
//! slots (round robin) and rings a CHUNK doorbell per filled slot; the receiver copies each
//! chunk straight into the sink regions and returns the slot with a CREDIT.
//! Pull: per layer, in one write, LAYER header, PULL (count, then address u64 + length u64
//! per run of adjacent regions) and the optional trailer; the receiver copies and answers
//! PULLED (echoing how many PULLs it has read) before it reads the trailer.
//!
//! Invariants: a slot is written by the sender only between receiving its CREDIT (or
//! initially) and ringing its CHUNK, and read by the receiver only between that CHUNK and
//! its CREDIT; chunks never span two layers; CHUNK slot numbers and lengths are validated
//! before any access; a PULL must cover exactly the layer payload; a sender's borrowed
//! `send_layer` returns only after its PULLED, and the owned buffers of `send_layer_bytes`
//! are held until theirs (at most `MAX_PULLS_IN_FLIGHT` layers ahead; PULLEDs answer in
//! order and are all in before the verdict), so regions outlive the copy; every socket wait
//! is bounded by a timeout.

mod arena;
mod files;
mod host;
pub(crate) mod mapping;
mod memfd;
mod pull;

pub use arena::{ArenaBuf, SendArena, ARENA_ALIGN};
pub use files::remove_stale;
pub use host::host_identity;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::config::{Timeouts, TransferConfig};
use crate::error::{Error, Result};
use crate::handshake;
use crate::layout::KvLayout;
use crate::protocol::frame::{
    FrameHeader, Verdict, TAG_CHUNK, TAG_CREDIT, TAG_PULL, TAG_PULLED, VERDICT_FIXED_LEN,
};
use crate::protocol::send::{ReceiverCore, SenderCore};
use crate::protocol::transport::FrameTransport;
use crate::protocol::{HEADER_LEN, IDLE, MAX_REASON_LEN};
use mapping::ShmMapping;

const SETUP_LEN: usize = 80;
/// SETUP byte saying the receiver offers pull mode (after the longest name).
const SETUP_PULL_AT: usize = SETUP_LEN - 1;
const READY_LEN: usize = 8;
/// READY byte saying the sender offers its send arena (pull mode only).
const READY_ARENA_AT: usize = 2;
/// ARENA body (sender → receiver, with the memfd as `SCM_RIGHTS`): address u64, length u64.
const ARENA_LEN: usize = pull::ENTRY_LEN;
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
    /// Offer pull mode (one copy through `process_vm_readv`); the ring is used when this is
    /// false or the sender's memory cannot be read.
    pub pull: bool,
}

/// How a connection moves layer payload (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShmMode {
    /// Through the shared ring: copied in by the sender, out by the receiver.
    Ring,
    /// Copied once by the receiver from the sender's memory.
    Pull,
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
            pull: true,
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
    mode: ShmMode,
    // Pull mode, receiver side: the peer's pid, the current PULL and what is left of the
    // layer payload; both sides: the reused PULL frame buffer.
    peer_pid: i32,
    cursor: pull::Cursor,
    layer_left: u64,
    pull_buf: Vec<u8>,
    /// PULL frames sent (sender) / read (receiver) on this connection; PULLED echoes the
    /// count (low 32 bits), so a sender never takes a stale PULLED for its current layer.
    pulls: u32,
    /// Sender: PULLs not answered yet, oldest first (PULLEDs come in order). Declared after
    /// `sock`, so it drops after it: when a broken connection goes, the socket closes before
    /// in-flight buffers return to their arena, and a receiver still copying one cannot
    /// answer PULLED for bytes that were meanwhile reused.
    in_flight: VecDeque<InFlight>,
    /// Receiver: the peer's send arena, mapped; sender: whether the peer has its arena.
    arena: Option<memfd::ArenaView>,
    arena_shared: bool,
    /// Receiver: layer PULLs copied from the arena view / read with `process_vm_readv`.
    pull_counts: ShmPulls,
}

/// Most owned layers (`send_layer_bytes`) a sender keeps in flight before it waits for the
/// receiver: enough to overlap one layer's round trip with the next layer's copy.
const MAX_PULLS_IN_FLIGHT: usize = 4;

/// A PULL sent and not answered yet, holding the owned regions it names (the receiver reads
/// them until it answers).
#[derive(Debug)]
struct InFlight {
    count: u32,
    _regions: Option<(Vec<Bytes>, Vec<Bytes>)>,
}

/// Layer PULLs a pull-mode connection has served, by where the bytes were read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShmPulls {
    /// Copied from the receiver's mapping of the sender's send arena (a memcpy).
    pub send_arena: u64,
    /// Read from the sender's ordinary memory with `process_vm_readv`.
    pub process_memory: u64,
}

impl ShmTransport {
    fn new(
        sock: UnixStream,
        t: Timeouts,
        map: ShmMapping,
        opts: &ShmOptions,
        mode: ShmMode,
        peer_pid: i32,
    ) -> Self {
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
            mode,
            peer_pid,
            cursor: pull::Cursor::default(),
            layer_left: 0,
            pull_buf: Vec::new(),
            pulls: 0,
            arena: None,
            arena_shared: false,
            pull_counts: ShmPulls::default(),
            in_flight: VecDeque::new(),
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

    /// Receiver, pull mode: fills `bufs` from the sender's regions, reading the layer's PULL
    /// first when none is loaded, and answers PULLED once the layer payload is complete.
    async fn pull_payload(&mut self, bufs: &mut [&mut [u8]]) -> Result<()> {
        let want: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        if want == 0 {
            return Ok(());
        }
        if want > self.layer_left {
            return Err(Error::malformed("LAYER", "payload longer than announced"));
        }
        if !self.cursor.loaded {
            let mut hdr = [0u8; HEADER_LEN];
            self.sock_read(&mut hdr, "waiting for a PULL").await?;
            let h = FrameHeader::decode(&hdr)?;
            if h.tag != TAG_PULL || h.crc() {
                return Err(Error::UnexpectedFrame {
                    expected: "PULL",
                    tag: h.tag,
                });
            }
            let n = pull::check_header(h.arg, h.len, self.layer_left)?;
            let mut body = std::mem::take(&mut self.pull_buf);
            body.resize(n, 0);
            let read = self.sock_read(&mut body, "reading a PULL").await;
            let parsed = read.and_then(|()| {
                pull::decode_regions(&body, self.layer_left, &mut self.cursor.regions)
            });
            self.pull_buf = body;
            parsed?;
            self.cursor.load(self.arena.as_ref());
            if self.cursor.in_arena {
                self.pull_counts.send_arena += 1;
            } else {
                self.pull_counts.process_memory += 1;
            }
            self.pulls = self.pulls.wrapping_add(1);
        }
        match &self.arena {
            Some(view) if self.cursor.in_arena => {
                pull::copy_from_arena(view, &mut self.cursor, bufs)?;
            }
            _ => pull::copy_into(self.peer_pid, &mut self.cursor, bufs)?,
        }
        self.layer_left -= want;
        if self.layer_left == 0 {
            let done = FrameHeader::new(TAG_PULLED, false, self.pulls, 0).encode();
            self.sock_write(&done, "answering PULLED").await?;
        }
        Ok(())
    }

    /// Sender, pull mode, borrowed regions: sends the layer, then waits until the receiver
    /// has copied it (and every earlier layer).
    async fn pull_layer<R: AsRef<[u8]>>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; 4]>,
    ) -> Result<()> {
        self.send_pull(header, k, v, trailer).await?;
        self.wait_pulled(0).await
    }

    /// Sender, pull mode: sends the LAYER header, the PULL naming the regions and the
    /// trailer in one write (one wake-up of the receiver instead of three), and records the
    /// PULL as in flight. Returns that record, for the caller to hand it owned regions to
    /// hold; `None` when no PULL went (a layer without payload has none).
    async fn send_pull<R: AsRef<[u8]>>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; 4]>,
    ) -> Result<Option<&mut InFlight>> {
        let mut frame = std::mem::take(&mut self.pull_buf);
        frame.clear();
        frame.extend_from_slice(header);
        frame.resize(2 * HEADER_LEN, 0);
        let runs = pull::encode_regions(k.iter().chain(v).map(|r| r.as_ref()), &mut frame);
        let h = FrameHeader::new(TAG_PULL, false, runs, (frame.len() - 2 * HEADER_LEN) as u64);
        frame[HEADER_LEN..2 * HEADER_LEN].copy_from_slice(&h.encode());
        if runs == 0 {
            // No payload, no PULL: the header and trailer alone.
            frame.truncate(HEADER_LEN);
        }
        if let Some(t) = trailer {
            frame.extend_from_slice(&t);
        }
        let sent = self
            .sock_write(&frame, "sending a layer and its PULL")
            .await;
        self.pull_buf = frame;
        sent?;
        if runs == 0 {
            return Ok(None);
        }
        self.pulls = self.pulls.wrapping_add(1);
        self.in_flight.push_back(InFlight {
            count: self.pulls,
            _regions: None,
        });
        Ok(self.in_flight.back_mut())
    }

    /// Sender: accounts one PULLED header, which must answer the oldest PULL in flight.
    fn take_pulled(&mut self, h: &FrameHeader) -> Result<()> {
        match self.in_flight.front() {
            Some(f) if h.len == 0 && !h.crc() && h.arg == f.count => {
                self.in_flight.pop_front();
                Ok(())
            }
            // E.g. the PULLED of a layer whose send was dropped before it arrived.
            _ => Err(Error::malformed(
                "PULLED",
                "does not answer the oldest PULL",
            )),
        }
    }

    /// Sender: reads PULLED answers until at most `keep` PULLs are in flight.
    async fn wait_pulled(&mut self, keep: usize) -> Result<()> {
        while self.in_flight.len() > keep {
            let mut hdr = [0u8; HEADER_LEN];
            self.sock_read(&mut hdr, "waiting for the receiver to pull a layer")
                .await?;
            let h = FrameHeader::decode(&hdr)?;
            if h.tag != TAG_PULLED {
                return Err(self.verdict_error(&hdr).await);
            }
            self.take_pulled(&h)?;
        }
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
        if self.cursor.loaded {
            return Err(Error::malformed(
                "PULL",
                "regions extend past the layer payload",
            ));
        }
        if self.rx_rem != 0 {
            return Err(Error::malformed(
                "CHUNK",
                "chunk extends past the layer payload",
            ));
        }
        self.sock_read(buf, during).await
    }

    async fn begin_payload(&mut self, len: u64) -> Result<()> {
        self.layer_left = len;
        Ok(())
    }

    async fn read_payload_vectored(&mut self, bufs: &mut [&mut [u8]]) -> Result<()> {
        if self.mode == ShmMode::Pull {
            return self.pull_payload(bufs).await;
        }
        for b in bufs.iter_mut() {
            self.read_payload(b).await?;
        }
        Ok(())
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        if self.mode == ShmMode::Pull {
            return self.pull_payload(&mut [dst]).await;
        }
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
        if self.mode == ShmMode::Pull {
            return self.pull_layer(header, k, v, trailer).await;
        }
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

    async fn write_layer_owned(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: Vec<Bytes>,
        v: Vec<Bytes>,
        trailer: Option<[u8; 4]>,
    ) -> Result<()> {
        if self.mode != ShmMode::Pull {
            return self.write_layer(header, &k, &v, trailer).await;
        }
        // Owned regions stay alive in `in_flight` until their PULLED: the next layer goes
        // out while the receiver still copies this one.
        if let Some(pull) = self.send_pull(header, &k, &v, trailer).await? {
            pull._regions = Some((k, v));
        }
        self.wait_pulled(MAX_PULLS_IN_FLIGHT).await
    }

    fn transfer_ended(&mut self) -> Result<()> {
        if self.in_flight.is_empty() {
            Ok(())
        } else {
            Err(Error::malformed(
                "VERDICT",
                "success while layers were still being pulled",
            ))
        }
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        loop {
            self.sock_read(buf, "waiting for the verdict").await?;
            let h = FrameHeader::decode(buf)?;
            match h.tag {
                TAG_CREDIT => self.take_credit(&h)?,
                TAG_PULLED => self.take_pulled(&h)?,
                _ => return Ok(()),
            }
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
    /// Binds the doorbell socket at `path` (which must not exist). The path names a
    /// listening socket from the moment it exists (see the `files` module).
    pub fn bind(path: impl AsRef<Path>, cfg: TransferConfig, opts: ShmOptions) -> Result<Self> {
        opts.validate()?;
        let path = path.as_ref().to_path_buf();
        let listener = files::bind_atomically(&path)?;
        Ok(ShmReceiver {
            listener,
            path,
            cfg,
            opts,
        })
    }

    /// A decode worker's receiver: first removes what dead receivers left in `opts.dir`
    /// ([`remove_stale`]), then binds a fresh socket `duet-sock-<tag>-<random>.sock` there.
    pub async fn bind_in(tag: &str, cfg: TransferConfig, opts: ShmOptions) -> Result<Self> {
        remove_stale(&opts.dir).await;
        let path = files::socket_path(&opts.dir, tag);
        ShmReceiver::bind(path, cfg, opts)
    }

    /// The socket path senders connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for one connection (bounded by the idle timeout); [`ShmSetup::run`] then
    /// authenticates it and sets up its ring, so a slow peer never holds up the accept loop.
    pub async fn accept_stream(&self) -> Result<UnixStream> {
        let (sock, _) = bounded(
            self.cfg.timeouts.idle,
            "waiting for a connection",
            self.listener.accept(),
        )
        .await?;
        Ok(sock)
    }

    /// What [`ShmSetup::run`] needs, detached from the listener (for a spawned task).
    pub fn setup(&self) -> ShmSetup {
        ShmSetup {
            cfg: self.cfg.clone(),
            opts: self.opts.clone(),
        }
    }

    /// Accepts one connection, authenticates it and sets up its ring.
    pub async fn accept(&self) -> Result<ShmInbound> {
        let sock = self.accept_stream().await?;
        self.setup().run(sock).await
    }
}

/// The receiver's side of a connection's set-up: handshake, ring, mode negotiation.
#[derive(Debug, Clone)]
pub struct ShmSetup {
    cfg: TransferConfig,
    opts: ShmOptions,
}

impl ShmSetup {
    /// Authenticates the peer on `sock` and sets up its ring (and pull mode when possible).
    pub async fn run(self, mut sock: UnixStream) -> Result<ShmInbound> {
        let t = self.cfg.timeouts;
        handshake::server(&mut sock, &self.cfg.layout, &self.cfg.secret, t.handshake).await?;
        let (mut map, name) = ShmMapping::create(&self.opts.dir, self.opts.ring_len()?)?;
        if !self.opts.pull {
            // Ring for sure: back it before the sender can write a slot.
            map.reserve()?;
        }
        let mut setup = [0u8; SETUP_LEN];
        setup[0..4].copy_from_slice(&self.opts.slots.to_le_bytes());
        setup[8..16].copy_from_slice(&(self.opts.slot_bytes as u64).to_le_bytes());
        setup[16] = name.len() as u8;
        setup[17..17 + name.len()].copy_from_slice(name.as_bytes());
        setup[SETUP_PULL_AT] = u8::from(self.opts.pull);
        bounded(t.handshake, "sending shm setup", sock.write_all(&setup)).await?;
        let r = negotiate(&mut sock, t.handshake, self.opts.pull, &map).await;
        map.unlink();
        let (mode, pid, arena) = r?;
        let mut io = ShmTransport::new(sock, t, map, &self.opts, mode, pid);
        io.arena = arena;
        Ok(ShmInbound {
            core: ReceiverCore::new(io, self.cfg.layout, self.cfg.checksum),
        })
    }
}

/// Receiver: reads READY and, when both sides offered pull, probes the sender's memory and
/// answers MODE; in pull mode, takes the sender's send arena when it offered one. Returns
/// the mode, the sender's pid and the arena's view. A ring that will be used is backed
/// with memory ([`ShmMapping::reserve`]) before MODE lets the sender write it (a sender that
/// declined pull may already be writing: only a full directory makes that matter).
async fn negotiate(
    sock: &mut UnixStream,
    t: Duration,
    offered: bool,
    map: &ShmMapping,
) -> Result<(ShmMode, i32, Option<memfd::ArenaView>)> {
    let mut ready = [0u8; READY_LEN];
    bounded(t, "waiting for shm ready", sock.read_exact(&mut ready)).await?;
    if ready[0] != 0 {
        return Err(Error::BackendUnavailable {
            backend: "shm",
            reason: "the sender could not map the shared ring".into(),
        });
    }
    if !(offered && ready[1] == 1) {
        if offered {
            map.reserve()?;
        }
        return Ok((ShmMode::Ring, 0, None));
    }
    let mut offer = [0u8; pull::OFFER_LEN];
    bounded(t, "reading the pull offer", sock.read_exact(&mut offer)).await?;
    let pid = sock.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
    let ok = pid > 0 && pull::probe(pid, &offer);
    if !ok {
        map.reserve()?;
    }
    // Only a sender that offered its arena (so knows this byte) is asked for it.
    let take_arena = ok && ready[READY_ARENA_AT] == 1;
    let mut mode = [0u8; pull::MODE_LEN];
    mode[0] = u8::from(ok);
    mode[1] = u8::from(take_arena);
    bounded(t, "sending the shm mode", sock.write_all(&mode)).await?;
    if !ok {
        return Ok((ShmMode::Ring, 0, None));
    }
    let arena = if take_arena {
        receive_arena(sock, t).await?
    } else {
        None
    };
    Ok((ShmMode::Pull, pid, arena))
}

/// Receiver: reads ARENA and maps the memfd that came with it. An unusable arena (no fd,
/// size not sealed, wrong size, refused mapping) is logged and left: every PULL is then
/// served with `process_vm_readv`, which needs nothing from the arena.
async fn receive_arena(sock: &mut UnixStream, t: Duration) -> Result<Option<memfd::ArenaView>> {
    let mut body = [0u8; ARENA_LEN];
    let fd = bounded(
        t,
        "reading the send arena",
        memfd::recv_with_fd(sock, &mut body),
    )
    .await?;
    let span = pull::decode_span(&body)
        .and_then(|(base, len)| Some((usize::try_from(base).ok()?, usize::try_from(len).ok()?)));
    let view = match (fd, span) {
        (Some(fd), Some((base, len))) => memfd::ArenaView::open(fd, base, len),
        _ => Err(Error::malformed(
            "shm arena",
            "no fd or an address beyond this host",
        )),
    };
    Ok(view
        .inspect_err(|e| tracing::warn!(error = %e, "peer's send arena unusable, pulling with process_vm_readv"))
        .ok())
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

    /// How this connection moves layer payload.
    pub fn mode(&self) -> ShmMode {
        self.core.transport().mode
    }

    /// The sender's send arena is mapped here: PULLs inside it are copied with a memcpy.
    pub fn arena_mapped(&self) -> bool {
        self.core.transport().arena.is_some()
    }

    /// Layer PULLs this connection has served, from the sender's arena (every region
    /// inside it) or with `process_vm_readv`.
    pub fn pulls(&self) -> ShmPulls {
        self.core.transport().pull_counts
    }
}

via_core!(receiver ShmInbound);

/// Same-host outbound connection (prefill side).
#[derive(Debug)]
pub struct ShmSender {
    core: SenderCore<ShmTransport>,
}

impl ShmSender {
    /// Connects to the receiver's socket, authenticates and maps its ring (found in `dir`).
    pub async fn connect(path: impl AsRef<Path>, cfg: &TransferConfig, dir: &Path) -> Result<Self> {
        Self::connect_with_arena(path, cfg, dir, None).await
    }

    /// [`connect`](Self::connect), offering `arena` to the receiver in pull mode: layers
    /// whose regions all lie in it are then copied by the receiver with a plain memcpy from
    /// its own mapping (see the `arena` module).
    pub async fn connect_with_arena(
        path: impl AsRef<Path>,
        cfg: &TransferConfig,
        dir: &Path,
        arena: Option<&Arc<SendArena>>,
    ) -> Result<Self> {
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
        let pull = opened.as_ref().is_ok_and(|(opts, _)| opts.pull);
        let offer_arena = pull && arena.is_some();
        let mut status = [0u8; READY_LEN];
        status[0] = u8::from(opened.is_err());
        status[1] = u8::from(pull);
        status[READY_ARENA_AT] = u8::from(offer_arena);
        bounded(t.handshake, "sending shm ready", sock.write_all(&status)).await?;
        let (opts, map) = opened?;
        let mut mode = ShmMode::Ring;
        let mut arena_shared = false;
        if pull {
            // The nonce must stay alive until the receiver has probed it (MODE).
            let probe = pull::Probe::new();
            let offer = probe.offer();
            bounded(
                t.handshake,
                "sending the pull offer",
                sock.write_all(&offer),
            )
            .await?;
            let mut m = [0u8; pull::MODE_LEN];
            bounded(t.handshake, "reading the shm mode", sock.read_exact(&mut m)).await?;
            drop(probe);
            (mode, arena_shared) = match m {
                [0, 0, 0, 0, 0, 0, 0, 0] => (ShmMode::Ring, false),
                [1, 0, 0, 0, 0, 0, 0, 0] => (ShmMode::Pull, false),
                [1, 1, 0, 0, 0, 0, 0, 0] if offer_arena => (ShmMode::Pull, true),
                _ => return Err(Error::malformed("shm mode", "unknown mode")),
            };
            if let (true, Some(arena)) = (arena_shared, arena) {
                let fd = arena.memfd();
                let body = pull::encode_span(fd.base(), fd.len());
                bounded(
                    t.handshake,
                    "sending the send arena",
                    memfd::send_with_fd(&mut sock, &body, fd.fd()),
                )
                .await?;
            }
        }
        let mut io = ShmTransport::new(sock, t, map, &opts, mode, 0);
        io.arena_shared = arena_shared;
        Ok(ShmSender {
            core: SenderCore::new(io, cfg.layout, cfg.checksum).with_compression(cfg.compression),
        })
    }

    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }

    /// How this connection moves layer payload.
    pub fn mode(&self) -> ShmMode {
        self.core.transport().mode
    }

    /// The receiver has this sender's send arena mapped (pull mode with an arena).
    pub fn arena_shared(&self) -> bool {
        self.core.transport().arena_shared
    }
}

fn parse_setup(b: &[u8; SETUP_LEN], dir: &Path) -> Result<(ShmOptions, String)> {
    let slots = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut sb = [0u8; 8];
    sb.copy_from_slice(&b[8..16]);
    let slot_bytes = usize::try_from(u64::from_le_bytes(sb))
        .map_err(|_| Error::malformed("shm setup", "slot size"))?;
    let name_len = usize::from(b[16]);
    if b[4..8].iter().any(|&x| x != 0) || 17 + name_len > SETUP_PULL_AT || b[SETUP_PULL_AT] > 1 {
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
        pull: b[SETUP_PULL_AT] == 1,
    };
    opts.validate()
        .map_err(|_| Error::malformed("shm setup", "slot count or size out of range"))?;
    Ok((opts, name))
}

via_core!(sender ShmSender);
