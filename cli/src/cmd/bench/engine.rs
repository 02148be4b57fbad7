//! `duet bench engine`: prefill tok/s at several prompt lengths and
//! aggregate decode tok/s at several batch sizes and contexts (every sequence with its own
//! context of `--context` tokens), plus resident memory, on either engine (`--engine`,
//! `--device`: the native CPU engine or the candle engine on its device). Under
//! `--attention window=W,sinks=S` the decoding sequences attend to their window and sinks
//! only, so a step's cost stops growing with the context; under `--attention snapkv=B` each
//! context is a prompt compressed to B positions before the timed steps (`docs/long-context.md`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use duet_bench::corpus::synthetic_ids as tokens;
use duet_bench::stats::median;
use duet_engine::{
    sampling::argmax, AttentionPolicy, EngineKind, EngineModel, KvCache, KvCacheConfig, KvDtype,
    Observation, SeqChunk,
};
use serde::Serialize;

use crate::cmd::model_args::{EngineArgs, ModelArgs};

#[derive(Args, Debug)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt lengths for prefill.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024")]
    pub prefill: Vec<usize>,
    /// Batch sizes for decode.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub batch: Vec<usize>,
    /// Contexts of the decoding sequences before the timed steps (each batch size at
    /// each context).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub context: Vec<usize>,
    /// Attention of the decoding sequences: `full`, or `window=W,sinks=S` (native engine).
    #[arg(long, env = "DUET_ATTENTION", default_value = "full")]
    pub attention: AttentionPolicy,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
    /// KV cache element type (`f16` with `--weights quantized` is llama.cpp's
    /// arithmetic, bit for bit).
    #[arg(long, env = "DUET_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Size of the KV pool whose resident memory is reported.
    #[arg(long, default_value_t = 1 << 30)]
    pub kv_pool_bytes: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Prefill {
    tokens: usize,
    seconds: f64,
    tok_per_s: f64,
}

#[derive(Serialize)]
struct Decode {
    batch: usize,
    context: usize,
    steps: usize,
    seconds: f64,
    tok_per_s: f64,
}

