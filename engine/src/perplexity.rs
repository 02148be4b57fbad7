//! Perplexity of the model over a text, computed as llama.cpp's `llama-perplexity` computes
//! it, so the two can be compared number for number:
//!
//! - The text is tokenized once (with BOS when the model's tokenizer adds one).
//! - Default mode: the tokens are cut into consecutive windows of `ctx` tokens (a partial
//!   last window is dropped); each window is evaluated on its own from an empty cache,
//!   its first token replaced by BOS when the tokenizer adds one, and only the second half
//!   is scored: position `j` in `ctx/2 .. ctx-1` predicts token `j + 1`. The first half
//!   gives every scored token some context.
//! - Stride mode (`stride > 0`, llama.cpp's `--ppl-stride`): windows of `ctx` tokens start
//!   every `stride` tokens and score their last `stride` predictions.
//! - Each scored token adds `-log softmax(logits)[next]`, with the softmax's sum of `expf`
//!   accumulated in f64 after subtracting the largest logit (llama.cpp's `log_softmax`).
//!   `ppl = exp(mean)`, and its standard error is `ppl * sqrt(var / (n - 1))`.
//! - Under a local window (`kv::window`) each window of text is fed in chunks of
//!   [`WINDOWED_CHUNK`] tokens, so that blocks out of view go back to the pool as they would
//!   in a long generation and `kv_bytes_peak` is what the policy holds. A row's logits do
//!   not depend on the chunking (`forward`), so the figure is the same as in one chunk.
//! - Under SnapKV (`kv::snapkv`), which compresses a prompt for what follows it, each
//!   window's unscored first half and its first scored position are the prompt: computed
//!   whole, then compressed; every later position is fed one token per step, as generation
//!   feeds it, and scored from that step's logits. With a budget that holds the prompt,
//!   this is full attention with its positions fed one by one.
//! - With a [`PromptTransit`] (what a remote prefill does to the prompt's KV on its way to
//!   the decode worker, e.g. kv-transfer's int8 encoding), the windows are evaluated the
//!   SnapKV way, prompt then steps, and the transit is applied to the prompt's blocks in
//!   place between the two (after compression, as a prefill worker compresses before it
//!   sends). The same evaluation with an identity transit is the reference that isolates
//!   the transit's cost from the rounding of one-row steps.

use serde::Serialize;

use crate::error::{EngineError, Result};
use crate::forward::{Observation, SeqChunk};
use crate::kv::{AttentionPolicy, KvCache, KvDtype, SeqId, SnapKv};
use crate::model::Model;

/// How to cut the text into windows.
#[derive(Debug, Clone, Copy)]
pub struct PerplexityConfig {
    /// Tokens per window.
    pub ctx: usize,
    /// 0: llama.cpp's default windows; otherwise its `--ppl-stride` windows.
    pub stride: usize,
    /// At most this many windows (`None`: all).
    pub max_windows: Option<usize>,
    pub kv_dtype: KvDtype,
    /// Full attention (llama.cpp's) or a local window with sinks.
    pub attention: AttentionPolicy,
}

/// Tokens per forward of a windowed evaluation.
pub const WINDOWED_CHUNK: usize = 64;

/// The result, as `duet eval perplexity --json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct PerplexityReport {
    pub ppl: f64,
    /// Standard error of `ppl`.
    pub ppl_stderr: f64,
    /// Mean negative log-likelihood per scored token (nats).
    pub nll: f64,
    pub tokens_scored: usize,
    pub tokens_total: usize,
    pub windows: usize,
    pub ctx: usize,
    pub stride: usize,
    /// `full`, or `window=W,sinks=S`.
    pub attention: String,
    /// The most KV bytes a window's sequence held in the cache.
    pub kv_bytes_peak: usize,
    /// The transit the prompt's KV went through (`none`, `int8`, ...), when one was named.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_in_flight: Option<String>,
}

/// Applies a transit in place to sequence `seq`'s blocks in `cache`.
pub type ApplyTransit = Box<dyn Fn(&mut KvCache, SeqId) -> Result<()>>;

/// What happens to a prompt's KV between the forward that computed it and the steps that go
/// on from it.
pub struct PromptTransit {
    /// Its name in the report (`kv_in_flight`).
    pub name: String,
    pub apply: ApplyTransit,
}

/// `-log softmax(logits)[target]` as llama.cpp computes it.
pub fn neg_log_softmax(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    -(f64::from(logits[target] - max) - sum.ln())
}

/// Running sums of the scored tokens' negative log-likelihoods.
#[derive(Debug, Default, Clone, Copy)]
pub struct NllSums {
    sum: f64,
    sum_sq: f64,
    n: usize,
}

impl NllSums {
    pub fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum_sq += v * v;
        self.n += 1;
    }

    /// `(mean nll, ppl, ppl's standard error)`.
    pub fn finish(&self) -> (f64, f64, f64) {
        let n = self.n.max(1) as f64;
        let mean = self.sum / n;
        let ppl = mean.exp();
        let var = self.sum_sq / n - mean * mean;
        let se = if var > 0.0 && self.n > 1 {
            (var / (n - 1.0)).sqrt() * ppl
        } else {
            0.0
        };
        (mean, ppl, se)
    }
}

