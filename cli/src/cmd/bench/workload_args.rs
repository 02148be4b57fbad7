//! The flags `duet bench serve` and `duet plan simulate` share, exactly: the workload,
//! the arrivals, the SLO and where the report goes. One definition, so that a simulated run
//! and a measured one are asked for with the same words.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use duet_bench::{BackendKind, DatasetKind, LengthParams, SendOptions, ServeConfig, Slo};

use super::serve::Dataset;
use crate::cmd::cluster::args::parse_duration;
use crate::cmd::model_args::DEFAULT_MODEL;

/// What is sent: the requests of a run (the same for `duet bench serve` and `duet plan
/// simulate`).
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// GGUF whose tokenizer builds the prompts (the served model's).
    #[arg(long, env = "DUET_BENCH_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Name of this configuration in the report and plots (default: the backend).
    #[arg(long, env = "DUET_BENCH_LABEL")]
    pub label: Option<String>,
    /// Workload.
    #[arg(long, env = "DUET_BENCH_DATASET", value_enum, default_value = "fixed")]
    pub dataset: Dataset,
    /// Prompt tokens (fixed), centre (uniform) or mean (lognormal).
    #[arg(long, env = "DUET_BENCH_INPUT_LEN", default_value_t = 256)]
    pub input_len: usize,
    /// Output tokens (fixed), centre (uniform) or mean (lognormal).
    #[arg(long, env = "DUET_BENCH_OUTPUT_LEN", default_value_t = 64)]
    pub output_len: usize,
    /// Uniform dataset: lengths within len·(1 ± ratio).
    #[arg(long, env = "DUET_BENCH_RANGE_RATIO", default_value_t = 0.5)]
    pub range_ratio: f64,
    /// Lognormal dataset: median prompt tokens.
    #[arg(long, env = "DUET_BENCH_INPUT_MEDIAN")]
    pub input_median: Option<f64>,
    /// Lognormal dataset: median output tokens.
    #[arg(long, env = "DUET_BENCH_OUTPUT_MEDIAN")]
    pub output_median: Option<f64>,
    /// azure-conv: multiply every length by this (shape kept) before capping.
    #[arg(long, env = "DUET_BENCH_LENGTH_SCALE", default_value_t = 1.0)]
    pub length_scale: f64,
    /// Longest prompt (drawn lengths above are capped).
    #[arg(long, env = "DUET_BENCH_MAX_INPUT_LEN", default_value_t = 2048)]
    pub max_input_len: usize,
    /// Longest output (drawn lengths above are capped).
    #[arg(long, env = "DUET_BENCH_MAX_OUTPUT_LEN", default_value_t = 512)]
    pub max_output_len: usize,
    /// Every prompt starts with the same this many tokens (part of its length): a shared
    /// system prompt.
    #[arg(long, env = "DUET_BENCH_SHARED_PREFIX_LEN", default_value_t = 0)]
    pub shared_prefix_len: usize,
    /// Distinct shared prefixes (system prompts of --shared-prefix-len tokens), one drawn
    /// per request (SGLang's generated-shared-prefix, vLLM's prefix-repetition).
    #[arg(long, env = "DUET_BENCH_NUM_PREFIXES", default_value_t = 1)]
    pub num_prefixes: usize,
    /// Multi-turn chat: requests per conversation. The first turn is --input-len tokens (the
    /// shared prefix, then a user message); turn k's prompt is turn k-1's prompt, a reply as
    /// long as its output and a new user message as long as the first; the turns of a
    /// conversation go one after another, and rates and --max-concurrency count
    /// conversations.
    #[arg(long, env = "DUET_BENCH_TURNS", default_value_t = 1)]
    pub turns: usize,
    /// Plain text prompts are cut from (default: the stored public-domain book).
    #[arg(long, env = "DUET_BENCH_CORPUS")]
    pub corpus: Option<PathBuf>,
    /// Seed of the workload and the arrivals.
    #[arg(long, env = "DUET_BENCH_SEED", default_value_t = 0)]
    pub seed: u64,
}

