//! duet's router: the public `duet.v1.Generation` door.
//!
//! A request is validated and tokenized ([`frontend`]), admitted into a bounded queue per
//! priority ([`admission`]), placed on a decode worker and, for long prompts in
//! disaggregated mode, a prefill worker ([`placement`], from the capacity workers publish in
//! the registry), then its tokens are relayed to the client ([`relay`]). With KV-aware
//! routing, placement also weighs the prompt's prefix each worker holds in its cache
//! ([`kv_index`], fed by [`kv_subscriber`]).
//!
//! [`server::serve`] runs both public doors on listeners the caller bound.
//!
//! Invariants: every request that reserved KV on a worker releases it on every path
//! (finish, error, deadline, client gone); a request is retried on another pair only
//! before its first token reached the client.

#![forbid(unsafe_code)]

pub mod admission;
pub mod api_keys;
pub mod claims;
pub mod config;
pub mod error;
pub mod frontend;
pub mod http;
pub mod kv_index;
pub mod kv_subscriber;
pub mod placement;
pub mod prompt_prefix;
pub mod recent;
pub mod relay;
pub mod request_metrics;
pub mod server;
pub mod service;
mod worker_calls;
pub mod workers;

pub use api_keys::ApiKeys;
pub use config::{Mode, RouterConfig};
pub use error::RouterError;
pub use service::{ClusterService, GenerationService};
