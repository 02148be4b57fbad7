//! The prefill engine thread: batching, chunking, and layer-by-layer KV hand-off.
//!
//! Each iteration fills one forward with up to `max_batch_tokens` prompt tokens: chunks of
//! requests already started first (oldest first), then new requests from the queue while
//! the budget and the scratch KV pool allow. A chunk that is not a request's last is a
//! multiple of the block size, so every chunk is a transfer of whole destination blocks
//! (`token_start` block aligned). After layer `l` of the forward, the hook copies each
//! chunk's layer-`l` regions out of the scratch cache into one buffer (in the connector's
//! send arena when the transfer goes over shm, see `layer_buffer`) and hands them to the
//! request's transfer task.
//!
//! Prefix cache: a request starts after the longest prefix its prompt finds in the cache
//! (only the rest is computed); KV the decode worker already holds (`dst_start`) is not
//! sent; cached blocks the decode worker lacks are sent from the cache before the first
//! forward. A finished prompt's blocks are registered and stay cached for the next request.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use duet_engine::{
    BlockHash, KvCache, KvCacheConfig, KvKind, Model, PrefixCacheConfig, PrefixHasher, Sampler,
    SamplingParams, SeqChunk,
};
use duet_kv_transfer::backend::shm::SendArena;
use duet_kv_transfer::{Connector, Route, TransferDesc};
use duet_serving::engine_thread::{EngineLoop, Wait};
use duet_serving::kv_events::KvEventHub;
use duet_serving::prefix_cache::PrefixCacheBook;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::error::PrefillError;
use crate::layer_buffer::layer_bytes;
use crate::metrics::PrefillMetrics;
use crate::policy;
use crate::transfer::{self, Msg, Reply};

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
}

/// Prefills sent to the engine thread that it has not taken from its channel yet (they
/// arrived during a forward). The status counts them, so a worker busy with a long forward
/// never reads idle while work waits for it.
#[derive(Debug, Default)]
struct Pending {
    requests: AtomicU64,
    tokens: AtomicU64,
}

impl Pending {
    fn sent(&self, job: &PrefillJob) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.tokens
            .fetch_add(job.prompt.len() as u64, Ordering::SeqCst);
    }

    fn taken(&self, job: &PrefillJob) {
        self.requests.fetch_sub(1, Ordering::SeqCst);
        self.tokens
            .fetch_sub(job.prompt.len() as u64, Ordering::SeqCst);
    }
}

enum Cmd {
    Prefill(PrefillJob, Reply),
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
}

impl PrefillHandle {
    /// Starts the engine thread; transfer tasks run on `rt`.
    pub fn start(
        model: Arc<Model>,
        kv: KvCacheConfig,
        cfg: PrefillConfig,
        connector: Arc<Connector>,
        rt: tokio::runtime::Handle,
        cancel: CancellationToken,
    ) -> Result<PrefillHandle, PrefillError> {
        let (tx, rx) = std_mpsc::channel();
        let status = Arc::new(Mutex::new(PrefillStatus::default()));
        let pending = Arc::new(Pending::default());
        let layout = model.kv_layout(kv.block_size, kv.dtype);
        let mut cache = KvCache::new(layout, kv.num_blocks);
        let kv_events = KvEventHub::new(cfg.id.clone(), kv.block_size);
        let book = match &cfg.prefix_cache {
            Some(pc) => {
                cache.enable_prefix_cache(pc)?;
                Some(PrefixCacheBook::new(kv_events.clone(), "prefill", &cfg.id))
            }
            None => None,
        };
        let eng = Engine {
            hasher: cache.prefix_hasher(),
            cache,
            book,
            model,
            cfg: cfg.clone(),
            status: status.clone(),
            pending: pending.clone(),
            connector: connector.clone(),
            rt: rt.clone(),
            queue: VecDeque::new(),
            running: Vec::new(),
            tokens_per_second: 0.0,
            metrics: PrefillMetrics::new(&cfg.id),
        };
        duet_serving::engine_thread::wake_on_cancel(&rt, tx.clone(), cancel.clone(), Cmd::Wake);
        std::thread::Builder::new()
            .name(format!("{}-engine", cfg.id))
            .spawn(move || duet_serving::engine_thread::run(eng, rx, &cancel))
            .map_err(|e| {
                PrefillError::Engine(duet_engine::EngineError::invalid(
                    "engine thread",
                    e.to_string(),
                ))
            })?;
        Ok(PrefillHandle {
            tx,
            status,
            pending,
            connector,
            kv_events,
        })
    }

