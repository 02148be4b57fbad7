//! `duet eval ...`: quality measurements of the model as duet runs it.
//!
//! `duet eval perplexity` computes perplexity over a text file as llama.cpp's
//! `llama-perplexity` does (`duet_engine::perplexity` states the windows and the sums), so
//! its figure can be put beside llama.cpp's (`bench/llama_cpp_perplexity.py`).
//!
//! `--kv-in-flight C` measures what moving a prompt's KV between workers costs: each
//! window's prompt KV goes through kv-transfer's own region codec (`encode_region`, then
//! `decode_region` into the same blocks), exactly what a decode worker receives when the
//! prefill worker sends with `--kv-compression C`; `none` is the same evaluation with the
//! bytes unchanged, the reference that separates the codec's cost from the rest.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use duet_engine::perplexity::{perplexity_in_transit, PerplexityConfig, PromptTransit};
use duet_engine::{AttentionPolicy, EngineError, KvCache, KvDtype, KvKind, SeqId};
use duet_kv_transfer::protocol::compress::{decode_region, encode_region};
use duet_kv_transfer::Compression;
use duet_worker_common::transfer_layout;

use super::cluster::args::CompressionArg;
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
    /// Put each window's prompt KV through kv-transfer's encoding `none|f16|int8` and back,
    /// as a remote prefill moves it (`--kv-compression` of `duet up`), then feed the rest
    /// of the window one token per step. Unset: no transit, the whole window in one forward.
    #[arg(long, value_enum)]
    pub kv_in_flight: Option<CompressionArg>,
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
    let transit = a
        .kv_in_flight
        .map(Compression::from)
        .map(|c| PromptTransit {
            name: c.as_str().to_string(),
            apply: Box::new(move |cache: &mut KvCache, seq: SeqId| round_trip(c, cache, seq)),
        });
    let r = perplexity_in_transit(&model, &tokens, &cfg, transit.as_ref())?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "PPL = {:.4} +/- {:.5} ({} tokens scored in {} windows of {}, attention {}, KV in flight {}, KV peak {} bytes)",
            r.ppl,
            r.ppl_stderr,
            r.tokens_scored,
            r.windows,
            r.ctx,
            r.attention,
            r.kv_in_flight.as_deref().unwrap_or("-"),
            r.kv_bytes_peak
        );
    }
    Ok(())
}

/// Every K and V region of sequence `seq`'s blocks encoded as `codec` and decoded back in
/// place, as a decode worker's pool receives them.
fn round_trip(codec: Compression, cache: &mut KvCache, seq: SeqId) -> duet_engine::Result<()> {
    let wire = |e: duet_kv_transfer::Error| EngineError::invalid("kv_in_flight", e.to_string());
    let layout = transfer_layout(cache.layout()).map_err(wire)?;
    let codec = codec.effective(layout.dtype());
    let mut encoded = Vec::new();
    for layer in 0..cache.layout().n_layers {
        // The blocks of the layer's group (`duet_engine::KvGroups`).
        let group = cache.layout().groups.group_of(layer);
        for b in cache.group_blocks(seq, group)?.to_vec() {
            for kind in [KvKind::K, KvKind::V] {
                encoded.clear();
                encode_region(
                    codec,
                    &layout,
                    cache.region_bytes(b, layer, kind),
                    &mut encoded,
                )
                .map_err(wire)?;
                decode_region(
                    codec,
                    &layout,
                    &encoded,
                    cache.region_bytes_mut(b, layer, kind),
                )
                .map_err(wire)?;
            }
        }
    }
    Ok(())
}
