//! `duet plan simulate`: a simulated cluster (`--profile`, worker counts, the workers' and
//! router's scheduling flags under the same names as `duet up`) under exactly the workload,
//! arrival and SLO flags of `duet bench serve`; prints and writes the same report.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use duet_bench::corpus::Corpus;
use duet_bench::{BackendKind, IgnoreEos, PromptFormat, SendOptions, ServeConfig};
use duet_engine::TextFrontend;
use duet_plan::sim::ClusterSpec;
use duet_plan::trace::TraceFormat;
use duet_plan::Profile;

use crate::cmd::bench::workload_args::{
    serve_config, ArrivalArgs, ReportArgs, SloArgs, Target, WorkloadArgs,
};
use crate::cmd::cluster::args::{ModeArg, Switch};
use crate::cmd::cluster::up::{DecodeArgs, PrefillArgs};

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Profile of one worker (`duet profile`, or written by hand: docs/plan.md).
    #[arg(long, env = "DUET_PLAN_PROFILE")]
    pub profile: PathBuf,
    /// Prefill workers (ignored with --mode colocated).
    #[arg(long, env = "DUET_PREFILL_WORKERS", default_value_t = 1)]
    pub prefill_workers: usize,
    /// Decode workers.
    #[arg(long, env = "DUET_DECODE_WORKERS", default_value_t = 1)]
    pub decode_workers: usize,
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub sched: SchedArgs,
    /// Requests from a trace instead of the generated workload: Azure LLM inference CSV
    /// (`.csv`) or Mooncake JSON lines (`.jsonl`); --num-prompts caps the rows, the
    /// workload and rate flags are not used.
    #[arg(long, env = "DUET_PLAN_TRACE")]
    pub trace: Option<PathBuf>,
    /// The trace's format (default: by its extension).
    #[arg(long, value_enum)]
    pub trace_format: Option<TraceFormatArg>,
    /// Divide the trace's times by this (2: twice the rate).
    #[arg(long, default_value_t = 1.0)]
    pub trace_speedup: f64,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub arrival: ArrivalArgs,
    #[command(flatten)]
    pub slo: SloArgs,
    #[command(flatten)]
    pub report: ReportArgs,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum TraceFormatArg {
    Azure,
    Mooncake,
}

impl SimulateArgs {
    fn cluster(&self, profile: &Profile) -> anyhow::Result<ClusterSpec> {
        if self.decode_workers == 0 {
            anyhow::bail!("--decode-workers: at least 1");
        }
        self.sched.cluster(
            profile,
            self.placement.mode.into(),
            self.prefill_workers,
            self.decode_workers,
            self.placement.local_prefill_max_tokens,
        )
    }
}

/// How the routers place prefill, as their flags (`plan simulate`, `planner`).
#[derive(Args, Debug)]
pub struct PlacementArgs {
    /// How the router places prefill.
    #[arg(long, env = "DUET_MODE", value_enum, default_value = "disaggregated")]
    pub mode: ModeArg,
    /// Prompts with at most this many tokens to compute are prefilled on the decode worker.
    #[arg(long, env = "DUET_LOCAL_PREFILL_MAX_TOKENS", default_value_t = 32)]
    pub local_prefill_max_tokens: usize,
}

/// The router's and workers' scheduling flags a simulated cluster takes (same names and
/// defaults as theirs), for `plan simulate` and `plan`.
#[derive(Args, Debug)]
pub struct SchedArgs {
    /// KV-aware routing (as the router's flag).
    #[arg(long, env = "DUET_KV_ROUTING", value_enum, default_value = "on")]
    pub kv_routing: Switch,
    /// Prefix caches on the workers (as the workers' flag).
    #[arg(long, env = "DUET_PREFIX_CACHE", value_enum, default_value = "on")]
    pub prefix_cache: Switch,
    /// In a decode worker's routing cost, what one running or waiting sequence weighs.
    #[arg(long, env = "DUET_DECODE_SEQ_COST_TOKENS", default_value_t = 256)]
    pub decode_seq_cost_tokens: u64,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub prefill: PrefillArgs,
    /// The profile's link KV moves over (`tcp`, `shm`, ...; default: its first).
    #[arg(long, env = "DUET_PLAN_KV_LINK")]
    pub kv_link: Option<String>,
    /// Workers sharing one host's cores, each busy one slowed by the others (1: every
    /// worker has its own machine or device).
    #[arg(long, env = "DUET_PLAN_WORKERS_PER_HOST", default_value_t = 1)]
    pub workers_per_host: usize,
}

