//! The paged KV pool on a candle device: per layer one f16 tensor for K and one for V, each
//! `blocks x block_size x (kv_heads * head_dim)` (stored as `blocks * block_size` rows), and
//! the same block accounting as the CPU cache ([`BlockAllocator`]: all-or-none allocation,
//! reference counts, `free + used == total`).
//!
//! Invariants:
//! - A sequence's token `p` lives in row `table[p / block_size] * block_size + p % block_size`
//!   of every layer's tensors; rows of free blocks are never read.
//! - Writes happen in place ([`Tensor::slice_set`]) one run of consecutive rows at a time
//!   (at most one run per block a chunk touches); reads gather a sequence's rows with
//!   `index_select`, so attention sees exactly its own positions in order.
//! - Blocks are reserved for a chunk before any layer is computed
//!   ([`DevicePool::prepare_append`]) and the sequence's length grows only after the whole
//!   forward ([`DevicePool::commit_append`]): a failed forward leaves the length as it was.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};
use crate::kv::{BlockAllocator, BlockId, SeqId};

struct Sequence {
    blocks: Vec<BlockId>,
    len: usize,
}

/// A paged KV pool whose tensors live on one device.
pub struct DevicePool {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    row_width: usize,
    alloc: BlockAllocator,
    seqs: HashMap<SeqId, Sequence>,
}

