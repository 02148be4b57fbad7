//! Keeps the [`KvIndex`] fed: one subscription to `duet.v1.KvCache/Subscribe` per worker
//! in the cluster view, started when the worker appears, ended (and the worker forgotten)
//! when it leaves.
//!
//! A subscription applies the snapshot and then each batch; a gap in the sequence numbers
//! starts it again from a new snapshot at once. A broken stream forgets the worker (the
//! router then routes it on load alone) and retries with a backoff of up to
//! [`MAX_BACKOFF`]. A worker without the service (UNIMPLEMENTED) is left alone until it
//! registers again. Every loop ends with the view (the router's shutdown).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use duet_discovery::ClusterView;
use duet_proto::v1 as pb;
use duet_telemetry::names::{ROUTER_KV_INDEX_BLOCKS, ROUTER_KV_INDEX_RESYNCS_TOTAL};
use tokio_util::sync::CancellationToken;

use crate::kv_index::{Applied, KvIndex};
use crate::workers::Workers;

/// Longest wait before subscribing again to a worker whose stream broke.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Follows `view` until it closes; `stop` ends it earlier.
pub async fn run(
    mut view: ClusterView,
    workers: Arc<Workers>,
    index: Arc<KvIndex>,
    stop: CancellationToken,
) {
    // Registry key -> (gRPC address, that subscription's token).
    let mut following: HashMap<String, (String, CancellationToken)> = HashMap::new();
    loop {
        let snap = view.snapshot();
        following.retain(|key, (addr, token)| {
            let same = snap.workers.get(key).is_some_and(|w| &w.grpc_addr == addr);
            if !same {
                token.cancel();
                index.forget(key);
            }
            same
        });
        for (key, w) in &snap.workers {
            if following.contains_key(key) {
                continue;
            }
            let token = stop.child_token();
            following.insert(key.clone(), (w.grpc_addr.clone(), token.clone()));
            tokio::spawn(follow(
                key.clone(),
                w.grpc_addr.clone(),
                workers.clone(),
                index.clone(),
                token,
            ));
        }
        metrics::gauge!(ROUTER_KV_INDEX_BLOCKS).set(index.total_blocks() as f64);
        tokio::select! {
            _ = stop.cancelled() => break,
            r = view.changed() => if r.is_err() { break },
        }
    }
    for (key, (_, token)) in following {
        token.cancel();
        index.forget(&key);
    }
}

/// One worker's subscription, until `stop`.
async fn follow(
    key: String,
    addr: String,
    workers: Arc<Workers>,
    index: Arc<KvIndex>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(200);
    let mut first = true;
    loop {
        if !std::mem::replace(&mut first, false) {
            metrics::counter!(ROUTER_KV_INDEX_RESYNCS_TOTAL).increment(1);
        }
        match subscribe_once(&key, &addr, &workers, &index, &stop).await {
            Ended::Stopped => {
                // A batch applied after `run` forgot the worker must not outlive this task.
                // (A follower started since for a new address recovers: its next batch
                // finds no entry, reads as a gap and subscribes again.)
                index.forget(&key);
                return;
            }
            Ended::Unsupported => {
                tracing::debug!(worker = %key, "worker serves no KV events; routed on load");
                index.forget(&key);
                return;
            }
            Ended::Gap => {
                tracing::debug!(worker = %key, "KV events lost: subscribing again");
                backoff = Duration::from_millis(200);
                continue;
            }
            Ended::Broken(reason) => {
                tracing::debug!(worker = %key, %reason, "KV event stream broke");
                index.forget(&key);
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

enum Ended {
    Stopped,
    Unsupported,
    Gap,
    Broken(String),
}

async fn subscribe_once(
    key: &str,
    addr: &str,
    workers: &Workers,
    index: &KvIndex,
    stop: &CancellationToken,
) -> Ended {
    let mut client = match workers.kv_cache(addr) {
        Ok(c) => c,
        Err(e) => return Ended::Broken(e.to_string()),
    };
    let stream = tokio::select! {
        _ = stop.cancelled() => return Ended::Stopped,
        r = client.subscribe(pb::KvSubscribeRequest {}) => r,
    };
    let mut stream = match stream {
        Ok(s) => s.into_inner(),
        Err(s) if s.code() == tonic::Code::Unimplemented => return Ended::Unsupported,
        Err(s) => return Ended::Broken(s.to_string()),
    };
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return Ended::Stopped,
            m = stream.message() => m,
        };
        match msg {
            Ok(Some(batch)) => {
                if index.apply(key, &batch) == Applied::Gap {
                    return Ended::Gap;
                }
                metrics::gauge!(ROUTER_KV_INDEX_BLOCKS).set(index.total_blocks() as f64);
            }
            Ok(None) => return Ended::Broken("stream ended".into()),
            Err(s) => return Ended::Broken(s.to_string()),
        }
    }
}
