//! `duet bench router`: how many requests per second the router's own work sustains.
//!
//! The router runs on a tokio runtime of one worker thread named `duet-router` (its core);
//! fake workers that answer instantly (this benchmark's test doubles: a one-token decode
//! stream, an instant prefill) and the load-generating clients run on a second runtime. For
//! a remote prefill the router makes one call, as for a local one: the fake decode worker,
//! like a real one, calls the prefill worker itself, on the second runtime.
//! Requests per router-core-second = completed requests / CPU seconds of the router's
//! threads (read from /proc), so the number holds even when the clients, not the router,
//! limit the wall-clock rate (also reported).
//!
//! The reference measured in the same run is a bare relay (two gRPC streams per request and
//! nothing else), so each row also reads as a ratio that the machine's noise moves less than
//! the absolute rate; rounds interleave the targets and each row reports its median round.
//! Write system calls per request come from /proc's `syscw` count, which noise does not move.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use duet_discovery::ClusterView;
use duet_engine::TextFrontend;
use duet_proto::v1 as pb;
use duet_router::{GenerationService, Mode, RouterConfig};
use futures::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::cmd::cluster::args::parse_duration;
use crate::cmd::model_args::DEFAULT_MODEL;
use duet_bench::fake_workers::{fake_workers, serve_fake};

#[derive(Args, Debug)]
pub struct RouterBenchArgs {
    /// GGUF file (the router reads its tokenizer).
    #[arg(long, env = "DUET_MODEL", default_value = DEFAULT_MODEL)]
    pub model: std::path::PathBuf,
    /// Concurrent client streams.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Client connections (HTTP/2) the streams share.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Measured time per placement and round.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Load before each measurement (connections warm, queues full).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Rounds over all targets, interleaved; each row reports its median round.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The prompt every request sends (the router tokenizes it).
    #[arg(long, default_value = "Hello there, router")]
    pub prompt: String,
    /// Send the prompt this many times over, space-separated (longer prompts weigh the
    /// router's tokenizer).
    #[arg(long, default_value_t = 1)]
    pub prompt_repeat: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// KV-aware routing in the measured router (the fake workers publish no KV events, so
    /// `on` measures what following and matching costs).
    #[arg(long, value_enum, default_value = "on")]
    pub kv_routing: crate::cmd::cluster::args::Switch,
}

/// CPU time and write calls of a set of threads.
#[derive(Debug, Clone, Copy, Default)]
struct ThreadUsage {
    cpu_seconds: f64,
    /// Write system calls (`syscw` of /proc's io file): one per socket flush, so a count
    /// that the machine's noise does not move.
    write_syscalls: u64,
}

impl std::ops::Sub for ThreadUsage {
    type Output = ThreadUsage;
    fn sub(self, o: ThreadUsage) -> ThreadUsage {
        ThreadUsage {
            cpu_seconds: self.cpu_seconds - o.cpu_seconds,
            write_syscalls: self.write_syscalls.saturating_sub(o.write_syscalls),
        }
    }
}

