//! duet's gRPC contract, package `duet.v1`: the public `Generation` service
//! (`duet/v1/generation.proto`) and the internal `Decode` / `Prefill` worker
//! services (`duet/v1/worker.proto`). The `.proto` files are the source of
//! truth for clients in other languages; this crate only compiles them.

#![forbid(unsafe_code)]

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("duet.v1");
}

/// Encoded `FileDescriptorSet` of every duet proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("duet_v1_descriptor");
