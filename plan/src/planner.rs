//! The live planner's decisions as a plain state machine: [`Planner::evaluate`] takes what
//! the registry shows ([`Observation`]: the workers and their roles, the requests the
//! routers finished recently) and says whether to move one switchable worker to the other
//! role. `duet planner` does the I/O around it (reading the registry, writing role
//! requests, metrics); tests drive it directly.
//!
//! How a layout is judged: the routers' recent requests are replayed at their own arrival
//! times, as a trace, on the profile through the same [`Sim`] `duet plan simulate` runs
//! (the live placement and scheduling code), for the current layout and for the layouts one
//! switch away. A layout's score is its predicted attainment at the observed load and its
//! headroom: the largest factor the arrival rate could grow by (times compressed) with
//! attainment still at the target.
//!
//! When it switches (hysteresis): only to a better layout (the current one misses the
//! target and the other meets it, or both meet it and the other has `margin` more
//! headroom); only after `confirm` evaluations in a row chose the same layout; never within
//! `dwell` of the last switch; one worker at a time: while a switch is under way (the
//! worker has not registered under its new role, at most `switch_timeout`), nothing else
//! is decided. The worker moved is the least loaded switchable one of the shrinking role.

use std::time::Duration;

use duet_bench::record::RequestRecord;
use duet_bench::Slo;
use duet_discovery::control::ObservedRequest;
use duet_discovery::Role;

use crate::profile::Profile;
use crate::sim::{ClusterSpec, Sim, SimRequest, Unit};

/// The planner's settings.
#[derive(Debug, Clone)]
pub struct PlannerConfig {
    pub slo: Slo,
    /// Attainment a layout must reach (0..=1).
    pub target: f64,
    /// Extra headroom (fraction) a layout must offer over the current one when both meet
    /// the target.
    pub margin: f64,
    /// Consecutive evaluations that must choose the same layout before a switch.
    pub confirm: u32,
    /// Least time between two switches.
    pub dwell: Duration,
    /// Fewer finished requests in the window: no decision.
    pub min_requests: usize,
    /// Largest rate factor the headroom search tries.
    pub max_speedup: f64,
    /// Fewest workers each role keeps.
    pub min_prefill: usize,
    pub min_decode: usize,
    /// A switch whose worker has not registered under its new role by then is given up.
    pub switch_timeout: Duration,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            slo: Slo::default(),
            target: 0.9,
            margin: 0.25,
            confirm: 2,
            dwell: Duration::from_secs(60),
            min_requests: 10,
            max_speedup: 16.0,
            min_prefill: 1,
            min_decode: 1,
            switch_timeout: Duration::from_secs(120),
        }
    }
}

/// A worker as the registry shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub id: String,
    pub role: Role,
    pub switchable: bool,
    pub draining: bool,
    /// Work it holds (running + waiting sequences, or queued prompt tokens): the least
    /// loaded is moved.
    pub load: f64,
}

/// What one evaluation sees.
#[derive(Debug, Clone, Default)]
pub struct Observation {
    /// Seconds on a monotonic clock.
    pub now_s: f64,
    pub workers: Vec<WorkerView>,
    /// The routers' recent requests (any order), over a stretch of time every router's
    /// sample covers in full (the arrival times carry the rate).
    pub requests: Vec<ObservedRequest>,
}

/// A layout's prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutScore {
    pub prefill: usize,
    pub decode: usize,
    /// Predicted attainment at the observed load.
    pub attainment: f64,
    /// Largest rate factor (1..=max_speedup) with attainment at the target; 0 when the
    /// observed load already misses it.
    pub headroom: f64,
}

impl LayoutScore {
    fn meets(&self, target: f64) -> bool {
        self.attainment >= target
    }

    /// Orders layouts: meeting the target first, then headroom, then attainment.
    fn key(&self, target: f64) -> (bool, f64, f64) {
        (self.meets(target), self.headroom, self.attainment)
    }
}

/// What an evaluation concluded.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Too few requests to judge.
    NoData,
    /// The current layout stays.
    Keep,
    /// A better layout exists but a rule holds the switch back (the reason, in words).
    Wait(String),
    /// Move `worker` from `from` to `to`.
    Switch {
        worker: String,
        from: Role,
        to: Role,
    },
}

impl Decision {
    /// The bounded metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Decision::NoData => "no_data",
            Decision::Keep => "keep",
            Decision::Wait(_) => "wait",
            Decision::Switch { .. } => "switch",
        }
    }
}

