//! The internal `duet.v1.Decode` gRPC service over a [`DecodeHandle`]; `ViaPrefill`
//! requests also call their prefill worker ([`crate::via_prefill`]).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use duet_discovery::{ClusterView, Role};
use duet_engine::{EngineError, GenerationParams};
use duet_proto::v1 as pb;
use duet_proto::v1::prefill_client::PrefillClient;
use duet_serving::channels::Channels;
use duet_serving::convert::{attention_from_proto, finish_to_proto, sampling_from_proto};
use duet_serving::deadline::grpc_timeout;
use duet_serving::status::{engine_status, mark_prefill_failed};
use duet_serving::trace_context::TraceContext;
use futures::Stream;
use tonic::{Request, Response, Status};

use crate::door::{self, DoorLimits};
use crate::error::DecodeError;
use crate::handle::{DecodeHandle, Event, GenerateJob, PrefillSource, Priority};
use crate::via_prefill::{Pending, ViaCall};

/// `duet.v1.Decode` backed by one engine thread.
#[derive(Clone)]
pub struct DecodeService {
    handle: DecodeHandle,
    kv_endpoints: Vec<pb::KvEndpoint>,
    id: String,
    /// Channels to the prefill workers `ViaPrefill` requests name.
    prefill_channels: Arc<Channels>,
    /// The cluster as the registry shows it: a `ViaPrefill` request may name only a
    /// registered prefill worker (this worker never calls an address a caller made up).
    peers: ClusterView,
}

impl DecodeService {
    /// `kv_endpoints`: where this worker receives KV (returned with every reservation);
    /// `prefill_channels`: how it reaches prefill workers (with the cluster's client TLS and
    /// token); `peers`: the view of its cluster that prefill addresses are checked against.
    pub fn new(
        handle: DecodeHandle,
        kv_endpoints: Vec<pb::KvEndpoint>,
        id: String,
        prefill_channels: Arc<Channels>,
        peers: ClusterView,
    ) -> Self {
        DecodeService {
            handle,
            kv_endpoints,
            id,
            prefill_channels,
            peers,
        }
    }

