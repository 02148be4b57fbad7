//! `duet plan ...`, `duet profile` and `duet planner`: sizing clusters from measured profiles (the logic
//! lives in the `duet-plan` crate; these files map flags to it and print what it returns).

pub mod planner;
pub mod profile;
mod search;
mod simulate;

use clap::{Args, Subcommand};

/// `duet plan [flags]` searches layouts; `duet plan simulate` simulates one.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct PlanArgs {
    #[command(subcommand)]
    pub command: Option<PlanCommand>,
    #[command(flatten)]
    pub search: search::SearchArgs,
}

#[derive(Subcommand, Debug)]
pub enum PlanCommand {
    /// Simulate a cluster under `duet bench serve`'s workload, from a profile; writes the
    /// same report as `duet bench serve`.
    Simulate(Box<simulate::SimulateArgs>),
}

pub fn run(p: PlanArgs) -> anyhow::Result<()> {
    match p.command {
        Some(PlanCommand::Simulate(a)) => simulate::run(*a),
        None => search::run(p.search),
    }
}
