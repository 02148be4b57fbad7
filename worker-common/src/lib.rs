//! What duet's two workers (prefill and decode) share, and the router never needs:
//!
//! - [`engine_thread`]: the one run loop of both engine threads (commands, ticks, an idle
//!   thread blocked on its channel, cancellation);
//! - [`prefix_cache`]: the prefix cache's metrics and the flushing of its events;
//! - [`kv_events`]: a worker's prefix-cache events for routers (`duet.v1.KvCache`);
//! - [`transfer_layout`]: the engine's KV layout as kv-transfer describes it;
//! - [`kv_shape`]: the cache's layer groups as a worker's record describes them;
//! - [`server`]: registering with live capacity, the peers' view, and serving behind the
//!   cluster token with the shutdown order both workers keep.
//!
//! Kept apart from `duet-serving` (what every gRPC server shares, the router included) so
//! that the router links neither kv-transfer nor the engine threads.
//!
//! Invariant: nothing here blocks an engine thread on a peer: event publishing drops to a
//! snapshot for a subscriber that falls behind instead of waiting for it.

#![forbid(unsafe_code)]

pub mod device_memory;
pub mod engine_thread;
pub mod kv_events;
pub mod kv_shape;
pub mod prefix_cache;
pub mod server;
mod transfer_layout;

pub use server::{ShmSetting, StartError, WorkerServer};
pub use transfer_layout::transfer_layout;
