//! The decode worker's error type, classified once into the shared error classes.

use duet_engine::{EngineError, ErrorClass};

/// What can go wrong in the decode worker.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("no reservation for request {0} (expired or released)")]
    NoReservation(u64),
    #[error("request {0} is already known to this worker")]
    Duplicate(u64),
    #[error("queue full: {0} sequences waiting")]
    QueueFull(usize),
    #[error("the KV of request {request_id} did not arrive: {reason}")]
    TransferFailed { request_id: u64, reason: String },
    #[error("the KV of request {0} did not arrive in time")]
    TransferTimeout(u64),
    #[error("the worker is shutting down")]
    ShuttingDown,
    #[error(
        "request {0}: the prompt does not start with the cached blocks its reservation \
         attached (block hashes from another prompt)"
    )]
    PrefixMismatch(u64),
    /// A forward failed and no request of the batch was to blame: this worker's fault, so
    /// another worker may well succeed (the router migrates the stream).
    #[error("the decode step failed on this worker: {0}")]
    StepFailed(String),
    /// The prefill worker to call is not registered in this cluster, as this worker's view
    /// shows it: refused (this worker never calls an address a caller made up). Views of
    /// the registry lag one another (a prefill worker restarting, a watch behind), so to the
    /// router this is a failed link between the pair ([`DecodeError::status`] says so): it
    /// tries another pair.
    #[error("{address} is not a registered prefill worker of cluster {cluster}")]
    UnregisteredPrefill { address: String, cluster: String },
}

impl DecodeError {
    /// The class that becomes the gRPC status and the metric label.
    pub fn class(&self) -> ErrorClass {
        match self {
            DecodeError::Engine(e) => e.class(),
            DecodeError::NoReservation(_) | DecodeError::UnregisteredPrefill { .. } => {
                ErrorClass::NotFound
            }
            DecodeError::Duplicate(_) => ErrorClass::InvalidArgument,
            DecodeError::QueueFull(_) => ErrorClass::ResourceExhausted,
            DecodeError::TransferFailed { .. }
            | DecodeError::ShuttingDown
            | DecodeError::StepFailed(_) => ErrorClass::Unavailable,
            DecodeError::TransferTimeout(_) => ErrorClass::DeadlineExceeded,
            DecodeError::PrefixMismatch(_) => ErrorClass::Internal,
        }
    }

    /// As a gRPC status.
    pub fn status(&self) -> tonic::Status {
        let s = duet_serving::status::status(self.class(), self.to_string());
        match self {
            DecodeError::UnregisteredPrefill { .. } => duet_serving::status::mark_prefill_failed(
                duet_serving::status::mark_kv_link_failed(s),
            ),
            _ => s,
        }
    }
}
