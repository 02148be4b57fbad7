//! Pinned regions: a sender reads a sequence's KV straight out of the pool, as `Bytes`,
//! while the engine goes on (a prefill worker's layer leaves while the next one computes, and
//! its sequence may be freed before the last byte is sent).
//!
//! A pin is a count per block, raised (from any thread holding `&KvCache`, such as a
//! forward's layer hook) when the `Bytes` are made and lowered when the last of them is
//! dropped. The engine gives a block back to the allocator only when it is not pinned: a
//! reference that would be the block's last while it is pinned is kept and given back later,
//! by [`KvCache::reclaim_unpinned`], once the pins are gone.
//!
//! Invariants:
//! - a pinned block is never handed out again, so nothing is written into it: the engine
//!   writes only into blocks it has just allocated or that its sequences append to, and the
//!   regions pinned are ones already computed (a sender pins a layer once it is written;
//!   chunks after it fill new blocks);
//! - every pin is lowered exactly once (when its group drops), and every kept reference is
//!   released exactly once (by the reclaim that finds its block unpinned);
//! - a pin lowered on another thread (`Release`) is seen by the engine's check (`Acquire`)
//!   before it reuses the block: the sender's reads happen before the engine's next writes.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::cache::{KvCache, KvKind};
use super::pool_memory::PoolMemory;
use super::BlockId;

/// Pin counts, one per block of the pool (the null block included).
#[derive(Debug)]
pub(crate) struct PinCounts(Vec<AtomicU32>);

impl PinCounts {
    pub(crate) fn new(blocks: usize) -> Arc<PinCounts> {
        Arc::new(PinCounts((0..blocks).map(|_| AtomicU32::new(0)).collect()))
    }

    fn is_pinned(&self, b: BlockId) -> bool {
        self.0
            .get(b as usize)
            .is_some_and(|c| c.load(Ordering::Acquire) > 0)
    }
}

/// The blocks one call pinned; lowers their pins when the last region made of it drops.
struct PinGroup {
    counts: Arc<PinCounts>,
    mem: Arc<PoolMemory>,
    blocks: Vec<BlockId>,
}

impl Drop for PinGroup {
    fn drop(&mut self) {
        for &b in &self.blocks {
            if let Some(c) = self.counts.0.get(b as usize) {
                c.fetch_sub(1, Ordering::Release);
            }
        }
    }
}

/// One pinned region: `Bytes`' owner.
struct PinnedRegion {
    group: Arc<PinGroup>,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for PinnedRegion {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `offset..offset + len` is a region of a block of the pool (computed by the
        // cache from its layout, inside the allocation, which `group.mem` keeps alive); the
        // block is pinned while `group` lives, and a pinned block's computed regions are
        // never written (module invariants), so shared reads cannot race a write.
        unsafe { std::slice::from_raw_parts(self.group.mem.base().add(self.offset), self.len) }
    }
}

impl KvCache {
    /// `layer`'s K and V regions of `blocks`, in order, read in place: each block is pinned
    /// (never reused) until the last of the returned `Bytes` is dropped. The regions must be
    /// computed already (see the module's invariants).
    pub fn pinned_regions(&self, layer: usize, blocks: &[BlockId]) -> (Vec<Bytes>, Vec<Bytes>) {
        let elem = self.layout.dtype.size();
        // A block listed twice (a local group's null block) is pinned twice and lowered
        // twice: the counts stay balanced.
        let pinned = blocks.to_vec();
        for &b in &pinned {
            if let Some(c) = self.pins.0.get(b as usize) {
                c.fetch_add(1, Ordering::AcqRel);
            }
        }
        let group = Arc::new(PinGroup {
            counts: self.pins.clone(),
            mem: self.storage.memory().clone(),
            blocks: pinned,
        });
        let len = self.layout.region_bytes();
        let regions = |kind| -> Vec<Bytes> {
            blocks
                .iter()
                .map(|&b| {
                    Bytes::from_owner(PinnedRegion {
                        group: group.clone(),
                        offset: self.region_offset(b, layer, kind) * elem,
                        len,
                    })
                })
                .collect()
        };
        (regions(KvKind::K), regions(KvKind::V))
    }

