//! A sequence's block tables per layer group (`super::groups`): what a forward indexes,
//! what local groups give back, and the regions of a sequence's logical blocks that
//! export, import and the workers' transfers read and write.
//!
//! A local group drops the leading blocks no later query sees (`KvGroups::droppable_below`)
//! at three points: at a commit when no prefix cache is on, once the blocks are registered
//! in the prefix cache (`KvCache::register_blocks`), and before every append; so a block
//! leaves its table only after the prefix cache could index it. A sequence whose KV arrives
//! from elsewhere skips its dropped blocks before it allocates any
//! ([`KvCache::expect_prompt`]): they are never allocated, and their regions in a frame are
//! ignored.

use super::allocator::BlockId;
use super::cache::{KvCache, KvKind, SeqId, Sequence};
use crate::error::{EngineError, Result};

/// The table of one layer group after the first (`super::groups`).
#[derive(Debug, Clone, Default)]
pub(super) struct GroupTable {
    pub(super) blocks: Vec<BlockId>,
    /// Leading logical blocks out of every later query's window (local groups only).
    pub(super) dropped: usize,
}

impl GroupTable {
    /// Where logical block `i` sits in `blocks` (`None`: dropped).
    pub(super) fn physical(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.dropped)
    }
}

/// Where a logical block of one layer group of a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    Held(BlockId),
    /// Out of every later query's view (a window's or a local group's).
    Dropped,
    /// Past the sequence's blocks (or no such group).
    Missing,
}

impl Sequence {
    /// Where logical block `i` of layer group `g` is.
    pub(super) fn slot(&self, g: usize, i: usize, block_size: usize) -> Slot {
        let (blocks, at) = match g {
            0 => (&self.blocks, self.physical(i, block_size)),
            _ => match self.groups.get(g - 1) {
                Some(t) => (&t.blocks, t.physical(i)),
                None => return Slot::Missing,
            },
        };
        match at {
            None => Slot::Dropped,
            Some(j) => blocks.get(j).map_or(Slot::Missing, |&b| Slot::Held(b)),
        }
    }
}

impl KvCache {
    /// The null block: zeroed, never written, read where a local group dropped a block
    /// (grouped layouts only).
    pub(crate) fn null_block(&self) -> BlockId {
        self.total_blocks() as BlockId
    }

    /// Per layer group, the block of every logical block index: what a forward indexes by
    /// `pos / block_size` in a layer of that group. Group 0's is
    /// [`KvCache::logical_table`]; a local group's dropped blocks are the null block.
    pub fn logical_tables(&self, id: SeqId) -> Result<Vec<Vec<BlockId>>> {
        let s = self.seq(id)?;
        let mut out = Vec::with_capacity(1 + s.groups.len());
        out.push(self.logical_table(id)?);
        let null = self.null_block();
        for t in &s.groups {
            let mut v = Vec::with_capacity(t.dropped + t.blocks.len());
            v.extend(std::iter::repeat_n(null, t.dropped));
            v.extend_from_slice(&t.blocks);
            out.push(v);
        }
        Ok(out)
    }

    /// The blocks sequence `id` holds in layer group `g`, in order (group 0's are
    /// [`KvCache::sequence_blocks`]).
    pub fn group_blocks(&self, id: SeqId, g: usize) -> Result<&[BlockId]> {
        let s = self.seq(id)?;
        match g {
            0 => Ok(&s.blocks),
            _ => s
                .groups
                .get(g - 1)
                .map(|t| t.blocks.as_slice())
                .ok_or_else(|| EngineError::invalid("group", format!("{g} out of range"))),
        }
    }

