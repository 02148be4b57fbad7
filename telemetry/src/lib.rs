//! duet's telemetry: the one place every metric is named and described ([`names`],
//! [`describe_all`]), the Prometheus exposition every process serves on `/metrics`
//! ([`install`], [`metrics_router`]), log set-up and optional OTLP span export
//! ([`init_logs`], feature `otlp`).
//!
//! Invariants:
//! - Library crates only record through the `metrics` facade under the names in [`names`];
//!   a binary installs the recorder once ([`install`] is idempotent, so `duet up`, which runs
//!   every role in one process, shares one registry).
//! - Histograms have explicit buckets chosen per metric ([`exporter`]), never summaries.
//! - Label values are bounded (see [`names`]); nothing derived from request content is a
//!   label.

#![forbid(unsafe_code)]

mod describe;
mod error;
pub mod exporter;
mod logs;
pub mod names;
#[cfg(feature = "otlp")]
mod otlp;

pub use describe::describe_all;
pub use error::Error;
pub use exporter::{install, metrics_router, serve_metrics, spawn_upkeep};
pub use logs::{init_logs, link_remote_parent, span_ids, LogFormat, LogGuard};
