//! `duet bench router`: how many requests per second the router's own work sustains.
//!
//! The router runs on a tokio runtime of one worker thread named `duet-router` (its core);
//! fake workers that answer instantly (this benchmark's test doubles: a one-token decode
//! stream, an instant prefill) and the load-generating clients run on a second runtime.
//! Requests per router-core-second = completed requests / CPU seconds of the router's
//! threads (read from /proc), so the number holds even when the clients, not the router,
//! limit the wall-clock rate (also reported).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use duet_discovery::{
    Capacity, ClusterView, KvEndpoint, MemoryRegistry, Registration, RegistrationOptions, Registry,
    Role, WorkerRecord,
};
use duet_engine::TextFrontend;
use duet_proto::v1 as pb;
use duet_router::{GenerationService, Mode, RouterConfig};
use futures::Stream;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::cmd::cluster::args::parse_duration;
use crate::cmd::model_args::DEFAULT_MODEL;

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
    /// Measured time per placement (after a 1 s warm-up).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// KV-aware routing in the measured router (the fake workers publish no KV events, so
    /// `on` measures what following and matching costs).
    #[arg(long, value_enum, default_value = "on")]
    pub kv_routing: crate::cmd::cluster::args::Switch,
}

#[derive(Clone)]
struct FakeDecode;

type Events = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for FakeDecode {
    async fn reserve(
        &self,
        r: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        let n = r.into_inner().prompt_tokens.div_ceil(16);
        Ok(Response::new(pb::ReserveResponse {
            block_ids: (0..n).collect(),
            kv_endpoints: vec![pb::KvEndpoint {
                transport: "tcp".into(),
                address: "127.0.0.1:9".into(),
            }],
            block_size: 16,
            cached_tokens: 0,
        }))
    }
    type GenerateStream = Events;
    async fn generate(&self, _: Request<pb::DecodeRequest>) -> Result<Response<Events>, Status> {
        let events = vec![
            Ok(pb::DecodeEvent {
                event: Some(pb::decode_event::Event::Token(pb::TokenChunk {
                    id: 42,
                    text: "x".into(),
                })),
            }),
            Ok(pb::DecodeEvent {
                event: Some(pb::decode_event::Event::Done(pb::DecodeDone {
                    finish_reason: pb::FinishReason::Length as i32,
                    completion_tokens: 1,
                    ..Default::default()
                })),
            }),
        ];
        Ok(Response::new(Box::pin(futures::stream::iter(events))))
    }
    async fn release(
        &self,
        _: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        Ok(Response::new(pb::ReleaseResponse { released: true }))
    }
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::WorkerStatus>, Status> {
        Ok(Response::new(pb::WorkerStatus::default()))
    }
}

#[derive(Clone)]
struct FakePrefill;

#[tonic::async_trait]
impl pb::prefill_server::Prefill for FakePrefill {
    async fn prefill(
        &self,
        _: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        Ok(Response::new(pb::PrefillResponse {
            first_token: 42,
            ..Default::default()
        }))
    }
    async fn cancel(
        &self,
        _: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        Ok(Response::new(pb::ReleaseResponse { released: true }))
    }
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::WorkerStatus>, Status> {
        Ok(Response::new(pb::WorkerStatus::default()))
    }
}

/// CPU seconds used so far by this process's threads whose name starts with `prefix`.
fn threads_cpu_seconds(prefix: &str) -> anyhow::Result<f64> {
    // Clock ticks per second of /proc's utime/stime (USER_HZ, 100 on Linux).
    const TICKS: f64 = 100.0;
    let mut total = 0u64;
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
            total += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
        }
    }
    Ok(total as f64 / TICKS)
}

async fn serve_fake(
    routes: tonic::service::Routes,
    cancel: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(
                duet_serving::server::nodelay_incoming(l),
                cancel.cancelled_owned(),
            )
            .await;
    });
    Ok(addr)
}

#[derive(Debug, serde::Serialize)]
struct Row {
    placement: &'static str,
    requests: u64,
    errors: u64,
    wall_seconds: f64,
    requests_per_second: f64,
    router_cpu_seconds: f64,
    requests_per_router_core_second: f64,
}

