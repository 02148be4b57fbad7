//! Turning a worker's flags into the worker crates' servers: [`WorkerEnv`] is what the
//! flags of `duet decode`, `duet prefill` and `duet up` resolve to; [`run_decode`] and
//! [`run_prefill`] hand it to `duet_decode_worker::server` and `duet_prefill_worker::server`,
//! which own the wiring (engine thread, KV endpoints, registration, services, shutdown).

use std::sync::Arc;
use std::time::Duration;

use duet_decode_worker::server::{DecodeWorker, KvReceivers};
use duet_decode_worker::DecodeConfig;
use duet_discovery::{RegistrationOptions, Registry};
use duet_engine::EngineModel;
use duet_kv_transfer::{LocalHub, SharedSecret};
use duet_prefill_worker::server::{KvSenders, PrefillWorker};
use duet_prefill_worker::PrefillConfig;
use duet_serving::tls::{ClientTls, ServerTls};
pub use duet_worker_common::ShmSetting;
use duet_worker_common::WorkerServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::args::KvArgs;

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
    pub model: Arc<EngineModel>,
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
    /// The worker follows role requests (`duet worker`), as its record says.
    pub switchable: bool,
}

impl WorkerEnv {
    /// The gRPC side both workers share, and what is left of the environment.
    fn split(self) -> anyhow::Result<(WorkerServer, Parts)> {
        let token = super::args::cluster_token(&self.secret)?;
        let server = WorkerServer {
            registry: self.registry,
            cluster: self.cluster,
            registration: self.registration,
            model_name: self.model_name,
            grpc: self.grpc,
            advertise_host: self.advertise_host,
            drain: self.drain,
            tls: self.tls,
            client_tls: self.client_tls,
            token,
            switchable: self.switchable,
        };
        let parts = Parts {
            model: self.model,
            kv: self.kv,
            secret: self.secret,
            kv_advertise_host: self.kv_advertise_host,
            hub: self.hub,
            kv_shm: self.kv_shm,
            #[cfg(feature = "rdma")]
            kv_rdma: self.kv_rdma,
        };
        Ok((server, parts))
    }
}

/// The engine and KV side of a [`WorkerEnv`].
struct Parts {
    model: Arc<EngineModel>,
    kv: KvArgs,
    secret: SharedSecret,
    kv_advertise_host: Option<String>,
    hub: Option<(LocalHub, String)>,
    kv_shm: Option<ShmSetting>,
    #[cfg(feature = "rdma")]
    kv_rdma: Option<RdmaSetting>,
}

/// Runs a decode worker until `shutdown` fires.
pub async fn run_decode(
    env: WorkerEnv,
    id: String,
    cfg: DecodeConfig,
    kv_tcp: Option<TcpListener>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let (server, p) = env.split()?;
    let worker = DecodeWorker {
        cache: p.kv.cache_config(&p.model),
        config: DecodeConfig {
            prefix_cache: p.kv.prefix_cache_config(&p.model, &id)?,
            ..cfg
        },
        transfer: p.kv.transfer_config(&p.model, &p.secret)?,
        id,
        model: p.model,
    };
    let receivers = KvReceivers {
        tcp: kv_tcp,
        shm: p.kv_shm,
        local: p.hub,
        #[cfg(feature = "rdma")]
        rdma: p.kv_rdma.and_then(|r| r.listener.map(|l| (l, r.options))),
        advertise_host: p.kv_advertise_host,
    };
    Ok(worker.serve(server, receivers, shutdown).await?)
}

/// Runs a prefill worker until `shutdown` fires.
pub async fn run_prefill(
    env: WorkerEnv,
    id: String,
    cfg: PrefillConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let (server, p) = env.split()?;
    let worker = PrefillWorker {
        cache: p.kv.cache_config(&p.model),
        config: PrefillConfig {
            prefix_cache: p.kv.prefix_cache_config(&p.model, &id)?,
            ..cfg
        },
        transfer: p.kv.transfer_config(&p.model, &p.secret)?,
        id,
        model: p.model,
    };
    let senders = KvSenders {
        shm: p.kv_shm,
        local: p.hub,
        #[cfg(feature = "rdma")]
        rdma: p.kv_rdma.map(|r| r.options),
    };
    Ok(worker.serve(server, senders, shutdown).await?)
}
