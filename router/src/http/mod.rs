//! The router's HTTP door: OpenAI-compatible endpoints, `/health` and `/metrics`.
//!
//! Requests enter the same [`GenerationService::start`] as the gRPC door, so validation,
//! admission, routing, cancellation and metrics are shared: closing the HTTP connection
//! drops the event receiver, which cancels the request and frees its KV on the workers.

mod api_error;
mod completions;
pub mod connections;
#[doc(hidden)]
pub mod fuzzing;
mod health;
mod openai_attention;
pub mod openai_request;
pub mod tls_listener;

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::service::GenerationService;
pub use connections::HttpLimits;
use duet_serving::tls::ServerTls;
use tls_listener::DoorListener;

/// The HTTP door's routes; `extra` (e.g. `/metrics`) is merged in.
pub fn app(svc: GenerationService, extra: axum::Router) -> axum::Router {
    axum::Router::new()
        .route("/health", axum::routing::get(health::health))
        .route("/v1/models", axum::routing::get(completions::models))
        .route(
            "/v1/completions",
            axum::routing::post(completions::completions),
        )
        .route(
            "/v1/chat/completions",
            axum::routing::post(completions::chat_completions),
        )
        .with_state(svc)
        .merge(extra)
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
}

/// A known path with the wrong method: OpenAI's error shape, 405.
async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> api_error::ApiError {
    api_error::ApiError {
        status: axum::http::StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{method} is not allowed on {}", uri.path()),
        param: None,
        retry_after: None,
    }
}

/// Anything else: OpenAI's error shape, 404.
async fn unknown_route(uri: axum::http::Uri) -> api_error::ApiError {
    api_error::ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        message: format!("no route {}", uri.path()),
        param: None,
        retry_after: None,
    }
}

/// Serves `app` on `listener` (plain HTTP, or HTTPS with `tls`) with `limits` until
/// `shutdown` fires, then lets open responses finish for up to `drain` (long streams are cut
/// at the deadline).
pub async fn serve(
    listener: TcpListener,
    tls: Option<&ServerTls>,
    app: axum::Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
    drain: Duration,
) -> std::io::Result<()> {
    let listener = match tls {
        Some(tls) => DoorListener::tls(
            listener,
            tls.rustls(&[b"http/1.1"])
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
            shutdown.child_token(),
        )?,
        None => DoorListener::plain(listener),
    };
    connections::serve_connections(listener, app, limits, shutdown, drain).await
}
