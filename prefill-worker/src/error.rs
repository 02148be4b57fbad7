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
}

impl PrefillError {
    /// The class that becomes the gRPC status and the metric label.
    pub fn class(&self) -> ErrorClass {
        match self {
            PrefillError::Engine(e) => e.class(),
            PrefillError::Transfer(e) => match e.class() {
                duet_kv_transfer::ErrorClass::InvalidArgument => ErrorClass::InvalidArgument,
                duet_kv_transfer::ErrorClass::DeadlineExceeded => ErrorClass::DeadlineExceeded,
                duet_kv_transfer::ErrorClass::ResourceExhausted => ErrorClass::ResourceExhausted,
                _ => ErrorClass::Unavailable,
            },
            PrefillError::QueueFull(_) => ErrorClass::ResourceExhausted,
            PrefillError::TooLong { .. } => ErrorClass::InvalidArgument,
            PrefillError::Cancelled(_) | PrefillError::ShuttingDown => ErrorClass::Unavailable,
        }
    }

    /// As a gRPC status.
    pub fn status(&self) -> tonic::Status {
        duet_serving::status::status(self.class(), self.to_string())
    }
}
