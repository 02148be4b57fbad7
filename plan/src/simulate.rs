//! `duet plan simulate`: the workload of `duet bench serve` (same configuration, same seed,
//! same [`Schedule`]) played through the [`Sim`]ulator, one run per offered rate, written as
//! a `duet bench serve` report (`backend: "simulated"`) so that `duet bench plot` overlays
//! simulated and measured runs.
//!
//! Not simulated: the warm-up requests (`--warmup`; caches start cold), request timeouts
//! and faults.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use duet_bench::arrival::Arrival;
use duet_bench::corpus::Corpus;
use duet_bench::report::{Report, RunReport, Summary, SweepSummary, SCHEMA};
use duet_bench::schedule::Schedule;
use duet_bench::ServeConfig;
use serde::Serialize;

use crate::error::Result;
use crate::profile::Profile;
use crate::sim::cache::block_hashes;
use crate::sim::{ClusterSpec, Sim, SimRequest, Unit};

/// How fast a simulation ran.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Speed {
    pub simulated_s: f64,
    pub wall_s: f64,
    pub events: u64,
    pub requests: usize,
}

impl Speed {
    /// Simulated seconds per wall-clock second.
    pub fn ratio(&self) -> f64 {
        self.simulated_s / self.wall_s.max(1e-9)
    }
}

/// The schedule of one run as simulator units.
pub fn units(schedule: Schedule, block_size: usize) -> impl Iterator<Item = Unit> {
    schedule.map(move |(due_s, turns)| Unit {
        due_s,
        turns: turns
            .into_iter()
            .map(|spec| SimRequest {
                prompt_len: spec.prompt_ids.len(),
                output_len: spec.output_len,
                hashes: block_hashes(&spec.prompt_ids, block_size),
            })
            .collect(),
    })
}

/// Simulates every rate of `cfg` on `cluster`; `corpus`: what prompts are cut from (the
/// tokenized text `duet bench serve` would use).
pub fn simulate(
    profile: &Profile,
    cluster: &ClusterSpec,
    cfg: &ServeConfig,
    corpus: Arc<Corpus>,
) -> Result<(Report, Speed)> {
    cfg.validate()?;
    let started_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut speed = Speed::default();
    let mut runs = Vec::new();
    for rate in &cfg.rates {
        let arrival = Arrival::new(*rate, cfg.burstiness)?;
        let offered = arrival.rate();
        let workload = cfg.workload(corpus.clone(), cfg.seed, None);
        let schedule = Schedule::new(workload, arrival, cfg.seed, cfg.num_prompts, cfg.duration);
        let t = Instant::now();
        let out = Sim::new(profile, cluster.clone()).run(
            units(schedule, profile.block_size()),
            cfg.max_concurrency,
            cfg.duration.map(|d| d.as_secs_f64()),
        );
        speed.wall_s += t.elapsed().as_secs_f64();
        speed.simulated_s += out.duration_s;
        speed.events += out.events;
        speed.requests += out.records.len();
        let summary = Summary::of(
            &out.records,
            out.duration_s,
            offered,
            cfg.max_concurrency,
            cfg.slo.as_ref(),
        );
        runs.push(RunReport {
            summary,
            requests: out.records,
        });
    }
    let sweep = SweepSummary::of(&runs, cfg.slo.as_ref(), cfg.attainment_target);
    let config = serde_json::json!({
        "serve": cfg,
        "cluster": cluster_json(cluster),
        "profile": &profile.file.source,
    });
    let report = Report {
        schema: SCHEMA.to_string(),
        label: cfg.label.clone(),
        backend: "simulated".into(),
        url: format!(
            "sim://{}p{}d",
            cluster.active_prefill_workers(),
            cluster.decode_workers
        ),
        model: profile.file.source.model.clone(),
        started_unix_s,
        config,
        runs,
        sweep,
    };
    Ok((report, speed))
}

/// Simulates the requests of a trace ([`crate::trace`]) on `cluster`: one run at the
/// trace's own times, reported as `duet bench serve` reports.
pub fn simulate_trace(
    profile: &Profile,
    cluster: &ClusterSpec,
    units: Vec<Unit>,
    slo: Option<&duet_bench::Slo>,
    label: &str,
    trace: &str,
) -> (Report, Speed) {
    let started_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let span = units.last().map_or(0.0, |u| u.due_s);
    let offered = (span > 0.0).then(|| units.len() as f64 / span);
    let t = Instant::now();
    let out = Sim::new(profile, cluster.clone()).run(units.into_iter(), None, None);
    let speed = Speed {
        simulated_s: out.duration_s,
        wall_s: t.elapsed().as_secs_f64(),
        events: out.events,
        requests: out.records.len(),
    };
    let summary = Summary::of(&out.records, out.duration_s, offered, None, slo);
    let report = Report {
        schema: SCHEMA.to_string(),
        label: label.to_string(),
        backend: "simulated".into(),
        url: format!("sim://trace/{trace}"),
        model: profile.file.source.model.clone(),
        started_unix_s,
        config: serde_json::json!({
            "trace": trace,
            "slo": slo,
            "cluster": cluster_json(cluster),
            "profile": &profile.file.source,
        }),
        runs: vec![RunReport {
            summary,
            requests: out.records,
        }],
        sweep: None,
    };
    (report, speed)
}

fn cluster_json(c: &ClusterSpec) -> serde_json::Value {
    serde_json::json!({
        "mode": c.mode.label(),
        "prefill_workers": c.prefill_workers,
        "decode_workers": c.decode_workers,
        "local_prefill_max_tokens": c.local_prefill_max_tokens,
        "kv_routing": c.kv_routing,
        "prefix_cache": c.prefix_cache,
        "max_batch": c.max_batch,
        "prefill_chunk_tokens": c.prefill_chunk_tokens,
        "max_batch_tokens": c.max_batch_tokens,
        "workers_per_host": c.workers_per_host,
        "link": c.link.backend,
    })
}
