//! One forward of [`CandleModel`] over a batch of [`SeqChunk`]s and a [`KvCache`] (its block
//! tables; the KV itself is read from the cache's copy on the model's device,
//! [`super::DeviceKv`]).
//!
//! The rows of every chunk are stacked (chunk order, then token order): RMSNorm, the
//! projections, RoPE, the feed-forward and the output head run over all rows at once;
//! attention runs per chunk over its sequence's rows gathered from the device pool
//! (positions `0..end` of the sequence, causal within the chunk). Each layer's new K and V
//! rows go to the device pool and to the host cache before the per-layer hook runs, as the
//! native engine's do, so a prefill worker streams them from the host while the next layer
//! computes. RoPE angles are computed on the host
//! exactly as ggml computes them (f32, each pair's angle the previous one times
//! `base^(-2/dims)`) and rotate adjacent pairs (`rope_i`), as llama.cpp's normal mode does.

use std::ops::ControlFlow;

use candle_core::{DType, Device, Tensor};
use half::f16;

use super::{CandleModel, DeviceKv};
use crate::error::{EngineError, Result};
use crate::forward::{check_chunk_fits, LayerHook, SeqChunk};
use crate::kv::{AttentionPolicy, BlockId, KvCache};

/// ggml's RoPE angles for `pos`: `cos` and `sin` of `head_dim / 2` pairs.
fn rope_angles(
    pos: usize,
    theta_base: f32,
    head_dim: usize,
    cos: &mut Vec<f32>,
    sin: &mut Vec<f32>,
) {
    let scale = theta_base.powf(-2.0 / head_dim as f32);
    let mut theta = pos as f32;
    for _ in 0..head_dim / 2 {
        cos.push(theta.cos());
        sin.push(theta.sin());
        theta *= scale;
    }
}

/// `(1, heads, n, head_dim)` from `n x (heads * head_dim)` rows.
fn heads_first(x: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    let n = x.dim(0)?;
    Ok(x.reshape((n, heads, head_dim))?
        .transpose(0, 1)?
        .contiguous()?
        .unsqueeze(0)?)
}

/// Rows back from `(1, heads, n, head_dim)`.
fn rows_first(x: &Tensor) -> Result<Tensor> {
    let (_, heads, n, head_dim) = x.dims4()?;
    Ok(x.squeeze(0)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, heads * head_dim))?)
}

/// Causal mask of a chunk whose `len` rows sit at positions `start..start + len` of a
/// sequence of `end` positions: 0 where a row may look, -inf after its own position.
fn causal_mask(start: usize, len: usize, end: usize, device: &Device) -> Result<Tensor> {
    let mut m = Vec::with_capacity(len * end);
    for r in 0..len {
        for col in 0..end {
            m.push(if col <= start + r {
                0f32
            } else {
                f32::NEG_INFINITY
            });
        }
    }
    Ok(Tensor::from_vec(m, (len, end), device)?)
}

impl CandleModel {
    /// Runs new tokens of several sequences through the model, writing their KV into
    /// `cache`; returns per chunk the logits of its last token (empty when it asked for
    /// none). Every chunk is checked and every block reserved before anything is computed;
    /// on an error no sequence's length changes.
    pub fn forward(&self, cache: &mut KvCache, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        self.forward_with(cache, batch, &mut |_, _| ControlFlow::Continue(()))
    }

    /// [`Self::forward`], calling `on_layer(l, cache)` once layer `l`'s KV is in the host
    /// cache; `Break` ends the forward there with [`EngineError::Stopped`], nothing
    /// committed (the native engine's contract).
    pub fn forward_with(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let l = cache.layout();
        if (l.n_layers, l.n_kv_heads, l.head_dim) != (c.n_layers, c.n_kv_heads, c.head_dim) {
            return Err(EngineError::LayoutMismatch(format!(
                "cache holds {}x{}x{}, model needs {}x{}x{}",
                l.n_layers, l.n_kv_heads, l.head_dim, c.n_layers, c.n_kv_heads, c.head_dim
            )));
        }
        for ch in batch {
            self.check_chunk(cache, ch)?;
        }
        let mut starts = Vec::with_capacity(batch.len());
        for ch in batch {
            starts.push(cache.prepare_append(ch.seq, ch.tokens.len())?);
        }
        let kv = cache.take_device_kv(&self.device)?;
        let logits = self.run(cache, &kv, batch, &starts, on_layer);
        cache.put_device_kv(kv);
        let logits = logits?;
        for ch in batch {
            cache.commit_append(ch.seq, ch.tokens.len())?;
        }
        Ok(logits)
    }

    /// Whether this engine runs `policy`: full attention only (`PolicyUnsupported` for a
    /// window, `InvalidArgument` for a window no model could run).
    pub fn check_attention(&self, policy: AttentionPolicy) -> Result<()> {
        policy.validate(self.config.context_length)?;
        if policy != AttentionPolicy::Full {
            return Err(EngineError::PolicyUnsupported(format!(
                "the candle engine runs full attention only ({policy} needs --engine native)"
            )));
        }
        Ok(())
    }

    /// Whether `ch` can be computed on its own (the native engine's rule).
    pub fn check_chunk(&self, cache: &KvCache, ch: &SeqChunk<'_>) -> Result<()> {
        if let Some(w) = cache.window(ch.seq)? {
            self.check_attention(AttentionPolicy::Window(w))?;
        }
        check_chunk_fits(&self.config, cache.sequence_len(ch.seq)?, ch.tokens, true)
    }