impl DevicePool {
    /// `blocks` blocks of `block_size` tokens for `layers` layers of `kv_heads * head_dim`
    /// values per token, zeroed, on `device`.
    pub fn new(
        device: &Device,
        layers: usize,
        (kv_heads, head_dim): (usize, usize),
        block_size: usize,
        blocks: usize,
    ) -> Result<Self> {
        let row_width = kv_heads * head_dim;
        if block_size == 0 || blocks == 0 {
            return Err(EngineError::invalid(
                "kv_pool",
                "needs at least one block of at least one token",
            ));
        }
        let zeros = || Tensor::zeros((blocks * block_size, row_width), DType::F16, device);
        let k = (0..layers)
            .map(|_| zeros())
            .collect::<candle_core::Result<_>>()?;
        let v = (0..layers)
            .map(|_| zeros())
            .collect::<candle_core::Result<_>>()?;
        Ok(DevicePool {
            k,
            v,
            block_size,
            kv_heads,
            head_dim,
            row_width,
            alloc: BlockAllocator::new(blocks),
            seqs: HashMap::new(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total_blocks(&self) -> usize {
        self.alloc.total_blocks()
    }

    pub fn free_blocks(&self) -> usize {
        self.alloc.free_blocks()
    }

    /// Bytes the pool's tensors hold on the device.
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.alloc.total_blocks() * self.block_size * self.row_width * 2
    }

    pub fn add_sequence(&mut self, id: SeqId) -> Result<()> {
        if self.seqs.contains_key(&id) {
            return Err(EngineError::invalid("sequence", format!("{id} exists")));
        }
        self.seqs.insert(
            id,
            Sequence {
                blocks: Vec::new(),
                len: 0,
            },
        );
        Ok(())
    }

    /// Frees the sequence's blocks (nothing if it is unknown).
    pub fn free_sequence(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            for b in s.blocks {
                self.alloc.release(b);
            }
        }
    }

    pub fn sequence_len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))
    }

    /// Reserves rows for `n` more tokens (all blocks or none); returns the first new
    /// position.
    pub fn prepare_append(&mut self, id: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(id)?;
        let need = (s.len + n)
            .div_ceil(self.block_size)
            .saturating_sub(s.blocks.len());
        let len = s.len;
        let fresh = self.alloc.allocate(need)?;
        if let Some(s) = self.seqs.get_mut(&id) {
            s.blocks.extend(fresh);
        }
        Ok(len)
    }

    /// The `n` tokens prepared last now hold KV.
    pub fn commit_append(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.block_size;
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if (s.len + n).div_ceil(bs) > s.blocks.len() {
            return Err(EngineError::invalid(
                "tokens",
                "commit beyond reserved blocks",
            ));
        }
        s.len += n;
        Ok(())
    }

    /// Pool rows of positions `from..to` of `id`, in order.
    pub fn rows(&self, id: SeqId, from: usize, to: usize) -> Result<Vec<u32>> {
        let s = self.seq(id)?;
        let bs = self.block_size;
        (from..to)
            .map(|p| {
                let b = s.blocks.get(p / bs).ok_or_else(|| {
                    EngineError::invalid("tokens", format!("position {p} has no block"))
                })?;
                u32::try_from(*b as usize * bs + p % bs)
                    .map_err(|_| EngineError::invalid("kv_pool", "more rows than u32 holds"))
            })
            .collect()
    }

    /// Writes `k` and `v` (`rows.len() x row_width`, any float dtype) of `layer` into
    /// `rows`: one in-place copy per run of consecutive rows.
    pub fn write(&self, layer: usize, rows: &[u32], k: &Tensor, v: &Tensor) -> Result<()> {
        let (k, v) = (k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?);
        let (pk, pv) = (&self.k[layer], &self.v[layer]);
        let mut i = 0;
        while i < rows.len() {
            let mut j = i + 1;
            while j < rows.len() && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            let at = rows[i] as usize;
            pk.slice_set(&k.narrow(0, i, j - i)?.contiguous()?, 0, at)?;
            pv.slice_set(&v.narrow(0, i, j - i)?.contiguous()?, 0, at)?;
            i = j;
        }
        Ok(())
    }

    /// K and V of `layer` at `rows` (an index tensor on the pool's device), as f16
    /// `rows x row_width`.
    pub fn gather(&self, layer: usize, rows: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k[layer].index_select(rows, 0)?,
            self.v[layer].index_select(rows, 0)?,
        ))
    }

    /// Reserves a new sequence `id` for `tokens` tokens whose KV will be imported; its
    /// length is 0 until [`Self::commit_append`].
    pub fn reserve_sequence(&mut self, id: SeqId, tokens: usize) -> Result<()> {
        self.add_sequence(id)?;
        if let Err(e) = self.prepare_append(id, tokens) {
            self.seqs.remove(&id);
            return Err(e);
        }
        Ok(())
    }

    /// One layer of a sequence in the CPU cache's frame format ([`crate::KvCache::export_layer`],
    /// what kv-transfer moves): every block's K region, then every block's V region, each
    /// region f16 `kv_heads x block_size x head_dim` (head-major; the pool is token-major,
    /// so each block is transposed on the device before it is copied out).
    pub fn export_layer(&self, id: SeqId, layer: usize) -> Result<Vec<u8>> {
        let blocks = self.seq(id)?.blocks.clone();
        let (bs, h, d) = (self.block_size, self.kv_heads, self.head_dim);
        let mut out = Vec::with_capacity(2 * blocks.len() * bs * self.row_width * 2);
        for t in [&self.k[layer], &self.v[layer]] {
            for &b in &blocks {
                let region = t
                    .narrow(0, b as usize * bs, bs)?
                    .reshape((bs, h, d))?
                    .transpose(0, 1)?
                    .flatten_all()?
                    .to_vec1::<half::f16>()?;
                out.extend_from_slice(bytemuck::cast_slice(&region));
            }
        }
        Ok(out)
    }

    /// Writes one layer frame in the CPU cache's format (f16, see [`Self::export_layer`])
    /// into a sequence's blocks, checking its length first.
    pub fn import_layer(&self, id: SeqId, layer: usize, frame: &[u8]) -> Result<()> {
        let blocks = &self.seq(id)?.blocks;
        let (bs, h, d) = (self.block_size, self.kv_heads, self.head_dim);
        let region = bs * self.row_width * 2;
        if layer >= self.k.len() || frame.len() != 2 * blocks.len() * region {
            return Err(EngineError::invalid(
                "frame",
                format!(
                    "layer {layer}: {} bytes for {} blocks of {region} bytes (K and V)",
                    frame.len(),
                    blocks.len()
                ),
            ));
        }
        let dev = self.k[layer].device().clone();
        for (i, chunk) in frame.chunks_exact(region).enumerate() {
            let pool = if i < blocks.len() {
                &self.k[layer]
            } else {
                &self.v[layer]
            };
            let b = blocks[i % blocks.len()] as usize;
            let vals: Vec<half::f16> = chunk
                .chunks_exact(2)
                .map(|p| half::f16::from_ne_bytes([p[0], p[1]]))
                .collect();
            let rows = Tensor::from_vec(vals, (h, bs, d), &dev)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((bs, h * d))?;
            pool.slice_set(&rows, 0, b * bs)?;
        }
        Ok(())
    }

    /// The allocator's own consistency check and that every used block belongs to a
    /// sequence (tests).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.alloc.check()?;
        let held: usize = self.seqs.values().map(|s| s.blocks.len()).sum();
        if held != self.alloc.used_blocks() {
            return Err(format!(
                "{held} blocks held by sequences, {} used",
                self.alloc.used_blocks()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_land_in_their_blocks_and_read_back_in_order() {
        let dev = Device::Cpu;
        let mut p = DevicePool::new(&dev, 2, (1, 3), 4, 8).unwrap();
        p.add_sequence(7).unwrap();
        p.add_sequence(9).unwrap();
        // Interleave two sequences so their blocks are not adjacent.
        for (seq, n) in [(7, 5), (9, 2), (7, 4)] {
            let start = p.prepare_append(seq, n).unwrap();
            let rows = p.rows(seq, start, start + n).unwrap();
            let vals: Vec<f32> = (0..n * 3)
                .map(|i| (seq as usize * 100 + start * 3 + i) as f32)
                .collect();
            let k = Tensor::from_vec(vals.clone(), (n, 3), &dev).unwrap();
            let v = (k.clone() * -1.0).unwrap();
            p.write(1, &rows, &k, &v).unwrap();
            p.commit_append(seq, n).unwrap();
        }
        assert_eq!(p.sequence_len(7).unwrap(), 9);
        assert_eq!(p.free_blocks(), 8 - 3 - 1);
        let rows = p.rows(7, 0, 9).unwrap();
        let idx = Tensor::new(rows.as_slice(), &dev).unwrap();
        let (k, v) = p.gather(1, &idx).unwrap();
        let k: Vec<f32> = k
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = (0..27).map(|i| (700 + i) as f32).collect();
        assert_eq!(k, want);
        let v: Vec<f32> = v
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(v[26], -726.0);
        p.check().unwrap();
        p.free_sequence(7);
        p.free_sequence(9);
        assert_eq!(p.free_blocks(), 8);
        p.check().unwrap();
    }

    #[test]
    fn an_allocation_that_does_not_fit_takes_nothing() {
        let mut p = DevicePool::new(&Device::Cpu, 1, (1, 2), 4, 2).unwrap();
        p.add_sequence(1).unwrap();
        let e = p.prepare_append(1, 9).unwrap_err();
        assert!(matches!(e, EngineError::KvExhausted { .. }), "{e}");
        assert_eq!(p.free_blocks(), 2);
        assert_eq!(p.sequence_len(1).unwrap(), 0);
    }
}