fn threads_usage(prefix: &str) -> anyhow::Result<ThreadUsage> {
    // Clock ticks per second of /proc's utime/stime (USER_HZ, 100 on Linux).
    const TICKS: f64 = 100.0;
    let (mut ticks, mut writes) = (0u64, 0u64);
    for t in std::fs::read_dir("/proc/self/task").context("reading /proc/self/task")? {
        let dir = t?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
        let Some(rest) = stat.rsplit_once(')').map(|x| x.1) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 12 {
            ticks += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
        }
        let io = std::fs::read_to_string(dir.join("io")).unwrap_or_default();
        writes += io
            .lines()
            .find_map(|l| l.strip_prefix("syscw:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(ThreadUsage {
        cpu_seconds: ticks as f64 / TICKS,
        write_syscalls: writes,
    })
}

/// The reference measured in the same run: a gRPC server that relays each request to the
/// fake decode worker's stream and its events back, and nothing else (no tokenizer, no
/// admission, no placement, no task or channel per request). Two gRPC streams per request on
/// one runtime thread, as with a prompt prefilled on its decode worker: the floor of what
/// tonic and loopback TCP cost on this machine.
#[derive(Clone)]
struct BareRelay {
    decode: pb::decode_client::DecodeClient<tonic::transport::Channel>,
}

#[tonic::async_trait]
impl pb::generation_server::Generation for BareRelay {
    type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

    async fn generate(
        &self,
        r: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r = r.into_inner();
        let req = pb::DecodeRequest {
            prompt: vec![1, 2, 3, 4, 5],
            max_tokens: r.max_tokens,
            prefill: Some(pb::decode_request::Prefill::Local(pb::LocalPrefill {
                replay_tokens: 0,
            })),
            ..Default::default()
        };
        let events = self.decode.clone().generate(req).await?.into_inner();
        let id = r.request_id;
        Ok(Response::new(Box::pin(events.map(move |e| {
            let event = match e?.event {
                Some(pb::decode_event::Event::Token(t)) => pb::generate_response::Event::Token(t),
                Some(pb::decode_event::Event::Done(d)) => {
                    pb::generate_response::Event::Final(pb::FinalMessage {
                        finish_reason: d.finish_reason,
                        text: d.text,
                        ..Default::default()
                    })
                }
                None => return Err(Status::internal("an empty event")),
            };
            Ok(pb::GenerateResponse {
                request_id: id.clone(),
                event: Some(event),
            })
        }))))
    }

    async fn tokenize(
        &self,
        _: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        Err(Status::unimplemented("the bare relay only relays"))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        Err(Status::unimplemented("the bare relay only relays"))
    }
}

/// One measured target: a name and the URL its clients call.
struct Target {
    name: &'static str,
    url: String,
}

/// One measurement of one target.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    requests: u64,
    errors: u64,
    wall_seconds: f64,
    usage: ThreadUsage,
}

impl Sample {
    fn per_core_second(&self) -> f64 {
        if self.usage.cpu_seconds > 0.0 {
            self.requests as f64 / self.usage.cpu_seconds
        } else {
            0.0
        }
    }
}

#[derive(Debug, serde::Serialize)]
struct Row {
    placement: &'static str,
    /// The round whose requests per router-core-second are the median of the rounds.
    requests: u64,
    errors: u64,
    wall_seconds: f64,
    requests_per_second: f64,
    router_cpu_seconds: f64,
    requests_per_router_core_second: f64,
    /// Every round's requests per router-core-second, in order.
    rounds: Vec<f64>,
    /// Median over rounds of (this target / the bare relay of the same round).
    vs_bare_relay: f64,
    /// Write system calls of the router's threads per completed request.
    router_writes_per_request: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub fn run(a: RouterBenchArgs) -> anyhow::Result<()> {
    if a.concurrency == 0 || a.connections == 0 || a.rounds == 0 {
        anyhow::bail!("--concurrency, --connections and --rounds must be at least 1");
    }
    let front = Arc::new(
        TextFrontend::load(&a.model).with_context(|| format!("reading {}", a.model.display()))?,
    );
    let router_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("duet-router")
        .enable_all()
        .build()?;
    let load_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-load")
        .enable_all()
        .build()?;
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let mut targets = Vec::new();
    let mut keep = Vec::new();
    let (registry, decode_addr, regs) = load_rt.block_on(fake_workers(&cancel))?;
    keep.push(regs);
    let bare = router_rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{decode_addr}"))?
            .tcp_nodelay(true)
            .connect()
            .await?;
        let relay = BareRelay {
            decode: pb::decode_client::DecodeClient::new(ch),
        };
        let routes =
            tonic::service::Routes::new(pb::generation_server::GenerationServer::new(relay));
        anyhow::Ok(format!(
            "http://{}",
            serve_fake(routes, cancel.clone()).await?
        ))
    })?;
    targets.push(Target {
        name: BARE_RELAY,
        url: bare,
    });
    for (name, local_max) in [
        ("local prefill (1 RPC)", usize::MAX),
        ("remote prefill (1 RPC)", 0),
    ] {
        // Each router has fake workers of its own, so no connection is shared.
        let registry = if targets.len() == 1 {
            registry.clone()
        } else {
            let (r, _, regs) = load_rt.block_on(fake_workers(&cancel))?;
            keep.push(regs);
            r
        };
        let kv_routing = a.kv_routing == crate::cmd::cluster::args::Switch::On;
        let url = start_router(
            &router_rt,
            front.clone(),
            registry,
            local_max,
            kv_routing,
            &cancel,
        )?;
        targets.push(Target { name, url });
    }
    // Rounds interleave the targets, so that the machine's drift reaches all of them alike.
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); targets.len()];
    for _ in 0..a.rounds {
        for (t, out) in targets.iter().zip(samples.iter_mut()) {
            out.push(load_rt.block_on(drive(&t.url, &a))?);
        }
    }
    let rows: Vec<Row> = targets
        .iter()
        .zip(&samples)
        .map(|(t, s)| row(t.name, s, &samples[0]))
        .collect();
    drop(keep);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<26} {:>9} {:>7} {:>10} {:>17} {:>9} {:>14}",
            "placement",
            "requests",
            "errors",
            "req/s",
            "req/router-core-s",
            "vs bare",
            "writes/request"
        );
        for r in &rows {
            println!(
                "{:<26} {:>9} {:>7} {:>10.0} {:>17.0} {:>8.2}x {:>14.2}",
                r.placement,
                r.requests,
                r.errors,
                r.requests_per_second,
                r.requests_per_router_core_second,
                r.vs_bare_relay,
                r.router_writes_per_request
            );
        }
    }
    Ok(())
}

