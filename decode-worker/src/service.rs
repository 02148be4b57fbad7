//! The internal `duet.v1.Decode` gRPC service over a [`DecodeHandle`].

use std::pin::Pin;
use std::time::Duration;

use duet_engine::{EngineError, GenerationParams};
use duet_proto::v1 as pb;
use duet_serving::convert::{finish_to_proto, sampling_from_proto};
use duet_serving::trace_context::TraceContext;
use futures::Stream;
use tonic::{Request, Response, Status};

use crate::handle::{DecodeHandle, Event, GenerateJob, PrefillSource, Priority};

/// `duet.v1.Decode` backed by one engine thread.
#[derive(Clone)]
pub struct DecodeService {
    handle: DecodeHandle,
    kv_endpoints: Vec<pb::KvEndpoint>,
    id: String,
}

impl DecodeService {
    /// `kv_endpoints`: where this worker receives KV (returned with every reservation).
    pub fn new(handle: DecodeHandle, kv_endpoints: Vec<pb::KvEndpoint>, id: String) -> Self {
        DecodeService {
            handle,
            kv_endpoints,
            id,
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
    async fn reserve(
        &self,
        req: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        let r = req.into_inner();
        let ttl = Duration::from_millis(u64::from(r.ttl_ms.max(1)));
        let reserved = self
            .handle
            .reserve(r.request_id, r.prompt_tokens as usize, ttl, r.block_hashes)
            .await
            .map_err(|e| e.status())?;
        Ok(Response::new(pb::ReserveResponse {
            block_ids: reserved.blocks,
            kv_endpoints: self.kv_endpoints.clone(),
            block_size: self.handle.layout().block_size as u32,
            cached_tokens: reserved.cached_tokens as u32,
        }))
    }

    type GenerateStream = EventStream;

    async fn generate(
        &self,
        req: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let trace = TraceContext::extract(req.metadata());
        let r = req.into_inner();
        let prefill = match r.prefill {
            Some(pb::decode_request::Prefill::Remote(p)) => PrefillSource::Remote {
                first_token: p.first_token,
            },
            Some(pb::decode_request::Prefill::Local(l)) => PrefillSource::Local {
                replay: l.replay_tokens as usize,
            },
            None => {
                return Err(duet_serving::status::engine_status(&EngineError::invalid(
                    "prefill",
                    "missing (remote or local)",
                )))
            }
        };
        let params = GenerationParams {
            sampling: sampling_from_proto(r.sampling.as_ref()),
            max_tokens: r.max_tokens as usize,
            stop: r.stop,
            stop_token_ids: Vec::new(),
            ignore_eos: r.ignore_eos,
        };
        let span = tracing::info_span!(
            "decode",
            request_id = r.request_id,
            worker = %self.id,
            trace_id = tracing::field::Empty,
            parent_span_id = tracing::field::Empty,
        );
        duet_serving::trace_context::join_caller_trace(&span, trace);
        let mut rx = self.handle.generate(GenerateJob {
            request_id: r.request_id,
            prompt: r.prompt,
            params,
            priority: priority(r.priority),
            prefill,
            span,
        });
        let stream = async_stream(move |tx| async move {
            while let Some(ev) = rx.recv().await {
                let (msg, last) = match ev {
                    Event::Token { id, text } => (
                        Ok(pb::DecodeEvent {
                            event: Some(pb::decode_event::Event::Token(pb::TokenChunk {
                                id,
                                text,
                            })),
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
