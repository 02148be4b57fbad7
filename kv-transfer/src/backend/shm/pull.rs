//! Pull mode of the shm backend: one copy per byte instead of two. The sender lists the
//! addresses of a layer's regions in a PULL frame; the receiver copies them straight into the
//! reserved blocks with `process_vm_readv(2)` (cross-memory attach) and answers PULLED; only
//! then does the sender's `send_layer` return, so its regions outlive the copy. When every
//! region of a PULL lies in the sender's send arena (mapped here, see `arena`), the receiver
//! copies it from that mapping with a memcpy instead (no page pinning).
//!
//! Why: through the ring every byte is copied in by the sender and out by the receiver, and
//! the copy out reads cache lines another core has just written; here the kernel reads the
//! sender's pages once, straight into the destination blocks.
//!
//! Invariants: the receiver writes only into the sink regions it was handed (the local side of
//! the syscall); a PULL's region count is bounded before anything is allocated and its lengths
//! must add up to exactly the announced layer payload; the addresses come from the peer and are
//! only ever read in the peer's address space (or, inside its arena, in this side's read-only
//! view of those pages), so a wrong one fails the transfer (EFAULT, or an out-of-arena
//! error) or copies the peer's own bytes, and can hurt nobody but the peer. Pull mode is chosen at setup only when the receiver could read
//! the sender's nonce this way (same user, ptrace allowed); otherwise the ring is used.

use super::memfd::ArenaView;
use crate::error::{Error, Result};
use crate::layout::MAX_BLOCKS_PER_TRANSFER;

/// OFFER body (sender → receiver, after READY): probe address u64, probe length u64, nonce.
pub(crate) const OFFER_LEN: usize = 32;
/// MODE body (receiver → sender): mode u8 (0 ring, 1 pull), reserved.
pub(crate) const MODE_LEN: usize = 8;
/// One PULL entry: address u64, length u64.
pub(crate) const ENTRY_LEN: usize = 16;
/// Most regions one PULL may list (K and V of every block of the largest transfer).
pub(crate) const MAX_REGIONS: u64 = 2 * MAX_BLOCKS_PER_TRANSFER as u64;
/// Iovecs per syscall (below every kernel's IOV_MAX of 1024).
const IOV_BATCH: usize = 512;
const NONCE_LEN: usize = 16;

/// A remote region: address and length in the sender's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

/// An address and a length as PULL entries, OFFER and ARENA carry them: two u64,
/// little-endian.
pub(crate) fn encode_span(addr: usize, len: usize) -> [u8; ENTRY_LEN] {
    let mut b = [0u8; ENTRY_LEN];
    b[..8].copy_from_slice(&(addr as u64).to_le_bytes());
    b[8..].copy_from_slice(&(len as u64).to_le_bytes());
    b
}

/// The address and length of the [`encode_span`] encoding `b` starts with (`None` when it
/// is shorter).
pub(crate) fn decode_span(b: &[u8]) -> Option<(u64, u64)> {
    let (addr, rest) = b.split_first_chunk::<8>()?;
    let (len, _) = rest.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*addr), u64::from_le_bytes(*len)))
}

/// Appends the PULL entries for `regions` to `out`, merging regions that are adjacent in
/// memory (a prefill worker's layer buffer is usually one run). Returns the entry count.
pub(crate) fn encode_regions<'r>(
    regions: impl Iterator<Item = &'r [u8]>,
    out: &mut Vec<u8>,
) -> u32 {
    let mut runs: u32 = 0;
    let mut cur: Option<Region> = None;
    let flush = |r: Region, out: &mut Vec<u8>, runs: &mut u32| {
        out.extend_from_slice(&encode_span(r.addr, r.len));
        *runs += 1;
    };
    for s in regions.filter(|s| !s.is_empty()) {
        let addr = s.as_ptr() as usize;
        match cur {
            Some(ref mut c) if c.addr + c.len == addr => c.len += s.len(),
            Some(c) => {
                flush(c, out, &mut runs);
                cur = Some(Region { addr, len: s.len() });
            }
            None => cur = Some(Region { addr, len: s.len() }),
        }
    }
    if let Some(c) = cur {
        flush(c, out, &mut runs);
    }
    runs
}

/// Checks a PULL header's count and body length against the announced payload before the
/// body is read (so a hostile count allocates nothing).
pub(crate) fn check_header(count: u32, body_len: u64, payload: u64) -> Result<usize> {
    let count = u64::from(count);
    if count == 0 || count > MAX_REGIONS || count > payload {
        return Err(Error::malformed("PULL", "region count out of range"));
    }
    if body_len != count * ENTRY_LEN as u64 {
        return Err(Error::malformed("PULL", "body length is not count x 16"));
    }
    Ok(body_len as usize)
}

