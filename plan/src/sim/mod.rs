//! A discrete-event simulator of a duet cluster: a router that places every request with
//! the router's own [`duet_router::placement::decide`] over worker records the simulated
//! workers publish, decode workers that batch with the decode worker's own rules
//! ([`duet_decode_worker::policy`]: admission, the next forward's rows, preemption; its
//! [`WaitingQueue`](duet_decode_worker::waiting::WaitingQueue)), prefill workers that cut
//! forwards with the prefill worker's own rules ([`duet_prefill_worker::policy`]), KV moved
//! over a link with a rate and a latency, and prefix caches ([`cache`]). Time costs come
//! from a [`Profile`].
//!
//! What a simulated request goes through, as in the live cluster: the router's overhead,
//! placement (or waiting for a decode worker with room, at most `max_queue_wait_s`); a
//! remote prefill reserves the decode worker's blocks at once, queues on the prefill
//! worker, computes, streams its KV layer by layer (only what the transfer exposes beyond
//! the compute is added), and starts decoding at the decode worker's next iteration, which
//! streams the first token; a local or colocated prefill waits in the decode worker's queue
//! and is computed in chunks mixed into its steps. Every step streams one token per
//! decoding sequence. Sequences stop at their output length (as `ignore_eos`).
//!
//! Hosts: with `workers_per_host` > 1, workers on one host share its cores, each busy one
//! progressing at 1/(busy workers on the host) of its profiled speed (processor sharing),
//! which is how `duet up` runs its workers on one machine.
//!
//! Invariants: simulated time never goes back; every request ends with one record; a
//! decode worker's blocks are `free + held by sequences and reservations == total` and its
//! cache never holds more than its free blocks; events of a worker's superseded work are
//! ignored (epochs).

pub mod cache;
mod decode;
mod prefill;
mod router;
#[cfg(test)]
pub(crate) mod tests;

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use duet_bench::record::{RequestError, RequestRecord};
use duet_router::config::Mode;

use crate::profile::{Link, Profile};
use decode::DecodeSim;
use prefill::PrefillSim;
use router::RouterSim;

/// The cluster and its settings (the same names and defaults as the workers' flags).
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub mode: Mode,
    pub prefill_workers: usize,
    pub decode_workers: usize,
    pub local_prefill_max_tokens: usize,
    pub decode_headroom_tokens: usize,
    pub decode_seq_cost_tokens: u64,
    pub kv_routing: bool,
    pub prefix_cache: bool,
    pub max_batch: usize,
    pub prefill_chunk_tokens: usize,
    pub max_batch_tokens: usize,
    pub admit_watermark_blocks: usize,
    pub max_waiting: usize,
    pub max_queue_wait_s: f64,
    /// Workers sharing one host's cores (1: every worker has its own).
    pub workers_per_host: usize,
    pub link: Link,
}

impl ClusterSpec {
    /// Prefill workers that exist: none in colocated mode, whatever the count says.
    pub fn active_prefill_workers(&self) -> usize {
        match self.mode {
            Mode::Colocated => 0,
            Mode::Disaggregated => self.prefill_workers,
        }
    }
}

/// One request of the workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    pub prompt_len: usize,
    pub output_len: usize,
    /// Chained hashes of the prompt's full blocks ([`cache::block_hashes`]).
    pub hashes: Vec<u64>,
}

