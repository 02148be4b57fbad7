//! Where a request runs: [`decide`], a pure function of the cluster as the router sees it
//! ([`RouterView`]), the request ([`Request`]) and the routing [`Policy`]. No I/O, no clock,
//! no channels: the relay calls it before each attempt, and the planner's simulator calls
//! the same function over simulated records.
//!
//! The rules, in order:
//! 1. **Decode workers** with the served model, not draining, with free KV blocks for the
//!    prompt plus `decode_headroom_tokens` (never more than their pool), cheapest first:
//!    `load x decode_seq_cost_tokens + prompt tokens they would prefill themselves` (load:
//!    the larger of the record's running + waiting and this router's own in-flight count;
//!    with KV-aware routing a prefix the worker caches is not counted). Workers that
//!    recently failed to answer (suspects) go last. None: [`Decision::Wait`].
//! 2. **Kind.** Colocated mode: always colocated. Disaggregated mode (conditional
//!    disaggregation): local when what the first decode worker would compute (prompt minus
//!    its cached prefix) is at most `local_prefill_max_tokens`, else remote. A migrated
//!    stream is never prefilled remotely (its sent tokens are replayed one per step on the
//!    decode worker so that the greedy continuation is exact).
//! 3. **Prefill workers** for a remote prefill, per decode worker: same model and model
//!    fingerprint, not draining, cheapest first (queued prefill tokens, or this router's
//!    own count if larger, plus the prompt tokens not cached there), without pairs whose
//!    KV link failed recently, suspects last. No prefill worker with the model: local. Every
//!    pair's link failed: local. Otherwise decode workers some prefill worker reaches come
//!    first, and those no prefill worker reaches are dropped.
//!
//! Invariants: every [`Candidate`] of a remote placement names a prefill worker whose
//! fingerprint equals its decode worker's; no other placement names one; a placement lists
//! at most [`MAX_CANDIDATES`], the first ones of the order above; the reason string says
//! which rule decided. Placement is linear in the number of workers (plus one sort of
//! each role), so that a router, and the planner's simulator, place quickly in clusters of
//! thousands of workers.

mod candidates;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};

use duet_discovery::{Role, Snapshot, WorkerRecord};
use duet_proto::v1 as pb;

pub use candidates::{decode_candidates, prefill_candidates};

use crate::config::{Mode, RouterConfig};

/// The most pairs one placement lists (the relay tries them in order within one attempt):
/// the cheapest ones. Workers refuse only when the records lagged (no room any more), so an
/// attempt whose first 16 all refuse is retried with fresh records (`--max-attempts`);
/// listing every worker of a large cluster would copy every record for every request.
pub const MAX_CANDIDATES: usize = 16;

/// Requests this router placed on a worker that are still running, by worker id.
pub type InFlight = HashMap<String, u32>;

/// Prompt tokens a worker's prefix cache holds, as the router believes.
pub trait CachedTokens {
    fn cached_tokens(&self, w: &WorkerRecord) -> usize;
}

/// No prefix is known anywhere (KV-aware routing off).
pub struct NoCache;

impl CachedTokens for NoCache {
    fn cached_tokens(&self, _: &WorkerRecord) -> usize {
        0
    }
}

impl<F: Fn(&WorkerRecord) -> usize> CachedTokens for F {
    fn cached_tokens(&self, w: &WorkerRecord) -> usize {
        self(w)
    }
}

/// The routing settings placement reads (a part of [`RouterConfig`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub mode: Mode,
    /// Served model name: workers serving another are never chosen.
    pub model: String,
    /// Prompts that leave at most this many tokens to compute are prefilled on the decode
    /// worker (0: never).
    pub local_prefill_max_tokens: usize,
    /// Generated tokens counted when checking a decode worker's free blocks.
    pub decode_headroom_tokens: usize,
    /// What one running or waiting sequence weighs in a decode worker's cost, in tokens.
    pub decode_seq_cost_tokens: u64,
}

impl Policy {
    /// The placement settings of `cfg`.
    pub fn of(cfg: &RouterConfig) -> Policy {
        Policy {
            mode: cfg.mode,
            model: cfg.model_name.clone(),
            local_prefill_max_tokens: cfg.local_prefill_max_tokens,
            decode_headroom_tokens: cfg.decode_headroom_tokens,
            decode_seq_cost_tokens: cfg.decode_seq_cost_tokens,
        }
    }
}

