//! Receiving KV from prefill workers.
//!
//! Each authenticated connection runs [`receive_loop`]: transfer after transfer, a
//! [`StagingSink`] accepts a header only for blocks the engine reserved for that request,
//! collects one layer frame's regions, and at the end of each layer hands them to the
//! engine thread, which copies them into the reserved blocks between two steps (the
//! engine thread is the only writer of the pool). A layer is therefore copied once from the
//! connection into the pool; the sequence's KV is never assembled anywhere else.
//!
//! When a transfer completes, the engine learns how many prompt tokens are now present;
//! when it fails after its header was accepted, the engine marks the reservation failed
//! (the router retries elsewhere, the blocks are freed).

use bytes::Bytes;
use duet_kv_transfer::backend::shm::ShmPulls;
use duet_kv_transfer::{AnyReceiver, Inbound, KvKind as WireKind, KvReceiver, KvSink, SinkError};
use duet_telemetry::names::{
    KV_TRANSFER_BYTES_TOTAL, KV_TRANSFER_FAILURES_TOTAL, KV_TRANSFER_SHM_PULLS_TOTAL,
    KV_TRANSFER_TRANSFERS_TOTAL, KV_TRANSFER_WIRE_BYTES_TOTAL,
};
use tokio_util::sync::CancellationToken;

use crate::handle::DecodeHandle;

/// Collects the regions of the layer frame being received.
pub struct StagingSink {
    handle: DecodeHandle,
    layer: Option<u32>,
    regions: Vec<(u32, duet_engine::KvKind, Vec<u8>)>,
    adopted: Vec<(u32, duet_engine::KvKind, Bytes)>,
    region_bytes: usize,
}

fn kind(k: WireKind) -> duet_engine::KvKind {
    match k {
        WireKind::K => duet_engine::KvKind::K,
        WireKind::V => duet_engine::KvKind::V,
    }
}

impl StagingSink {
    /// A sink writing into `handle`'s reserved blocks.
    pub fn new(handle: DecodeHandle) -> StagingSink {
        let region_bytes = handle.layout().region_bytes();
        StagingSink {
            handle,
            layer: None,
            regions: Vec::new(),
            adopted: Vec::new(),
            region_bytes,
        }
    }

    fn start_layer(&mut self, layer: u32) {
        if self.layer != Some(layer) {
            self.layer = Some(layer);
            self.regions.clear();
            self.adopted.clear();
        }
    }
}

impl KvSink for StagingSink {
    fn is_reserved(&self, request_id: u64, block: u32) -> bool {
        self.handle.is_reserved(request_id, block)
    }

    fn region_mut(&mut self, layer: u32, k: WireKind, block: u32) -> Result<&mut [u8], SinkError> {
        self.start_layer(layer);
        self.regions
            .push((block, kind(k), vec![0u8; self.region_bytes]));
        // The receiver fills the whole region it is handed.
        crate::copies::staged(self.region_bytes);
        match self.regions.last_mut() {
            Some(r) => Ok(&mut r.2),
            None => Err(SinkError::new(
                duet_kv_transfer::ErrorClass::Internal,
                "staging region vanished",
            )),
        }
    }

    fn adopt_region(
        &mut self,
        layer: u32,
        k: WireKind,
        block: u32,
        data: Bytes,
    ) -> Result<(), SinkError> {
        self.start_layer(layer);
        if data.len() != self.region_bytes {
            return Err(SinkError::new(
                duet_kv_transfer::ErrorClass::Internal,
                format!(
                    "region of {} bytes, expected {}",
                    data.len(),
                    self.region_bytes
                ),
            ));
        }
        self.adopted.push((block, kind(k), data));
        Ok(())
    }

    fn layer_done(&mut self, request_id: u64, layer: u32) {
        let mut regions: Vec<(u32, duet_engine::KvKind, Bytes)> = std::mem::take(&mut self.adopted);
        regions.extend(
            self.regions
                .drain(..)
                .map(|(b, k, v)| (b, k, Bytes::from(v))),
        );
        self.layer = None;
        self.handle.import(request_id, layer as usize, regions);
    }
}

/// Counts the layer PULLs served between `before` and `now`, by source.
fn record_shm_pulls(before: &ShmPulls, now: &ShmPulls) {
    for (source, n) in [
        (
            "send_arena",
            now.send_arena.saturating_sub(before.send_arena),
        ),
        (
            "process_memory",
            now.process_memory.saturating_sub(before.process_memory),
        ),
    ] {
        if n > 0 {
            metrics::counter!(KV_TRANSFER_SHM_PULLS_TOTAL, "source" => source).increment(n);
        }
    }
}

/// Receives transfers on one connection until the peer closes, stays idle past the
/// configured timeout, or `cancel` fires.
pub async fn receive_loop(mut rx: AnyReceiver, handle: DecodeHandle, cancel: CancellationToken) {
    let mut sink = StagingSink::new(handle.clone());
    let transport = rx.kind().as_str();
    let mut pulls = rx.shm_pulls().unwrap_or_default();
    loop {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = rx.receive(&mut sink) => r,
        };
        if let Some(now) = rx.shm_pulls() {
            record_shm_pulls(&pulls, &now);
            pulls = now;
        }
        match r {
            Ok(receipt) => {
                let d = &receipt.desc;
                metrics::counter!(
                    KV_TRANSFER_BYTES_TOTAL,
                    "direction" => "received",
                    "transport" => transport
                )
                .increment(receipt.payload_bytes);
                metrics::counter!(
                    KV_TRANSFER_WIRE_BYTES_TOTAL,
                    "direction" => "received",
                    "compression" => receipt.compression.as_str()
                )
                .increment(receipt.wire_bytes);
                metrics::counter!(
                    KV_TRANSFER_TRANSFERS_TOTAL,
                    "direction" => "received",
                    "transport" => transport
                )
                .increment(1);
                handle.transfer_done(d.request_id, (d.token_start + d.token_count) as usize);
            }
            Err(e) => {
                if !matches!(e, duet_kv_transfer::Error::PeerClosed { .. }) {
                    metrics::counter!(
                        KV_TRANSFER_FAILURES_TOTAL,
                        "direction" => "received",
                        "reason" => e.metric_label()
                    )
                    .increment(1);
                    tracing::warn!(
                        peer = %rx.peer(),
                        transport,
                        reason = e.metric_label(),
                        error = %e,
                        "KV transfer refused; its reserved blocks are released"
                    );
                }
                if let duet_kv_transfer::Error::Aborted { request_id, .. } = &e {
                    handle.transfer_failed(*request_id, e.to_string());
                    // The connection stays usable after an aborted transfer.
                    continue;
                }
                if !matches!(e, duet_kv_transfer::Error::PeerClosed { .. }) {
                    tracing::debug!(error = %e, "KV connection closed");
                }
                return;
            }
        }
    }
}

/// Serves KV on every listener of `inbound` (tcp, shm for same-host prefill workers, the
/// in-process hub, UCX control connections in an rdma build) into `handle` until `cancel`
/// fires.
pub async fn serve(inbound: Inbound, handle: DecodeHandle, cancel: CancellationToken) {
    let c = cancel.clone();
    duet_kv_transfer::serve_inbound(inbound, cancel, move |rx| {
        tokio::spawn(receive_loop(rx, handle.clone(), c.clone()));
    })
    .await
}
