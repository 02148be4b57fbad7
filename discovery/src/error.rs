//! The one error type of this crate and its mapping to a small, bounded class.
//!
//! Invariant: every variant maps to exactly one [`ErrorClass`] in [`Error::class`]; the class
//! is what callers turn into a gRPC status, an HTTP status or a metric label, so it never
//! carries unbounded text.

use std::time::Duration;

/// Boxed cause for errors whose concrete type we do not want in the public API.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while talking to the registry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The registry could not be reached or refused service (connection refused, no leader,
    /// simulated outage of the in-memory backend).
    #[error("registry unavailable during {op}")]
    Unavailable {
        /// The operation that failed.
        op: &'static str,
        /// Underlying cause, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// A registry call did not finish within its deadline.
    #[error("registry call {op} timed out after {timeout:?}")]
    Timeout {
        /// The operation that timed out.
        op: &'static str,
        /// The deadline that elapsed.
        timeout: Duration,
    },

    /// The lease expired or was revoked; whoever owned it must register again.
    #[error("lease {lease} not found (expired or revoked)")]
    LeaseNotFound {
        /// Lease id as the backend knows it.
        lease: i64,
    },

    /// A watch asked for history that has been compacted away; the caller must list again.
    #[error(
        "watch from revision {requested} is no longer possible: history compacted up to {compact_revision}"
    )]
    Compacted {
        /// The start revision the caller asked for.
        requested: i64,
        /// The oldest revision the backend still has.
        compact_revision: i64,
    },

    /// A watch stream ended or was cancelled by the backend; the caller must list again.
    #[error("watch broken: {reason}")]
    WatchBroken {
        /// Why (backend message, bounded by the backend).
        reason: String,
        /// Underlying cause, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// A worker record or key failed validation.
    #[error("invalid worker record: {reason}")]
    InvalidRecord {
        /// What is wrong.
        reason: String,
    },

    /// A worker record carries a version this build does not understand.
    #[error("unsupported worker record version {found} (this build reads version {expected})")]
    UnsupportedVersion {
        /// Version found in the record.
        found: u32,
        /// Version this build reads and writes.
        expected: u32,
    },

    /// A worker record is not valid JSON for the expected schema.
    #[error("malformed worker record")]
    Decode {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },

    /// A worker record could not be encoded (should not happen for well-formed records).
    #[error("cannot encode worker record")]
    Encode {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },

    /// Any other etcd failure.
    #[error("etcd {op} failed")]
    Etcd {
        /// The operation that failed.
        op: &'static str,
        /// The etcd client error.
        #[source]
        source: etcd_client::Error,
    },

    /// The registration or view was stopped (token cancelled or deregistered).
    #[error("stopped")]
    Stopped,
}

pub use duet_error_class::ErrorClass;

impl Error {
    /// The bounded class of this error.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Unavailable { .. }
            | Error::LeaseNotFound { .. }
            | Error::Compacted { .. }
            | Error::WatchBroken { .. }
            | Error::Stopped => ErrorClass::Unavailable,
            Error::Timeout { .. } => ErrorClass::DeadlineExceeded,
            Error::InvalidRecord { .. }
            | Error::UnsupportedVersion { .. }
            | Error::Decode { .. } => ErrorClass::InvalidArgument,
            Error::Encode { .. } => ErrorClass::Internal,
            Error::Etcd { source, .. } => etcd_class(source),
        }
    }

    /// True when retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.class(),
            ErrorClass::Unavailable | ErrorClass::DeadlineExceeded
        )
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        Error::InvalidRecord {
            reason: reason.into(),
        }
    }
}

fn etcd_class(e: &etcd_client::Error) -> ErrorClass {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::GRpcStatus(status) => match status.code() {
            Code::Unavailable | Code::Aborted | Code::ResourceExhausted | Code::Cancelled => {
                ErrorClass::Unavailable
            }
            Code::DeadlineExceeded => ErrorClass::DeadlineExceeded,
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                ErrorClass::InvalidArgument
            }
            _ => ErrorClass::Internal,
        },
        E::TransportError(_) | E::IoError(_) | E::WatchError(_) | E::LeaseKeepAliveError(_) => {
            ErrorClass::Unavailable
        }
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => ErrorClass::InvalidArgument,
        _ => ErrorClass::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_bounded_and_stable() {
        assert_eq!(
            Error::Timeout {
                op: "put",
                timeout: Duration::from_secs(1)
            }
            .class(),
            ErrorClass::DeadlineExceeded
        );
        assert_eq!(
            Error::LeaseNotFound { lease: 7 }.class(),
            ErrorClass::Unavailable
        );
        assert_eq!(
            Error::UnsupportedVersion {
                found: 2,
                expected: 1
            }
            .class(),
            ErrorClass::InvalidArgument
        );
        let etcd = Error::Etcd {
            op: "get",
            source: etcd_client::Error::GRpcStatus(tonic::Status::unavailable("down")),
        };
        assert_eq!(etcd.class(), ErrorClass::Unavailable);
        assert!(etcd.is_retryable());
        assert_eq!(ErrorClass::DeadlineExceeded.label(), "deadline_exceeded");
    }
}
