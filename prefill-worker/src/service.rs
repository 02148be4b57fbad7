//! The internal `duet.v1.Prefill` gRPC service over a [`PrefillHandle`].

use duet_discovery::{ClusterView, Role};
use duet_kv_transfer::Endpoint;
use duet_proto::v1 as pb;
use duet_serving::convert::{attention_from_proto, sampling_from_proto};
use duet_serving::trace_context::TraceContext;
use tonic::{Request, Response, Status};

use crate::error::PrefillError;
use crate::handle::{PrefillHandle, PrefillJob};

/// `duet.v1.Prefill` backed by one engine thread.
#[derive(Clone)]
pub struct PrefillService {
    handle: PrefillHandle,
    id: String,
    /// The cluster as the registry shows it: KV goes only to endpoints registered decode
    /// workers advertise (this worker never connects to an address a caller made up).
    peers: ClusterView,
}

impl PrefillService {
    pub fn new(handle: PrefillHandle, id: String, peers: ClusterView) -> Self {
        PrefillService { handle, id, peers }
    }

    /// Refuses a request whose KV endpoints are not all a registered decode worker's.
    async fn check_endpoints(&self, all: &[pb::KvEndpoint]) -> Result<(), Status> {
        for e in all {
            let known = self
                .peers
                .has_worker(Role::Decode, |w| {
                    w.kv_endpoints
                        .iter()
                        .any(|k| k.transport == e.transport && k.address == e.address)
                })
                .await;
            if !known {
                return Err(PrefillError::UnregisteredDecodeEndpoint {
                    endpoint: format!("{}://{}", e.transport, e.address),
                    cluster: self.peers.cluster().to_string(),
                }
                .status());
            }
        }
        Ok(())
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::prefill_server::PrefillServer<Self> {
        pb::prefill_server::PrefillServer::new(self)
    }
}

/// The decode worker's endpoints this build understands (others, from a newer peer, are
/// skipped); only the router's single pick when the list is empty (an older router).
fn offered_endpoints(all: &[pb::KvEndpoint]) -> Result<Vec<Endpoint>, Status> {
    let parsed: Vec<Endpoint> = all
        .iter()
        .filter_map(|e| match Endpoint::parse(&e.transport, &e.address) {
            Ok(e) => Some(e),
            Err(err) => {
                tracing::debug!(error = %err, "skipping a KV endpoint");
                None
            }
        })
        .collect();
    if parsed.is_empty() {
        return Err(
            PrefillError::Transfer(duet_kv_transfer::Error::InvalidArgument(format!(
                "none of the decode worker's KV endpoints is usable: {all:?}"
            )))
            .status(),
        );
    }
    Ok(parsed)
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let trace = TraceContext::extract(req.metadata());
        let r = req.into_inner();
        self.check_endpoints(&r.kv_endpoints).await?;
        let route = self
            .handle
            .connector()
            .route(&offered_endpoints(&r.kv_endpoints)?)
            .map_err(|e| PrefillError::Transfer(e).status())?;
        let sampling = sampling_from_proto(r.sampling.as_ref());
        sampling
            .validate()
            .map_err(|e| duet_serving::status::engine_status(&e))?;
        let attention = attention_from_proto(r.attention.as_ref())
            .map_err(|e| duet_serving::status::engine_status(&e))?
            .unwrap_or_default();
        let span = tracing::info_span!(
            "prefill",
            request_id = r.request_id,
            worker = %self.id,
            trace_id = tracing::field::Empty,
            parent_span_id = tracing::field::Empty,
        );
        duet_serving::trace_context::join_caller_trace(&span, trace);
        let done_span = span.clone();
        let outcome = crate::metrics::RequestOutcome::new(&self.id);
        let prompt_tokens = r.prompt.len();
        let res = self
            .handle
            .prefill(PrefillJob {
                request_id: r.request_id,
                prompt: r.prompt,
                sampling,
                route,
                dst_blocks: r.dst_blocks,
                dst_start: r.dst_start_tokens as usize,
                batch: r.priority == pb::Priority::Batch as i32,
                attention,
                span,
            })
            .await;
        let res = match res {
            Ok(r) => {
                let total = r.queue_seconds + r.prefill_seconds + r.kv_transfer_seconds;
                outcome.done("ok", Some(total));
                tracing::info!(
                    parent: &done_span,
                    prompt_tokens,
                    prefill_seconds = r.prefill_seconds,
                    kv_bytes = r.kv_bytes,
                    "prefilled"
                );
                r
            }
            Err(e) => {
                outcome.done(e.class().label(), None);
                return Err(e.status());
            }
        };
        Ok(Response::new(pb::PrefillResponse {
            first_token: res.first_token,
            queue_seconds: res.queue_seconds,
            prefill_seconds: res.prefill_seconds,
            kv_transfer_seconds: res.kv_transfer_seconds,
            kv_bytes: res.kv_bytes,
            kv_stream_seconds: res.kv_stream_seconds,
            cached_tokens: res.cached_tokens as u32,
        }))
    }

    async fn cancel(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.handle.cancel(req.into_inner().request_id);
        Ok(Response::new(pb::ReleaseResponse { released: true }))
    }

    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::WorkerStatus>, Status> {
        let s = self.handle.status();
        Ok(Response::new(pb::WorkerStatus {
            id: self.id.clone(),
            role: "prefill".into(),
            kv_blocks_total: s.kv_blocks_total,
            kv_blocks_free: s.kv_blocks_free,
            running: s.running,
            waiting: s.queued,
            queued_prefill_tokens: s.queued_prefill_tokens,
            reservations: 0,
            tokens_per_second: s.tokens_per_second,
        }))
    }
}
