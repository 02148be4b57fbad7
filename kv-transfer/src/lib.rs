//! Moves KV-cache blocks from prefill workers to decode workers.
//!
//! - [`KvLayout`] describes the cache geometry both sides must share; [`TransferDesc`] one
//!   transfer (request, tokens, receiver-reserved destination blocks).
//! - The prefill side drives a [`KvSender`] layer by layer as the forward pass produces
//!   them; the decode side runs a [`KvReceiver`] that writes each frame straight into the
//!   engine's blocks through the [`KvSink`] trait.
//! - Backends: [`backend::tcp`] (default), [`backend::shm`] (same host: one copy, from the
//!   sender's send arena or through `process_vm_readv`, or a shared ring),
//!   [`backend::local`] (same process, zero copy), `backend::nccl` (feature `nccl`),
//!   `backend::rdma` (feature `rdma`, UCX); [`select_backend`] picks one.
//! - The wire format is documented in [`protocol`]; connections authenticate with a
//!   shared-secret HMAC challenge-response ([`SharedSecret`]).
//! - Every error is an [`Error`] with a coarse [`ErrorClass`]; after a receiver accepted a
//!   header, failures list the blocks to release ([`Error::blocks_to_release`]).
//!
//! Invariant: the only `unsafe` code is in FFI modules: the shared-memory mappings
//! (`backend::shm::mapping`; `backend::shm::memfd`, with its fd passing), and the optional
//! `nccl` backend and `rdma` bindings (`backend::rdma::ffi`, over the C shim
//! `backend/rdma/shim.c`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod auth;
pub mod backend;
pub mod buffer;
pub mod config;
pub mod endpoint;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod handshake;
pub mod layout;
pub mod mem_sink;
pub mod protocol;
pub mod sink;

pub use api::{KvReceiver, KvSender, TransferReceipt};
pub use auth::SharedSecret;
pub use backend::{select_backend, AnyReceiver, AnySender, BackendCaps, BackendKind, EndpointInfo};
pub use config::{Timeouts, TransferConfig};
pub use endpoint::{serve_inbound, Connector, Endpoint, Inbound, LocalHub, Route};
pub use error::{Error, ErrorClass, Result, SinkError};
pub use layout::{
    Dtype, Fingerprint, KvKind, KvLayout, KvLayoutSpec, LayoutMismatch, TransferDesc,
};
pub use mem_sink::MemorySink;
pub use protocol::codec::LayerRegions;
pub use protocol::Compression;
pub use sink::KvSink;
