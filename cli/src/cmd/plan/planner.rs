//! `duet planner`: moves switchable workers (`duet worker`) between prefill and decode as
//! the load asks. Every `--interval` it reads the cluster from the registry (the workers'
//! records and the load the routers publish), hands it to `duet_plan::planner::Planner`
//! (which replays the routers' recent requests on the profile for the current layout and
//! its neighbours), and, when that says so, writes one worker's role request. It publishes
//! its view as metrics and prints one line per evaluation.
//!
//! The planner holds no state the cluster needs: stopping it leaves every worker in its
//! role; a restarted planner starts its dwell time and confirmations afresh.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use duet_discovery::control::{self, RoleRequest};
use duet_discovery::{Registry, Role, WorkerRecord};
use duet_plan::planner::{Decision, Evaluation, Observation, Planner, PlannerConfig, WorkerView};
use duet_plan::Profile;
use duet_telemetry::names::*;

use super::simulate::{PlacementArgs, SchedArgs};
use crate::cmd::cluster::args::{parse_duration, ModeArg, RegistryArgs};
use crate::cmd::cluster::router::serve_metrics_on;

#[derive(Args, Debug)]
pub struct PlannerArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Profile of one worker (`duet profile`, or written by hand: docs/plan.md).
    #[arg(long, env = "DUET_PLAN_PROFILE")]
    pub profile: PathBuf,
    /// Service-level objective, milliseconds: `ttft=500,tpot=100` (also `e2e=`), as
    /// `duet bench serve --slo`.
    #[arg(long, env = "DUET_PLANNER_SLO")]
    pub slo: String,
    /// Attainment a layout must reach (share of requests within the SLO).
    #[arg(long, env = "DUET_PLANNER_SLO_ATTAINMENT", default_value_t = 0.9)]
    pub slo_attainment: f64,
    /// How often the cluster is evaluated.
    #[arg(long, env = "DUET_PLANNER_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub interval: Duration,
    /// The routers' requests of this last stretch of time are the load judged (at most the
    /// 60 s the routers publish).
    #[arg(long, env = "DUET_PLANNER_WINDOW", default_value = "60s", value_parser = parse_duration)]
    pub window: Duration,
    /// Least time between two switches.
    #[arg(long, env = "DUET_PLANNER_DWELL", default_value = "60s", value_parser = parse_duration)]
    pub dwell: Duration,
    /// Evaluations in a row that must choose the same layout before a switch.
    #[arg(long, env = "DUET_PLANNER_CONFIRM", default_value_t = 2)]
    pub confirm: u32,
    /// When both layouts meet the SLO, the other must have this much more headroom
    /// (fraction of the current one's) to be switched to.
    #[arg(long, env = "DUET_PLANNER_MARGIN", default_value_t = 0.25)]
    pub margin: f64,
    /// Fewer finished requests in the window: no decision.
    #[arg(long, env = "DUET_PLANNER_MIN_REQUESTS", default_value_t = 10)]
    pub min_requests: usize,
    /// Fewest prefill workers kept.
    #[arg(long, env = "DUET_PLANNER_MIN_PREFILL", default_value_t = 1)]
    pub min_prefill: usize,
    /// Fewest decode workers kept.
    #[arg(long, env = "DUET_PLANNER_MIN_DECODE", default_value_t = 1)]
    pub min_decode: usize,
    /// Evaluate and report, but write no role request.
    #[arg(long, env = "DUET_PLANNER_DRY_RUN")]
    pub dry_run: bool,
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub sched: SchedArgs,
    /// Where `/metrics` is served (port 0: any free port, printed at start).
    #[arg(long, env = "DUET_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    pub metrics_listen: std::net::SocketAddr,
}

impl PlannerArgs {
    /// One check of every setting, naming the bad one.
    fn validate(&self) -> anyhow::Result<duet_bench::Slo> {
        self.registry.validate()?;
        let slo = duet_bench::Slo::parse(&self.slo)?;
        if !(0.0..=1.0).contains(&self.slo_attainment) {
            anyhow::bail!("--slo-attainment: between 0 and 1");
        }
        if self.interval.is_zero() {
            anyhow::bail!("--interval: more than 0");
        }
        if self.window.is_zero() || self.window > duet_router::recent::WINDOW {
            anyhow::bail!(
                "--window: more than 0 and at most {:?} (what routers publish)",
                duet_router::recent::WINDOW
            );
        }
        if self.confirm == 0 {
            anyhow::bail!("--confirm: at least 1");
        }
        if self.margin.is_nan() || self.margin < 0.0 {
            anyhow::bail!("--margin: 0 or more");
        }
        if self.min_decode == 0 {
            anyhow::bail!("--min-decode: at least 1");
        }
        if matches!(self.placement.mode, ModeArg::Colocated) {
            anyhow::bail!("--mode: colocated clusters have no prefill role to switch to");
        }
        Ok(slo)
    }
}

