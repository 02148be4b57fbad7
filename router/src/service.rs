//! The public `duet.v1.Generation` service.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_discovery::{ClusterView, Role};
use duet_engine::{ChatMessage, TextFrontend};
use duet_proto::v1 as pb;
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::admission::Admission;
use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::frontend::prepare;
use crate::relay::{self, Job, Shared};
use crate::request_metrics::{count_refused, Door, RequestMetrics};
use crate::workers::Workers;
use duet_serving::trace_context::TraceContext;

/// `duet.v1.Generation`.
#[derive(Clone)]
pub struct GenerationService {
    front: Arc<TextFrontend>,
    shared: Arc<Shared>,
    admission: Arc<Admission>,
}

impl GenerationService {
    pub fn new(front: Arc<TextFrontend>, cfg: RouterConfig, view: ClusterView) -> Self {
        let admission = Admission::new(cfg.max_queued_per_priority);
        GenerationService {
            front,
            shared: Arc::new(Shared {
                cfg,
                view,
                workers: Workers::new(),
            }),
            admission,
        }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::generation_server::GenerationServer<Self> {
        pb::generation_server::GenerationServer::new(self)
    }

    /// The context length requests are held to.
    fn context(&self) -> usize {
        self.shared
            .cfg
            .context_length(self.front.config.context_length)
    }

    /// Validates, admits and starts one generation; its events arrive on the returned
    /// channel (tokens, then a final message or an error). Dropping the receiver cancels the
    /// request and frees whatever it holds on the workers. Both doors (gRPC and HTTP) enter
    /// here, so routing, admission, cancellation and metrics are the same for both.
    pub fn start(
        &self,
        req: pb::GenerateRequest,
        arrival: Instant,
        deadline: Option<Instant>,
        door: Door,
        trace: Option<TraceContext>,
    ) -> Result<mpsc::Receiver<Result<pb::GenerateResponse, Status>>, RouterError> {
        let refused = |e: RouterError| {
            count_refused(door, e.class());
            e
        };
        let prep = prepare(
            &self.front,
            &self.shared.cfg.model_name,
            self.context(),
            &req,
        )
        .map_err(refused)?;
        let slot = self.admission.enter(prep.priority).map_err(refused)?;
        let request_id: u64 = rand::random();
        let client_id = if req.request_id.is_empty() {
            format!("{request_id:016x}")
        } else {
            req.request_id.clone()
        };
        let (tx, rx) = mpsc::channel(64);
        // Every request has a deadline: the client's, else the configured default.
        let deadline = Some(deadline.unwrap_or(arrival + self.shared.cfg.default_request_timeout));
        // The placement fields are filled in when the request is placed, so the decision
        // (which workers, local or remote prefill, and why) is on the request's span.
        let span = tracing::info_span!(
            "generate",
            request_id,
            client_id = %client_id,
            door = door.label(),
            trace_id = tracing::field::Empty,
            prompt_tokens = prep.prompt.len(),
            decode_worker = tracing::field::Empty,
            prefill_worker = tracing::field::Empty,
            placement = tracing::field::Empty,
            routing_reason = tracing::field::Empty,
        );
        // The request's trace: the client's when it sent one (this span its child), else a
        // new one; with OTLP export, the ids the span is exported under.
        if let Some(t) = trace {
            duet_telemetry::link_remote_parent(&span, t.trace_id, t.span_id, t.sampled());
        }
        let trace = match duet_telemetry::span_ids(&span) {
            Some((trace_id, span_id)) => TraceContext {
                trace_id,
                span_id,
                flags: trace.map_or(1, |t| t.flags),
            },
            None => trace.map_or_else(TraceContext::new_root, |t| t.child()),
        };
        span.record("trace_id", trace.trace_hex());
        let metrics = RequestMetrics::start(
            door,
            crate::admission::class(prep.priority).1,
            arrival,
            prep.prompt.len(),
        );
        let job = Job {
            request_id,
            client_id,
            prep,
            slot,
            arrival,
            deadline,
            metrics,
            trace,
        };
        tokio::spawn(relay::run(self.shared.clone(), job, tx).instrument(span));
        Ok(rx)
    }

    /// The context length requests are held to (prompt + generated tokens).
    pub fn context_length(&self) -> usize {
        self.context()
    }

    /// The model name requests must use (or leave empty).
    pub fn model_name(&self) -> &str {
        &self.shared.cfg.model_name
    }

    /// The registry view the router routes on.
    pub fn view(&self) -> &ClusterView {
        &self.shared.view
    }
}

/// Parses the `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
pub fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

type GenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrival = Instant::now();
        let deadline = grpc_timeout(req.metadata()).map(|d| arrival + d);
        let trace = TraceContext::extract(req.metadata());
        let rx = self
            .start(req.into_inner(), arrival, deadline, Door::Grpc, trace)
            .map_err(|e| e.status())?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn tokenize(
        &self,
        req: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let r = req.into_inner();
        if !r.model.is_empty() && r.model != self.shared.cfg.model_name {
            return Err(RouterError::UnknownModel(r.model).status());
        }
        let ids = match r.input {
            Some(pb::tokenize_request::Input::Text(t)) => self.front.tokenizer.encode(&t, false),
            Some(pb::tokenize_request::Input::Chat(c)) => {
                let msgs: Vec<ChatMessage> = c
                    .messages
                    .iter()
                    .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
                    .collect();
                self.front.chat_tokens(&msgs)
            }
            None => return Err(RouterError::invalid("input", "missing (text or chat)").status()),
        }
        .map_err(|e| duet_serving::status::engine_status(&e))?;
        Ok(Response::new(pb::TokenizeResponse {
            count: ids.len() as u32,
            ids,
            max_context: self.context() as u32,
        }))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let snap = self.shared.view.snapshot();
        let name = &self.shared.cfg.model_name;
        let count = |role| snap.workers(role).filter(|w| &w.model == name).count() as u32;
        let fingerprint = snap
            .workers(Role::Decode)
            .find(|w| &w.model == name)
            .map(|w| w.fingerprint.clone())
            .unwrap_or_default();
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelInfo {
                name: name.clone(),
                fingerprint,
                context_length: self.context() as u32,
                prefill_workers: count(Role::Prefill),
                decode_workers: count(Role::Decode),
            }],
        }))
    }
}

/// `duet.v1.Cluster`: the workers in the router's registry view (what `duet status
/// --router` prints).
#[derive(Clone)]
pub struct ClusterService {
    view: ClusterView,
}

impl ClusterService {
    pub fn new(view: ClusterView) -> Self {
        ClusterService { view }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::cluster_server::ClusterServer<Self> {
        pb::cluster_server::ClusterServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::cluster_server::Cluster for ClusterService {
    async fn list_workers(
        &self,
        _: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let snap = self.view.snapshot();
        let mut records_json = Vec::with_capacity(snap.workers.len());
        for w in snap.workers.values() {
            let bytes = w
                .to_json()
                .map_err(|e| Status::internal(format!("encoding a worker record: {e}")))?;
            records_json.push(String::from_utf8_lossy(&bytes).into_owned());
        }
        Ok(Response::new(pb::ListWorkersResponse {
            records_json,
            stale: snap.stale,
            revision: snap.revision,
        }))
    }
}
