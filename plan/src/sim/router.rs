//! The simulated router: worker records as the registry would hold them (updated whenever
//! a simulated worker's load changes, i.e. fresh records), the router's own in-flight
//! counts, and placement by the live router's [`decide`].
//!
//! Placement of a request, as the relay does it: [`decide`]; a `Wait` (no decode worker
//! with room) queues the request until a decode worker frees blocks (first come first
//! placed) or `max_queue_wait_s` passes; a placement tries its candidates in order, a
//! decode worker refusing (no room for the reservation, a full waiting queue) passes to the
//! next; all refusing queues the request as a `Wait` does.

use std::collections::VecDeque;

use duet_bench::record::RequestError;
use duet_discovery::{Capacity, Role, Snapshot, WorkerRecord};
use duet_router::placement::{
    decide, never_fits, CachedTokens, Decision, NoCache, Placement, Policy, Request, RouterLoad,
    RouterView,
};

use super::{ClusterSpec, Worker};
use super::{Ev, Sim, SimRequest};

const MODEL: &str = "sim";
const CLUSTER: &str = "sim";

pub(super) struct RouterSim {
    snapshot: Snapshot,
    /// Registry key and id per worker (prefill ones first, then decode).
    keys: Vec<String>,
    ids: Vec<String>,
    pub(super) load: RouterLoad,
    policy: Policy,
    kv_routing: bool,
    max_queue_wait_s: f64,
    /// Requests waiting for a decode worker with room, and since when.
    pub(super) pending: VecDeque<(usize, f64)>,
}

fn record(role: Role, id: &str, blocks: usize, block_size: usize) -> WorkerRecord {
    let mut w = WorkerRecord::new(CLUSTER, role, id, format!("sim://{id}"));
    w.model = MODEL.into();
    w.fingerprint = "sim".into();
    w.capacity = Capacity {
        kv_blocks_total: blocks as u64,
        kv_blocks_free: blocks as u64,
        block_size: block_size as u32,
        ..Capacity::default()
    };
    w
}

impl RouterSim {
    pub(super) fn new(spec: &ClusterSpec, prefill: usize, blocks: usize, bs: usize) -> Self {
        let mut snapshot = Snapshot {
            workers: Default::default(),
            revision: 1,
            stale: false,
            stale_since: None,
            lost_at: Default::default(),
        };
        let mut keys = Vec::new();
        let mut worker_ids = Vec::new();
        let ids = (0..prefill)
            .map(|i| (Role::Prefill, format!("p{i}")))
            .chain((0..spec.decode_workers).map(|i| (Role::Decode, format!("d{i}"))));
        for (role, id) in ids {
            let rec = record(role, &id, blocks, bs);
            let key = rec.key();
            snapshot.workers.insert(key.clone(), rec);
            keys.push(key);
            worker_ids.push(id);
        }
        RouterSim {
            snapshot,
            keys,
            ids: worker_ids,
            load: RouterLoad::default(),
            policy: Policy {
                mode: spec.mode,
                model: MODEL.into(),
                local_prefill_max_tokens: spec.local_prefill_max_tokens,
                decode_headroom_tokens: spec.decode_headroom_tokens,
                decode_seq_cost_tokens: spec.decode_seq_cost_tokens,
            },
            kv_routing: spec.kv_routing,
            max_queue_wait_s: spec.max_queue_wait_s,
            pending: VecDeque::new(),
        }
    }

    /// Publishes a worker's capacity (`slot`: prefill workers first, then decode).
    pub(super) fn publish(&mut self, slot: usize, update: impl FnOnce(&mut Capacity)) {
        if let Some(w) = self.snapshot.workers.get_mut(&self.keys[slot]) {
            update(&mut w.capacity);
        }
    }

    /// The simulated worker of a record (ids are `p<i>` and `d<i>`).
    fn worker(&self, w: &WorkerRecord) -> Option<Worker> {
        let i = w.id.get(1..)?.parse().ok()?;
        match w.id.as_bytes().first() {
            Some(b'p') => Some(Worker::Prefill(i)),
            Some(b'd') => Some(Worker::Decode(i)),
            _ => None,
        }
    }
}

/// What each worker's prefix cache holds of one prompt, read from the simulated caches.
struct Cached<'a, 'p> {
    sim: &'a Sim<'p>,
    req: &'a SimRequest,
}