/// When requests are sent, and how many.
#[derive(Args, Debug, Clone)]
pub struct ArrivalArgs {
    /// Offered requests per second (default: all at once, see --max-concurrency).
    #[arg(long, env = "DUET_BENCH_REQUEST_RATE")]
    pub request_rate: Option<f64>,
    /// One run per rate, all in one report (e.g. `1,2,4,8`).
    #[arg(
        long,
        env = "DUET_BENCH_RATE_SWEEP",
        value_delimiter = ',',
        conflicts_with = "request_rate"
    )]
    pub rate_sweep: Vec<f64>,
    /// Gamma shape of the arrival gaps (1: Poisson; < 1 burstier, > 1 more regular).
    #[arg(long, env = "DUET_BENCH_BURSTINESS", default_value_t = 1.0)]
    pub burstiness: f64,
    /// Most requests in flight (without a rate: a closed loop of this many clients).
    #[arg(long, env = "DUET_BENCH_MAX_CONCURRENCY")]
    pub max_concurrency: Option<usize>,
    /// Measured requests per run (default 100 unless --duration is given).
    #[arg(long, env = "DUET_BENCH_NUM_PROMPTS")]
    pub num_prompts: Option<usize>,
    /// Stop sending after this long (`60s`, `5m`).
    #[arg(long, env = "DUET_BENCH_DURATION", value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Requests sent before the first run and left out of every statistic.
    #[arg(long, env = "DUET_BENCH_WARMUP", default_value_t = 0)]
    pub warmup: usize,
}

/// The service-level objective runs are judged by.
#[derive(Args, Debug, Clone)]
pub struct SloArgs {
    /// Service-level objective, milliseconds: `ttft=500,tpot=100` (also `e2e=`).
    #[arg(long, env = "DUET_BENCH_SLO")]
    pub slo: Option<String>,
    /// Attainment a rate must reach to count towards goodput.
    #[arg(long, env = "DUET_BENCH_SLO_ATTAINMENT", default_value_t = 0.9)]
    pub slo_attainment: f64,
}

/// Where results go.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Write the report (configuration, summaries, every request) here.
    #[arg(long, env = "DUET_BENCH_OUTPUT_JSON")]
    pub output_json: Option<PathBuf>,
    /// Write SVG plots (latency CDFs, attainment against rate) here.
    #[arg(long, env = "DUET_BENCH_PLOT_DIR")]
    pub plot_dir: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, env = "DUET_BENCH_QUIET")]
    pub quiet: bool,
}

/// Who the requests go to (a real server for `bench serve`; nobody for a simulation).
pub struct Target {
    /// The label when `--label` is not given.
    pub label: &'static str,
    pub backend: BackendKind,
    pub url: String,
    pub endpoint: String,
    pub model_name: Option<String>,
    pub send: SendOptions,
}

/// The configuration of a `bench serve` run (measured or simulated).
pub fn serve_config(
    w: &WorkloadArgs,
    a: &ArrivalArgs,
    slo: &SloArgs,
    target: Target,
) -> anyhow::Result<ServeConfig> {
    let dataset = match w.dataset {
        Dataset::Fixed => DatasetKind::Fixed,
        Dataset::Uniform => DatasetKind::Uniform,
        Dataset::Lognormal => DatasetKind::Lognormal,
        Dataset::AzureConv => DatasetKind::AzureConv,
    };
    let length_params = LengthParams {
        input_len: w.input_len,
        output_len: w.output_len,
        range_ratio: w.range_ratio,
        input_median: w.input_median,
        output_median: w.output_median,
        length_scale: w.length_scale,
        max_input_len: w.max_input_len,
        max_output_len: w.max_output_len,
    };
    let rates = if a.rate_sweep.is_empty() {
        vec![a.request_rate]
    } else {
        a.rate_sweep.iter().copied().map(Some).collect()
    };
    let num_prompts = match (a.num_prompts, a.duration) {
        (None, None) => Some(100),
        (n, _) => n,
    };
    Ok(ServeConfig {
        label: w.label.clone().unwrap_or_else(|| target.label.to_string()),
        backend: target.backend,
        url: target.url,
        endpoint: target.endpoint,
        model_name: target.model_name,
        tokenizer: w.model.clone(),
        dataset,
        lengths: length_params.lengths(dataset)?,
        length_params,
        corpus: w.corpus.clone(),
        shared_prefix_len: w.shared_prefix_len,
        num_prefixes: w.num_prefixes,
        turns: w.turns,
        seed: w.seed,
        send: target.send,
        rates,
        burstiness: a.burstiness,
        max_concurrency: a.max_concurrency,
        num_prompts,
        duration: a.duration,
        warmup: a.warmup,
        slo: slo.slo.as_deref().map(Slo::parse).transpose()?,
        attainment_target: slo.slo_attainment,
    })
}
