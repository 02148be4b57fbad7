//! Receiving KV from prefill workers.
//!
//! Each authenticated connection runs [`receive_loop`]: transfer after transfer, a
//! [`PoolSink`] accepts a header only for blocks the engine reserved for that request,
//! takes the reservation's lease ([`crate::leases`]) for the span of the transfer and hands
//! the transport the reserved regions of the engine's own pool to fill: a tcp read lands in
//! the pool, an shm pull is one memcpy from the sender's arena into it. No staging buffer,
//! no second copy on the engine thread. The engine reads the blocks only once the whole
//! transfer arrived and every MAC checked (they belong to no sequence before), so a
//! corrupted or cut transfer never reaches a token.
//!
//! When a transfer completes, the engine learns how many prompt tokens are now present;
//! when it fails after its header was accepted, the engine marks the reservation failed
//! (the router retries elsewhere, the blocks are freed once the lease is back).

use duet_engine::{LeasedRegion, RegionLease};
use duet_kv_transfer::backend::shm::ShmPulls;
use duet_kv_transfer::{
    AnyReceiver, ErrorClass, Inbound, KvKind as WireKind, KvReceiver, KvSink, SinkError,
};
use duet_telemetry::names::{
    KV_TRANSFER_BYTES_TOTAL, KV_TRANSFER_FAILURES_TOTAL, KV_TRANSFER_SHM_PULLS_TOTAL,
    KV_TRANSFER_TRANSFERS_TOTAL, KV_TRANSFER_WIRE_BYTES_TOTAL,
};
use tokio_util::sync::CancellationToken;

use crate::handle::DecodeHandle;
use crate::leases::Held;

/// Writes arriving regions into the reserved blocks of the transfer's request.
pub struct PoolSink {
    handle: DecodeHandle,
    /// The lease of the transfer being received.
    held: Option<Held>,
    /// Where the regions of blocks a local layer group does not keep are read and dropped.
    discard: Vec<u8>,
}

fn kind(k: WireKind) -> duet_engine::KvKind {
    match k {
        WireKind::K => duet_engine::KvKind::K,
        WireKind::V => duet_engine::KvKind::V,
    }
}

fn no_lease() -> SinkError {
    SinkError::new(ErrorClass::Internal, "no transfer holds a lease")
}

impl PoolSink {
    /// A sink writing into `handle`'s reserved blocks.
    pub fn new(handle: DecodeHandle) -> PoolSink {
        PoolSink {
            handle,
            held: None,
            discard: Vec::new(),
        }
    }

    /// Gives the current transfer's lease back (its end, success or not); returns its
    /// generation (`None`: the transfer took none).
    pub fn release(&mut self) -> Option<u64> {
        self.held.take().map(|h| h.generation())
    }
}

/// The current transfer's lease (a free function, so the sink's other fields stay
/// borrowable beside it).
fn lease_of(held: &mut Option<Held>) -> Result<&mut RegionLease, SinkError> {
    held.as_mut().and_then(Held::lease).ok_or_else(no_lease)
}

impl KvSink for PoolSink {
    fn is_reserved(&self, request_id: u64, block: u32) -> bool {
        self.handle.is_reserved(request_id, block)
    }

    fn begin_transfer(&mut self, request_id: u64) -> Result<(), SinkError> {
        self.held = None;
        self.held = Some(self.handle.take_lease(request_id).ok_or_else(|| {
            SinkError::new(
                ErrorClass::NotFound,
                format!("request {request_id}'s reservation is gone or being written by another transfer"),
            )
        })?);
        Ok(())
    }

    fn region_mut(&mut self, layer: u32, k: WireKind, block: u32) -> Result<&mut [u8], SinkError> {
        let PoolSink { held, discard, .. } = self;
        let lease = lease_of(held)?;
        let n = lease.region_bytes();
        match lease.region_mut(layer as usize, kind(k), block) {
            LeasedRegion::Write(r) => {
                crate::copies::into_pool(r.len());
                Ok(r)
            }
            LeasedRegion::Dropped => {
                discard.resize(n, 0);
                Ok(discard)
            }
            LeasedRegion::Outside => Err(SinkError::new(
                ErrorClass::Internal,
                format!("block {block}, layer {layer} is not leased to this transfer"),
            )),
        }
    }

    fn regions_mut<'a>(
        &'a mut self,
        layer: u32,
        k: WireKind,
        blocks: &[u32],
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<bool, SinkError> {
        let lease = lease_of(&mut self.held)?;
        let done = lease.regions_mut(layer as usize, kind(k), blocks, out);
        if done {
            crate::copies::into_pool(out.iter().map(|r| r.len()).sum());
        }
        Ok(done)
    }

    fn layer_done(&mut self, request_id: u64, _layer: u32) {
        if let Some(h) = &self.held {
            self.handle.layer_arrived(request_id, h.generation());
        }
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
    let mut sink = PoolSink::new(handle.clone());
    let transport = rx.kind().as_str();
    let mut pulls = rx.shm_pulls().unwrap_or_default();
    loop {
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = rx.receive(&mut sink) => r,
        };
        // The lease goes back before the engine hears the outcome: it commits or frees the
        // blocks only with the lease in hand.
        let lease = sink.release();
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
                handle.transfer_done(
                    d.request_id,
                    (d.token_start + d.token_count) as usize,
                    lease,
                );
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
                    handle.transfer_failed(*request_id, e.to_string(), lease);
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
