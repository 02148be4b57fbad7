//! `duet profile`: measures this engine on this machine (prefill against prompt and
//! cached-prefix length, decode steps against batch and context, KV links) and writes a
//! profile for `duet plan simulate`.

use std::path::PathBuf;

use clap::Args;
use duet_engine::KvDtype;
use duet_kv_transfer::BackendKind;
use duet_plan::measure::{measure, Grid};
use duet_plan::profile::Source;
use duet_plan::Profile;

use crate::cmd::cluster::args::parse_bytes;
use crate::cmd::model_args::{EngineArgs, ModelArgs};

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Where the profile (JSON) goes.
    #[arg(long, env = "DUET_PROFILE_OUTPUT")]
    pub output: PathBuf,
    /// Prompt lengths of the prefill table.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,64,128,256,512,1024,2048"
    )]
    pub prefill_tokens: Vec<usize>,
    /// Cached prefix lengths of the prefill table (prefix-cache hits).
    #[arg(long, value_delimiter = ',', default_value = "0,512,1536")]
    pub prefill_cached: Vec<usize>,
    /// Batch sizes of the decode table.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub decode_batch: Vec<usize>,
    /// Context per sequence of the decode table.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024")]
    pub decode_context: Vec<usize>,
    /// Repetitions per prefill point (the median is kept).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Timed decode steps per point (the median is kept).
    #[arg(long, default_value_t = 8)]
    pub steps: usize,
    /// Times the prefill and decode tables are measured, whole tables one round after the
    /// other (each point keeps the median of its rounds).
    #[arg(long, env = "DUET_PROFILE_ROUNDS", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Largest disagreement between rounds, as a fraction of the faster one (0.15 = 15 %),
    /// that a profile may have: beyond it the machine was too busy to profile, and no
    /// profile is written.
    #[arg(long, env = "DUET_PROFILE_AGREE_WITHIN", default_value_t = 0.15)]
    pub agree_within: f64,
    /// KV links to measure (`duet bench transfer`); empty: none (give them by hand).
    #[arg(long, value_delimiter = ',', default_value = "local,shm,tcp")]
    pub links: Vec<BackendKind>,
    /// A worker's KV pool, as the workers' flag (sets the profile's pool blocks).
    #[arg(long, env = "DUET_KV_POOL", default_value = "512MiB", value_parser = parse_bytes)]
    pub kv_pool: u64,
    /// KV cache element type.
    #[arg(long, env = "DUET_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// What the router and its gRPC hops add to each request, milliseconds; default:
    /// measured (the median one-token request, one at a time, through an in-process router
    /// to fake workers that answer at once, as `duet bench router` runs it).
    #[arg(long)]
    pub router_overhead_ms: Option<f64>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn machine() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    if a.router_overhead_ms
        .is_some_and(|ms| !(ms.is_finite() && ms >= 0.0))
    {
        anyhow::bail!("--router-overhead-ms: a number >= 0");
    }
    if !(a.agree_within.is_finite() && a.agree_within >= 0.0) {
        anyhow::bail!("--agree-within: a fraction >= 0 (0.15 = 15 %)");
    }
    let kind = a.engine.resolve()?;
    let (router_overhead_s, note) = match a.router_overhead_ms {
        Some(ms) => (
            ms / 1e3,
            format!("router_overhead_s given on the command line ({ms} ms), not measured"),
        ),
        None => {
            const WARMUP: usize = 50;
            const REQUESTS: usize = 400;
            if !a.quiet {
                eprintln!("measuring the router's overhead ({REQUESTS} requests)");
            }
            let s = crate::cmd::bench::router::request_overhead(&a.model.model, WARMUP, REQUESTS)?;
            (
                s,
                format!(
                    "router_overhead_s measured: median of {REQUESTS} one-token requests, one at a time, through an in-process router (one runtime thread, KV-aware routing, prefill on the decode worker) to fake workers that answer at once"
                ),
            )
        }
    };
    let model = a.model.load_engine(&a.engine)?;
    let grid = Grid {
        prefill_tokens: a.prefill_tokens.clone(),
        prefill_cached: a.prefill_cached.clone(),
        decode_batch: a.decode_batch.clone(),
        decode_context: a.decode_context.clone(),
        reps: a.reps,
        steps: a.steps,
        rounds: a.rounds as usize,
        links: a.links.clone(),
        kv_pool_bytes: a.kv_pool as usize,
        kv_dtype: a.kv_dtype,
        router_overhead_s,
    };
    let source = Source {
        kind: "measured".into(),
        model: a
            .model
            .model
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        engine: format!("{kind} {} threads={}", a.engine.device, a.model.threads),
        machine: format!(
            "{} ({} cpus)",
            machine(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
        created_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        notes: vec![note],
    };
    let (mut file, agreed) = measure(&model, a.model.threads, &grid, source, !a.quiet)?;
    // One round agrees with itself: nothing to check or to say.
    if agreed.rounds > 1 {
        eprintln!("{agreed}");
        if !agreed.within(a.agree_within) {
            anyhow::bail!(
                "no profile written: its rounds disagree by {:.1} % at {} (more than \
                 --agree-within {:.1} %); the machine was busy while it measured: profile \
                 again on a quiet machine, or accept the noise with a larger --agree-within",
                100.0 * agreed.worst,
                agreed.worst_at,
                100.0 * a.agree_within
            );
        }
        file.source.notes.push(format!(
            "{agreed} (at most {:.1} % accepted); each point is the median of its rounds",
            100.0 * a.agree_within
        ));
    }
    let profile = Profile::new(&a.output.display().to_string(), file)?;
    if let Some(dir) = a.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    profile.write(&a.output)?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}
