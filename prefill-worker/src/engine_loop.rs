//! The prefill engine thread: batching, chunking, and layer-by-layer KV hand-off.
//!
//! Each iteration fills one forward with up to `max_batch_tokens` prompt tokens: chunks of
//! requests already started first (oldest first), then new requests from the queue while
//! the budget and the scratch KV pool allow. A chunk that is not a request's last is a
//! multiple of the block size, so every chunk is a transfer of whole destination blocks
//! (`token_start` block aligned). After layer `l` of the forward, the hook hands each
//! chunk's layer-`l` regions, read in place from the scratch cache and pinned there
//! (`send_pool`), to the request's transfer task; a block whose sequence ends while a
//! sender still reads it is given back once the sender lets go (`reclaim_unpinned`, every
//! tick).
//!
//! Prefix cache: a request starts after the longest prefix its prompt finds in the cache
//! (only the rest is computed); KV the decode worker already holds (`dst_start`) is not
//! sent; cached blocks the decode worker lacks are sent from the cache before the first
//! forward. A finished prompt's blocks are registered and stay cached for the next request.
//!
//! Local windows (StreamingLLM): a windowed prompt holds at most its window's blocks here
//! (each chunk's commit drops what no later query sees) and never touches the prefix cache;
//! its chunks send nothing, and once it is computed only its kept blocks travel (its sink
//! blocks, then the next query's window), into destinations the decode worker reserved for
//! exactly those. SnapKV: a prompt's chunks send nothing either; its last positions' queries
//! are gathered over them and, once it is computed, its KV is compacted to the slots SnapKV
//! keeps, which travel as one transfer.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use duet_engine::{
    AttentionPolicy, EngineModel, KvCache, KvCacheConfig, Observation, PrefixHasher,
};
use duet_kv_transfer::Connector;
use duet_worker_common::engine_thread::{EngineLoop, Wait};
use duet_worker_common::kv_events::KvEventHub;
use duet_worker_common::prefix_cache::PrefixCacheBook;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::error::PrefillError;
use crate::handle::{Cmd, Pending, PrefillConfig, PrefillJob, PrefillStatus};
use crate::metrics::PrefillMetrics;
use crate::policy;
use crate::queue::{Queue, Waiting};
use crate::transfer::{self, Msg, Reply};

mod forward;
mod send;

/// How often an idle engine looks for blocks its senders have let go of.
const UNPIN_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// What the engine thread shares with its handle.
pub(crate) struct Shared {
    pub model: Arc<EngineModel>,
    pub kv: KvCacheConfig,
    pub cfg: PrefillConfig,
    pub status: Arc<Mutex<PrefillStatus>>,
    pub pending: Arc<Pending>,
    pub connector: Arc<Connector>,
    pub kv_events: KvEventHub,
}

/// Starts the engine thread over its scratch KV cache; it runs until `cancel` fires or
/// every sender of `tx` is gone. Transfer tasks run on `rt`.
pub(crate) fn spawn(
    shared: Shared,
    rt: tokio::runtime::Handle,
    tx: std_mpsc::Sender<Cmd>,
    rx: std_mpsc::Receiver<Cmd>,
    cancel: CancellationToken,
) -> Result<(), PrefillError> {
    let Shared {
        model,
        kv,
        cfg,
        status,
        pending,
        connector,
        kv_events,
    } = shared;
    let layout = model.kv_layout(kv.block_size, kv.dtype)?;
    let mut cache = crate::send_pool::scratch_pool(connector.send_arena(), layout, kv.num_blocks)?;
    let book = match &cfg.prefix_cache {
        Some(pc) => {
            cache.enable_prefix_cache(pc)?;
            Some(PrefixCacheBook::new(kv_events, "prefill", &cfg.id))
        }
        None => None,
    };
    let metrics = PrefillMetrics::new(&cfg.id);
    let max_queue = cfg.max_queue;
    let name = format!("{}-engine", cfg.id);
    let eng = Engine {
        hasher: cache.prefix_hasher(),
        cache,
        book,
        model,
        cfg,
        status,
        pending,
        connector,
        rt: rt.clone(),
        queue: Queue::new(max_queue),
        running: Vec::new(),
        tokens_per_second: 0.0,
        metrics,
    };
    duet_worker_common::engine_thread::wake_on_cancel(&rt, tx, cancel.clone(), Cmd::Wake);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || duet_worker_common::engine_thread::run(eng, rx, &cancel))
        .map_err(|e| {
            PrefillError::Engine(duet_engine::EngineError::invalid(
                "engine thread",
                e.to_string(),
            ))
        })?;
    Ok(())
}

