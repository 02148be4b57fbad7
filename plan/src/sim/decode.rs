//! A simulated decode worker, iteration by iteration as `decode-worker/src/scheduler`
//! runs: start the sequences whose remote KV arrived (streaming their first token), admit
//! waiting local prefills by [`policy::admits`], plan the forward by
//! [`policy::plan_forward`], preempt by [`policy::preemption_victim`] while the forward's
//! blocks do not fit, then spend the profiled step time.
//!
//! Commands reach the worker's engine thread only between iterations: a remote placement's
//! reservation (and so the call to the prefill worker) waits for the forward in progress,
//! as in the live worker, where a long local prefill chunk delays the remote prefills
//! placed meanwhile.
//!
//! Blocks are counted as the KV cache does: a sequence holds `blocks_for(len)` blocks and
//! grows them as its forward rows need; a reservation holds its whole prompt's blocks from
//! the moment the router places it; a preempted sequence frees everything and is recomputed
//! from its tokens (the generated ones one per step, as the real scheduler replays them).

use std::collections::HashMap;
use std::time::Instant;

use duet_bench::record::RequestError;
use duet_decode_worker::handle::Priority;
use duet_decode_worker::policy;
use duet_decode_worker::waiting::{Queued, WaitingQueue};

use super::cache::PrefixLru;
use super::{Sim, Worker};

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// KV is being computed here up to `total` tokens; `exact_from`: tokens from there on
    /// are fed one per step; `first`: the prompt's first computation (its end streams the
    /// first token).
    Prefill {
        total: usize,
        exact_from: usize,
        first: bool,
    },
    Decode,
}

struct Seq {
    id: u64,
    req: usize,
    arrival: Instant,
    /// Tokens whose KV is held.
    len: usize,
    blocks: usize,
    /// Tokens streamed to the client.
    generated: usize,
    phase: Phase,
}

impl Queued for Seq {
    fn id(&self) -> u64 {
        self.id
    }
    fn priority(&self) -> Priority {
        Priority::Interactive
    }
}

pub(super) struct DecodeSim {
    total: usize,
    free: usize,
    cache: PrefixLru,
    /// Blocks reserved per request whose KV a prefill worker is computing.
    reservations: HashMap<usize, usize>,
    /// Requests whose KV arrived, started at the next iteration.
    ready: Vec<usize>,
    /// Remote prefills reserved while a forward ran: the worker's engine thread takes the
    /// reservation command only between iterations, so the prefill worker is called
    /// then. (request, prefill worker, tokens to transfer)
    deferred: Vec<(usize, usize, usize)>,
    waiting: WaitingQueue<Seq>,
    running: Vec<Seq>,
    /// The forward in progress: (running index, tokens).
    plan: Vec<(usize, usize)>,
    next_id: u64,
}

impl DecodeSim {
    pub(super) fn new(blocks: usize, max_waiting: usize, prefix_cache: bool) -> Self {
        DecodeSim {
            total: blocks,
            free: blocks,
            cache: PrefixLru::new(prefix_cache),
            reservations: HashMap::new(),
            ready: Vec::new(),
            deferred: Vec::new(),
            waiting: WaitingQueue::new(max_waiting),
            running: Vec::new(),
            plan: Vec::new(),
            next_id: 0,
        }
    }

    /// Leading blocks of `hashes` this worker's cache holds.
    pub(super) fn cached_blocks(&self, hashes: &[u64]) -> usize {
        self.cache.hit(hashes)
    }

    fn allocate(&mut self, n: usize) {
        self.free -= n;
        self.cache.shrink_to(self.free);
    }

    /// Blocks in use or reserved plus free blocks: always the pool.
    #[cfg(test)]
    pub(super) fn accounted(&self) -> usize {
        self.free
            + self.reservations.values().sum::<usize>()
            + self.running.iter().map(|s| s.blocks).sum::<usize>()
    }

    #[cfg(test)]
    pub(super) fn free_blocks(&self) -> (usize, usize) {
        (self.free, self.total)
    }
}

