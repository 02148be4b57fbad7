//! `duet plan`: the cheapest layout that serves a target rate within an SLO.
//!
//! Method (DistServe's, with duet's simulator): a *unit* is a small layout (P prefill and
//! D decode workers with a local-prefill threshold, or one colocated worker); its goodput
//! is the highest offered rate at which the simulated unit still meets the SLO for at least
//! the attainment target (found by doubling, then bisection, each point one simulation of
//! the workload); a cluster is that unit replicated until the units' goodputs add up to the
//! target rate. Devices = units × workers per unit × devices per worker (the profile's
//! `threads`: cores on a CPU profile, 1 for a GPU profile). The cheapest layout is the one
//! with the fewest devices (then the highest goodput per device); the best colocated layout
//! is reported beside it.
//!
//! Replication assumes the router spreads load evenly over identical units; a larger pool
//! of workers only multiplexes better, so the device count is an upper bound on what the
//! router needs. The search is over units, so it answers in the same time for 8 or 4,096
//! devices.

use std::sync::Arc;

use duet_bench::corpus::Corpus;
use duet_bench::ServeConfig;
use duet_router::config::Mode;
use serde::Serialize;

use crate::error::{PlanError, Result};
use crate::profile::Profile;
use crate::sim::ClusterSpec;
use crate::simulate::simulate;

/// What to search.
#[derive(Debug, Clone)]
pub struct SearchSpec {
    /// Scheduling settings every layout keeps (workers, mode and threshold are set here).
    pub base: ClusterSpec,
    pub max_prefill: usize,
    pub max_decode: usize,
    /// Local-prefill thresholds tried for disaggregated units.
    pub thresholds: Vec<usize>,
    /// Requests per second the cluster must serve.
    pub target_rate: f64,
    /// Most devices the cluster may use.
    pub devices: usize,
}

/// One evaluated layout.
#[derive(Debug, Clone, Serialize)]
pub struct Layout {
    #[serde(serialize_with = "mode_label")]
    pub mode: Mode,
    pub prefill: usize,
    pub decode: usize,
    pub local_prefill_max_tokens: usize,
    /// Highest rate one unit serves within the SLO (0: not even the lowest tried).
    pub unit_goodput_rps: f64,
    pub devices_per_unit: usize,
    /// Units for the target rate (None: the unit serves nothing within the SLO).
    pub units: Option<usize>,
    pub devices: Option<usize>,
    pub goodput_per_device: f64,
}

/// The answer.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub target_rate: f64,
    pub device_budget: usize,
    /// The cheapest layout meeting the target within the budget.
    pub best: Option<Layout>,
    /// The cheapest colocated one (within the budget or not).
    pub best_colocated: Option<Layout>,
    /// When nothing fits the budget: the layout serving the most within it.
    pub closest: Option<Layout>,
    /// `best` (or the best disaggregated layout) goodput per device over colocated's.
    pub disaggregation_gain: Option<f64>,
    pub layouts: Vec<Layout>,
    pub simulations: usize,
}

struct Searcher<'a> {
    cfg: &'a ServeConfig,
    corpus: Arc<Corpus>,
    simulations: usize,
}

