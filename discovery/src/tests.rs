//! Tests of the shared logic ([`Registration`], [`ClusterView`]) against [`MemoryRegistry`],
//! on tokio's paused clock so timings are exact and the tests take no wall time.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, timeout, Instant};
use tokio_util::sync::CancellationToken;

use crate::*;

mod fixtures;

use fixtures::*;

#[tokio::test(start_paused = true)]
async fn registered_worker_is_visible_in_view() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start(registry.clone(), CLUSTER, cancel.clone());
    assert!(view.snapshot().stale && !view.snapshot().is_synced());

    let d = Registration::start(
        registry.clone(),
        record(Role::Decode, "d0"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    let p = Registration::start(
        registry.clone(),
        record(Role::Prefill, "p0"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, "both workers", |s| s.workers.len() == 2).await;
    let snap = view.snapshot();
    assert!(!snap.stale && snap.stale_since.is_none() && snap.is_synced());
    assert_eq!(view.workers(Role::Decode)[0].id, "d0");
    assert_eq!(view.workers(Role::Prefill)[0].id, "p0");
    assert_eq!(snap.get(Role::Decode, "d0").unwrap().key(), d.key());
    assert_eq!(d.status().registrations, 1);

    // Leases are renewed: still there after several TTLs.
    sleep(Duration::from_secs(10)).await;
    assert_eq!(view.snapshot().workers.len(), 2);
    assert_eq!(d.status().registrations, 1);
    assert!(d.status().registered);
    assert_eq!(mem.lease_count(), 2);

    // An update reaches the view.
    p.update(|r| r.capacity.queued_prefill_tokens = 123);
    wait_view(&mut view, "queued tokens", |s| {
        s.get(Role::Prefill, "p0")
            .is_some_and(|w| w.capacity.queued_prefill_tokens == 123)
    })
    .await;
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn update_coalescing_respects_intervals() {
    let mem = MemoryRegistry::new();
    let rec = Recording::new(mem.clone());
    let registry: Arc<dyn Registry> = rec.clone();
    let cancel = CancellationToken::new();
    let opts = RegistrationOptions::default();
    let reg = Registration::start(
        registry,
        record(Role::Decode, "d0"),
        opts.clone(),
        cancel.clone(),
    )
    .await
    .unwrap();
    let key = reg.key().to_string();
    let t0 = Instant::now();

    // Phase 1: small changes every 10 ms for 2 s -> coalesced to one publish per 500 ms.
    for i in 0..200u64 {
        reg.update(|r| {
            r.capacity.kv_blocks_free = 100 - (i % 10);
            r.capacity.running = (i % 7) as u32;
        });
        sleep(Duration::from_millis(10)).await;
    }
    let small: Vec<Instant> = rec
        .put_times(&key)
        .into_iter()
        .filter(|t| *t > t0)
        .collect();
    assert!(
        (3..=5).contains(&small.len()),
        "expected about 2 s / 500 ms publishes, got {}",
        small.len()
    );
    for w in small.windows(2) {
        assert!(
            w[1] - w[0] >= opts.publish_interval,
            "small changes published too often"
        );
    }

    // Phase 2: big swings every 10 ms for 1 s -> one publish per min interval (100 ms).
    sleep(Duration::from_secs(1)).await;
    let t1 = Instant::now();
    for i in 0..100u64 {
        reg.update(|r| r.capacity.kv_blocks_free = if i % 2 == 0 { 0 } else { 100 });
        sleep(Duration::from_millis(10)).await;
    }
    let big: Vec<Instant> = rec
        .put_times(&key)
        .into_iter()
        .filter(|t| *t > t1)
        .collect();
    assert!(
        (8..=11).contains(&big.len()),
        "expected about 1 s / 100 ms publishes, got {}",
        big.len()
    );
    let all = rec.put_times(&key);
    for w in all.windows(2) {
        assert!(
            w[1] - w[0] >= opts.min_publish_interval,
            "publishes closer than the floor"
        );
    }

    // The latest state is always published eventually (trailing edge).
    reg.update_capacity(Capacity {
        kv_blocks_total: 100,
        kv_blocks_free: 42,
        running: 5,
        ..Capacity::default()
    });
    sleep(opts.publish_interval + Duration::from_millis(10)).await;
    assert_eq!(published(&mem, &key).capacity.kv_blocks_free, 42);

    // Draining is a big change: out within the floor, even right after a publish.
    let n = rec.put_times(&key).len();
    reg.set_draining(true);
    sleep(opts.min_publish_interval + Duration::from_millis(5)).await;
    assert_eq!(rec.put_times(&key).len(), n + 1);
    assert!(published(&mem, &key).draining);

    // No change, no publish; identity cannot be changed through update.
    let n = rec.put_times(&key).len();
    reg.update(|r| r.id = "other".into());
    sleep(Duration::from_secs(2)).await;
    assert_eq!(rec.put_times(&key).len(), n);
    assert_eq!(reg.record().id, "d0");
    assert!(reg.status().publishes >= 10);
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn deregister_removes_at_once() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start(registry.clone(), CLUSTER, cancel.clone());
    let reg = Registration::start(
        registry.clone(),
        record(Role::Decode, "d0"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, "worker", |s| s.workers.len() == 1).await;

    let before = Instant::now();
    reg.deregister().await.unwrap();
    assert!(
        mem.get(reg.key()).is_none(),
        "key must be gone when deregister returns"
    );
    assert_eq!(mem.lease_count(), 0, "lease must be revoked");
    wait_view(&mut view, "worker gone", |s| s.workers.is_empty()).await;
    assert!(before.elapsed() < Duration::from_millis(50));
    // The view remembers when its last decode worker left (callers wait a little for it to
    // come back); a role that never had a worker has no such instant.
    assert!(view.snapshot().lost_at(Role::Decode).is_some());
    assert_eq!(view.snapshot().lost_at(Role::Prefill), None);
    assert!(!reg.status().registered);
    // Idempotent, and later updates are ignored.
    reg.deregister().await.unwrap();
    reg.set_draining(true);
    sleep(Duration::from_secs(3)).await;
    assert!(mem.get(reg.key()).is_none());
    // A decode worker back: nothing is lost any more.
    let _again = Registration::start(
        registry.clone(),
        record(Role::Decode, "d1"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, "worker back", |s| s.workers.len() == 1).await;
    assert_eq!(view.snapshot().lost_at(Role::Decode), None);
}

#[tokio::test(start_paused = true)]
async fn cancelled_registration_disappears_after_ttl() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let view_cancel = CancellationToken::new();
    let mut view = ClusterView::start(registry.clone(), CLUSTER, view_cancel.clone());
    let worker_cancel = CancellationToken::new();
    let reg = Registration::start(
        registry.clone(),
        record(Role::Decode, "d0"),
        ttl2(),
        worker_cancel.clone(),
    )
    .await
    .unwrap();
    let key = reg.key().to_string();
    wait_view(&mut view, "worker", |s| s.workers.len() == 1).await;
    // Let a few renewals happen, then "die" just after one.
    sleep(Duration::from_millis(2010)).await;
    let died = Instant::now();
    worker_cancel.cancel();
    sleep(Duration::from_millis(1000)).await;
    assert!(
        mem.get(&key).is_some(),
        "must survive until the lease runs out"
    );
    assert_eq!(view.snapshot().workers.len(), 1);
    wait_view(&mut view, "dead worker gone", |s| s.workers.is_empty()).await;
    let gone_after = died.elapsed();
    assert!(
        gone_after <= Duration::from_secs(2) + Duration::from_millis(50),
        "gone after {gone_after:?}"
    );
    assert!(mem.get(&key).is_none());
    drop(reg);
    view_cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn view_relists_after_forced_watch_break() {
    let mem = MemoryRegistry::new();
    let rec = Recording::new(mem.clone());
    let registry: Arc<dyn Registry> = rec.clone();
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start(registry.clone(), CLUSTER, cancel.clone());
    let _a = Registration::start(
        registry.clone(),
        record(Role::Decode, "a"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, "a", |s| s.workers.len() == 1).await;
    assert_eq!(rec.lists(), 1);

    mem.break_watches();
    let _b = Registration::start(
        registry.clone(),
        record(Role::Prefill, "b"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, "a and b", |s| s.workers.len() == 2).await;
    assert!(rec.lists() >= 2, "the view must list again after a break");
    assert!(
        !view.snapshot().stale,
        "a broken watch alone is not staleness"
    );

    // Changes after the relist still arrive through the new watch.
    mem.break_watches();
    sleep(Duration::from_secs(1)).await;
    _b.deregister().await.unwrap();
    wait_view(&mut view, "b gone", |s| s.workers.len() == 1).await;
    assert!(rec.lists() >= 3);
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn view_relists_after_compaction() {
    let mem = MemoryRegistry::new();
    let rec = Recording::new(mem.clone());
    let registry: Arc<dyn Registry> = rec.clone();
    let cancel = CancellationToken::new();
    let (listed, release) = rec.hold_next_list();
    let opts = ViewOptions {
        call_timeout: Duration::from_secs(60),
        ..ViewOptions::default()
    };
    let mut view = ClusterView::start_with(registry.clone(), CLUSTER, opts, cancel.clone());
    listed.await.unwrap();
    // The view listed an empty cluster; before it can watch, history moves on and is compacted.
    let a = Registration::start(
        registry.clone(),
        record(Role::Decode, "a"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    for i in 0..20 {
        a.update(|r| r.capacity.running = i);
        sleep(Duration::from_millis(600)).await;
    }
    mem.compact(mem.revision());
    release.send(()).unwrap();
    wait_view(&mut view, "a with final state", |s| {
        s.get(Role::Decode, "a")
            .is_some_and(|w| w.capacity.running == 19)
    })
    .await;
    assert!(rec.lists() >= 2, "compaction must force a relist");
    assert!(!view.snapshot().stale);
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn outage_marks_view_stale_and_worker_reregisters() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start(registry.clone(), CLUSTER, cancel.clone());
    let reg = Registration::start(
        registry.clone(),
        record(Role::Decode, "d0"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    wait_view(&mut view, "worker", |s| s.workers.len() == 1 && !s.stale).await;

    mem.set_available(false);
    wait_view(&mut view, "stale", |s| s.stale).await;
    let snap = view.snapshot();
    assert_eq!(snap.workers.len(), 1, "stale view keeps the last workers");
    assert!(snap.stale_since.is_some());
    // Longer than the TTL: the lease expires on the "server".
    sleep(Duration::from_secs(4)).await;
    assert!(mem.get(reg.key()).is_none());
    assert!(view.snapshot().stale);
    assert_eq!(view.snapshot().workers.len(), 1);

    mem.set_available(true);
    wait_view(&mut view, "fresh with worker", |s| {
        !s.stale && s.workers.len() == 1
    })
    .await;
    // The registration noticed and registered again under a new lease.
    sleep(Duration::from_secs(3)).await;
    assert!(mem.get(reg.key()).is_some());
    assert!(reg.status().registrations >= 2, "{:?}", reg.status());
    assert!(reg.status().registered);
    assert_eq!(mem.lease_count(), 1, "old lease must not linger");
    assert!(view.snapshot().stale_since.is_none());
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn revoked_lease_leads_to_reregistration() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let cancel = CancellationToken::new();
    let reg = Registration::start(
        registry.clone(),
        record(Role::Prefill, "p0"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    let lease = reg.status().lease.unwrap();
    registry.revoke_lease(lease).await.unwrap();
    assert!(mem.get(reg.key()).is_none());
    // Noticed at the next renewal (TTL/3) and fixed right away.
    sleep(Duration::from_millis(700)).await;
    assert!(mem.get(reg.key()).is_some());
    let st = reg.status();
    assert_eq!(st.registrations, 2);
    assert_ne!(st.lease, Some(lease));
    cancel.cancel();
}

#[tokio::test]
async fn start_rejects_bad_input() {
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let mut bad = record(Role::Decode, "x");
    bad.cluster = String::new();
    let err = Registration::start(registry.clone(), bad, ttl2(), CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(err.class(), ErrorClass::InvalidArgument);
    let opts = RegistrationOptions {
        min_publish_interval: Duration::from_secs(1),
        publish_interval: Duration::from_millis(10),
        ..ttl2()
    };
    let err = Registration::start(
        registry,
        record(Role::Decode, "x"),
        opts,
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class(), ErrorClass::InvalidArgument);
}

#[tokio::test]
async fn start_fails_when_registry_unreachable() {
    let mem = MemoryRegistry::new();
    mem.set_available(false);
    let registry: Arc<dyn Registry> = Arc::new(mem);
    let err = Registration::start(
        registry,
        record(Role::Decode, "x"),
        ttl2(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.class(), ErrorClass::Unavailable);
}

#[tokio::test(start_paused = true)]
async fn view_ignores_other_clusters_and_bad_records() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let cancel = CancellationToken::new();
    let mut view = ClusterView::start(registry.clone(), CLUSTER, cancel.clone());
    // Another cluster whose name extends ours must not leak in.
    let mut other = record(Role::Decode, "o");
    other.cluster = format!("{CLUSTER}x");
    registry
        .put(&other.key(), other.to_json().unwrap(), None)
        .await
        .unwrap();
    // A future version is skipped, not misread.
    let mut v: serde_json::Value = serde_json::to_value(record(Role::Decode, "v2")).unwrap();
    v["version"] = serde_json::json!(2);
    let key_v2 = worker_key(CLUSTER, Role::Decode, "v2");
    registry
        .put(&key_v2, serde_json::to_vec(&v).unwrap(), None)
        .await
        .unwrap();
    // A record stored under the wrong key is skipped.
    let good = record(Role::Decode, "g");
    registry
        .put(
            &worker_key(CLUSTER, Role::Prefill, "g"),
            good.to_json().unwrap(),
            None,
        )
        .await
        .unwrap();
    registry
        .put(&good.key(), good.to_json().unwrap(), None)
        .await
        .unwrap();
    wait_view(&mut view, "good worker", |s| s.workers.len() == 1).await;
    sleep(Duration::from_secs(1)).await;
    let snap = view.snapshot();
    assert_eq!(snap.workers.keys().collect::<Vec<_>>(), vec![&good.key()]);
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn dropping_view_and_registration_stops_tasks() {
    let mem = MemoryRegistry::new();
    let registry: Arc<dyn Registry> = Arc::new(mem.clone());
    let cancel = CancellationToken::new();
    let reg = Registration::start(
        registry.clone(),
        record(Role::Decode, "d0"),
        ttl2(),
        cancel.clone(),
    )
    .await
    .unwrap();
    let view = ClusterView::start(registry.clone(), CLUSTER, cancel.clone());
    let mut rx = view.subscribe();
    drop(view);
    drop(reg);
    // The view task ends (its sender goes away), and the dropped registration stops renewing.
    timeout(Duration::from_secs(5), async {
        while rx.changed().await.is_ok() {}
    })
    .await
    .unwrap();
    sleep(Duration::from_secs(3)).await;
    assert_eq!(mem.lease_count(), 0);
}
