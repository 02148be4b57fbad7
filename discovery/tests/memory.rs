//! The in-process registry keeps the same contract as etcd (the generic suite in
//! `contract/mod.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod contract;

use duet_discovery::MemoryRegistry;

#[tokio::test]
async fn memory_backend_keeps_the_registry_contract() {
    let reg = MemoryRegistry::new();
    let compact_on = reg.clone();
    contract::registry_keeps_the_contract(
        &reg,
        Box::new(move |rev| {
            let r = compact_on.clone();
            Box::pin(async move { r.compact(rev) })
        }),
    )
    .await;
}
