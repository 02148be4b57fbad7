//! `duet up`: router + prefill workers + decode workers in one process, in-memory registry,
//! KV handed over in process (`local` transport); the separate-process commands run the
//! same pieces against etcd ([`super::processes`]). The workers' scheduling flags are
//! defined here, once, for both.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use duet_decode_worker::DecodeConfig;
use duet_discovery::{MemoryRegistry, RegistrationOptions, Registry};
use duet_engine::EngineModel;
use duet_kv_transfer::LocalHub;
use duet_prefill_worker::PrefillConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[cfg(feature = "rdma")]
use super::args::UcxArgs;
use super::args::{default_shm_dir, parse_duration, CompressionArg, KvArgs};
use super::router::{model_name, run_router, RouterListeners, RoutingArgs};
use super::tls_args::TlsArgs;
#[cfg(feature = "rdma")]
use super::worker::RdmaSetting;
use super::worker::{run_decode, run_prefill, ShmSetting, WorkerEnv};
use crate::cmd::model_args::{EngineArgs, ModelArgs};

/// Decode scheduling flags.
#[derive(Args, Debug, Clone)]
pub struct DecodeArgs {
    /// Most sequences in one decode batch.
    #[arg(long, env = "DUET_MAX_BATCH", default_value_t = 64)]
    pub max_batch: usize,
    /// Prompt tokens of local prefills mixed into one decode step.
    #[arg(long, env = "DUET_PREFILL_CHUNK_TOKENS", default_value_t = 256)]
    pub prefill_chunk_tokens: usize,
}

impl DecodeArgs {
    pub fn config(&self) -> anyhow::Result<DecodeConfig> {
        if self.max_batch == 0 || self.prefill_chunk_tokens == 0 {
            anyhow::bail!("--max-batch and --prefill-chunk-tokens must be at least 1");
        }
        Ok(DecodeConfig {
            max_batch: self.max_batch,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            ..DecodeConfig::default()
        })
    }
}

/// Prefill batching flags.
#[derive(Args, Debug, Clone)]
pub struct PrefillArgs {
    /// Prompt tokens in one prefill forward (longer prompts are chunked).
    #[arg(long, env = "DUET_MAX_BATCH_TOKENS", default_value_t = 2048)]
    pub max_batch_tokens: usize,
}

impl PrefillArgs {
    pub fn config(&self) -> anyhow::Result<PrefillConfig> {
        if self.max_batch_tokens < super::args::BLOCK_SIZE {
            anyhow::bail!("--max-batch-tokens: at least {}", super::args::BLOCK_SIZE);
        }
        Ok(PrefillConfig {
            max_batch_tokens: self.max_batch_tokens,
            ..PrefillConfig::default()
        })
    }
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub routing: RoutingArgs,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub prefill: PrefillArgs,
    /// Address of the public gRPC door.
    #[arg(long, env = "DUET_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the HTTP door: OpenAI-compatible API, /health and /metrics.
    #[arg(long, env = "DUET_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    pub http_listen: SocketAddr,
    /// Prefill workers (0 with --mode colocated).
    #[arg(long, env = "DUET_PREFILL_WORKERS", default_value_t = 1)]
    pub prefill_workers: usize,
    /// Decode workers.
    #[arg(long, env = "DUET_DECODE_WORKERS", default_value_t = 1)]
    pub decode_workers: usize,
    /// How long in-flight requests may finish after SIGTERM.
    #[arg(long, env = "DUET_DRAIN", default_value = "10s", value_parser = parse_duration)]
    pub drain: Duration,
    /// How KV moves between the workers of this process: handed over in memory (`local`),
    /// or, to measure a transport, over loopback tcp as between hosts (`tcp`) or over shared
    /// memory as between processes of one host (`shm`).
    #[arg(long, env = "DUET_KV_TRANSPORT", value_enum, default_value = "local")]
    pub kv_transport: KvTransport,
    #[cfg(feature = "rdma")]
    #[command(flatten)]
    pub ucx: UcxArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// KV transport inside `duet up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvTransport {
    Local,
    Tcp,
    Shm,
    /// Over UCX (RDMA where a device exists; its tcp or shared-memory transports here).
    #[cfg(feature = "rdma")]
    Rdma,
}

