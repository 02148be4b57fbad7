//! `duet bench serve`: load generator against duet's gRPC door or an OpenAI-compatible
//! server (the logic lives in the `duet-bench` crate; this file maps flags to its
//! configuration and prints / writes what it returns).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use duet_bench::{
    BackendKind, DatasetKind, IgnoreEos, LengthParams, PromptFormat, SendOptions, ServeConfig, Slo,
};

use crate::cmd::cluster::args::parse_duration;
use crate::cmd::model_args::DEFAULT_MODEL;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Backend {
    /// duet's gRPC door (`duet.v1.Generation/Generate`).
    Duet,
    /// Any OpenAI-compatible server (`POST {url}/v1/completions`, streamed).
    Openai,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Dataset {
    /// Every prompt --input-len tokens, every output --output-len tokens.
    Fixed,
    /// Uniform within ±--range-ratio of --input-len / --output-len.
    Uniform,
    /// Lognormal with means --input-len / --output-len and medians --input-median /
    /// --output-median.
    Lognormal,
    /// Lognormal shaped like the Azure LLM inference trace 2023, conversation set (input
    /// mean 1155 / median 1020, output mean 211 / median 129), times --length-scale, capped.
    AzureConv,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// Token ids (exact prompt lengths).
    Tokens,
    /// Text decoded from the ids (for servers that only take strings).
    Text,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum EosParam {
    /// `"ignore_eos": true` (duet, vLLM, llama.cpp's llama-server).
    IgnoreEos,
    /// `"min_tokens": max_tokens` (llama-cpp-python's server).
    MinTokens,
    /// Neither: outputs may stop early at end-of-sequence.
    None,
}

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Target kind.
    #[arg(long, env = "DUET_BENCH_BACKEND", value_enum, default_value = "duet")]
    pub backend: Backend,
    /// Target URL: the gRPC door (`http://127.0.0.1:50051`) or the HTTP server's base URL.
    #[arg(long, env = "DUET_BENCH_URL", default_value = "http://127.0.0.1:50051")]
    pub url: String,
    /// Path of the completions endpoint (openai backend).
    #[arg(long, env = "DUET_BENCH_ENDPOINT", default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name sent with requests (default: duet's only model; for openai, the first id
    /// of GET /v1/models).
    #[arg(long, env = "DUET_BENCH_MODEL_NAME")]
    pub model_name: Option<String>,
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
    /// How prompts are sent to openai targets.
    #[arg(
        long,
        env = "DUET_BENCH_PROMPT_FORMAT",
        value_enum,
        default_value = "tokens"
    )]
    pub prompt_format: Format,
    /// How exact output lengths are asked of openai targets.
    #[arg(
        long,
        env = "DUET_BENCH_IGNORE_EOS_PARAM",
        value_enum,
        default_value = "ignore-eos"
    )]
    pub ignore_eos_param: EosParam,
    /// JSON object merged into every OpenAI request body, e.g. '{"cache_prompt": false}'
    /// for llama.cpp's llama-server.
    #[arg(long, env = "DUET_BENCH_EXTRA_BODY", value_parser = parse_object)]
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
    /// API key of a server started with `--api-key` (sent as `authorization: Bearer`).
    #[arg(long, env = "DUET_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Sampling temperature (0: greedy).
    #[arg(long, env = "DUET_BENCH_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,

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
    /// Longest time one request may take.
    #[arg(long, env = "DUET_BENCH_TIMEOUT", default_value = "600s", value_parser = parse_duration)]
    pub timeout: Duration,

    /// Service-level objective, milliseconds: `ttft=500,tpot=100` (also `e2e=`).
    #[arg(long, env = "DUET_BENCH_SLO")]
    pub slo: Option<String>,
    /// Attainment a rate must reach to count towards goodput.
    #[arg(long, env = "DUET_BENCH_SLO_ATTAINMENT", default_value_t = 0.9)]
    pub slo_attainment: f64,

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

impl ServeBenchArgs {
    fn config(&self) -> anyhow::Result<ServeConfig> {
        let dataset = match self.dataset {
            Dataset::Fixed => DatasetKind::Fixed,
            Dataset::Uniform => DatasetKind::Uniform,
            Dataset::Lognormal => DatasetKind::Lognormal,
            Dataset::AzureConv => DatasetKind::AzureConv,
        };
        let length_params = LengthParams {
            input_len: self.input_len,
            output_len: self.output_len,
            range_ratio: self.range_ratio,
            input_median: self.input_median,
            output_median: self.output_median,
            length_scale: self.length_scale,
            max_input_len: self.max_input_len,
            max_output_len: self.max_output_len,
        };
        let backend = match self.backend {
            Backend::Duet => BackendKind::Duet,
            Backend::Openai => BackendKind::Openai,
        };
        let rates = if self.rate_sweep.is_empty() {
            vec![self.request_rate]
        } else {
            self.rate_sweep.iter().copied().map(Some).collect()
        };
        let num_prompts = match (self.num_prompts, self.duration) {
            (None, None) => Some(100),
            (n, _) => n,
        };
        Ok(ServeConfig {
            label: self.label.clone().unwrap_or_else(|| {
                match self.backend {
                    Backend::Duet => "duet",
                    Backend::Openai => "openai",
                }
                .to_string()
            }),
            backend,
            url: self.url.clone(),
            endpoint: self.endpoint.clone(),
            model_name: self.model_name.clone(),
            tokenizer: self.model.clone(),
            dataset,
            lengths: length_params.lengths(dataset)?,
            length_params,
            corpus: self.corpus.clone(),
            shared_prefix_len: self.shared_prefix_len,
            num_prefixes: self.num_prefixes,
            turns: self.turns,
            seed: self.seed,
            send: SendOptions {
                temperature: self.temperature,
                seed: (self.temperature > 0.0).then_some(self.seed),
                prompt_format: match self.prompt_format {
                    Format::Tokens => PromptFormat::Tokens,
                    Format::Text => PromptFormat::Text,
                },
                ignore_eos: match self.ignore_eos_param {
                    EosParam::IgnoreEos => IgnoreEos::IgnoreEos,
                    EosParam::MinTokens => IgnoreEos::MinTokens,
                    EosParam::None => IgnoreEos::None,
                },
                extra_body: self.extra_body.clone().unwrap_or_default(),
                api_key: self.api_key.clone(),
                timeout: self.timeout,
            },
            rates,
            burstiness: self.burstiness,
            max_concurrency: self.max_concurrency,
            num_prompts,
            duration: self.duration,
            warmup: self.warmup,
            slo: self.slo.as_deref().map(Slo::parse).transpose()?,
            attainment_target: self.slo_attainment,
        })
    }
}

pub fn run(a: ServeBenchArgs) -> anyhow::Result<()> {
    let cfg = a.config()?;
    cfg.validate()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(duet_bench::run(&cfg, !a.quiet))?;
    print!("{}", report.table());
    if let Some(path) = &a.output_json {
        report.write(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &a.plot_dir {
        for p in duet_bench::plot::write_plots(std::slice::from_ref(&report), dir, None)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(())
}

/// A JSON object flag.
fn parse_object(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("a JSON object is expected".into()),
        Err(e) => Err(e.to_string()),
    }
}
