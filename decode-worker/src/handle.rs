//! The decode worker's async face: a cloneable handle that sends commands to the engine
//! thread (TGI-style actor: bounded admission, oneshot replies, the request's span carried
//! along).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::{AttentionPolicy, BlockHash, EngineModel, FinishReason, GenerationParams};
use duet_worker_common::kv_events::KvEventHub;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::config::DecodeConfig;
use crate::error::DecodeError;
use crate::leases::Leases;
use crate::scheduler::Scheduler;

/// Scheduling class: batch sequences are preempted first and admitted last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    Interactive,
    Batch,
}

/// Where the prompt's KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillSource {
    /// A prefill worker sends it into the reservation; it sampled `first_token`.
    Remote { first_token: u32 },
    /// This worker computes it, in chunks mixed into its decode steps; the last `replay`
    /// prompt tokens were generated before and are fed one per step (see [`crate`] docs).
    Local { replay: usize },
}

/// One generation request.
pub struct GenerateJob {
    pub request_id: u64,
    pub prompt: Vec<u32>,
    pub params: GenerationParams,
    pub priority: Priority,
    pub prefill: PrefillSource,
    /// Checked against the model at the door ([`DecodeHandle::check_attention`]).
    pub attention: AttentionPolicy,
    pub span: tracing::Span,
}

/// How a finished sequence ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Done {
    pub finish: FinishReason,
    pub completion_tokens: u32,
    pub prefill_seconds: f64,
    pub kv_wait_seconds: f64,
    pub preemptions: u32,
    /// Tokens generated when the sequence was first preempted (its KV was recomputed from
    /// the prompt and those tokens).
    pub first_preempted_at: Option<u32>,
    /// Prompt tokens whose KV came from the prefix cache (not computed by a local prefill,
    /// not transferred by a remote one).
    pub cached_tokens: usize,
}

/// What a generating sequence streams.
#[derive(Debug)]
pub enum Event {
    Token { id: u32, text: String },
    Done(Done),
    Error(DecodeError),
}

/// Live numbers the registry record and `Status` report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeStatus {
    pub kv_blocks_total: u64,
    pub kv_blocks_free: u64,
    /// Of the free blocks, those holding cached prefixes.
    pub kv_blocks_cached: u64,
    pub block_size: u32,
    pub running: u32,
    pub waiting: u32,
    pub reservations: u32,
    pub max_batch: u32,
    /// Generated tokens per second, exponentially averaged over steps.
    pub tokens_per_second: f64,
    /// The cache's layer groups, when the model mixes global and local layers.
    pub kv_groups: Option<duet_discovery::KvGroupShape>,
}

pub(crate) enum Cmd {
    Reserve {
        request_id: u64,
        prompt_tokens: usize,
        ttl: Duration,
        block_hashes: Vec<BlockHash>,
        attention: AttentionPolicy,
        reply: oneshot::Sender<Result<Reserved, DecodeError>>,
    },
    Generate {
        job: GenerateJob,
        events: mpsc::UnboundedSender<Event>,
    },
    Release {
        request_id: u64,
        reply: Option<oneshot::Sender<bool>>,
    },
    /// A layer of a transfer was written into the request's reserved blocks under lease
    /// generation `lease` (reports name it: one about an earlier reservation of the same
    /// request id is ignored).
    LayerArrived {
        request_id: u64,
        lease: u64,
    },
    TransferDone {
        request_id: u64,
        token_end: usize,
        lease: Option<u64>,
    },
    /// `lease`: `None` when the transfer failed before it took one.
    TransferFailed {
        request_id: u64,
        reason: String,
        lease: Option<u64>,
    },
    Prefetch {
        block_hashes: Vec<BlockHash>,
    },
    /// Wakes the engine thread (its cancellation fired).
    Wake,
}

/// A reservation: the leading prompt tokens the worker already holds (prefix cache) and
/// the fresh blocks the rest of the KV goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub cached_tokens: usize,
    pub blocks: Vec<u32>,
}

