//! The paged KV cache: one pool of fixed-size blocks shared by all sequences,
//! per-sequence block tables, and export / import of a sequence's KV in a
//! described layout (what kv-transfer moves between workers).
//!
//! Storage order: `[block][member][K|V][kv_head][slot][head_dim]`, so the K (or
//! V) of one layer of one block is one contiguous *region*. A block holds the layers of one
//! group (`super::groups`: every layer, unless the model mixes global and local attention);
//! `member` is the layer's place in its group. A layer's export frame is the K regions of
//! the sequence's logical blocks in order, then the V regions in the same order.
//!
//! Invariants: a sequence of `len` tokens owns exactly `ceil(len / block_size)`
//! blocks (plus those reserved ahead of a write), less the blocks a windowed sequence
//! dropped (`super::window`: they sit right after its sink blocks, in logical order, and
//! are never referenced again), and less a local layer group's blocks out of its window
//! (`super::group_tables`); a block shared by several
//! sequences, or indexed by the prefix cache, is copied before anyone writes into it
//! (copy-on-write), so a block's content never changes while its hash names it.

use std::collections::HashMap;
use std::sync::Arc;

use half::f16;
use serde::{Deserialize, Serialize};

use super::allocator::{BlockAllocator, BlockId};
use super::device_sync::DeviceSync;
use super::group_tables::GroupTable;
use super::groups::KvGroups;
use super::pins::PinCounts;
use super::pool_memory::{PoolBacking, PoolMemory, PoolVec};
use super::prefix::BlockHash;
use super::prefix_cache::PrefixState;
use super::window::Window;
use crate::error::{EngineError, Result};

pub type SeqId = u64;

/// What a windowed sequence's logical block table ([`KvCache::logical_table`]) holds where
/// a block was dropped: no query sees it, so no one reads it.
pub const DROPPED: BlockId = BlockId::MAX;

/// Element type of the stored KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            other => Err(format!("unknown KV dtype `{other}` (f32, f16)")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    K = 0,
    V = 1,
}

/// Everything needed to interpret exported KV bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Hex digest identifying the model (architecture, dims, tokenizer, weights).
    pub fingerprint: String,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
    /// Which layers share a block table (`super::groups`).
    pub groups: KvGroups,
}

impl KvLayout {
    /// Elements of one whole block: its group's layers, K and V.
    pub fn block_elems(&self) -> usize {
        self.groups.per_group * 2 * self.region_elems()
    }

    /// Bytes of one whole block.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Elements in one (block, layer, K-or-V) region.
    pub fn region_elems(&self) -> usize {
        self.n_kv_heads * self.block_size * self.head_dim
    }

    pub fn region_bytes(&self) -> usize {
        self.region_elems() * self.dtype.size()
    }

    /// Bytes of KV per token, all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.size()
    }

    /// Whether KV in `other`'s layout can be imported into this one (the
    /// dtype may differ: import converts).
    pub fn check_compatible(&self, other: &KvLayout) -> Result<()> {
        let mut diffs = Vec::new();
        if self.fingerprint != other.fingerprint {
            diffs.push(format!(
                "model fingerprint {} vs {}",
                self.fingerprint, other.fingerprint
            ));
        }
        for (name, a, b) in [
            ("layers", self.n_layers, other.n_layers),
            ("kv heads", self.n_kv_heads, other.n_kv_heads),
            ("head dim", self.head_dim, other.head_dim),
            ("block size", self.block_size, other.block_size),
        ] {
            if a != b {
                diffs.push(format!("{name} {a} vs {b}"));
            }
        }
        if self.groups != other.groups {
            diffs.push(format!(
                "layer groups {} vs {}",
                self.groups.n_groups(),
                other.groups.n_groups()
            ));
        }
        match diffs.is_empty() {
            true => Ok(()),
            false => Err(EngineError::LayoutMismatch(diffs.join(", "))),
        }
    }
}

/// A sequence's KV, detached from any cache: one frame per layer.
#[derive(Debug, Clone)]
pub struct KvExport {
    pub layout: KvLayout,
    pub tokens: usize,
    /// `layers[l]` = K regions of every block, then V regions, in `layout.dtype`.
    pub layers: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, Copy)]
pub struct KvCacheConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

impl KvCacheConfig {
    /// As many blocks as fit in `budget_bytes`; `geometry` = (layers a block holds, KV
    /// heads, head dim).
    pub fn from_budget(
        budget_bytes: usize,
        block_size: usize,
        dtype: KvDtype,
        geometry: (usize, usize, usize),
    ) -> Self {
        let (layers, kv_heads, head_dim) = geometry;
        let block_bytes = 2 * layers * kv_heads * head_dim * block_size * dtype.size();
        Self {
            block_size,
            num_blocks: budget_bytes / block_bytes.max(1),
            dtype,
        }
    }
}

