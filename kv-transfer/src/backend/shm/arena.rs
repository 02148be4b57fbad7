//! The send arena: memory a sender allocates its outgoing KV in, shared with same-host
//! receivers so that pull mode copies it with a plain `memcpy` instead of
//! `process_vm_readv(2)`.
//!
//! Why: `process_vm_readv` pins the sender's pages 4 KiB at a time before it copies, which
//! costs about as much as the copy itself (0.25-0.5x a memcpy of the same size on these
//! machines). A receiver that has the sender's arena mapped skips the pinning: it copies
//! from its own mapping of the same pages.
//!
//! How: the arena is one sealed memfd (see `memfd`). A sender connecting in pull mode hands
//! its fd to the receiver over the unix socket (`SCM_RIGHTS`), with the address it is mapped
//! at; PULL frames keep naming sender addresses, and the receiver serves every PULL whose
//! regions all lie in the arena from its view, any other from `process_vm_readv` as before.
//! Buffers ([`ArenaBuf`]) come from a first-fit free list in 4 KiB units (page-aligned:
//! `memcpy` and the kernel's copies run fastest when source and destination agree in their
//! offset within a cache line), and go back to it when dropped; [`SendArena::alloc`] returns
//! `None` when the arena is full, and callers use ordinary memory then.
//!
//! Invariants: allocated ranges are disjoint and inside the arena; freed ranges are merged
//! with their free neighbours; `free + allocated == capacity` at all times. Pages once
//! written stay resident (the arena is a pool: its resident size is its high-water mark, at
//! most its capacity).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::memfd::SealedMemfd;
use crate::error::{Error, Result};

/// Allocation unit and alignment.
pub const ARENA_ALIGN: usize = 4096;

/// First-fit free list over `0..capacity` in `ARENA_ALIGN` units (offsets in bytes).
#[derive(Debug)]
struct FreeList {
    /// Free ranges: offset -> length; never adjacent, never empty.
    free: BTreeMap<usize, usize>,
    free_bytes: usize,
}

impl FreeList {
    fn new(capacity: usize) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        FreeList {
            free,
            free_bytes: capacity,
        }
    }

    /// A range of `len` bytes (a multiple of the unit), or `None` when no free range fits.
    fn take(&mut self, len: usize) -> Option<usize> {
        let (&off, &have) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&off);
        if have > len {
            self.free.insert(off + len, have - len);
        }
        self.free_bytes -= len;
        Some(off)
    }

    /// Returns `off..off + len`, merging it with free neighbours.
    fn give(&mut self, mut off: usize, mut len: usize) {
        self.free_bytes += len;
        if let Some((&prev, &plen)) = self.free.range(..off).next_back() {
            if prev + plen == off {
                self.free.remove(&prev);
                off = prev;
                len += plen;
            }
        }
        if let Some(next) = self.free.remove(&(off + len)) {
            len += next;
        }
        self.free.insert(off, len);
    }
}

/// A process's send arena (cheap to share: senders and buffers hold an `Arc`).
#[derive(Debug)]
pub struct SendArena {
    map: SealedMemfd,
    free: Mutex<FreeList>,
}

impl SendArena {
    /// An arena of `capacity` bytes (rounded up to 4 KiB). Only address space and a memfd
    /// until buffers are written.
    pub fn new(capacity: usize) -> Result<Arc<SendArena>> {
        let capacity = capacity
            .max(1)
            .checked_next_multiple_of(ARENA_ALIGN)
            .ok_or_else(|| Error::InvalidArgument("send arena size overflows".into()))?;
        let map = SealedMemfd::create(capacity)?;
        Ok(Arc::new(SendArena {
            free: Mutex::new(FreeList::new(map.len())),
            map,
        }))
    }

    /// Bytes the arena holds.
    pub fn capacity(&self) -> usize {
        self.map.len()
    }

