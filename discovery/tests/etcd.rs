//! Integration tests against a real etcd (see `support/mod.rs`): the etcd backend's contract,
//! and registration + cluster view through kill, graceful shutdown, outage, restart and
//! compaction. Leases use a 2 s TTL to keep the suite fast.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod contract;
mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use duet_discovery::*;
use support::EtcdServer;
use tokio::sync::oneshot;
use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;

const CLUSTER: &str = "it";
const TTL: Duration = Duration::from_secs(2);

async fn connect(etcd: &EtcdServer) -> Arc<EtcdRegistry> {
    let mut opts = EtcdOptions::new([etcd.endpoint()]);
    opts.connect_timeout = Duration::from_secs(1);
    opts.request_timeout = Duration::from_secs(1);
    Arc::new(EtcdRegistry::connect(opts).await.expect("connect to etcd"))
}

fn reg_opts() -> RegistrationOptions {
    RegistrationOptions {
        call_timeout: Duration::from_millis(500),
        max_backoff: Duration::from_millis(300),
        ..RegistrationOptions::with_ttl(TTL)
    }
}

fn view_opts() -> ViewOptions {
    ViewOptions {
        call_timeout: Duration::from_millis(500),
        probe_interval: Duration::from_millis(300),
        min_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(300),
        export_gauges: true,
    }
}

fn record(role: Role, id: &str) -> WorkerRecord {
    let mut r = WorkerRecord::new(CLUSTER, role, id, format!("http://127.0.0.1:9/{id}"));
    r.model = "smol".into();
    r.fingerprint = "0123abcd".into();
    r.kv_endpoints = vec![
        KvEndpoint {
            transport: "tcp".into(),
            address: "127.0.0.1:7000".into(),
        },
        KvEndpoint {
            transport: "shm".into(),
            address: format!("duet-{id}"),
        },
    ];
    r.capacity = Capacity {
        kv_blocks_total: 64,
        kv_blocks_free: 64,
        block_size: 16,
        max_batch: 4,
        tokens_per_second: 12.5,
        ..Capacity::default()
    };
    r
}

