//! The `duet` command line: argument parsing and wiring only.

#![forbid(unsafe_code)]

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "duet",
    version,
    about = "Disaggregated prefill/decode LLM serving"
)]
struct Cli {
    /// Log line format (level filter: DUET_LOG, e.g. `info` or `duet_router=debug`).
    #[arg(
        long,
        global = true,
        env = "DUET_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: LogFormatArg,
    /// Export request spans over OTLP/gRPC to this collector (e.g. http://127.0.0.1:4317).
    #[arg(long, global = true, env = "DUET_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormatArg {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// One-shot generation in this process, streaming text to stdout.
    Run(cmd::run::RunArgs),
    /// Everything in one process: router, prefill and decode workers, in-memory registry.
    Up(cmd::cluster::up::UpArgs),
    /// The public gRPC door of a cluster (workers found in etcd).
    Router(cmd::cluster::processes::RouterCmd),
    /// A prefill worker of a cluster.
    Prefill(cmd::cluster::processes::PrefillCmd),
    /// A decode worker of a cluster.
    Decode(cmd::cluster::processes::DecodeCmd),
    /// A worker of a cluster that a planner may move between prefill and decode.
    Worker(Box<cmd::cluster::switchable::WorkerCmd>),
    /// Move workers between roles as the load asks (`duet worker`s, from a profile and an
    /// SLO).
    Planner(Box<cmd::plan::planner::PlannerArgs>),
    /// Stream a completion from a running router.
    Generate(cmd::cluster::client::GenerateArgs),
    /// The workers of a cluster and their capacity (from etcd or from a router).
    Status(cmd::cluster::client::StatusArgs),
    /// Whether a router or worker serves (gRPC health; exit code 0 when it does).
    Health(cmd::health::HealthArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Quality measurements (perplexity).
    #[command(subcommand)]
    Eval(cmd::eval::EvalCommand),
    /// Measure this engine on this machine and write a profile for `duet plan`.
    Profile(Box<cmd::plan::profile::ProfileArgs>),
    /// Size clusters from profiles: the cheapest layout for a rate and an SLO, or
    /// (`plan simulate`) one layout under a workload.
    Plan(Box<cmd::plan::PlanArgs>),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let format = match cli.log_format {
        LogFormatArg::Text => duet_telemetry::LogFormat::Text,
        LogFormatArg::Json => duet_telemetry::LogFormat::Json,
    };
    let service = match &cli.command {
        Command::Router(_) => "duet-router",
        Command::Prefill(_) => "duet-prefill",
        Command::Decode(_) => "duet-decode",
        Command::Worker(_) => "duet-worker",
        Command::Planner(_) => "duet-planner",
        Command::Up(_) => "duet",
        _ => "duet-cli",
    };
    // Held to the end: dropping it flushes exported spans.
    let _logs = match duet_telemetry::init_logs(format, cli.otlp_endpoint.as_deref(), service) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("duet: error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let res = match cli.command {
        Command::Run(args) => cmd::run::run(args),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Eval(e) => cmd::eval::run(e),
        Command::Profile(a) => cmd::plan::profile::run(*a),
        Command::Plan(p) => cmd::plan::run(*p),
        Command::Up(a) => cmd::cluster::up::up(a),
        Command::Router(a) => cmd::cluster::processes::router(a),
        Command::Prefill(a) => cmd::cluster::processes::prefill(a),
        Command::Decode(a) => cmd::cluster::processes::decode(a),
        Command::Worker(a) => cmd::cluster::switchable::worker(*a),
        Command::Planner(a) => cmd::plan::planner::run(*a),
        Command::Generate(a) => cmd::cluster::client::generate(a),
        Command::Status(a) => cmd::cluster::client::status(a),
        Command::Health(a) => cmd::health::health(a),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("duet: error: {e:#}");
            // A device or engine that cannot run here is a usage error, as clap's are.
            let device = e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<duet_engine::EngineError>(),
                    Some(duet_engine::EngineError::Device(_))
                )
            });
            std::process::ExitCode::from(if device { 2 } else { 1 })
        }
    }
}