impl Searcher<'_> {
    /// Whether `cluster` meets the SLO at `rate` (attainment at least the target).
    fn meets(&mut self, profile: &Profile, cluster: &ClusterSpec, rate: f64) -> Result<bool> {
        let mut cfg = self.cfg.clone();
        cfg.rates = vec![Some(rate)];
        self.simulations += 1;
        let (report, _) = simulate(profile, cluster, &cfg, self.corpus.clone())?;
        let att = report
            .runs
            .first()
            .and_then(|r| r.summary.slo.as_ref())
            .and_then(|s| s.attainment)
            .unwrap_or(0.0);
        Ok(att >= cfg.attainment_target)
    }

    /// The unit's goodput: doubling from a rate it surely meets, then bisection.
    fn goodput(&mut self, profile: &Profile, cluster: &ClusterSpec) -> Result<f64> {
        let mean_in = self.cfg.length_params.input_len;
        let mean_out = self.cfg.length_params.output_len;
        // One request alone takes about this long; a unit serves at least a fraction of
        // 1/that per worker below saturation.
        let alone = profile.prefill_s(mean_in.max(1), 0.0)
            + mean_out as f64 * profile.step_s(1, mean_in as f64, &[]);
        let workers = (cluster.prefill_workers + cluster.decode_workers).max(1) as f64;
        let mut lo = 0.0;
        let mut hi = 0.25 * workers / alone.max(1e-6);
        let mut doublings = 0;
        while self.meets(profile, cluster, hi)? {
            lo = hi;
            hi *= 2.0;
            doublings += 1;
            if doublings > 16 {
                return Ok(lo);
            }
        }
        if lo == 0.0 {
            // Not met at the first rate: look lower, a factor of 4 at a time.
            let mut r = hi / 4.0;
            for _ in 0..4 {
                if self.meets(profile, cluster, r)? {
                    lo = r;
                    break;
                }
                hi = r;
                r /= 4.0;
            }
            if lo == 0.0 {
                return Ok(0.0);
            }
        }
        for _ in 0..6 {
            let mid = (lo + hi) / 2.0;
            if self.meets(profile, cluster, mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(lo)
    }
}

fn layout(
    mode: Mode,
    p: usize,
    d: usize,
    threshold: usize,
    goodput: f64,
    devices_per_worker: usize,
    target: f64,
) -> Layout {
    let devices_per_unit = (p + d) * devices_per_worker;
    let units = (goodput > 0.0).then(|| ((target / goodput).ceil() as usize).max(1));
    Layout {
        mode,
        prefill: p,
        decode: d,
        local_prefill_max_tokens: threshold,
        unit_goodput_rps: goodput,
        devices_per_unit,
        units,
        devices: units.map(|u| u * devices_per_unit),
        goodput_per_device: goodput / devices_per_unit as f64,
    }
}

fn mode_label<S: serde::Serializer>(m: &Mode, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(m.label())
}

/// Cheapest first: fewest devices, then highest goodput per device.
fn cheaper(a: &Layout, b: &Layout) -> std::cmp::Ordering {
    a.devices
        .unwrap_or(usize::MAX)
        .cmp(&b.devices.unwrap_or(usize::MAX))
        .then(b.goodput_per_device.total_cmp(&a.goodput_per_device))
}

/// Searches disaggregated units on `profile` and colocated ones on `colocated` (the same
/// profile unless a colocated worker runs with other settings, e.g. more threads).
pub fn search(
    profile: &Profile,
    colocated: &Profile,
    spec: &SearchSpec,
    cfg: &ServeConfig,
    corpus: Arc<Corpus>,
) -> Result<Plan> {
    if !(spec.target_rate.is_finite() && spec.target_rate > 0.0) {
        return Err(PlanError::setting(
            "--request-rate",
            "a target rate > 0 is needed",
        ));
    }
    if cfg.slo.is_none() {
        return Err(PlanError::setting("--slo", "a plan needs an SLO"));
    }
    let mut s = Searcher {
        cfg,
        corpus,
        simulations: 0,
    };
    let mut layouts = Vec::new();
    let unit = |mode, p, d, t| ClusterSpec {
        mode,
        prefill_workers: p,
        decode_workers: d,
        local_prefill_max_tokens: t,
        ..spec.base.clone()
    };
    let colo = unit(Mode::Colocated, 0, 1, 0);
    let g = s.goodput(colocated, &colo)?;
    layouts.push(layout(
        Mode::Colocated,
        0,
        1,
        0,
        g,
        colocated.file.threads,
        spec.target_rate,
    ));
    for p in 1..=spec.max_prefill {
        for d in 1..=spec.max_decode {
            for &t in &spec.thresholds {
                let c = unit(Mode::Disaggregated, p, d, t);
                let g = s.goodput(profile, &c)?;
                layouts.push(layout(
                    Mode::Disaggregated,
                    p,
                    d,
                    t,
                    g,
                    profile.file.threads,
                    spec.target_rate,
                ));
            }
        }
    }
    layouts.sort_by(cheaper);
    let fits = |l: &&Layout| l.devices.is_some_and(|d| d <= spec.devices);
    let best = layouts.iter().find(fits).cloned();
    let best_colocated = layouts.iter().find(|l| l.mode == Mode::Colocated).cloned();
    let closest = match best {
        Some(_) => None,
        // What the budget serves at most: whole units that fit, times their goodput.
        None => layouts
            .iter()
            .filter(|l| l.devices_per_unit <= spec.devices && l.unit_goodput_rps > 0.0)
            .max_by(|a, b| {
                let serves =
                    |l: &Layout| (spec.devices / l.devices_per_unit) as f64 * l.unit_goodput_rps;
                serves(a).total_cmp(&serves(b))
            })
            .cloned(),
    };
    let best_disagg = layouts
        .iter()
        .filter(|l| l.mode == Mode::Disaggregated)
        .max_by(|a, b| a.goodput_per_device.total_cmp(&b.goodput_per_device));
    let disaggregation_gain = match (best_disagg, &best_colocated) {
        (Some(d), Some(c)) if c.goodput_per_device > 0.0 => {
            Some(d.goodput_per_device / c.goodput_per_device)
        }
        _ => None,
    };
    Ok(Plan {
        target_rate: spec.target_rate,
        device_budget: spec.devices,
        best,
        best_colocated,
        closest,
        disaggregation_gain,
        layouts,
        simulations: s.simulations,
    })
}