    /// What requests are checked against at this door.
    fn limits(&self) -> DoorLimits {
        DoorLimits {
            vocab_size: self.handle.vocab_size(),
            context_length: self.handle.context_length(),
            block_size: self.handle.layout().block_size,
        }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::decode_server::DecodeServer<Self> {
        pb::decode_server::DecodeServer::new(self)
    }
}

/// Priority from the proto enum.
pub fn priority(p: i32) -> Priority {
    match pb::Priority::try_from(p) {
        Ok(pb::Priority::Batch) => Priority::Batch,
        _ => Priority::Interactive,
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        req: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let trace = TraceContext::extract(req.metadata());
        let deadline = grpc_timeout(req.metadata());
        let r = req.into_inner();
        let params = GenerationParams {
            sampling: sampling_from_proto(r.sampling.as_ref()),
            max_tokens: r.max_tokens as usize,
            stop: r.stop.clone(),
            stop_token_ids: Vec::new(),
            ignore_eos: r.ignore_eos,
        };
        let attention = attention_from_proto(r.attention.as_ref())
            .map_err(|e| engine_status(&e))?
            .unwrap_or_default();
        // Everything checked before the request can reach a batch others share.
        door::check_generate(&r, &params, attention, &self.limits())
            .map_err(|e| engine_status(&e))?;
        self.handle
            .check_attention(attention)
            .map_err(|e| e.status())?;
        let span = tracing::info_span!(
            "decode",
            request_id = r.request_id,
            worker = %self.id,
            trace_id = tracing::field::Empty,
            parent_span_id = tracing::field::Empty,
        );
        duet_serving::trace_context::join_caller_trace(&span, trace);
        let (prefill, via) = match r.prefill {
            Some(pb::decode_request::Prefill::Local(l)) => (
                PrefillSource::Local {
                    replay: l.replay_tokens as usize,
                },
                None,
            ),
            Some(pb::decode_request::Prefill::Via(v)) => {
                // Only a registered prefill worker of this cluster is ever called.
                let addr = v.prefill_address.as_str();
                let known = self
                    .peers
                    .has_worker(Role::Prefill, |w| w.grpc_addr == addr)
                    .await;
                if !known {
                    return Err(DecodeError::UnregisteredPrefill {
                        address: addr.to_string(),
                        cluster: self.peers.cluster().to_string(),
                    }
                    .status());
                }
                // Reserved before the stream's headers go out: a refusal (no room) reaches
                // the router as the call's status, and it tries another decode worker.
                let client = self
                    .prefill_channels
                    .get(&v.prefill_address)
                    .map(PrefillClient::new)
                    .map_err(|e| mark_prefill_failed(Status::unavailable(e.to_string())))?;
                let ttl = Duration::from_millis(u64::from(v.ttl_ms.max(1)));
                let pending = Pending::new(self.handle.clone(), client.clone(), r.request_id);
                let reserved = self
                    .handle
                    .reserve(r.request_id, r.prompt.len(), ttl, v.block_hashes, attention)
                    .await
                    .map_err(|e| e.status())?;
                let call = ViaCall {
                    client,
                    request: pb::PrefillRequest {
                        request_id: r.request_id,
                        prompt: r.prompt.clone(),
                        sampling: r.sampling,
                        kv_endpoints: self.kv_endpoints.clone(),
                        dst_blocks: reserved.blocks,
                        priority: r.priority,
                        dst_start_tokens: reserved.cached_tokens as u32,
                        attention: r.attention,
                    },
                    trace,
                    deadline,
                    timeout: Duration::from_millis(u64::from(v.prefill_timeout_ms.max(1))),
                };
                // Replaced by the prefill worker's first token once it answers.
                let source = PrefillSource::Remote { first_token: 0 };
                (source, Some((call, pending)))
            }
            None => {
                return Err(engine_status(&EngineError::invalid(
                    "prefill",
                    "missing (local or via)",
                )))
            }
        };
        let mut job = GenerateJob {
            request_id: r.request_id,
            prompt: r.prompt,
            params,
            priority: priority(r.priority),
            prefill,
            attention,
            span,
        };
        let handle = self.handle.clone();
        let stream = async_stream(move |tx| async move {
            let mut remote = None;
            if let Some((call, mut pending)) = via {
                match pending.prefill(call).await {
                    Ok(answer) => {
                        job.prefill = PrefillSource::Remote {
                            first_token: answer.first_token,
                        };
                        remote = Some(answer);
                    }
                    Err(status) => {
                        // `pending` drops at the end of this scope: reservation released,
                        // prefill cancelled.
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
                let rx = handle.generate(job);
                pending.disarm();
                relay(rx, tx, remote).await;
            } else {
                relay(handle.generate(job), tx, remote).await;
            }
        });
        Ok(Response::new(stream))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let released = self.handle.release(req.into_inner().request_id).await;
        Ok(Response::new(pb::ReleaseResponse { released }))
    }

    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::WorkerStatus>, Status> {
        let s = self.handle.status();
        Ok(Response::new(pb::WorkerStatus {
            id: self.id.clone(),
            role: "decode".into(),
            kv_blocks_total: s.kv_blocks_total,
            kv_blocks_free: s.kv_blocks_free,
            running: s.running,
            waiting: s.waiting,
            queued_prefill_tokens: 0,
            reservations: s.reservations,
            tokens_per_second: s.tokens_per_second,
        }))
    }
}

/// Sends the engine's events for one sequence as `DecodeEvent`s until `Done` or an error;
/// `remote` (a `ViaPrefill` request's prefill answer) rides in `Done`.
async fn relay(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    tx: tokio::sync::mpsc::Sender<Result<pb::DecodeEvent, Status>>,
    mut remote: Option<pb::PrefillResponse>,
) {
    while let Some(ev) = rx.recv().await {
        let (msg, last) = match ev {
            Event::Token { id, text } => (
                Ok(pb::DecodeEvent {
                    event: Some(pb::decode_event::Event::Token(pb::TokenChunk { id, text })),
                }),
                false,
            ),
            Event::Done(d) => (
                Ok(pb::DecodeEvent {
                    event: Some(pb::decode_event::Event::Done(pb::DecodeDone {
                        finish_reason: finish_to_proto(d.finish) as i32,
                        completion_tokens: d.completion_tokens,
                        text: String::new(),
                        prefill_seconds: d.prefill_seconds,
                        kv_wait_seconds: d.kv_wait_seconds,
                        preemptions: d.preemptions,
                        cached_tokens: d.cached_tokens as u32,
                        remote_prefill: remote.take(),
                    })),
                }),
                true,
            ),
            Event::Error(e) => (Err(e.status()), true),
        };
        if tx.send(msg).await.is_err() || last {
            return;
        }
    }
}

/// A response stream fed by a task: the task ends (and drops what it holds, e.g. the
/// engine's event receiver, which cancels the sequence) when the client goes away.
fn async_stream<F, Fut>(f: F) -> EventStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<pb::DecodeEvent, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let task = f(tx.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = task => {}
            _ = tx.closed() => {}
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