/// What this router knows beyond the registry: its own placements still running and the
/// failures it saw (both expire outside this module; here they are plain sets).
#[derive(Debug, Clone, Default)]
pub struct RouterLoad {
    /// Requests in flight per decode worker id.
    pub decode_inflight: InFlight,
    /// Prompt tokens in flight per prefill worker id.
    pub prefill_tokens: HashMap<String, u64>,
    /// Worker ids that recently failed to answer: placed last.
    pub suspects: HashSet<String>,
    /// (prefill id, decode id) pairs whose KV link recently failed: not used.
    pub bad_links: HashSet<(String, String)>,
}

/// The cluster as placement sees it.
pub struct RouterView<'a> {
    /// The registry's workers and their published capacity.
    pub snapshot: &'a Snapshot,
    pub load: &'a RouterLoad,
    /// The prefix of this request's prompt each worker caches ([`NoCache`]: load only).
    pub cached: &'a dyn CachedTokens,
}

/// The request, as far as placement cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Prompt tokens, including tokens already sent by a migrated stream.
    pub prompt_tokens: usize,
    /// Tokens already sent to the client (a migrated stream; 0 otherwise).
    pub resumed_tokens: usize,
}

/// Where the prompt is prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// On the decode worker, before it decodes (conditional disaggregation).
    Local,
    /// On a prefill worker, KV moved to the decode worker.
    Remote,
    /// On the one worker of colocated mode, in chunks mixed into its decode steps.
    Colocated,
}

impl Kind {
    /// The bounded metric label.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Local => "local",
            Kind::Remote => "remote",
            Kind::Colocated => "colocated",
        }
    }

    pub fn to_proto(self) -> pb::PrefillPlacement {
        match self {
            Kind::Local => pb::PrefillPlacement::Local,
            Kind::Remote => pb::PrefillPlacement::Remote,
            Kind::Colocated => pb::PrefillPlacement::Colocated,
        }
    }
}

/// One decode worker to try, with the prefill worker it would use.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub decode: WorkerRecord,
    /// The prefill worker (remote placements only).
    pub prefill: Option<WorkerRecord>,
    /// Prompt tokens the worker that prefills holds in its cache, as the router believes
    /// (the prefill worker's for a remote placement, else the decode worker's).
    pub cached_tokens: usize,
}

/// A placement: its kind, why, and the pairs to try in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub kind: Kind,
    /// Which rule decided (shown to clients in the final message's timings).
    pub reason: String,
    /// Never empty.
    pub candidates: Vec<Candidate>,
}

/// What [`decide`] concludes.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Place(Placement),
    /// No decode worker has room now. `largest_pool_tokens`: the largest KV pool (in
    /// tokens) of a decode worker with the model, `None` when no such worker is known; a
    /// prompt longer than it can never be placed.
    Wait {
        largest_pool_tokens: Option<u64>,
    },
}

/// Whether a prompt of `prompt_tokens` tokens can never be placed where the largest decode
/// pool holds `largest_pool_tokens` ([`Decision::Wait`]): a sequence needs room for its
/// prompt and its first generated token. The router fails such a request at once, and the
/// planner's simulator with it (one rule: a prompt of exactly a pool's size would otherwise
/// wait out the queue and hold up every request behind it).
pub fn never_fits(prompt_tokens: usize, largest_pool_tokens: u64) -> bool {
    prompt_tokens as u64 + 1 > largest_pool_tokens
}

