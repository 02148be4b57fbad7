//! duet's prefill worker.
//!
//! - [`engine_loop`]: one engine thread batches queued prompts up to a token budget per
//!   forward (long prompts are cut into block-aligned chunks, one KV transfer each); after
//!   each layer of the forward it hands that layer's new KV, read in place, to the
//!   request's transfer task, so layer `l` is on the wire while layer `l + 1` computes.
//! - [`send_pool`]: the KV pool as the transfers' source: in the send arena same-host
//!   decode workers map, its regions lent as pinned `Bytes` (no copy on this side).
//! - [`handle`]: the settings, job and result types, and the cloneable handle that talks
//!   to the engine thread.
//! - [`policy`]: the queue's order and the forward's chunks as pure functions,
//!   unit-tested without a model.
//! - `queue`: the prompts not yet started, as model-free state (order, bound, cancel),
//!   unit-tested.
//! - [`transfer`]: the per-request task that drives a pooled kv-transfer sender.
//! - [`server`]: the whole worker on a listener the caller bound ([`server::PrefillWorker`]).
//! - [`service`]: the internal `duet.v1.Prefill` gRPC service.
//!
//! Invariant: a request's scratch KV lives in this worker only while its prefill runs; it is
//! freed after the forward of its last chunk, whatever happens to the transfer (a block a
//! sender still reads goes back to the pool when the sender lets go of it).

#![forbid(unsafe_code)]

pub mod engine_loop;
pub mod error;
pub mod handle;
mod metrics;
pub mod policy;
mod queue;
pub mod send_pool;
pub mod server;
pub mod service;
pub mod transfer;

pub use error::PrefillError;
pub use handle::{PrefillConfig, PrefillHandle, PrefillJob, PrefillResult, PrefillStatus};
