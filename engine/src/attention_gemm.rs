//! Prefill attention as matrix products: for a chunk of many rows of one
//! sequence, `softmax(Q K^T / sqrt(d)) V` per KV head with a GEMM, instead of
//! one dot product per (row, head, position). Used for f32 caches: in a prompt chunk (two
//! rows or more), the rows at position `MIN_ROWS - 1` and later take this path, the
//! earlier ones the per-row path. Results equal the per-row path up to floating-point
//! summation order.
//!
//! Why the choice depends on a row's position and not on the chunk's size: a row's result
//! then does not depend on how its prompt was cut into chunks. A prompt computed in one
//! chunk, in several chunks (chunked prefill), or after a cached prefix (prefix cache) takes
//! the same kernel for the same row, and the GEMMs' sums run over the same keys in the same
//! order (trailing masked keys add exact zeros), so its KV and logits are bit-identical.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::error::Result;
use crate::kv::{BlockId, KvCache, KvKind, KvView};

/// Rows at positions `MIN_ROWS - 1` and later (those that see at least `MIN_ROWS` keys)
/// take the GEMM path.
pub const MIN_ROWS: usize = 32;

/// The first position of a chunk of `rows` rows starting at `start` that takes the GEMM
/// path (`None`: no row does). Single rows (decode steps) never do.
pub fn gemm_from(start: usize, rows: usize) -> Option<usize> {
    let from = start.max(MIN_ROWS - 1);
    (rows >= 2 && from < start + rows).then_some(from)
}

pub struct ChunkRows<'a> {
    /// Index of the chunk's first row in the batch.
    pub first_row: usize,
    pub rows: usize,
    /// Position of the chunk's first token.
    pub start_pos: usize,
    pub table: &'a [BlockId],
}

pub struct Dims {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies `q . k` (`Architecture::attn_scale`).
    pub scale: f32,
}

/// Gather one KV head's keys or values for positions `0..n`, row-major.
fn gather(
    cache: &KvCache,
    data: KvView<'_, f32>,
    layer: usize,
    kind: KvKind,
    g: usize,
    table: &[BlockId],
    n: usize,
) -> Vec<f32> {
    let (bs, hd) = (cache.block_size(), cache.layout().head_dim);
    let mut out = Vec::with_capacity(n * hd);
    for t in 0..n {
        let off = cache.region_offset(table[t / bs], layer, kind) + (g * bs + t % bs) * hd;
        out.extend_from_slice(&data[off..off + hd]);
    }
    out
}

/// Write the attention output of `chunk`'s rows into `out` (`[rows][heads][head_dim]`).
#[allow(clippy::too_many_arguments)]
pub fn chunk_attention(
    cache: &KvCache,
    data: KvView<'_, f32>,
    layer: usize,
    qkv: &[f32],
    stride: usize,
    chunk: &ChunkRows<'_>,
    d: &Dims,
    out: &mut [f32],
) -> Result<()> {
    let (hd, nh) = (d.head_dim, d.n_heads);
    let group = nh / d.n_kv_heads;
    let t_rows = chunk.rows;
    let n = chunk.start_pos + t_rows;
    let scale = d.scale;
    for g in 0..d.n_kv_heads {
        let k = gather(cache, data, layer, KvKind::K, g, chunk.table, n);
        let v = gather(cache, data, layer, KvKind::V, g, chunk.table, n);
        // The group's query heads stacked: row j * T + i is head g*group+j of row i.
        let mut q = Vec::with_capacity(group * t_rows * hd);
        for j in 0..group {
            let h = g * group + j;
            for i in 0..t_rows {
                let r = chunk.first_row + i;
                q.extend_from_slice(&qkv[r * stride + h * hd..r * stride + (h + 1) * hd]);
            }
        }
        let qt = Tensor::from_vec(q, (group * t_rows, hd), &Device::Cpu)?;
        let kt = Tensor::from_vec(k, (n, hd), &Device::Cpu)?;
        let mut s = qt.matmul(&kt.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        // Causal softmax per row: row i sees positions 0..=start_pos+i.
        s.par_chunks_mut(n).enumerate().for_each(|(row, sr)| {
            let visible = chunk.start_pos + row % t_rows + 1;
            let (seen, hidden) = sr.split_at_mut(visible);
            let max = seen
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
            let mut sum = 0f32;
            for x in seen.iter_mut() {
                *x = (*x * scale - max).exp();
                sum += *x;
            }
            let inv = 1.0 / sum;
            seen.iter_mut().for_each(|x| *x *= inv);
            hidden.iter_mut().for_each(|x| *x = 0.0);
        });
        let p = Tensor::from_vec(s, (group * t_rows, n), &Device::Cpu)?;
        let vt = Tensor::from_vec(v, (n, hd), &Device::Cpu)?;
        let o = p.matmul(&vt)?.flatten_all()?.to_vec1::<f32>()?;
        for j in 0..group {
            let h = g * group + j;
            for i in 0..t_rows {
                let dst = (chunk.first_row + i) * nh * hd + h * hd;
                let src = (j * t_rows + i) * hd;
                out[dst..dst + hd].copy_from_slice(&o[src..src + hd]);
            }
        }
    }
    Ok(())
}