pub fn load(m: &ModelArgs, e: &EngineArgs) -> anyhow::Result<Arc<EngineModel>> {
    Ok(Arc::new(m.load_engine(e)?))
}

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn up(a: UpArgs) -> anyhow::Result<()> {
    a.routing.validate()?;
    let server_tls = a.tls.server()?;
    if server_tls.is_some() && a.tls.tls_ca.is_none() {
        // The workers of this process serve TLS too, and the router must verify them.
        anyhow::bail!("--tls-cert: `duet up` also needs --tls-ca (the router checks its workers' certificates)");
    }
    let client_tls = a.tls.client()?;
    let scheme = duet_serving::tls::scheme(server_tls.is_some());
    // Before anything records: metric handles taken earlier would go nowhere.
    duet_telemetry::install()?;
    if a.decode_workers == 0 {
        anyhow::bail!("--decode-workers: at least 1");
    }
    if a.kv_transport == KvTransport::Local && a.kv.kv_compression != CompressionArg::None {
        // Refused rather than ignored: the setting would change nothing.
        anyhow::bail!(
            "--kv-compression: the local transport hands KV over in memory and never encodes \
             it; add --kv-transport tcp (or shm) to compress KV in flight"
        );
    }
    let dcfg = a.decode.config()?;
    let pcfg = a.prefill.config()?;
    let name = model_name(&a.model.model, &a.routing.served_model_name);
    let front = Arc::new(a.routing.frontend(&a.model.model)?);
    // One process: a secret of its own unless one is given (nothing outside can join).
    let secret = a.kv.secret.or_random()?;
    let token = super::args::cluster_token(&secret)?;
    let rt = runtime()?;
    rt.block_on(async move {
        let shutdown = duet_serving::server::shutdown_on_signal();
        let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
        let hub = LocalHub::default();
        let tag = format!("{:016x}", rand::random::<u64>());
        let cluster = "local".to_string();
        let mut tasks = tokio::task::JoinSet::new();
        let env = |model: Arc<EngineModel>, grpc: TcpListener| WorkerEnv {
            model,
            model_name: name.clone(),
            kv: a.kv.clone(),
            registry: registry.clone(),
            cluster: cluster.clone(),
            registration: RegistrationOptions::default(),
            grpc,
            advertise_host: "127.0.0.1".into(),
            hub: (a.kv_transport == KvTransport::Local).then(|| (hub.clone(), tag.clone())),
            kv_shm: (a.kv_transport == KvTransport::Shm).then(|| ShmSetting {
                dir: default_shm_dir(),
                required: true,
                pool_in_arena: true,
            }),
            kv_advertise_host: None,
            #[cfg(feature = "rdma")]
            kv_rdma: (a.kv_transport == KvTransport::Rdma).then(|| RdmaSetting {
                options: a.ucx.options(),
                listener: None,
            }),
            drain: a.drain,
            tls: server_tls.clone(),
            client_tls: client_tls.clone(),
            secret: secret.clone(),
            switchable: false,
        };
        for i in 0..a.decode_workers {
            let model = load(&a.model, &a.engine)?;
            // Every request that names no policy gets this one: one the workers cannot run
            // is refused at start, not on every request.
            model
                .check_attention(a.routing.attention)
                .context("--attention")?;
            let grpc = TcpListener::bind("127.0.0.1:0").await?;
            // Over shm or rdma, tcp is not offered: the transfers measured are theirs.
            let kv = match a.kv_transport {
                KvTransport::Local | KvTransport::Tcp => {
                    Some(TcpListener::bind("127.0.0.1:0").await?)
                }
                _ => None,
            };
            #[cfg_attr(not(feature = "rdma"), allow(unused_mut))]
            let mut e = env(model, grpc);
            #[cfg(feature = "rdma")]
            if let Some(r) = e.kv_rdma.as_mut() {
                r.listener = Some(TcpListener::bind("127.0.0.1:0").await?);
            }
            tasks.spawn(run_decode(
                e,
                format!("decode-{i}"),
                dcfg.clone(),
                kv,
                shutdown.clone(),
            ));
        }
        for i in 0..a.prefill_workers {
            let model = load(&a.model, &a.engine)?;
            let grpc = TcpListener::bind("127.0.0.1:0").await?;
            let e = env(model, grpc);
            tasks.spawn(run_prefill(
                e,
                format!("prefill-{i}"),
                pcfg.clone(),
                shutdown.clone(),
            ));
        }
        // `listening` below means ready: the router's first listing holds every worker.
        let workers = a.decode_workers + a.prefill_workers;
        wait_registered(registry.as_ref(), &cluster, workers, &mut tasks, &shutdown).await?;
        let listener = TcpListener::bind(a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?;
        let http = TcpListener::bind(a.http_listen)
            .await
            .with_context(|| format!("binding --http-listen {}", a.http_listen))?;
        let http_addr = http.local_addr()?;
        let mut cfg = a.routing.config(name.clone())?;
        cfg.worker_tls = client_tls.clone();
        cfg.cluster_token = Some(token);
        println!(
            "duet up: model {name}, {} prefill + {} decode workers, mode {:?}",
            a.prefill_workers, a.decode_workers, a.routing.mode
        );
        println!("duet up: router listening on {scheme}://{addr}");
        println!("duet up: http listening on {scheme}://{http_addr} (OpenAI API under /v1)");
        println!("duet up: metrics on {scheme}://{http_addr}/metrics");
        println!(
            "duet up: try  duet generate --router {scheme}://{addr} --prompt 'Why is the sky blue?'"
        );
        tasks.spawn(run_router(
            front,
            cfg,
            registry.clone(),
            cluster.clone(),
            RouterListeners {
                grpc: listener,
                http,
                tls: server_tls,
            },
            shutdown.clone(),
            a.drain,
        ));
        wait_all(tasks, shutdown).await
    })
}

/// Waits until the `want` workers this process started are in the registry (or shutdown).
/// Workers register from their own tasks; a request the router took before a prefill worker
/// registered would be prefilled on its decode worker instead.
async fn wait_registered(
    registry: &dyn Registry,
    cluster: &str,
    want: usize,
    tasks: &mut tokio::task::JoinSet<anyhow::Result<()>>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    const LIMIT: Duration = Duration::from_secs(60);
    let prefix = duet_discovery::workers_prefix(cluster);
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        if registry.list(&prefix).await?.kvs.len() >= want {
            return Ok(());
        }
        // A worker that ended before registering: its error is the process's.
        if let Some(r) = tasks.try_join_next() {
            r??;
            anyhow::bail!("a worker stopped before registering");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep_until(deadline) => {
                anyhow::bail!("the workers did not register within {LIMIT:?}")
            }
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
}

async fn wait_all(
    mut tasks: tokio::task::JoinSet<anyhow::Result<()>>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        let r = r.map_err(anyhow::Error::from).and_then(|r| r);
        if let Err(e) = r {
            // One part failing takes the whole process down cleanly.
            shutdown.cancel();
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}
