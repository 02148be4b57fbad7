//! A worker's KV events, published to routers: the `duet.v1.KvCache` service.
//!
//! The engine thread hands every change of its prefix cache to a [`KvEventHub`]
//! ([`KvEventHub::publish`]). The hub numbers the batches, keeps a mirror of what the
//! worker holds (hash -> tier), and broadcasts the batches on a bounded channel. A
//! subscriber gets a snapshot taken from the mirror under the same lock as its channel
//! subscription (so no change falls between the two), then the batches after it.
//!
//! Lossy by design: a subscriber that falls more than [`BACKLOG`] batches behind does not
//! block the engine; it is sent a fresh snapshot instead of what it missed. Batches are
//! numbered consecutively per worker instance, so a router that sees a gap (or a new
//! instance) knows its index is incomplete and subscribes again.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use duet_engine::{BlockHash, KvEvent, KvTier};
use duet_proto::v1 as pb;
use futures::Stream;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Batches a subscriber may fall behind before it is re-sent a snapshot.
pub const BACKLOG: usize = 1024;

/// Largest number of hashes in one snapshot message (larger snapshots are split; the
/// first part carries `snapshot = true`).
const SNAPSHOT_CHUNK: usize = 16_384;

/// The proto tier.
pub fn tier_to_proto(t: KvTier) -> pb::KvTier {
    match t {
        KvTier::Device => pb::KvTier::Device,
        KvTier::Host => pb::KvTier::Host,
        KvTier::Disk => pb::KvTier::Disk,
    }
}

fn event_to_proto(e: &KvEvent) -> pb::KvBlockEvent {
    let (stored, tier, hashes) = match e {
        KvEvent::Stored { tier, hashes } => (true, tier, hashes),
        KvEvent::Removed { tier, hashes } => (false, tier, hashes),
    };
    pb::KvBlockEvent {
        stored,
        tier: tier_to_proto(*tier) as i32,
        hashes: hashes.clone(),
    }
}

struct Mirror {
    seq: u64,
    held: HashMap<BlockHash, KvTier>,
}

/// One worker's KV event publisher (cloneable; the engine thread holds one).
#[derive(Clone)]
pub struct KvEventHub {
    worker_id: String,
    instance: u64,
    block_size: u32,
    mirror: Arc<Mutex<Mirror>>,
    tx: broadcast::Sender<Arc<pb::KvEventBatch>>,
}

impl KvEventHub {
    pub fn new(worker_id: impl Into<String>, block_size: usize) -> KvEventHub {
        let (tx, _) = broadcast::channel(BACKLOG);
        KvEventHub {
            worker_id: worker_id.into(),
            instance: rand::random(),
            block_size: u32::try_from(block_size).unwrap_or(u32::MAX),
            mirror: Arc::new(Mutex::new(Mirror {
                seq: 0,
                held: HashMap::new(),
            })),
            tx,
        }
    }

    /// Publishes the engine's changes (one batch). Never blocks on subscribers.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let Ok(mut m) = self.mirror.lock() else {
            return;
        };
        for e in &events {
            match e {
                KvEvent::Stored { tier, hashes } => {
                    for &h in hashes {
                        m.held.insert(h, *tier);
                    }
                }
                KvEvent::Removed { tier, hashes } => {
                    for h in hashes {
                        if m.held.get(h) == Some(tier) {
                            m.held.remove(h);
                        }
                    }
                }
            }
        }
        m.seq += 1;
        let batch = pb::KvEventBatch {
            worker_id: self.worker_id.clone(),
            instance: self.instance,
            seq: m.seq,
            snapshot: false,
            events: events.iter().map(event_to_proto).collect(),
            block_size: self.block_size,
        };
        // Sent under the lock: a subscriber sees a snapshot and exactly the batches after it.
        let _ = self.tx.send(Arc::new(batch));
    }

    /// Blocks held per tier (the mirror's view).
    pub fn held(&self) -> HashMap<KvTier, usize> {
        let mut out = HashMap::new();
        if let Ok(m) = self.mirror.lock() {
            for t in m.held.values() {
                *out.entry(*t).or_default() += 1;
            }
        }
        out
    }

    /// A snapshot (split into messages of at most [`SNAPSHOT_CHUNK`] hashes, all with the
    /// snapshot's sequence number) and the channel of the batches after it.
    fn subscribe(
        &self,
    ) -> (
        Vec<pb::KvEventBatch>,
        broadcast::Receiver<Arc<pb::KvEventBatch>>,
    ) {
        let (seq, held, rx) = match self.mirror.lock() {
            Ok(m) => (m.seq, m.held.clone(), self.tx.subscribe()),
            Err(_) => (0, HashMap::new(), self.tx.subscribe()),
        };
        let mut by_tier: HashMap<KvTier, Vec<BlockHash>> = HashMap::new();
        for (h, t) in held {
            by_tier.entry(t).or_default().push(h);
        }
        let mut events: Vec<pb::KvBlockEvent> = Vec::new();
        for tier in KvTier::ALL {
            for part in by_tier
                .remove(&tier)
                .unwrap_or_default()
                .chunks(SNAPSHOT_CHUNK)
            {
                events.push(event_to_proto(&KvEvent::Stored {
                    tier,
                    hashes: part.to_vec(),
                }));
            }
        }
        let mut msgs: Vec<pb::KvEventBatch> = events
            .into_iter()
            .map(|e| pb::KvEventBatch {
                worker_id: self.worker_id.clone(),
                instance: self.instance,
                seq,
                snapshot: false,
                events: vec![e],
                block_size: self.block_size,
            })
            .collect();
        match msgs.first_mut() {
            Some(first) => first.snapshot = true,
            None => msgs.push(pb::KvEventBatch {
                worker_id: self.worker_id.clone(),
                instance: self.instance,
                seq,
                snapshot: true,
                events: Vec::new(),
                block_size: self.block_size,
            }),
        }
        (msgs, rx)
    }
}

