//! One request's KV transfer, driven by messages from the engine thread.
//!
//! The engine thread never waits on the network: it sends `Begin` / `Layer` / `Finish`
//! for each chunk and `Complete` (or `Fail`) at the end; this task pushes them through a
//! pooled sender and answers the caller once the decode worker acknowledged every chunk.
//! On any error the sender is aborted and dropped (never returned to the pool), the task
//! ends (its closed channel makes the engine drop the prefill at its next step), and the
//! caller gets the error.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use duet_kv_transfer::{AnySender, Connector, Endpoint, KvSender, Route, TransferDesc};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use duet_telemetry::names::{
    KV_TRANSFER_BYTES_TOTAL, KV_TRANSFER_FAILURES_TOTAL, KV_TRANSFER_SECONDS,
    KV_TRANSFER_TRANSFERS_TOTAL, KV_TRANSFER_WIRE_BYTES_TOTAL,
};

use crate::error::PrefillError;
use crate::handle::PrefillResult;

pub(crate) enum Msg {
    Begin(TransferDesc),
    Layer {
        layer: u32,
        k: Vec<Bytes>,
        v: Vec<Bytes>,
    },
    Finish,
    /// The result, and when the last forward ended (the exposed transfer time starts).
    Complete(PrefillResult, Instant),
    Fail(PrefillError),
}

pub(crate) type Reply = oneshot::Sender<Result<PrefillResult, PrefillError>>;

/// Spawns the task; returns the channel the engine thread feeds.
pub(crate) fn spawn(
    rt: &tokio::runtime::Handle,
    connector: Arc<Connector>,
    route: Route,
    reply: Reply,
    span: tracing::Span,
) -> mpsc::UnboundedSender<Msg> {
    let (tx, rx) = mpsc::unbounded_channel();
    rt.spawn(run(connector, route, rx, reply).instrument(span));
    tx
}

/// Starts a transfer on the request's sender, connecting one first (along `route`, so an
/// unusable shm endpoint falls back to tcp); `sender` then holds the endpoint it belongs to.
async fn begin(
    connector: &Connector,
    route: &Route,
    sender: &mut Option<(Endpoint, AnySender)>,
    desc: TransferDesc,
) -> Result<(), duet_kv_transfer::Error> {
    if let Some((_, s)) = sender.as_mut() {
        return s.begin(desc).await;
    }
    // A pooled connection may have been closed by the peer while idle: retry once fresh.
    let (mut ep, mut s) = connector.connect(route, false).await?;
    if s.begin(desc.clone()).await.is_err() {
        (ep, s) = connector.connect(route, true).await?;
        s.begin(desc).await?;
    }
    *sender = Some((ep, s));
    Ok(())
}

async fn run(
    connector: Arc<Connector>,
    route: Route,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    reply: Reply,
) {
    let mut sender: Option<(Endpoint, AnySender)> = None;
    let mut failed: Option<PrefillError> = None;
    let mut first_layer: Option<Instant> = None;
    let mut bytes = 0u64;
    while let Some(msg) = rx.recv().await {
        let r = match msg {
            Msg::Begin(desc) => begin(&connector, &route, &mut sender, desc).await,
            Msg::Layer { layer, k, v } => {
                first_layer.get_or_insert_with(Instant::now);
                match sender.as_mut() {
                    Some((_, s)) => s.send_layer_bytes(layer, k, v).await,
                    None => Ok(()),
                }
            }
            Msg::Finish => match sender.as_mut() {
                Some((_, s)) => s.finish().await.map(|receipt| {
                    let transport = s.kind().as_str();
                    bytes += receipt.payload_bytes;
                    metrics::counter!(
                        KV_TRANSFER_BYTES_TOTAL,
                        "direction" => "sent",
                        "transport" => transport
                    )
                    .increment(receipt.payload_bytes);
                    metrics::counter!(
                        KV_TRANSFER_WIRE_BYTES_TOTAL,
                        "direction" => "sent",
                        "compression" => receipt.compression.as_str()
                    )
                    .increment(receipt.wire_bytes);
                    metrics::counter!(
                        KV_TRANSFER_TRANSFERS_TOTAL,
                        "direction" => "sent",
                        "transport" => transport
                    )
                    .increment(1);
                }),
                None => Ok(()),
            },
            Msg::Complete(mut result, compute_done) => {
                // What the transfer adds to time-to-first-token: from the end of the last
                // forward until the decode worker acknowledged the last layer (earlier layers
                // travelled while later ones computed).
                result.kv_transfer_seconds = compute_done.elapsed().as_secs_f64();
                result.kv_stream_seconds = first_layer.map_or(0.0, |t| t.elapsed().as_secs_f64());
                result.kv_bytes = bytes;
                tracing::Span::current().record("kv_bytes", bytes);
                metrics::histogram!(KV_TRANSFER_SECONDS).record(result.kv_transfer_seconds);
                if let Some((ep, s)) = sender.take() {
                    connector.checkin(&ep, s);
                }
                let _ = reply.send(Ok(result));
                return;
            }
            Msg::Fail(e) => {
                failed = Some(e);
                break;
            }
        };
        if let Err(e) = r {
            metrics::counter!(
                KV_TRANSFER_FAILURES_TOTAL,
                "direction" => "sent",
                "reason" => e.metric_label()
            )
            .increment(1);
            // Stop at once: dropping the channel tells the engine to abandon the prefill.
            failed = Some(PrefillError::Transfer(e));
            break;
        }
    }
    if let Some((_, mut s)) = sender.take() {
        let _ = s.abort().await;
    }
    let _ = reply.send(Err(failed.unwrap_or(PrefillError::ShuttingDown)));
}
