//! The registry contract every discovery backend keeps, as one generic suite: each
//! backend's test file runs [`registry_keeps_the_contract`] on its own registry
//! (`memory.rs` in process, `etcd.rs` against a real etcd), so a new backend gets the same
//! checks by adding one call.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use duet_discovery::*;
use futures::StreamExt;
use tokio::time::timeout;

/// Compacts the backend's history up to a revision (backends do it their own way).
pub type Compact<'a> = Box<dyn Fn(i64) -> Pin<Box<dyn Future<Output = ()> + 'a>> + 'a>;

async fn next_event(watch: &mut WatchStream) -> WatchEvent {
    timeout(Duration::from_secs(2), watch.next())
        .await
        .expect("a watch event within 2 s")
        .expect("the watch is open")
        .expect("an event, not an error")
}

/// Leases, puts, deletes and their watch events in revision order, revoked leases refused
/// by every call, and a watch from compacted history refused as `Compacted`
/// (unavailable: the caller lists again). Uses keys under `/duet/contract/` only.
pub async fn registry_keeps_the_contract(reg: &dyn Registry, compact: Compact<'_>) {
    let prefix = "/duet/contract/";
    let lease = reg.grant_lease(Duration::from_millis(1500)).await.unwrap();
    assert!(
        lease.ttl >= Duration::from_millis(1500),
        "a lease lives at least its TTL: {:?}",
        lease.ttl
    );
    let listing = reg.list(prefix).await.unwrap();
    assert!(listing.kvs.is_empty());
    let mut watch = reg.watch(prefix, listing.revision + 1).await.unwrap();

    let r1 = reg
        .put("/duet/contract/a", b"1".to_vec(), Some(lease.id))
        .await
        .unwrap();
    assert!(r1 > listing.revision);
    assert_eq!(reg.probe().await.unwrap(), r1, "probe reports the revision");
    reg.keep_alive(lease.id).await.unwrap();
    reg.delete("/duet/contract/a").await.unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        WatchEvent::Put(KeyValue {
            key: "/duet/contract/a".into(),
            value: b"1".to_vec(),
            mod_revision: r1
        })
    );
    let ev = next_event(&mut watch).await;
    assert!(
        matches!(ev, WatchEvent::Delete { ref key, revision } if key == "/duet/contract/a" && revision == r1 + 1),
        "{ev:?}"
    );

    // Revoked leases are reported as such by every call that uses them; revoking twice is
    // not an error.
    reg.put("/duet/contract/b", b"2".to_vec(), Some(lease.id))
        .await
        .unwrap();
    reg.revoke_lease(lease.id).await.unwrap();
    reg.revoke_lease(lease.id).await.unwrap();
    assert!(
        reg.list(prefix).await.unwrap().kvs.is_empty(),
        "revoke deletes the lease's keys"
    );
    assert!(matches!(
        reg.keep_alive(lease.id).await,
        Err(Error::LeaseNotFound { .. })
    ));
    assert!(matches!(
        reg.put("/duet/contract/c", vec![], Some(lease.id)).await,
        Err(Error::LeaseNotFound { .. })
    ));

    // A listing sees the latest value of each key.
    for i in 0..5 {
        reg.put("/duet/contract/x", vec![i], None).await.unwrap();
    }
    let now = reg.probe().await.unwrap();
    let listed = reg.list(prefix).await.unwrap();
    assert_eq!(listed.revision, now);
    assert_eq!(listed.kvs.len(), 1);
    assert_eq!(listed.kvs[0].value, vec![4]);

    // Compacted history: the watch refuses to start from it.
    compact(now).await;
    let err = match reg.watch(prefix, listing.revision + 1).await {
        Err(e) => e,
        Ok(mut s) => s.next().await.expect("an item").expect_err("compacted"),
    };
    assert!(
        matches!(err, Error::Compacted { compact_revision, .. } if compact_revision == now),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Unavailable);
}
