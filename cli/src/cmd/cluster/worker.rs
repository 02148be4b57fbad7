//! Starting one worker (decode or prefill) on given listeners: engine thread, KV endpoints,
//! registry record and capacity publishing, gRPC server, graceful shutdown.
//!
//! Shutdown order (SIGTERM or the parent's token): the registry key is deleted (routers
//! stop choosing this worker), then health goes NOT_SERVING and the server drains in-flight
//! calls up to the deadline, then the engine thread stops.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use duet_decode_worker::{kv_inbound, service::DecodeService, DecodeConfig, DecodeHandle};
use duet_discovery::{
    Capacity, ClusterView, KvEndpoint, Registration, RegistrationOptions, Registry, Role,
    ViewOptions, WorkerRecord,
};
use duet_engine::Model;
use duet_kv_transfer::backend::shm::{host_identity, SendArena, ShmOptions, ShmReceiver};
use duet_kv_transfer::backend::tcp::TcpReceiver;
use duet_kv_transfer::{Connector, Endpoint, Inbound, LocalHub, SharedSecret, TransferConfig};
use duet_prefill_worker::{service::PrefillService, PrefillConfig, PrefillHandle};
use duet_proto::v1 as pb;
use duet_serving::channels::Channels;
use duet_serving::cluster_auth::{ClusterToken, RequireToken};
use duet_serving::tls::{ClientTls, ServerTls};
use duet_worker_common::kv_events::KvCacheService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::args::KvArgs;

/// How often a worker hands its live numbers to the registration (which coalesces them).
const CAPACITY_POLL: Duration = Duration::from_millis(200);

/// Where a decode worker receives KV over shm.
#[derive(Debug, Clone)]
pub struct ShmSetting {
    /// Directory of its socket and ring files.
    pub dir: PathBuf,
    /// When shm cannot be set up, the worker stops (asked for explicitly: `--kv-shm-dir`, or
    /// `duet up --kv-transport shm`); otherwise it says so and receives over tcp alone.
    pub required: bool,
    /// Prefill workers: bytes of the send arena their shm transfers are laid out in (0:
    /// none; decode workers send nothing).
    pub send_arena_bytes: usize,
}

/// Default size of a prefill worker's send arena (`--kv-send-arena-mib`): about ten
/// 1024-token prompts of the default model's f16 KV in flight.
pub const DEFAULT_SEND_ARENA_MIB: u32 = 256;

/// Largest `--kv-send-arena-mib` (64 GiB of address space).
pub const MAX_SEND_ARENA_MIB: i64 = 1 << 16;

/// `n` MiB in bytes (`n` at most [`MAX_SEND_ARENA_MIB`], so no overflow on 64-bit hosts).
pub fn mib(n: u32) -> usize {
    (n as usize).saturating_mul(1 << 20)
}

/// The send arena of a prefill worker's shm transfers, when asked for. One the kernel
/// refuses (no memfd here) is a warning: shm then reads ordinary memory.
fn send_arena(shm: Option<&ShmSetting>) -> Option<Arc<SendArena>> {
    let bytes = shm?.send_arena_bytes;
    if bytes == 0 {
        return None;
    }
    SendArena::new(bytes)
        .inspect_err(
            |e| tracing::warn!(error = %e, "no KV send arena: shm transfers read ordinary memory"),
        )
        .ok()
}

/// KV over RDMA through UCX (feature `rdma`).
#[cfg(feature = "rdma")]
#[derive(Debug)]
pub struct RdmaSetting {
    /// UCX options (its transports).
    pub options: duet_kv_transfer::backend::rdma::RdmaOptions,
    /// Decode workers: the control listener prefill workers connect to, advertised as the
    /// `rdma` endpoint. Prefill workers: `None`.
    pub listener: Option<TcpListener>,
}

