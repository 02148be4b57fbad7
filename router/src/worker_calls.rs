//! The router's calls to workers besides the token stream, and how their failures are
//! read: a broken connection is an unavailable worker; a decode worker's report of a
//! prefill failure blames that prefill worker (or their KV link), not itself. Every control
//! call is bounded by [`CONTROL_TIMEOUT`], a hung worker included.

use std::time::Duration;

use duet_discovery::WorkerRecord;
use duet_proto::v1 as pb;
use tonic::Status;

use crate::error::RouterError;
use crate::workers::Workers;

/// Bound on control calls to a worker (reserve, release, cancel): a worker that does not
/// answer them within this is treated as unavailable.
pub(crate) const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

/// A worker call that got no answer within `limit`: the worker is hung or cut off.
pub(crate) fn no_answer(what: &str, limit: Duration) -> Status {
    Status::unavailable(format!("no answer to {what} within {limit:?}"))
}

pub(crate) fn worker_err(w: &WorkerRecord, status: Status) -> RouterError {
    // A connection that broke mid-call (the worker died) reaches tonic's caller as UNKNOWN
    // ("transport error", "h2 protocol error"): to the router that is a worker that became
    // unavailable.
    let status = if status.code() == tonic::Code::Unknown && connection_broke(&status) {
        Status::unavailable(format!("connection lost: {}", status.message()))
    } else {
        status
    };
    RouterError::Worker {
        worker: format!("{} {}", w.role, w.id),
        worker_id: w.id.clone(),
        status,
    }
}

/// A failure on `decoder`'s stream: the prefill worker's (or its KV link's) when the decode
/// worker says so, else the decode worker's own.
pub(crate) fn stream_err(
    decoder: &WorkerRecord,
    prefill: Option<&WorkerRecord>,
    s: Status,
) -> RouterError {
    match prefill {
        Some(p) if duet_serving::status::is_prefill_failure(&s) => {
            if duet_serving::status::is_kv_link_failure(&s) {
                RouterError::KvLink {
                    prefill_id: p.id.clone(),
                    decode_id: decoder.id.clone(),
                    status: s,
                }
            } else {
                worker_err(p, s)
            }
        }
        _ => worker_err(decoder, s),
    }
}

/// Whether `status` came from a broken connection rather than from the worker's answer. A
/// status the worker sent has no cause; one tonic made on this side from a transport, h2 or
/// hyper error keeps that error as its source.
fn connection_broke(status: &Status) -> bool {
    std::error::Error::source(status).is_some()
}

/// Asks decode worker `addr` to free request `id` (bounded wait; errors are ignored: the
/// worker also frees sequences whose stream closed and reservations that expire).
pub(crate) async fn release_decode(workers: &Workers, addr: &str, id: u64) {
    if let Ok(mut c) = workers.decode(addr) {
        let mut req = tonic::Request::new(pb::ReleaseRequest { request_id: id });
        req.set_timeout(CONTROL_TIMEOUT);
        // Bounded here too: a hung worker (SIGSTOP) never answers, and tonic leaves the
        // deadline to the server. Its reservation then expires on its own TTL.
        let _ = tokio::time::timeout(CONTROL_TIMEOUT, c.release(req)).await;
    }
}

/// Tells prefill worker `addr` that request `id` with these block hashes is coming (fire and
/// forget, bounded: a prefetch is a hint).
pub(crate) fn prefetch(workers: &Workers, addr: &str, id: u64, hashes: &[u64]) {
    let Ok(mut c) = workers.kv_cache(addr) else {
        return;
    };
    let mut req = tonic::Request::new(pb::PrefetchRequest {
        request_id: id,
        block_hashes: hashes.to_vec(),
    });
    req.set_timeout(CONTROL_TIMEOUT);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(CONTROL_TIMEOUT, c.prefetch(req)).await;
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use duet_discovery::Role;
    use duet_serving::status::{mark_kv_link_failed, mark_prefill_failed};

    use super::*;

    fn pair() -> (WorkerRecord, WorkerRecord) {
        (
            WorkerRecord::new("c", Role::Decode, "decode-0", "http://d:1"),
            WorkerRecord::new("c", Role::Prefill, "prefill-0", "http://p:1"),
        )
    }

    /// A worker that cannot find its peer in its own view of the registry (the views lag one
    /// another while a worker restarts) refuses with NotFound, flagged as a failed link: the
    /// router avoids the pair and tries another, without spending an attempt. Seen in a
    /// rolling restart, where this refusal used to fail the request as InvalidArgument.
    #[test]
    fn a_peer_missing_from_a_workers_view_is_a_failed_link_not_a_bad_request() {
        let (d, p) = pair();
        // The decode worker's door (prefill worker not in its view).
        let door = mark_prefill_failed(mark_kv_link_failed(Status::not_found(
            "http://p:1 is not a registered prefill worker of cluster c",
        )));
        // The prefill worker's answer (decode endpoint not in its view), relayed.
        let relayed = mark_prefill_failed(mark_kv_link_failed(Status::not_found(
            "tcp://d:2 is not a registered decode worker's KV endpoint in cluster c",
        )));
        for s in [door, relayed] {
            let e = stream_err(&d, Some(&p), s);
            assert_eq!(e.failed_link(), Some(("prefill-0", "decode-0")), "{e}");
            assert!(e.retryable());
            assert_eq!(e.status().code(), tonic::Code::Unavailable);
            assert_eq!(e.suspect_worker(), None, "neither worker is suspect");
        }
    }

    #[test]
    fn a_prefill_workers_refusal_blames_it_and_a_bad_request_is_not_retried() {
        let (d, p) = pair();
        let s = mark_prefill_failed(Status::invalid_argument("token outside the vocabulary"));
        let e = stream_err(&d, Some(&p), s);
        assert_eq!(e.failed_link(), None);
        assert!(!e.retryable());
        assert!(e.to_string().starts_with("prefill prefill-0"), "{e}");
        // Without the flag the decode worker itself answered.
        let e = stream_err(&d, Some(&p), Status::unavailable("draining"));
        assert_eq!(e.suspect_worker(), Some("decode-0"));
    }
}
