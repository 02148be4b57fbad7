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
mod endpoints;
mod files;
mod frames;
mod host;
pub(crate) mod mapping;
mod memfd;
mod pull;

pub use arena::{ArenaBuf, SendArena, ARENA_ALIGN};
pub use endpoints::{ShmInbound, ShmReceiver, ShmSender, ShmSetup};
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
    FrameHeader, Verdict, MAC_LEN, TAG_CHUNK, TAG_CREDIT, TAG_PULL, TAG_PULLED, VERDICT_FIXED_LEN,
};
use crate::protocol::integrity::{sender_auth, FrameAuth};
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
        if h.len != 0 || h.mac() || self.tx_credited >= self.tx_seq {
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
            if h.tag != TAG_PULL || h.mac() {
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
        trailer: Option<[u8; MAC_LEN]>,
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
        trailer: Option<[u8; MAC_LEN]>,
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
            Some(f) if h.len == 0 && !h.mac() && h.arg == f.count => {
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