/// A unit of work sent at `due_s` (a request, or a conversation's turns in order).
#[derive(Debug, Clone)]
pub struct Unit {
    pub due_s: f64,
    pub turns: Vec<SimRequest>,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// By index, as `duet bench serve` records them.
    pub records: Vec<RequestRecord>,
    /// First send until the last response ended, simulated seconds.
    pub duration_s: f64,
    pub events: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worker {
    Prefill(usize),
    Decode(usize),
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    UnitDue(usize),
    Place(usize),
    WorkDone(Worker, u64),
    KvArrived(usize),
    /// The first waiting request's queue wait ran out: place it or fail it.
    RetryPending,
}

struct Timed {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    // Earliest first in a max-heap; ties in the order they were scheduled.
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

/// A request in flight.
struct Req {
    unit: usize,
    turn: usize,
    index: usize,
    /// The index of the conversation's first request.
    first_index: usize,
    spec: SimRequest,
    scheduled_s: f64,
    sent: f64,
    chunks: Vec<f64>,
    end: Option<f64>,
    error: Option<RequestError>,
    placement: Option<&'static str>,
    cached: usize,
    decode: Option<usize>,
    prefill: Option<usize>,
}

/// Work a worker is doing: seconds left at full speed, and since when.
#[derive(Debug, Clone, Copy)]
struct Work {
    left: f64,
    since: f64,
}

pub struct Sim<'p> {
    profile: &'p Profile,
    spec: ClusterSpec,
    base: Instant,
    now: f64,
    events: BinaryHeap<Timed>,
    seq: u64,
    processed: u64,
    reqs: Vec<Req>,
    /// Units pulled from the schedule so far.
    units: Vec<Unit>,
    unit_reqs: Vec<Vec<usize>>,
    schedule: Box<dyn Iterator<Item = Unit> + 'p>,
    /// The unit that is due but waits for a concurrency slot.
    waits_for_slot: Option<usize>,
    units_in_flight: usize,
    max_concurrency: Option<usize>,
    stop_sending_at: Option<f64>,
    next_index: usize,
    router: RouterSim,
    decode: Vec<DecodeSim>,
    prefill: Vec<PrefillSim>,
    /// Per worker (prefill ones first): its work and the epoch of its completion event;
    /// per host: its busy workers.
    work: Vec<Option<Work>>,
    epoch: Vec<u64>,
    host_busy: Vec<usize>,
}

impl<'p> Sim<'p> {
    pub fn new(profile: &'p Profile, spec: ClusterSpec) -> Sim<'p> {
        let bs = profile.block_size();
        let blocks = profile.file.kv_pool_blocks as usize;
        let prefill_workers = spec.active_prefill_workers();
        let decode = (0..spec.decode_workers)
            .map(|_| DecodeSim::new(blocks, spec.max_waiting, spec.prefix_cache))
            .collect();
        let prefill = (0..prefill_workers)
            .map(|_| PrefillSim::new(blocks, spec.prefix_cache))
            .collect();
        let router = RouterSim::new(&spec, prefill_workers, blocks, bs);
        let n = prefill_workers + spec.decode_workers;
        let hosts = n.div_ceil(spec.workers_per_host.max(1)).max(1);
        Sim {
            profile,
            spec,
            base: Instant::now(),
            now: 0.0,
            events: BinaryHeap::new(),
            seq: 0,
            processed: 0,
            reqs: Vec::new(),
            units: Vec::new(),
            unit_reqs: Vec::new(),
            schedule: Box::new(std::iter::empty()),
            waits_for_slot: None,
            units_in_flight: 0,
            max_concurrency: None,
            stop_sending_at: None,
            next_index: 0,
            router,
            decode,
            prefill,
            work: vec![None; n],
            epoch: vec![0; n],
            host_busy: vec![0; hosts],
        }
    }

    /// Plays `schedule` (units sent at their due times, the next one considered once the
    /// one before is sent, as the load generator does; at most `max_concurrency` at once;
    /// none at or after `duration_s`) to the end.
    pub fn run(
        mut self,
        schedule: impl Iterator<Item = Unit> + 'p,
        max_concurrency: Option<usize>,
        duration_s: Option<f64>,
    ) -> Outcome {
        self.max_concurrency = max_concurrency;
        self.stop_sending_at = duration_s;
        self.schedule = Box::new(schedule);
        self.pull_unit();
        while let Some(Timed { t, ev, .. }) = self.events.pop() {
            self.now = self.now.max(t);
            self.processed += 1;
            match ev {
                Ev::UnitDue(u) => self.unit_due(u),
                Ev::Place(r) => self.place(r),
                Ev::WorkDone(w, epoch) => self.work_done(w, epoch),
                Ev::KvArrived(r) => self.kv_arrived(r),
                Ev::RetryPending => self.retry_pending(),
            }
        }
        self.finish()
    }

    fn at(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.events.push(Timed {
            t,
            seq: self.seq,
            ev,
        });
    }

    fn instant(&self, t: f64) -> Instant {
        self.base + Duration::from_secs_f64(t.max(0.0))
    }

    /// Takes the schedule's next unit and makes it due.
    fn pull_unit(&mut self) {
        if let Some(unit) = self.schedule.next() {
            let u = self.units.len();
            let t = unit.due_s.max(self.now);
            self.units.push(unit);
            self.unit_reqs.push(Vec::new());
            self.at(t, Ev::UnitDue(u));
        }
    }

    fn unit_due(&mut self, u: usize) {
        if self
            .max_concurrency
            .is_some_and(|c| self.units_in_flight >= c)
        {
            self.waits_for_slot = Some(u);
            return;
        }
        self.send_unit(u);
    }

    /// Sends unit `u` (unless sending has stopped) and makes the next one due.
    fn send_unit(&mut self, u: usize) {
        if self.stop_sending_at.is_some_and(|d| self.now >= d) {
            return;
        }
        self.units_in_flight += 1;
        self.send_turn(u, 0);
        self.pull_unit();
    }

    /// Records turn `turn` of unit `u` as a request sent now; its index.
    fn new_request(&mut self, u: usize, turn: usize) -> usize {
        let r = self.reqs.len();
        let first_index = self.first_index(u);
        self.reqs.push(Req {
            unit: u,
            turn,
            index: self.next_index,
            first_index,
            spec: self.units[u].turns[turn].clone(),
            scheduled_s: self.units[u].due_s,
            sent: self.now,
            chunks: Vec::new(),
            end: None,
            error: None,
            placement: None,
            cached: 0,
            decode: None,
            prefill: None,
        });
        self.next_index += 1;
        r
    }

    fn send_turn(&mut self, u: usize, turn: usize) {
        let r = self.new_request(u, turn);
        self.unit_reqs[u].push(r);
        let t = self.now + self.profile.file.router_overhead_s;
        self.at(t, Ev::Place(r));
    }

    /// A request's stream ended (`error`: failed): the next turn or the next unit goes.
    fn end_request(&mut self, r: usize, error: Option<RequestError>) {
        let req = &mut self.reqs[r];
        req.end = Some(self.now);
        req.error = error;
        let (u, turn, failed) = (req.unit, req.turn, req.error.is_some());
        if !failed && turn + 1 < self.units[u].turns.len() {
            self.send_turn(u, turn + 1);
            return;
        }
        if failed {
            // Later turns are recorded as not sent, as the load generator does.
            for t in turn + 1..self.units[u].turns.len() {
                self.send_turn_not_sent(u, t);
            }
        }
        self.units_in_flight -= 1;
        if let Some(next) = self.waits_for_slot.take() {
            self.send_unit(next);
        }
    }

    fn send_turn_not_sent(&mut self, u: usize, turn: usize) {
        let r = self.new_request(u, turn);
        self.reqs[r].end = Some(self.now);
        self.reqs[r].error = Some(RequestError::new(
            "not_sent",
            "an earlier turn of the conversation failed",
        ));
    }

    fn first_index(&self, u: usize) -> usize {
        self.unit_reqs[u]
            .first()
            .map_or(self.next_index, |&r| self.reqs[r].index)
    }

    fn token(&mut self, r: usize) {
        self.reqs[r].chunks.push(self.now);
    }

    // ---- work on hosts (processor sharing) ----

    fn slot(&self, w: Worker) -> usize {
        match w {
            Worker::Prefill(i) => i,
            Worker::Decode(i) => self.prefill.len() + i,
        }
    }

    fn worker_at(&self, slot: usize) -> Worker {
        match slot.checked_sub(self.prefill.len()) {
            None => Worker::Prefill(slot),
            Some(i) => Worker::Decode(i),
        }
    }

    fn host_of(&self, slot: usize) -> usize {
        slot / self.spec.workers_per_host.max(1)
    }

    fn host_slots(&self, host: usize) -> std::ops::Range<usize> {
        let per = self.spec.workers_per_host.max(1);
        host * per..((host + 1) * per).min(self.work.len())
    }

    fn speed(&self, host: usize) -> f64 {
        1.0 / self.host_busy[host].max(1) as f64
    }

    /// Brings every busy worker of `host` up to now at its current speed.
    fn settle(&mut self, host: usize) {
        let speed = self.speed(host);
        for s in self.host_slots(host) {
            if let Some(w) = &mut self.work[s] {
                w.left = (w.left - (self.now - w.since) * speed).max(0.0);
                w.since = self.now;
            }
        }
    }

    /// (Re)schedules the completion of every busy worker of `host`.
    fn reschedule(&mut self, host: usize) {
        let speed = self.speed(host);
        for s in self.host_slots(host) {
            if let Some(w) = self.work[s] {
                self.epoch[s] += 1;
                let ev = Ev::WorkDone(self.worker_at(s), self.epoch[s]);
                self.at(self.now + w.left / speed, ev);
            }
        }
    }

    /// Worker `w` starts `seconds` of work (at full speed).
    fn start_work(&mut self, w: Worker, seconds: f64) {
        let s = self.slot(w);
        let host = self.host_of(s);
        self.settle(host);
        self.work[s] = Some(Work {
            left: seconds,
            since: self.now,
        });
        self.host_busy[host] += 1;
        self.reschedule(host);
    }

    fn work_done(&mut self, w: Worker, epoch: u64) {
        let s = self.slot(w);
        if self.epoch[s] != epoch || self.work[s].is_none() {
            return;
        }
        let host = self.host_of(s);
        self.settle(host);
        self.work[s] = None;
        self.host_busy[host] -= 1;
        self.reschedule(host);
        match w {
            Worker::Decode(d) => self.decode_step_done(d),
            Worker::Prefill(p) => self.prefill_forward_done(p),
        }
    }

    fn busy(&self, w: Worker) -> bool {
        self.work[self.slot(w)].is_some()
    }

    fn finish(self) -> Outcome {
        let mut first = f64::INFINITY;
        let mut last: f64 = 0.0;
        let mut records: Vec<RequestRecord> = self
            .reqs
            .into_iter()
            .map(|r| {
                first = first.min(r.sent);
                last = last.max(r.end.unwrap_or(r.sent));
                record(r, &self.units)
            })
            .collect();
        records.sort_by_key(|r| r.index);
        Outcome {
            duration_s: if first.is_finite() { last - first } else { 0.0 },
            records,
            events: self.processed,
        }
    }
}

/// The record `duet bench serve` would have written for `r`.
fn record(r: Req, units: &[Unit]) -> RequestRecord {
    let ttft_s = r.chunks.first().map(|c| c - r.sent);
    let e2e_s = r.end.map(|e| e - r.sent);
    let output_tokens = r.chunks.len();
    let error = r.error.or_else(|| {
        ttft_s
            .is_none()
            .then(|| RequestError::new("protocol", "no output was streamed"))
    });
    let tpot_s = match (ttft_s, e2e_s) {
        (Some(ttft), Some(e2e)) if output_tokens > 1 && error.is_none() => {
            Some((e2e - ttft).max(0.0) / (output_tokens - 1) as f64)
        }
        _ => None,
    };
    let multi = units[r.unit].turns.len() > 1;
    RequestRecord {
        index: r.index,
        scheduled_s: r.scheduled_s,
        arrival_s: r.sent,
        prompt_tokens: r.spec.prompt_len,
        output_tokens,
        requested_output_tokens: r.spec.output_len,
        ttft_s,
        tpot_s,
        itl_s: r.chunks.windows(2).map(|w| w[1] - w[0]).collect(),
        e2e_s,
        placement: r.placement.map(str::to_string),
        cached_tokens: Some(r.cached),
        conversation: multi.then_some(r.first_index),
        turn: multi.then_some(r.turn),
        error,
    }
}
