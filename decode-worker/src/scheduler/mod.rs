//! The engine thread: continuous batching over one paged KV cache.
//!
//! The decisions (waiting order, admission, the next forward's rows, the preemption victim)
//! are model-free functions in [`crate::policy`], and the reservation table and the waiting
//! queue are model-free state (`crate::reservations`, `crate::waiting`); this module applies
//! them to the engine (`seq.rs`: a sequence and its phase; `forward.rs`: admission and the
//! forward pass).
//!
//! Each iteration: take commands (sleeping only when nothing can run), expire
//! reservations, start sequences whose remote KV is complete, drop sequences whose client
//! is gone, admit waiting local prefills while blocks allow, then run one forward over
//! every running sequence's next token plus up to `prefill_chunk_tokens` prompt tokens of
//! sequences being prefilled here.
//!
//! Prefix cache: a reservation or a local prefill starts from the leading blocks the cache
//! holds (only the rest is transferred or computed); a sequence's full prompt blocks are
//! registered once their KV is complete and stay cached after it ends, for the next turn of
//! the conversation (generated tokens are not: see `Seq::cacheable`); the cache's changes
//! are published to routers after every iteration.
//!
//! Local windows (StreamingLLM): a windowed sequence gets its policy when its cache
//! sequence is made (admitted, or reserved for a remote prompt's kept blocks), is admitted
//! for the blocks its window bounds rather than its length, may run past the model's
//! context, and never reads or feeds the prefix cache; a preempted one is recomputed under
//! the same window. SnapKV (`duet_engine::kv::snapkv`): a prompt computed here gathers the
//! queries of its last positions over the forwards and is compressed as soon as it is
//! computed (the forward that completes it reserves the compacted blocks too); a remote
//! prompt arrives compressed into the slots reserved for it; a preempted sequence is
//! recomputed and compressed the same way.
//!
//! Invariants:
//! - a cache sequence exists iff its request is in `reservations` or `active`
//!   (`waiting` sequences hold no KV);
//! - KV receivers may write only the reservation's fresh blocks, never its cached prefix;
//! - before a forward, the blocks it needs are free: otherwise the lowest-priority, newest
//!   sequence is preempted (freed; recomputed from its tokens when it is admitted again),
//!   so one long request never stalls or fails the others;
//! - every request ends with exactly one `Done` or `Error` event, unless its receiver is
//!   already gone.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::{
    AttentionPolicy, BlockHash, EngineError, EngineModel, FinishReason, KvCache, KvCacheConfig,
    PrefixHasher, TokenStep,
};
use duet_worker_common::engine_thread::{EngineLoop, Wait};
use duet_worker_common::kv_events::KvEventHub;
use duet_worker_common::prefix_cache::PrefixCacheBook;
use tokio::sync::mpsc;

use crate::config::DecodeConfig;
use crate::error::DecodeError;
use crate::handle::{secs, Cmd, DecodeStatus, Done, Event, GenerateJob, PrefillSource, Reserved};
use crate::leases::Leases;
use crate::metrics::DecodeMetrics;
use crate::reservations::{Claim, ClaimCheck, Ending, Reservations};
use crate::waiting::WaitingQueue;

mod forward;
mod seq;

use seq::{Phase, Seq};

/// How long the engine thread sleeps, with no command, while it holds reservations or
/// waiting sequences: their expiry and their clients going away announce themselves by no
/// command. With nothing held it sleeps until a command arrives.
const IDLE_POLL: Duration = Duration::from_millis(20);

impl EngineLoop for Scheduler {
    type Cmd = Cmd;

    fn idle_wait(&self) -> Wait {
        if !self.active.is_empty() || self.can_admit() {
            Wait::Busy
        } else if self.waiting.is_empty()
            && self.reservations.is_empty()
            && self.reservations.parked() == 0
        {
            Wait::Forever
        } else {
            Wait::At(IDLE_POLL)
        }
    }

    fn command(&mut self, c: Cmd) {
        self.handle(c);
    }

    fn tick(&mut self) {
        self.expire(Instant::now());
        self.start_ready_transfers();
        self.drop_abandoned();
        self.admit();
        if !self.active.is_empty() {
            self.step();
        }
        self.publish();
    }

    fn stop(&mut self) {
        self.shutdown();
    }
}

