//! duet's forward pass over the paged KV cache.
//!
//! One call runs any mix of sequences: a prefill chunk is a run of rows of one
//! sequence, a decode step is one row per sequence. The dense parts
//! (projections, MLP) run over all rows of the batch at once; attention runs
//! per (row, head) over that row's own sequence blocks, so sequences at
//! different positions share one forward.

use std::ops::ControlFlow;

use half::f16;
use rayon::prelude::*;

use crate::attention_gemm;
use crate::attention_window::{windowed_row, Queries};
pub(crate) use crate::checks::check_chunk_fits;
pub use crate::checks::{check_prompt, check_token_ids};
use crate::error::{EngineError, Result};
use crate::kernels;
use crate::kernels::ggml::DotOrder;
use crate::kv::cache::Storage;
use crate::kv::{BlockId, KvCache, KvKind, SeqId, Window};
use crate::linear::KernelRows;
use crate::model::Model;

/// A run of new tokens for one sequence.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// Whether to compute the logits of the chunk's last token (the last
    /// chunk of a prefill, every decode step).
    pub logits: bool,
    /// Whether these tokens are (part of) a prompt rather than a decode step.
    /// Prompt rows reduce attention in the order llama.cpp uses for a
    /// multi-token batch, decode rows in its single-token order, whatever the
    /// chunking or the batch they run in.
    pub prompt: bool,
}

impl<'a> SeqChunk<'a> {
    /// Logits wanted; a prompt chunk when it has several tokens, a decode
    /// step when it has one.
    pub fn new(seq: SeqId, tokens: &'a [u32]) -> Self {
        Self {
            seq,
            tokens,
            logits: true,
            prompt: tokens.len() > 1,
        }
    }

    /// Part of a prompt of `prompt_len` tokens; `logits` on its last chunk.
    /// A one-token prompt is one row, as a decode step is, so it takes the
    /// decode order (llama.cpp's batch of one token does).
    pub fn prompt(seq: SeqId, tokens: &'a [u32], logits: bool, prompt_len: usize) -> Self {
        Self {
            seq,
            tokens,
            logits,
            prompt: prompt_len > 1,
        }
    }
}

struct Row {
    chunk: usize,
    prompt: bool,
    pos: usize,
    block: BlockId,
    slot: usize,
    /// The sequence's local window when this row's view is masked by it (`kv::window`):
    /// the row attends to the sinks with its query rotated at the cache position, and to
    /// its window with its own.
    masked: Option<Window>,
}

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
    data: &[T],
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

/// RMSNorm as ggml computes it: squares summed in f64 in order, the mean
/// and the scale in f32. The result is quantized to 8 bits next, where one
/// ulp of difference can move a value to the neighbouring grid point, so
/// matching ggml bit for bit here keeps duet on llama.cpp's trajectory.
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let ss = xr.iter().fold(0f64, |s, &v| s + f64::from(v * v));
        let mean = (ss / w.len() as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// Rotate adjacent pairs (GGUF llama's layout) of every head in `x`, with
/// the fused multiply-adds GCC makes of ggml's `x0*cos - x1*sin` and
/// `x0*sin + x1*cos` (bit-identical to llama.cpp's CPU build).
fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (i, pair) in head.chunks_exact_mut(2).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a.mul_add(cos[i], -(b * sin[i]));
            pair[1] = a.mul_add(sin[i], b * cos[i]);
        }
    }
}

/// ggml's RoPE angles: `theta_scale = base^(-2/dims)` in f32, and each
/// pair's angle the previous one times it, in f32.
fn rope_angles(pos: usize, theta_base: f32, head_dim: usize, cos: &mut [f32], sin: &mut [f32]) {
    let scale = theta_base.powf(-2.0 / head_dim as f32);
    let mut theta = pos as f32;
    for (c, s) in cos.iter_mut().zip(sin.iter_mut()) {
        *c = theta.cos();
        *s = theta.sin();
        theta *= scale;
    }
}

