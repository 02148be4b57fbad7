//! `duet run`: one-shot generation in-process.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use duet_engine::{
    generate_in, AttentionPolicy, CandleModel, CandleSession, ChatMessage, ChatTemplate,
    EngineKind, ForwardSession, GenerationParams, KvCache, KvDtype, NativeSession, SamplingParams,
    Tokenizer,
};

use super::model_args::{EngineArgs, ModelArgs};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt (raw text, or the user message with --chat).
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as one user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A Jinja chat template file for --chat, instead of the GGUF's (which some models,
    /// like base models, do not have).
    #[arg(long, env = "DUET_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub top_k: i64,
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable); not included in the output.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Prefill chunk size in tokens (0 = whole prompt in one forward).
    #[arg(long, default_value_t = 0)]
    pub prefill_chunk: usize,
    /// KV cache element type.
    #[arg(long, env = "DUET_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// `full`, `window=W,sinks=S`: each token attends to the first S tokens and its last
    /// W (StreamingLLM); the KV held stays bounded and generation may run past the model's
    /// context; or `snapkv=B[,observe=O,pool=P]`: once the prompt is computed, each layer's
    /// KV heads keep the B prompt positions its last O queries attend to most (SnapKV)
    /// (native engine).
    #[arg(long, env = "DUET_ATTENTION", default_value = "full")]
    pub attention: AttentionPolicy,
    /// Print one JSON object (prompt_ids, ids, text, timings) instead of streaming.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    if a.prompt.trim().is_empty() {
        anyhow::bail!("--prompt is empty");
    }
    let params = GenerationParams {
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            seed: a.seed,
        },
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
    };
    // Reject bad parameters before spending time on loading.
    params.sampling.validate()?;
    let engine = a.engine.resolve()?;
    if engine == EngineKind::Candle && a.kv_dtype != KvDtype::F16 {
        anyhow::bail!("--kv-dtype: the candle engine keeps an f16 KV pool");
    }
    a.model.validate()?;
    // Either engine behind the one generation loop; each with a cache sized for the run.
    let (native, candle);
    let mut cache;
    let (mut session, prompt): (Box<dyn ForwardSession + '_>, Vec<u32>) = match engine {
        EngineKind::Native => {
            native = a.model.load()?;
            let prompt = prompt_ids(&a, &native.tokenizer, native.chat_template.as_ref())?;
            a.attention.validate(native.config.context_length)?;
            let layout = native.kv_layout(16, a.kv_dtype);
            let bs = layout.block_size;
            let blocks = match a.attention.window() {
                // The prompt's blocks while it is computed, then at most the window's.
                Some(w) => prompt.len().div_ceil(bs) + w.max_blocks(bs),
                // SnapKV writes the kept positions into fresh blocks before it frees the
                // prompt's.
                None => {
                    params.validate(native.config.context_length)?;
                    let compacted = a.attention.snapkv().map_or(0, |s| s.budget.div_ceil(bs));
                    // Every layer group's (the prompt is one forward).
                    let total = prompt.len() + a.max_tokens;
                    layout.groups.peak_blocks(total, prompt.len(), bs) + compacted
                }
            };
            cache = KvCache::new(layout, blocks);
            let s = NativeSession {
                model: &native,
                cache: &mut cache,
            };
            (Box::new(s), prompt)
        }
        EngineKind::Candle => {
            candle = CandleModel::load(&a.model.model, a.engine.device)
                .with_context(|| format!("loading {}", a.model.model.display()))?;
            let prompt = prompt_ids(&a, &candle.tokenizer, candle.chat_template.as_ref())?;
            params.validate(candle.config.context_length)?;
            cache = candle.new_cache(16, (prompt.len() + a.max_tokens).div_ceil(16));
            let s = CandleSession {
                model: &candle,
                cache: &mut cache,
            };
            (Box::new(s), prompt)
        }
    };
    let stdout = std::io::stdout();
    let json = a.json;
    let out = generate_in(
        session.as_mut(),
        0,
        &prompt,
        params,
        a.prefill_chunk,
        a.attention,
        &mut |s| {
            if !json {
                let mut o = stdout.lock();
                let _ = o.write_all(s.text.as_bytes());
                let _ = o.flush();
            }
        },
    )?;
    if json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens, {} generated, finish: {}, prefill {:.1} ms, decode {:.2} ms/token]",
            out.prompt_ids.len(),
            out.ids.len(),
            out.finish_reason.as_str(),
            out.timings.prefill_ms,
            out.timings.decode_ms_per_token
        );
    }
    Ok(())
}

/// The prompt's token ids: the raw text, or one user message in the model's chat template.
fn prompt_ids(
    a: &RunArgs,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> anyhow::Result<Vec<u32>> {
    let given = a
        .chat_template
        .as_deref()
        .map(|path| super::model_args::chat_template(path, tokenizer))
        .transpose()?;
    let (text, parse_special) = match a.chat {
        true => {
            let tpl = given.as_ref().or(template).context(
                "--chat: the model has no chat template; give one with --chat-template FILE",
            )?;
            (
                tpl.render(&[ChatMessage::new("user", &a.prompt)], true)?,
                true,
            )
        }
        false => (a.prompt.clone(), false),
    };
    Ok(tokenizer.encode(&text, parse_special)?)
}