/// One evaluation's result.
#[derive(Debug, Clone)]
pub struct Evaluation {
    pub decision: Decision,
    /// Attainment of the window's requests as the clients saw them.
    pub observed_attainment: Option<f64>,
    /// The current layout first, then the candidates.
    pub layouts: Vec<LayoutScore>,
}

#[derive(Debug, Clone)]
struct InFlight {
    worker: String,
    to: Role,
    since_s: f64,
}

/// The planner's state between evaluations.
pub struct Planner<'p> {
    profile: &'p Profile,
    /// The cluster's settings; its worker counts are replaced per layout.
    spec: ClusterSpec,
    cfg: PlannerConfig,
    last_switch_s: Option<f64>,
    /// The layout (prefill workers) recent evaluations chose, and how many in a row.
    streak: Option<(usize, u32)>,
    in_flight: Option<InFlight>,
}

impl<'p> Planner<'p> {
    pub fn new(profile: &'p Profile, spec: ClusterSpec, cfg: PlannerConfig) -> Self {
        Planner {
            profile,
            spec,
            cfg,
            last_switch_s: None,
            streak: None,
            in_flight: None,
        }
    }

    /// Judges the current layout against its neighbours and decides.
    pub fn evaluate(&mut self, obs: &Observation) -> Evaluation {
        let observed_attainment = observed_attainment(&self.cfg.slo, &obs.requests);
        let serving: Vec<&WorkerView> = obs.workers.iter().filter(|w| !w.draining).collect();
        let count = |r: Role| serving.iter().filter(|w| w.role == r).count();
        let (p, d) = (count(Role::Prefill), count(Role::Decode));
        let mut eval = Evaluation {
            decision: Decision::NoData,
            observed_attainment,
            layouts: Vec::new(),
        };
        if let Some(f) = &self.in_flight {
            let done = serving.iter().any(|w| w.id == f.worker && w.role == f.to);
            let late = obs.now_s - f.since_s > self.cfg.switch_timeout.as_secs_f64();
            if !done && !late {
                eval.decision = Decision::Wait(format!("{} is switching to {}", f.worker, f.to));
                return eval;
            }
            self.in_flight = None;
        }
        if obs.requests.len() < self.cfg.min_requests || d == 0 {
            self.streak = None;
            return eval;
        }
        let units = replay(&obs.requests);
        let mut candidates = vec![(p, d)];
        let movable = |r: Role| serving.iter().any(|w| w.role == r && w.switchable);
        if d > self.cfg.min_decode && movable(Role::Decode) {
            candidates.push((p + 1, d - 1));
        }
        if p > self.cfg.min_prefill && movable(Role::Prefill) {
            candidates.push((p - 1, d + 1));
        }
        eval.layouts = candidates
            .iter()
            .map(|&(p, d)| self.score(p, d, &units))
            .collect();
        let current = &eval.layouts[0];
        let target = self.cfg.target;
        let best = eval
            .layouts
            .iter()
            .skip(1)
            .filter(|s| better(s, current, target, self.cfg.margin))
            .max_by(|a, b| {
                a.key(target)
                    .partial_cmp(&b.key(target))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        let Some(best) = best.cloned() else {
            self.streak = None;
            eval.decision = Decision::Keep;
            return eval;
        };
        let streak = match self.streak {
            Some((layout, n)) if layout == best.prefill => n + 1,
            _ => 1,
        };
        self.streak = Some((best.prefill, streak));
        if streak < self.cfg.confirm {
            eval.decision = Decision::Wait(format!(
                "{}P+{}D chosen {streak} of {} times in a row",
                best.prefill, best.decode, self.cfg.confirm
            ));
            return eval;
        }
        if let Some(last) = self.last_switch_s {
            let left = self.cfg.dwell.as_secs_f64() - (obs.now_s - last);
            if left > 0.0 {
                eval.decision = Decision::Wait(format!("dwell: {left:.0} s left"));
                return eval;
            }
        }
        let (from, to) = if best.prefill > p {
            (Role::Decode, Role::Prefill)
        } else {
            (Role::Prefill, Role::Decode)
        };
        let Some(worker) = serving
            .iter()
            .filter(|w| w.role == from && w.switchable)
            .min_by(|a, b| a.load.total_cmp(&b.load).then_with(|| a.id.cmp(&b.id)))
        else {
            eval.decision = Decision::Keep;
            return eval;
        };
        self.last_switch_s = Some(obs.now_s);
        self.streak = None;
        self.in_flight = Some(InFlight {
            worker: worker.id.clone(),
            to,
            since_s: obs.now_s,
        });
        eval.decision = Decision::Switch {
            worker: worker.id.clone(),
            from,
            to,
        };
        eval
    }

    /// Predicted attainment of `p`P+`d`D at the observed load, and its headroom.
    fn score(&self, p: usize, d: usize, units: &[Unit]) -> LayoutScore {
        let attainment = |speedup: f64| self.attainment(p, d, units, speedup);
        let at_one = attainment(1.0);
        let target = self.cfg.target;
        let mut headroom = 0.0;
        if at_one >= target {
            // Doubling, then bisection between the last factor that met and the first
            // that did not.
            let (mut lo, mut hi) = (1.0, None);
            let mut k: f64 = 2.0;
            while k <= self.cfg.max_speedup {
                if attainment(k) >= target {
                    lo = k;
                    k *= 2.0;
                } else {
                    hi = Some(k);
                    break;
                }
            }
            if let Some(mut hi) = hi {
                for _ in 0..4 {
                    let mid = (lo + hi) / 2.0;
                    if attainment(mid) >= target {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
            }
            headroom = lo;
        }
        LayoutScore {
            prefill: p,
            decode: d,
            attainment: at_one,
            headroom,
        }
    }

    fn attainment(&self, p: usize, d: usize, units: &[Unit], speedup: f64) -> f64 {
        let spec = ClusterSpec {
            prefill_workers: p,
            decode_workers: d,
            ..self.spec.clone()
        };
        let out = Sim::new(self.profile, spec).run(at_rate(units, speedup).into_iter(), None, None);
        let records: &[RequestRecord] = &out.records;
        self.cfg.slo.attainment(records).1.unwrap_or(0.0)
    }
}

/// `a` is worth switching to from `current`.
fn better(a: &LayoutScore, current: &LayoutScore, target: f64, margin: f64) -> bool {
    match (a.meets(target), current.meets(target)) {
        (true, false) => true,
        (true, true) => a.headroom >= current.headroom * (1.0 + margin),
        _ => false,
    }
}

/// The observed requests as a trace: arrivals relative to the first, at their own times.
pub fn replay(requests: &[ObservedRequest]) -> Vec<Unit> {
    let mut sorted: Vec<&ObservedRequest> = requests.iter().collect();
    sorted.sort_by_key(|r| r.arrival_ms);
    let first = sorted.first().map_or(0, |r| r.arrival_ms);
    sorted
        .iter()
        .map(|r| Unit {
            due_s: (r.arrival_ms - first) as f64 / 1e3,
            turns: vec![SimRequest {
                prompt_len: (r.prompt_tokens as usize).max(1),
                output_len: (r.output_tokens as usize).max(1),
                hashes: Vec::new(),
            }],
        })
        .collect()
}

/// `units` at `k` times their rate over the same span: the trace repeated `ceil(k)` times
/// end to end, then compressed by `k` and cut at the original span. Compressing alone
/// would not do: a few requests squeezed together are a burst, not a sustained rate.
pub fn at_rate(units: &[Unit], k: f64) -> Vec<Unit> {
    let span = units.last().map_or(0.0, |u| u.due_s);
    if k <= 1.0 || span <= 0.0 {
        return units.to_vec();
    }
    // One mean gap after the last arrival before the next copy (span > 0: n >= 2).
    let n = units.len() as f64;
    let period = span * n / (n - 1.0);
    let copies = k.ceil() as usize;
    let mut out: Vec<Unit> = (0..copies)
        .flat_map(|c| {
            units.iter().map(move |u| Unit {
                due_s: (c as f64 * period + u.due_s) / k,
                turns: u.turns.clone(),
            })
        })
        .filter(|u| u.due_s <= span)
        .collect();
    out.sort_by(|a, b| a.due_s.total_cmp(&b.due_s));
    out
}

/// The share of `requests` that ended with their tokens within the SLO.
pub fn observed_attainment(slo: &Slo, requests: &[ObservedRequest]) -> Option<f64> {
    if requests.is_empty() {
        return None;
    }
    let met = requests
        .iter()
        .filter(|r| {
            let e2e = r.ttft_ms.map(|t| {
                t + r.tpot_ms.unwrap_or(0.0) * f64::from(r.output_tokens.saturating_sub(1))
            });
            slo.met(r.ok, r.ttft_ms, r.tpot_ms, e2e)
        })
        .count();
    Some(met as f64 / requests.len() as f64)
}

#[cfg(test)]
#[path = "planner_tests.rs"]
mod tests;
