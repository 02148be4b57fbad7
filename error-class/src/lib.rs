//! duet's one error class. Every crate classifies each of its failures once, nearest the
//! cause, into an [`ErrorClass`]; the class alone decides the gRPC code a server answers
//! ([`ErrorClass::grpc_code`]), the HTTP status of the OpenAI door
//! ([`ErrorClass::http_status`]), the bounded `outcome` metric label
//! ([`ErrorClass::label`]) and whether a caller may retry elsewhere
//! ([`ErrorClass::is_retryable`]).
//!
//! A leaf crate with no dependency on tonic or axum, so the engine and kv-transfer can
//! classify without linking a server; the servers turn the numeric codes into their types.
//!
//! Invariants: the set is small and closed (a new class is a deliberate API change, seen
//! in every `match`); labels are `snake_case`, stable and unique; the gRPC codes are the
//! canonical numbers of `google.rpc.Code`.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// The class of a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The caller gave up (its stream closed, it cancelled).
    Cancelled,
    /// The caller or a peer supplied something malformed, out of range or incompatible.
    InvalidArgument,
    /// A named object (a model, a reservation, a block) does not exist.
    NotFound,
    /// A well-formed request this model or worker cannot run as asked (a local attention
    /// window on an engine or model without it): refused, never served some other way.
    FailedPrecondition,
    /// An id already in flight.
    AlreadyExists,
    /// A queue, a pool or a size limit is full.
    ResourceExhausted,
    /// No valid credential (API key, cluster token, transfer handshake).
    Unauthenticated,
    /// Transient: a peer or backend cannot be reached or went away; another may succeed.
    Unavailable,
    /// A wait ran past its deadline.
    DeadlineExceeded,
    /// A bug or an unexpected state inside this process.
    Internal,
}

impl ErrorClass {
    /// Every class, in declaration order.
    pub const ALL: [ErrorClass; 10] = [
        ErrorClass::Cancelled,
        ErrorClass::InvalidArgument,
        ErrorClass::NotFound,
        ErrorClass::FailedPrecondition,
        ErrorClass::AlreadyExists,
        ErrorClass::ResourceExhausted,
        ErrorClass::Unauthenticated,
        ErrorClass::Unavailable,
        ErrorClass::DeadlineExceeded,
        ErrorClass::Internal,
    ];

    /// The bounded metric label (`outcome="..."`), also the class's name in JSON.
    pub fn label(self) -> &'static str {
        match self {
            ErrorClass::Cancelled => "cancelled",
            ErrorClass::InvalidArgument => "invalid_argument",
            ErrorClass::NotFound => "not_found",
            ErrorClass::FailedPrecondition => "failed_precondition",
            ErrorClass::AlreadyExists => "already_exists",
            ErrorClass::ResourceExhausted => "resource_exhausted",
            ErrorClass::Unauthenticated => "unauthenticated",
            ErrorClass::Unavailable => "unavailable",
            ErrorClass::DeadlineExceeded => "deadline_exceeded",
            ErrorClass::Internal => "internal",
        }
    }

    /// The canonical gRPC status code (`google.rpc.Code`) a server answers with.
    pub fn grpc_code(self) -> i32 {
        match self {
            ErrorClass::Cancelled => 1,
            ErrorClass::InvalidArgument => 3,
            ErrorClass::DeadlineExceeded => 4,
            ErrorClass::NotFound => 5,
            ErrorClass::FailedPrecondition => 9,
            ErrorClass::AlreadyExists => 6,
            ErrorClass::ResourceExhausted => 8,
            ErrorClass::Internal => 13,
            ErrorClass::Unavailable => 14,
            ErrorClass::Unauthenticated => 16,
        }
    }

    /// The class of a gRPC code a peer answered with, as the caller should treat it. A
    /// peer's CANCELLED or ABORTED (it was shutting down, its stream was cut) is a reason
    /// to try another peer: unavailable. OUT_OF_RANGE is the request's fault: invalid
    /// argument. Codes outside the set (UNKNOWN, UNIMPLEMENTED,
    /// DATA_LOSS, PERMISSION_DENIED, unassigned numbers) are internal.
    pub fn from_grpc_code(code: i32) -> ErrorClass {
        match code {
            3 | 11 => ErrorClass::InvalidArgument,
            9 => ErrorClass::FailedPrecondition,
            4 => ErrorClass::DeadlineExceeded,
            5 => ErrorClass::NotFound,
            6 => ErrorClass::AlreadyExists,
            8 => ErrorClass::ResourceExhausted,
            1 | 10 | 14 => ErrorClass::Unavailable,
            16 => ErrorClass::Unauthenticated,
            _ => ErrorClass::Internal,
        }
    }

    /// The HTTP status of the public door: 400, 404, 409, 429 (queue full), 401, 503, 504,
    /// 500, and 499 (nginx's "client closed request") for a cancelled one.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorClass::Cancelled => 499,
            ErrorClass::InvalidArgument => 400,
            ErrorClass::NotFound => 404,
            ErrorClass::FailedPrecondition => 400,
            ErrorClass::AlreadyExists => 409,
            ErrorClass::ResourceExhausted => 429,
            ErrorClass::Unauthenticated => 401,
            ErrorClass::Unavailable => 503,
            ErrorClass::DeadlineExceeded => 504,
            ErrorClass::Internal => 500,
        }
    }

    /// Whether the same call may succeed when tried again later or on another peer.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorClass::Unavailable | ErrorClass::DeadlineExceeded)
    }
}

impl std::fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn labels_and_codes_are_unique_and_codes_round_trip() {
        let labels: HashSet<_> = ErrorClass::ALL.iter().map(|c| c.label()).collect();
        let codes: HashSet<_> = ErrorClass::ALL.iter().map(|c| c.grpc_code()).collect();
        assert_eq!(labels.len(), ErrorClass::ALL.len());
        assert_eq!(codes.len(), ErrorClass::ALL.len());
        for c in ErrorClass::ALL {
            if c != ErrorClass::Cancelled {
                assert_eq!(ErrorClass::from_grpc_code(c.grpc_code()), c, "{c}");
            }
            // The JSON name (bench reports, kv-transfer's) is the label.
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.label())
            );
        }
    }

    #[test]
    fn a_peer_that_went_away_is_retried_elsewhere_and_bad_requests_are_not() {
        assert_eq!(ErrorClass::from_grpc_code(1), ErrorClass::Unavailable);
        assert_eq!(ErrorClass::from_grpc_code(10), ErrorClass::Unavailable);
        assert_eq!(ErrorClass::from_grpc_code(11), ErrorClass::InvalidArgument);
        assert_eq!(ErrorClass::from_grpc_code(2), ErrorClass::Internal);
        assert_eq!(ErrorClass::from_grpc_code(99), ErrorClass::Internal);
        assert!(ErrorClass::Unavailable.is_retryable());
        assert!(!ErrorClass::InvalidArgument.is_retryable());
        assert_eq!(ErrorClass::ResourceExhausted.http_status(), 429);
        // A request the model cannot run as asked is the caller's to change, not to retry.
        assert_eq!(
            ErrorClass::from_grpc_code(9),
            ErrorClass::FailedPrecondition
        );
        assert!(!ErrorClass::FailedPrecondition.is_retryable());
        assert_eq!(ErrorClass::FailedPrecondition.http_status(), 400);
    }
}