/// What every worker needs besides its engine.
pub struct WorkerEnv {
    pub model: Arc<Model>,
    pub model_name: String,
    pub kv: KvArgs,
    pub registry: Arc<dyn Registry>,
    pub cluster: String,
    pub registration: RegistrationOptions,
    pub grpc: TcpListener,
    /// Host other processes reach this worker at.
    pub advertise_host: String,
    /// Host prefill workers reach this worker's KV endpoint at (default: `advertise_host`).
    pub kv_advertise_host: Option<String>,
    /// In-process hub and this process's tag (all-in-one mode).
    pub hub: Option<(LocalHub, String)>,
    /// Same-host shm KV when set: decode workers listen on a unix socket in its directory
    /// (their ring files go there too), prefill workers use shm toward them.
    pub kv_shm: Option<ShmSetting>,
    /// RDMA KV when set: decode workers also receive over UCX, prefill workers prefer it
    /// toward decode workers that offer it.
    #[cfg(feature = "rdma")]
    pub kv_rdma: Option<RdmaSetting>,
    pub drain: Duration,
    /// TLS on the gRPC server (mutual when it names a client CA).
    pub tls: Option<ServerTls>,
    /// TLS of this worker's calls to other workers (a decode worker calls the prefill
    /// workers its remote prompts go to).
    pub client_tls: Option<ClientTls>,
    /// The cluster secret: the KV handshake's, and the source of the token internal calls
    /// carry (this worker's server refuses calls without it, health excepted).
    pub secret: SharedSecret,
}

impl WorkerEnv {
    fn token(&self) -> anyhow::Result<ClusterToken> {
        super::args::cluster_token(&self.secret)
    }

    /// The cluster as the registry shows it, for checking the peers requests name.
    fn peers(&self, stop: &CancellationToken) -> ClusterView {
        let opts = ViewOptions {
            export_gauges: false,
            ..ViewOptions::default()
        };
        ClusterView::start_with(
            self.registry.clone(),
            self.cluster.clone(),
            opts,
            stop.clone(),
        )
    }
}

fn record(env: &WorkerEnv, role: Role, id: &str, grpc_addr: &str) -> WorkerRecord {
    let mut r = WorkerRecord::new(env.cluster.clone(), role, id, grpc_addr);
    r.model = env.model_name.clone();
    r.fingerprint = env.model.fingerprint().to_string();
    r
}

async fn serve_until(
    env: WorkerEnv,
    routes: tonic::service::Routes,
    services: &[&str],
    reg: Arc<Registration>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let auth = RequireToken::new(Some(env.token()?));
    let stop_server = CancellationToken::new();
    let s = stop_server.clone();
    let r = reg;
    tokio::spawn(async move {
        shutdown.cancelled().await;
        if let Err(e) = r.deregister().await {
            tracing::warn!(error = %e, "deleting the registry key");
        }
        s.cancel();
    });
    duet_serving::server::serve(
        env.grpc,
        env.tls.as_ref(),
        auth,
        routes,
        services,
        stop_server,
        env.drain,
    )
    .await?;
    Ok(())
}

/// Registers `rec` with its current capacity, then hands the live numbers to the
/// registration every [`CAPACITY_POLL`] (it coalesces them) until `stop` fires.
async fn register_and_publish(
    env: &WorkerEnv,
    mut rec: WorkerRecord,
    stop: CancellationToken,
    capacity: impl Fn() -> Capacity + Send + 'static,
) -> Result<Arc<Registration>, duet_discovery::Error> {
    rec.capacity = capacity();
    let reg = Arc::new(
        Registration::start(
            env.registry.clone(),
            rec,
            env.registration.clone(),
            stop.clone(),
        )
        .await?,
    );
    let publisher = reg.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CAPACITY_POLL);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => publisher.update_capacity(capacity()),
            }
        }
    });
    Ok(reg)
}

/// The address routers reach this worker's gRPC service at.
fn grpc_addr(env: &WorkerEnv) -> std::io::Result<String> {
    Ok(format!(
        "{}://{}:{}",
        duet_serving::tls::scheme(env.tls.is_some()),
        env.advertise_host,
        env.grpc.local_addr()?.port()
    ))
}

