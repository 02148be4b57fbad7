//! A `ViaPrefill` request: this decode worker reserved blocks for the prompt and now asks
//! the prefill worker the router picked to compute it and stream its KV into them.
//!
//! Why the decode worker makes this call and not the router: the router's work per request
//! is then one gRPC call whatever the placement (three before: reserve, prefill, generate),
//! and the extra call is spread over the decode workers, which scale with the cluster, as
//! NVIDIA Dynamo's decode workers hand remote prefills to their prefill pool.
//!
//! Invariant: from before the reservation until the sequence joins the batch, [`Pending`]
//! owns the request's pending work. Dropping it (the router went away, the reservation or
//! the prefill failed, the stream ended) releases the reservation here, and cancels the
//! prefill there if it was asked for and has not answered, both without waiting; the
//! reservation's TTL is the backstop. A prefill that answered, even with an error, is not
//! cancelled: a late cancel must never reach what that prefill worker runs next (the router
//! gives every attempt its own id as well). A failure is reported with
//! [`mark_prefill_failed`], so the router blames the prefill worker or the KV link, not this
//! worker.

use std::time::Duration;

use duet_proto::v1 as pb;
use duet_proto::v1::prefill_client::PrefillClient;
use duet_serving::cluster_auth::AuthChannel;
use duet_serving::status::{mark_kv_link_failed, mark_prefill_failed};
use duet_serving::trace_context::TraceContext;
use tonic::Status;

use crate::handle::DecodeHandle;

/// Bound on the cancel sent to a prefill worker that is no longer needed.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(2);

/// What a `ViaPrefill` call needs besides the request itself.
pub struct ViaCall {
    pub client: PrefillClient<AuthChannel>,
    pub request: pb::PrefillRequest,
    pub trace: Option<TraceContext>,
    /// The caller's remaining deadline, passed on.
    pub deadline: Option<Duration>,
    /// Longest the prefill worker may take to answer.
    pub timeout: Duration,
}

/// The request's pending work until its sequence joins the batch (see the module docs).
pub struct Pending {
    handle: DecodeHandle,
    client: PrefillClient<AuthChannel>,
    request_id: u64,
    /// The reservation (made or being made) is still ours to release.
    armed: bool,
    /// The prefill was asked for and has not answered.
    prefill_outstanding: bool,
    /// Resolves if the request's KV transfer fails.
    transfer_failed: tokio::sync::oneshot::Receiver<String>,
}

impl Pending {
    /// Taken before the reservation is asked for, so that a request dropped while the
    /// engine thread has not yet answered still releases what it will reserve (the release
    /// queues behind the reservation; releasing nothing is harmless).
    pub fn new(handle: DecodeHandle, client: PrefillClient<AuthChannel>, request_id: u64) -> Self {
        let transfer_failed = handle.watch_transfer(request_id);
        Pending {
            handle,
            client,
            request_id,
            armed: true,
            prefill_outstanding: false,
            transfer_failed,
        }
    }

    /// Runs `call`, with a cancel sent if this is dropped while it is outstanding. A failure
    /// of the request's KV transfer (timed out on a silent sender, refused for its MAC, cut)
    /// ends the wait at once as a failure of the KV link from that prefill worker: a frozen
    /// sender never answers, and its connection may take the HTTP/2 keepalive's time to
    /// break.
    pub async fn prefill(&mut self, call: ViaCall) -> Result<pb::PrefillResponse, Status> {
        self.prefill_outstanding = true;
        tokio::select! {
            a = call.run() => {
                self.prefill_outstanding = false;
                a
            }
            // The prefill stays outstanding: it is cancelled when this drops.
            Ok(reason) = &mut self.transfer_failed => Err(mark_prefill_failed(
                mark_kv_link_failed(Status::unavailable(format!(
                    "the KV transfer from the prefill worker failed: {reason}"
                ))),
            )),
        }
    }

    /// The sequence joined the batch: its event receiver owns it from now on.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.handle.unwatch_transfer(self.request_id);
        if !self.armed {
            return;
        }
        self.handle.release_now(self.request_id);
        if !self.prefill_outstanding {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut client = self.client.clone();
        let mut req = tonic::Request::new(pb::ReleaseRequest {
            request_id: self.request_id,
        });
        req.set_timeout(CANCEL_TIMEOUT);
        rt.spawn(async move {
            let _ = tokio::time::timeout(CANCEL_TIMEOUT, client.cancel(req)).await;
        });
    }
}

impl ViaCall {
    /// Runs the prefill; its answer carries the first token. Every failure comes back
    /// marked as the prefill worker's.
    pub async fn run(self) -> Result<pb::PrefillResponse, Status> {
        let ViaCall {
            mut client,
            request,
            trace,
            deadline,
            timeout,
        } = self;
        let mut req = tonic::Request::new(request);
        if let Some(t) = trace {
            t.inject(&mut req);
        }
        if let Some(d) = deadline {
            req.set_timeout(d);
        }
        match tokio::time::timeout(timeout, client.prefill(req)).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(mark_prefill_failed(answered_or_lost(s))),
            Err(_) => Err(mark_prefill_failed(Status::unavailable(format!(
                "no answer to prefill within {timeout:?}"
            )))),
        }
    }
}

/// A connection that broke mid-call (the prefill worker died) reaches tonic's caller as
/// UNKNOWN with the transport error as its source; the source does not cross the wire, so
/// it becomes UNAVAILABLE here, as the router reads it for the workers it calls itself.
fn answered_or_lost(s: Status) -> Status {
    if s.code() == tonic::Code::Unknown && std::error::Error::source(&s).is_some() {
        let mut lost = Status::unavailable(format!("connection lost: {}", s.message()));
        *lost.metadata_mut() = s.metadata().clone();
        lost
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_reads_as_unavailable_and_keeps_its_metadata() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let mut s = Status::from_error(Box::new(io));
        assert_eq!(s.code(), tonic::Code::Unknown);
        s.metadata_mut()
            .insert("duet-kv-link-failed", "1".parse().unwrap());
        let lost = answered_or_lost(s);
        assert_eq!(lost.code(), tonic::Code::Unavailable);
        assert!(lost.metadata().contains_key("duet-kv-link-failed"));
        let answered = answered_or_lost(Status::invalid_argument("bad prompt"));
        assert_eq!(answered.code(), tonic::Code::InvalidArgument);
    }
}
