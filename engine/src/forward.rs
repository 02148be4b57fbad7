//! duet's forward pass over the paged KV cache.
//!
//! One call runs any mix of sequences: a prefill chunk is a run of rows of one
//! sequence, a decode step is one row per sequence. The dense parts
//! (projections, MLP) run over all rows of the batch at once; attention runs
//! per (row, head) over that row's own sequence blocks, so sequences at
//! different positions share one forward.

use std::ops::ControlFlow;

use crate::architecture::Activation;
use crate::attention_window::Queries;
pub(crate) use crate::checks::check_chunk_fits;
pub use crate::checks::{check_prompt, check_token_ids};
use crate::error::{EngineError, Result};
use crate::kernels;
use crate::kv::{AttentionPolicy, BlockId, KvCache, SeqId, Window};
use crate::layer_ops::{rms_norm, rms_norm_in_place, rope, rope_angles};
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
    /// The whole prompt's length when these tokens are part of one (0 otherwise): a prompt
    /// row's weight kernels are those of its row in the whole prompt, however it is cut.
    pub prompt_len: usize,
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
            prompt_len: if tokens.len() > 1 { tokens.len() } else { 0 },
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
            prompt_len: if prompt_len > 1 { prompt_len } else { 0 },
        }
    }
}

pub(crate) struct Row {
    pub(crate) chunk: usize,
    pub(crate) prompt: bool,
    /// The row's slot in its sequence: what it attends up to, where its KV goes.
    pub(crate) pos: usize,
    /// The position its query and key are rotated at: `pos`, or `pos + shift` in a
    /// SnapKV-compressed sequence (`kv::snapkv`).
    rope_pos: usize,
    slot: usize,
    /// The sequence's local window when this row's view is masked by it (`kv::window`):
    /// the row attends to the sinks with its query rotated at the cache position, and to
    /// its window with its own.
    pub(crate) masked: Option<Window>,
}

/// The rotated queries of one sequence's positions `from..` (the end of its prompt), gathered
/// over the forwards that compute them, whatever the chunks: SnapKV's observation window
/// (`crate::snapkv`).
pub struct Observation {
    pub(crate) seq: SeqId,
    /// The first observed position.
    pub(crate) from: usize,
    /// Per layer, the observed rows' queries in position order (`q_dim` each).
    pub(crate) q: Vec<Vec<f32>>,
    /// Positions gathered so far.
    pub(crate) rows: usize,
}

impl Observation {
    /// Observes the last `observe` positions of sequence `seq`'s prompt of `prompt_len`
    /// tokens in a model of `n_layers` layers.
    pub fn new(seq: SeqId, prompt_len: usize, observe: usize, n_layers: usize) -> Self {
        Observation {
            seq,
            from: prompt_len.saturating_sub(observe),
            q: vec![Vec::new(); n_layers],
            rows: 0,
        }
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
        self.forward_inner(cache, batch, on_layer, false, &mut [])
    }

    /// One prompt chunk of one sequence with the logits of **every** row: `out[r]` predicts
    /// token `r + 1` of the chunk (perplexity). The output head runs over all rows at once,
    /// as llama.cpp's does when it keeps every position's logits.
    pub fn forward_every_row(
        &self,
        cache: &mut KvCache,
        chunk: SeqChunk<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_inner(
            cache,
            &[chunk],
            &mut |_, _| ControlFlow::Continue(()),
            true,
            &mut [],
        )
    }

    /// [`Self::forward`] that also gathers, for each of `observed`, the queries of its
    /// sequence's rows at or after its first observed position.
    pub fn forward_observing(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        observed: &mut [Observation],
    ) -> Result<Vec<Vec<f32>>> {
        let mut hook = |_: usize, _: &KvCache| ControlFlow::Continue(());
        self.forward_inner(cache, batch, &mut hook, false, observed)
    }

    /// [`Self::forward_with`] and [`Self::forward_observing`] at once.
    pub fn forward_with_observing(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
        observed: &mut [Observation],
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_inner(cache, batch, on_layer, false, observed)
    }