/// Runs a decode worker until `shutdown` fires.
pub async fn run_decode(
    #[cfg_attr(not(feature = "rdma"), allow(unused_mut))] mut env: WorkerEnv,
    id: String,
    cfg: DecodeConfig,
    kv_tcp: Option<TcpListener>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let engine_stop = CancellationToken::new();
    let _stop_engine = engine_stop.clone().drop_guard();
    let handle = DecodeHandle::start(
        env.model.clone(),
        env.kv.cache_config(&env.model),
        DecodeConfig {
            id: id.clone(),
            prefix_cache: env.kv.prefix_cache_config(&env.model, &id)?,
            ..cfg
        },
        engine_stop.clone(),
    )?;
    let tcfg = env.kv.transfer_config(&env.model, &env.secret)?;
    let grpc_addr = grpc_addr(&env)?;
    let kv_host = env
        .kv_advertise_host
        .clone()
        .unwrap_or_else(|| env.advertise_host.clone());
    let mut endpoints = Vec::new();
    if let Some(l) = &kv_tcp {
        endpoints.push(KvEndpoint {
            transport: "tcp".into(),
            address: format!("{kv_host}:{}", l.local_addr()?.port()),
        });
    }
    let shm = match &env.kv_shm {
        Some(setting) => shm_listener(setting, &id, &tcfg).await?,
        None => None,
    };
    if let Some((_, e)) = &shm {
        endpoints.push(KvEndpoint {
            transport: "shm".into(),
            address: e.address.clone(),
        });
    }
    #[cfg(feature = "rdma")]
    let rdma = match env.kv_rdma.take() {
        Some(RdmaSetting {
            options,
            listener: Some(l),
        }) => {
            let port = l.local_addr()?.port();
            let rx = duet_kv_transfer::backend::rdma::RdmaReceiver::new(l, tcfg.clone(), options)
                .context("--kv-rdma-listen: UCX does not start")?;
            endpoints.push(KvEndpoint {
                transport: "rdma".into(),
                address: format!("{kv_host}:{port}"),
            });
            Some(rx)
        }
        _ => None,
    };
    let local = env
        .hub
        .as_ref()
        .map(|(h, tag)| (h.clone(), format!("{tag}/{id}")));
    if let Some((_, name)) = &local {
        endpoints.push(KvEndpoint {
            transport: "local".into(),
            address: name.clone(),
        });
    }
    if endpoints.is_empty() {
        anyhow::bail!(
            "decode worker {id}: no KV endpoint to offer (no tcp or rdma listener, shm unavailable)"
        );
    }
    let inbound = Inbound {
        tcp: kv_tcp.map(|l| TcpReceiver::new(l, tcfg)),
        shm: shm.map(|(rx, _)| rx),
        local: local.map(|(h, name)| h.listen(&name)),
        #[cfg(feature = "rdma")]
        rdma,
    };
    tokio::spawn(kv_inbound::serve(
        inbound,
        handle.clone(),
        engine_stop.clone(),
    ));
    let mut rec = record(&env, Role::Decode, &id, &grpc_addr);
    rec.kv_endpoints = endpoints.clone();
    let reg = register_and_publish(&env, rec, engine_stop.clone(), {
        let handle = handle.clone();
        move || decode_capacity(&handle)
    })
    .await
    .context("registering the decode worker")?;
    println!(
        "duet: decode worker {id} serving gRPC on {grpc_addr}, KV on {}",
        endpoints
            .iter()
            .map(|e| format!("{}://{}", e.transport, e.address))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let kv_cache = KvCacheService::new(
        handle.kv_events().clone(),
        {
            let h = handle.clone();
            Arc::new(move |hashes| h.prefetch(hashes))
        },
        shutdown.clone(),
    );
    let svc = DecodeService::new(
        handle,
        endpoints
            .iter()
            .map(|e| pb::KvEndpoint {
                transport: e.transport.clone(),
                address: e.address.clone(),
            })
            .collect(),
        id,
        Arc::new(Channels::new(env.client_tls.clone(), Some(env.token()?))),
        env.peers(&engine_stop),
    );
    let routes = tonic::service::Routes::new(svc.into_server()).add_service(kv_cache.into_server());
    let services = ["duet.v1.Decode", "duet.v1.KvCache"];
    serve_until(env, routes, &services, reg, shutdown).await
}

/// The decode worker's shm receiver (a fresh socket in the setting's directory, after what
/// dead workers left there is removed) and the endpoint it is advertised as. `None` when shm
/// is unavailable and not required: the worker says so once and offers tcp alone.
async fn shm_listener(
    setting: &ShmSetting,
    id: &str,
    cfg: &TransferConfig,
) -> anyhow::Result<Option<(ShmReceiver, Endpoint)>> {
    let r = async {
        let host = host_identity()
            .context("no host identity (/proc/sys/kernel/random/boot_id, /proc/self/ns/mnt)")?;
        // Senders must find the socket by this path from anywhere: absolute, no symlinks.
        let dir = std::fs::canonicalize(&setting.dir)
            .with_context(|| format!("--kv-shm-dir {}", setting.dir.display()))?;
        let opts = ShmOptions {
            dir: dir.clone(),
            ..ShmOptions::default()
        };
        let rx = ShmReceiver::bind_in(id, cfg.clone(), opts)
            .await
            .with_context(|| format!("binding the shm KV socket in {}", dir.display()))?;
        let e = Endpoint::shm(&host, rx.path())?;
        anyhow::Ok((rx, e))
    }
    .await;
    match r {
        Ok(x) => Ok(Some(x)),
        Err(e) if !setting.required => {
            tracing::warn!(error = %format!("{e:#}"), "KV over shm unavailable: tcp only");
            Ok(None)
        }
        Err(e) => Err(e.context("--kv-shm")),
    }
}

fn decode_capacity(h: &DecodeHandle) -> Capacity {
    let s = h.status();
    Capacity {
        kv_blocks_total: s.kv_blocks_total,
        kv_blocks_free: s.kv_blocks_free,
        kv_blocks_cached: s.kv_blocks_cached,
        block_size: s.block_size,
        running: s.running,
        waiting: s.waiting,
        queued_prefill_tokens: 0,
        max_batch: s.max_batch,
        tokens_per_second: s.tokens_per_second,
    }
}

/// Runs a prefill worker until `shutdown` fires.
pub async fn run_prefill(
    env: WorkerEnv,
    id: String,
    cfg: PrefillConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let engine_stop = CancellationToken::new();
    let _stop_engine = engine_stop.clone().drop_guard();
    let tcfg = env.kv.transfer_config(&env.model, &env.secret)?;
    let connector = Connector::new(tcfg, env.hub.as_ref().map(|(h, _)| h.clone()))
        .with_shm(env.kv_shm.is_some())
        .with_send_arena(send_arena(env.kv_shm.as_ref()));
    #[cfg(feature = "rdma")]
    let connector = {
        let options = env.kv_rdma.as_ref().map(|r| r.options.clone());
        if let Some(o) = &options {
            // Asked for: a missing UCX stops the worker rather than silently using tcp.
            duet_kv_transfer::backend::rdma::probe(o).context("--kv-rdma: UCX does not start")?;
        }
        connector.with_rdma(options)
    };
    let connector = Arc::new(connector);
    let handle = PrefillHandle::start(
        env.model.clone(),
        env.kv.cache_config(&env.model),
        PrefillConfig {
            id: id.clone(),
            prefix_cache: env.kv.prefix_cache_config(&env.model, &id)?,
            ..cfg
        },
        connector,
        tokio::runtime::Handle::current(),
        engine_stop.clone(),
    )?;
    let grpc_addr = grpc_addr(&env)?;
    let mut rec = record(&env, Role::Prefill, &id, &grpc_addr);
    if let Some((_, tag)) = &env.hub {
        // "Reaches the local KV listeners of process `tag`".
        rec.kv_endpoints.push(KvEndpoint {
            transport: "local".into(),
            address: tag.clone(),
        });
    }
    let reg = register_and_publish(&env, rec, engine_stop.clone(), {
        let handle = handle.clone();
        move || prefill_capacity(&handle)
    })
    .await
    .context("registering the prefill worker")?;
    println!("duet: prefill worker {id} serving gRPC on {grpc_addr}");
    let kv_cache = KvCacheService::new(
        handle.kv_events().clone(),
        {
            let h = handle.clone();
            Arc::new(move |hashes| h.prefetch(hashes))
        },
        shutdown.clone(),
    );
    let peers = env.peers(&engine_stop);
    let routes = tonic::service::Routes::new(PrefillService::new(handle, id, peers).into_server())
        .add_service(kv_cache.into_server());
    let services = ["duet.v1.Prefill", "duet.v1.KvCache"];
    serve_until(env, routes, &services, reg, shutdown).await
}

fn prefill_capacity(h: &PrefillHandle) -> Capacity {
    let s = h.status();
    Capacity {
        kv_blocks_total: s.kv_blocks_total,
        kv_blocks_free: s.kv_blocks_free,
        kv_blocks_cached: s.kv_blocks_cached,
        block_size: super::args::BLOCK_SIZE as u32,
        running: s.running,
        waiting: s.queued,
        queued_prefill_tokens: s.queued_prefill_tokens,
        max_batch: 0,
        tokens_per_second: s.tokens_per_second,
    }
}