pub(crate) enum Storage {
    F32(PoolVec<f32>),
    F16(PoolVec<f16>),
}

impl Storage {
    /// The pool's memory (what leases and pins hold a share of).
    pub(super) fn memory(&self) -> &Arc<PoolMemory> {
        match self {
            Storage::F32(v) => v.memory(),
            Storage::F16(v) => v.memory(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F16(v) => v.len(),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct Sequence {
    pub(super) blocks: Vec<BlockId>,
    pub(super) len: usize,
    /// Hashes of the sequence's first full blocks, as far as they were computed
    /// (prefix cache; the hash chain of a growing sequence is extended, never redone).
    pub(super) hashes: Vec<BlockHash>,
    /// Local attention with sinks (`None`: full attention).
    pub(super) window: Option<Window>,
    /// Logical blocks dropped after the sink blocks (windowed sequences only).
    pub(super) dropped: usize,
    /// Positions a SnapKV-compressed sequence's tokens sit ahead of their slots: the next
    /// token goes in slot `len` and is rotated at position `len + shift` (`super::snapkv`).
    pub(super) shift: usize,
    /// The tables of layer groups 1.. (group 0's are `blocks` and `dropped`).
    pub(super) groups: Vec<GroupTable>,
}

impl Sequence {
    /// Where logical block `i` sits in `blocks` (`None`: dropped).
    pub(super) fn physical(&self, i: usize, block_size: usize) -> Option<usize> {
        let sinks = self
            .window
            .map_or(usize::MAX, |w| w.sink_blocks(block_size));
        if i < sinks {
            Some(i)
        } else if i < sinks + self.dropped {
            None
        } else {
            Some(i - self.dropped)
        }
    }
}

pub struct KvCache {
    pub(super) layout: KvLayout,
    pub(super) storage: Storage,
    pub(super) alloc: BlockAllocator,
    pub(super) seqs: HashMap<SeqId, Sequence>,
    /// The prefix cache's index and lower tiers (`None`: disabled).
    pub(super) prefix: Option<PrefixState>,
    /// The candle engine's copy of the pool on its device, and which blocks' host bytes
    /// changed since it last copied them (`super::device_sync`).
    pub(super) device: DeviceSync,
    /// Senders' pins on blocks (`kv::pins`), and the blocks whose last reference waits for
    /// their pins to go.
    pub(super) pins: Arc<PinCounts>,
    pub(super) unpinning: Vec<BlockId>,
}

impl KvCache {
    /// A pool of `num_blocks` blocks (plus, for a grouped layout, the null block that
    /// stands for a local group's dropped blocks: zeroed, never written).
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let n = Self::pool_elems(&layout, num_blocks);
        // Zeroed allocations are lazy: pages become resident when written.
        let storage = match layout.dtype {
            KvDtype::F32 => Storage::F32(PoolVec::zeroed(n)),
            KvDtype::F16 => Storage::F16(PoolVec::zeroed(n)),
        };
        Self::with_storage(layout, num_blocks, storage)
    }

    /// [`KvCache::new`] in memory `backing` lends (zeroed, at least
    /// [`KvCache::memory_bytes`] long): a prefill worker's pool in its shared-memory send
    /// arena, which same-host decode workers read from.
    pub fn new_in(layout: KvLayout, num_blocks: usize, backing: PoolBacking) -> Result<Self> {
        let n = Self::pool_elems(&layout, num_blocks);
        let storage = match layout.dtype {
            KvDtype::F32 => PoolVec::lent(n, backing).map(Storage::F32),
            KvDtype::F16 => PoolVec::lent(n, backing).map(Storage::F16),
        };
        let Some(storage) = storage else {
            return Err(EngineError::invalid(
                "kv_pool",
                format!(
                    "the memory lent to a pool of {num_blocks} blocks is shorter than {} bytes or misaligned",
                    Self::memory_bytes(&layout, num_blocks)
                ),
            ));
        };
        Ok(Self::with_storage(layout, num_blocks, storage))
    }

    /// Bytes of memory a pool of `num_blocks` blocks of `layout` takes.
    pub fn memory_bytes(layout: &KvLayout, num_blocks: usize) -> usize {
        Self::pool_elems(layout, num_blocks) * layout.dtype.size()
    }

    fn pool_elems(layout: &KvLayout, num_blocks: usize) -> usize {
        let null = usize::from(layout.groups.is_grouped());
        (num_blocks + null) * layout.block_elems()
    }

    fn with_storage(layout: KvLayout, num_blocks: usize, storage: Storage) -> Self {
        let null = usize::from(layout.groups.is_grouped());
        Self {
            layout,
            storage,
            alloc: BlockAllocator::new(num_blocks),
            seqs: HashMap::new(),
            prefix: None,
            device: DeviceSync::default(),
            pins: PinCounts::new(num_blocks + null),
            unpinning: Vec::new(),
        }
    }

    /// Touch every page of the pool so that it is resident (for memory measurements; a new
    /// pool is allocated lazily by the OS). Block by block, and not at all while a lease or a
    /// pin shares the pool (a receiver or a sender may be using some of its blocks).
    pub fn prefault(&mut self) {
        if Arc::strong_count(self.storage.memory()) > 1 {
            return;
        }
        let n = self.layout.block_elems();
        for b in 0..self.storage.len() / n.max(1) {
            let r = b * n..(b + 1) * n;
            match &mut self.storage {
                Storage::F32(v) => v[r].iter_mut().step_by(1024).for_each(|x| *x = 0.0),
                Storage::F16(v) => v[r].iter_mut().step_by(2048).for_each(|x| *x = f16::ZERO),
            }
        }
    }

    /// Bytes of the block pool.
    pub fn pool_bytes(&self) -> usize {
        self.total_blocks() * self.layout.block_bytes()
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn block_size(&self) -> usize {
        self.layout.block_size
    }

    pub fn total_blocks(&self) -> usize {
        self.alloc.total_blocks()
    }

    pub fn free_blocks(&self) -> usize {
        self.alloc.free_blocks()
    }

    pub fn used_blocks(&self) -> usize {
        self.alloc.used_blocks()
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.block_size)
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    pub fn sequence_len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// The blocks a sequence holds, in order (a windowed sequence's dropped blocks are not
    /// among them).
    pub fn sequence_blocks(&self, id: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(id)?.blocks)
    }

    pub(super) fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))
    }

