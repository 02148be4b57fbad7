//! The prefill worker's error type, classified once.

use duet_engine::{EngineError, ErrorClass};

/// What can go wrong in the prefill worker.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("KV transfer: {0}")]
    Transfer(#[source] duet_kv_transfer::Error),
    #[error("queue full: {0} prompts waiting")]
    QueueFull(usize),
    #[error("prompt of {tokens} tokens needs {blocks} KV blocks, this worker has {total}")]
    TooLong {
        tokens: usize,
        blocks: usize,
        total: usize,
    },
    #[error("request {0} was cancelled")]
    Cancelled(u64),
    #[error("the worker is shutting down")]
    ShuttingDown,
    /// A forward failed with no request to blame: this worker's fault.
    #[error("the prefill step failed on this worker: {0}")]
    StepFailed(String),
    /// KV was to go where no decode worker of this cluster is registered, as this worker's
    /// view shows it: refused (this worker never connects to an address a caller made up).
    /// Views of the registry lag one another (a decode worker restarting, a watch behind),
    /// so to the router this is a failed link between the pair: it tries another pair.
    #[error("{endpoint} is not a registered decode worker's KV endpoint in cluster {cluster}")]
    UnregisteredDecodeEndpoint { endpoint: String, cluster: String },
}

impl PrefillError {
    /// The class that becomes the gRPC status and the metric label.
    pub fn class(&self) -> ErrorClass {
        match self {
            PrefillError::Engine(e) => e.class(),
            // kv-transfer classified it, nearest the cause.
            PrefillError::Transfer(e) => e.class(),
            PrefillError::QueueFull(_) => ErrorClass::ResourceExhausted,
            PrefillError::TooLong { .. } => ErrorClass::InvalidArgument,
            PrefillError::UnregisteredDecodeEndpoint { .. } => ErrorClass::NotFound,
            PrefillError::Cancelled(_)
            | PrefillError::ShuttingDown
            | PrefillError::StepFailed(_) => ErrorClass::Unavailable,
        }
    }

    /// Whether the KV link to the decode worker failed (timed out, broke, or could not be
    /// opened, or the decode worker is not in this worker's view of the registry): not this
    /// worker's fault, nor necessarily the decode worker's. A transfer the decode worker
    /// refused, or a local failure, is not a link failure.
    pub fn is_link_failure(&self) -> bool {
        match self {
            PrefillError::Transfer(e) => e.is_link_failure(),
            PrefillError::UnregisteredDecodeEndpoint { .. } => true,
            _ => false,
        }
    }

    /// As a gRPC status (a link failure carries [`duet_serving::status::KV_LINK_FAILED`]).
    pub fn status(&self) -> tonic::Status {
        let s = duet_serving::status::status(self.class(), self.to_string());
        if self.is_link_failure() {
            duet_serving::status::mark_kv_link_failed(s)
        } else {
            s
        }
    }
}