struct Running {
    job: PrefillJob,
    /// Under SnapKV: the queries of the prompt's last positions, gathered over its chunks.
    observation: Option<Observation>,
    /// Prompt tokens whose KV is in the cache (attached or computed).
    done: usize,
    /// Of those, the tokens attached from the prefix cache.
    cached: usize,
    enqueued: Instant,
    started: Instant,
    tx: mpsc::UnboundedSender<Msg>,
    /// Closed when the caller went away.
    watch: oneshot::Sender<()>,
}

/// What a queued prompt keeps until it starts.
struct Queued {
    job: PrefillJob,
    reply: Reply,
}

struct Engine {
    model: Arc<EngineModel>,
    cache: KvCache,
    /// Prefix-cache bookkeeping (`None`: the cache is off).
    book: Option<PrefixCacheBook>,
    hasher: PrefixHasher,
    cfg: PrefillConfig,
    status: Arc<Mutex<PrefillStatus>>,
    pending: Arc<Pending>,
    connector: Arc<Connector>,
    rt: tokio::runtime::Handle,
    queue: Queue<Queued>,
    running: Vec<Running>,
    tokens_per_second: f64,
    metrics: PrefillMetrics,
}

impl EngineLoop for Engine {
    type Cmd = Cmd;

    /// Busy while anything is queued or running; otherwise asleep until a command, or a
    /// little while when blocks wait for their senders to let go of them (`kv::pins`).
    fn idle_wait(&self) -> Wait {
        match (self.running.is_empty(), self.cache.pinned_blocks() > 0) {
            (false, _) => Wait::Busy,
            // Queued prompts that did not fit wait for pinned blocks without spinning.
            (true, true) => Wait::At(UNPIN_POLL),
            (true, false) if self.queue.is_empty() => Wait::Forever,
            (true, false) => Wait::Busy,
        }
    }

    fn command(&mut self, c: Cmd) {
        self.handle(c);
    }

    fn tick(&mut self) {
        self.cache.reclaim_unpinned();
        self.drop_abandoned();
        self.step();
        self.publish();
    }

    fn stop(&mut self) {
        for q in self.queue.drain() {
            let _ = q.item.reply.send(Err(PrefillError::ShuttingDown));
        }
        for r in std::mem::take(&mut self.running) {
            self.cache.free_sequence(r.job.request_id);
            let _ = r.tx.send(Msg::Fail(PrefillError::ShuttingDown));
        }
        // The pool goes with the thread: nothing is queued or held, and there is no pool
        // (a `duet worker` that moved to decode must not show its last sample forever).
        let m = &self.metrics;
        for g in [&m.queue_depth, &m.queued_tokens, &m.kv_used, &m.kv_capacity] {
            g.set(0.0);
        }
    }
}

impl Engine {
    /// Frees a running request's KV, keeping its complete blocks in the prefix cache.
    fn end(&mut self, r: &Running) {
        if self.book.is_some() {
            let _ = self
                .cache
                .register_blocks(r.job.request_id, &r.job.prompt[..r.done]);
        }
        self.cache.free_sequence(r.job.request_id);
    }

