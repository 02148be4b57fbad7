//! `duet eval ...`: quality measurements of the model as duet runs it.
//!
//! `duet eval perplexity` computes perplexity over a text file as llama.cpp's
//! `llama-perplexity` does (`duet_engine::perplexity` states the windows and the sums), so
//! its figure can be put beside llama.cpp's (`bench/llama_cpp_perplexity.py`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use duet_engine::perplexity::{perplexity, PerplexityConfig};
use duet_engine::{AttentionPolicy, KvDtype};

use super::model_args::ModelArgs;

#[derive(Subcommand, Debug)]
pub enum EvalCommand {
    /// Perplexity over a text file (llama.cpp's windows: the second half of each scored).
    Perplexity(PerplexityArgs),
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text (UTF-8).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// 0: consecutive windows, second half scored (llama.cpp's default); N: a window every
    /// N tokens scoring its last N (llama.cpp's `--ppl-stride`).
    #[arg(long, default_value_t = 0)]
    pub stride: usize,
    /// At most this many windows.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// KV cache element type.
    #[arg(long, env = "DUET_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// `full` (the model's attention, llama.cpp's figure); `window=W,sinks=S`: each
    /// token attends to the first S tokens and its last W (StreamingLLM), and blocks out of
    /// view go back to the pool; or `snapkv=B[,observe=O,pool=P]`: each window's first
    /// half is a prompt compressed by SnapKV, its second half fed one token per step.
    #[arg(long, env = "DUET_ATTENTION", default_value = "full")]
    pub attention: AttentionPolicy,
    /// Print one JSON object (ppl, ppl_stderr, nll, tokens_scored, kv_bytes_peak, ...).
    #[arg(long)]
    pub json: bool,
}

pub fn run(c: EvalCommand) -> anyhow::Result<()> {
    match c {
        EvalCommand::Perplexity(a) => run_perplexity(a),
    }
}

fn run_perplexity(a: PerplexityArgs) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(&a.file).with_context(|| format!("--file {}", a.file.display()))?;
    let model = a.model.load()?;
    let tokens = model.tokenizer.encode(&text, false)?;
    let cfg = PerplexityConfig {
        ctx: a.ctx,
        stride: a.stride,
        max_windows: a.chunks,
        kv_dtype: a.kv_dtype,
        attention: a.attention,
    };
    let r = perplexity(&model, &tokens, &cfg)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "PPL = {:.4} +/- {:.5} ({} tokens scored in {} windows of {}, attention {}, KV peak {} bytes)",
            r.ppl, r.ppl_stderr, r.tokens_scored, r.windows, r.ctx, r.attention, r.kv_bytes_peak
        );
    }
    Ok(())
}