/// Parses a PULL body into `out`; the lengths must add up to exactly `payload`.
pub(crate) fn decode_regions(body: &[u8], payload: u64, out: &mut Vec<Region>) -> Result<()> {
    out.clear();
    let mut total: u64 = 0;
    for e in body.chunks_exact(ENTRY_LEN) {
        let Some((addr, len)) = decode_span(e) else {
            return Err(Error::malformed("PULL", "short entry"));
        };
        let end = addr.checked_add(len);
        if len == 0 || end.is_none() {
            return Err(Error::malformed("PULL", "empty or wrapping region"));
        }
        total = total.saturating_add(len);
        if total > payload {
            return Err(Error::malformed("PULL", "regions exceed the layer payload"));
        }
        let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(Error::malformed("PULL", "region beyond the address space"));
        };
        out.push(Region { addr, len });
    }
    if total != payload {
        return Err(Error::malformed(
            "PULL",
            "regions do not cover the layer payload",
        ));
    }
    Ok(())
}

/// Where the receiver is in the current PULL's region list.
#[derive(Debug, Default)]
pub(crate) struct Cursor {
    pub(crate) regions: Vec<Region>,
    idx: usize,
    off: usize,
    /// True between reading a PULL and copying its last byte.
    pub(crate) loaded: bool,
    /// Every region of the loaded PULL lies in the peer's send arena (copied from the
    /// receiver's view of it, not with `process_vm_readv`).
    pub(crate) in_arena: bool,
}

impl Cursor {
    /// Starts on the regions just decoded; `arena` is the peer's send arena, if mapped.
    pub(crate) fn load(&mut self, arena: Option<&ArenaView>) {
        self.idx = 0;
        self.off = 0;
        self.loaded = true;
        self.in_arena = arena.is_some_and(|a| {
            self.regions
                .iter()
                .all(|r| a.offset_of(r.addr, r.len).is_some())
        });
    }

    /// The next remote pieces, at most `IOV_BATCH` of them and `max` bytes in all.
    #[cfg(target_os = "linux")]
    fn batch(&self, max: usize, out: &mut Vec<nix::sys::uio::RemoteIoVec>) {
        out.clear();
        let mut left = max;
        let mut off = self.off;
        for r in self.regions[self.idx..].iter().take(IOV_BATCH) {
            if left == 0 {
                break;
            }
            let len = (r.len - off).min(left);
            out.push(nix::sys::uio::RemoteIoVec {
                base: r.addr + off,
                len,
            });
            left -= len;
            off = 0;
        }
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 && self.idx < self.regions.len() {
            let r = self.regions[self.idx];
            let step = (r.len - self.off).min(n);
            self.off += step;
            n -= step;
            if self.off == r.len {
                self.idx += 1;
                self.off = 0;
            }
        }
    }
}

fn unreadable(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!(
        "reading the sender's memory (process_vm_readv): {e}"
    ))
}

/// Copies the next `sum(bufs)` bytes of the peer's regions into `bufs`.
#[cfg(target_os = "linux")]
pub(crate) fn copy_into(pid: i32, cur: &mut Cursor, bufs: &mut [&mut [u8]]) -> Result<()> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    use nix::unistd::Pid;
    use std::io::IoSliceMut;

    let mut want: usize = bufs.iter().map(|b| b.len()).sum();
    let mut locals: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
    let mut view: &mut [IoSliceMut<'_>] = &mut locals;
    let mut remote: Vec<RemoteIoVec> = Vec::with_capacity(IOV_BATCH.min(cur.regions.len()));
    while want > 0 {
        cur.batch(want, &mut remote);
        if remote.is_empty() {
            return Err(Error::malformed("PULL", "regions shorter than the payload"));
        }
        let n_local = view.len().min(IOV_BATCH);
        let n = process_vm_readv(Pid::from_raw(pid), &mut view[..n_local], &remote)
            .map_err(unreadable)?;
        if n == 0 {
            return Err(unreadable("no progress"));
        }
        IoSliceMut::advance_slices(&mut view, n);
        cur.advance(n);
        want -= n;
    }
    if cur.idx == cur.regions.len() {
        cur.loaded = false;
    }
    Ok(())
}

