//! Attention of each row over its sequence's paged KV: the per-row path (any KV dtype,
//! decode steps, rows a window masks) in llama.cpp's reduction orders, and the dispatch of
//! long prompt chunks of an f32 cache to matrix products (`attention_gemm`). A local layer
//! (`LayerAttention::Local`) masks the positions before its window as llama.cpp's mask
//! does; rows of a sequence windowed by `kv::window` go to `attention_window`.

use half::f16;
use rayon::prelude::*;

use crate::architecture::LayerAttention;
use crate::attention_gemm;
use crate::attention_window::{windowed_row, Queries};
use crate::error::Result;
use crate::forward::{Row, SeqChunk};
use crate::kernels;
use crate::kernels::ggml::DotOrder;
use crate::kv::cache::Storage;
use crate::kv::{BlockId, KvCache, KvKind, KvView};
use crate::model::Model;

/// A KV storage element, and how llama.cpp's attention treats that storage.
pub(crate) trait KvElem: kernels::KvLanes + Send + Sync {
    /// f16 storage follows llama.cpp's f16 KV path: the query and the softmax
    /// weights are rounded to f16 too before their products, and a
    /// multi-token batch's `QK^T` goes through tinyBLAS. (With f32 storage
    /// the permuted query keeps ggml on its per-row dot product.)
    const F16_PATH: bool;
    /// `src` as f32: itself, or widened into `buf`.
    fn as_f32<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
}

impl KvElem for f32 {
    const F16_PATH: bool = false;
    #[inline]
    fn as_f32<'a>(src: &'a [Self], _: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

impl KvElem for f16 {
    const F16_PATH: bool = true;
    #[inline]
    fn as_f32<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        for (d, s) in buf.iter_mut().zip(src) {
            *d = s.to_f32();
        }
        buf
    }
}

/// `row += p * V[base..]` for each `(base, p)`, in order.
#[inline(always)]
pub(crate) fn accumulate<T: KvElem>(
    row: &mut [f32],
    terms: impl Iterator<Item = (usize, f32)>,
    data: KvView<'_, T>,
    buf: &mut [f32],
) {
    let hd = row.len();
    for (base, p) in terms {
        let v = T::as_f32(&data[base..base + hd], buf);
        for (a, &x) in row.iter_mut().zip(v) {
            *a = p.mul_add(x, *a);
        }
    }
}

