//! `duet router` and the router part of `duet up`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use duet_discovery::Registry;
use duet_engine::TextFrontend;
pub use duet_router::server::RouterListeners;
use duet_router::{ApiKeys, RouterConfig};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::args::{parse_duration, ModeArg, Switch};

/// Routing flags (shared by `duet router` and `duet up`).
#[derive(Args, Debug, Clone)]
pub struct RoutingArgs {
    /// Disaggregated (prefill workers + decode workers) or colocated (one worker per request
    /// does both, chunked prefill mixed into decode batches).
    #[arg(long, env = "DUET_MODE", value_enum, default_value = "disaggregated")]
    pub mode: ModeArg,
    /// Prompts up to this many tokens are prefilled on the decode worker (0: never).
    #[arg(long, env = "DUET_LOCAL_PREFILL_MAX_TOKENS", default_value_t = 32)]
    pub local_prefill_max_tokens: usize,
    /// Requests waiting for a worker, per priority class, before RESOURCE_EXHAUSTED.
    #[arg(long, env = "DUET_MAX_QUEUED", default_value_t = 1024)]
    pub max_queued: usize,
    /// Longest wait for a worker with room.
    #[arg(long, env = "DUET_MAX_QUEUE_WAIT", default_value = "30s", value_parser = parse_duration)]
    pub max_queue_wait: Duration,
    /// Attempts on other workers before the first token.
    #[arg(long, env = "DUET_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: usize,
    /// Times a stream may move to another worker pair when its decode worker fails
    /// mid-stream: the prompt plus the tokens already sent are prefilled again and the
    /// stream continues (0: the stream fails instead).
    #[arg(long, env = "DUET_MAX_MIGRATIONS", default_value_t = 2)]
    pub max_migrations: usize,
    /// Longest wait for a prefill worker's answer before the request tries another (a hung
    /// worker); keep it above the longest prompt's prefill time.
    #[arg(long, env = "DUET_PREFILL_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub prefill_timeout: Duration,
    /// Longest silence between two tokens of a stream before its decode worker is treated
    /// as hung and the stream migrates.
    #[arg(long, env = "DUET_STREAM_STALL_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub stream_stall_timeout: Duration,
    /// Model name clients use (default: the GGUF file name without extension).
    #[arg(long, env = "DUET_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// A Jinja chat template file for the chat doors, instead of the GGUF's (like vLLM's
    /// --chat-template): for models whose GGUF has none, such as base models.
    #[arg(long, env = "DUET_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// Longest prompt + generation accepted, below the model's context (like vLLM's
    /// --max-model-len); default: the model's context length.
    #[arg(long, env = "DUET_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Deadline of requests that set none (no gRPC deadline; HTTP requests).
    #[arg(long, env = "DUET_REQUEST_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// How long a request waits for a decode worker to appear when none is known, before
    /// it fails as unavailable (HTTP 503).
    #[arg(long, env = "DUET_NO_WORKER_GRACE", default_value = "1s", value_parser = parse_duration)]
    pub no_worker_grace: Duration,
    /// API keys clients of the public doors must send as `authorization: Bearer <key>`
    /// (repeat the flag or separate with commas; none: open doors). Never logged.
    #[arg(
        long = "api-key",
        env = "DUET_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and lines starting with `#` are
    /// skipped), accepted besides `--api-key`: keys stay out of the command line and the
    /// environment (the Helm chart mounts them from a Secret).
    #[arg(long, env = "DUET_API_KEY_FILE")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Requests one client address may have in flight (0: unlimited); more get
    /// RESOURCE_EXHAUSTED (HTTP 429).
    #[arg(long, env = "DUET_MAX_IN_FLIGHT_PER_CLIENT", default_value_t = 0)]
    pub max_in_flight_per_client: usize,
    /// Largest request accepted on the public doors (gRPC message, HTTP body), in bytes.
    #[arg(long, env = "DUET_MAX_REQUEST_BYTES", default_value_t = 4 << 20)]
    pub max_request_bytes: usize,
    /// HTTP door: time a client has to send a complete request head, from connecting and
    /// from the end of its previous response (so also the idle keep-alive timeout).
    #[arg(long, env = "DUET_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,
    /// HTTP door: time a client has to send a request's whole body once its head arrived
    /// (408 past it).
    #[arg(long, env = "DUET_HTTP_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub http_body_timeout: Duration,
    /// HTTP door: connections open at once; one more is answered 503 and closed.
    #[arg(long, env = "DUET_HTTP_MAX_CONNECTIONS", default_value_t = 1024)]
    pub http_max_connections: usize,
    /// KV-aware routing: follow every worker's prefix-cache events and send a request where
    /// its prompt's prefix is cached (cost: tokens still to prefill plus load); `off` routes
    /// on load alone.
    #[arg(long, env = "DUET_KV_ROUTING", value_enum, default_value = "on")]
    pub kv_routing: Switch,
    /// In a decode worker's routing cost, what one running or waiting sequence weighs, in
    /// prompt tokens the worker would prefill (the cost's other part).
    #[arg(long, env = "DUET_DECODE_SEQ_COST_TOKENS", default_value_t = 256)]
    pub decode_seq_cost_tokens: u64,
    /// Attention of requests that name none (`attention` in the request): `full`;
    /// `window=W,sinks=S`: each token attends to the first S tokens and its last W
    /// (StreamingLLM), a sequence's KV stays bounded and generation may run past the
    /// context; or `snapkv=B[,observe=O,pool=P]`: once a prompt is computed, each layer's
    /// KV heads keep the B positions its last O queries attend to most (SnapKV). Under
    /// either only the kept KV travels from prefill to decode (native engine; no prefix
    /// cache for such requests).
    #[arg(long, env = "DUET_ATTENTION", default_value = "full")]
    pub attention: duet_engine::AttentionPolicy,
}

