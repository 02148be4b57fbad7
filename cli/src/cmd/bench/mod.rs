//! `duet bench ...`: benchmarks. Each prints its numbers beside a reference
//! measured in the same run where one exists (the reference tool for the
//! engine, llama.cpp, is driven by `scripts/bench-engine.sh`).

mod engine;
mod matmul;
mod plot;
pub mod router;
pub mod serve;
mod transfer;
pub mod workload_args;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and batched-decode throughput of the engine.
    Engine(engine::EngineBenchArgs),
    /// One weight matrix of a GGUF file: the engine's native kernel beside the same
    /// matrix expanded to f32.
    Matmul(matmul::MatmulBenchArgs),
    /// Requests per second per core the router sustains, with instant fake workers.
    Router(router::RouterBenchArgs),
    /// KV transfer throughput and latency beside iperf3 / memcpy.
    Transfer(transfer::TransferBenchArgs),
    /// Load generator against a serving endpoint (duet gRPC or OpenAI-compatible HTTP):
    /// TTFT, TPOT, ITL, throughput, SLO attainment and goodput.
    Serve(Box<serve::ServeBenchArgs>),
    /// Overlay several `bench serve` reports in SVG plots.
    Plot(plot::PlotBenchArgs),
}

pub fn run(c: BenchCommand) -> anyhow::Result<()> {
    match c {
        BenchCommand::Engine(a) => engine::run(a),
        BenchCommand::Matmul(a) => matmul::run(a),
        BenchCommand::Transfer(a) => transfer::run(a),
        BenchCommand::Router(a) => router::run(a),
        BenchCommand::Serve(a) => serve::run(*a),
        BenchCommand::Plot(a) => plot::run(a),
    }
}

/// Write a JSON report where asked, creating its directory.
pub fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(value)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