impl Model {
    pub(crate) fn attention(
        &self,
        cache: &KvCache,
        layer: usize,
        q: &Queries<'_>,
        rows: &[Row],
        tables: &[Vec<BlockId>],
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>> {
        let data = match cache.storage() {
            Storage::F16(data) => {
                return Ok(self.attention_t(cache, data.view(), layer, q, rows, tables, &[]))
            }
            Storage::F32(data) => data.view(),
        };
        // Prompt rows that see many keys go through matrix products; the rest per row. Rows
        // a window masks go per row whatever their chunk.
        let mut gemm = vec![(usize::MAX, 0); batch.len()];
        let mut chunks = Vec::new();
        let mut first = 0;
        for (i, ch) in batch.iter().enumerate() {
            let start = rows[first].pos;
            let mut end = start + ch.tokens.len();
            // The chunk's last row is its furthest: masked whenever any row is.
            if let Some(w) = rows[first + ch.tokens.len() - 1].masked {
                end = end.min(w.sinks + w.window);
            }
            // A local layer's rows past its window go per row, masked there.
            if let LayerAttention::Local { window } = self.config.arch.layers[layer].attention {
                end = end.min(window);
            }
            if let Some(from) = attention_gemm::gemm_from(start, end.saturating_sub(start)) {
                gemm[i] = (from, end);
                chunks.push(attention_gemm::ChunkRows {
                    first_row: first + (from - start),
                    rows: end - from,
                    start_pos: from,
                    table: &tables[i],
                });
            }
            first += ch.tokens.len();
        }
        let mut out = self.attention_t(cache, data, layer, q, rows, tables, &gemm);
        let c = &self.config;
        let dims = attention_gemm::Dims {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            scale: c.arch.attn_scale,
        };
        for ch in &chunks {
            attention_gemm::chunk_attention(
                cache, data, layer, q.qkv, q.stride, ch, &dims, &mut out,
            )?;
        }
        Ok(out)
    }

    /// Every row's attention output but the rows `gemm` (per chunk, a range of positions)
    /// leaves to matrix products.
    #[allow(clippy::too_many_arguments)]
    fn attention_t<T: KvElem>(
        &self,
        cache: &KvCache,
        data: KvView<'_, T>,
        layer: usize,
        queries: &Queries<'_>,
        rows: &[Row],
        tables: &[Vec<BlockId>],
        gemm: &[(usize, usize)],
    ) -> Vec<f32> {
        let (qkv, stride) = (queries.qkv, queries.stride);
        let c = &self.config;
        let (hd, nh, group) = (c.head_dim, c.n_heads, c.group_size());
        let bs = cache.block_size();
        let scale = c.arch.attn_scale;
        let layer_attention = c.arch.layers[layer].attention;
        // The least common multiple of the block size and 64 (the widest value lanes, a
        // multiple of the softmax's 16-wide groups).
        let skip_unit = bs * 64 / gcd(bs, 64);
        let mut out = vec![0f32; rows.len() * nh * hd];
        out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
            let (r, h) = (idx / nh, idx % nh);
            let row = &rows[r];
            if gemm
                .get(row.chunk)
                .is_some_and(|&(from, to)| (from..to).contains(&row.pos))
            {
                return;
            }
            let g = h / group;
            let mut q = qkv[r * stride + h * hd..r * stride + (h + 1) * hd].to_vec();
            if T::F16_PATH {
                q.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
            }
            if let Some(w) = row.masked {
                let q_dim = nh * hd;
                let mut qs = queries.sink_q[r * q_dim + h * hd..r * q_dim + (h + 1) * hd].to_vec();
                if T::F16_PATH {
                    qs.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
                }
                let table = &tables[row.chunk];
                let at = |t: usize, kind| {
                    cache.region_offset(table[t / bs], layer, kind) + (g * bs + t % bs) * hd
                };
                windowed_row::<T>(data, &q, &qs, w, row.pos, scale, bs, &at, o);
                return;
            }
            // llama.cpp's reduction orders: a multi-token batch's `softmax(QK^T)V`
            // goes through tinyBLAS, a single token's through ggml's dot products.
            let pv = match row.prompt {
                true => DotOrder::Lanes16,
                false => DotOrder::Lanes64,
            };
            let qk = match T::F16_PATH {
                true => pv,
                false => DotOrder::Lanes64,
            };
            let table = &tables[row.chunk];
            let n = row.pos + 1;
            // A local layer masks the positions before its window, as llama.cpp's mask does
            // (-inf scores, whose weights are exact zeros).
            let first = layer_attention.first_seen(row.pos);
            // Positions before `skip` are not visited at all: their weights would be exact
            // zeros in every sum, and `skip` is a multiple of the block size, of the
            // softmax's groups and of the value lanes, so position `t` keeps its group and
            // lane (`skip_unit`) and the result is the bits of the whole masked row.
            let skip = first / skip_unit * skip_unit;
            let mut scores = Vec::with_capacity(n - skip);
            let mut kbuf = vec![0f32; hd];
            // Block by block: one offset computation per block, not per token.
            for (bi, &b) in table
                .iter()
                .enumerate()
                .take(n.div_ceil(bs))
                .skip(skip / bs)
            {
                let count = bs.min(n - bi * bs);
                if (bi + 1) * bs <= first {
                    scores.resize(scores.len() + count, f32::NEG_INFINITY);
                    continue;
                }
                let base = cache.region_offset(b, layer, KvKind::K) + g * bs * hd;
                let k = &data[base..base + count * hd];
                if !kernels::attention_scores(qk, &q, k, scale, &mut scores) {
                    for k in k.chunks_exact(hd) {
                        scores.push(qk.dot(&q, T::as_f32(k, &mut kbuf)) * scale);
                    }
                }
            }
            scores[..first - skip].fill(f32::NEG_INFINITY);
            kernels::ggml::softmax(&mut scores);
            if T::F16_PATH {
                scores
                    .iter_mut()
                    .for_each(|p| *p = f16::from_f32(*p).to_f32());
            }
            // Output element `d` is a dot product over positions: position `t`
            // accumulates into lane `t % lanes`, as in ggml.
            let lanes = pv.lanes();
            let mut acc = vec![0f32; lanes * hd];
            let v_bases: Vec<usize> = table[skip / bs..n.div_ceil(bs)]
                .iter()
                .map(|&b| cache.region_offset(b, layer, KvKind::V) + g * bs * hd)
                .collect();
            if !kernels::attention_pv(lanes, &scores, data, &v_bases, bs, &mut acc) {
                // Lane by lane: each lane's row accumulates its positions (`lane`,
                // `lane + lanes`, ...) in ggml's order.
                for (lane, row) in acc.chunks_exact_mut(hd).enumerate().take(n - skip) {
                    let terms = (lane..n - skip)
                        .step_by(lanes)
                        .map(|t| (v_bases[t / bs] + (t % bs) * hd, scores[t]));
                    accumulate(row, terms, data, &mut kbuf);
                }
            }
            pv.reduce_rows(&acc, o);
        });
        out
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a.max(1),
        _ => gcd(b, a % b),
    }
}