    /// Sequence `id`, which must hold no token yet (`field` names what the caller sets).
    pub(super) fn empty_seq_mut(
        &mut self,
        id: SeqId,
        field: &'static str,
    ) -> Result<&mut Sequence> {
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if s.len != 0 || !s.blocks.is_empty() {
            return Err(EngineError::invalid(
                field,
                format!("sequence {id} already holds tokens"),
            ));
        }
        Ok(s)
    }

    pub fn add_sequence(&mut self, id: SeqId) -> Result<()> {
        if self.seqs.contains_key(&id) {
            return Err(EngineError::invalid(
                "sequence",
                format!("sequence {id} exists"),
            ));
        }
        let groups = vec![GroupTable::default(); self.layout.groups.n_groups() - 1];
        self.seqs.insert(
            id,
            Sequence {
                groups,
                ..Sequence::default()
            },
        );
        Ok(())
    }

    /// Release every block of a sequence. Unknown ids are a no-op, so a
    /// release after a failure is always safe. Blocks go back last first: cached ones then
    /// enter the eviction order tail first, so a prefix loses its ends before its head
    /// (a prefix whose first block is gone cannot be found at all).
    pub fn free_sequence(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            // Other groups' blocks first: a global prefix outlives their windows.
            for b in s
                .groups
                .into_iter()
                .rev()
                .flat_map(|g| g.blocks.into_iter().rev())
            {
                self.release_block(b);
            }
            for b in s.blocks.into_iter().rev() {
                self.release_block(b);
            }
        }
    }

    /// A new sequence sharing every block of `src` (reference counts).
    pub fn fork(&mut self, src: SeqId, dst: SeqId) -> Result<()> {
        if self.seqs.contains_key(&dst) {
            return Err(EngineError::invalid(
                "sequence",
                format!("sequence {dst} exists"),
            ));
        }
        let s = self.seq(src)?.clone();
        for &b in s
            .blocks
            .iter()
            .chain(s.groups.iter().flat_map(|g| &g.blocks))
        {
            self.alloc.retain(b);
        }
        self.seqs.insert(dst, s);
        Ok(())
    }

    /// Takes `n` blocks (all or none). Cached blocks the allocator had to evict leave the
    /// prefix index here, before anyone writes into them, and move to the host tier.
    pub(super) fn allocate_blocks(&mut self, n: usize) -> Result<Vec<BlockId>> {
        let blocks = self.alloc.allocate(n)?;
        self.on_evicted();
        Ok(blocks)
    }

    /// Zeroes the fresh block `b` when a sequence of `tokens` tokens leaves it partly
    /// filled (every other fresh block is written whole), so its slots past the sequence's
    /// end hold nothing of the sequence that had the block before: what a sender moves of
    /// a last block, and an int8 scale taken over its every slot, depend on this sequence
    /// alone.
    pub(super) fn zero_if_partial(&mut self, b: BlockId, tokens: usize) {
        if tokens.is_multiple_of(self.layout.block_size) {
            return;
        }
        self.device.host_wrote(b);
        let (o, n) = self.block_span(b);
        match &mut self.storage {
            Storage::F32(d) => d[o..o + n].fill(0.0),
            Storage::F16(d) => d[o..o + n].fill(half::f16::ZERO),
        }
    }

    /// Elements of one whole block (its group's layers, K and V), and where it starts.
    fn block_span(&self, b: BlockId) -> (usize, usize) {
        let n = self.layout.block_elems();
        (b as usize * n, n)
    }

    /// The bytes of one whole block (its group's layers, K and V): what the lower tiers
    /// hold.
    pub(super) fn block_bytes(&self, b: BlockId) -> &[u8] {
        let (o, n) = self.block_span(b);
        match &self.storage {
            Storage::F32(d) => bytemuck::cast_slice(&d[o..o + n]),
            Storage::F16(d) => bytemuck::cast_slice(&d[o..o + n]),
        }
    }

    pub(super) fn block_bytes_mut(&mut self, b: BlockId) -> &mut [u8] {
        self.device.host_wrote(b);
        let (o, n) = self.block_span(b);
        match &mut self.storage {
            Storage::F32(d) => bytemuck::cast_slice_mut(&mut d[o..o + n]),
            Storage::F16(d) => bytemuck::cast_slice_mut(&mut d[o..o + n]),
        }
    }

    /// Where the region of `layer` (which must be of `block`'s group) starts.
    pub(crate) fn region_offset(&self, block: BlockId, layer: usize, kind: KvKind) -> usize {
        let member = self.layout.groups.member_of(layer);
        ((block as usize * self.layout.groups.per_group + member) * 2 + kind as usize)
            * self.layout.region_elems()
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    pub(super) fn copy_block(&mut self, from: BlockId, to: BlockId) {
        self.device.host_wrote(to);
        let (a, n) = self.block_span(from);
        let (b, _) = self.block_span(to);
        match &mut self.storage {
            Storage::F32(v) => v.copy_within(a..a + n, b),
            Storage::F16(v) => v.copy_within(a..a + n, b),
        }
    }

    /// Write one token's K and V (`[kv_head][head_dim]` each) for one layer.
    pub(crate) fn write_token(
        &mut self,
        block: BlockId,
        slot: usize,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        let ko = self.region_offset(block, layer, KvKind::K);
        let vo = self.region_offset(block, layer, KvKind::V);
        self.device.host_wrote(block);
        for h in 0..self.layout.n_kv_heads {
            let at = (h * bs + slot) * hd;
            let (ks, vs) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            match &mut self.storage {
                Storage::F32(d) => {
                    d[ko + at..ko + at + hd].copy_from_slice(ks);
                    d[vo + at..vo + at + hd].copy_from_slice(vs);
                }
                Storage::F16(d) => {
                    for (dst, src) in d[ko + at..ko + at + hd].iter_mut().zip(ks) {
                        *dst = f16::from_f32(*src);
                    }
                    for (dst, src) in d[vo + at..vo + at + hd].iter_mut().zip(vs) {
                        *dst = f16::from_f32(*src);
                    }
                }
            }
        }
    }

    /// The bytes of one region, for a zero-copy sender.
    pub fn region_bytes(&self, block: BlockId, layer: usize, kind: KvKind) -> &[u8] {
        let o = self.region_offset(block, layer, kind);
        let n = self.layout.region_elems();
        match &self.storage {
            Storage::F32(d) => bytemuck::cast_slice(&d[o..o + n]),
            Storage::F16(d) => bytemuck::cast_slice(&d[o..o + n]),
        }
    }

    /// The bytes of one region, for a receiver that writes in place.
    pub fn region_bytes_mut(&mut self, block: BlockId, layer: usize, kind: KvKind) -> &mut [u8] {
        self.device.host_wrote(block);
        let o = self.region_offset(block, layer, kind);
        let n = self.layout.region_elems();
        match &mut self.storage {
            Storage::F32(d) => bytemuck::cast_slice_mut(&mut d[o..o + n]),
            Storage::F16(d) => bytemuck::cast_slice_mut(&mut d[o..o + n]),
        }
    }
}