/// Who waits to hear that a request's transfer failed: request id -> the waiter. Filled by
/// [`DecodeHandle::watch_transfer`], emptied when the failure is told or the waiter leaves.
type TransferWatchers = Arc<Mutex<std::collections::HashMap<u64, oneshot::Sender<String>>>>;

/// Cloneable handle to a decode worker's engine thread.
#[derive(Clone)]
pub struct DecodeHandle {
    tx: std_mpsc::Sender<Cmd>,
    status: Arc<Mutex<DecodeStatus>>,
    leases: Leases,
    layout: duet_engine::KvLayout,
    context_length: usize,
    vocab_size: usize,
    model: Arc<EngineModel>,
    stopped: Arc<AtomicBool>,
    kv_events: KvEventHub,
    watchers: TransferWatchers,
}

impl DecodeHandle {
    /// Starts the engine thread over `model` with a pool of `num_blocks` blocks.
    /// The thread ends when `cancel` fires (every request still running gets
    /// `ShuttingDown`) or every handle is dropped.
    pub fn start(
        model: Arc<EngineModel>,
        kv: duet_engine::KvCacheConfig,
        cfg: DecodeConfig,
        cancel: CancellationToken,
    ) -> Result<DecodeHandle, DecodeError> {
        let layout = model.kv_layout(kv.block_size, kv.dtype)?;
        let context_length = model.config().context_length;
        let vocab_size = model.config().vocab_size;
        let (tx, rx) = std_mpsc::channel();
        let status = Arc::new(Mutex::new(DecodeStatus::default()));
        let leases: Leases = Arc::default();
        let stopped = Arc::new(AtomicBool::new(false));
        let kv_events = KvEventHub::new(cfg.id.clone(), kv.block_size);
        let sched = Scheduler::new(
            model.clone(),
            kv,
            cfg.clone(),
            status.clone(),
            leases.clone(),
            kv_events.clone(),
        )?;
        // Started from the worker's runtime, cancellation wakes an idle engine at once;
        // without one (unit tests) the engine ends with its handles.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            duet_worker_common::engine_thread::wake_on_cancel(
                &rt,
                tx.clone(),
                cancel.clone(),
                Cmd::Wake,
            );
        }
        let flag = stopped.clone();
        std::thread::Builder::new()
            .name(format!("{}-engine", cfg.id))
            .spawn(move || {
                duet_worker_common::engine_thread::run(sched, rx, &cancel);
                flag.store(true, Ordering::SeqCst);
            })
            .map_err(|e| {
                DecodeError::Engine(duet_engine::EngineError::invalid(
                    "engine thread",
                    e.to_string(),
                ))
            })?;
        Ok(DecodeHandle {
            tx,
            status,
            leases,
            layout,
            context_length,
            vocab_size,
            model,
            stopped,
            kv_events,
            watchers: Arc::default(),
        })
    }

    fn send(&self, c: Cmd) -> Result<(), DecodeError> {
        self.tx.send(c).map_err(|_| DecodeError::ShuttingDown)
    }

    /// Reserves blocks for a prompt whose KV will arrive by kv-transfer, after the leading
    /// blocks of `block_hashes` that the prefix cache holds; under a local window, for the
    /// blocks the prompt keeps (no prefix cache).
    pub async fn reserve(
        &self,
        request_id: u64,
        prompt_tokens: usize,
        ttl: Duration,
        block_hashes: Vec<BlockHash>,
        attention: AttentionPolicy,
    ) -> Result<Reserved, DecodeError> {
        let (reply, rx) = oneshot::channel();
        self.send(Cmd::Reserve {
            request_id,
            prompt_tokens,
            ttl,
            block_hashes,
            attention,
            reply,
        })?;
        rx.await.map_err(|_| DecodeError::ShuttingDown)?
    }

    /// Starts generating; events stream until `Done` or `Error`. Dropping the receiver
    /// cancels the sequence (its blocks are freed at the next step).
    pub fn generate(&self, job: GenerateJob) -> mpsc::UnboundedReceiver<Event> {
        let (events, rx) = mpsc::unbounded_channel();
        if let Err(Cmd::Generate { events, .. }) =
            self.tx.send(Cmd::Generate { job, events }).map_err(|e| e.0)
        {
            let _ = events.send(Event::Error(DecodeError::ShuttingDown));
        }
        rx
    }

    /// Frees whatever the request holds; `true` if it held something.
    pub async fn release(&self, request_id: u64) -> bool {
        let (reply, rx) = oneshot::channel();
        if self
            .send(Cmd::Release {
                request_id,
                reply: Some(reply),
            })
            .is_err()
        {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Frees whatever the request holds without waiting for the answer (for drop guards,
    /// which cannot wait).
    pub fn release_now(&self, request_id: u64) {
        let _ = self.send(Cmd::Release {
            request_id,
            reply: None,
        });
    }

    /// Starts bringing a prompt's blocks up from the host and disk tiers (fire and forget).
    pub fn prefetch(&self, block_hashes: Vec<BlockHash>) {
        let _ = self.send(Cmd::Prefetch { block_hashes });
    }

    /// The worker's prefix-cache events (for `duet.v1.KvCache`).
    pub fn kv_events(&self) -> &KvEventHub {
        &self.kv_events
    }

    /// Latest status.
    pub fn status(&self) -> DecodeStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The engine's KV layout (what senders must match).
    pub fn layout(&self) -> &duet_engine::KvLayout {
        &self.layout
    }

    /// The model's vocabulary size (token ids are below it).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The model's context length.
    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// Whether this worker's engine and model run `policy` (`PolicyUnsupported`, a failed
    /// precondition, when they cannot: never served as full attention instead).
    pub fn check_attention(&self, policy: AttentionPolicy) -> Result<(), DecodeError> {
        Ok(self.model.check_attention(policy)?)
    }

    /// Whether the engine thread has ended.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    pub(crate) fn layer_arrived(&self, request_id: u64, lease: u64) {
        let _ = self.send(Cmd::LayerArrived { request_id, lease });
    }

    pub(crate) fn transfer_done(&self, request_id: u64, token_end: usize, lease: Option<u64>) {
        let _ = self.send(Cmd::TransferDone {
            request_id,
            token_end,
            lease,
        });
    }

    /// A transfer for `request_id` (under lease generation `lease`, if it took one) failed.
    /// Its waiter hears it unless the report is about an earlier reservation of that id.
    pub(crate) fn transfer_failed(&self, request_id: u64, reason: String, lease: Option<u64>) {
        let watcher = crate::leases::is_current(&self.leases, request_id, lease)
            .then(|| {
                self.watchers
                    .lock()
                    .ok()
                    .and_then(|mut w| w.remove(&request_id))
            })
            .flatten();
        if let Some(w) = watcher {
            let _ = w.send(reason.clone());
        }
        let _ = self.send(Cmd::TransferFailed {
            request_id,
            reason,
            lease,
        });
    }

    /// Resolves with the reason if `request_id`'s KV transfer fails before
    /// [`DecodeHandle::unwatch_transfer`]: the caller waiting on the prefill worker's answer
    /// hears at once that the KV will not come, instead of waiting for a sender that may be
    /// hung (the link's own timeout has already run out).
    pub(crate) fn watch_transfer(&self, request_id: u64) -> oneshot::Receiver<String> {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.watchers.lock() {
            w.insert(request_id, tx);
        }
        rx
    }

    /// Stops [`DecodeHandle::watch_transfer`] for `request_id`.
    pub(crate) fn unwatch_transfer(&self, request_id: u64) {
        if let Ok(mut w) = self.watchers.lock() {
            w.remove(&request_id);
        }
    }

    pub(crate) fn is_reserved(&self, request_id: u64, block: u32) -> bool {
        crate::leases::is_reserved(&self.leases, request_id, block)
    }

    /// Takes `request_id`'s lease for a receiver (`None`: no such reservation, or another
    /// receiver holds it).
    pub(crate) fn take_lease(&self, request_id: u64) -> Option<crate::leases::Held> {
        crate::leases::Held::take(&self.leases, request_id)
    }
}

/// Seconds since `t`.
pub(crate) fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}
