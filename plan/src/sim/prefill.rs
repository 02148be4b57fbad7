//! A simulated prefill worker, as `prefill-worker/src/engine_loop` runs: a queue in
//! [`policy::queue_position`] order, prompts started while [`policy::has_room`], forwards
//! cut by [`policy::plan_chunks`], the profiled time per forward (its chunks priced as
//! [`crate::Profile::step_s`] says); a finished prompt's KV reaches its decode worker over
//! the link.
//!
//! Transfer: KV streams layer by layer during the last chunk's forward, so what the link
//! adds beyond the compute is the last layer's bytes at the link's rate plus its latency,
//! unless the link is slower than the compute, in which case the whole prompt's bytes at
//! the link's rate from the first chunk's start bound it.

use std::collections::VecDeque;

use duet_prefill_worker::policy;

use super::cache::PrefixLru;
use super::{Ev, Sim, Worker};

struct Job {
    req: usize,
    /// Prompt tokens whose KV goes to the decode worker (after its cached prefix).
    transfer_tokens: usize,
    /// Tokens the router counted for this worker (taken back when it finishes).
    counted: usize,
    /// Tokens whose KV is here (cached prefix, then computed chunks).
    done: usize,
    blocks: usize,
    started: Option<f64>,
}

pub(super) struct PrefillSim {
    free: usize,
    cache: PrefixLru,
    queue: VecDeque<Job>,
    running: Vec<Job>,
    plan: Vec<(usize, usize)>,
}

impl PrefillSim {
    pub(super) fn new(blocks: usize, prefix_cache: bool) -> Self {
        PrefillSim {
            free: blocks,
            cache: PrefixLru::new(prefix_cache),
            queue: VecDeque::new(),
            running: Vec::new(),
            plan: Vec::new(),
        }
    }

    pub(super) fn cached_blocks(&self, hashes: &[u64]) -> usize {
        self.cache.hit(hashes)
    }
}

impl Sim<'_> {
    /// Request `r` queues on prefill worker `p`, which starts a forward if idle; `transfer`
    /// tokens of KV go to its decode worker.
    pub(super) fn enqueue_prefill(&mut self, r: usize, p: usize, transfer: usize) {
        self.queue_prefill(r, p, transfer);
        self.kick_prefill(p);
    }

    /// Request `r` joins prefill worker `p`'s queue (no forward started).
    pub(super) fn queue_prefill(&mut self, r: usize, p: usize, transfer: usize) {
        let prompt = self.reqs[r].spec.prompt_len;
        let bs = self.profile.block_size();
        let hit = self.prefill[p].cache.hit(&self.reqs[r].spec.hashes);
        let counted = prompt - hit.min((prompt - 1) / bs) * bs;
        self.router_prefill_tokens(p, counted as i64);
        self.reqs[r].prefill = Some(p);
        let w = &mut self.prefill[p];
        let at = policy::queue_position(w.queue.iter().map(|_| false), false);
        w.queue.insert(
            at,
            Job {
                req: r,
                transfer_tokens: transfer,
                counted,
                done: 0,
                blocks: 0,
                started: None,
            },
        );
        self.publish_prefill(p);
    }

    /// The next forward of prefill worker `p`, unless it is computing.
    pub(super) fn kick_prefill(&mut self, p: usize) {
        if self.busy(Worker::Prefill(p)) {
            return;
        }
        let bs = self.profile.block_size();
        // Start queued prompts while their blocks fit (allocated whole at the start, which
        // is what the live worker's room check counts).
        while let Some(job) = self.prefill[p].queue.front() {
            let r = job.req;
            let prompt = self.reqs[r].spec.prompt_len;
            let hashes = &self.reqs[r].spec.hashes;
            let w = &self.prefill[p];
            let hit = w.cache.hit(hashes).min((prompt - 1) / bs);
            let need = prompt.div_ceil(bs);
            if !policy::has_room(need, 0, w.free) {
                break;
            }
            let w = &mut self.prefill[p];
            let Some(mut job) = w.queue.pop_front() else {
                break;
            };
            w.cache.take(hashes, hit);
            w.free -= need;
            w.cache.shrink_to(w.free);
            job.blocks = need;
            job.done = hit * bs;
            self.reqs[r].cached = job.done;
            self.prefill[p].running.push(job);
        }
        let w = &self.prefill[p];
        let left: Vec<usize> = w
            .running
            .iter()
            .map(|j| self.reqs[j.req].spec.prompt_len - j.done)
            .collect();
        let plan = policy::plan_chunks(&left, self.spec.max_batch_tokens, bs);
        if plan.is_empty() {
            self.publish_prefill(p);
            return;
        }
        let chunks: Vec<(usize, f64)> = plan
            .iter()
            .map(|&(i, n)| (n, w.running[i].done as f64))
            .collect();
        let now = self.now;
        for &(i, _) in &plan {
            self.prefill[p].running[i].started.get_or_insert(now);
        }
        self.prefill[p].plan = plan;
        let seconds = self.profile.step_s(0, 0.0, &chunks);
        self.publish_prefill(p);
        self.start_work(Worker::Prefill(p), seconds);
    }

    pub(super) fn prefill_forward_done(&mut self, p: usize) {
        for (i, n) in std::mem::take(&mut self.prefill[p].plan) {
            self.prefill[p].running[i].done += n;
        }
        let link = self.spec.link.clone();
        let kv = self.profile.file.kv_bytes_per_token as f64;
        let layers = self.profile.file.n_layers as f64;
        let mut i = 0;
        while i < self.prefill[p].running.len() {
            let j = &self.prefill[p].running[i];
            if j.done < self.reqs[j.req].spec.prompt_len {
                i += 1;
                continue;
            }
            let j = self.prefill[p].running.remove(i);
            let w = &mut self.prefill[p];
            w.free += j.blocks;
            w.cache.insert(&self.reqs[j.req].spec.hashes, w.free);
            self.router_prefill_tokens(p, -(j.counted as i64));
            let bytes = j.transfer_tokens as f64 * kv;
            let tail = self.now + link.latency_s + bytes / layers / link.bytes_per_s;
            let whole = j.started.unwrap_or(self.now) + link.latency_s + bytes / link.bytes_per_s;
            self.at(tail.max(whole), Ev::KvArrived(j.req));
        }
        self.publish_prefill(p);
        self.kick_prefill(p);
    }

    pub(super) fn publish_prefill(&mut self, p: usize) {
        let w = &self.prefill[p];
        let queued: usize = w
            .queue
            .iter()
            .chain(&w.running)
            .map(|j| self.reqs[j.req].spec.prompt_len - j.done)
            .sum();
        let (running, waiting, free, cached) =
            (w.running.len(), w.queue.len(), w.free, w.cache.len());
        self.router.publish(p, |c| {
            c.running = running as u32;
            c.waiting = waiting as u32;
            c.queued_prefill_tokens = queued as u64;
            c.kv_blocks_free = free as u64;
            c.kv_blocks_cached = cached as u64;
        });
    }
}