/// Copies the next `sum(bufs)` bytes of the peer's regions into `bufs` from the receiver's
/// view of the peer's send arena (every region of the PULL lies in it: `Cursor::in_arena`).
pub(crate) fn copy_from_arena(
    view: &ArenaView,
    cur: &mut Cursor,
    bufs: &mut [&mut [u8]],
) -> Result<()> {
    for b in bufs.iter_mut() {
        let mut filled = 0;
        while filled < b.len() {
            let Some(r) = cur.regions.get(cur.idx).copied() else {
                return Err(Error::malformed("PULL", "regions shorter than the payload"));
            };
            let n = (r.len - cur.off).min(b.len() - filled);
            let Some(at) = view.offset_of(r.addr + cur.off, n) else {
                return Err(Error::malformed("PULL", "region outside the send arena"));
            };
            view.read_at(at, &mut b[filled..filled + n])?;
            filled += n;
            cur.advance(n);
        }
    }
    if cur.idx == cur.regions.len() {
        cur.loaded = false;
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn copy_into(_pid: i32, _cur: &mut Cursor, _bufs: &mut [&mut [u8]]) -> Result<()> {
    Err(unreadable("cross-memory attach needs Linux"))
}

/// The sender's half of the setup probe: a random nonce it keeps alive until MODE arrives.
#[derive(Debug)]
pub(crate) struct Probe {
    nonce: Box<[u8; NONCE_LEN]>,
}

impl Probe {
    pub(crate) fn new() -> Self {
        Probe {
            nonce: Box::new(rand::random()),
        }
    }

    /// The OFFER body naming the nonce's address.
    pub(crate) fn offer(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[..ENTRY_LEN].copy_from_slice(&encode_span(self.nonce.as_ptr() as usize, NONCE_LEN));
        b[ENTRY_LEN..].copy_from_slice(&self.nonce[..]);
        b
    }
}

/// The receiver's half: true when `pid`'s memory at the offered address holds the offered
/// nonce, i.e. cross-memory attach works between these two processes.
pub(crate) fn probe(pid: i32, offer: &[u8; OFFER_LEN]) -> bool {
    let Some((addr, len)) = decode_span(offer) else {
        return false;
    };
    let Ok(addr) = usize::try_from(addr) else {
        return false;
    };
    if len != NONCE_LEN as u64 {
        return false;
    }
    let mut cur = Cursor {
        regions: vec![Region {
            addr,
            len: NONCE_LEN,
        }],
        ..Cursor::default()
    };
    cur.load(None);
    let mut got = [0u8; NONCE_LEN];
    match copy_into(pid, &mut cur, &mut [&mut got[..]]) {
        Ok(()) => got[..] == offer[16..],
        Err(e) => {
            tracing::debug!(error = %e, "shm pull mode unavailable, using the ring");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_regions_merge_and_decode_back() {
        let buf = vec![7u8; 300];
        let other = [9u8; 50];
        let parts: Vec<&[u8]> = vec![&buf[..100], &buf[100..300], &other[..], &[]];
        let mut body = Vec::new();
        let n = encode_regions(parts.into_iter(), &mut body);
        assert_eq!(n, 2);
        assert_eq!(check_header(n, body.len() as u64, 350).unwrap(), 32);
        let mut out = Vec::new();
        decode_regions(&body, 350, &mut out).unwrap();
        assert_eq!(out[0].len, 300);
        assert_eq!(out[1].addr, other.as_ptr() as usize);
    }

    #[test]
    fn hostile_pull_frames_are_refused() {
        assert!(check_header(0, 0, 10).is_err());
        assert!(check_header(u32::MAX, u64::from(u32::MAX) * 16, u64::MAX).is_err());
        assert!(check_header(2, 16, 100).is_err());
        assert!(check_header(11, 176, 10).is_err());
        let entry = |addr: u64, len: u64| {
            let mut e = addr.to_le_bytes().to_vec();
            e.extend_from_slice(&len.to_le_bytes());
            e
        };
        let mut out = Vec::new();
        assert!(decode_regions(&entry(4096, 0), 0, &mut out).is_err());
        assert!(decode_regions(&entry(u64::MAX, 2), 2, &mut out).is_err());
        assert!(decode_regions(&entry(4096, 10), 9, &mut out).is_err());
        assert!(decode_regions(&entry(4096, 10), 11, &mut out).is_err());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn copies_across_region_and_buffer_boundaries() {
        let src: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let pid = std::process::id() as i32;
        let mut cur = Cursor {
            regions: vec![
                Region {
                    addr: src.as_ptr() as usize,
                    len: 1234,
                },
                Region {
                    addr: src.as_ptr() as usize + 1234,
                    len: 5000 - 1234,
                },
            ],
            ..Cursor::default()
        };
        cur.load(None);
        let mut a = vec![0u8; 3000];
        let mut b = vec![0u8; 1000];
        copy_into(pid, &mut cur, &mut [&mut a[..], &mut b[..]]).unwrap();
        assert!(cur.loaded);
        let mut c = vec![0u8; 1000];
        copy_into(pid, &mut cur, &mut [&mut c[..]]).unwrap();
        assert!(!cur.loaded);
        assert_eq!([a, b, c].concat(), src);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn probe_reads_the_nonce_and_rejects_a_wrong_one() {
        let pid = std::process::id() as i32;
        let p = Probe::new();
        let mut offer = p.offer();
        assert!(probe(pid, &offer));
        offer[20] ^= 1;
        assert!(!probe(pid, &offer));
    }
}
