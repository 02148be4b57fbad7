//! Router settings.

use std::time::Duration;

use duet_serving::tls::ClientTls;

use crate::api_keys::ApiKeys;

/// How prefill and decode are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Long prompts on prefill workers, KV moved to decode workers; prompts up to
    /// `local_prefill_max_tokens` prefilled on the decode worker itself.
    Disaggregated,
    /// Every request on one worker that mixes prefill chunks into its decode batches.
    Colocated,
}

impl Mode {
    /// The name the `--mode` flag takes.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Disaggregated => "disaggregated",
            Mode::Colocated => "colocated",
        }
    }
}

/// Router settings (the CLI fills them from flags / `DUET_*` variables).
#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub mode: Mode,
    /// This router's id: the key its load is published under (default: `router-` and a
    /// random suffix, so routers of one cluster never share it).
    pub id: String,
    /// Prompts up to this many tokens are prefilled on the decode worker (0: never).
    pub local_prefill_max_tokens: usize,
    /// Requests waiting for placement, per priority class, before RESOURCE_EXHAUSTED.
    pub max_queued_per_priority: usize,
    /// How long a request may wait for a worker with room before it fails.
    pub max_queue_wait: Duration,
    /// Lifetime of a decode reservation waiting for its KV.
    pub reservation_ttl: Duration,
    /// Attempts on other workers before the first token was sent.
    pub max_attempts: usize,
    /// Times a stream may move to another worker pair after its decode worker failed
    /// mid-stream (0: the stream fails instead).
    pub max_migrations: usize,
    /// Generated tokens counted when checking a decode worker's free blocks.
    pub decode_headroom_tokens: usize,
    /// Served model name (what clients put in `model`).
    pub model_name: String,
    /// Longest sequence (prompt + generated) accepted, below the model's context length
    /// (vLLM's `--max-model-len`); `None`: the model's.
    pub max_model_len: Option<usize>,
    /// Deadline of a request whose client set none (no `grpc-timeout`; HTTP requests).
    pub default_request_timeout: Duration,
    /// How long a request waits for a decode worker to appear when none is known at all,
    /// before it fails as unavailable (HTTP 503).
    pub no_worker_grace: Duration,
    /// Keys a client of the public doors must present (none: the doors are open).
    pub api_keys: ApiKeys,
    /// Requests one client address may have in flight at once (0: unlimited).
    pub max_in_flight_per_client: usize,
    /// Longest wait for a prefill worker's answer; past it the worker is treated as hung
    /// and the request tries another.
    pub prefill_timeout: Duration,
    /// Longest silence of a decode worker between two tokens of a stream; past it the
    /// worker is treated as hung and the stream migrates.
    pub stream_stall_timeout: Duration,
    /// How long a worker that could not be reached or timed out is placed last.
    pub suspect_for: Duration,
    /// Largest request accepted on the public doors (gRPC message, HTTP body), in bytes.
    pub max_request_bytes: usize,
    /// TLS towards the workers' gRPC servers (their addresses are `https://`); `None`: the
    /// router cannot reach a worker that serves TLS.
    pub worker_tls: Option<ClientTls>,
    /// KV-aware routing: follow the workers' prefix-cache events and prefer workers that
    /// hold a request's prefix (`false`: route on load alone).
    pub kv_routing: bool,
    /// In a decode worker's routing cost, what one running or waiting sequence weighs, in
    /// prompt tokens to prefill (the cost's other part).
    pub decode_seq_cost_tokens: u64,
    /// The attention policy of requests that name none.
    pub attention: duet_engine::AttentionPolicy,
    /// The HTTP door's connection limits and timeouts.
    pub http: crate::http::HttpLimits,
    /// What the router's calls to workers carry (derived from the cluster secret; workers
    /// refuse calls without it). `None`: nothing (stand-in workers only).
    pub cluster_token: Option<duet_serving::cluster_auth::ClusterToken>,
}

impl RouterConfig {
    /// The context length requests are held to.
    pub fn context_length(&self, model_context: usize) -> usize {
        self.max_model_len
            .map_or(model_context, |m| m.min(model_context))
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            mode: Mode::Disaggregated,
            id: format!("router-{:08x}", rand::random::<u32>()),
            local_prefill_max_tokens: 32,
            max_queued_per_priority: 1024,
            max_queue_wait: Duration::from_secs(30),
            reservation_ttl: Duration::from_secs(30),
            max_attempts: 3,
            max_migrations: 2,
            decode_headroom_tokens: 64,
            model_name: "default".into(),
            max_model_len: None,
            default_request_timeout: Duration::from_secs(600),
            no_worker_grace: Duration::from_secs(1),
            api_keys: ApiKeys::default(),
            max_in_flight_per_client: 0,
            max_request_bytes: 4 << 20,
            suspect_for: Duration::from_secs(10),
            prefill_timeout: Duration::from_secs(120),
            stream_stall_timeout: Duration::from_secs(30),
            worker_tls: None,
            kv_routing: true,
            decode_seq_cost_tokens: 256,
            attention: duet_engine::AttentionPolicy::Full,
            http: crate::http::HttpLimits::default(),
            cluster_token: None,
        }
    }
}
