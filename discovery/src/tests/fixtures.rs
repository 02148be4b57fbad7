//! What the discovery tests share: a registry wrapper that records puts, counts listings
//! and can hold one back, a worker record, and waiting on a view.

use crate::*;
use async_trait::async_trait;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::{timeout, Instant};

/// Delegates to a [`MemoryRegistry`], recording puts and counting lists; can hold the next
/// listing until released (to slip writes between a listing and its watch).
#[derive(Debug)]
pub(super) struct Recording {
    inner: MemoryRegistry,
    puts: Mutex<Vec<(Instant, String, Vec<u8>)>>,
    lists: AtomicUsize,
    hold: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
}

impl Recording {
    pub(super) fn new(inner: MemoryRegistry) -> Arc<Self> {
        Arc::new(Recording {
            inner,
            puts: Mutex::new(Vec::new()),
            lists: AtomicUsize::new(0),
            hold: Mutex::new(None),
        })
    }

    pub(super) fn put_times(&self, key: &str) -> Vec<Instant> {
        self.puts
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, _)| k == key)
            .map(|(t, _, _)| *t)
            .collect()
    }

    pub(super) fn lists(&self) -> usize {
        self.lists.load(Ordering::SeqCst)
    }

    /// The next `list` completes its read, signals `listed`, then waits for `release`.
    pub(super) fn hold_next_list(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (listed_tx, listed_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        *self.hold.lock().unwrap() = Some((listed_tx, release_rx));
        (listed_rx, release_tx)
    }
}

#[async_trait]
impl Registry for Recording {
    fn backend(&self) -> &'static str {
        "recording"
    }
    async fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.inner.revoke_lease(lease).await
    }
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64> {
        let r = self.inner.put(key, value.clone(), lease).await;
        if r.is_ok() {
            self.puts
                .lock()
                .unwrap()
                .push((Instant::now(), key.to_string(), value));
        }
        r
    }
    async fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Listing> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        let r = self.inner.list(prefix).await;
        let hold = self.hold.lock().unwrap().take();
        if let Some((listed, release)) = hold {
            let _ = listed.send(());
            let _ = release.await;
        }
        r
    }
    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream> {
        self.inner.watch(prefix, from_revision).await
    }
    async fn probe(&self) -> Result<i64> {
        self.inner.probe().await
    }
}

pub(super) const CLUSTER: &str = "t";

pub(super) fn record(role: Role, id: &str) -> WorkerRecord {
    let mut r = WorkerRecord::new(CLUSTER, role, id, format!("http://127.0.0.1:1/{id}"));
    r.model = "m".into();
    r.fingerprint = "f00d".into();
    r.kv_endpoints.push(KvEndpoint {
        transport: "tcp".into(),
        address: "127.0.0.1:2".into(),
    });
    r.capacity = Capacity {
        kv_blocks_total: 100,
        kv_blocks_free: 100,
        block_size: 16,
        max_batch: 8,
        ..Capacity::default()
    };
    r
}

pub(super) fn ttl2() -> RegistrationOptions {
    RegistrationOptions::with_ttl(Duration::from_secs(2))
}

pub(super) async fn wait_view(
    view: &mut ClusterView,
    what: &str,
    pred: impl FnMut(&Snapshot) -> bool,
) {
    match timeout(Duration::from_secs(30), view.wait_for(pred)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => panic!("view stopped while waiting for {what}: {e}"),
        Err(_) => panic!("timed out waiting for {what}; view: {:?}", view.snapshot()),
    }
}

pub(super) fn published(reg: &MemoryRegistry, key: &str) -> WorkerRecord {
    WorkerRecord::from_json(&reg.get(key).expect("key present")).unwrap()
}
