//! One sequence's generation: sampling, stop conditions, and the text the
//! user sees.
//!
//! Text invariants: the concatenation of emitted deltas is exactly the final
//! text; a stop string is never emitted, even when it spans several tokens
//! (text that might start a stop string is held back until it cannot); text
//! is only emitted as whole UTF-8 characters.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::forward::{Observation, SeqChunk};
use crate::kv::{AttentionPolicy, KvCache, SeqId, SnapKv};
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};
use crate::session::{ForwardSession, NativeSession};
use crate::tokenizer::{Detokenizer, Tokenizer};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerationParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Strings that end generation; not included in the output.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (EOS and end-of-turn do too, unless
    /// `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS / end-of-turn until `max_tokens` or a stop string
    /// (benchmarks use it for exact output lengths, like vLLM's `ignore_eos`).
    pub ignore_eos: bool,
}

impl Default for GenerationParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            max_tokens: 128,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl GenerationParams {
    pub fn validate(&self, max_tokens_limit: usize) -> Result<()> {
        self.sampling.validate()?;
        if self.max_tokens == 0 || self.max_tokens > max_tokens_limit {
            return Err(EngineError::invalid(
                "max_tokens",
                format!("{} (must be in 1..={max_tokens_limit})", self.max_tokens),
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(EngineError::invalid(
                "stop",
                format!(
                    "{} stop strings (at most {MAX_STOP_STRINGS})",
                    self.stop.len()
                ),
            ));
        }
        for s in &self.stop {
            if s.is_empty() || s.len() > MAX_STOP_STRING_BYTES {
                return Err(EngineError::invalid(
                    "stop",
                    format!("stop strings must have 1..={MAX_STOP_STRING_BYTES} bytes"),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token (EOS, end of turn, or a requested id) or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What one sampled token produced.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenStep {
    pub id: u32,
    /// Text that became final with this token (may be empty).
    pub text: String,
    pub finished: Option<FinishReason>,
}

/// The state of one sequence's generation, independent of where its forward
/// passes run (so a decode worker can drive many of them in one batch).
pub struct Generation {
    params: GenerationParams,
    sampler: Sampler,
    detok: Detokenizer,
    held: String,
    history: Vec<u32>,
    generated: Vec<u32>,
    stop_ids: Vec<u32>,
    finished: Option<FinishReason>,
}

impl Generation {
    pub fn new(tokenizer: &Tokenizer, prompt: &[u32], params: GenerationParams) -> Result<Self> {
        let sampler = Sampler::new(params.sampling.clone())?;
        let mut stop_ids = match params.ignore_eos {
            true => Vec::new(),
            false => tokenizer.stop_token_ids().to_vec(),
        };
        stop_ids.extend_from_slice(&params.stop_token_ids);
        Ok(Self {
            params,
            sampler,
            detok: Detokenizer::new(),
            held: String::new(),
            history: prompt.to_vec(),
            generated: Vec::new(),
            stop_ids,
            finished: None,
        })
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Sample from the logits of the last position and advance.
    /// `context_left` is how many more tokens the sequence can hold.
    pub fn step(
        &mut self,
        tokenizer: &Tokenizer,
        logits: &mut [f32],
        context_left: usize,
    ) -> TokenStep {
        let id = self.sampler.sample(logits, &self.history);
        self.push(tokenizer, id, context_left)
    }

    /// Advance with a token sampled elsewhere from this sequence's first
    /// logits (a prefill worker samples the first token; the decode worker
    /// continues). With a seed, the sampler skips the draw that token used,
    /// so the whole sequence equals a single-worker run with that seed.
    pub fn accept_first(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        context_left: usize,
    ) -> TokenStep {
        self.sampler.skip_draw();
        self.push(tokenizer, id, context_left)
    }

    /// Continue a generation that started elsewhere (a stream migrated from a failed
    /// worker): `earlier` are the tokens generated there, all of them already part of the
    /// prompt this generation was made with. They go through the text state exactly as they
    /// did there (detokenizer, text held back for stop strings or an unfinished character)
    /// without being emitted again, and each consumes the random draw it took, so the text
    /// and (with a seed) the tokens that follow are those of an undisturbed run. They do
    /// not count as generated here: the caller's `max_tokens` is what is left.
    ///
    /// Returns the text those tokens emitted there (the client has it already).
    pub fn resume(&mut self, tokenizer: &Tokenizer, earlier: &[u32]) -> String {
        let mut emitted = String::new();
        for &id in earlier {
            self.sampler.skip_draw();
            self.held.push_str(&self.detok.push(tokenizer, id));
            let keep = self.holdback();
            let emit_to = self.held.len() - keep;
            emitted.extend(self.held.drain(..emit_to));
        }
        emitted
    }

    fn push(&mut self, tokenizer: &Tokenizer, id: u32, context_left: usize) -> TokenStep {
        self.history.push(id);
        self.generated.push(id);
        if self.stop_ids.contains(&id) {
            let text = self.finish(FinishReason::Stop);
            return TokenStep {
                id,
                text,
                finished: self.finished,
            };
        }
        self.held.push_str(&self.detok.push(tokenizer, id));
        if let Some(at) = self.find_stop() {
            let text = self.held[..at].to_string();
            self.held.clear();
            self.finished = Some(FinishReason::Stop);
            return TokenStep {
                id,
                text,
                finished: self.finished,
            };
        }
        if self.generated.len() >= self.params.max_tokens || context_left <= 1 {
            let text = self.finish(FinishReason::Length);
            return TokenStep {
                id,
                text,
                finished: self.finished,
            };
        }
        let keep = self.holdback();
        let emit_to = self.held.len() - keep;
        let text: String = self.held.drain(..emit_to).collect();
        TokenStep {
            id,
            text,
            finished: None,
        }
    }

    fn finish(&mut self, reason: FinishReason) -> String {
        self.finished = Some(reason);
        let mut text = std::mem::take(&mut self.held);
        text.push_str(&self.detok.flush());
        // A stop string completed by the flushed bytes still must not show.
        for s in &self.params.stop {
            if let Some(at) = text.find(s.as_str()) {
                text.truncate(at);
            }
        }
        text
    }

    fn find_stop(&self) -> Option<usize> {
        self.params
            .stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
    }

    /// Bytes at the end of `held` that could be the start of a stop string.
    fn holdback(&self) -> usize {
        let mut keep = 0;
        for s in &self.params.stop {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        keep
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub decode_ms_per_token: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerationOutput {
    pub prompt_ids: Vec<u32>,
    pub ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Generate for one prompt in one sequence of `cache`, prefilling in chunks
/// of `prefill_chunk` tokens (0: the whole prompt at once), calling
/// `on_step` for every token. The sequence is freed afterwards.
pub fn generate(
    model: &Model,
    cache: &mut KvCache,
    seq: SeqId,
    prompt: &[u32],
    params: GenerationParams,
    prefill_chunk: usize,
    on_step: &mut dyn FnMut(&TokenStep),
) -> Result<GenerationOutput> {
    generate_in(
        &mut NativeSession { model, cache },
        seq,
        prompt,
        params,
        prefill_chunk,
        AttentionPolicy::Full,
        on_step,
    )
}

/// [`generate`] on any engine: the prompt in chunks of `prefill_chunk` tokens (0: whole),
/// then one decode step per token until a stop condition; the sequence is freed after.
/// Under a local window (`attention`) the sequence may run past the model's context.
pub fn generate_in(
    session: &mut dyn ForwardSession,
    seq: SeqId,
    prompt: &[u32],
    params: GenerationParams,
    prefill_chunk: usize,
    attention: AttentionPolicy,
    on_step: &mut dyn FnMut(&TokenStep),
) -> Result<GenerationOutput> {
    if prompt.is_empty() {
        return Err(EngineError::invalid("prompt", "empty"));
    }
    attention.validate(session.context_length())?;
    // The most tokens the sequence may hold.
    let limit = attention.max_sequence_tokens(session.context_length());
    params.validate(limit)?;
    let mut gen = Generation::new(session.tokenizer(), prompt, params)?;
    session.add_sequence(seq)?;
    if let Err(e) = session.set_attention(seq, attention) {
        session.free_sequence(seq);
        return Err(e);
    }
    let prefill = Prefill {
        chunk: prefill_chunk,
        snapkv: attention.snapkv(),
    };
    let res = run(session, seq, prompt, &mut gen, prefill, limit, on_step);
    session.free_sequence(seq);
    res
}

/// How a prompt is computed: in chunks of `chunk` tokens (0: whole), its KV compressed by
/// SnapKV after the last one.
struct Prefill {
    chunk: usize,
    snapkv: Option<SnapKv>,
}

fn run(
    session: &mut dyn ForwardSession,
    seq: SeqId,
    prompt: &[u32],
    gen: &mut Generation,
    prefill: Prefill,
    limit: usize,
    on_step: &mut dyn FnMut(&TokenStep),
) -> Result<GenerationOutput> {
    let t0 = Instant::now();
    let chunk = if prefill.chunk == 0 {
        prompt.len()
    } else {
        prefill.chunk
    };
    let mut logits = Vec::new();
    let layers = session.n_layers();
    let mut observed = prefill
        .snapkv
        .map(|s| Observation::new(seq, prompt.len(), s.observe, layers));
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= prompt.len();
        let ch = [SeqChunk::prompt(seq, part, last, prompt.len())];
        let mut out = match observed.as_mut() {
            Some(obs) => session.forward_observing(&ch, obs)?,
            None => session.forward(&ch)?,
        };
        if last {
            logits = out.pop().unwrap_or_default();
        }
    }
    if let (Some(obs), Some(s)) = (&observed, prefill.snapkv) {
        session.compress_snapkv(obs, s)?;
    }
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut text = String::new();
    loop {
        let left = limit.saturating_sub(session.sequence_len(seq)?);
        let step = gen.step(session.tokenizer(), &mut logits, left);
        text.push_str(&step.text);
        on_step(&step);
        if step.finished.is_some() {
            break;
        }
        let mut out = session.forward(&[SeqChunk::new(seq, &[step.id])])?;
        logits = out.pop().unwrap_or_default();
    }
    let decode = t1.elapsed();
    let n = gen.generated().len();
    Ok(GenerationOutput {
        prompt_ids: prompt.to_vec(),
        ids: gen.generated().to_vec(),
        text,
        finish_reason: gen.finished().unwrap_or(FinishReason::Length),
        timings: Timings {
            prefill_ms: ms(prefill),
            decode_ms: ms(decode),
            decode_ms_per_token: if n > 1 {
                ms(decode) / (n - 1) as f64
            } else {
                0.0
            },
        },
    })
}
