//! Error class <-> gRPC status for every duet server and client (the numbers are
//! [`ErrorClass`]'s own), and the failure flags peers set on statuses.

use duet_engine::{EngineError, ErrorClass};
use tonic::{Code, Status};

/// gRPC code of an error class.
pub fn code(class: ErrorClass) -> Code {
    Code::from_i32(class.grpc_code())
}

/// Error class of a gRPC code received from a peer (for retry decisions and metrics).
pub fn class_of(code: Code) -> ErrorClass {
    ErrorClass::from_grpc_code(code as i32)
}

/// A status for an error of `class` with `message`.
pub fn status(class: ErrorClass, message: impl Into<String>) -> Status {
    Status::new(code(class), message)
}

/// The status of an engine error.
pub fn engine_status(e: &EngineError) -> Status {
    status(e.class(), e.to_string())
}

/// Metadata key a prefill worker sets on a failure of the KV link to the decode worker
/// (the link timed out, broke or could not be opened), as opposed to a failure of its own:
/// the router then avoids that prefill -> decode pair rather than either worker.
pub const KV_LINK_FAILED: &str = "duet-kv-link-failed";

/// `status` with the flag `key` set in its metadata (what else it carries is kept).
fn flagged(mut status: Status, key: &'static str) -> Status {
    status
        .metadata_mut()
        .insert(key, tonic::metadata::MetadataValue::from_static("1"));
    status
}

/// Marks `status` as a KV link failure.
pub fn mark_kv_link_failed(status: Status) -> Status {
    flagged(status, KV_LINK_FAILED)
}

/// Whether a prefill worker's `status` reports a KV link failure.
pub fn is_kv_link_failure(status: &Status) -> bool {
    status.metadata().contains_key(KV_LINK_FAILED)
}

/// Metadata key a decode worker sets on the status of a `ViaPrefill` request that failed
/// at the prefill worker it called (or on the KV link from it): the router then blames
/// that prefill worker (or the pair, with [`KV_LINK_FAILED`]), not the decode worker.
pub const PREFILL_FAILED: &str = "duet-prefill-failed";

/// Marks `status`, from or about the prefill worker, as a prefill failure (keeping the
/// prefill worker's own metadata, such as [`KV_LINK_FAILED`]).
pub fn mark_prefill_failed(status: Status) -> Status {
    flagged(status, PREFILL_FAILED)
}

/// Whether a decode worker's `status` reports a failure of the prefill worker it called.
pub fn is_prefill_failure(status: &Status) -> bool {
    status.metadata().contains_key(PREFILL_FAILED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_flags_compose_and_keep_the_status() {
        let s = mark_kv_link_failed(Status::unavailable("link cut"));
        assert!(is_kv_link_failure(&s) && !is_prefill_failure(&s));
        let s = mark_prefill_failed(s);
        assert!(is_kv_link_failure(&s) && is_prefill_failure(&s));
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(s.message(), "link cut");
        assert!(!is_prefill_failure(&Status::internal("decode worker")));
    }
}
