//! Cluster discovery for duet: who is serving, where, and how loaded.
//!
//! Workers publish a versioned [`WorkerRecord`] at `/duet/<cluster>/workers/<role>/<id>`
//! under a lease ([`Registration`]); the router follows all records of a cluster
//! ([`ClusterView`]). Both are written once against the small [`Registry`] trait, which has an
//! etcd backend ([`EtcdRegistry`]) and an in-memory one ([`MemoryRegistry`]) for the
//! all-in-one process and tests.
//!
//! Crate-wide invariants:
//! - A worker's key exists only while its lease lives: a worker that dies disappears within
//!   one lease TTL; a worker that shuts down gracefully disappears at once.
//! - Records are JSON with `"version": 1`; unknown fields are ignored, other versions rejected.
//! - The router's view is a full listing followed by a gap-free watch; any doubt (broken
//!   watch, compaction, unreachable registry) leads to a fresh listing, and while the registry
//!   is unreachable the view keeps the last known workers and says it is stale.
//! - Every registry call is bounded by a deadline and every background loop stops on its
//!   [`CancellationToken`](tokio_util::sync::CancellationToken).
//! - This crate never installs a metrics exporter; it records through the `metrics` facade
//!   under the names in `duet_telemetry::names`.

#![forbid(unsafe_code)]

pub mod control;
mod error;
mod etcd;
mod memory;
mod record;
mod registration;
mod registry;
mod view;

pub use error::{BoxError, Error, ErrorClass, Result};
pub use etcd::{EtcdCredentials, EtcdOptions, EtcdRegistry};
pub use memory::{MemoryRegistry, DEFAULT_HISTORY_LIMIT};
pub use record::{
    now_ms, parse_worker_key, role_prefix, worker_key, workers_prefix, Capacity, KvEndpoint,
    KvGroupShape, Role, WorkerRecord, RECORD_VERSION,
};
pub use registration::{Registration, RegistrationOptions, RegistrationStatus};
pub use registry::{
    with_timeout, KeyValue, Lease, LeaseId, Listing, Registry, WatchEvent, WatchStream,
};
pub use view::{ClusterView, Snapshot, ViewOptions};

#[cfg(test)]
mod tests;
