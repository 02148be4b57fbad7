//! duet's decode worker.
//!
//! - [`scheduler`]: one engine thread owns the model's KV cache and runs the continuous
//!   batch: every step mixes one decode row per running sequence with chunks of prompts
//!   being prefilled locally; sequences join and leave at every step; when the pool runs
//!   out, the lowest-priority, newest sequence is preempted (freed, recomputed later).
//! - [`policy`]: the scheduler's decisions as pure functions (waiting order, admission,
//!   forward planning, preemption choice), unit-tested without a model.
//! - `reservations`: the model-free table of blocks held for KV a prefill worker sends
//!   (expiry, claims, block accounting), unit-tested over a real KV cache.
//! - `leases`: the reserved blocks' regions lent to the KV receivers, which write arriving
//!   KV straight into the pool; a reservation ending mid-write is parked until the lease is
//!   back.
//! - `waiting`: the model-free queue of sequences waiting for admission (order, bound,
//!   preempted sequences back in front), unit-tested.
//! - [`handle`]: the cloneable async handle (commands over a channel, oneshot replies).
//! - [`kv_inbound`]: receives KV from prefill workers straight into reserved blocks.
//! - [`server`]: the whole worker on listeners the caller bound ([`server::DecodeWorker`]).
//! - [`service`]: the internal `duet.v1.Decode` gRPC service.
//! - [`via_prefill`]: a `ViaPrefill` request's call to the prefill worker the router picked.
//!
//! Invariant: KV blocks are only ever held by a live sequence, by a reservation with a
//! deadline, or parked behind a receiver's lease (bounded by its link timeout); every path that ends a request (finish, error, cancel, client gone, expiry)
//! frees them in the engine thread.

#![forbid(unsafe_code)]

pub mod config;
pub mod copies;
pub mod door;
pub mod error;
pub mod handle;
pub mod kv_inbound;
mod leases;
mod metrics;
pub mod policy;
mod reservations;
mod scheduler;
pub mod server;
pub mod service;
pub mod via_prefill;
pub mod waiting;

pub use config::DecodeConfig;
pub use error::DecodeError;
pub use handle::{
    DecodeHandle, DecodeStatus, Event, GenerateJob, PrefillSource, Priority, Reserved,
};