    /// Queues a prefill; resolves when the decode worker holds the KV.
    pub async fn prefill(&self, job: PrefillJob) -> Result<PrefillResult, PrefillError> {
        let (reply, rx) = oneshot::channel();
        self.pending.sent(&job);
        if let Err(std_mpsc::SendError(Cmd::Prefill(job, _))) =
            self.tx.send(Cmd::Prefill(job, reply))
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

    /// The connector (endpoint choice).
    pub fn connector(&self) -> &Connector {
        &self.connector
    }
}

struct Running {
    job: PrefillJob,
    /// Prompt tokens whose KV is in the cache (attached or computed).
    done: usize,
    /// Of those, the tokens attached from the prefix cache.
    cached: usize,
    enqueued: Instant,
    started: Instant,
    tx: mpsc::UnboundedSender<Msg>,
    /// Closed when the caller went away.
    watch: oneshot::Sender<()>,
    /// Where this request's layer buffers go first: the send arena for an shm transfer.
    arena: Option<Arc<SendArena>>,
}

struct Queued {
    job: PrefillJob,
    reply: Reply,
    enqueued: Instant,
}

struct Engine {
    model: Arc<Model>,
    cache: KvCache,
    /// Prefix-cache bookkeeping (`None`: the cache is off).
    book: Option<PrefixCacheBook>,
    hasher: PrefixHasher,
    cfg: PrefillConfig,
    status: Arc<Mutex<PrefillStatus>>,
    pending: Arc<Pending>,
    connector: Arc<Connector>,
    rt: tokio::runtime::Handle,
    queue: VecDeque<Queued>,
    running: Vec<Running>,
    tokens_per_second: f64,
    metrics: PrefillMetrics,
}

impl EngineLoop for Engine {
    type Cmd = Cmd;

    /// Busy while anything is queued or running; otherwise asleep until a command (nothing
    /// here expires on its own).
    fn idle_wait(&self) -> Wait {
        if self.queue.is_empty() && self.running.is_empty() {
            Wait::Forever
        } else {
            Wait::Busy
        }
    }

    fn command(&mut self, c: Cmd) {
        self.handle(c);
    }

    fn tick(&mut self) {
        self.drop_abandoned();
        self.step();
        self.publish();
    }

