//! The separate-process commands, against etcd: `duet router`, `duet prefill`,
//! `duet decode`, and the pieces `duet worker` ([`super::switchable`]) shares with the two
//! workers: the flags of each side's KV, the ports a worker binds once, and the
//! environment a role is served in.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use duet_discovery::Registry;
use duet_engine::EngineModel;
use duet_kv_transfer::SharedSecret;
use duet_serving::tls::{ClientTls, ServerTls};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[cfg(feature = "rdma")]
use super::args::UcxArgs;
use super::args::{
    default_shm_dir, parse_duration, KvArgs, RegistryArgs, SecretArgs, ShmArgs, Switch,
};
use super::router::{model_name, run_router, serve_metrics_on, RouterListeners, RoutingArgs};
use super::tls_args::TlsArgs;
use super::up::{load, runtime, DecodeArgs, PrefillArgs};
#[cfg(feature = "rdma")]
use super::worker::RdmaSetting;
use super::worker::{run_decode, run_prefill, ShmSetting, WorkerEnv};
use crate::cmd::model_args::{EngineArgs, ModelArgs};

/// Flags of a separate worker or router process.
#[derive(Args, Debug)]
pub struct ProcessArgs {
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// gRPC listen address (port 0: any free port, printed at start).
    #[arg(long, env = "DUET_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Host name other processes reach this one at (default: the listen IP).
    #[arg(long, env = "DUET_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Worker or router id (default: role and a random suffix).
    #[arg(long, env = "DUET_ID")]
    pub id: Option<String>,
    /// How long in-flight requests may finish after SIGTERM (and, for `duet worker`, after
    /// a role switch was asked).
    #[arg(long, env = "DUET_DRAIN", default_value = "10s", value_parser = parse_duration)]
    pub drain: Duration,
    /// Where `/metrics` is served (port 0: any free port, printed at start).
    #[arg(long, env = "DUET_METRICS_LISTEN", default_value = "127.0.0.1:0")]
    pub metrics_listen: SocketAddr,
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl ProcessArgs {
    fn host(&self) -> String {
        self.advertise_host.clone().unwrap_or_else(|| {
            let ip = self.listen.ip();
            if ip.is_unspecified() {
                "127.0.0.1".into()
            } else {
                ip.to_string()
            }
        })
    }

    pub fn id(&self, role: &str) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("{role}-{:08x}", rand::random::<u32>()))
    }
}

/// What every worker process has, whatever its role.
#[derive(Args, Debug)]
pub struct WorkerProcessArgs {
    #[command(flatten)]
    pub process: ProcessArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub shm: ShmArgs,
    #[cfg(feature = "rdma")]
    #[command(flatten)]
    pub ucx: UcxArgs,
    /// Served model name (default: the GGUF file name without extension).
    #[arg(long, env = "DUET_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
}

/// How a decode worker receives KV.
#[derive(Args, Debug)]
pub struct DecodeKvArgs {
    /// KV receive address (tcp).
    #[arg(long, env = "DUET_KV_LISTEN", default_value = "127.0.0.1:0")]
    pub kv_listen: SocketAddr,
    /// Directory of the shm KV socket and ring files (default: /dev/shm, else the temp dir).
    #[arg(long, env = "DUET_KV_SHM_DIR")]
    pub kv_shm_dir: Option<std::path::PathBuf>,
    /// Host prefill workers send KV to, when KV travels on another network than gRPC (a
    /// dedicated data network); default: --advertise-host.
    #[arg(long, env = "DUET_KV_ADVERTISE_HOST")]
    pub kv_advertise_host: Option<String>,
    /// Also receive KV over RDMA (UCX): the control address prefill workers connect to
    /// (port 0: any free port). Advertised beside tcp; prefill workers with `--kv-rdma on`
    /// prefer it.
    #[cfg(feature = "rdma")]
    #[arg(long, env = "DUET_KV_RDMA_LISTEN")]
    pub kv_rdma_listen: Option<SocketAddr>,
}

/// How a prefill worker sends KV.
#[derive(Args, Debug)]
pub struct PrefillKvArgs {
    /// Keep the KV pool in a send arena: a sealed memfd that same-host decode workers map
    /// and copy each layer from with one memcpy (off: ordinary memory, read by them with
    /// process_vm_readv).
    #[arg(long, env = "DUET_KV_SEND_ARENA", value_enum, default_value = "on")]
    pub kv_send_arena: Switch,
    /// Send KV over RDMA (UCX) to decode workers that offer it (after a same-host shm
    /// endpoint, before tcp).
    #[cfg(feature = "rdma")]
    #[arg(long, env = "DUET_KV_RDMA", value_enum, default_value = "on")]
    pub kv_rdma: Switch,
}

#[derive(Args, Debug)]
pub struct DecodeCmd {
    #[command(flatten)]
    pub worker: WorkerProcessArgs,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub decode_kv: DecodeKvArgs,
}

#[derive(Args, Debug)]
pub struct PrefillCmd {
    #[command(flatten)]
    pub worker: WorkerProcessArgs,
    #[command(flatten)]
    pub prefill: PrefillArgs,
    #[command(flatten)]
    pub prefill_kv: PrefillKvArgs,
}