    /// Drops a reference to `b`: its last one is kept while `b` is pinned (see the module
    /// docs). Every release of a block by the cache goes through here.
    pub(super) fn release_block(&mut self, b: BlockId) {
        if self.alloc.refcount(b) == 1 && self.pins.is_pinned(b) {
            self.unpinning.push(b);
        } else {
            self.alloc.release(b);
        }
    }

    /// Gives back the kept references of blocks whose pins are gone; returns how many blocks
    /// are still kept for a pin. Called by the engine between steps.
    pub fn reclaim_unpinned(&mut self) -> usize {
        let kept = std::mem::take(&mut self.unpinning);
        for b in kept {
            self.release_block(b);
        }
        self.unpinning.len()
    }

    /// Blocks kept only because a sender still reads them.
    pub fn pinned_blocks(&self) -> usize {
        self.unpinning.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvDtype, KvGroups, KvLayout};

    fn cache(blocks: usize) -> KvCache {
        KvCache::new(
            KvLayout {
                fingerprint: "test".into(),
                n_layers: 2,
                n_kv_heads: 1,
                head_dim: 4,
                block_size: 4,
                dtype: KvDtype::F16,
                groups: KvGroups::single(2),
            },
            blocks,
        )
    }

    #[test]
    fn pinned_regions_read_the_pool_in_place_and_outlive_their_sequence() {
        let mut c = cache(4);
        c.add_sequence(1).unwrap();
        c.prepare_append(1, 8).unwrap();
        c.commit_append(1, 8).unwrap();
        let blocks = c.sequence_blocks(1).unwrap().to_vec();
        for (i, &b) in blocks.iter().enumerate() {
            c.region_bytes_mut(b, 1, KvKind::V).fill(i as u8 + 1);
        }
        let (k, v) = c.pinned_regions(1, &blocks);
        assert_eq!((k.len(), v.len()), (2, 2));
        assert_eq!(
            v[1].as_ptr(),
            c.region_bytes(blocks[1], 1, KvKind::V).as_ptr()
        );
        assert!(v[1].iter().all(|&x| x == 2));
        c.free_sequence(1);
        assert_eq!(c.free_blocks(), 2, "pinned blocks are not free");
        assert_eq!(c.pinned_blocks(), 2);
        // Nothing can take them: an allocation of the whole pool fails.
        c.add_sequence(2).unwrap();
        assert!(c.prepare_append(2, 16).is_err());
        assert_eq!(c.reclaim_unpinned(), 2, "still pinned");
        drop(k);
        assert_eq!(c.reclaim_unpinned(), 2, "the V regions still pin them");
        let first = v[0].clone();
        drop(v);
        assert_eq!(
            c.reclaim_unpinned(),
            2,
            "one region of the group pins them all"
        );
        drop(first);
        assert_eq!(c.reclaim_unpinned(), 0);
        assert_eq!(c.free_blocks(), 4);
        assert_eq!(c.allocator().check(), Ok(()));
    }

    #[test]
    fn a_pinned_block_another_sequence_shares_goes_to_it_not_back_to_the_pool() {
        let mut c = cache(4);
        c.add_sequence(1).unwrap();
        c.prepare_append(1, 4).unwrap();
        c.commit_append(1, 4).unwrap();
        let b = c.sequence_blocks(1).unwrap()[0];
        let pinned = c.pinned_regions(0, &[b]);
        c.fork(1, 2).unwrap();
        c.free_sequence(1);
        assert_eq!(c.pinned_blocks(), 0, "sequence 2 still holds it");
        c.free_sequence(2);
        assert_eq!(c.pinned_blocks(), 1);
        drop(pinned);
        c.reclaim_unpinned();
        assert_eq!(c.free_blocks(), 4);
    }
}