/// The windows of `tokens`: `(start, first scored position)` per window.
pub fn windows(total: usize, cfg: &PerplexityConfig) -> Result<Vec<(usize, usize)>> {
    let ctx = cfg.ctx;
    if ctx < 4 {
        return Err(EngineError::invalid("ctx", "at least 4 tokens"));
    }
    let w: Vec<(usize, usize)> = if cfg.stride == 0 {
        if total < 2 * ctx {
            return Err(EngineError::invalid(
                "file",
                format!("{total} tokens; at least {} (2 x ctx) are needed", 2 * ctx),
            ));
        }
        (0..total / ctx).map(|i| (i * ctx, ctx / 2)).collect()
    } else {
        if cfg.stride >= ctx || total <= ctx {
            return Err(EngineError::invalid(
                "stride",
                format!(
                    "{} must be below ctx {ctx}, with more than ctx tokens ({total})",
                    cfg.stride
                ),
            ));
        }
        let n = (total - ctx).div_ceil(cfg.stride);
        (0..n)
            .map(|i| (i * cfg.stride, ctx - cfg.stride - 1))
            .collect()
    };
    Ok(match cfg.max_windows {
        Some(m) => w.into_iter().take(m).collect(),
        None => w,
    })
}

/// Perplexity of `model` over `tokens` (see the module docs for the windows).
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    cfg: &PerplexityConfig,
) -> Result<PerplexityReport> {
    perplexity_in_transit(model, tokens, cfg, None)
}

/// [`perplexity`], each window's prompt KV put through `transit` when one is given.
pub fn perplexity_in_transit(
    model: &Model,
    tokens: &[u32],
    cfg: &PerplexityConfig,
    transit: Option<&PromptTransit>,
) -> Result<PerplexityReport> {
    if cfg.ctx > model.config.context_length {
        return Err(EngineError::invalid(
            "ctx",
            format!(
                "{} exceeds the model's context {}",
                cfg.ctx, model.config.context_length
            ),
        ));
    }
    cfg.attention.validate(model.config.context_length)?;
    let wins = windows(tokens.len(), cfg)?;
    let layout = model.kv_layout(16, cfg.kv_dtype);
    let bos = model
        .tokenizer
        .bos_token_id()
        .filter(|_| model.tokenizer.adds_bos());
    let mut sums = NllSums::default();
    let mut kv_peak = 0;
    // SnapKV compacts into fresh blocks while the prompt's are held.
    let compacted = cfg.attention.snapkv().map_or(0, |p| p.budget.div_ceil(16));
    // Every layer group's blocks of a whole window (a local group's peak is at most that).
    let blocks = layout.groups.n_groups() * cfg.ctx.div_ceil(16);
    let mut cache = KvCache::new(layout, blocks + compacted);
    for &(start, first) in &wins {
        let mut window = tokens[start..start + cfg.ctx].to_vec();
        if let Some(b) = bos {
            window[0] = b;
        }
        cache.add_sequence(0)?;
        let block_bytes = cache.layout().block_bytes();
        let mut held = |used: usize| kv_peak = kv_peak.max(used * block_bytes);
        let logits = if cfg.attention.snapkv().is_some() || transit.is_some() {
            let prompt = Prompt {
                attention: cfg.attention,
                transit,
            };
            prompt_then_steps(model, &mut cache, &window, first, prompt, &mut held)
        } else {
            window_logits(model, &mut cache, &window, cfg.attention, &mut held)
        };
        cache.free_sequence(0);
        let logits = logits?;
        for j in first..cfg.ctx - 1 {
            sums.add(neg_log_softmax(&logits[j], tokens[start + j + 1] as usize));
        }
    }
    let (nll, ppl, ppl_stderr) = sums.finish();
    Ok(PerplexityReport {
        ppl,
        ppl_stderr,
        nll,
        tokens_scored: sums.n,
        tokens_total: tokens.len(),
        windows: wins.len(),
        ctx: cfg.ctx,
        stride: cfg.stride,
        attention: cfg.attention.to_string(),
        kv_bytes_peak: kv_peak,
        kv_in_flight: transit.map(|t| t.name.clone()),
    })
}

/// The logits of every row of `window` for the new sequence 0 under `attention`; `held`
/// sees the blocks in use at each forward's largest (its rows reserved).
fn window_logits(
    model: &Model,
    cache: &mut KvCache,
    window: &[u32],
    attention: AttentionPolicy,
    held: &mut dyn FnMut(usize),
) -> Result<Vec<Vec<f32>>> {
    cache.set_attention(0, attention)?;
    let chunk = match attention {
        AttentionPolicy::Full | AttentionPolicy::SnapKv(_) => window.len(),
        AttentionPolicy::Window(_) => WINDOWED_CHUNK,
    };
    let mut logits = Vec::with_capacity(window.len());
    for part in window.chunks(chunk) {
        cache.prepare_append(0, part.len())?;
        held(cache.used_blocks());
        let ch = SeqChunk::prompt(0, part, true, window.len());
        logits.extend(model.forward_every_row(cache, ch)?);
    }
    Ok(logits)
}