pub(crate) struct Scheduler {
    model: Arc<EngineModel>,
    cache: KvCache,
    cfg: DecodeConfig,
    status: Arc<Mutex<DecodeStatus>>,
    reservations: Reservations<Seq>,
    active: Vec<Seq>,
    waiting: WaitingQueue<Seq>,
    tokens_per_second: f64,
    metrics: DecodeMetrics,
    /// Prefix-cache bookkeeping (`None`: the cache is off).
    book: Option<PrefixCacheBook>,
    hasher: PrefixHasher,
}

impl Scheduler {
    pub(crate) fn new(
        model: Arc<EngineModel>,
        kv: KvCacheConfig,
        cfg: DecodeConfig,
        status: Arc<Mutex<DecodeStatus>>,
        leases: Leases,
        hub: KvEventHub,
    ) -> Result<Scheduler, DecodeError> {
        let layout = model.kv_layout(kv.block_size, kv.dtype)?;
        let mut cache = KvCache::new(layout, kv.num_blocks);
        let book = match &cfg.prefix_cache {
            Some(pc) => {
                cache.enable_prefix_cache(pc)?;
                Some(PrefixCacheBook::new(hub, "decode", &cfg.id))
            }
            None => None,
        };
        let hasher = cache.prefix_hasher();
        let cfg_id = cfg.id.clone();
        let max_ttl = cfg.max_reservation_ttl;
        let max_waiting = cfg.max_waiting;
        let s = Scheduler {
            model,
            cache,
            cfg,
            status,
            reservations: Reservations::new(leases, max_ttl),
            active: Vec::new(),
            waiting: WaitingQueue::new(max_waiting),
            tokens_per_second: 0.0,
            metrics: DecodeMetrics::new(&cfg_id),
            book,
            hasher,
        };
        let mut s = s;
        s.publish();
        Ok(s)
    }

    fn shutdown(&mut self) {
        for s in self.active.drain(..).chain(self.waiting.drain()) {
            let _ = s.events.send(Event::Error(DecodeError::ShuttingDown));
            self.cache.free_sequence(s.id);
        }
        for (_, seq) in self.reservations.drain(&mut self.cache) {
            let _ = seq.events.send(Event::Error(DecodeError::ShuttingDown));
        }
        self.publish();
        // The pool goes with the thread: nothing runs, waits or is held, and there is no
        // pool (a `duet worker` that moved to prefill must not show its last sample).
        let m = &self.metrics;
        for g in [&m.running, &m.waiting, &m.kv_used, &m.kv_capacity] {
            g.set(0.0);
        }
    }

    fn publish(&mut self) {
        if let Some(b) = &self.book {
            b.flush(&mut self.cache);
        }
        if let Ok(mut st) = self.status.lock() {
            *st = DecodeStatus {
                kv_blocks_total: self.cache.total_blocks() as u64,
                kv_blocks_free: self.cache.free_blocks() as u64,
                kv_blocks_cached: self.cache.allocator().cached_blocks() as u64,
                block_size: self.cache.block_size() as u32,
                running: self.active.len() as u32,
                waiting: self.waiting.len() as u32,
                reservations: self.reservations.len() as u32,
                max_batch: self.cfg.max_batch as u32,
                tokens_per_second: self.tokens_per_second,
                kv_groups: duet_worker_common::kv_shape::kv_group_shape(
                    &self.cache.layout().groups,
                    self.cfg.prefill_chunk_tokens,
                ),
            };
        }
        let m = &self.metrics;
        m.running.set(self.active.len() as f64);
        m.waiting.set(self.waiting.len() as f64);
        m.kv_used.set(self.cache.used_blocks() as f64);
        m.kv_capacity.set(self.cache.total_blocks() as f64);
    }