impl RoutingArgs {
    /// The router's text side of `model`: tokenizer and chat template (`--chat-template`'s
    /// when given, else the GGUF's).
    pub fn frontend(&self, model: &Path) -> anyhow::Result<TextFrontend> {
        let mut front =
            TextFrontend::load(model).with_context(|| format!("reading {}", model.display()))?;
        if let Some(path) = &self.chat_template {
            front.chat_template = Some(crate::cmd::model_args::chat_template(
                path,
                &front.tokenizer,
            )?);
        }
        Ok(front)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.max_queued == 0 {
            anyhow::bail!("--max-queued: at least 1");
        }
        if self.max_model_len.is_some_and(|m| m < 2) {
            anyhow::bail!("--max-model-len: at least 2");
        }
        if self.max_attempts == 0 {
            anyhow::bail!("--max-attempts: at least 1");
        }
        if self.max_request_bytes < 1024 {
            anyhow::bail!("--max-request-bytes: at least 1024");
        }
        if self.http_header_timeout < Duration::from_millis(100) {
            anyhow::bail!("--http-header-timeout: at least 100ms");
        }
        if self.http_body_timeout < Duration::from_millis(100) {
            anyhow::bail!("--http-body-timeout: at least 100ms");
        }
        if self.http_max_connections == 0 {
            anyhow::bail!("--http-max-connections: at least 1");
        }
        // A missing or empty key file stops the router before it opens any door.
        self.api_keys()?;
        Ok(())
    }

    /// Every API key given: `--api-key` and the lines of `--api-key-file`.
    pub fn api_keys(&self) -> anyhow::Result<Vec<String>> {
        let mut keys = self.api_keys.clone();
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--api-key-file: reading {}: {e}", path.display()))?;
            let from_file: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect();
            if from_file.is_empty() {
                anyhow::bail!(
                    "--api-key-file {}: no key in it (one per line; an empty file would open the doors)",
                    path.display()
                );
            }
            keys.extend(from_file);
        }
        Ok(keys)
    }

    pub fn config(&self, model_name: String) -> anyhow::Result<RouterConfig> {
        Ok(RouterConfig {
            mode: self.mode.into(),
            local_prefill_max_tokens: self.local_prefill_max_tokens,
            max_queued_per_priority: self.max_queued,
            max_queue_wait: self.max_queue_wait,
            max_attempts: self.max_attempts,
            max_migrations: self.max_migrations,
            prefill_timeout: self.prefill_timeout,
            stream_stall_timeout: self.stream_stall_timeout,
            model_name,
            max_model_len: self.max_model_len,
            default_request_timeout: self.request_timeout,
            no_worker_grace: self.no_worker_grace,
            api_keys: ApiKeys::new(self.api_keys()?),
            max_in_flight_per_client: self.max_in_flight_per_client,
            max_request_bytes: self.max_request_bytes,
            kv_routing: self.kv_routing == Switch::On,
            decode_seq_cost_tokens: self.decode_seq_cost_tokens,
            attention: self.attention,
            http: duet_router::http::HttpLimits {
                header_timeout: self.http_header_timeout,
                body_timeout: self.http_body_timeout,
                max_connections: self.http_max_connections,
            },
            ..RouterConfig::default()
        })
    }
}

/// The name clients use for the model at `path`.
pub fn model_name(path: &std::path::Path, flag: &Option<String>) -> String {
    flag.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "default".into())
    })
}

/// Serves the public doors until `shutdown` ([`duet_router::server::serve`]).
pub async fn run_router(
    front: Arc<TextFrontend>,
    cfg: RouterConfig,
    registry: Arc<dyn Registry>,
    cluster: String,
    listeners: RouterListeners,
    shutdown: CancellationToken,
    drain: Duration,
) -> anyhow::Result<()> {
    Ok(
        duet_router::server::serve(front, cfg, registry, cluster, listeners, shutdown, drain)
            .await?,
    )
}

/// Binds `addr` and serves `/metrics` there until `shutdown` (worker processes; the router
/// serves it on its HTTP door too).
pub async fn serve_metrics_on(
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let handle = duet_telemetry::install()?;
    let l = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding --metrics-listen {addr}: {e}"))?;
    println!("duet: metrics on http://{}/metrics", l.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = duet_telemetry::serve_metrics(l, handle, shutdown).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(())
}
