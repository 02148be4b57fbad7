//! What both workers do to serve: advertise their gRPC address, register in the registry
//! with live capacity, check the peers requests name against the registry's view, and
//! serve their services behind the cluster token until shutdown.
//!
//! Shutdown order ([`WorkerServer::serve_until`]): the registry key is deleted first
//! (routers stop choosing this worker), then health goes NOT_SERVING and the server drains
//! in-flight calls up to the deadline; the caller stops its engine thread after that.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use duet_discovery::{
    Capacity, ClusterView, Registration, RegistrationOptions, Registry, Role, ViewOptions,
    WorkerRecord,
};
use duet_serving::cluster_auth::{ClusterToken, RequireToken};
use duet_serving::error::ServeError;
use duet_serving::tls::{ClientTls, ServerTls};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How often a worker hands its live numbers to the registration (which coalesces them).
pub const CAPACITY_POLL: Duration = Duration::from_millis(200);

/// Why a worker could not start or stopped serving (startup failures: they reach the
/// process's `main`, never a client).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("registry: {0}")]
    Registry(#[from] duet_discovery::Error),
    #[error("KV transfer: {0}")]
    Transfer(#[from] duet_kv_transfer::Error),
    #[error("engine: {0}")]
    Engine(#[from] duet_engine::EngineError),
    #[error("{during}: {source}")]
    Io {
        during: String,
        #[source]
        source: std::io::Error,
    },
    /// A setting that cannot work here (named in the message).
    #[error("{0}")]
    Config(String),
    /// The worker's own engine did not start.
    #[error("{0}")]
    Worker(String),
}

impl StartError {
    /// An I/O failure while doing `during`.
    pub fn io(during: impl Into<String>, source: std::io::Error) -> StartError {
        StartError::Io {
            during: during.into(),
            source,
        }
    }
}

/// Where a worker receives (decode) or sends (prefill) KV over same-host shared memory.
#[derive(Debug, Clone)]
pub struct ShmSetting {
    /// Directory of the decode worker's socket and ring files.
    pub dir: PathBuf,
    /// When shm cannot be set up, the worker stops (asked for explicitly); otherwise it says
    /// so and uses tcp alone.
    pub required: bool,
    /// Prefill workers: their KV pool lives in a send arena, a sealed memfd the decode
    /// workers of the host map and copy layers from (false: ordinary memory; decode workers
    /// send nothing).
    pub pool_in_arena: bool,
}

/// A worker's gRPC side and its membership in a cluster.
pub struct WorkerServer {
    pub registry: Arc<dyn Registry>,
    pub cluster: String,
    pub registration: RegistrationOptions,
    /// Model name clients use (the registry record's `model`).
    pub model_name: String,
    /// The bound gRPC listener.
    pub grpc: TcpListener,
    /// Host other processes reach this worker at.
    pub advertise_host: String,
    pub drain: Duration,
    /// TLS on the gRPC server (mutual when it names a client CA).
    pub tls: Option<ServerTls>,
    /// TLS of this worker's calls to other workers.
    pub client_tls: Option<ClientTls>,
    /// The cluster token: checked on every call but health, carried on calls to peers.
    pub token: ClusterToken,
    /// The process follows role requests (`duet worker`); published in its record.
    pub switchable: bool,
}

impl WorkerServer {
    /// The address routers reach this worker's gRPC service at.
    pub fn grpc_addr(&self) -> Result<String, StartError> {
        let port = self
            .grpc
            .local_addr()
            .map_err(|e| StartError::io("reading the gRPC listener's address", e))?
            .port();
        Ok(format!(
            "{}://{}:{port}",
            duet_serving::tls::scheme(self.tls.is_some()),
            self.advertise_host,
        ))
    }

    /// This worker's registry record (capacity and endpoints are the caller's).
    pub fn record(
        &self,
        role: Role,
        id: &str,
        fingerprint: &str,
    ) -> Result<WorkerRecord, StartError> {
        let mut r = WorkerRecord::new(self.cluster.clone(), role, id, self.grpc_addr()?);
        r.model = self.model_name.clone();
        r.fingerprint = fingerprint.to_string();
        r.switchable = self.switchable;
        Ok(r)
    }

    /// The cluster as the registry shows it, for checking the peers requests name.
    pub fn peers(&self, stop: &CancellationToken) -> ClusterView {
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

    /// Registers `rec` with its current capacity, then hands the live numbers to the
    /// registration every [`CAPACITY_POLL`] until `stop` fires.
    pub async fn register_and_publish(
        &self,
        mut rec: WorkerRecord,
        stop: CancellationToken,
        capacity: impl Fn() -> Capacity + Send + 'static,
    ) -> Result<Arc<Registration>, StartError> {
        rec.capacity = capacity();
        let reg = Arc::new(
            Registration::start(
                self.registry.clone(),
                rec,
                self.registration.clone(),
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

    /// Serves `routes` behind the cluster token until `shutdown`, deregistering `reg` first.
    pub async fn serve_until(
        self,
        routes: tonic::service::Routes,
        services: &[&str],
        reg: Arc<Registration>,
        shutdown: CancellationToken,
    ) -> Result<(), StartError> {
        let auth = RequireToken::new(Some(self.token.clone()));
        let stop_server = CancellationToken::new();
        let s = stop_server.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            if let Err(e) = reg.deregister().await {
                tracing::warn!(error = %e, "deleting the registry key");
            }
            s.cancel();
        });
        duet_serving::server::serve(
            self.grpc,
            self.tls.as_ref(),
            auth,
            routes,
            services,
            stop_server,
            self.drain,
        )
        .await?;
        Ok(())
    }
}