    fn publish(&mut self) {
        let queued_prefill_tokens: u64 = self.queue.tokens()
            + self
                .running
                .iter()
                .map(|r| (r.job.prompt.len() - r.done) as u64)
                .sum::<u64>();
        self.metrics
            .queue_depth
            .set((self.queue.len() + self.running.len()) as f64);
        self.metrics.queued_tokens.set(queued_prefill_tokens as f64);
        self.metrics.kv_used.set(self.cache.used_blocks() as f64);
        self.metrics
            .kv_capacity
            .set(self.cache.total_blocks() as f64);
        self.metrics.tick();
        if let Ok(mut s) = self.status.lock() {
            *s = PrefillStatus {
                queued: self.queue.len() as u32,
                running: self.running.len() as u32,
                queued_prefill_tokens,
                kv_blocks_total: self.cache.total_blocks() as u64,
                kv_blocks_free: self.cache.free_blocks() as u64,
                kv_blocks_cached: self.cache.allocator().cached_blocks() as u64,
                tokens_per_second: self.tokens_per_second,
                kv_groups: duet_worker_common::kv_shape::kv_group_shape(
                    &self.cache.layout().groups,
                    self.cfg.max_batch_tokens,
                ),
            };
        }
        if let Some(b) = &self.book {
            b.flush(&mut self.cache);
        }
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Prefill(job, reply) => {
                let job = *job;
                self.pending.taken(&job);
                let c = self.model.config();
                let limit = job.attention.max_sequence_tokens(c.context_length);
                if let Err(e) = self
                    .model
                    .check_attention(job.attention)
                    .and_then(|_| duet_engine::check_prompt(&job.prompt, c.vocab_size, limit))
                {
                    let _ = reply.send(Err(e.into()));
                } else if let Err(e) = policy::check_job(
                    job.prompt.len(),
                    job.dst_start,
                    job.dst_blocks.len(),
                    self.cache.block_size(),
                    self.cache.total_blocks(),
                    self.job_blocks(job.prompt.len(), job.attention),
                ) {
                    let _ = reply.send(Err(e));
                } else {
                    let waiting = Waiting {
                        id: job.request_id,
                        batch: job.batch,
                        tokens: job.prompt.len(),
                        enqueued: Instant::now(),
                        item: Queued { job, reply },
                    };
                    if let Err((w, queued)) = self.queue.push(waiting) {
                        let _ = w.item.reply.send(Err(PrefillError::QueueFull(queued)));
                    }
                }
            }
            Cmd::Cancel(id) => {
                if let Some(q) = self.queue.remove(id) {
                    let _ = q.item.reply.send(Err(PrefillError::Cancelled(id)));
                }
                if let Some(i) = self.running.iter().position(|r| r.job.request_id == id) {
                    let r = self.running.swap_remove(i);
                    self.end(&r);
                    let _ = r.tx.send(Msg::Fail(PrefillError::Cancelled(id)));
                }
            }
            Cmd::Prefetch(hashes) => {
                if let Some(b) = &self.book {
                    let moved = self.cache.prefetch(&hashes);
                    b.prefetched(moved);
                }
            }
            Cmd::Wake => {}
        }
    }

    fn drop_abandoned(&mut self) {
        self.queue.retain(|q| !q.reply.is_closed());
        let mut i = 0;
        while i < self.running.len() {
            // The caller went away, or the transfer failed (its task ended).
            if self.running[i].watch.is_closed() || self.running[i].tx.is_closed() {
                let r = self.running.swap_remove(i);
                self.end(&r);
                let _ =
                    r.tx.send(Msg::Fail(PrefillError::Cancelled(r.job.request_id)));
            } else {
                i += 1;
            }
        }
    }

    /// The blocks `job` holds here at most and sends: every block of its prompt (every
    /// layer group's, a local group's bounded by its window and a chunk); under a
    /// local window what its window bounds (its chunks drop blocks as they go); under SnapKV
    /// the prompt's and the compacted slots' (held together while it compacts), and the
    /// latter sent.
    fn job_blocks(&self, tokens: usize, attention: AttentionPolicy) -> policy::JobBlocks {
        let bs = self.cache.block_size();
        match attention {
            // Every layer group's peak (a local group holds its window and a chunk); the
            // decode worker lists one block per prompt block.
            AttentionPolicy::Full => policy::JobBlocks {
                peak: self.cache.peak_blocks(tokens, self.cfg.max_batch_tokens),
                sent: policy::JobBlocks::full(tokens, bs).sent,
            },
            AttentionPolicy::Window(w) => policy::JobBlocks {
                peak: w.peak_blocks(tokens, self.cfg.max_batch_tokens, bs),
                sent: w.kept_blocks(tokens, bs).iter().map(|r| r.len()).sum(),
            },
            AttentionPolicy::SnapKv(p) => {
                let kept = self.cache.blocks_for(p.kept(tokens));
                let compacted = if p.compresses(tokens) { kept } else { 0 };
                policy::JobBlocks {
                    peak: self.cache.blocks_for(tokens) + compacted,
                    sent: kept,
                }
            }
        }
    }

    /// Blocks still to be allocated by running requests other than `id`.
    fn pending_blocks_except(&self, id: u64) -> usize {
        self.running
            .iter()
            .filter(|r| r.job.request_id != id)
            .map(|r| {
                let have = self.cache.held_blocks(r.job.request_id).unwrap_or(0);
                self.job_blocks(r.job.prompt.len(), r.job.attention)
                    .peak
                    .saturating_sub(have)
            })
            .sum()
    }

    /// Starts the request at the queue's front after its cached prefix: the tokens attached
    /// from the prefix cache, or `None` when the pool has no room for the rest yet (the
    /// request stays queued and holds nothing).
    fn attach(
        &mut self,
        id: u64,
        prompt: &[u32],
        attention: AttentionPolicy,
    ) -> Result<Option<usize>, PrefillError> {
        self.cache.add_sequence(id)?;
        if attention != AttentionPolicy::Full {
            // A windowed or SnapKV prompt neither reads nor feeds the prefix cache.
            if let Err(e) = self.cache.set_attention(id, attention) {
                self.cache.free_sequence(id);
                return Err(e.into());
            }
            return self.room_for(id, prompt.len(), attention, 0);
        }
        if self.book.is_none() {
            return self.room_for(id, prompt.len(), attention, 0);
        }
        let bs = self.cache.block_size();
        let limit = duet_engine::reusable_tokens(prompt.len(), bs);
        let hashes = self.hasher.hashes(&prompt[..limit]);
        let hit = match self.cache.attach_prefix(id, &hashes, limit) {
            Ok(h) => h,
            Err(e) => {
                self.cache.free_sequence(id);
                return Err(e.into());
            }
        };
        let room = self.room_for(id, prompt.len(), attention, hit.blocks() * bs)?;
        if let (Some(book), Some(_)) = (&self.book, room) {
            book.lookup(prompt.len(), hit, bs);
        }
        Ok(room)
    }

    /// Whether the rest of `prompt` after `cached` tokens fits next to the running requests
    /// (otherwise the sequence is freed again: its attached blocks go back to the cache).
    fn room_for(
        &mut self,
        id: u64,
        tokens: usize,
        attention: AttentionPolicy,
        cached: usize,
    ) -> Result<Option<usize>, PrefillError> {
        let need = self
            .job_blocks(tokens, attention)
            .peak
            .saturating_sub(cached / self.cache.block_size());
        if !policy::has_room(
            need,
            self.pending_blocks_except(id),
            self.cache.free_blocks(),
        ) {
            self.cache.free_sequence(id);
            return Ok(None);
        }
        Ok(Some(cached))
    }

    fn start_queued(&mut self) {
        while let Some(q) = self.queue.front() {
            let (id, prompt, attention) = (q.id, q.item.job.prompt.clone(), q.item.job.attention);
            let cached = match self.attach(id, &prompt, attention) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    if let Some(q) = self.queue.pop_front() {
                        let _ = q.item.reply.send(Err(e));
                    }
                    continue;
                }
            };
            let Some(q) = self.queue.pop_front() else {
                self.cache.free_sequence(id);
                break;
            };
            // The transfer task owns the reply; the engine watches the caller through a
            // second channel that closes with the reply's receiver.
            let (watch, watch_rx) = oneshot::channel::<()>();
            let Waiting {
                enqueued,
                item: Queued { job, reply },
                ..
            } = q;
            let reply = forward_reply(&self.rt, reply, watch_rx);
            // The transfer is a child span of the request's: router -> prefill -> transfer.
            let span = tracing::info_span!(
                parent: &job.span,
                "kv_transfer",
                request_id = job.request_id,
                endpoint = %job.route.endpoint.address,
                transport = job.route.endpoint.kind.as_str(),
                kv_bytes = tracing::field::Empty,
            );
            let tx = transfer::spawn(
                &self.rt,
                self.connector.clone(),
                job.route.clone(),
                reply,
                span,
            );
            let observation = job.attention.snapkv().map(|p| {
                Observation::new(
                    id,
                    job.prompt.len(),
                    p.observe,
                    self.cache.layout().n_layers,
                )
            });
            let r = Running {
                job,
                observation,
                done: cached,
                cached,
                enqueued,
                started: Instant::now(),
                tx,
                watch,
            };
            // Cached blocks the decode worker does not hold travel before any compute.
            if cached > r.job.dst_start {
                self.send_cached(&r, r.job.dst_start, cached);
            }
            self.running.push(r);
        }
    }
}

/// Wraps `reply` so that `watch` closes when the caller drops its receiver.
fn forward_reply(rt: &tokio::runtime::Handle, reply: Reply, watch: oneshot::Receiver<()>) -> Reply {
    let (tx, rx) = oneshot::channel();
    rt.spawn(async move {
        let mut reply = reply;
        tokio::select! {
            r = rx => { let _ = reply.send(r.unwrap_or(Err(PrefillError::ShuttingDown))); }
            _ = reply.closed() => {}
        }
        drop(watch);
    });
    tx
}