/// The per-layer hook of a forward, on either engine: called with `(l, cache)` once layer
/// `l`'s KV is in the cache; `Break` stops the forward there.
pub type LayerHook<'h> = dyn FnMut(usize, &KvCache) -> ControlFlow<()> + Send + 'h;

impl Model {
    /// Run new tokens of several sequences through the model, writing their
    /// KV into `cache`. Returns, per chunk, the logits of its last token
    /// (empty when the chunk asked for none). `on_layer(l, cache)` runs after
    /// layer `l`'s KV is in the cache: a prefill worker streams it from there
    /// while the next layer computes. When it returns `Break` the forward ends
    /// there with [`EngineError::Stopped`] and no token is committed (the
    /// caller frees the sequences: nobody waits for them).
    pub fn forward_with(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_inner(cache, batch, on_layer, false)
    }

    /// One prompt chunk of one sequence with the logits of **every** row: `out[r]` predicts
    /// token `r + 1` of the chunk (perplexity). The output head runs over all rows at once,
    /// as llama.cpp's does when it keeps every position's logits.
    pub fn forward_every_row(
        &self,
        cache: &mut KvCache,
        chunk: SeqChunk<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_inner(cache, &[chunk], &mut |_, _| ControlFlow::Continue(()), true)
    }

    fn forward_inner(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
        every_row: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let layout = cache.layout().clone();
        if (layout.n_layers, layout.n_kv_heads, layout.head_dim)
            != (c.n_layers, c.n_kv_heads, c.head_dim)
        {
            return Err(EngineError::LayoutMismatch(format!(
                "cache holds {}x{}x{}, model needs {}x{}x{}",
                layout.n_layers,
                layout.n_kv_heads,
                layout.head_dim,
                c.n_layers,
                c.n_kv_heads,
                c.head_dim
            )));
        }
        for ch in batch {
            self.check_chunk(cache, ch)?;
        }
        // Reserve all blocks before computing anything.
        let mut starts = Vec::with_capacity(batch.len());
        for ch in batch {
            starts.push(cache.prepare_append(ch.seq, ch.tokens.len())?);
        }
        let bs = layout.block_size;
        let tables: Vec<Vec<BlockId>> = batch
            .iter()
            .map(|ch| cache.logical_table(ch.seq))
            .collect::<Result<_>>()?;
        let windows: Vec<Option<Window>> = batch
            .iter()
            .map(|ch| cache.window(ch.seq))
            .collect::<Result<_>>()?;
        let mut rows = Vec::new();
        let mut tokens = Vec::new();
        for (i, ch) in batch.iter().enumerate() {
            for (j, &t) in ch.tokens.iter().enumerate() {
                let pos = starts[i] + j;
                rows.push(Row {
                    chunk: i,
                    prompt: ch.prompt,
                    pos,
                    block: tables[i][pos / bs],
                    slot: pos % bs,
                    masked: windows[i].filter(|w| w.masks(pos)),
                });
                tokens.push(t);
            }
        }
        // A forward made only of prompt chunks, one of which continues its sequence (chunked
        // prefill, a cached prefix), picks its weight kernels as a forward over the whole
        // prompt would (by the rows up to the longest chunk's end), so the KV and the logits
        // do not depend on how the prompt was cut.
        let continues = batch.iter().all(|c| c.tokens.len() >= 2) && starts.iter().any(|&s| s > 0);
        let decode = batch.iter().all(|c| c.tokens.len() == 1 && !c.prompt);
        let kernel_rows = match (decode, continues) {
            (true, _) => KernelRows::Decode,
            (false, true) => KernelRows::As {
                n: batch
                    .iter()
                    .zip(&starts)
                    .map(|(c, s)| s + c.tokens.len())
                    .max()
                    .unwrap_or(0)
                    .max(rows.len()),
                // One continuing chunk: its rows are the prompt's rows from its start.
                first: match starts.as_slice() {
                    [s] => *s,
                    _ => 0,
                },
            },
            (false, false) => KernelRows::As {
                n: rows.len(),
                first: 0,
            },
        };
        let logits = self.pool.install(|| {
            let sel = (kernel_rows, every_row);
            self.run_layers(cache, batch, &rows, &tokens, &tables, sel, on_layer)
        })?;
        for ch in batch {
            cache.commit_append(ch.seq, ch.tokens.len())?;
        }
        Ok(logits)
    }