    /// Every block sequence `id` holds, all groups.
    pub fn held_blocks(&self, id: SeqId) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(s.blocks.len() + s.groups.iter().map(|t| t.blocks.len()).sum::<usize>())
    }

    /// The most blocks a full-attention sequence of `tokens` tokens holds at once while it
    /// is computed in chunks of at most `chunk` tokens (every group's): what admission
    /// reserves room for.
    pub fn peak_blocks(&self, tokens: usize, chunk: usize) -> usize {
        self.layout
            .groups
            .peak_blocks(tokens, chunk, self.layout.block_size)
    }

    /// The blocks a full-attention sequence of `tokens` tokens keeps once complete, every
    /// group's: what an imported prompt of that length takes.
    pub fn kept_blocks(&self, tokens: usize) -> usize {
        self.layout
            .groups
            .kept_blocks(tokens, self.layout.block_size)
    }

    /// Prepares sequence `id` (empty, or holding only an attached prefix) for a prompt of
    /// `tokens` tokens whose KV arrives from elsewhere: each local group skips the blocks
    /// the complete prompt drops, so [`KvCache::prepare_append`] allocates only the kept
    /// ones (a no-op for a layout of one group).
    pub fn expect_prompt(&mut self, id: SeqId, tokens: usize) -> Result<()> {
        self.seq(id)?;
        self.skip_local_blocks(id, tokens);
        Ok(())
    }

    /// Gives back the blocks of `id`'s local groups that no query at its length or later
    /// sees.
    pub(super) fn drop_out_of_local_windows(&mut self, id: SeqId) {
        if let Some(len) = self.seqs.get(&id).map(|s| s.len) {
            self.skip_local_blocks(id, len);
        }
    }

    /// Marks dropped, in every local group of `id`, the blocks no query at `len` or later
    /// sees, releasing those it holds.
    fn skip_local_blocks(&mut self, id: SeqId, len: usize) {
        let (groups, bs) = (&self.layout.groups, self.layout.block_size);
        if !groups.is_grouped() {
            return;
        }
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let mut gone = Vec::new();
        for (i, t) in s.groups.iter_mut().enumerate() {
            let target = groups.droppable_below(i + 1, len, bs);
            if target <= t.dropped {
                continue;
            }
            let n = (target - t.dropped).min(t.blocks.len());
            gone.extend(t.blocks.drain(..n));
            t.dropped = target;
        }
        for b in gone {
            self.release_block(b);
        }
    }

    /// The block of logical index `index` of `id` in `layer`'s group (`None`: dropped).
    pub(super) fn block_at(
        &self,
        id: SeqId,
        index: usize,
        layer: usize,
    ) -> Result<Option<BlockId>> {
        let s = self.seq(id)?;
        if layer >= self.layout.n_layers {
            return Err(EngineError::invalid(
                "layer",
                format!("{layer} out of range"),
            ));
        }
        let g = self.layout.groups.group_of(layer);
        match s.slot(g, index, self.layout.block_size) {
            Slot::Held(b) => Ok(Some(b)),
            Slot::Dropped => Ok(None),
            Slot::Missing => Err(EngineError::invalid(
                "block",
                format!("logical block {index} of sequence {id} out of range"),
            )),
        }
    }

    /// The block holding sequence `id`'s logical block `index` in `layer`: a sender's
    /// source. A block a local group dropped is the null block (zeros).
    pub fn sequence_block(&self, id: SeqId, index: usize, layer: usize) -> Result<BlockId> {
        match self.block_at(id, index, layer)? {
            Some(b) => Ok(b),
            None if self.layout.groups.group_of(layer) > 0 => Ok(self.null_block()),
            None => Err(EngineError::invalid(
                "block",
                format!("logical block {index} of sequence {id} was dropped"),
            )),
        }
    }

    /// The bytes of one region of sequence `id`'s logical block `index` in `layer` (see
    /// [`KvCache::sequence_block`]).
    pub fn sequence_region(
        &self,
        id: SeqId,
        index: usize,
        layer: usize,
        kind: KvKind,
    ) -> Result<&[u8]> {
        let b = self.sequence_block(id, index, layer)?;
        Ok(self.region_bytes(b, layer, kind))
    }

    /// The bytes of one region of sequence `id`'s logical block `index` in `layer`, for a
    /// receiver that writes in place (`None`: the block is dropped in that layer's group,
    /// and what arrives for it is not kept).
    pub fn sequence_region_mut(
        &mut self,
        id: SeqId,
        index: usize,
        layer: usize,
        kind: KvKind,
    ) -> Result<Option<&mut [u8]>> {
        Ok(match self.block_at(id, index, layer)? {
            Some(b) => Some(self.region_bytes_mut(b, layer, kind)),
            None => None,
        })
    }

    /// Checks that the null block is still all zeros (tests).
    pub fn null_block_is_zero(&self) -> bool {
        !self.layout.groups.is_grouped()
            || self.block_bytes(self.null_block()).iter().all(|&b| b == 0)
    }
}
