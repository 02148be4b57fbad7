//! The engine thread: continuous batching over one paged KV cache.
//!
//! The decisions (waiting order, admission, the next forward's rows, the preemption victim)
//! are model-free functions in [`crate::policy`]; this file applies them to the engine.
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
//! Invariants:
//! - a cache sequence exists iff its request is in `reservations` or `active`
//!   (`waiting` sequences hold no KV);
//! - KV receivers may write only the reservation's fresh blocks, never its cached prefix;
//! - before a forward, the blocks it needs are free: otherwise the lowest-priority, newest
//!   sequence is preempted (freed; recomputed from its tokens when it is admitted again),
//!   so one long request never stalls or fails the others;
//! - every request ends with exactly one `Done` or `Error` event, unless its receiver is
//!   already gone.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::{
    reusable_tokens, BlockHash, EngineError, FinishReason, Generation, KvCache, KvCacheConfig,
    Model, PrefixHasher, SeqChunk, TokenStep,
};
use duet_serving::engine_thread::{EngineLoop, Wait};
use duet_serving::kv_events::KvEventHub;
use duet_serving::prefix_cache::PrefixCacheBook;
use tokio::sync::mpsc;

use crate::config::DecodeConfig;
use crate::error::DecodeError;
use crate::handle::{
    secs, Cmd, DecodeStatus, Done, Event, GenerateJob, PrefillSource, Priority, Reserved,
    ReservedBlocks,
};
use crate::metrics::DecodeMetrics;
use crate::policy;

/// How long the engine thread sleeps, with no command, while it holds reservations or
/// waiting sequences: their expiry and their clients going away announce themselves by no
/// command. With nothing held it sleeps until a command arrives.
const IDLE_POLL: Duration = Duration::from_millis(20);

impl EngineLoop for Scheduler {
    type Cmd = Cmd;