    /// Whether `ch` can be computed on its own: tokens inside the vocabulary, a sequence the
    /// cache knows, within the context. [`Self::forward_with`] checks every chunk this way
    /// before it changes anything, so a caller whose batch failed can tell which of its
    /// sequences is to blame and go on with the others.
    pub fn check_chunk(&self, cache: &KvCache, ch: &SeqChunk<'_>) -> Result<()> {
        let len = cache.sequence_len(ch.seq)?;
        // A windowed sequence's queries never look further back than its window and sinks,
        // which fit in the context: it may grow past the context.
        let bounded = cache.window(ch.seq)?.is_none();
        check_chunk_fits(&self.config, len, ch.tokens, bounded)
    }

    /// [`Self::forward_with`] without a per-layer hook.
    pub fn forward(&self, cache: &mut KvCache, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        self.forward_with(cache, batch, &mut |_, _| ControlFlow::Continue(()))
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layers(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        rows: &[Row],
        tokens: &[u32],
        tables: &[Vec<BlockId>],
        (kernel_rows, every_row): (KernelRows, bool),
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let (d, hd, n) = (c.hidden, c.head_dim, rows.len());
        let (q_dim, kv_dim) = (c.n_heads * hd, c.n_kv_heads * hd);
        let mut x = vec![0f32; n * d];
        for (xr, &t) in x.chunks_exact_mut(d).zip(tokens) {
            self.embed.dequant_row(t as usize, xr);
        }
        // RoPE tables per row.
        let half = hd / 2;
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for (r, row) in rows.iter().enumerate() {
            let span = r * half..(r + 1) * half;
            rope_angles(
                row.pos,
                c.rope_theta,
                hd,
                &mut cos[span.clone()],
                &mut sin[span],
            );
        }
        // Masked rows' queries for the sinks, rotated at their cache position.
        let masked = rows.iter().any(|r| r.masked.is_some());
        let (mut sink_cos, mut sink_sin) = (Vec::new(), Vec::new());
        if masked {
            (sink_cos, sink_sin) = (vec![0f32; n * half], vec![0f32; n * half]);
            for (r, row) in rows.iter().enumerate() {
                if let Some(w) = row.masked {
                    let span = r * half..(r + 1) * half;
                    let (cs, sn) = (&mut sink_cos[span.clone()], &mut sink_sin[span]);
                    rope_angles(w.sink_query_pos(row.pos), c.rope_theta, hd, cs, sn);
                }
            }
        }
        let mut sink_q = vec![0f32; if masked { n * q_dim } else { 0 }];
        let mut xn = vec![0f32; n * d];
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut xn);
            let mut qkv = layer.wqkv.forward_with(&xn, n, kernel_rows)?;
            let stride = q_dim + 2 * kv_dim;
            if masked {
                for (r, row) in rows.iter().enumerate() {
                    if row.masked.is_some() {
                        let q = &mut sink_q[r * q_dim..(r + 1) * q_dim];
                        q.copy_from_slice(&qkv[r * stride..r * stride + q_dim]);
                        let span = r * half..(r + 1) * half;
                        rope(q, hd, &sink_cos[span.clone()], &sink_sin[span]);
                    }
                }
            }
            for (r, row) in qkv.chunks_exact_mut(stride).enumerate() {
                let (cs, sn) = (
                    &cos[r * half..(r + 1) * half],
                    &sin[r * half..(r + 1) * half],
                );
                let (q, kv) = row.split_at_mut(q_dim);
                rope(q, hd, cs, sn);
                rope(&mut kv[..kv_dim], hd, cs, sn);
            }
            for (row, r) in qkv.chunks_exact(stride).zip(rows) {
                let (k, v) = (&row[q_dim..q_dim + kv_dim], &row[q_dim + kv_dim..]);
                cache.write_token(r.block, r.slot, l, k, v);
            }
            let queries = Queries {
                qkv: &qkv,
                stride,
                sink_q: &sink_q,
            };
            let attn = self.attention(cache, l, &queries, rows, tables, batch)?;
            let o = layer.wo.forward_with(&attn, n, kernel_rows)?;
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            if on_layer(l, cache).is_break() {
                return Err(EngineError::Stopped { layer: l });
            }
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut xn);
            let gu = layer.w_gate_up.forward_with(&xn, n, kernel_rows)?;
            let f = c.ffn_hidden;
            let mut h = vec![0f32; n * f];
            for (hr, gur) in h.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
                let (g, u) = gur.split_at(f);
                for ((o, &gv), &uv) in hr.iter_mut().zip(g).zip(u) {
                    *o = kernels::ggml::silu(gv) * uv;
                }
            }
            let down = layer.w_down.forward_with(&h, n, kernel_rows)?;
            for (a, b) in x.iter_mut().zip(&down) {
                *a += b;
            }
        }
        // Logits only for the last row of the chunks that want them (or of every row).
        let mut want = Vec::new();
        let mut end = 0;
        for (i, ch) in batch.iter().enumerate() {
            end += ch.tokens.len();
            if ch.logits && !every_row {
                want.push((i, end - 1));
            }
        }
        if every_row {
            want = (0..n).map(|r| (r, r)).collect();
        }
        let mut out = vec![Vec::new(); want.len().max(batch.len())];
        if want.is_empty() {
            return Ok(out);
        }
        let mut sel = Vec::with_capacity(want.len() * d);
        for &(_, r) in &want {
            sel.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut seln = vec![0f32; sel.len()];
        rms_norm(&sel, &self.out_norm, c.rms_eps, &mut seln);
        let head_rows = match kernel_rows {
            KernelRows::Decode => KernelRows::Decode,
            KernelRows::As { .. } => KernelRows::As {
                n: want.len(),
                first: 0,
            },
        };
        let logits = self.output.forward_with(&seln, want.len(), head_rows)?;
        for (&(i, _), lg) in want.iter().zip(logits.chunks_exact(c.vocab_size)) {
            out[i] = lg.to_vec();
        }
        Ok(out)
    }

    fn attention(
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
                return Ok(self.attention_t(cache, data, layer, q, rows, tables, &[]))
            }
            Storage::F32(data) => data,
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
        data: &[T],
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
        let scale = 1.0 / (hd as f32).sqrt();
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
            let mut scores = Vec::with_capacity(n);
            let mut kbuf = vec![0f32; hd];
            // Block by block: one offset computation per block, not per token.
            for (bi, &b) in table.iter().enumerate().take(n.div_ceil(bs)) {
                let base = cache.region_offset(b, layer, KvKind::K) + g * bs * hd;
                let count = bs.min(n - bi * bs);
                let k = &data[base..base + count * hd];
                if !kernels::attention_scores(qk, &q, k, scale, &mut scores) {
                    for k in k.chunks_exact(hd) {
                        scores.push(qk.dot(&q, T::as_f32(k, &mut kbuf)) * scale);
                    }
                }
            }
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
            let v_bases: Vec<usize> = table[..n.div_ceil(bs)]
                .iter()
                .map(|&b| cache.region_offset(b, layer, KvKind::V) + g * bs * hd)
                .collect();
            if !kernels::attention_pv(lanes, &scores, data, &v_bases, bs, &mut acc) {
                // Lane by lane: each lane's row accumulates its positions (`lane`,
                // `lane + lanes`, ...) in ggml's order.
                for (lane, row) in acc.chunks_exact_mut(hd).enumerate().take(n) {
                    let terms = (lane..n)
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