    fn known(&self, id: u64) -> bool {
        self.reservations.contains(id)
            || self.active.iter().any(|s| s.id == id)
            || self.waiting.contains(id)
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Reserve {
                request_id,
                prompt_tokens,
                ttl,
                block_hashes,
                attention,
                reply,
            } => {
                let r = self.reserve(request_id, prompt_tokens, ttl, &block_hashes, attention);
                // Status is current before the caller hears back.
                self.publish();
                let _ = reply.send(r);
            }
            Cmd::Generate { job, events } => self.generate(job, events),
            Cmd::Release { request_id, reply } => {
                let found = self.release(request_id);
                self.publish();
                if let Some(r) = reply {
                    let _ = r.send(found);
                }
            }
            Cmd::LayerArrived { request_id, lease } => {
                self.reservations.touch(request_id, lease, Instant::now())
            }
            Cmd::TransferDone {
                request_id,
                token_end,
                lease,
            } => self
                .reservations
                .received(request_id, token_end, lease, Instant::now()),
            Cmd::TransferFailed {
                request_id,
                reason,
                lease,
            } => self.reservations.failed(request_id, reason, lease),
            Cmd::Prefetch { block_hashes } => {
                if let Some(b) = &self.book {
                    let moved = self.cache.prefetch(&block_hashes);
                    b.prefetched(moved);
                }
            }
            Cmd::Wake => {}
        }
    }

    /// Reserves room for a prompt of `tokens` tokens whose KV arrives from a prefill worker,
    /// after the cached prefix of `hashes`; returns the tokens already held and the fresh
    /// blocks for the rest.
    fn reserve(
        &mut self,
        id: u64,
        tokens: usize,
        ttl: Duration,
        hashes: &[BlockHash],
        attention: AttentionPolicy,
    ) -> Result<Reserved, DecodeError> {
        if self.known(id) {
            return Err(DecodeError::Duplicate(id));
        }
        let limit = attention.max_sequence_tokens(self.model.config().context_length);
        if tokens == 0 || tokens >= limit {
            return Err(EngineError::invalid(
                "prompt_tokens",
                format!("{tokens} (must be in 1..{limit})"),
            )
            .into());
        }
        let cached = self.book.as_ref().map(|_| hashes);
        let (reserved, hit) = self.reservations.reserve(
            &mut self.cache,
            id,
            tokens,
            ttl,
            cached,
            attention,
            Instant::now(),
        )?;
        if let Some(book) = self
            .book
            .as_ref()
            .filter(|_| !hashes.is_empty() && attention == AttentionPolicy::Full)
        {
            book.lookup(tokens, hit, self.cache.block_size());
        }
        Ok(reserved)
    }

    fn generate(&mut self, job: GenerateJob, events: mpsc::UnboundedSender<Event>) {
        let id = job.request_id;
        let source = job.prefill;
        let limit = job
            .attention
            .max_sequence_tokens(self.model.config().context_length);
        if job.prompt.is_empty() || job.prompt.len() >= limit {
            let e = EngineError::invalid(
                "prompt",
                format!("{} tokens (must be in 1..{limit})", job.prompt.len()),
            );
            let _ = events.send(Event::Error(e.into()));
            return;
        }
        match source {
            PrefillSource::Remote { first_token } => {
                let check = self.reservations.check_claim(id, job.prompt.len(), |h| {
                    self.prefix_matches(&job.prompt, h)
                });
                match check {
                    ClaimCheck::Missing => {
                        let _ = events.send(Event::Error(DecodeError::NoReservation(id)));
                    }
                    ClaimCheck::Conflict => {
                        let _ = events.send(Event::Error(DecodeError::Duplicate(id)));
                    }
                    ClaimCheck::ForeignPrefix => {
                        // The reservation attached another prompt's cached blocks: its KV
                        // must not be continued. It ends here (blocks freed).
                        self.reservations.drop(&mut self.cache, id);
                        let _ = events.send(Event::Error(DecodeError::PrefixMismatch(id)));
                    }
                    ClaimCheck::Free => match self.new_seq(job, events) {
                        Ok(seq) => {
                            let claim = Claim {
                                seq,
                                first_token,
                                at: Instant::now(),
                            };
                            if let Err(seq) = self.reservations.claim(id, claim) {
                                let _ = seq.events.send(Event::Error(DecodeError::Duplicate(id)));
                            }
                        }
                        Err((e, events)) => {
                            let _ = events.send(Event::Error(e));
                            self.reservations.drop(&mut self.cache, id);
                        }
                    },
                }
            }
            PrefillSource::Local { .. } => {
                if self.known(id) {
                    let _ = events.send(Event::Error(DecodeError::Duplicate(id)));
                    return;
                }
                if self.waiting.is_full() {
                    let _ = events.send(Event::Error(DecodeError::QueueFull(self.waiting.len())));
                    return;
                }
                match self.new_seq(job, events) {
                    Ok(seq) => self.enqueue(seq, false),
                    Err((e, events)) => {
                        let _ = events.send(Event::Error(e));
                    }
                }
            }
        }
    }

    /// Whether `prompt` starts with the blocks whose hashes a reservation attached (the
    /// router hashed the same prompt; a mismatch would continue another prompt's KV).
    fn prefix_matches(&self, prompt: &[u32], hashes: &[BlockHash]) -> bool {
        let bs = self.cache.block_size();
        let n = hashes.len() * bs;
        n <= prompt.len() && self.hasher.hashes(&prompt[..n]) == hashes
    }

    /// Registers the blocks of a sequence whose KV is complete (the prefix cache keeps them
    /// after the sequence ends).
    fn register(&mut self, id: u64, tokens: &[u32]) {
        if self.book.is_some() {
            if let Err(e) = self.cache.register_blocks(id, tokens) {
                tracing::debug!(request_id = id, error = %e, "registering blocks");
            }
        }
    }

    /// Frees a running sequence's KV, keeping its complete prompt blocks in the prefix cache.
    fn end_sequence(&mut self, s: &Seq) {
        self.register(s.id, &s.prompt[..s.cacheable]);
        self.cache.free_sequence(s.id);
    }

    /// Into the waiting queue at [`crate::policy::waiting_position`] (`front`: preempted).
    fn enqueue(&mut self, seq: Seq, front: bool) {
        self.waiting.push(seq, front);
    }

    fn release(&mut self, id: u64) -> bool {
        if self.reservations.drop(&mut self.cache, id).is_some() {
            return true;
        }
        if let Some(i) = self.active.iter().position(|s| s.id == id) {
            let s = self.active.swap_remove(i);
            self.end_sequence(&s);
            return true;
        }
        if self.waiting.remove(id).is_some() {
            return true;
        }
        false
    }

    /// Ends the reservations that expired, failed or waited too long for their KV; their
    /// claimants hear why.
    fn expire(&mut self, now: Instant) {
        self.reservations.reclaim(&mut self.cache);
        let ended =
            self.reservations
                .expire(&mut self.cache, now, self.cfg.kv_wait_timeout, |s: &Seq| {
                    s.events.is_closed()
                });
        for (id, seq, ending) in ended {
            tracing::debug!(request_id = id, ending = ?ending, "reservation ended");
            if ending == Ending::Expired {
                self.metrics.reservations_expired.increment(1);
            }
            if let (Some(seq), Some(e)) = (seq, ending.error(id)) {
                let _ = seq.events.send(Event::Error(e));
            }
        }
    }

    /// Starts the sequences whose remote KV is complete with the first token the prefill
    /// worker sampled.
    fn start_ready_transfers(&mut self) {
        for ready in self.reservations.take_ready(&mut self.cache) {
            let r = match ready {
                Ok(r) => r,
                Err((seq, e)) => {
                    let _ = seq.events.send(Event::Error(e.into()));
                    continue;
                }
            };
            let (mut seq, first) = (r.claim.seq, r.claim.first_token);
            seq.cached_tokens = r.cached;
            let prompt = seq.prompt.clone();
            self.register(r.id, &prompt);
            seq.kv_wait_seconds = secs(r.claim.at);
            let left = seq
                .max_tokens(self.model.config().context_length)
                .saturating_sub(r.prompt_tokens);
            let step = seq.gen.accept_first(self.model.tokenizer(), first, left);
            seq.phase = Phase::Decode { next: first };
            if let Some(seq) = self.emit(seq, step) {
                self.active.push(seq);
            }
        }
    }

    /// Sends a token; returns the sequence if it goes on (its KV is freed otherwise).
    fn emit(&mut self, seq: Seq, step: TokenStep) -> Option<Seq> {
        let _ = seq.events.send(Event::Token {
            id: step.id,
            text: step.text,
        });
        match step.finished {
            None => Some(seq),
            Some(finish) => {
                self.finish(seq, finish);
                None
            }
        }
    }

    fn finish(&mut self, seq: Seq, finish: FinishReason) {
        self.end_sequence(&seq);
        // A client that saw Done and then reads the status sees the blocks free.
        self.publish();
        tracing::info!(
            parent: &seq.span,
            completion_tokens = seq.gen.generated().len(),
            finish = ?finish,
            preemptions = seq.preemptions,
            "sequence finished"
        );
        let _ = seq.events.send(Event::Done(Done {
            finish,
            completion_tokens: seq.gen.generated().len() as u32,
            prefill_seconds: seq.prefill_seconds,
            kv_wait_seconds: seq.kv_wait_seconds,
            preemptions: seq.preemptions,
            first_preempted_at: seq.first_preempted_at,
            cached_tokens: seq.cached_tokens,
        }));
    }

    fn drop_abandoned(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].events.is_closed() {
                let s = self.active.swap_remove(i);
                self.end_sequence(&s);
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|s| !s.events.is_closed());
    }
}