    fn idle_wait(&self) -> Wait {
        if !self.active.is_empty() || self.can_admit() {
            Wait::Busy
        } else if self.waiting.is_empty() && self.reservations.is_empty() {
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

enum Phase {
    /// Prompt (or, after preemption, prompt + generated) tokens being computed here.
    Prefill {
        tokens: Vec<u32>,
        done: usize,
        /// Token to feed once the prefill is complete (resuming a preempted sequence);
        /// `None`: sample the first token from the prefill's logits.
        resume: Option<u32>,
        /// Tokens from this index on were generated before (preemption, migration): they
        /// are fed one per step, as decoding fed them, so their KV, and the greedy tokens
        /// that follow, are bit-identical to an undisturbed run. A multi-row chunk would
        /// take another attention kernel whose sums round differently.
        exact_from: usize,
    },
    /// KV holds everything but `next`, which is fed at the next step.
    Decode { next: u32 },
}

struct Seq {
    id: u64,
    prompt: Vec<u32>,
    priority: Priority,
    arrival: Instant,
    gen: Generation,
    events: mpsc::UnboundedSender<Event>,
    phase: Phase,
    prefill_started: Option<Instant>,
    prefill_seconds: f64,
    kv_wait_seconds: f64,
    preemptions: u32,
    first_preempted_at: Option<u32>,
    /// Prompt tokens whose KV came from the prefix cache at the first prefill.
    cached_tokens: usize,
    /// Leading prompt tokens whose KV is computed as a prompt (by a prefill worker, or by a
    /// local prefill here); only those are registered in the prefix cache. Tokens computed
    /// one per step (a replay after migration) are not, nor are generated ones: a later
    /// prompt recomputes them as a prompt, so its KV, and its output, never depend on
    /// whether the cache served it.
    cacheable: usize,
    span: tracing::Span,
}

struct Reservation {
    /// The fresh blocks the KV arrives in (the cached prefix's blocks are not listed).
    blocks: Vec<u32>,
    prompt_tokens: usize,
    /// Leading prompt tokens attached from the prefix cache, and their block hashes (checked
    /// against the prompt when Generate claims the reservation).
    cached: usize,
    cached_hashes: Vec<BlockHash>,
    received: usize,
    /// Unclaimed reservations expire; every piece of KV that arrives extends the lifetime
    /// by `ttl`, so a long prefill streaming its KV keeps its blocks.
    expires: Instant,
    ttl: Duration,
    failed: Option<String>,
    /// Claimed by Generate: (sequence, first token, claim time).
    claim: Option<(Seq, u32, Instant)>,
}

pub(crate) struct Scheduler {
    model: Arc<Model>,
    cache: KvCache,
    cfg: DecodeConfig,
    status: Arc<Mutex<DecodeStatus>>,
    reserved: ReservedBlocks,
    reservations: HashMap<u64, Reservation>,
    active: Vec<Seq>,
    waiting: VecDeque<Seq>,
    tokens_per_second: f64,
    metrics: DecodeMetrics,
    /// Prefix-cache bookkeeping (`None`: the cache is off).
    book: Option<PrefixCacheBook>,
    hasher: PrefixHasher,
}

impl Scheduler {
    pub(crate) fn new(
        model: Arc<Model>,
        kv: KvCacheConfig,
        cfg: DecodeConfig,
        status: Arc<Mutex<DecodeStatus>>,
        reserved: ReservedBlocks,
        hub: KvEventHub,
    ) -> Result<Scheduler, DecodeError> {
        let layout = model.kv_layout(kv.block_size, kv.dtype);
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
        let s = Scheduler {
            model,
            cache,
            cfg,
            status,
            reserved,
            reservations: HashMap::new(),
            active: Vec::new(),
            waiting: VecDeque::new(),
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
        for s in self.active.drain(..).chain(self.waiting.drain(..)) {
            let _ = s.events.send(Event::Error(DecodeError::ShuttingDown));
            self.cache.free_sequence(s.id);
        }
        let ids: Vec<u64> = self.reservations.keys().copied().collect();
        for id in ids {
            self.drop_reservation(id, Some(DecodeError::ShuttingDown));
        }
        self.publish();
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
            };
        }
        let m = &self.metrics;
        m.running.set(self.active.len() as f64);
        m.waiting.set(self.waiting.len() as f64);
        m.kv_used.set(self.cache.used_blocks() as f64);
        m.kv_capacity.set(self.cache.total_blocks() as f64);
    }

    fn known(&self, id: u64) -> bool {
        self.reservations.contains_key(&id)
            || self.active.iter().any(|s| s.id == id)
            || self.waiting.iter().any(|s| s.id == id)
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Reserve {
                request_id,
                prompt_tokens,
                ttl,
                block_hashes,
                reply,
            } => {
                let r = self.reserve(request_id, prompt_tokens, ttl, &block_hashes);
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
            Cmd::Import {
                request_id,
                layer,
                regions,
            } => {
                let Some(r) = self.reservations.get_mut(&request_id) else {
                    return;
                };
                r.expires = Instant::now() + r.ttl;
                let r = &*r;
                for (block, kind, data) in regions {
                    if !r.blocks.contains(&block) {
                        continue;
                    }
                    let dst = self.cache.region_bytes_mut(block, layer, kind);
                    if dst.len() == data.len() {
                        dst.copy_from_slice(&data);
                    }
                }
            }
            Cmd::TransferDone {
                request_id,
                token_end,
            } => {
                if let Some(r) = self.reservations.get_mut(&request_id) {
                    r.received = r.received.max(token_end);
                    r.expires = Instant::now() + r.ttl;
                }
            }
            Cmd::TransferFailed { request_id, reason } => {
                if let Some(r) = self.reservations.get_mut(&request_id) {
                    r.failed = Some(reason);
                }
            }
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
    ) -> Result<Reserved, DecodeError> {
        if self.known(id) {
            return Err(DecodeError::Duplicate(id));
        }
        let ctx = self.model.config.context_length;
        if tokens == 0 || tokens >= ctx {
            return Err(EngineError::invalid(
                "prompt_tokens",
                format!("{tokens} (must be in 1..{ctx})"),
            )
            .into());
        }
        self.cache.add_sequence(id)?;
        let bs = self.cache.block_size();
        let hit = match &self.book {
            Some(book) if !hashes.is_empty() => {
                let hit = self
                    .cache
                    .attach_prefix(id, hashes, reusable_tokens(tokens, bs))?;
                book.lookup(tokens, hit, bs);
                hit
            }
            _ => Default::default(),
        };
        let cached = hit.blocks() * bs;
        if let Err(e) = self.cache.prepare_append(id, tokens - cached) {
            self.cache.free_sequence(id);
            return Err(e.into());
        }
        let blocks = self.cache.sequence_blocks(id)?[cached / bs..].to_vec();
        if let Ok(mut m) = self.reserved.lock() {
            for &b in &blocks {
                m.insert(b, id);
            }
        }
        self.reservations.insert(
            id,
            Reservation {
                blocks: blocks.clone(),
                prompt_tokens: tokens,
                cached,
                cached_hashes: hashes[..cached / bs].to_vec(),
                received: cached,
                expires: Instant::now() + ttl.min(self.cfg.max_reservation_ttl),
                ttl: ttl.min(self.cfg.max_reservation_ttl),
                failed: None,
                claim: None,
            },
        );
        Ok(Reserved {
            cached_tokens: cached,
            blocks,
        })
    }

    fn new_seq(
        &self,
        job: GenerateJob,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<Seq, (DecodeError, mpsc::UnboundedSender<Event>)> {
        let mut gen = match job
            .params
            .validate(self.model.config.context_length)
            .and_then(|_| Generation::new(&self.model.tokenizer, &job.prompt, job.params))
        {
            Ok(g) => g,
            Err(e) => return Err((e.into(), events)),
        };
        // A migrated stream: the replayed tokens were generated (and their text sent) by
        // another worker; the text state continues from them, so nothing is sent twice and
        // nothing held back there is lost.
        if let PrefillSource::Local { replay } = job.prefill {
            let replayed = &job.prompt[job.prompt.len().saturating_sub(replay)..];
            gen.resume(&self.model.tokenizer, replayed);
        }
        let cacheable = match job.prefill {
            PrefillSource::Local { replay } => job.prompt.len().saturating_sub(replay),
            PrefillSource::Remote { .. } => job.prompt.len(),
        };
        Ok(Seq {
            id: job.request_id,
            phase: Phase::Prefill {
                tokens: job.prompt.clone(),
                done: 0,
                resume: None,
                exact_from: match job.prefill {
                    PrefillSource::Local { replay } => job.prompt.len().saturating_sub(replay),
                    PrefillSource::Remote { .. } => job.prompt.len(),
                },
            },
            prompt: job.prompt,
            priority: job.priority,
            arrival: Instant::now(),
            gen,
            events,
            prefill_started: None,
            prefill_seconds: 0.0,
            kv_wait_seconds: 0.0,
            preemptions: 0,
            first_preempted_at: None,
            cached_tokens: 0,
            cacheable,
            span: job.span,
        })
    }

    fn generate(&mut self, job: GenerateJob, events: mpsc::UnboundedSender<Event>) {
        let id = job.request_id;
        let source = job.prefill;
        if job.prompt.is_empty() || job.prompt.len() >= self.model.config.context_length {
            let e = EngineError::invalid(
                "prompt",
                format!(
                    "{} tokens (must be in 1..{})",
                    job.prompt.len(),
                    self.model.config.context_length
                ),
            );
            let _ = events.send(Event::Error(e.into()));
            return;
        }
        match source {
            PrefillSource::Remote { first_token } => {
                let reservation = self.reservations.get(&id);
                let claimed =
                    reservation.map(|r| r.claim.is_some() || r.prompt_tokens != job.prompt.len());
                let foreign_prefix = reservation
                    .is_some_and(|r| !self.prefix_matches(&job.prompt, &r.cached_hashes));
                match claimed {
                    None => {
                        let _ = events.send(Event::Error(DecodeError::NoReservation(id)));
                    }
                    Some(true) => {
                        let _ = events.send(Event::Error(DecodeError::Duplicate(id)));
                    }
                    Some(false) if foreign_prefix => {
                        // The reservation attached another prompt's cached blocks: its KV
                        // must not be continued. It ends here (blocks freed).
                        self.drop_reservation(id, None);
                        let _ = events.send(Event::Error(DecodeError::PrefixMismatch(id)));
                    }
                    Some(false) => match self.new_seq(job, events) {
                        Ok(seq) => {
                            if let Some(r) = self.reservations.get_mut(&id) {
                                r.claim = Some((seq, first_token, Instant::now()));
                            }
                        }
                        Err((e, events)) => {
                            let _ = events.send(Event::Error(e));
                            self.drop_reservation(id, None);
                        }
                    },
                }
            }
            PrefillSource::Local { .. } => {
                if self.known(id) {
                    let _ = events.send(Event::Error(DecodeError::Duplicate(id)));
                    return;
                }
                if self.waiting.len() >= self.cfg.max_waiting {
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

    /// Into the waiting queue at [`policy::waiting_position`].
    fn enqueue(&mut self, seq: Seq, front: bool) {
        let pos =
            policy::waiting_position(self.waiting.iter().map(|w| w.priority), seq.priority, front);
        self.waiting.insert(pos, seq);
    }

    fn release(&mut self, id: u64) -> bool {
        if self.reservations.contains_key(&id) {
            self.drop_reservation(id, None);
            return true;
        }
        if let Some(i) = self.active.iter().position(|s| s.id == id) {
            let s = self.active.swap_remove(i);
            self.end_sequence(&s);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        false
    }

    fn drop_reservation(&mut self, id: u64, err: Option<DecodeError>) {
        if let Some(r) = self.reservations.remove(&id) {
            if let Ok(mut m) = self.reserved.lock() {
                for b in &r.blocks {
                    m.remove(b);
                }
            }
            self.cache.free_sequence(id);
            if let (Some((seq, _, _)), Some(e)) = (r.claim, err) {
                let _ = seq.events.send(Event::Error(e));
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        let mut ended = Vec::new();
        for (&id, r) in &self.reservations {
            match &r.claim {
                None if now >= r.expires => {
                    self.metrics.reservations_expired.increment(1);
                    ended.push((id, None));
                }
                Some((seq, _, claimed)) => {
                    if seq.events.is_closed() {
                        ended.push((id, None));
                    } else if let Some(reason) = &r.failed {
                        ended.push((
                            id,
                            Some(DecodeError::TransferFailed {
                                request_id: id,
                                reason: reason.clone(),
                            }),
                        ));
                    } else if now.duration_since(*claimed) >= self.cfg.kv_wait_timeout {
                        ended.push((id, Some(DecodeError::TransferTimeout(id))));
                    }
                }
                None => {}
            }
        }
        for (id, e) in ended {
            tracing::debug!(request_id = id, error = ?e, "reservation ended");
            self.drop_reservation(id, e);
        }
    }

    fn start_ready_transfers(&mut self) {
        let ready: Vec<u64> = self
            .reservations
            .iter()
            .filter(|(_, r)| {
                r.claim.is_some() && r.failed.is_none() && r.received >= r.prompt_tokens
            })
            .map(|(&id, _)| id)
            .collect();
        for id in ready {
            let Some(r) = self.reservations.remove(&id) else {
                continue;
            };
            if let Ok(mut m) = self.reserved.lock() {
                for b in &r.blocks {
                    m.remove(b);
                }
            }
            let Some((mut seq, first, claimed)) = r.claim else {
                continue;
            };
            if let Err(e) = self.cache.commit_append(id, r.prompt_tokens - r.cached) {
                self.cache.free_sequence(id);
                let _ = seq.events.send(Event::Error(e.into()));
                continue;
            }
            seq.cached_tokens = r.cached;
            let prompt = seq.prompt.clone();
            self.register(id, &prompt);
            seq.kv_wait_seconds = secs(claimed);
            let left = self.model.config.context_length - r.prompt_tokens;
            let step = seq.gen.accept_first(&self.model.tokenizer, first, left);
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

    fn can_admit(&self) -> bool {
        self.waiting.front().is_some_and(|s| {
            let pool = policy::Pool {
                free_blocks: self.cache.free_blocks(),
                total_blocks: self.cache.total_blocks(),
                watermark_blocks: self.cfg.admit_watermark_blocks,
            };
            policy::admits(
                self.active.len(),
                self.cfg.max_batch,
                self.blocks_to_start(s),
                pool,
            )
        })
    }

    fn blocks_to_start(&self, s: &Seq) -> usize {
        match &s.phase {
            Phase::Prefill { tokens, .. } => self.cache.blocks_for(tokens.len() + 1),
            Phase::Decode { .. } => 1,
        }
    }

    fn admit(&mut self) {
        while self.can_admit() {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if let Err(e) = self.cache.add_sequence(s.id) {
                let _ = s.events.send(Event::Error(e.into()));
                continue;
            }
            if let Err(e) = self.attach_cached_prefix(&mut s) {
                self.cache.free_sequence(s.id);
                let _ = s.events.send(Event::Error(e.into()));
                continue;
            }
            s.prefill_started.get_or_insert_with(Instant::now);
            self.active.push(s);
        }
        // A sequence that can never fit (more blocks than the pool) fails instead of waiting.
        if self.active.is_empty() {
            if let Some(s) = self.waiting.front() {
                let need = self.blocks_to_start(s);
                if need > self.cache.total_blocks() {
                    if let Some(s) = self.waiting.pop_front() {
                        let _ = s.events.send(Event::Error(
                            EngineError::KvExhausted {
                                needed: need,
                                free: self.cache.total_blocks(),
                            }
                            .into(),
                        ));
                    }
                }
            }
        }
    }

    /// Starts a local prefill after the longest prefix the cache holds. Tokens that must be
    /// fed one per step (a replay after preemption or migration) are never taken from the
    /// cache.
    fn attach_cached_prefix(&mut self, s: &mut Seq) -> Result<(), EngineError> {
        let Some(book) = &self.book else {
            return Ok(());
        };
        let Phase::Prefill {
            tokens,
            done,
            exact_from,
            ..
        } = &mut s.phase
        else {
            return Ok(());
        };
        let bs = self.cache.block_size();
        // Two rows at least before `exact_from` too: a one-row first chunk would take the
        // per-row kernels, unlike the same row in the prefill that cached the prefix.
        let limit = reusable_tokens(tokens.len(), bs).min(reusable_tokens(*exact_from, bs));
        let hashes = self.hasher.hashes(&tokens[..limit]);
        let hit = self.cache.attach_prefix(s.id, &hashes, limit)?;
        *done = hit.blocks() * bs;
        if s.preemptions == 0 {
            book.lookup(tokens.len(), hit, bs);
            s.cached_tokens = *done;
        }
        Ok(())
    }

    /// The next forward ([`policy::plan_forward`]) and the blocks it needs.
    fn plan(&self) -> (Vec<(usize, usize)>, usize) {
        let rows: Vec<policy::Row> = self
            .active
            .iter()
            .map(|s| policy::Row {
                priority: s.priority,
                arrival: s.arrival,
                prefill: match &s.phase {
                    Phase::Decode { .. } => None,
                    Phase::Prefill {
                        tokens,
                        done,
                        exact_from,
                        ..
                    } => Some(policy::PrefillLeft {
                        tokens: tokens.len() - done,
                        before_exact: exact_from.saturating_sub(*done),
                    }),
                },
            })
            .collect();
        let plan = policy::plan_forward(&rows, self.cfg.prefill_chunk_tokens);
        let need = plan
            .iter()
            .map(|&(i, n)| {
                let id = self.active[i].id;
                let len = self.cache.sequence_len(id).unwrap_or(0);
                let have = self.cache.sequence_blocks(id).map_or(0, |b| b.len());
                self.cache.blocks_for(len + n).saturating_sub(have)
            })
            .sum();
        (plan, need)
    }

    /// Frees the lowest-priority, newest running sequence and queues it for recompute.
    fn preempt_one(&mut self) -> bool {
        let running: Vec<(Priority, Instant)> = self
            .active
            .iter()
            .map(|s| (s.priority, s.arrival))
            .collect();
        let Some(i) = policy::preemption_victim(&running) else {
            return false;
        };
        let mut s = self.active.swap_remove(i);
        // Its complete prompt blocks stay cached: the recompute finds them unless evicted.
        self.end_sequence(&s);
        s.phase = match s.phase {
            Phase::Decode { next } => {
                let gen = s.gen.generated();
                let mut tokens = s.prompt.clone();
                tokens.extend_from_slice(&gen[..gen.len().saturating_sub(1)]);
                Phase::Prefill {
                    tokens,
                    done: 0,
                    resume: Some(next),
                    exact_from: s.prompt.len(),
                }
            }
            Phase::Prefill {
                tokens,
                resume,
                exact_from,
                ..
            } => Phase::Prefill {
                tokens,
                done: 0,
                resume,
                exact_from,
            },
        };
        s.preemptions += 1;
        self.metrics.preemptions.increment(1);
        s.first_preempted_at
            .get_or_insert(s.gen.generated().len() as u32);
        tracing::info!(parent: &s.span, request_id = s.id, "preempted: KV pool full");
        self.enqueue(s, true);
        true
    }

    /// After a forward over `plan` failed with `e`: ends the sequences `blamed` for it (each
    /// with its own error); when none is to blame (a fault of this worker, not of a
    /// request), ends the whole batch as unavailable here, which the router migrates.
    fn fail_step(
        &mut self,
        plan: &[(usize, usize)],
        blamed: Vec<(usize, EngineError)>,
        e: &EngineError,
    ) {
        let mut ended: Vec<(usize, DecodeError)> = if blamed.is_empty() {
            tracing::error!(error = %e, "forward failed; no request to blame: ending the batch");
            plan.iter()
                .map(|&(i, _)| (i, DecodeError::StepFailed(e.to_string())))
                .collect()
        } else {
            tracing::warn!(
                error = %e,
                blamed = blamed.len(),
                batch = plan.len(),
                "forward refused a chunk; ending only the sequences it belongs to"
            );
            blamed.into_iter().map(|(i, e)| (i, e.into())).collect()
        };
        ended.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, err) in ended {
            let s = self.active.swap_remove(i);
            self.cache.free_sequence(s.id);
            let _ = s.events.send(Event::Error(err));
        }
    }

    fn step(&mut self) {
        let (mut plan, mut need) = self.plan();
        while need > self.cache.free_blocks() {
            if !self.preempt_one() {
                // A single sequence that outgrew the pool: it ends here.
                if let Some(s) = self.active.pop() {
                    self.cache.free_sequence(s.id);
                    let _ = s.events.send(Event::Error(
                        EngineError::KvExhausted {
                            needed: need,
                            free: self.cache.free_blocks(),
                        }
                        .into(),
                    ));
                }
                return;
            }
            (plan, need) = self.plan();
        }
        if plan.is_empty() {
            return;
        }
        let feeds: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, n)| match &self.active[i].phase {
                Phase::Decode { next } => vec![*next],
                Phase::Prefill { tokens, done, .. } => tokens[*done..*done + n].to_vec(),
            })
            .collect();
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .zip(&feeds)
            .map(|(&(i, n), toks)| SeqChunk {
                seq: self.active[i].id,
                tokens: toks,
                logits: match &self.active[i].phase {
                    Phase::Decode { .. } => true,
                    Phase::Prefill { tokens, done, .. } => done + n == tokens.len(),
                },
                // Replayed generated tokens were decode steps: they keep the decode order.
                prompt: matches!(
                    &self.active[i].phase,
                    Phase::Prefill { done, exact_from, .. } if done < exact_from
                ),
            })
            .collect();
        // What this step reads: every weight once, and each sequence's whole KV so far.
        let kv_tokens: usize = plan
            .iter()
            .map(|&(i, n)| self.cache.sequence_len(self.active[i].id).unwrap_or(0) + n)
            .sum();
        let read_bytes =
            self.model.weight_bytes_per_step() + kv_tokens * self.cache.layout().bytes_per_token();
        let t0 = Instant::now();
        let result = self.model.forward(&mut self.cache, &chunks);
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                // One sequence's fault must not end the others: the forward checks every
                // chunk before it changes anything, so the sequences whose chunk fails that
                // check end here and the rest, untouched, run at the next iteration.
                let blamed: Vec<(usize, EngineError)> = plan
                    .iter()
                    .zip(&chunks)
                    .filter_map(|(&(i, _), ch)| {
                        self.model
                            .check_chunk(&self.cache, ch)
                            .err()
                            .map(|e| (i, e))
                    })
                    .collect();
                drop(chunks);
                self.fail_step(&plan, blamed, &e);
                return;
            }
        };
        drop(chunks);
        let dt = t0.elapsed().as_secs_f64();
        self.metrics.batch_size.record(plan.len() as f64);
        self.metrics.step_seconds.record(dt);
        self.metrics.read_bytes.increment(read_bytes as u64);
        if dt > 0.0 {
            self.metrics.bandwidth.set(read_bytes as f64 / dt);
        }
        let mut generated = 0usize;
        let ctx = self.model.config.context_length;
        let mut ended: Vec<(usize, Option<TokenStep>)> = Vec::new();
        for (k, &(i, n)) in plan.iter().enumerate() {
            let row = std::mem::take(&mut logits[k]);
            let left =
                ctx.saturating_sub(self.cache.sequence_len(self.active[i].id).unwrap_or(ctx));
            let s = &mut self.active[i];
            match &mut s.phase {
                Phase::Decode { .. } => {
                    let mut row = row;
                    let step = s.gen.step(&self.model.tokenizer, &mut row, left);
                    generated += 1;
                    ended.push((i, Some(step)));
                }
                Phase::Prefill {
                    tokens,
                    done,
                    resume,
                    ..
                } => {
                    *done += n;
                    if *done < tokens.len() {
                        continue;
                    }
                    if self.book.is_some() {
                        let _ = self.cache.register_blocks(s.id, &s.prompt[..s.cacheable]);
                    }
                    if let Some(started) = s.prefill_started {
                        s.prefill_seconds += secs(started);
                    }
                    match resume.take() {
                        Some(next) => s.phase = Phase::Decode { next },
                        None => {
                            let mut row = row;
                            let step = s.gen.step(&self.model.tokenizer, &mut row, left);
                            generated += 1;
                            ended.push((i, Some(step)));
                        }
                    }
                }
            }
        }
        // Apply steps; remove finished sequences from the back so indices stay valid.
        ended.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, step) in ended {
            let Some(step) = step else { continue };
            let finished = step.finished;
            let s = &mut self.active[i];
            s.phase = Phase::Decode { next: step.id };
            let _ = s.events.send(Event::Token {
                id: step.id,
                text: step.text,
            });
            if let Some(f) = finished {
                let s = self.active.swap_remove(i);
                self.finish(s, f);
            }
        }
        self.metrics.generated.increment(generated as u64);
        if dt > 0.0 {
            let rate = generated as f64 / dt;
            self.tokens_per_second = 0.9 * self.tokens_per_second + 0.1 * rate;
        }
    }
}