/// Starts bringing a prompt's blocks up from the lower tiers (the worker's engine).
pub type PrefetchFn = Arc<dyn Fn(Vec<BlockHash>) + Send + Sync>;

/// `duet.v1.KvCache` over a hub.
#[derive(Clone)]
pub struct KvCacheService {
    hub: KvEventHub,
    prefetch: PrefetchFn,
    /// Ends every subscription (the worker is shutting down: streams must not hold the
    /// server's drain).
    closed: CancellationToken,
}

impl KvCacheService {
    pub fn new(hub: KvEventHub, prefetch: PrefetchFn, closed: CancellationToken) -> Self {
        KvCacheService {
            hub,
            prefetch,
            closed,
        }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::kv_cache_server::KvCacheServer<Self> {
        pb::kv_cache_server::KvCacheServer::new(self)
    }
}

type BatchStream = Pin<Box<dyn Stream<Item = Result<pb::KvEventBatch, Status>> + Send>>;

/// Sends one batch to a subscriber; `false` when it went away or the worker is draining (a
/// slow subscriber must not hold the drain).
async fn send(
    out: &tokio::sync::mpsc::Sender<Result<pb::KvEventBatch, Status>>,
    closed: &CancellationToken,
    m: pb::KvEventBatch,
) -> bool {
    tokio::select! {
        _ = closed.cancelled() => false,
        r = out.send(Ok(m)) => r.is_ok(),
    }
}

#[tonic::async_trait]
impl pb::kv_cache_server::KvCache for KvCacheService {
    type SubscribeStream = BatchStream;

    async fn subscribe(
        &self,
        _: Request<pb::KvSubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let hub = self.hub.clone();
        let closed = self.closed.clone();
        let (out, rx_out) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let (mut snapshot, mut rx) = hub.subscribe();
            loop {
                let mut last = 0;
                for m in snapshot.drain(..) {
                    last = m.seq;
                    if !send(&out, &closed, m).await {
                        return;
                    }
                }
                loop {
                    let b = tokio::select! {
                        _ = closed.cancelled() => return,
                        _ = out.closed() => return,
                        b = rx.recv() => b,
                    };
                    match b {
                        Ok(b) if b.seq <= last => continue,
                        Ok(b) => {
                            if !send(&out, &closed, (*b).clone()).await {
                                return;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            // Fell behind: start again from a snapshot.
                            (snapshot, rx) = hub.subscribe();
                            break;
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx_out),
        )))
    }

    async fn prefetch(
        &self,
        req: Request<pb::PrefetchRequest>,
    ) -> Result<Response<pb::PrefetchResponse>, Status> {
        (self.prefetch)(req.into_inner().block_hashes);
        Ok(Response::new(pb::PrefetchResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use pb::kv_cache_server::KvCache;

    fn stored(tier: KvTier, hashes: &[u64]) -> KvEvent {
        KvEvent::Stored {
            tier,
            hashes: hashes.to_vec(),
        }
    }

    async fn subscribe(hub: &KvEventHub) -> BatchStream {
        let svc = KvCacheService::new(hub.clone(), Arc::new(|_| {}), CancellationToken::new());
        svc.subscribe(Request::new(pb::KvSubscribeRequest {}))
            .await
            .unwrap()
            .into_inner()
    }

    #[tokio::test]
    async fn a_subscriber_gets_a_snapshot_then_the_changes_after_it() {
        let hub = KvEventHub::new("w", 16);
        hub.publish(vec![stored(KvTier::Device, &[1, 2])]);
        hub.publish(vec![
            KvEvent::Removed {
                tier: KvTier::Device,
                hashes: vec![1],
            },
            stored(KvTier::Host, &[1]),
        ]);
        let mut s = subscribe(&hub).await;
        let mut snap = Vec::new();
        let first = s.next().await.unwrap().unwrap();
        assert!(first.snapshot && first.seq == 2);
        snap.push(first);
        snap.push(s.next().await.unwrap().unwrap());
        let held: Vec<(i32, Vec<u64>)> = snap
            .iter()
            .flat_map(|b| b.events.iter().map(|e| (e.tier, e.hashes.clone())))
            .collect();
        assert_eq!(
            held,
            [
                (pb::KvTier::Device as i32, vec![2]),
                (pb::KvTier::Host as i32, vec![1])
            ]
        );
        hub.publish(vec![stored(KvTier::Device, &[3])]);
        let next = s.next().await.unwrap().unwrap();
        assert_eq!((next.seq, next.snapshot), (3, false));
        assert_eq!(next.events[0].hashes, [3]);
    }

    #[tokio::test]
    async fn a_subscriber_that_falls_behind_gets_a_new_snapshot() {
        let hub = KvEventHub::new("w", 16);
        let mut s = subscribe(&hub).await;
        assert!(s.next().await.unwrap().unwrap().snapshot);
        // Far more batches than the backlog while the subscriber does not read.
        for h in 0..(BACKLOG as u64 + 64) * 2 {
            hub.publish(vec![stored(KvTier::Device, &[h])]);
        }
        let mut seqs = Vec::new();
        let mut resnapshot = None;
        while let Some(Ok(b)) = s.next().await {
            if b.snapshot {
                resnapshot = Some(b);
                break;
            }
            seqs.push(b.seq);
        }
        let snap = resnapshot.expect("a new snapshot after the lag");
        assert!(
            seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "no gap before it"
        );
        let total: usize = snap.events.iter().map(|e| e.hashes.len()).sum();
        assert!(total > BACKLOG, "the snapshot holds everything: {total}");
    }
}