impl SchedArgs {
    /// The cluster of these settings with `prefill` and `decode` workers.
    pub fn cluster(
        &self,
        profile: &Profile,
        mode: duet_router::Mode,
        prefill: usize,
        decode: usize,
        local_prefill_max_tokens: usize,
    ) -> anyhow::Result<ClusterSpec> {
        let bad = |field: &str, why: &str| anyhow::anyhow!("{field}: {why}");
        if self.workers_per_host == 0 {
            return Err(bad("--workers-per-host", "at least 1"));
        }
        if self.decode.max_batch == 0 || self.decode.prefill_chunk_tokens == 0 {
            return Err(bad("--max-batch / --prefill-chunk-tokens", "at least 1"));
        }
        if self.prefill.max_batch_tokens < profile.block_size() {
            return Err(bad("--max-batch-tokens", "at least one block"));
        }
        let defaults = duet_decode_worker::config::DecodeConfig::default();
        let router = duet_router::RouterConfig::default();
        Ok(ClusterSpec {
            mode,
            prefill_workers: prefill,
            decode_workers: decode,
            local_prefill_max_tokens,
            decode_headroom_tokens: router.decode_headroom_tokens,
            decode_seq_cost_tokens: self.decode_seq_cost_tokens,
            kv_routing: self.kv_routing == Switch::On,
            prefix_cache: self.prefix_cache == Switch::On,
            max_batch: self.decode.max_batch,
            prefill_chunk_tokens: self.decode.prefill_chunk_tokens,
            max_batch_tokens: self.prefill.max_batch_tokens,
            admit_watermark_blocks: defaults.admit_watermark_blocks,
            max_waiting: defaults.max_waiting,
            max_queue_wait_s: router.max_queue_wait.as_secs_f64(),
            workers_per_host: self.workers_per_host,
            link: profile.link(self.kv_link.as_deref())?.clone(),
        })
    }
}

/// The workload as `duet bench serve` builds it, for a simulation (no target).
pub fn simulated_config(
    w: &WorkloadArgs,
    a: &ArrivalArgs,
    slo: &SloArgs,
) -> anyhow::Result<(ServeConfig, Arc<Corpus>)> {
    let target = Target {
        label: "simulated",
        backend: BackendKind::Duet,
        url: String::new(),
        endpoint: String::new(),
        model_name: None,
        send: SendOptions {
            temperature: 0.0,
            seed: None,
            prompt_format: PromptFormat::Tokens,
            ignore_eos: IgnoreEos::IgnoreEos,
            extra_body: Default::default(),
            api_key: None,
            timeout: std::time::Duration::from_secs(600),
        },
    };
    let cfg = serve_config(w, a, slo, target)?;
    let front = TextFrontend::load(&cfg.tokenizer)
        .with_context(|| format!("loading the tokenizer of {}", cfg.tokenizer.display()))?;
    let corpus = Arc::new(Corpus::load(&front.tokenizer, cfg.corpus.as_deref())?);
    Ok((cfg, corpus))
}

pub fn run(a: SimulateArgs) -> anyhow::Result<()> {
    let profile = Profile::read(&a.profile)?;
    let cluster = a.cluster(&profile)?;
    if let Some(path) = &a.trace {
        let format = match a.trace_format {
            Some(TraceFormatArg::Azure) => TraceFormat::Azure,
            Some(TraceFormatArg::Mooncake) => TraceFormat::Mooncake,
            None => TraceFormat::of(path).ok_or_else(|| {
                anyhow::anyhow!(
                    "--trace-format: {} is neither .csv nor .jsonl",
                    path.display()
                )
            })?,
        };
        let units = duet_plan::trace::read(
            path,
            format,
            profile.block_size(),
            a.arrival.num_prompts,
            a.trace_speedup,
        )?;
        let slo = a
            .slo
            .slo
            .as_deref()
            .map(duet_bench::Slo::parse)
            .transpose()?;
        let label = a
            .workload
            .label
            .clone()
            .unwrap_or_else(|| "simulated".into());
        let (report, speed) = duet_plan::simulate::simulate_trace(
            &profile,
            &cluster,
            units,
            slo.as_ref(),
            &label,
            &path.display().to_string(),
        );
        return finish(&a, &report, &speed);
    }
    let (cfg, corpus) = simulated_config(&a.workload, &a.arrival, &a.slo)?;
    let (report, speed) = duet_plan::simulate::simulate(&profile, &cluster, &cfg, corpus)?;
    finish(&a, &report, &speed)
}

/// Prints the table and the speed, writes the report and the plots where asked.
fn finish(
    a: &SimulateArgs,
    report: &duet_bench::Report,
    speed: &duet_plan::simulate::Speed,
) -> anyhow::Result<()> {
    print!("{}", report.table());
    if !a.report.quiet {
        eprintln!(
            "simulated {:.1} s of {} requests in {:.3} s ({:.0}x real time, {} events)",
            speed.simulated_s,
            speed.requests,
            speed.wall_s,
            speed.ratio(),
            speed.events
        );
    }
    if let Some(path) = &a.report.output_json {
        report.write(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &a.report.plot_dir {
        for p in duet_bench::plot::write_plots(std::slice::from_ref(report), dir, None)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(())
}
