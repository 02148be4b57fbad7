//! The router as a server: both public doors (gRPC `duet.v1.Generation` + `duet.v1.Cluster`,
//! and the OpenAI-compatible HTTP door with `/health` and `/metrics`) over a cluster view of
//! the registry, until shutdown. `duet router`, `duet up` and in-process tests start it the
//! same way, on listeners they bound themselves (`127.0.0.1:0` in tests).
//!
//! While it serves, it publishes the requests it finished recently for the planner
//! ([`crate::recent`]).
//!
//! Shutdown: when `shutdown` fires both doors stop accepting, health turns NOT_SERVING, and
//! open calls and streams get up to `drain` to finish; [`serve`] returns once both are done.

use std::sync::Arc;
use std::time::Duration;

use duet_discovery::{ClusterView, Registry};
use duet_engine::TextFrontend;
use duet_serving::error::ServeError;
use duet_serving::tls::ServerTls;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{ClusterService, GenerationService, RouterConfig};

/// The router's listeners.
pub struct RouterListeners {
    /// The public gRPC door.
    pub grpc: TcpListener,
    /// The HTTP door (OpenAI-compatible API, `/health`, `/metrics`).
    pub http: TcpListener,
    /// TLS on both doors (`None`: plain text).
    pub tls: Option<ServerTls>,
}

/// Serves the public doors for the workers of `cluster` in `registry` until `shutdown`.
pub async fn serve(
    front: Arc<TextFrontend>,
    cfg: RouterConfig,
    registry: Arc<dyn Registry>,
    cluster: String,
    listeners: RouterListeners,
    shutdown: CancellationToken,
    drain: Duration,
) -> Result<(), ServeError> {
    let metrics = duet_telemetry::install().map_err(|e| ServeError::Metrics(e.to_string()))?;
    duet_telemetry::spawn_upkeep(metrics.clone(), shutdown.clone());
    let view = ClusterView::start(registry.clone(), cluster.clone(), shutdown.child_token());
    let ops = ClusterService::new(view.clone(), cfg.api_keys.clone());
    let limits = cfg.http;
    let router_id = cfg.id.clone();
    let svc = GenerationService::new(front, cfg, view);
    tokio::spawn(crate::recent::publish(
        registry,
        cluster,
        router_id,
        svc.recent(),
        shutdown.child_token(),
    ));
    let app = crate::http::app(svc.clone(), duet_telemetry::metrics_router(metrics));
    let http = {
        let tls = listeners.tls.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            crate::http::serve(listeners.http, tls.as_ref(), app, limits, shutdown, drain).await
        })
    };
    let routes = tonic::service::Routes::new(svc.into_server()).add_service(ops.into_server());
    duet_serving::server::serve(
        listeners.grpc,
        listeners.tls.as_ref(),
        // The public doors: clients are checked by API key, not by the cluster token.
        duet_serving::cluster_auth::RequireToken::new(None),
        routes,
        &["duet.v1.Generation", "duet.v1.Cluster"],
        shutdown,
        drain,
    )
    .await?;
    http.await
        .map_err(|_| ServeError::Task("the HTTP door"))?
        .map_err(|source| ServeError::Io {
            during: "serving the HTTP door",
            source,
        })
}