async fn wait_view(
    view: &mut ClusterView,
    within: Duration,
    what: &str,
    pred: impl FnMut(&Snapshot) -> bool,
) -> Duration {
    let t0 = Instant::now();
    match timeout(within, view.wait_for(pred)).await {
        Ok(Ok(_)) => t0.elapsed(),
        Ok(Err(e)) => panic!("view stopped while waiting for {what}: {e}"),
        Err(_) => panic!("no {what} within {within:?}; view: {:?}", view.snapshot()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_keeps_the_registry_contract() {
    let etcd = EtcdServer::start();
    let reg = connect(&etcd).await;
    let lease = reg.grant_lease(Duration::from_millis(1500)).await.unwrap();
    assert_eq!(
        lease.ttl,
        Duration::from_secs(2),
        "etcd rounds TTLs up to seconds"
    );
    reg.revoke_lease(lease.id).await.unwrap();
    let compact_on = reg.clone();
    contract::registry_keeps_the_contract(
        reg.as_ref(),
        Box::new(move |rev| {
            let r = compact_on.clone();
            Box::pin(async move { r.compact(rev).await.unwrap() })
        }),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_expires_and_graceful_worker_leaves_at_once() {
    let etcd = EtcdServer::start();
    let registry: Arc<dyn Registry> = connect(&etcd).await;
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start_with(registry.clone(), CLUSTER, view_opts(), cancel.clone());

    let a_token = CancellationToken::new();
    let a = Registration::start(
        registry.clone(),
        record(Role::Decode, "a"),
        reg_opts(),
        a_token.clone(),
    )
    .await
    .unwrap();
    let b = Registration::start(
        registry.clone(),
        record(Role::Prefill, "b"),
        reg_opts(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, Duration::from_secs(5), "both workers", |s| {
        s.workers.len() == 2 && !s.stale
    })
    .await;
    let snap = view.snapshot();
    let seen = snap.get(Role::Decode, "a").unwrap();
    assert_eq!(seen.kv_endpoint("shm").unwrap().address, "duet-a");
    assert_eq!(seen.capacity.tokens_per_second, 12.5);

    // A capacity update travels through etcd.
    a.update(|r| r.capacity.kv_blocks_free = 10);
    wait_view(&mut view, Duration::from_secs(2), "a's update", |s| {
        s.get(Role::Decode, "a")
            .is_some_and(|w| w.capacity.kv_blocks_free == 10)
    })
    .await;

    // Leases outlive several TTLs while renewed.
    sleep(TTL + Duration::from_millis(500)).await;
    assert_eq!(view.snapshot().workers.len(), 2);
    assert_eq!(a.status().registrations, 1);

    // "Kill" a: no delete, the lease runs out.
    a_token.cancel();
    let took = wait_view(&mut view, TTL + Duration::from_secs(2), "a expired", |s| {
        s.get(Role::Decode, "a").is_none()
    })
    .await;
    assert!(
        took <= TTL + Duration::from_secs(1),
        "a took {took:?} to disappear"
    );
    assert!(view.snapshot().get(Role::Prefill, "b").is_some());

    // Graceful: gone at once, in etcd and in the view.
    b.deregister().await.unwrap();
    assert!(registry
        .list(&workers_prefix(CLUSTER))
        .await
        .unwrap()
        .kvs
        .is_empty());
    let took = wait_view(&mut view, Duration::from_secs(2), "b gone", |s| {
        s.workers.is_empty()
    })
    .await;
    assert!(
        took < Duration::from_millis(500),
        "b took {took:?} to disappear"
    );
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_keeps_last_view_and_restart_recovers() {
    let mut etcd = EtcdServer::start();
    let registry: Arc<dyn Registry> = connect(&etcd).await;
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start_with(registry.clone(), CLUSTER, view_opts(), cancel.clone());
    let survivor = Registration::start(
        registry.clone(),
        record(Role::Decode, "s"),
        reg_opts(),
        cancel.clone(),
    )
    .await
    .unwrap();
    let victim_token = CancellationToken::new();
    let _victim = Registration::start(
        registry.clone(),
        record(Role::Prefill, "v"),
        reg_opts(),
        victim_token.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, Duration::from_secs(5), "both workers", |s| {
        s.workers.len() == 2 && !s.stale
    })
    .await;

    // Freeze etcd: requests hang, the view notices through its probes.
    etcd.pause();
    let took = wait_view(&mut view, Duration::from_secs(3), "stale view", |s| s.stale).await;
    eprintln!("view went stale {took:?} after SIGSTOP");
    let snap = view.snapshot();
    assert_eq!(snap.workers.len(), 2, "a stale view keeps the last workers");
    assert!(snap.stale_since.is_some());
    // The victim dies while etcd is away; then etcd itself dies.
    victim_token.cancel();
    sleep(Duration::from_millis(700)).await;
    etcd.kill();
    sleep(Duration::from_millis(1500)).await;
    let snap = view.snapshot();
    assert!(snap.stale && snap.workers.len() == 2, "{snap:?}");

    // Back on the same data dir and ports: the view refreshes, the survivor is there
    // (re-registered: it could not renew for longer than its TTL).
    etcd.restart();
    let took = wait_view(
        &mut view,
        Duration::from_secs(5),
        "fresh view with the survivor",
        |s| !s.stale && s.get(Role::Decode, "s").is_some(),
    )
    .await;
    eprintln!("view fresh again {took:?} after restart");
    assert!(view.snapshot().stale_since.is_none());
    timeout(Duration::from_secs(3), async {
        while survivor.status().registrations < 2 || !survivor.status().registered {
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("survivor did not re-register: {:?}", survivor.status()));

    // The victim's lease came back with etcd and runs out without renewals.
    wait_view(
        &mut view,
        TTL + Duration::from_secs(2),
        "victim expired",
        |s| s.get(Role::Prefill, "v").is_none(),
    )
    .await;
    // The survivor stays, with exactly one key in etcd.
    sleep(TTL).await;
    let listing = registry.list(&workers_prefix(CLUSTER)).await.unwrap();
    assert_eq!(listing.kvs.len(), 1);
    assert_eq!(listing.kvs[0].key, survivor.key());
    assert_eq!(view.snapshot().workers.len(), 1);

    // A short freeze (shorter than the TTL) does not need a re-registration.
    let before = survivor.status().registrations;
    etcd.pause();
    wait_view(&mut view, Duration::from_secs(3), "stale again", |s| {
        s.stale
    })
    .await;
    etcd.resume();
    wait_view(&mut view, Duration::from_secs(5), "fresh again", |s| {
        !s.stale && s.workers.len() == 1
    })
    .await;
    sleep(Duration::from_millis(500)).await;
    assert_eq!(survivor.status().registrations, before);
    cancel.cancel();
}

/// Delegates to another registry; holds its first listing until released, and counts lists.
#[derive(Debug)]
struct Gated {
    inner: Arc<dyn Registry>,
    lists: AtomicUsize,
    hold: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
}

#[async_trait]
impl Registry for Gated {
    fn backend(&self) -> &'static str {
        "gated"
    }
    async fn grant_lease(&self, ttl: Duration) -> duet_discovery::Result<Lease> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> duet_discovery::Result<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> duet_discovery::Result<()> {
        self.inner.revoke_lease(lease).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> duet_discovery::Result<i64> {
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> duet_discovery::Result<()> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> duet_discovery::Result<Listing> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        let r = self.inner.list(prefix).await;
        let hold = self.hold.lock().unwrap().take();
        if let Some((listed, release)) = hold {
            let _ = listed.send(());
            let _ = release.await;
        }
        r
    }
    async fn watch(&self, prefix: &str, from: i64) -> duet_discovery::Result<WatchStream> {
        self.inner.watch(prefix, from).await
    }
    async fn probe(&self) -> duet_discovery::Result<i64> {
        self.inner.probe().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn view_converges_after_compaction() {
    let etcd = EtcdServer::start();
    let etcd_reg = connect(&etcd).await;
    let (listed_tx, listed_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    let gated = Arc::new(Gated {
        inner: etcd_reg.clone(),
        lists: AtomicUsize::new(0),
        hold: Mutex::new(Some((listed_tx, release_rx))),
    });
    let cancel = CancellationToken::new();
    let opts = ViewOptions {
        call_timeout: Duration::from_secs(10),
        ..view_opts()
    };
    let mut view = ClusterView::start_with(gated.clone(), CLUSTER, opts, cancel.clone());
    listed_rx.await.unwrap();

    // The view has listed an empty cluster. Before it watches, many revisions pass and the
    // history it needs is compacted away.
    for i in 0..40u64 {
        let mut r = record(Role::Decode, &format!("w{}", i % 8));
        r.capacity.running = i as u32;
        etcd_reg
            .put(&r.key(), r.to_json().unwrap(), None)
            .await
            .unwrap();
    }
    for i in 0..3 {
        etcd_reg
            .delete(&worker_key(CLUSTER, Role::Decode, &format!("w{i}")))
            .await
            .unwrap();
    }
    let rev = etcd_reg.probe().await.unwrap();
    etcd_reg.compact(rev).await.unwrap();
    release_tx.send(()).unwrap();

    wait_view(&mut view, Duration::from_secs(5), "converged view", |s| {
        s.workers.len() == 5 && !s.stale
    })
    .await;
    assert!(
        gated.lists.load(Ordering::SeqCst) >= 2,
        "compaction must force a relist"
    );
    let snap = view.snapshot();
    let listing = etcd_reg.list(&workers_prefix(CLUSTER)).await.unwrap();
    assert_eq!(
        snap.workers.keys().cloned().collect::<Vec<_>>(),
        listing
            .kvs
            .iter()
            .map(|kv| kv.key.clone())
            .collect::<Vec<_>>()
    );
    for w in snap.workers.values() {
        let last = (0..40u32)
            .filter(|i| format!("w{}", i % 8) == w.id)
            .max()
            .unwrap();
        assert_eq!(w.capacity.running, last, "{} has its final state", w.id);
    }

    // And it keeps following changes afterwards.
    let r = record(Role::Prefill, "late");
    etcd_reg
        .put(&r.key(), r.to_json().unwrap(), None)
        .await
        .unwrap();
    wait_view(&mut view, Duration::from_secs(2), "late worker", |s| {
        s.get(Role::Prefill, "late").is_some()
    })
    .await;
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn view_and_worker_started_while_etcd_is_down() {
    let mut etcd = EtcdServer::start();
    etcd.kill();
    // Connecting is lazy: it works while etcd is down, and calls fail within their deadline.
    let registry: Arc<dyn Registry> = connect(&etcd).await;
    let t0 = Instant::now();
    let err = registry.list("/duet/").await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );

    let cancel = CancellationToken::new();
    let mut view = ClusterView::start_with(registry.clone(), CLUSTER, view_opts(), cancel.clone());
    let err = Registration::start(
        registry.clone(),
        record(Role::Decode, "w"),
        reg_opts(),
        cancel.clone(),
    )
    .await
    .unwrap_err();
    assert!(
        err.is_retryable(),
        "start reports an unreachable registry: {err:?}"
    );
    sleep(Duration::from_millis(500)).await;
    let snap = view.snapshot();
    assert!(snap.stale && !snap.is_synced(), "{snap:?}");

    etcd.restart();
    wait_view(&mut view, Duration::from_secs(5), "first sync", |s| {
        s.is_synced() && !s.stale
    })
    .await;
    let w = Registration::start(
        registry.clone(),
        record(Role::Decode, "w"),
        reg_opts(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, Duration::from_secs(2), "worker", |s| {
        s.workers.len() == 1
    })
    .await;
    w.deregister().await.unwrap();
    cancel.cancel();
}
