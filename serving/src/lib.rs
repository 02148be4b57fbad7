//! What every duet gRPC server (router, prefill worker, decode worker) shares:
//!
//! - [`error`]: the crate's one error type;
//! - [`channels`]: lazily connected channels to other duet processes, one per address;
//! - [`cluster_auth`]: the cluster token internal calls carry and workers check;
//! - [`deadline`]: the caller's `grpc-timeout`, read once for every server;
//! - [`convert`]: proto messages <-> engine types (sampling parameters, finish reasons,
//!   cache tiers);
//! - [`status`]: the one mapping from an error class to a gRPC status code;
//! - [`server`]: serving a tonic router with `grpc.health.v1`, server reflection and
//!   graceful shutdown (health NOT_SERVING, stop accepting, drain with a deadline);
//! - [`tls`]: TLS (optionally mutual) for servers and clients, from PEM files;
//! - [`trace_context`]: W3C `traceparent` in gRPC metadata, one trace id per request across
//!   the router and the workers;
//!
//! The conversions live here once so that the router and both workers agree on them.

#![forbid(unsafe_code)]

pub mod channels;
pub mod cluster_auth;
pub mod convert;
pub mod deadline;
pub mod error;
pub mod server;
pub mod status;
pub mod tls;
pub mod trace_context;
