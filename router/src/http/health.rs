//! `GET /health`: 200 while the router can route (at least one decode worker for its model
//! in its registry view), 503 otherwise; the body says what the router sees.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use duet_discovery::Role;

use crate::service::GenerationService;

pub(super) async fn health(
    State(svc): State<GenerationService>,
) -> (StatusCode, Json<serde_json::Value>) {
    let snap = svc.view().snapshot();
    let model = svc.model_name();
    let count = |role| {
        snap.workers(role)
            .filter(|w| w.model == model && !w.draining)
            .count()
    };
    let (prefill, decode) = (count(Role::Prefill), count(Role::Decode));
    let status = if decode > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": if decode > 0 { "ok" } else { "no decode workers" },
        "model": model,
        "prefill_workers": prefill,
        "decode_workers": decode,
        "registry_stale": snap.stale,
    });
    (status, Json(body))
}