#[derive(Args, Debug)]
pub struct RouterCmd {
    #[command(flatten)]
    pub process: ProcessArgs,
    #[command(flatten)]
    pub routing: RoutingArgs,
    /// Address of the HTTP door: OpenAI-compatible API, /health and /metrics (port 0: any
    /// free port, printed at start).
    #[arg(long, env = "DUET_HTTP_LISTEN", default_value = "127.0.0.1:0")]
    pub http_listen: SocketAddr,
    #[command(flatten)]
    pub secret: SecretArgs,
    /// GGUF model file (the router reads only its tokenizer and metadata).
    #[arg(long, env = "DUET_MODEL", default_value = crate::cmd::model_args::DEFAULT_MODEL)]
    pub model: std::path::PathBuf,
}

/// The sockets a worker process binds once. Each role served takes duplicates of them
/// ([`Ports::grpc`], ...), so a switchable worker serves its next role on the same ports:
/// the sockets stay open (connections wait in the backlog) while one role's server has
/// stopped and the next has not started.
pub struct Ports {
    grpc: std::net::TcpListener,
    /// The decode side's tcp KV listener (workers that may decode).
    kv: Option<std::net::TcpListener>,
    #[cfg(feature = "rdma")]
    rdma: Option<std::net::TcpListener>,
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<std::net::TcpListener> {
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("{what}: binding {addr}"))?;
    Ok(l.into_std()?)
}

fn dup(l: &std::net::TcpListener) -> anyhow::Result<TcpListener> {
    Ok(TcpListener::from_std(
        l.try_clone().context("duplicating a listening socket")?,
    )?)
}

impl Ports {
    /// Binds the gRPC port and, when the worker may decode (`decode_kv`), its KV ports.
    pub async fn bind(p: &ProcessArgs, decode_kv: Option<&DecodeKvArgs>) -> anyhow::Result<Ports> {
        let grpc = bind(p.listen, "--listen").await?;
        let kv = match decode_kv {
            Some(d) => Some(bind(d.kv_listen, "--kv-listen").await?),
            None => None,
        };
        #[cfg(feature = "rdma")]
        let rdma = match decode_kv.and_then(|d| d.kv_rdma_listen) {
            Some(addr) => Some(bind(addr, "--kv-rdma-listen").await?),
            None => None,
        };
        Ok(Ports {
            grpc,
            kv,
            #[cfg(feature = "rdma")]
            rdma,
        })
    }

    pub fn grpc(&self) -> anyhow::Result<TcpListener> {
        dup(&self.grpc)
    }

    pub fn kv(&self) -> anyhow::Result<Option<TcpListener>> {
        self.kv.as_ref().map(dup).transpose()
    }

    #[cfg(feature = "rdma")]
    fn rdma(&self) -> anyhow::Result<Option<TcpListener>> {
        self.rdma.as_ref().map(dup).transpose()
    }
}

/// What a worker process loads, reads and connects once, shared by every role it serves.
pub struct Loaded {
    pub model: Arc<EngineModel>,
    pub model_name: String,
    pub registry: Arc<dyn Registry>,
    tls: Option<ServerTls>,
    client_tls: Option<ClientTls>,
    secret: SharedSecret,
}

impl WorkerProcessArgs {
    /// Loads the model (before the runtime: it is CPU work).
    fn load(&self) -> anyhow::Result<(Arc<EngineModel>, String)> {
        self.process.registry.validate()?;
        let model = load(&self.model, &self.engine)?;
        Ok((
            model,
            model_name(&self.model.model, &self.served_model_name),
        ))
    }

    /// Runs a worker process: loads the model, reads its TLS files and the cluster secret,
    /// then on the runtime starts `/metrics`,
    /// connects to the registry, binds the ports (the decode side's too with `decode_kv`)
    /// and hands them to `serve` until shutdown.
    pub fn run(
        &self,
        decode_kv: Option<&DecodeKvArgs>,
        serve: impl AsyncFnOnce(&Loaded, &Ports, CancellationToken) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let (model, model_name) = self.load()?;
        let p = &self.process;
        // Read once: every role this process serves uses them.
        let (tls, client_tls) = (p.tls.server()?, p.tls.client()?);
        let secret = self.kv.secret.required()?;
        runtime()?.block_on(async move {
            let shutdown = duet_serving::server::shutdown_on_signal();
            serve_metrics_on(p.metrics_listen, shutdown.clone()).await?;
            let registry = p.registry.connect().await?;
            let ports = Ports::bind(p, decode_kv).await?;
            let loaded = Loaded {
                model,
                model_name,
                registry,
                tls,
                client_tls,
                secret,
            };
            serve(&loaded, &ports, shutdown).await
        })
    }

