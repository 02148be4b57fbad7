//! The low-level registry trait: a leased key-value store with prefix listing and watches.
//!
//! The trait is deliberately small and knows nothing about worker records: [`Registration`]
//! and [`ClusterView`] are written once on top of it, so the etcd and in-memory backends
//! share all policy (renewal, re-registration, coalescing, relisting, staleness).
//!
//! Contract every backend keeps:
//! - Revisions are positive and strictly increase with every mutation; [`Registry::list`]
//!   returns the store revision the listing reflects, and `watch(prefix, list.revision + 1)`
//!   delivers exactly the mutations after that listing, in revision order.
//! - A key put with a lease is deleted (producing a [`WatchEvent::Delete`]) when the lease
//!   expires or is revoked. A put moves the key to the lease given in that put.
//! - A watch that cannot deliver history (compacted) fails with [`Error::Compacted`]; a watch
//!   that stops for any other reason yields [`Error::WatchBroken`] or simply ends. In both
//!   cases the caller must list again; a backend never silently skips events.
//! - Backends do not retry on their own; every call returns promptly or is bounded by the
//!   caller's timeout ([`with_timeout`]).
//!
//! [`Registration`]: crate::Registration
//! [`ClusterView`]: crate::ClusterView
//! [`Error::Compacted`]: crate::Error::Compacted
//! [`Error::WatchBroken`]: crate::Error::WatchBroken

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::error::{Error, Result};

/// A lease id, as the backend hands it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The TTL the backend granted (etcd rounds up to whole seconds).
    pub ttl: Duration,
}

/// One stored key and value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The raw value.
    pub value: Vec<u8>,
    /// Revision of the last modification of this key.
    pub mod_revision: i64,
}

/// The result of a prefix listing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// All keys under the prefix, in key order.
    pub kvs: Vec<KeyValue>,
    /// The store revision this listing reflects; watch from `revision + 1`.
    pub revision: i64,
}

/// One change delivered by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or updated.
    Put(KeyValue),
    /// A key was deleted (explicitly or because its lease ended).
    Delete {
        /// The deleted key.
        key: String,
        /// Revision of the deletion.
        revision: i64,
    },
}

impl WatchEvent {
    /// The key the event is about.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }

    /// The revision of the event.
    pub fn revision(&self) -> i64 {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { revision, .. } => *revision,
        }
    }
}

/// A stream of watch events. An `Err` item ends the useful life of the stream.
pub type WatchStream = BoxStream<'static, Result<WatchEvent>>;

/// A leased key-value store with prefix listing and watches (see the module docs for the
/// contract). Object-safe: used as `Arc<dyn Registry>`.
#[async_trait]
pub trait Registry: Send + Sync + fmt::Debug + 'static {
    /// Short backend name for logs (`"etcd"`, `"memory"`).
    fn backend(&self) -> &'static str;

    /// Grants a lease that expires `ttl` after its last renewal.
    async fn grant_lease(&self, ttl: Duration) -> Result<Lease>;

    /// Renews a lease once. Fails with [`Error::LeaseNotFound`] if it has expired or was revoked.
    async fn keep_alive(&self, lease: LeaseId) -> Result<()>;

    /// Revokes a lease, deleting every key attached to it. Revoking an unknown lease is not an
    /// error.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()>;

    /// Puts `value` at `key`, attached to `lease` if given; returns the new revision.
    /// Fails with [`Error::LeaseNotFound`] if the lease does not exist.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64>;

    /// Deletes `key` (no error if absent).
    async fn delete(&self, key: &str) -> Result<()>;

    /// Lists every key under `prefix`, with the revision the listing reflects.
    async fn list(&self, prefix: &str) -> Result<Listing>;

    /// Watches `prefix` starting at `from_revision` (inclusive).
    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream>;

    /// Cheap liveness check that goes to the backend's source of truth; returns the current
    /// revision.
    async fn probe(&self) -> Result<i64>;
}

/// Runs a registry call under a deadline, turning an elapsed deadline into [`Error::Timeout`].
pub async fn with_timeout<T>(
    op: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout { op, timeout }),
    }
}