const BARE_RELAY: &str = "bare relay (reference)";

/// A router on `rt` over the fake workers of `registry`, prefilling prompts of at most
/// `local_max` tokens on their decode worker; its URL.
fn start_router(
    rt: &tokio::runtime::Runtime,
    front: Arc<TextFrontend>,
    registry: Arc<dyn duet_discovery::Registry>,
    local_max: usize,
    kv_routing: bool,
    cancel: &CancellationToken,
) -> anyhow::Result<String> {
    let cfg = RouterConfig {
        mode: Mode::Disaggregated,
        local_prefill_max_tokens: local_max,
        model_name: "bench".into(),
        max_queued_per_priority: 1 << 20,
        kv_routing,
        ..RouterConfig::default()
    };
    rt.block_on(async {
        let view = ClusterView::start(registry, "bench", cancel.clone());
        view.clone().wait_for(|s| s.workers.len() == 2).await.ok();
        let svc = GenerationService::new(front, cfg, view);
        let addr = serve_fake(
            tonic::service::Routes::new(svc.into_server()),
            cancel.clone(),
        )
        .await?;
        anyhow::Ok(format!("http://{addr}"))
    })
}

/// What the router and its gRPC hops add to every request, for `duet profile`: the median
/// time of a one-token request, one at a time, through an in-process router (its own
/// runtime thread, KV-aware routing on, the prompt prefilled on its decode worker: one
/// RPC) to fake workers that answer at once, after `warmup` requests.
pub fn request_overhead(
    model: &std::path::Path,
    warmup: usize,
    requests: usize,
) -> anyhow::Result<f64> {
    let front = Arc::new(
        TextFrontend::load(model).with_context(|| format!("reading {}", model.display()))?,
    );
    let one_thread = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(name)
            .enable_all()
            .build()
    };
    let (router_rt, load_rt) = (one_thread("duet-router")?, one_thread("bench-load")?);
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let (registry, _, regs) = load_rt.block_on(fake_workers(&cancel))?;
    let url = start_router(&router_rt, front, registry, usize::MAX, true, &cancel)?;
    let times = load_rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(url)?
            .tcp_nodelay(true)
            .connect()
            .await?;
        let mut c = pb::generation_client::GenerationClient::new(ch);
        let mut times = Vec::with_capacity(requests);
        for i in 0..warmup + requests {
            let req = pb::GenerateRequest {
                prompt: Some(pb::generate_request::Prompt::Text(
                    "Hello there, router".into(),
                )),
                max_tokens: 1,
                ..Default::default()
            };
            let t = Instant::now();
            let mut s = c.generate(req).await?.into_inner();
            let mut finished = false;
            while let Some(m) = s.message().await? {
                finished |= matches!(m.event, Some(pb::generate_response::Event::Final(_)));
            }
            if !finished {
                anyhow::bail!("a request through the router ended without its final message");
            }
            if i >= warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        anyhow::Ok(times)
    })?;
    drop(regs);
    Ok(median(times))
}