pub fn run(a: PlannerArgs) -> anyhow::Result<()> {
    let slo = a.validate()?;
    let profile = Profile::read(&a.profile)?;
    let spec = a.sched.cluster(
        &profile,
        a.placement.mode.into(),
        1,
        1,
        a.placement.local_prefill_max_tokens,
    )?;
    let cfg = PlannerConfig {
        slo,
        target: a.slo_attainment,
        margin: a.margin,
        confirm: a.confirm,
        dwell: a.dwell,
        min_requests: a.min_requests,
        min_prefill: a.min_prefill,
        min_decode: a.min_decode,
        ..PlannerConfig::default()
    };
    crate::cmd::cluster::up::runtime()?.block_on(async move {
        let shutdown = duet_serving::server::shutdown_on_signal();
        serve_metrics_on(a.metrics_listen, shutdown.clone()).await?;
        let registry = a.registry.connect().await?;
        let cluster = a.registry.cluster.clone();
        let mut planner = Planner::new(&profile, spec, cfg);
        let started = Instant::now();
        let mut tick = tokio::time::interval(a.interval);
        println!(
            "duet planner: cluster {cluster}, every {:?}{}",
            a.interval,
            if a.dry_run { " (dry run)" } else { "" }
        );
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            let obs = match observe(registry.as_ref(), &cluster, a.window, started).await {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the cluster; trying at the next interval");
                    continue;
                }
            };
            if !a.dry_run {
                forget_departed(registry.as_ref(), &cluster, &obs.workers).await;
            }
            // Simulations are CPU work: off the async threads' hands.
            let eval = tokio::task::block_in_place(|| planner.evaluate(&obs));
            report(&obs, &eval);
            if let Decision::Switch { worker, from, to } = &eval.decision {
                if a.dry_run {
                    continue;
                }
                let why = format!("duet planner: {from} -> {to}");
                match control::request_role(
                    registry.as_ref(),
                    &cluster,
                    worker,
                    &RoleRequest::new(*to, why),
                )
                .await
                {
                    Ok(()) => metrics::counter!(
                        PLANNER_ROLE_SWITCHES_TOTAL,
                        "from" => from.as_str(), "to" => to.as_str()
                    )
                    .increment(1),
                    Err(e) => {
                        tracing::warn!(worker = %worker, error = %e, "writing the role request")
                    }
                }
            }
        }
    })
}

/// The cluster as the registry shows it now.
async fn observe(
    registry: &dyn Registry,
    cluster: &str,
    window: Duration,
    started: Instant,
) -> anyhow::Result<Observation> {
    let listing = registry
        .list(&duet_discovery::workers_prefix(cluster))
        .await?;
    let workers = listing
        .kvs
        .iter()
        .filter_map(|kv| WorkerRecord::from_json(&kv.value).ok())
        .map(|r| WorkerView {
            load: match r.role {
                Role::Decode => f64::from(r.capacity.running + r.capacity.waiting),
                Role::Prefill => r.capacity.queued_prefill_tokens as f64,
            },
            id: r.id,
            role: r.role,
            switchable: r.switchable,
            draining: r.draining,
        })
        .collect();
    // A router whose sample was capped covers less than the window: every router's
    // requests are cut to the stretch all samples cover, so the rate is not diluted.
    let loads = control::router_loads(registry, cluster).await?;
    let mut since = duet_discovery::now_ms().saturating_sub(window.as_millis() as u64);
    for load in &loads {
        if load.finished > load.sample.len() as u64 {
            if let Some(first) = load.sample.first() {
                since = since.max(first.arrival_ms);
            }
        }
    }
    let requests = loads
        .into_iter()
        .flat_map(|l| l.sample)
        .filter(|r| r.arrival_ms >= since)
        .collect();
    Ok(Observation {
        now_s: started.elapsed().as_secs_f64(),
        workers,
        requests,
    })
}

/// Role requests older than this whose worker is not registered are removed.
const DEPARTED_AFTER: Duration = Duration::from_secs(600);

/// Removes the role requests of workers gone for good (a pod replaced under a new name),
/// so they do not pile up. A worker absent only for a restart at that moment comes back
/// in its `--role`, and the planner decides again.
async fn forget_departed(registry: &dyn Registry, cluster: &str, workers: &[WorkerView]) {
    let requests = match control::role_requests(registry, cluster).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "listing role requests");
            return;
        }
    };
    let old = duet_discovery::now_ms().saturating_sub(DEPARTED_AFTER.as_millis() as u64);
    for (id, r) in requests {
        if r.requested_at_ms < old && !workers.iter().any(|w| w.id == id) {
            let key = control::role_request_key(cluster, &id);
            if let Err(e) = registry.delete(&key).await {
                tracing::warn!(key = %key, error = %e, "removing a departed worker's role request");
            }
        }
    }
}

/// Metrics and one printed line per evaluation.
fn report(obs: &Observation, eval: &Evaluation) {
    for role in Role::ALL {
        let n = obs
            .workers
            .iter()
            .filter(|w| w.role == role && !w.draining)
            .count();
        metrics::gauge!(PLANNER_WORKERS, "role" => role.as_str()).set(n as f64);
    }
    if let Some(a) = eval.observed_attainment {
        metrics::gauge!(PLANNER_ATTAINMENT_RATIO, "source" => "observed").set(a);
    }
    if let Some(cur) = eval.layouts.first() {
        metrics::gauge!(PLANNER_ATTAINMENT_RATIO, "source" => "predicted").set(cur.attainment);
    }
    metrics::counter!(PLANNER_EVALUATIONS_TOTAL, "decision" => eval.decision.label()).increment(1);
    let layouts: Vec<String> = eval
        .layouts
        .iter()
        .map(|l| {
            format!(
                "{}P+{}D attainment {:.2} headroom {:.1}x",
                l.prefill, l.decode, l.attainment, l.headroom
            )
        })
        .collect();
    let decision = match &eval.decision {
        Decision::Switch { worker, from, to } => format!("switch {worker} {from} -> {to}"),
        Decision::Wait(why) => format!("wait ({why})"),
        d => d.label().to_string(),
    };
    println!(
        "duet planner: {} requests, observed attainment {}; {}: {decision}",
        obs.requests.len(),
        eval.observed_attainment
            .map_or("-".to_string(), |a| format!("{a:.2}")),
        if layouts.is_empty() {
            "no prediction".to_string()
        } else {
            layouts.join(", ")
        },
    );
}