/// Places `req` on `view` by `policy` (the rules are in this module's docs).
pub fn decide(view: &RouterView<'_>, req: &Request, policy: &Policy) -> Decision {
    let snap = view.snapshot;
    let load = view.load;
    let prompt_len = req.prompt_tokens;
    let mut decoders: Vec<&WorkerRecord> = decode_candidates(
        snap,
        &policy.model,
        prompt_len,
        policy.decode_headroom_tokens,
        &load.decode_inflight,
        view.cached,
        policy.decode_seq_cost_tokens,
    );
    if decoders.is_empty() {
        let largest_pool_tokens = snap
            .workers(Role::Decode)
            .filter(|w| w.model == policy.model)
            .map(|w| w.capacity.tokens_in_blocks(w.capacity.kv_blocks_total))
            .max();
        return Decision::Wait {
            largest_pool_tokens,
        };
    }
    // Workers that just failed to answer go last (a dead one stays registered until its
    // lease expires; a hung one forever). The sort is stable: cost order otherwise.
    if !load.suspects.is_empty() {
        decoders.sort_by_key(|d| load.suspects.contains(&d.id));
    }
    let local_cached = view.cached.cached_tokens(decoders[0]).min(prompt_len);
    let to_compute = prompt_len - local_cached;
    let limit = policy.local_prefill_max_tokens;
    let (mut kind, mut reason) = match policy.mode {
        Mode::Colocated => (Kind::Colocated, "colocated mode".to_string()),
        Mode::Disaggregated if to_compute <= limit && local_cached > 0 => (
            Kind::Local,
            format!(
                "prompt of {prompt_len} tokens, {local_cached} cached on the decode worker: \
                 {to_compute} to prefill <= local prefill limit {limit}"
            ),
        ),
        Mode::Disaggregated if to_compute <= limit => (
            Kind::Local,
            format!("prompt of {prompt_len} tokens <= local prefill limit {limit}"),
        ),
        Mode::Disaggregated => (
            Kind::Remote,
            format!("prompt of {prompt_len} tokens prefilled remotely"),
        ),
    };
    if req.resumed_tokens > 0 && kind == Kind::Remote {
        kind = Kind::Local;
        reason = format!(
            "migrated stream: {} sent tokens replayed on the decode worker",
            req.resumed_tokens
        );
    }
    let local = |d: &WorkerRecord| Candidate {
        decode: d.clone(),
        prefill: None,
        cached_tokens: view.cached.cached_tokens(d),
    };
    if kind != Kind::Remote {
        let candidates = decoders.into_iter().take(MAX_CANDIDATES).map(local);
        return place(kind, reason, candidates.collect());
    }
    // For each decode worker, its first usable prefill worker: same fingerprint, cheapest,
    // not over a link that failed recently, suspects last. The ranking depends on the
    // fingerprint only, so it is made once per fingerprint, not once per decode worker
    // (placement stays linear in the number of workers).
    let mut ranked: HashMap<&str, Vec<&WorkerRecord>> = HashMap::new();
    for d in &decoders {
        ranked.entry(d.fingerprint.as_str()).or_insert_with(|| {
            let mut v = prefill_candidates(
                snap,
                &policy.model,
                &d.fingerprint,
                prompt_len,
                &load.prefill_tokens,
                view.cached,
            );
            if !load.suspects.is_empty() {
                v.sort_by_key(|p| load.suspects.contains(&p.id));
            }
            v
        });
    }
    let prefill_for = |d: &WorkerRecord| -> Option<&WorkerRecord> {
        let v = ranked.get(d.fingerprint.as_str())?;
        v.iter()
            .find(|p| {
                load.bad_links.is_empty() || !load.bad_links.contains(&(p.id.clone(), d.id.clone()))
            })
            .copied()
    };
    let pairs: Vec<Candidate> = decoders
        .iter()
        .filter_map(|d| {
            let p = prefill_for(d)?;
            Some(Candidate {
                decode: (*d).clone(),
                cached_tokens: view.cached.cached_tokens(p),
                prefill: Some(p.clone()),
            })
        })
        .take(MAX_CANDIDATES)
        .collect();
    if !pairs.is_empty() {
        return place(Kind::Remote, reason, pairs);
    }
    // No pair: say why, and prefill on the decode workers.
    let any_prefill = decoders.iter().any(|d| {
        let none = HashMap::new();
        !prefill_candidates(snap, &policy.model, &d.fingerprint, 0, &none, &NoCache).is_empty()
    });
    let reason = if any_prefill {
        "the KV links from the prefill workers to the decode workers failed recently: \
         prefilled locally"
    } else {
        "no prefill worker with the decode worker's model: prefilled locally"
    };
    place(
        Kind::Local,
        reason.into(),
        decoders
            .into_iter()
            .take(MAX_CANDIDATES)
            .map(local)
            .collect(),
    )
}

fn place(kind: Kind, reason: String, candidates: Vec<Candidate>) -> Decision {
    Decision::Place(Placement {
        kind,
        reason,
        candidates,
    })
}
