//! The Prometheus recorder and the `/metrics` endpoint.
//!
//! [`install`] builds the recorder once per process with explicit histogram buckets per
//! metric and describes every metric; later calls return the same handle. [`serve_metrics`]
//! serves the text exposition on a listener the caller bound (port 0 works: the caller knows
//! the address), until its cancellation token fires; [`metrics_router`] gives the same route
//! to mount on another axum server (the router's HTTP door).

use std::sync::OnceLock;
use std::time::Duration;

use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::names::*;
use crate::Error;

/// End-to-end latencies: milliseconds to minutes.
const LATENCY: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Per-token and per-step times: a millisecond to a second.
const PER_TOKEN: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
];
/// Engine steps: a millisecond (one decode row) to ten seconds (a long prefill chunk).
const STEP: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// KV transfers: 100 µs to a second.
const TRANSFER: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];
/// Prompt tokens in one prefill batch.
const BATCH_TOKENS: &[f64] = &[
    16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];
/// Sequences in one decode step.
const BATCH_SEQS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// The buckets of every histogram duet records.
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (ROUTER_TTFT_SECONDS, LATENCY),
    (ROUTER_E2E_SECONDS, LATENCY),
    (ROUTER_QUEUE_SECONDS, LATENCY),
    (ROUTER_TPOT_SECONDS, PER_TOKEN),
    (ROUTER_ITL_SECONDS, PER_TOKEN),
    (PREFILL_BATCH_SECONDS, LATENCY),
    (PREFILL_REQUEST_SECONDS, LATENCY),
    (PREFILL_BATCH_TOKENS, BATCH_TOKENS),
    (DECODE_STEP_SECONDS, STEP),
    (DECODE_BATCH_SIZE, BATCH_SEQS),
    (KV_TRANSFER_SECONDS, TRANSFER),
    (WORKER_ROLE_SWITCH_SECONDS, LATENCY),
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (first call) and describes every metric.
/// Idempotent: later calls return the installed handle.
pub fn install() -> Result<PrometheusHandle, Error> {
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = INSTALLING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let mut b = PrometheusBuilder::new();
    for (name, buckets) in HISTOGRAM_BUCKETS {
        b = b
            .set_buckets_for_metric(Matcher::Full((*name).to_string()), buckets)
            .map_err(|e| Error::Recorder(Box::new(e)))?;
    }
    let recorder = b.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| Error::Recorder(Box::new(e)))?;
    crate::describe_all();
    let _ = HANDLE.set(handle.clone());
    Ok(handle)
}

/// An axum router answering `GET /metrics` with the text exposition.
pub fn metrics_router(handle: PrometheusHandle) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        get(move || {
            let h = handle.clone();
            async move {
                (
                    [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
                    h.render(),
                )
            }
        }),
    )
}

/// Runs the recorder's upkeep (draining histogram samples into their buckets) every few
/// seconds until `shutdown` fires. Without it, histogram samples pile up between scrapes:
/// every process that installs the recorder runs it once.
pub fn spawn_upkeep(handle: PrometheusHandle, shutdown: CancellationToken) {
    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if STARTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => handle.run_upkeep(),
            }
        }
    });
}

/// Serves `/metrics` on `listener` until `shutdown` fires (and runs the upkeep).
pub async fn serve_metrics(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    spawn_upkeep(handle.clone(), shutdown.clone());
    axum::serve(listener, metrics_router(handle))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(Error::Serve)
}
