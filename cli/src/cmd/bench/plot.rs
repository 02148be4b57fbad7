//! `duet bench plot`: overlays several `duet bench serve` reports (one configuration each,
//! named by its `--label`) in one set of SVG plots.

use std::path::PathBuf;

use clap::Args;
use duet_bench::Report;

#[derive(Args, Debug)]
pub struct PlotBenchArgs {
    /// Directory the SVG files go to.
    #[arg(long, env = "DUET_BENCH_PLOT_OUT")]
    pub out: PathBuf,
    /// Latency CDFs only for the runs at this offered rate (default: every run).
    #[arg(long, env = "DUET_BENCH_CDF_RATE")]
    pub cdf_rate: Option<f64>,
    /// Reports written by `duet bench serve --output-json`.
    #[arg(required = true)]
    pub reports: Vec<PathBuf>,
}

pub fn run(a: PlotBenchArgs) -> anyhow::Result<()> {
    let reports = a
        .reports
        .iter()
        .map(|p| Report::read(p))
        .collect::<Result<Vec<_>, _>>()?;
    let written = duet_bench::plot::write_plots(&reports, &a.out, a.cdf_rate)?;
    if written.is_empty() {
        anyhow::bail!("the reports hold no completed request to plot");
    }
    for p in written {
        println!("{}", p.display());
    }
    Ok(())
}
