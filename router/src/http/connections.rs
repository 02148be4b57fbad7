//! The HTTP door's connections: accepted, bounded and timed here, then served by hyper.
//!
//! Limits (all configurable, see [`HttpLimits`]):
//! - at most `max_connections` open at once; one more is answered `503` with `Retry-After`
//!   and closed at once, so a flood of idle sockets never starves the process of file
//!   descriptors or memory;
//! - a client must send a complete request head within `header_timeout` of connecting, and
//!   of its previous response ending: hyper starts that timer whenever a connection waits
//!   for a request, so it is also the idle keep-alive timeout (a slow-headers client and an
//!   idle connection are both closed);
//! - the body has its own deadline (`body_timeout`, applied where bodies are read, in
//!   `completions`), answered `408`.
//!
//! Shutdown: the accept loop stops, hyper's graceful shutdown lets requests in flight
//! finish (new ones on kept-alive connections are refused), and after `drain` whatever
//! still runs is dropped.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::ConnectInfo;
use axum::serve::Listener;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::tls_listener::{ClientAddr, DoorListener};
use duet_telemetry::names::{ROUTER_HTTP_CONNECTIONS, ROUTER_HTTP_CONNECTIONS_REFUSED_TOTAL};

/// The HTTP door's connection limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time to send a complete request head, from connecting or from the previous
    /// response's end (so also the idle keep-alive timeout).
    pub header_timeout: Duration,
    /// Time to send the whole request body once its head arrived.
    pub body_timeout: Duration,
    /// Connections open at once; more are refused with 503.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// What a refused connection reads before it is closed (OpenAI's error shape, as every
/// other refusal of this door).
fn refusal() -> Vec<u8> {
    const BODY: &str = "{\"error\":{\"code\":503,\"message\":\"too many open connections\",\
                        \"param\":null,\"type\":\"service_unavailable_error\"}}";
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    )
    .into_bytes()
}

/// Serves `app` on `listener` with `limits` until `shutdown` fires, then drains for at most
/// `drain`.
pub async fn serve_connections(
    mut listener: DoorListener,
    app: axum::Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
    drain: Duration,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = metrics::gauge!(ROUTER_HTTP_CONNECTIONS);
    let refused = metrics::counter!(ROUTER_HTTP_CONNECTIONS_REFUSED_TOTAL);
    loop {
        let (io, peer) = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.cancelled() => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refused.increment(1);
            tracing::debug!(%peer, "HTTP door: connection limit reached, refusing");
            tokio::spawn(async move {
                let mut io = io;
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    io.write_all(&refusal()).await?;
                    io.shutdown().await
                })
                .await;
            });
            continue;
        };
        let app = app.clone();
        let svc =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                // What `into_make_service_with_connect_info` would add: the per-client limits
                // read it.
                req.extensions_mut().insert(ConnectInfo(ClientAddr(peer)));
                app.clone().oneshot(req)
            });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .keep_alive(true)
            .serve_connection(TokioIo::new(io), svc);
        let conn = graceful.watch(conn);
        let open = open.clone();
        open.increment(1.0);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended");
            }
            open.decrement(1.0);
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("HTTP drain deadline passed: closing open responses");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_well_formed_response_in_openais_error_shape() {
        let r = String::from_utf8(refusal()).unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], 503);
        assert_eq!(v["error"]["type"], "service_unavailable_error");
    }
}
