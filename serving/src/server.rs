//! Serving a tonic router the way every duet process does: with `grpc.health.v1` (the
//! overall service and each named service SERVING while up), server reflection for every
//! duet proto (`grpc.reflection.v1` and `v1alpha`), and graceful shutdown.
//!
//! Shutdown sequence (linkerd2-proxy style): `shutdown` fires -> health NOT_SERVING -> the
//! server stops accepting and lets in-flight calls finish -> after `drain` the remaining
//! calls are dropped.

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

use crate::cluster_auth::RequireToken;
pub use crate::error::ServeError;
use crate::tls::ServerTls;

/// Health reporter handle, to flip services to NOT_SERVING.
pub type Health = tonic_health::server::HealthReporter;

/// Serves `routes` (built with `Routes::new(svc).add_service(...)`) on `listener`, with
/// health (the named `services` and "" SERVING) and reflection, until `shutdown` fires; then
/// drains for at most `drain`. With `tls`, every connection is TLS (mutual when `tls` names
/// a client CA): health and reflection included. `auth` refuses every call but health that
/// lacks the cluster token (workers; the router's public doors pass an open one).
pub async fn serve(
    listener: TcpListener,
    tls: Option<&ServerTls>,
    auth: RequireToken,
    routes: Routes,
    services: &[&str],
    shutdown: CancellationToken,
    drain: Duration,
) -> Result<(), ServeError> {
    let (health, health_svc) = tonic_health::server::health_reporter();
    for s in services {
        health
            .set_service_status(*s, tonic_health::ServingStatus::Serving)
            .await;
    }
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    // Reflection in both versions: `grpc.reflection.v1`, and `v1alpha`, the only one Python's
    // grpcio-reflection and older grpcurl speak.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(duet_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1().map_err(ServeError::Reflection)?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(ServeError::Reflection)?;
    let routes = routes
        .add_service(health_svc)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let stopping = CancellationToken::new();
    let names: Vec<String> = services.iter().map(|s| s.to_string()).collect();
    let watcher = {
        let shutdown = shutdown.clone();
        let stopping = stopping.clone();
        async move {
            shutdown.cancelled().await;
            for s in &names {
                health
                    .set_service_status(s, tonic_health::ServingStatus::NotServing)
                    .await;
            }
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            stopping.cancel();
        }
    };
    tokio::spawn(watcher);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls.tonic())
            .map_err(ServeError::Transport)?;
    }
    let server = builder
        .layer(auth)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_routes(routes)
        .serve_with_incoming_shutdown(nodelay_incoming(listener), {
            let stopping = stopping.clone();
            async move { stopping.cancelled().await }
        });
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return r.map_err(ServeError::Transport),
        _ = stopping.cancelled() => {}
    }
    match tokio::time::timeout(drain, &mut server).await {
        Ok(r) => r.map_err(ServeError::Transport),
        Err(_) => {
            tracing::warn!(
                ?drain,
                "drain deadline passed; dropping the calls still running"
            );
            Ok(())
        }
    }
}

/// Accepted connections with TCP_NODELAY: small gRPC frames (one token) must not wait for
/// Nagle's algorithm to meet the peer's delayed ACK (tens of milliseconds per message).
pub fn nodelay_incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|s| {
        let s = s?;
        s.set_nodelay(true)?;
        Ok(s)
    })
}

/// A token cancelled on SIGTERM or Ctrl-C.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let term = async {
            #[cfg(unix)]
            {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut s) => {
                        s.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            }
            #[cfg(not(unix))]
            std::future::pending::<()>().await
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        tracing::info!("shutdown signal received");
        t.cancel();
    });
    token
}