    /// The environment of one role's run on `ports`.
    fn env(&self, loaded: &Loaded, ports: &Ports, switchable: bool) -> anyhow::Result<WorkerEnv> {
        let p = &self.process;
        Ok(WorkerEnv {
            tls: loaded.tls.clone(),
            client_tls: loaded.client_tls.clone(),
            secret: loaded.secret.clone(),
            model: loaded.model.clone(),
            model_name: loaded.model_name.clone(),
            kv: self.kv.clone(),
            registry: loaded.registry.clone(),
            cluster: p.registry.cluster.clone(),
            registration: p.registry.registration(),
            grpc: ports.grpc()?,
            advertise_host: p.host(),
            hub: None,
            kv_shm: None,
            kv_advertise_host: None,
            #[cfg(feature = "rdma")]
            kv_rdma: None,
            drain: p.drain,
            switchable,
        })
    }

    /// Serves the decode role on `ports` until `shutdown`.
    pub async fn serve_decode(
        &self,
        loaded: &Loaded,
        ports: &Ports,
        args: (&DecodeArgs, &DecodeKvArgs),
        id: String,
        switchable: bool,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (sched, d) = args;
        let cfg = sched.config()?;
        let mut env = self.env(loaded, ports, switchable)?;
        env.kv_advertise_host = d.kv_advertise_host.clone();
        if self.shm.kv_shm == Switch::On {
            env.kv_shm = Some(ShmSetting {
                dir: d.kv_shm_dir.clone().unwrap_or_else(default_shm_dir),
                required: d.kv_shm_dir.is_some(),
                pool_in_arena: false,
            });
        }
        #[cfg(feature = "rdma")]
        if let Some(l) = ports.rdma()? {
            env.kv_rdma = Some(RdmaSetting {
                options: self.ucx.options(),
                listener: Some(l),
            });
        }
        let kv = ports
            .kv()?
            .context("a decode worker needs its KV listener")?;
        run_decode(env, id, cfg, Some(kv), shutdown).await
    }

    /// Serves the prefill role on `ports` until `shutdown`.
    pub async fn serve_prefill(
        &self,
        loaded: &Loaded,
        ports: &Ports,
        args: (&PrefillArgs, &PrefillKvArgs),
        id: String,
        switchable: bool,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (sched, p) = args;
        let cfg = sched.config()?;
        let mut env = self.env(loaded, ports, switchable)?;
        if self.shm.kv_shm == Switch::On {
            // Only "on" matters to a sender: the directory is the receiver's.
            env.kv_shm = Some(ShmSetting {
                dir: default_shm_dir(),
                required: false,
                pool_in_arena: p.kv_send_arena == Switch::On,
            });
        }
        #[cfg(feature = "rdma")]
        if p.kv_rdma == Switch::On {
            env.kv_rdma = Some(RdmaSetting {
                options: self.ucx.options(),
                listener: None,
            });
        }
        run_prefill(env, id, cfg, shutdown).await
    }
}

pub fn decode(a: DecodeCmd) -> anyhow::Result<()> {
    a.decode.config()?;
    let id = a.worker.process.id("decode");
    a.worker
        .run(Some(&a.decode_kv), async |loaded, ports, shutdown| {
            let args = (&a.decode, &a.decode_kv);
            (a.worker)
                .serve_decode(loaded, ports, args, id, false, shutdown)
                .await
        })
}

pub fn prefill(a: PrefillCmd) -> anyhow::Result<()> {
    a.prefill.config()?;
    let id = a.worker.process.id("prefill");
    a.worker.run(None, async |loaded, ports, shutdown| {
        let args = (&a.prefill, &a.prefill_kv);
        (a.worker)
            .serve_prefill(loaded, ports, args, id, false, shutdown)
            .await
    })
}

pub fn router(a: RouterCmd) -> anyhow::Result<()> {
    a.process.registry.validate()?;
    a.routing.validate()?;
    let tls = a.process.tls.server()?;
    let scheme = duet_serving::tls::scheme(tls.is_some());
    let worker_tls = a.process.tls.client()?;
    let token = super::args::cluster_token(&a.secret.required()?)?;
    let front = Arc::new(a.routing.frontend(&a.model)?);
    let name = model_name(&a.model, &a.routing.served_model_name);
    runtime()?.block_on(async move {
        let shutdown = duet_serving::server::shutdown_on_signal();
        serve_metrics_on(a.process.metrics_listen, shutdown.clone()).await?;
        let registry = a.process.registry.connect().await?;
        let listener = TcpListener::bind(a.process.listen)
            .await
            .with_context(|| format!("binding {}", a.process.listen))?;
        let http = TcpListener::bind(a.http_listen)
            .await
            .with_context(|| format!("binding --http-listen {}", a.http_listen))?;
        println!(
            "duet: router listening on {scheme}://{}",
            listener.local_addr()?
        );
        println!(
            "duet: http listening on {scheme}://{} (OpenAI API under /v1)",
            http.local_addr()?
        );
        let mut cfg = a.routing.config(name)?;
        cfg.id = a.process.id("router");
        cfg.worker_tls = worker_tls;
        cfg.cluster_token = Some(token);
        run_router(
            front,
            cfg,
            registry,
            a.process.registry.cluster.clone(),
            RouterListeners {
                grpc: listener,
                http,
                tls,
            },
            shutdown,
            a.process.drain,
        )
        .await
    })
}
