//! Growing a sequence: the blocks an append needs in every layer group, their allocation
//! (all or none) with copy-on-write of a shared last block, the commit that makes them hold
//! KV, and truncation.

use super::allocator::BlockId;
use super::cache::{KvCache, SeqId};
use crate::error::{EngineError, Result};

impl KvCache {
    /// The free blocks [`Self::prepare_append`] needs for `n` more tokens: the fresh blocks
    /// it takes (a dropped block is not taken again; the copy of a shared last block aside),
    /// less those a local layer group gives back before it allocates.
    pub fn blocks_to_append(&self, id: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(id)?;
        let (end, bs) = (self.blocks_for(s.len + n), self.layout.block_size);
        let (mut fresh, mut freed) = (end.saturating_sub(s.blocks.len() + s.dropped), 0);
        for (g, t) in s.groups.iter().enumerate() {
            // A local group's drops keep its logical length: what it drops is not taken
            // again, and what it still holds below its window comes back first.
            fresh += end.saturating_sub(t.dropped + t.blocks.len());
            let below = self.layout.groups.droppable_below(g + 1, s.len, bs);
            freed += below.saturating_sub(t.dropped).min(t.blocks.len());
        }
        Ok(fresh.saturating_sub(freed))
    }

    /// Make room for `n` more tokens: allocates blocks (all or none, every layer group's)
    /// and copies a shared partially-filled last block before it is written. A local
    /// group first gives back the blocks out of its window. Returns the position of the
    /// first new token.
    pub fn prepare_append(&mut self, id: SeqId, n: usize) -> Result<usize> {
        self.drop_out_of_local_windows(id);
        let bs = self.layout.block_size;
        let s = self.seq(id)?;
        let len = s.len;
        let end = self.blocks_for(len + n);
        let shared = |b: BlockId| self.alloc.refcount(b) > 1 || self.alloc.is_cacheable(b);
        let partial = len % bs != 0 && n > 0;
        // Per table (group 0 first): fresh blocks, and the index of a shared last block.
        let mut plans = Vec::with_capacity(1 + s.groups.len());
        let last = s.physical(len / bs, bs);
        plans.push((
            end.saturating_sub(s.blocks.len() + s.dropped),
            last.filter(|&i| partial && shared(s.blocks[i])),
        ));
        for t in &s.groups {
            let last = t.physical(len / bs).filter(|&i| i < t.blocks.len());
            plans.push((
                end.saturating_sub(t.blocks.len() + t.dropped),
                last.filter(|&i| partial && shared(t.blocks[i])),
            ));
        }
        let total = plans
            .iter()
            .map(|(need, cow)| need + usize::from(cow.is_some()))
            .sum();
        let mut fresh = self.allocate_blocks(total)?.into_iter();
        for (g, (need, cow)) in plans.into_iter().enumerate() {
            if let Some(idx) = cow {
                if let Some(copy) = fresh.next() {
                    let old = self.table_mut(id, g).map_or(copy, |t| t[idx]);
                    self.copy_block(old, copy);
                    self.release_block(old);
                    if let Some(t) = self.table_mut(id, g) {
                        t[idx] = copy;
                    }
                }
            }
            let new: Vec<BlockId> = fresh.by_ref().take(need).collect();
            // The copy is written whole; the last new block may end partly filled.
            if let Some(&b) = new.last() {
                self.zero_if_partial(b, len + n);
            }
            if let Some(t) = self.table_mut(id, g) {
                t.extend(new);
            }
        }
        Ok(len)
    }

    /// The blocks of layer group `g` of sequence `id`.
    fn table_mut(&mut self, id: SeqId, g: usize) -> Option<&mut Vec<BlockId>> {
        let s = self.seqs.get_mut(&id)?;
        match g {
            0 => Some(&mut s.blocks),
            _ => s.groups.get_mut(g - 1).map(|t| &mut t.blocks),
        }
    }

    /// Record that `n` tokens prepared with [`Self::prepare_append`] now hold KV.
    pub fn commit_append(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.layout.block_size;
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        let end = (s.len + n).div_ceil(bs);
        let short = |have: usize| end > have;
        if short(s.blocks.len() + s.dropped)
            || s.groups.iter().any(|t| short(t.blocks.len() + t.dropped))
        {
            return Err(EngineError::invalid(
                "tokens",
                "commit beyond reserved blocks",
            ));
        }
        s.len += n;
        self.drop_out_of_window(id);
        // With a prefix cache, local blocks go once registered (`register_blocks`), or
        // before the next append.
        if self.prefix.is_none() {
            self.drop_out_of_local_windows(id);
        }
        Ok(())
    }

    /// Drop tokens past `len` (keeps the blocks that still hold tokens).
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<()> {
        let keep = self.blocks_for(len);
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if len > s.len {
            return Err(EngineError::invalid("len", "truncate beyond the sequence"));
        }
        if s.dropped > 0 || s.groups.iter().any(|t| t.dropped > 0) {
            return Err(EngineError::invalid(
                "len",
                "a windowed sequence, or a local layer group, that dropped blocks cannot be \
                 truncated",
            ));
        }
        s.len = len;
        s.hashes.truncate(len / self.layout.block_size);
        let mut dropped: Vec<BlockId> = s.blocks.drain(keep.min(s.blocks.len())..).collect();
        for t in &mut s.groups {
            dropped.extend(t.blocks.drain(keep.min(t.blocks.len())..));
        }
        for b in dropped {
            self.release_block(b);
        }
        Ok(())
    }
}