    fn stop(&mut self) {
        for q in self.queue.drain(..) {
            let _ = q.reply.send(Err(PrefillError::ShuttingDown));
        }
        for r in std::mem::take(&mut self.running) {
            self.cache.free_sequence(r.job.request_id);
            let _ = r.tx.send(Msg::Fail(PrefillError::ShuttingDown));
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
        let queued_prefill_tokens: u64 = self
            .queue
            .iter()
            .map(|q| q.job.prompt.len() as u64)
            .chain(
                self.running
                    .iter()
                    .map(|r| (r.job.prompt.len() - r.done) as u64),
            )
            .sum();
        self.metrics
            .queue_depth
            .set((self.queue.len() + self.running.len()) as f64);
        self.metrics.queued_tokens.set(queued_prefill_tokens as f64);
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
            };
        }
        if let Some(b) = &self.book {
            b.flush(&mut self.cache);
        }
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Prefill(job, reply) => {
                let blocks = self.cache.blocks_for(job.prompt.len());
                let bs = self.cache.block_size();
                self.pending.taken(&job);
                let c = &self.model.config;
                if let Err(e) =
                    duet_engine::check_prompt(&job.prompt, c.vocab_size, c.context_length)
                {
                    let _ = reply.send(Err(e.into()));
                } else if blocks > self.cache.total_blocks() {
                    let _ = reply.send(Err(PrefillError::TooLong {
                        tokens: job.prompt.len(),
                        blocks,
                        total: self.cache.total_blocks(),
                    }));
                } else if job.dst_start % bs != 0 || job.dst_start >= job.prompt.len() {
                    let _ = reply.send(Err(PrefillError::Engine(
                        duet_engine::EngineError::invalid(
                            "dst_start_tokens",
                            format!(
                                "{} (must be a multiple of {bs} below the prompt's {} tokens)",
                                job.dst_start,
                                job.prompt.len()
                            ),
                        ),
                    )));
                } else if job.dst_blocks.len() != blocks - job.dst_start / bs {
                    let _ = reply.send(Err(PrefillError::Engine(
                        duet_engine::EngineError::invalid(
                            "dst_blocks",
                            format!(
                                "{} destination blocks for {} tokens after {} held (need {})",
                                job.dst_blocks.len(),
                                job.prompt.len(),
                                job.dst_start,
                                blocks - job.dst_start / bs
                            ),
                        ),
                    )));
                } else if self.queue.len() >= self.cfg.max_queue {
                    let _ = reply.send(Err(PrefillError::QueueFull(self.queue.len())));
                } else {
                    let at =
                        policy::queue_position(self.queue.iter().map(|q| q.job.batch), job.batch);
                    self.queue.insert(
                        at,
                        Queued {
                            job,
                            reply,
                            enqueued: Instant::now(),
                        },
                    );
                }
            }
            Cmd::Cancel(id) => {
                if let Some(i) = self.queue.iter().position(|q| q.job.request_id == id) {
                    if let Some(q) = self.queue.remove(i) {
                        let _ = q.reply.send(Err(PrefillError::Cancelled(id)));
                    }
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

    /// Blocks still to be allocated by running requests other than `id`.
    fn pending_blocks_except(&self, id: u64) -> usize {
        self.running
            .iter()
            .filter(|r| r.job.request_id != id)
            .map(|r| {
                let have = self
                    .cache
                    .sequence_blocks(r.job.request_id)
                    .map_or(0, |b| b.len());
                self.cache
                    .blocks_for(r.job.prompt.len())
                    .saturating_sub(have)
            })
            .sum()
    }

    /// Starts the request at the queue's front after its cached prefix: the tokens attached
    /// from the prefix cache, or `None` when the pool has no room for the rest yet (the
    /// request stays queued and holds nothing).
    fn attach(&mut self, id: u64, prompt: &[u32]) -> Result<Option<usize>, PrefillError> {
        self.cache.add_sequence(id)?;
        if self.book.is_none() {
            return self.room_for(id, prompt, 0);
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
        let room = self.room_for(id, prompt, hit.blocks() * bs)?;
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
        prompt: &[u32],
        cached: usize,
    ) -> Result<Option<usize>, PrefillError> {
        let need = self.cache.blocks_for(prompt.len()) - cached / self.cache.block_size();
        if need + self.pending_blocks_except(id) > self.cache.free_blocks() {
            self.cache.free_sequence(id);
            return Ok(None);
        }
        Ok(Some(cached))
    }

    /// Sends the KV of tokens `from..to` (whole blocks, already in the cache) to `r`'s
    /// decode worker as one transfer of every layer.
    fn send_cached(&self, r: &Running, from: usize, to: usize) {
        let bs = self.cache.block_size();
        let Ok(blocks) = self.cache.sequence_blocks(r.job.request_id) else {
            return;
        };
        let (first, last) = (from / bs, to / bs);
        let dst0 = r.job.dst_start / bs;
        let desc = TransferDesc {
            request_id: r.job.request_id,
            token_start: from as u32,
            token_count: (to - from) as u32,
            dst_blocks: r.job.dst_blocks[first - dst0..last - dst0].to_vec(),
        };
        let _ = r.tx.send(Msg::Begin(desc));
        for layer in 0..self.cache.layout().n_layers {
            let regions = |kind| -> Vec<&[u8]> {
                blocks[first..last]
                    .iter()
                    .map(|&b| self.cache.region_bytes(b, layer, kind))
                    .collect()
            };
            let (k, v) = layer_bytes(r.arena.as_ref(), &regions(KvKind::K), &regions(KvKind::V));
            let _ = r.tx.send(Msg::Layer {
                layer: layer as u32,
                k,
                v,
            });
        }
        let _ = r.tx.send(Msg::Finish);
    }

    fn start_queued(&mut self) {
        while let Some(q) = self.queue.front() {
            let (id, prompt) = (q.job.request_id, q.job.prompt.clone());
            let cached = match self.attach(id, &prompt) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    if let Some(q) = self.queue.pop_front() {
                        let _ = q.reply.send(Err(e));
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
            let Queued {
                job,
                reply,
                enqueued,
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
            let arena = self.connector.send_arena_for(&job.route.endpoint).cloned();
            let r = Running {
                job,
                done: cached,
                cached,
                enqueued,
                started: Instant::now(),
                tx,
                watch,
                arena,
            };
            // Cached blocks the decode worker does not hold travel before any compute.
            if cached > r.job.dst_start {
                self.send_cached(&r, r.job.dst_start, cached);
            }
            self.running.push(r);
        }
    }

    /// After a forward over `plan` failed with `e`: ends the requests whose chunk is
    /// `blamed` with their own error, and leaves the others running (their KV is untouched:
    /// the forward refused before computing). With none to blame (this worker's fault, not
    /// a request's), every request of the forward ends as unavailable here, and is retried
    /// elsewhere.
    fn fail_step(
        &mut self,
        plan: &[(usize, usize, usize)],
        blamed: Vec<(usize, duet_engine::EngineError)>,
        e: &duet_engine::EngineError,
    ) {
        let mut ended: Vec<(usize, PrefillError)> = if blamed.is_empty() {
            plan.iter()
                .map(|p| (p.0, PrefillError::StepFailed(e.to_string())))
                .collect()
        } else {
            blamed.into_iter().map(|(i, b)| (i, b.into())).collect()
        };
        tracing::warn!(error = %e, ended = ended.len(), forward = plan.len(), "prefill forward failed");
        ended.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, err) in ended {
            let r = self.running.swap_remove(i);
            self.end(&r);
            let _ = r.tx.send(Msg::Fail(err));
        }
    }

    fn step(&mut self) {
        self.start_queued();
        if self.running.is_empty() {
            return;
        }
        // Live status while the forward runs: what it computes shows as running.
        self.publish();
        let bs = self.cache.block_size();
        let left: Vec<usize> = self
            .running
            .iter()
            .map(|r| r.job.prompt.len() - r.done)
            .collect();
        // (running index, start, len)
        let plan: Vec<(usize, usize, usize)> =
            policy::plan_chunks(&left, self.cfg.max_batch_tokens, bs)
                .into_iter()
                .map(|(i, n)| (i, self.running[i].done, n))
                .collect();
        // Each chunk sends the part of its KV the decode worker does not hold yet (from
        // `dst_start` on), as whole destination blocks: `(plan index, first token)`.
        let mut sends = Vec::new();
        for (k, &(i, start, n)) in plan.iter().enumerate() {
            let r = &self.running[i];
            let from = start.max(r.job.dst_start);
            if from >= start + n {
                continue;
            }
            let dst0 = r.job.dst_start / bs;
            let desc = TransferDesc {
                request_id: r.job.request_id,
                token_start: from as u32,
                token_count: (start + n - from) as u32,
                dst_blocks: r.job.dst_blocks[from / bs - dst0..(start + n).div_ceil(bs) - dst0]
                    .to_vec(),
            };
            let _ = r.tx.send(Msg::Begin(desc));
            sends.push((k, from));
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, start, n)| {
                let r = &self.running[i];
                SeqChunk::prompt(
                    r.job.request_id,
                    &r.job.prompt[start..start + n],
                    start + n == r.job.prompt.len(),
                    r.job.prompt.len(),
                )
            })
            .collect();
        // What the per-layer hook needs: for each chunk, its sender, block index range and
        // send arena.
        type Out = (
            mpsc::UnboundedSender<Msg>,
            u64,
            usize,
            usize,
            Option<Arc<SendArena>>,
        );
        let outs: Vec<Out> = sends
            .iter()
            .map(|&(k, from)| {
                let (i, start, n) = plan[k];
                let r = &self.running[i];
                (
                    r.tx.clone(),
                    r.job.request_id,
                    from / bs,
                    (start + n).div_ceil(bs),
                    r.arena.clone(),
                )
            })
            .collect();
        let t0 = Instant::now();
        let mut hook = |layer: usize, cache: &KvCache| {
            for (tx, seq, first, last, arena) in &outs {
                let Ok(blocks) = cache.sequence_blocks(*seq) else {
                    continue;
                };
                let Some(blocks) = blocks.get(*first..*last) else {
                    continue;
                };
                let regions = |kind| -> Vec<&[u8]> {
                    blocks
                        .iter()
                        .map(|&b| cache.region_bytes(b, layer, kind))
                        .collect()
                };
                let (k, v) = layer_bytes(arena.as_ref(), &regions(KvKind::K), &regions(KvKind::V));
                let _ = tx.send(Msg::Layer {
                    layer: layer as u32,
                    k,
                    v,
                });
            }
        };
        let result = self.model.forward_with(&mut self.cache, &chunks, &mut hook);
        // On failure, the chunks to blame (the forward checks them all before it changes
        // anything): their requests end, the others go on.
        let blamed: Vec<(usize, duet_engine::EngineError)> = match &result {
            Ok(_) => Vec::new(),
            Err(_) => plan
                .iter()
                .zip(&chunks)
                .filter_map(|(p, ch)| {
                    self.model
                        .check_chunk(&self.cache, ch)
                        .err()
                        .map(|e| (p.0, e))
                })
                .collect(),
        };
        drop(chunks);
        let elapsed = t0.elapsed();
        let dt = elapsed.as_secs_f64();
        let tokens: usize = plan.iter().map(|p| p.2).sum();
        if dt > 0.0 {
            self.tokens_per_second = 0.8 * self.tokens_per_second + 0.2 * tokens as f64 / dt;
        }
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                self.fail_step(&plan, blamed, &e);
                return;
            }
        };
        self.metrics.forward(tokens, elapsed);
        let compute_done = Instant::now();
        let mut finished = Vec::new();
        for (k, &(i, start, n)) in plan.iter().enumerate() {
            let r = &mut self.running[i];
            if sends.iter().any(|&(s, _)| s == k) {
                let _ = r.tx.send(Msg::Finish);
            }
            r.done = start + n;
            if r.done < r.job.prompt.len() {
                continue;
            }
            let first_token = Sampler::new(r.job.sampling.clone())
                .map(|mut s| s.sample(&mut logits[k], &r.job.prompt));
            finished.push((i, first_token));
        }
        finished.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, first) in finished {
            let r = self.running.swap_remove(i);
            self.end(&r);
            let msg = match first {
                Ok(first_token) => Msg::Complete(
                    PrefillResult {
                        first_token,
                        queue_seconds: r.started.duration_since(r.enqueued).as_secs_f64(),
                        prefill_seconds: r.started.elapsed().as_secs_f64(),
                        kv_transfer_seconds: 0.0,
                        kv_stream_seconds: 0.0,
                        kv_bytes: 0,
                        cached_tokens: r.cached,
                    },
                    compute_done,
                ),
                Err(e) => Msg::Fail(e.into()),
            };
            let _ = r.tx.send(msg);
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