    /// Bytes not allocated now.
    pub fn free_bytes(&self) -> usize {
        self.lock().free_bytes
    }

    /// A buffer of `len` bytes (page-aligned, contents unspecified), or `None` when `len`
    /// is zero or no free range is large enough.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<ArenaBuf> {
        if len == 0 {
            return None;
        }
        let cap = len.checked_next_multiple_of(ARENA_ALIGN)?;
        let off = self.lock().take(cap)?;
        Some(ArenaBuf {
            arena: Arc::clone(self),
            off,
            len,
            cap,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FreeList> {
        // The free list is consistent after every call (no panics inside): a poisoned lock
        // holds a valid list.
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn memfd(&self) -> &SealedMemfd {
        &self.map
    }
}

/// A buffer in a [`SendArena`]: derefs to its bytes, returns its range when dropped. Wrap it
/// in `bytes::Bytes::from_owner` to send it through any backend.
#[derive(Debug)]
pub struct ArenaBuf {
    arena: Arc<SendArena>,
    off: usize,
    len: usize,
    cap: usize,
}

impl ArenaBuf {
    /// The arena's memfd, this buffer's offset and length (for the `memfd` module's slices).
    pub(crate) fn raw(&self) -> (&SealedMemfd, usize, usize) {
        (&self.arena.map, self.off, self.len)
    }
}

impl AsRef<[u8]> for ArenaBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for ArenaBuf {
    fn drop(&mut self) {
        self.arena.lock().give(self.off, self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buffers_are_page_aligned_disjoint_and_return_when_dropped() {
        let arena = SendArena::new(64 << 10).unwrap();
        assert_eq!(arena.capacity(), 64 << 10);
        let mut a = arena.alloc(5000).unwrap();
        let mut b = arena.alloc(100).unwrap();
        assert_eq!(a.len(), 5000);
        assert_eq!(a.as_ptr() as usize % ARENA_ALIGN, 0);
        assert_eq!(b.as_ptr() as usize % ARENA_ALIGN, 0);
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        assert_eq!(arena.free_bytes(), (64 << 10) - 3 * ARENA_ALIGN);
        assert!(
            arena.alloc(64 << 10).is_none(),
            "does not fit while a and b live"
        );
        assert!(arena.alloc(0).is_none());
        drop(a);
        drop(b);
        assert_eq!(arena.free_bytes(), 64 << 10);
        assert!(
            arena.alloc(64 << 10).is_some(),
            "the freed ranges merged back"
        );
    }

    proptest! {
        /// Random allocations and frees keep ranges disjoint and in bounds, and freeing
        /// everything gives back one range covering the arena.
        #[test]
        fn free_list_keeps_its_invariants(ops in prop::collection::vec((any::<bool>(), 1usize..40), 1..200)) {
            let units = 64;
            let mut fl = FreeList::new(units * ARENA_ALIGN);
            let mut live: Vec<(usize, usize)> = Vec::new();
            for (alloc, n) in ops {
                if alloc || live.is_empty() {
                    let len = n * ARENA_ALIGN;
                    if let Some(off) = fl.take(len) {
                        prop_assert!(off + len <= units * ARENA_ALIGN);
                        prop_assert!(live.iter().all(|&(o, l)| off + len <= o || o + l <= off));
                        live.push((off, len));
                    }
                } else {
                    let (o, l) = live.swap_remove(n % live.len());
                    fl.give(o, l);
                }
                let held: usize = live.iter().map(|l| l.1).sum();
                prop_assert_eq!(fl.free_bytes + held, units * ARENA_ALIGN);
                prop_assert_eq!(fl.free.values().sum::<usize>(), fl.free_bytes);
            }
            for (o, l) in live.drain(..) {
                fl.give(o, l);
            }
            prop_assert_eq!(fl.free.len(), 1);
            prop_assert_eq!(fl.free.get(&0).copied(), Some(units * ARENA_ALIGN));
        }
    }
}
