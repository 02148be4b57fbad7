//! `duet plan`: the cheapest layout serving `--request-rate` within `--slo` on at most
//! `--devices` devices, from a profile (`duet-plan`'s `search`), with the best colocated
//! layout beside it and an attainment-against-rate plot of both.

use std::path::PathBuf;

use clap::Args;
use duet_plan::search::{search, Layout, SearchSpec};
use duet_plan::simulate::simulate;
use duet_plan::Profile;

use super::simulate::{simulated_config, SchedArgs};
use crate::cmd::bench::workload_args::{ArrivalArgs, SloArgs, WorkloadArgs};

#[derive(Args, Debug)]
pub struct SearchArgs {
    /// Profile of one worker (`duet profile`, or written by hand: docs/plan.md).
    /// (Required without a subcommand.)
    #[arg(long, env = "DUET_PLAN_PROFILE", required = true)]
    pub profile: Option<PathBuf>,
    /// Profile of a colocated worker when it runs otherwise (e.g. with all of a host's
    /// cores); default: --profile.
    #[arg(long, env = "DUET_PLAN_COLOCATED_PROFILE")]
    pub colocated_profile: Option<PathBuf>,
    /// Most devices the cluster may use (a device: a GPU, or a core of a CPU profile).
    #[arg(long, env = "DUET_PLAN_DEVICES", default_value_t = 4096)]
    pub devices: usize,
    /// Most prefill workers in one unit of the search.
    #[arg(long, default_value_t = 4)]
    pub max_prefill_per_unit: usize,
    /// Most decode workers in one unit of the search.
    #[arg(long, default_value_t = 4)]
    pub max_decode_per_unit: usize,
    /// Local-prefill thresholds tried for disaggregated units.
    #[arg(long, value_delimiter = ',', default_value = "0,32,256")]
    pub local_prefill_thresholds: Vec<usize>,
    #[command(flatten)]
    pub sched: SchedArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub arrival: ArrivalArgs,
    #[command(flatten)]
    pub slo: SloArgs,
    /// Write the plan (every layout evaluated) as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Write attainment-against-rate plots of the chosen and the best colocated unit here.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
}

fn describe(l: &Layout) -> String {
    let unit = match l.mode {
        duet_router::Mode::Colocated => "1 colocated worker".to_string(),
        duet_router::Mode::Disaggregated => format!(
            "{}P+{}D, local prefill <= {} tokens",
            l.prefill, l.decode, l.local_prefill_max_tokens
        ),
    };
    match (l.units, l.devices) {
        (Some(u), Some(d)) => format!(
            "{u} x ({unit}) = {d} devices; {:.3} req/s per unit, {:.4} req/s per device",
            l.unit_goodput_rps, l.goodput_per_device
        ),
        _ => format!("{unit}: meets the SLO at no rate tried"),
    }
}

pub fn run(a: SearchArgs) -> anyhow::Result<()> {
    let Some(path) = &a.profile else {
        anyhow::bail!("--profile: the profile of one worker (see duet plan --help)");
    };
    let profile = Profile::read(path)?;
    let colocated = match &a.colocated_profile {
        Some(p) => Profile::read(p)?,
        None => profile.clone(),
    };
    let Some(target_rate) = a.arrival.request_rate else {
        anyhow::bail!("--request-rate: the rate the cluster must serve");
    };
    let mut arrival = a.arrival.clone();
    arrival.num_prompts = arrival.num_prompts.or(Some(200));
    let (cfg, corpus) = simulated_config(&a.workload, &arrival, &a.slo)?;
    let base = a
        .sched
        .cluster(&profile, duet_router::Mode::Disaggregated, 1, 1, 0)?;
    let spec = SearchSpec {
        base,
        max_prefill: a.max_prefill_per_unit,
        max_decode: a.max_decode_per_unit,
        thresholds: a.local_prefill_thresholds.clone(),
        target_rate,
        devices: a.devices,
    };
    let t = std::time::Instant::now();
    let plan = search(&profile, &colocated, &spec, &cfg, corpus.clone())?;
    eprintln!(
        "{} layouts, {} simulations in {:.1} s",
        plan.layouts.len(),
        plan.simulations,
        t.elapsed().as_secs_f64()
    );
    println!(
        "target {target_rate} req/s within {} on at most {} devices",
        a.slo.slo.as_deref().unwrap_or("-"),
        a.devices
    );
    match (&plan.best, &plan.closest) {
        (Some(b), _) => println!("cheapest:        {}", describe(b)),
        (None, Some(c)) => println!(
            "no layout meets the target within {} devices; closest: {}",
            a.devices,
            describe(c)
        ),
        (None, None) => println!("no layout meets the SLO at any rate tried"),
    }
    if let Some(c) = &plan.best_colocated {
        println!("best colocated:  {}", describe(c));
    }
    if let Some(g) = plan.disaggregation_gain {
        println!("goodput per device, best disaggregated / colocated: {g:.2}x");
    }
    if let Some(path) = &a.output_json {
        crate::cmd::bench::write_json(path, &plan)?;
    }
    if let Some(dir) = &a.plot_dir {
        let mut reports = Vec::new();
        for l in plan.best.iter().chain(plan.best_colocated.iter()) {
            if l.unit_goodput_rps <= 0.0 {
                continue;
            }
            let p = match l.mode {
                duet_router::Mode::Colocated => &colocated,
                duet_router::Mode::Disaggregated => &profile,
            };
            let cluster = a.sched.cluster(
                p,
                l.mode,
                l.prefill,
                l.decode.max(1),
                l.local_prefill_max_tokens,
            )?;
            let mut c = cfg.clone();
            c.label = format!("{} {}P{}D", l.mode.label(), l.prefill, l.decode);
            c.rates = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
                .iter()
                .map(|f| Some(f * l.unit_goodput_rps))
                .collect();
            reports.push(simulate(p, &cluster, &c, corpus.clone())?.0);
        }
        for p in duet_bench::plot::write_plots(&reports, dir, None)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(())
}