#[derive(Serialize)]
struct Report {
    engine: &'static str,
    /// `native` or `candle`.
    engine_kind: String,
    device: String,
    threads: usize,
    weights: String,
    kv_dtype: String,
    attention: String,
    prefill: Vec<Prefill>,
    decode: Vec<Decode>,
    rss_after_load_bytes: u64,
    rss_with_kv_pool_bytes: u64,
    kv_pool_bytes: usize,
    weight_bytes: usize,
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

pub fn run(a: EngineBenchArgs) -> anyhow::Result<()> {
    let kind = a.engine.resolve()?;
    if kind == EngineKind::Candle && a.kv_dtype != KvDtype::F16 {
        anyhow::bail!("--kv-dtype: the candle engine keeps an f16 KV pool");
    }
    let model = a.model.load_engine(&a.engine)?;
    let groups = model.kv_layout(16, a.kv_dtype)?.groups;
    let new_cache = |blocks: usize| -> anyhow::Result<KvCache> {
        Ok(KvCache::new(model.kv_layout(16, a.kv_dtype)?, blocks))
    };
    let rss_after_load = rss_bytes();
    let mut prefill = Vec::new();
    for &n in &a.prefill {
        let mut runs = Vec::new();
        for i in 0..4 {
            let mut store = new_cache(groups.peak_blocks(n, n, 16))?;
            store.add_sequence(0)?;
            let t = Instant::now();
            model.forward(&mut store, &[SeqChunk::new(0, &tokens(n, 0))])?;
            if i > 0 {
                runs.push(t.elapsed().as_secs_f64()); // the first run warms up
            }
        }
        let s = median(runs).unwrap_or(0.0);
        eprintln!("prefill {n:5} tokens: {:8.1} tok/s", n as f64 / s);
        prefill.push(Prefill {
            tokens: n,
            seconds: s,
            tok_per_s: n as f64 / s,
        });
    }
    let mut decode = Vec::new();
    for &context in &a.context {
        // Blocks per sequence: its whole context, or a prefill chunk and the window.
        let per_seq = match a.attention.window() {
            Some(w) => CONTEXT_CHUNK.div_ceil(16) + w.max_blocks(16) + 1,
            // SnapKV compacts into fresh blocks while the context's are held.
            None => {
                let compacted = a.attention.snapkv().map_or(0, |p| p.budget.div_ceil(16));
                groups.peak_blocks(context + a.steps + 1, CONTEXT_CHUNK, 16) + compacted
            }
        };
        for &b in &a.batch {
            let cache = new_cache(b * per_seq)?;
            let shape = DecodeShape {
                batch: b,
                context,
                steps: a.steps,
                attention: a.attention,
            };
            decode.push(bench_decode(&model, cache, &shape)?);
        }
    }
    let (config, weight_bytes) = (model.config().clone(), model.weight_bytes());
    let sized = KvCacheConfig::from_budget(
        a.kv_pool_bytes,
        16,
        a.kv_dtype,
        (
            config.layers_per_kv_block(),
            config.n_kv_heads,
            config.head_dim,
        ),
    );
    // Held until the report is written: its resident memory is measured.
    let mut pool = new_cache(sized.num_blocks)?;
    pool.prefault();
    let kv_pool_bytes = pool.pool_bytes();
    let report = Report {
        engine: "duet",
        engine_kind: kind.to_string(),
        device: a.engine.device.to_string(),
        threads: a.model.threads,
        weights: format!("{:?}", a.model.weights),
        kv_dtype: format!("{:?}", a.kv_dtype).to_lowercase(),
        attention: a.attention.to_string(),
        prefill,
        decode,
        rss_after_load_bytes: rss_after_load,
        rss_with_kv_pool_bytes: rss_bytes(),
        kv_pool_bytes,
        weight_bytes,
    };
    eprintln!(
        "RSS after load {:.1} MiB, with a {:.0} MiB KV pool {:.1} MiB",
        report.rss_after_load_bytes as f64 / 1048576.0,
        report.kv_pool_bytes as f64 / 1048576.0,
        report.rss_with_kv_pool_bytes as f64 / 1048576.0
    );
    match &a.json {
        Some(p) => super::write_json(p, &report)?,
        None => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    Ok(())
}

/// Tokens per prefill forward of a decoding sequence's context.
const CONTEXT_CHUNK: usize = 512;

struct DecodeShape {
    batch: usize,
    context: usize,
    steps: usize,
    attention: AttentionPolicy,
}

fn bench_decode(
    model: &EngineModel,
    mut cache: KvCache,
    shape: &DecodeShape,
) -> anyhow::Result<Decode> {
    let &DecodeShape {
        batch,
        context,
        steps,
        attention,
    } = shape;
    // Distinct contexts per sequence, prefilled a few sequences per forward, in chunks (a
    // windowed sequence then holds only its window).
    let prompts: Vec<Vec<u32>> = (0..batch).map(|i| tokens(context, i + 1)).collect();
    let mut next = vec![0u32; batch];
    let layers = model.config().n_layers;
    for group in (0..batch).collect::<Vec<_>>().chunks(4) {
        for &i in group {
            cache.add_sequence(i as u64)?;
            cache.set_attention(i as u64, attention)?;
        }
        // Under SnapKV each context is a prompt, compressed once computed.
        let mut observed: Vec<Observation> = match attention.snapkv() {
            Some(p) => group
                .iter()
                .map(|&i| Observation::new(i as u64, context, p.observe, layers))
                .collect(),
            None => Vec::new(),
        };
        for start in (0..context).step_by(CONTEXT_CHUNK) {
            let end = (start + CONTEXT_CHUNK).min(context);
            let last = end == context;
            let chunks: Vec<SeqChunk> = group
                .iter()
                .map(|&i| SeqChunk::prompt(i as u64, &prompts[i][start..end], last, context))
                .collect();
            let logits = model
                .forward_observing(&mut cache, &chunks, &mut observed)
                .context("prefill")?;
            if last {
                for (&i, l) in group.iter().zip(&logits) {
                    next[i] = argmax(l);
                }
            }
        }
        if let Some(p) = attention.snapkv() {
            for obs in &observed {
                model
                    .compress_snapkv(&mut cache, obs, p)
                    .context("SnapKV")?;
            }
        }
    }
    let step = |cache: &mut KvCache, next: &mut Vec<u32>| -> anyhow::Result<()> {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let chunks: Vec<SeqChunk> = toks
            .iter()
            .enumerate()
            .map(|(i, t)| SeqChunk::new(i as u64, t))
            .collect();
        for (n, l) in next.iter_mut().zip(model.forward(cache, &chunks)?) {
            *n = argmax(&l);
        }
        Ok(())
    };
    step(&mut cache, &mut next)?; // warm-up
    let t = Instant::now();
    for _ in 0..steps {
        step(&mut cache, &mut next)?;
    }
    let s = t.elapsed().as_secs_f64();
    let tps = (batch * steps) as f64 / s;
    eprintln!("decode batch {batch:3} (context {context}): {tps:8.1} tok/s aggregate");
    Ok(Decode {
        batch,
        context,
        steps,
        seconds: s,
        tok_per_s: tps,
    })
}