    fn run(
        &self,
        cache: &mut KvCache,
        kv: &DeviceKv,
        batch: &[SeqChunk<'_>],
        starts: &[usize],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let dev = &self.device;
        let (hd, heads, kv_heads) = (c.head_dim, c.n_heads, c.n_kv_heads);
        let eps = c.rms_eps;
        let bs = cache.block_size();
        // Rows: tokens, positions, the (block, slot) and pool row each writes, and per chunk
        // its rows' range; the blocks every chunk reads are brought up to date first.
        let mut tokens = Vec::new();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        let mut new_at: Vec<(BlockId, usize)> = Vec::new();
        let mut spans = Vec::with_capacity(batch.len());
        let mut seen = Vec::with_capacity(batch.len());
        for (ch, &start) in batch.iter().zip(starts) {
            let table = cache.sequence_blocks(ch.seq)?.to_vec();
            let end = start + ch.tokens.len();
            let block_of = |p: usize| {
                table.get(p / bs).copied().ok_or_else(|| {
                    EngineError::invalid("tokens", format!("position {p} has no block"))
                })
            };
            let first = tokens.len();
            for (j, &t) in ch.tokens.iter().enumerate() {
                tokens.push(t);
                rope_angles(start + j, c.rope_theta, hd, &mut cos, &mut sin);
                new_at.push((block_of(start + j)?, (start + j) % bs));
            }
            spans.push((first, ch.tokens.len()));
            cache.sync_to_device(kv, &table[..end.div_ceil(bs)])?;
            let rows = (0..end)
                .map(|p| kv.row(block_of(p)?, p % bs))
                .collect::<Result<Vec<u32>>>()?;
            seen.push((
                Tensor::new(rows.as_slice(), dev)?,
                causal_mask(start, ch.tokens.len(), end, dev)?,
            ));
        }
        let new_rows = new_at
            .iter()
            .map(|&(b, s)| kv.row(b, s))
            .collect::<Result<Vec<u32>>>()?;
        let n = tokens.len();
        let cos = Tensor::from_vec(cos, (n, hd / 2), dev)?;
        let sin = Tensor::from_vec(sin, (n, hd / 2), dev)?;
        let ids = Tensor::new(tokens.as_slice(), dev)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let group = heads / kv_heads;
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let q = xn.apply(&layer.wq)?;
            let k = xn.apply(&layer.wk)?;
            let v = xn.apply(&layer.wv)?;
            let q = candle_nn::rotary_emb::rope_i(&heads_first(&q, heads, hd)?, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope_i(&heads_first(&k, kv_heads, hd)?, &cos, &sin)?;
            let (k, v) = (
                rows_first(&k)?.to_dtype(DType::F16)?,
                v.to_dtype(DType::F16)?,
            );
            kv.write(l, &new_rows, &k, &v)?;
            let host = |t: &Tensor| -> Result<Vec<f16>> { Ok(t.flatten_all()?.to_vec1::<f16>()?) };
            cache.write_rows_back(l, &new_at, &host(&k)?, &host(&v)?)?;
            if on_layer(l, cache).is_break() {
                return Err(EngineError::Stopped { layer: l });
            }
            let mut outs = Vec::with_capacity(batch.len());
            for (&(first, len), (rows, mask)) in spans.iter().zip(&seen) {
                let qc = q.narrow(2, first, len)?.squeeze(0)?.contiguous()?; // heads x len x hd
                let (kc, vc) = kv.gather(l, rows)?; // end x kv_dim (f16)
                let end = rows.dim(0)?;
                let expand = |t: Tensor| -> Result<Tensor> {
                    // end x kv_heads x hd -> heads x end x hd (each kv head serves `group`).
                    Ok(t.to_dtype(DType::F32)?
                        .reshape((end, kv_heads, 1, hd))?
                        .broadcast_as((end, kv_heads, group, hd))?
                        .reshape((end, heads, hd))?
                        .transpose(0, 1)?
                        .contiguous()?)
                };
                let (kc, vc) = (expand(kc)?, expand(vc)?);
                // ggml multiplies an f16 KV cache by f16 copies of Q and of the softmax.
                let qc = qc.to_dtype(DType::F16)?.to_dtype(DType::F32)?;
                let scores = (qc.matmul(&kc.t()?)? * scale)?.broadcast_add(mask)?;
                let probs = candle_nn::ops::softmax_last_dim(&scores)?
                    .to_dtype(DType::F16)?
                    .to_dtype(DType::F32)?;
                outs.push(probs.matmul(&vc)?); // heads x len x hd
            }
            let attn = rows_first(&Tensor::cat(&outs, 1)?.unsqueeze(0)?)?;
            x = (x + attn.apply(&layer.wo)?)?;
            let xn = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gate = candle_nn::ops::silu(&xn.apply(&layer.w_gate)?)?;
            let h = (gate * xn.apply(&layer.w_up)?)?;
            x = (x + h.apply(&layer.w_down)?)?;
        }
        // Logits of each chunk's last row, where asked.
        let want: Vec<u32> = batch
            .iter()
            .zip(&spans)
            .filter(|(ch, _)| ch.logits)
            .map(|(_, &(first, len))| (first + len - 1) as u32)
            .collect();
        let mut out = vec![Vec::new(); batch.len()];
        if want.is_empty() {
            return Ok(out);
        }
        let last = x.index_select(&Tensor::new(want.as_slice(), dev)?, 0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.out_norm, eps)?;
        let logits = last.apply(&self.output)?.to_dtype(DType::F32)?;
        let mut rows = logits.to_vec2::<f32>()?.into_iter();
        for (o, ch) in out.iter_mut().zip(batch) {
            if ch.logits {
                *o = rows.next().unwrap_or_default();
            }
        }
        Ok(out)
    }
}