impl Sim<'_> {
    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.profile.block_size())
    }

    /// Leading prompt blocks of `r` a worker may take from a cache holding `hit` of them:
    /// never the prompt's last token (it is computed to sample from).
    fn usable_hit(&self, r: usize, hit: usize) -> usize {
        hit.min((self.reqs[r].spec.prompt_len.saturating_sub(1)) / self.profile.block_size())
    }

    /// A remote placement: decode worker `d` reserves the prompt's blocks (after its cached
    /// prefix) and prefill worker `p` queues the rest; `false`: no room.
    pub(super) fn start_remote(&mut self, r: usize, d: usize, p: usize) -> bool {
        let prompt = self.reqs[r].spec.prompt_len;
        let need = self.blocks_for(prompt);
        let hit = self.usable_hit(r, self.decode[d].cache.hit(&self.reqs[r].spec.hashes));
        if self.decode[d].free < need {
            return false;
        }
        let w = &mut self.decode[d];
        w.cache.take(&self.reqs[r].spec.hashes, hit);
        w.allocate(need);
        w.reservations.insert(r, need);
        let transfer = prompt - hit * self.profile.block_size();
        self.publish_decode(d);
        if self.busy(Worker::Decode(d)) {
            self.decode[d].deferred.push((r, p, transfer));
        } else {
            self.enqueue_prefill(r, p, transfer);
        }
        true
    }

    /// A local or colocated placement: the prompt waits in `d`'s queue; `false`: full.
    pub(super) fn start_local(&mut self, r: usize, d: usize) -> bool {
        if self.decode[d].waiting.is_full() {
            return false;
        }
        let prompt = self.reqs[r].spec.prompt_len;
        let arrival = self.instant(self.now);
        let w = &mut self.decode[d];
        w.next_id += 1;
        let s = Seq {
            id: w.next_id,
            req: r,
            arrival,
            len: 0,
            blocks: 0,
            generated: 0,
            phase: Phase::Prefill {
                total: prompt,
                exact_from: prompt,
                first: true,
            },
        };
        w.waiting.push(s, false);
        self.publish_decode(d);
        self.kick_decode(d);
        true
    }

    /// The KV of `r` is complete on its decode worker.
    pub(super) fn kv_arrived(&mut self, r: usize) {
        if let Some(d) = self.reqs[r].decode {
            self.decode[d].ready.push(r);
            self.kick_decode(d);
        }
    }

    /// One iteration of decode worker `d`, unless it is computing.
    pub(super) fn kick_decode(&mut self, d: usize) {
        if self.busy(Worker::Decode(d)) {
            return;
        }
        self.start_ready(d);
        self.admit(d);
        if self.decode[d].running.is_empty() {
            self.publish_decode(d);
            return;
        }
        let Some(plan) = self.plan_with_room(d) else {
            self.publish_decode(d);
            return self.kick_decode(d);
        };
        let (mut rows, mut ctx) = (0, 0.0);
        let mut chunks = Vec::new();
        let w = &mut self.decode[d];
        let mut grow = 0;
        for &(i, n) in &plan {
            let s = &mut w.running[i];
            let want = (s.len + n).div_ceil(self.profile.block_size());
            grow += want.saturating_sub(s.blocks);
            s.blocks = s.blocks.max(want);
            match s.phase {
                Phase::Decode => {
                    rows += 1;
                    ctx += s.len as f64;
                }
                Phase::Prefill { .. } => chunks.push((n, s.len as f64)),
            }
        }
        w.allocate(grow);
        w.plan = plan;
        let mean_ctx = if rows == 0 { 0.0 } else { ctx / rows as f64 };
        let seconds = self.profile.step_s(rows, mean_ctx, &chunks);
        self.publish_decode(d);
        self.start_work(Worker::Decode(d), seconds);
    }

    fn start_ready(&mut self, d: usize) {
        for r in std::mem::take(&mut self.decode[d].ready) {
            let Some(blocks) = self.decode[d].reservations.remove(&r) else {
                continue;
            };
            let arrival = self.instant(self.now);
            let w = &mut self.decode[d];
            w.next_id += 1;
            w.running.push(Seq {
                id: w.next_id,
                req: r,
                arrival,
                len: self.reqs[r].spec.prompt_len,
                blocks,
                generated: 1,
                phase: Phase::Decode,
            });
            self.token(r);
        }
        self.finish_done(d);
    }

    fn admit(&mut self, d: usize) {
        loop {
            let w = &self.decode[d];
            let Some(front) = w.waiting.front() else {
                return;
            };
            let Phase::Prefill { total, .. } = front.phase else {
                return;
            };
            let pool = policy::Pool {
                free_blocks: w.free,
                total_blocks: w.total,
                watermark_blocks: self.spec.admit_watermark_blocks,
            };
            let need = self.blocks_for(total + 1);
            if !policy::admits(w.running.len(), self.spec.max_batch, need, pool) {
                if w.running.is_empty() && need > w.total {
                    if let Some(s) = self.decode[d].waiting.pop_front() {
                        let why = "the prompt needs more KV blocks than the pool has";
                        self.fail_seq(d, s, why);
                    }
                    continue;
                }
                return;
            }
            let Some(mut s) = self.decode[d].waiting.pop_front() else {
                return;
            };
            let hit = self.usable_hit(
                s.req,
                self.decode[d].cache.hit(&self.reqs[s.req].spec.hashes),
            );
            let w = &mut self.decode[d];
            w.cache.take(&self.reqs[s.req].spec.hashes, hit);
            w.free -= hit;
            s.blocks = hit;
            s.len = hit * self.profile.block_size();
            if matches!(s.phase, Phase::Prefill { first: true, .. }) {
                self.reqs[s.req].cached = s.len;
            }
            self.decode[d].running.push(s);
        }
    }

    /// The next forward's rows, preempting until its blocks fit; `None`: a sequence failed
    /// (the last one cannot fit), plan again.
    fn plan_with_room(&mut self, d: usize) -> Option<Vec<(usize, usize)>> {
        loop {
            let w = &self.decode[d];
            let rows: Vec<policy::Row> = w
                .running
                .iter()
                .map(|s| policy::Row {
                    priority: Priority::Interactive,
                    arrival: s.arrival,
                    prefill: match s.phase {
                        Phase::Decode => None,
                        Phase::Prefill {
                            total, exact_from, ..
                        } => Some(policy::PrefillLeft {
                            tokens: total - s.len,
                            before_exact: exact_from.saturating_sub(s.len),
                        }),
                    },
                })
                .collect();
            let plan = policy::plan_forward(&rows, self.spec.prefill_chunk_tokens);
            let bs = self.profile.block_size();
            let need: usize = plan
                .iter()
                .map(|&(i, n)| {
                    let s = &w.running[i];
                    (s.len + n).div_ceil(bs).saturating_sub(s.blocks)
                })
                .sum();
            if need <= w.free {
                return Some(plan);
            }
            let order: Vec<(Priority, Instant)> = w
                .running
                .iter()
                .map(|s| (Priority::Interactive, s.arrival))
                .collect();
            match policy::preemption_victim(&order) {
                Some(v) => self.preempt(d, v),
                None => {
                    let s = self.decode[d].running.remove(0);
                    self.fail_seq(d, s, "the sequence outgrew the KV pool");
                    return None;
                }
            }
        }
    }

    /// Frees running sequence `i` and queues it to be recomputed.
    fn preempt(&mut self, d: usize, i: usize) {
        let prompt_len = self.reqs[self.decode[d].running[i].req].spec.prompt_len;
        let w = &mut self.decode[d];
        let mut s = w.running.remove(i);
        w.free += s.blocks;
        let first = s.generated == 0;
        s.phase = Phase::Prefill {
            total: prompt_len + s.generated.saturating_sub(1),
            exact_from: prompt_len,
            first,
        };
        s.len = 0;
        s.blocks = 0;
        w.waiting.push(s, true);
    }

    pub(super) fn decode_step_done(&mut self, d: usize) {
        // Every deferred call reaches its prefill worker before that worker plans its next
        // forward (they arrive together), so prompts reserved in one gap share a forward.
        let deferred = std::mem::take(&mut self.decode[d].deferred);
        for &(r, p, transfer) in &deferred {
            self.queue_prefill(r, p, transfer);
        }
        for &(_, p, _) in &deferred {
            self.kick_prefill(p);
        }
        let plan = std::mem::take(&mut self.decode[d].plan);
        for (i, n) in plan {
            let s = &mut self.decode[d].running[i];
            s.len += n;
            let streams = match s.phase {
                Phase::Decode => true,
                Phase::Prefill { total, first, .. } if s.len >= total => {
                    s.phase = Phase::Decode;
                    first
                }
                Phase::Prefill { .. } => false,
            };
            if streams {
                s.generated += 1;
                let r = s.req;
                self.token(r);
            }
        }
        self.finish_done(d);
        self.retry_pending();
        self.kick_decode(d);
    }

    /// Ends the sequences that streamed their whole output.
    fn finish_done(&mut self, d: usize) {
        let mut i = 0;
        while i < self.decode[d].running.len() {
            let s = &self.decode[d].running[i];
            if s.generated < self.reqs[s.req].spec.output_len {
                i += 1;
                continue;
            }
            let s = self.decode[d].running.swap_remove(i);
            self.release(d, &s);
            self.end_request(s.req, None);
        }
    }

    fn release(&mut self, d: usize, s: &Seq) {
        let prompt_blocks = self.reqs[s.req].spec.hashes.len();
        let w = &mut self.decode[d];
        w.free += s.blocks;
        w.cache
            .insert(&self.reqs[s.req].spec.hashes[..prompt_blocks], w.free);
        self.router_done(d);
        self.publish_decode(d);
    }

    fn fail_seq(&mut self, d: usize, s: Seq, why: &str) {
        self.release(d, &s);
        self.end_request(
            s.req,
            Some(RequestError::new("grpc:RESOURCE_EXHAUSTED", why)),
        );
    }

    pub(super) fn publish_decode(&mut self, d: usize) {
        let slot = self.prefill.len() + d;
        let w = &self.decode[d];
        let (running, waiting, free, cached) =
            (w.running.len(), w.waiting.len(), w.free, w.cache.len());
        self.router.publish(slot, |c| {
            c.running = running as u32;
            c.waiting = waiting as u32;
            c.kv_blocks_free = free as u64;
            c.kv_blocks_cached = cached as u64;
        });
    }
}