pub fn run(a: RouterBenchArgs) -> anyhow::Result<()> {
    if a.concurrency == 0 || a.connections == 0 {
        anyhow::bail!("--concurrency and --connections must be at least 1");
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
    let mut rows = Vec::new();
    for (placement, local_max) in [
        ("local prefill (1 RPC)", usize::MAX),
        ("remote prefill (3 RPCs)", 0),
    ] {
        let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
        // Fake workers on the load runtime.
        let (decode_addr, prefill_addr, regs) = load_rt.block_on(async {
            let d = serve_fake(
                tonic::service::Routes::new(pb::decode_server::DecodeServer::new(FakeDecode)),
                cancel.clone(),
            )
            .await?;
            let p = serve_fake(
                tonic::service::Routes::new(pb::prefill_server::PrefillServer::new(FakePrefill)),
                cancel.clone(),
            )
            .await?;
            let mut regs = Vec::new();
            for (role, addr) in [(Role::Decode, d), (Role::Prefill, p)] {
                let mut r = WorkerRecord::new(
                    "bench",
                    role,
                    format!("fake-{}", role.as_str()),
                    format!("http://{addr}"),
                );
                r.model = "bench".into();
                r.fingerprint = "f".into();
                r.kv_endpoints = vec![KvEndpoint {
                    transport: "tcp".into(),
                    address: "127.0.0.1:9".into(),
                }];
                r.capacity = Capacity {
                    kv_blocks_total: 1 << 30,
                    kv_blocks_free: 1 << 30,
                    block_size: 16,
                    ..Capacity::default()
                };
                regs.push(
                    Registration::start(
                        registry.clone(),
                        r,
                        RegistrationOptions::default(),
                        cancel.clone(),
                    )
                    .await?,
                );
            }
            anyhow::Ok((d, p, regs))
        })?;
        let _ = (decode_addr, prefill_addr);
        let cfg = RouterConfig {
            mode: Mode::Disaggregated,
            local_prefill_max_tokens: local_max,
            model_name: "bench".into(),
            max_queued_per_priority: 1 << 20,
            kv_routing: a.kv_routing == crate::cmd::cluster::args::Switch::On,
            ..RouterConfig::default()
        };
        let front = front.clone();
        let url = router_rt.block_on(async {
            let view = ClusterView::start(registry.clone(), "bench", cancel.clone());
            view.clone().wait_for(|s| s.workers.len() == 2).await.ok();
            let svc = GenerationService::new(front, cfg, view);
            let addr = serve_fake(
                tonic::service::Routes::new(svc.into_server()),
                cancel.clone(),
            )
            .await?;
            anyhow::Ok(format!("http://{addr}"))
        })?;
        let row = load_rt.block_on(drive(&url, &a, placement))?;
        drop(regs);
        rows.push(row);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<26} {:>9} {:>7} {:>10} {:>12} {:>16}",
            "placement", "requests", "errors", "req/s", "router cpu s", "req/router-core-s"
        );
        for r in &rows {
            println!(
                "{:<26} {:>9} {:>7} {:>10.0} {:>12.2} {:>16.0}",
                r.placement,
                r.requests,
                r.errors,
                r.requests_per_second,
                r.router_cpu_seconds,
                r.requests_per_router_core_second
            );
        }
    }
    Ok(())
}

async fn drive(url: &str, a: &RouterBenchArgs, placement: &'static str) -> anyhow::Result<Row> {
    let mut clients = Vec::new();
    for _ in 0..a.connections {
        let ch = tonic::transport::Endpoint::from_shared(url.to_string())?
            .connect()
            .await?;
        clients.push(pb::generation_client::GenerationClient::new(ch));
    }
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for i in 0..a.concurrency {
        let mut c = clients[i % clients.len()].clone();
        let (done, errors, stop) = (done.clone(), errors.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let req = pb::GenerateRequest {
                    prompt: Some(pb::generate_request::Prompt::Text(
                        "Hello there, router".into(),
                    )),
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
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (n0, e0, cpu0, t0) = (
        done.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        threads_cpu_seconds("duet-router")?,
        Instant::now(),
    );
    tokio::time::sleep(a.duration).await;
    let (n1, e1, cpu1, wall) = (
        done.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        threads_cpu_seconds("duet-router")?,
        t0.elapsed().as_secs_f64(),
    );
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    let requests = n1 - n0;
    let cpu = cpu1 - cpu0;
    Ok(Row {
        placement,
        requests,
        errors: e1 - e0,
        wall_seconds: wall,
        requests_per_second: requests as f64 / wall,
        router_cpu_seconds: cpu,
        requests_per_router_core_second: if cpu > 0.0 {
            requests as f64 / cpu
        } else {
            0.0
        },
    })
}
