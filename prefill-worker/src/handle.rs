//! The prefill worker's async face: its settings, the job and result types, and the
//! cloneable handle that sends commands to the engine thread ([`crate::engine_loop`]) and
//! reads its published status.
//!
//! Invariant: the status a caller reads counts every job sent and not yet finished, also
//! those still in the channel (a worker busy with a long forward never reads idle).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use duet_engine::{
    AttentionPolicy, BlockHash, EngineModel, KvCacheConfig, PrefixCacheConfig, SamplingParams,
};
use duet_kv_transfer::{Connector, Route};
use duet_worker_common::kv_events::KvEventHub;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::engine_loop;
use crate::error::PrefillError;
use crate::transfer::Reply;

/// Prefill worker settings.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    pub id: String,
    /// Prompt tokens in one forward.
    pub max_batch_tokens: usize,
    /// Requests queued before new ones are refused.
    pub max_queue: usize,
    /// The prefix cache and its lower tiers (`None`: off).
    pub prefix_cache: Option<PrefixCacheConfig>,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            id: "prefill-0".into(),
            max_batch_tokens: 2048,
            max_queue: 256,
            prefix_cache: Some(PrefixCacheConfig::default()),
        }
    }
}

/// One prompt to prefill and where its KV goes.
pub struct PrefillJob {
    pub request_id: u64,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Where the KV goes (and the tcp fallback of an shm choice).
    pub route: Route,
    /// Destination blocks reserved by the decode worker, in sequence order, for the tokens
    /// from `dst_start` on.
    pub dst_blocks: Vec<u32>,
    /// Leading tokens the decode worker already holds (whole blocks): not sent.
    pub dst_start: usize,
    /// Batch requests queue behind interactive ones.
    pub batch: bool,
    /// Under a local window only the prompt's kept blocks are sent, once it is computed.
    pub attention: AttentionPolicy,
    pub span: tracing::Span,
}

/// What a completed prefill returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillResult {
    pub first_token: u32,
    pub queue_seconds: f64,
    pub prefill_seconds: f64,
    /// Exposed transfer time: end of the last forward -> the decode worker's acknowledgement.
    pub kv_transfer_seconds: f64,
    /// First layer handed to the transport -> acknowledgement (overlaps the compute).
    pub kv_stream_seconds: f64,
    pub kv_bytes: u64,
    /// Prompt tokens found in this worker's prefix cache (not computed).
    pub cached_tokens: usize,
}

/// Live numbers for the registry and `Status`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillStatus {
    pub queued: u32,
    pub running: u32,
    pub queued_prefill_tokens: u64,
    pub kv_blocks_total: u64,
    pub kv_blocks_free: u64,
    /// Of the free blocks, those holding cached prefixes.
    pub kv_blocks_cached: u64,
    /// Prompt tokens per second, exponentially averaged over forwards.
    pub tokens_per_second: f64,
    /// The cache's layer groups, when the model mixes global and local layers.
    pub kv_groups: Option<duet_discovery::KvGroupShape>,
}

/// Prefills sent to the engine thread that it has not taken from its channel yet (they
/// arrived during a forward). The status counts them, so a worker busy with a long forward
/// never reads idle while work waits for it.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    requests: AtomicU64,
    tokens: AtomicU64,
}

impl Pending {
    pub(crate) fn sent(&self, job: &PrefillJob) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.tokens
            .fetch_add(job.prompt.len() as u64, Ordering::SeqCst);
    }

    pub(crate) fn taken(&self, job: &PrefillJob) {
        self.requests.fetch_sub(1, Ordering::SeqCst);
        self.tokens
            .fetch_sub(job.prompt.len() as u64, Ordering::SeqCst);
    }
}

pub(crate) enum Cmd {
    Prefill(Box<PrefillJob>, Reply),
    Cancel(u64),
    Prefetch(Vec<BlockHash>),
    /// Wakes the engine thread (its cancellation fired).
    Wake,
}

/// Cloneable handle to the prefill engine thread.
#[derive(Clone)]
pub struct PrefillHandle {
    tx: std_mpsc::Sender<Cmd>,
    status: Arc<Mutex<PrefillStatus>>,
    pending: Arc<Pending>,
    connector: Arc<Connector>,
    kv_events: KvEventHub,
    block_size: u32,
}

impl PrefillHandle {
    /// Starts the engine thread; transfer tasks run on `rt`.
    pub fn start(
        model: Arc<EngineModel>,
        kv: KvCacheConfig,
        cfg: PrefillConfig,
        connector: Arc<Connector>,
        rt: tokio::runtime::Handle,
        cancel: CancellationToken,
    ) -> Result<PrefillHandle, PrefillError> {
        let (tx, rx) = std_mpsc::channel();
        let status = Arc::new(Mutex::new(PrefillStatus::default()));
        let pending = Arc::new(Pending::default());
        let kv_events = KvEventHub::new(cfg.id.clone(), kv.block_size);
        let block_size = u32::try_from(kv.block_size).unwrap_or(u32::MAX);
        engine_loop::spawn(
            engine_loop::Shared {
                model,
                kv,
                cfg,
                status: status.clone(),
                pending: pending.clone(),
                connector: connector.clone(),
                kv_events: kv_events.clone(),
            },
            rt,
            tx.clone(),
            rx,
            cancel,
        )?;
        Ok(PrefillHandle {
            tx,
            status,
            pending,
            connector,
            kv_events,
            block_size,
        })
    }

    /// Queues a prefill; resolves when the decode worker holds the KV.
    pub async fn prefill(&self, job: PrefillJob) -> Result<PrefillResult, PrefillError> {
        let (reply, rx) = oneshot::channel();
        self.pending.sent(&job);
        if let Err(std_mpsc::SendError(Cmd::Prefill(job, _))) =
            self.tx.send(Cmd::Prefill(Box::new(job), reply))
        {
            self.pending.taken(&job);
            return Err(PrefillError::ShuttingDown);
        }
        rx.await.map_err(|_| PrefillError::ShuttingDown)?
    }

    /// Drops a queued or running prefill.
    pub fn cancel(&self, request_id: u64) {
        let _ = self.tx.send(Cmd::Cancel(request_id));
    }

    /// Starts bringing a prompt's blocks up from the host and disk tiers (fire and forget).
    pub fn prefetch(&self, block_hashes: Vec<BlockHash>) {
        let _ = self.tx.send(Cmd::Prefetch(block_hashes));
    }

    /// The worker's prefix-cache events (for `duet.v1.KvCache`).
    pub fn kv_events(&self) -> &KvEventHub {
        &self.kv_events
    }

    /// Latest status: the engine's (published when work is admitted, before and after
    /// every forward) plus what waits in its channel.
    pub fn status(&self) -> PrefillStatus {
        let mut s = self.status.lock().map(|s| s.clone()).unwrap_or_default();
        s.queued += self.pending.requests.load(Ordering::SeqCst) as u32;
        s.queued_prefill_tokens += self.pending.tokens.load(Ordering::SeqCst);
        s
    }

    /// Tokens per KV block of the scratch pool.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The connector (endpoint choice).
    pub fn connector(&self) -> &Connector {
        &self.connector
    }
}