    fn forward_inner(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
        every_row: bool,
        observe: &mut [Observation],
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
        // `tables[group][chunk]`: each layer indexes its group's table (`kv::groups`).
        let mut tables: Vec<Vec<Vec<BlockId>>> = vec![Vec::new(); layout.groups.n_groups()];
        for ch in batch {
            for (g, t) in cache.logical_tables(ch.seq)?.into_iter().enumerate() {
                tables[g].push(t);
            }
        }
        let windows: Vec<Option<Window>> = batch
            .iter()
            .map(|ch| cache.window(ch.seq))
            .collect::<Result<_>>()?;
        let shifts: Vec<usize> = batch
            .iter()
            .map(|ch| cache.shift(ch.seq))
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
                    rope_pos: pos + shifts[i],
                    slot: pos % bs,
                    masked: windows[i].filter(|w| w.masks(pos)),
                });
                tokens.push(t);
            }
        }
        // A forward made only of prompt chunks, one of which is part of a longer prompt
        // (chunked prefill, a cached prefix), picks its weight kernels as a forward over the
        // whole prompt would (by the whole prompt's rows), so the KV and the logits do not
        // depend on how the prompt was cut.
        let part_of_longer = batch
            .iter()
            .zip(&starts)
            .any(|(c, &s)| s > 0 || c.prompt_len > c.tokens.len());
        let continues = batch.iter().all(|c| c.tokens.len() >= 2 || c.prompt) && part_of_longer;
        let decode = batch.iter().all(|c| c.tokens.len() == 1 && !c.prompt);
        let kernel_rows = match (decode, continues) {
            (true, _) => KernelRows::Decode,
            (false, true) => KernelRows::As {
                n: batch
                    .iter()
                    .zip(&starts)
                    .map(|(c, s)| (s + c.tokens.len()).max(c.prompt_len))
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
            let sel = (kernel_rows, every_row, observe);
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
        let window = cache.window(ch.seq)?;
        if let Some(w) = window {
            self.check_attention(AttentionPolicy::Window(w))?;
        }
        // A compressed sequence's positions run `shift` ahead of its slots.
        let len = len + cache.shift(ch.seq)?;
        check_chunk_fits(&self.config, len, ch.tokens, window.is_none())
    }

    /// Whether this model runs `policy` (a window of valid size on a model whose own layers
    /// all attend globally): `InvalidArgument` for a bad size, `PolicyUnsupported` otherwise.
    pub fn check_attention(&self, policy: AttentionPolicy) -> Result<()> {
        policy.validate(self.config.context_length)?;
        if policy != AttentionPolicy::Full && self.config.arch.has_local_layers() {
            return Err(EngineError::PolicyUnsupported(format!(
                "{policy} on {}, whose own layers attend locally",
                self.config.architecture
            )));
        }
        Ok(())
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
        tables: &[Vec<Vec<BlockId>>],
        (kernel_rows, every_row, observe): (KernelRows, bool, &mut [Observation]),
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let arch = &c.arch;
        let (d, hd, n) = (c.hidden, c.head_dim, rows.len());
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let mut x = vec![0f32; n * d];
        for (xr, &t) in x.chunks_exact_mut(d).zip(tokens) {
            self.embedding_row(t as usize, xr)?;
            if let Some(s) = arch.embed_scale {
                xr.iter_mut().for_each(|v| *v *= s);
            }
        }
        // RoPE tables per row, one set per distinct base of the layers.
        let bases = arch.rope_bases();
        let half = hd / 2;
        let tables_at = |pos: &dyn Fn(&Row) -> Option<usize>| {
            bases
                .iter()
                .map(|&base| {
                    let (mut cos, mut sin) = (vec![0f32; n * half], vec![0f32; n * half]);
                    for (r, row) in rows.iter().enumerate() {
                        if let Some(p) = pos(row) {
                            let span = r * half..(r + 1) * half;
                            rope_angles(p, base, hd, &mut cos[span.clone()], &mut sin[span]);
                        }
                    }
                    (cos, sin)
                })
                .collect::<Vec<_>>()
        };
        let angles = tables_at(&|row| Some(row.rope_pos));
        // Masked rows' queries for the sinks, rotated at their cache position.
        let masked = rows.iter().any(|r| r.masked.is_some());
        let sink_angles = match masked {
            true => tables_at(&|row| row.masked.map(|w| w.sink_query_pos(row.pos))),
            false => Vec::new(),
        };
        let mut sink_q = vec![0f32; if masked { n * q_dim } else { 0 }];
        let mut xn = vec![0f32; n * d];
        for (l, layer) in self.layers.iter().enumerate() {
            let spec = arch.layers[l];
            let base = bases.iter().position(|&b| b == spec.rope_base).unwrap_or(0);
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut xn);
            let mut qkv = layer.wqkv.forward_with(&xn, n, kernel_rows)?;
            let stride = q_dim + 2 * kv_dim;
            if let Some((qn, kn)) = &layer.qk_norm {
                for row in qkv.chunks_exact_mut(stride) {
                    let (q, kv) = row.split_at_mut(q_dim);
                    rms_norm_in_place(q, qn, c.rms_eps);
                    rms_norm_in_place(&mut kv[..kv_dim], kn, c.rms_eps);
                }
            }
            if masked {
                let (sink_cos, sink_sin) = &sink_angles[base];
                for (r, row) in rows.iter().enumerate() {
                    if row.masked.is_some() {
                        let q = &mut sink_q[r * q_dim..(r + 1) * q_dim];
                        q.copy_from_slice(&qkv[r * stride..r * stride + q_dim]);
                        let span = r * half..(r + 1) * half;
                        rope(q, hd, arch.rope, &sink_cos[span.clone()], &sink_sin[span]);
                    }
                }
            }
            let (cos, sin) = &angles[base];
            for (r, row) in qkv.chunks_exact_mut(stride).enumerate() {
                let (cs, sn) = (
                    &cos[r * half..(r + 1) * half],
                    &sin[r * half..(r + 1) * half],
                );
                let (q, kv) = row.split_at_mut(q_dim);
                rope(q, hd, arch.rope, cs, sn);
                rope(&mut kv[..kv_dim], hd, arch.rope, cs, sn);
            }
            let tables = &tables[cache.layout().groups.group_of(l)];
            let bs = cache.block_size();
            for (row, r) in qkv.chunks_exact(stride).zip(rows) {
                let (k, v) = (&row[q_dim..q_dim + kv_dim], &row[q_dim + kv_dim..]);
                cache.write_token(tables[r.chunk][r.pos / bs], r.slot, l, k, v);
            }
            for obs in observe.iter_mut() {
                for (q, r) in qkv.chunks_exact(stride).zip(rows) {
                    if batch[r.chunk].seq == obs.seq && r.pos >= obs.from {
                        obs.q[l].extend_from_slice(&q[..q_dim]);
                        obs.rows += usize::from(l == 0);
                    }
                }
            }
            let queries = Queries {
                qkv: &qkv,
                stride,
                sink_q: &sink_q,
            };
            let attn = self.attention(cache, l, &queries, rows, tables, batch)?;
            let mut o = layer.wo.forward_with(&attn, n, kernel_rows)?;
            if let Some((post_attn, _)) = &layer.post_norms {
                rms_norm_in_place(&mut o, post_attn, c.rms_eps);
            }
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
            let act = match arch.activation {
                Activation::Silu => kernels::ggml::silu,
                Activation::Gelu => kernels::ggml::gelu,
            };
            for (hr, gur) in h.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
                let (g, u) = gur.split_at(f);
                for ((o, &gv), &uv) in hr.iter_mut().zip(g).zip(u) {
                    *o = act(gv) * uv;
                }
            }
            let mut down = layer.w_down.forward_with(&h, n, kernel_rows)?;
            if let Some((_, post_ffw)) = &layer.post_norms {
                rms_norm_in_place(&mut down, post_ffw, c.rms_eps);
            }
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
}