impl CachedTokens for Cached<'_, '_> {
    fn cached_tokens(&self, w: &WorkerRecord) -> usize {
        let blocks = match self.sim.router.worker(w) {
            Some(Worker::Decode(d)) => self.sim.decode[d].cached_blocks(&self.req.hashes),
            Some(Worker::Prefill(p)) => self.sim.prefill[p].cached_blocks(&self.req.hashes),
            None => 0,
        };
        (blocks * self.sim.profile.block_size()).min(self.req.prompt_len)
    }
}

impl Sim<'_> {
    fn decision(&self, r: usize) -> Decision {
        let req = &self.reqs[r].spec;
        let cached = Cached { sim: self, req };
        let view = RouterView {
            snapshot: &self.router.snapshot,
            load: &self.router.load,
            cached: if self.router.kv_routing {
                &cached
            } else {
                &NoCache
            },
        };
        let request = Request {
            prompt_tokens: req.prompt_len,
            resumed_tokens: 0,
        };
        decide(&view, &request, &self.router.policy)
    }

    /// The router places request `r`, or queues it.
    pub(super) fn place(&mut self, r: usize) {
        if !self.try_place(r) {
            if self.router.pending.is_empty() {
                self.at(self.now + self.router.max_queue_wait_s, Ev::RetryPending);
            }
            self.router.pending.push_back((r, self.now));
        }
    }

    /// Places `r` if a worker takes it now; `false`: it must wait.
    fn try_place(&mut self, r: usize) -> bool {
        match self.decision(r) {
            Decision::Wait {
                largest_pool_tokens,
            } => {
                let prompt = self.reqs[r].spec.prompt_len;
                if largest_pool_tokens.is_none_or(|t| never_fits(prompt, t)) {
                    let why = "the prompt does not fit any decode worker's KV pool";
                    self.end_request(r, Some(RequestError::new("grpc:RESOURCE_EXHAUSTED", why)));
                    return true;
                }
                false
            }
            Decision::Place(p) => self.try_candidates(r, p),
        }
    }

    fn try_candidates(&mut self, r: usize, p: Placement) -> bool {
        for c in &p.candidates {
            let Some(Worker::Decode(d)) = self.router.worker(&c.decode) else {
                continue;
            };
            let prefill = c
                .prefill
                .as_ref()
                .and_then(|w| match self.router.worker(w) {
                    Some(Worker::Prefill(i)) => Some(i),
                    _ => None,
                });
            let taken = match prefill {
                Some(pw) => self.start_remote(r, d, pw),
                None => self.start_local(r, d),
            };
            if taken {
                self.reqs[r].placement = Some(p.kind.label());
                self.reqs[r].decode = Some(d);
                *self
                    .router
                    .load
                    .decode_inflight
                    .entry(c.decode.id.clone())
                    .or_insert(0) += 1;
                return true;
            }
        }
        false
    }

    /// After a decode worker freed room: places waiting requests in order, failing those
    /// that waited too long.
    pub(super) fn retry_pending(&mut self) {
        let before = self.router.pending.front().map(|p| p.0);
        while let Some(&(r, since)) = self.router.pending.front() {
            if self.now - since >= self.router.max_queue_wait_s {
                self.router.pending.pop_front();
                let why = "no decode worker had room within the queue wait";
                self.end_request(r, Some(RequestError::new("grpc:RESOURCE_EXHAUSTED", why)));
                continue;
            }
            if !self.try_place(r) {
                break;
            }
            self.router.pending.pop_front();
        }
        // The new first waiting request is re-checked when its wait runs out, whatever
        // the workers do meanwhile.
        if let Some(&(r, since)) = self.router.pending.front() {
            if before != Some(r) {
                let t = since + self.router.max_queue_wait_s + 1e-9;
                self.at(t.max(self.now), Ev::RetryPending);
            }
        }
    }

    /// The request left decode worker `d` (finished or failed).
    pub(super) fn router_done(&mut self, d: usize) {
        let id = &self.router.ids[self.prefill.len() + d];
        if let Some(n) = self.router.load.decode_inflight.get_mut(id) {
            *n = n.saturating_sub(1);
        }
    }

    pub(super) fn router_prefill_tokens(&mut self, p: usize, add: i64) {
        let id = &self.router.ids[p];
        if let Some(e) = self.router.load.prefill_tokens.get_mut(id) {
            *e = (*e as i64 + add).max(0) as u64;
        } else if add > 0 {
            self.router
                .load
                .prefill_tokens
                .insert(id.clone(), add as u64);
        }
    }
}