/// How a stepped window's prompt is computed and handed on.
#[derive(Clone, Copy)]
struct Prompt<'t> {
    attention: AttentionPolicy,
    transit: Option<&'t PromptTransit>,
}

/// `window[..=first]` as a prompt (compressed under SnapKV, then put through the transit),
/// then one token per step; the logits of rows `first..` (earlier rows are left empty: they
/// are not scored).
fn prompt_then_steps(
    model: &Model,
    cache: &mut KvCache,
    window: &[u32],
    first: usize,
    how: Prompt,
    held: &mut dyn FnMut(usize),
) -> Result<Vec<Vec<f32>>> {
    cache.set_attention(0, how.attention)?;
    let prompt = &window[..=first];
    let mut logits = vec![Vec::new(); window.len()];
    let chunk = match how.attention {
        AttentionPolicy::SnapKv(policy) => {
            logits[first] = snapkv_prompt(model, cache, prompt, policy, held)?;
            None
        }
        AttentionPolicy::Window(_) => Some(WINDOWED_CHUNK),
        AttentionPolicy::Full => Some(prompt.len()),
    };
    if let Some(chunk) = chunk {
        let parts = prompt.len().div_ceil(chunk);
        for (i, part) in prompt.chunks(chunk).enumerate() {
            cache.prepare_append(0, part.len())?;
            held(cache.used_blocks());
            let ch = SeqChunk::prompt(0, part, i + 1 == parts, prompt.len());
            if let Some(l) = model.forward(cache, &[ch])?.pop() {
                logits[first] = l;
            }
        }
    }
    if let Some(t) = how.transit {
        (t.apply)(cache, 0)?;
    }
    for j in first + 1..window.len() - 1 {
        cache.prepare_append(0, 1)?;
        held(cache.used_blocks());
        let mut out = model.forward(cache, &[SeqChunk::new(0, &window[j..=j])])?;
        logits[j] = out.pop().unwrap_or_default();
    }
    Ok(logits)
}

/// Computes `prompt` whole, compresses it by SnapKV and returns its last row's logits.
fn snapkv_prompt(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    policy: SnapKv,
    held: &mut dyn FnMut(usize),
) -> Result<Vec<f32>> {
    let mut obs = Observation::new(0, prompt.len(), policy.observe, model.config.n_layers);
    cache.prepare_append(0, prompt.len())?;
    held(cache.used_blocks());
    let ch = SeqChunk::prompt(0, prompt, true, prompt.len());
    let mut out = model.forward_observing(cache, &[ch], std::slice::from_mut(&mut obs))?;
    let compacting = cache.used_blocks() + cache.blocks_for(policy.kept(prompt.len()));
    model.compress_snapkv(cache, &obs, policy)?;
    if policy.compresses(prompt.len()) {
        held(compacting);
    }
    Ok(out.pop().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(ctx: usize, stride: usize) -> PerplexityConfig {
        PerplexityConfig {
            ctx,
            stride,
            max_windows: None,
            kv_dtype: KvDtype::F16,
            attention: AttentionPolicy::Full,
        }
    }

    #[test]
    fn windows_are_llama_cpps() {
        // Default: whole windows only, the second half scored.
        assert_eq!(
            windows(1000, &cfg(256, 0)).unwrap(),
            vec![(0, 128), (256, 128), (512, 128)]
        );
        assert!(windows(511, &cfg(256, 0)).is_err(), "needs 2 x ctx tokens");
        // Stride: a window every `stride` tokens, its last `stride` predictions scored.
        assert_eq!(
            windows(300, &cfg(256, 16)).unwrap(),
            vec![(0, 239), (16, 239), (32, 239)]
        );
        assert!(windows(300, &cfg(256, 256)).is_err());
        let mut c = cfg(256, 0);
        c.max_windows = Some(1);
        assert_eq!(windows(1000, &c).unwrap().len(), 1);
    }

    #[test]
    fn uniform_logits_give_the_vocabulary_size_and_stats_are_exact() {
        let logits = vec![0.5f32; 100];
        assert!((neg_log_softmax(&logits, 3) - 100f64.ln()).abs() < 1e-9);
        let mut s = NllSums::default();
        for v in [1.0, 2.0, 3.0] {
            s.add(v);
        }
        let (mean, ppl, se) = s.finish();
        assert_eq!(mean, 2.0);
        assert!((ppl - 2f64.exp()).abs() < 1e-12);
        // var = 14/3 - 4 = 2/3; se = sqrt((2/3) / 2) * ppl.
        assert!((se - (1.0f64 / 3.0).sqrt() * ppl).abs() < 1e-12);
    }
}
