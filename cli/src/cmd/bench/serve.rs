//! `duet bench serve`: load generator against duet's gRPC door or an OpenAI-compatible
//! server (the logic lives in the `duet-bench` crate; this file maps flags to its
//! configuration and prints / writes what it returns).

use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use duet_bench::{BackendKind, IgnoreEos, PromptFormat, SendOptions, ServeConfig};

use super::workload_args::{serve_config, ArrivalArgs, ReportArgs, SloArgs, Target, WorkloadArgs};
use crate::cmd::cluster::args::parse_duration;

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
    /// Longest time one request may take.
    #[arg(long, env = "DUET_BENCH_TIMEOUT", default_value = "600s", value_parser = parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub arrival: ArrivalArgs,
    #[command(flatten)]
    pub slo: SloArgs,
    #[command(flatten)]
    pub report: ReportArgs,
}

impl ServeBenchArgs {
    fn config(&self) -> anyhow::Result<ServeConfig> {
        let (backend, label) = match self.backend {
            Backend::Duet => (BackendKind::Duet, "duet"),
            Backend::Openai => (BackendKind::Openai, "openai"),
        };
        let target = Target {
            label,
            backend,
            url: self.url.clone(),
            endpoint: self.endpoint.clone(),
            model_name: self.model_name.clone(),
            send: SendOptions {
                temperature: self.temperature,
                seed: (self.temperature > 0.0).then_some(self.workload.seed),
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
        };
        serve_config(&self.workload, &self.arrival, &self.slo, target)
    }
}

pub fn run(a: ServeBenchArgs) -> anyhow::Result<()> {
    let cfg = a.config()?;
    cfg.validate()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(duet_bench::run(&cfg, !a.report.quiet))?;
    print!("{}", report.table());
    if let Some(path) = &a.report.output_json {
        report.write(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &a.report.plot_dir {
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
