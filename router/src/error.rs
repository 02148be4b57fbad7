//! The router's error type, classified once into the shared error classes.

use duet_engine::{EngineError, ErrorClass};

/// What can go wrong while serving a request.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("unknown model `{0}`")]
    UnknownModel(String),
    #[error("too many {priority} requests queued ({queued}); retry after {retry_after_ms} ms")]
    QueueFull {
        priority: &'static str,
        queued: usize,
        retry_after_ms: u64,
    },
    #[error("no {role} worker available: {reason}")]
    NoWorker { role: &'static str, reason: String },
    #[error("{worker}: {status}")]
    Worker {
        /// Role and id, for the message.
        worker: String,
        /// The worker's id (what placement avoids after a failure).
        worker_id: String,
        #[source]
        status: tonic::Status,
    },
    #[error(
        "KV link from prefill worker {prefill_id} to decode worker {decode_id} failed: {status}"
    )]
    KvLink {
        prefill_id: String,
        decode_id: String,
        #[source]
        status: tonic::Status,
    },
    #[error("request id `{0}` is already in flight")]
    DuplicateRequestId(String),
    #[error("this client already has {limit} requests in flight (the per-client limit)")]
    ClientBusy { limit: usize },
    #[error("unauthenticated: {0}")]
    Unauthenticated(&'static str),
    #[error("deadline exceeded {0}")]
    Deadline(&'static str),
    #[error("invalid prompt: {tokens} tokens (with {headroom} for generation) exceed the largest decode KV pool ({largest} tokens)")]
    PromptExceedsPools {
        tokens: usize,
        headroom: usize,
        largest: u64,
    },
}

impl RouterError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        RouterError::Invalid {
            field,
            reason: reason.into(),
        }
    }

    /// The class that becomes the gRPC status and the metric label.
    pub fn class(&self) -> ErrorClass {
        match self {
            RouterError::Engine(e) => e.class(),
            RouterError::Invalid { .. } => ErrorClass::InvalidArgument,
            RouterError::UnknownModel(_) => ErrorClass::NotFound,
            RouterError::QueueFull { .. } => ErrorClass::ResourceExhausted,
            RouterError::NoWorker { .. } => ErrorClass::Unavailable,
            // A worker that lost the request's reservation or sequence is, to the client, a
            // worker that became unavailable (not an unknown model: 404 would mislead).
            RouterError::Worker { status, .. } => {
                match duet_serving::status::class_of(status.code()) {
                    ErrorClass::NotFound => ErrorClass::Unavailable,
                    c => c,
                }
            }
            // To the client, a pair of workers that cannot talk is unavailable capacity.
            RouterError::KvLink { .. } => ErrorClass::Unavailable,
            RouterError::Deadline(_) => ErrorClass::DeadlineExceeded,
            RouterError::DuplicateRequestId(_) => ErrorClass::AlreadyExists,
            RouterError::ClientBusy { .. } => ErrorClass::ResourceExhausted,
            RouterError::Unauthenticated(_) => ErrorClass::Unauthenticated,
            RouterError::PromptExceedsPools { .. } => ErrorClass::InvalidArgument,
        }
    }

    /// Whether another worker pair might succeed (before any token was sent): a worker
    /// that failed or lost the reservation. Not a full queue, not a wait for room that
    /// already lasted `max_queue_wait`.
    pub fn retryable(&self) -> bool {
        match self {
            RouterError::Worker { status, .. } => matches!(
                duet_serving::status::class_of(status.code()),
                ErrorClass::Unavailable | ErrorClass::ResourceExhausted | ErrorClass::NotFound
            ),
            // Another pair (or a local prefill) does not need that link.
            RouterError::KvLink { .. } => true,
            _ => false,
        }
    }

    /// A worker refused for lack of KV room: its published capacity was stale. The request
    /// waits in the queue again instead of spending an attempt.
    pub fn worker_full(&self) -> bool {
        matches!(self, RouterError::Worker { status, .. }
            if status.code() == tonic::Code::ResourceExhausted)
    }

    /// The worker to avoid for a while: one that could not be reached or did not answer in
    /// time (dead, hung, partitioned). A worker that answered with an error is not suspect.
    pub fn suspect_worker(&self) -> Option<&str> {
        match self {
            RouterError::Worker {
                worker_id, status, ..
            } => matches!(
                duet_serving::status::class_of(status.code()),
                ErrorClass::Unavailable | ErrorClass::DeadlineExceeded
            )
            .then_some(worker_id.as_str()),
            _ => None,
        }
    }

    /// The prefill -> decode pair whose KV link failed (placement avoids it for a while).
    pub fn failed_link(&self) -> Option<(&str, &str)> {
        match self {
            RouterError::KvLink {
                prefill_id,
                decode_id,
                ..
            } => Some((prefill_id.as_str(), decode_id.as_str())),
            _ => None,
        }
    }

    /// As a gRPC status (queue-full carries a retry hint in `retry-after-ms`).
    pub fn status(&self) -> tonic::Status {
        let mut s = duet_serving::status::status(self.class(), self.to_string());
        if let RouterError::QueueFull { retry_after_ms, .. } = self {
            if let Ok(v) = retry_after_ms.to_string().parse() {
                s.metadata_mut().insert("retry-after-ms", v);
            }
        }
        s
    }
}