/// The median round of `s`, with its ratios to the bare relay's round of the same index.
fn row(name: &'static str, s: &[Sample], bare: &[Sample]) -> Row {
    let rounds: Vec<f64> = s.iter().map(Sample::per_core_second).collect();
    let med = median(rounds.clone());
    let pick = s
        .iter()
        .min_by(|a, b| {
            (a.per_core_second() - med)
                .abs()
                .total_cmp(&(b.per_core_second() - med).abs())
        })
        .copied()
        .unwrap_or_default();
    let ratios = s
        .iter()
        .zip(bare)
        .map(|(x, b)| x.per_core_second() / b.per_core_second().max(f64::MIN_POSITIVE))
        .collect();
    let (requests, writes): (u64, u64) = s.iter().fold((0, 0), |(n, w), x| {
        (n + x.requests, w + x.usage.write_syscalls)
    });
    Row {
        placement: name,
        requests: pick.requests,
        errors: s.iter().map(|x| x.errors).sum(),
        wall_seconds: pick.wall_seconds,
        requests_per_second: pick.requests as f64 / pick.wall_seconds.max(f64::MIN_POSITIVE),
        router_cpu_seconds: pick.usage.cpu_seconds,
        requests_per_router_core_second: pick.per_core_second(),
        rounds,
        vs_bare_relay: median(ratios),
        router_writes_per_request: writes as f64 / requests.max(1) as f64,
    }
}

async fn drive(url: &str, a: &RouterBenchArgs) -> anyhow::Result<Sample> {
    let mut clients = Vec::new();
    for _ in 0..a.connections {
        let ch = tonic::transport::Endpoint::from_shared(url.to_string())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        clients.push(pb::generation_client::GenerationClient::new(ch));
    }
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let prompt = vec![a.prompt.as_str(); a.prompt_repeat.max(1)].join(" ");
    let mut tasks = Vec::new();
    for i in 0..a.concurrency {
        let prompt = prompt.clone();
        let mut c = clients[i % clients.len()].clone();
        let (done, errors, stop) = (done.clone(), errors.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let req = pb::GenerateRequest {
                    prompt: Some(pb::generate_request::Prompt::Text(prompt.clone())),
                    max_tokens: 1,
                    ..Default::default()
                };
                let ok = async {
                    let mut s = c.generate(req).await?.into_inner();
                    while let Some(m) = s.message().await? {
                        if matches!(m.event, Some(pb::generate_response::Event::Final(_))) {
                            return Ok::<bool, Status>(true);
                        }
                    }
                    Ok(false)
                }
                .await;
                match ok {
                    Ok(true) => done.fetch_add(1, Ordering::Relaxed),
                    _ => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    tokio::time::sleep(a.warmup).await;
    let (n0, e0, u0, t0) = (
        done.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        threads_usage("duet-router")?,
        Instant::now(),
    );
    tokio::time::sleep(a.duration).await;
    let (n1, e1, u1, wall) = (
        done.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        threads_usage("duet-router")?,
        t0.elapsed().as_secs_f64(),
    );
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(Sample {
        requests: n1 - n0,
        errors: e1 - e0,
        wall_seconds: wall,
        usage: u1 - u0,
    })
}
