//! `duet bench ...`: benchmarks.

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {}

pub fn run(c: BenchCommand) -> anyhow::Result<()> {
    match c {}
}
