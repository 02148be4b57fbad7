//! A [`RegionLease`]: the right to write the regions of a reserved sequence's fresh blocks
//! from another thread, straight into the pool (a KV receiver's one copy).
//!
//! The engine makes a lease for blocks it has just allocated to a sequence that nothing reads
//! yet (a decode worker's reservation). The lease maps each listed block, in every layer, to
//! the bytes of its region in the pool, for each layer group the physical block at the
//! same logical index (none where a local group keeps no block there). It owns a share of
//! the pool's memory, so its pointers stay valid however long it lives.
//!
//! Invariants (the holder's side of `pool_memory`'s contract):
//! - a lease is exclusive: one holder, regions handed out one `&mut` borrow at a time or as a
//!   batch of pairwise distinct regions ([`RegionLease::regions_mut`] refuses a repeated
//!   block);
//! - the blocks stay allocated to the sequence, unread by the engine, until the holder gives
//!   the lease up: the reservation table frees a leased sequence only after the lease is
//!   back (or dropped).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use super::cache::{KvCache, KvKind, SeqId};
use super::pool_memory::PoolMemory;
use super::BlockId;
use crate::error::{EngineError, Result};

/// No region: the block is dropped in that layer's group (its bytes are not kept).
const DROPPED: usize = usize::MAX;

/// What [`RegionLease::region_mut`] finds for a `(layer, kind, block)`.
#[derive(Debug)]
pub enum LeasedRegion<'a> {
    /// The region's bytes in the pool.
    Write(&'a mut [u8]),
    /// Leased, but the layer's group keeps no block there: read and discard.
    Dropped,
    /// Not a block of the lease, or a layer past the model's.
    Outside,
}

/// See the module docs.
pub struct RegionLease {
    mem: Arc<PoolMemory>,
    region_bytes: usize,
    layers: usize,
    blocks: Vec<BlockId>,
    /// Position of each listed block in `blocks`.
    index: HashMap<BlockId, usize>,
    /// Per listed block, per layer: the byte offset of its K region (V follows it).
    k_offsets: Vec<usize>,
    /// Scratch for [`RegionLease::regions_mut`]'s repeated-block check.
    seen: Vec<bool>,
}

impl std::fmt::Debug for RegionLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionLease")
            .field("blocks", &self.blocks)
            .field("layers", &self.layers)
            .finish()
    }
}

impl RegionLease {
    /// The listed blocks, in order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Bytes of one region.
    pub fn region_bytes(&self) -> usize {
        self.region_bytes
    }

    /// `block`'s place in the lease and the offset of its region (`DROPPED` if dropped).
    fn locate(&self, layer: usize, kind: KvKind, block: BlockId) -> Option<(usize, usize)> {
        if layer >= self.layers {
            return None;
        }
        let at = *self.index.get(&block)?;
        let offset = match self.k_offsets[at * self.layers + layer] {
            DROPPED => DROPPED,
            k => k + kind as usize * self.region_bytes,
        };
        Some((at, offset))
    }

    fn slice(&mut self, offset: usize) -> &mut [u8] {
        // SAFETY: `offset` is a region of a leased block (computed by the cache from its own
        // layout, within the allocation), the lease is the only writer of it and the engine
        // makes no reference to it while the lease lives (module invariants); `&mut self`
        // allows one such borrow at a time.
        unsafe { std::slice::from_raw_parts_mut(self.mem.base().add(offset), self.region_bytes) }
    }

    /// The region of `layer`'s `kind` in `block`.
    pub fn region_mut(&mut self, layer: usize, kind: KvKind, block: BlockId) -> LeasedRegion<'_> {
        match self.locate(layer, kind, block) {
            None => LeasedRegion::Outside,
            Some((_, DROPPED)) => LeasedRegion::Dropped,
            Some((_, o)) => LeasedRegion::Write(self.slice(o)),
        }
    }

    /// Pushes the regions of `blocks` (in order) onto `out` and returns `true`, when every one
    /// is leased, kept and listed once; otherwise pushes nothing and returns `false` (the
    /// caller goes region by region).
    pub fn regions_mut<'a>(
        &'a mut self,
        layer: usize,
        kind: KvKind,
        blocks: &[BlockId],
        out: &mut Vec<&'a mut [u8]>,
    ) -> bool {
        self.seen.clear();
        self.seen.resize(self.blocks.len(), false);
        let (start, base, n) = (out.len(), self.mem.base(), self.region_bytes);
        for &b in blocks {
            let o = match self.locate(layer, kind, b) {
                Some((at, o)) if o != DROPPED && !std::mem::replace(&mut self.seen[at], true) => o,
                _ => {
                    out.truncate(start);
                    return false;
                }
            };
            // SAFETY: as in `slice`; a block is pushed only the first time it is seen, so the
            // regions are pairwise disjoint (distinct blocks' regions never overlap), and all
            // borrow `self` mutably for `'a`, so no other borrow of the lease exists
            // meanwhile. On a refusal they are taken off `out` again before anyone uses them.
            out.push(unsafe { std::slice::from_raw_parts_mut(base.add(o), n) });
        }
        true
    }
}

impl KvCache {
    /// Moves sequence `from`, blocks and all, to the free id `to` (a lease's sequence that
    /// must outlive its request's id, which a retry may reuse).
    pub fn rename_sequence(&mut self, from: SeqId, to: SeqId) -> Result<()> {
        if self.seqs.contains_key(&to) {
            return Err(EngineError::invalid(
                "sequence",
                format!("{to} already exists"),
            ));
        }
        let s = self
            .seqs
            .remove(&from)
            .ok_or(EngineError::UnknownSequence(from))?;
        self.seqs.insert(to, s);
        Ok(())
    }

    /// A lease on the regions of `blocks`, the fresh blocks of sequence `id` from logical
    /// block `first` on, in order (a reservation's): group 0's regions are those of the
    /// listed blocks themselves, another group's those of its block at the same logical
    /// index. Marks the blocks written (the device copy, if any, reloads them).
    pub fn lease_regions(
        &mut self,
        id: SeqId,
        first: usize,
        blocks: &[BlockId],
    ) -> Result<RegionLease> {
        let (layers, elem) = (self.layout.n_layers, self.layout.dtype.size());
        let mut k_offsets = Vec::with_capacity(blocks.len() * layers);
        let mut index = HashMap::with_capacity(blocks.len());
        for (at, &b) in blocks.iter().enumerate() {
            if index.insert(b, at).is_some() {
                return Err(EngineError::invalid(
                    "lease",
                    format!("block {b} listed twice"),
                ));
            }
            for layer in 0..layers {
                let phys = match self.layout.groups.group_of(layer) {
                    0 => Some(b),
                    _ => self.block_at(id, first + at, layer)?,
                };
                k_offsets.push(match phys {
                    Some(p) => {
                        self.device.host_wrote(p);
                        self.region_offset(p, layer, KvKind::K) * elem
                    }
                    None => DROPPED,
                });
            }
        }
        Ok(RegionLease {
            mem: self.storage.memory().clone(),
            region_bytes: self.layout.region_bytes(),
            layers,
            blocks: blocks.to_vec(),
            index,
            k_offsets,
            seen: Vec::new(),
        })
    }
}
