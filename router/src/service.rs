//! The public `duet.v1.Generation` service.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use duet_discovery::{ClusterView, Role};
use duet_engine::{ChatMessage, TextFrontend};
use duet_proto::v1 as pb;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::admission::Admission;
use crate::api_keys::ApiKeys;
use crate::claims::Claims;
use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::frontend::prepare;
use crate::kv_index::KvIndex;
use crate::kv_subscriber;
use crate::recent::RecentRequests;
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
    claims: Arc<Claims>,
}

/// Where and when a request came in.
#[derive(Debug, Clone)]
pub struct Origin {
    pub arrival: Instant,
    /// The client's deadline (`grpc-timeout`); `None`: the configured default applies.
    pub deadline: Option<Instant>,
    pub door: Door,
    /// The caller's trace context, when it sent one.
    pub trace: Option<TraceContext>,
    /// The client's address (its concurrency allowance is kept per address).
    pub client: Option<IpAddr>,
}

/// Checks the API key in `authorization` (counting a refusal on `door`).
pub fn authorize(
    keys: &ApiKeys,
    authorization: Option<&[u8]>,
    door: Door,
) -> Result<(), RouterError> {
    keys.check(authorization)
        .inspect_err(|e| count_refused(door, e.class()))
}

fn authorize_grpc<T>(keys: &ApiKeys, req: &Request<T>) -> Result<(), Status> {
    let auth = req.metadata().get("authorization").map(|v| v.as_bytes());
    authorize(keys, auth, Door::Grpc).map_err(|e| e.status())
}

impl GenerationService {
    pub fn new(front: Arc<TextFrontend>, cfg: RouterConfig, view: ClusterView) -> Self {
        let admission = Admission::new(cfg.max_queued_per_priority);
        let claims = Claims::new(cfg.max_in_flight_per_client);
        let workers = Workers::new(cfg.worker_tls.clone(), cfg.cluster_token.clone());
        let kv_index = Arc::new(KvIndex::new());
        if cfg.kv_routing {
            // Follows the view until it closes (the router's shutdown).
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(kv_subscriber::run(
                    view.clone(),
                    workers.clone(),
                    kv_index.clone(),
                    CancellationToken::new(),
                ));
            }
        }
        GenerationService {
            claims,
            front,
            shared: Arc::new(Shared {
                cfg,
                view,
                workers,
                kv_index,
                recent: RecentRequests::default(),
            }),
            admission,
        }
    }

    /// The tonic server wrapper.
    /// Messages above `max_request_bytes` are refused by tonic (OUT_OF_RANGE).
    pub fn into_server(self) -> pb::generation_server::GenerationServer<Self> {
        let limit = self.shared.cfg.max_request_bytes;
        pb::generation_server::GenerationServer::new(self).max_decoding_message_size(limit)
    }

    /// The requests this router finished recently.
    pub fn recent(&self) -> crate::recent::RecentRequests {
        self.shared.recent.clone()
    }

    /// The API keys of the public doors.
    pub fn api_keys(&self) -> &ApiKeys {
        &self.shared.cfg.api_keys
    }

    /// The largest request body the doors accept.
    pub fn max_request_bytes(&self) -> usize {
        self.shared.cfg.max_request_bytes
    }

    /// The HTTP door's connection limits and timeouts.
    pub fn http_limits(&self) -> crate::http::HttpLimits {
        self.shared.cfg.http
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
        origin: Origin,
    ) -> Result<mpsc::Receiver<Result<pb::GenerateResponse, Status>>, RouterError> {
        let Origin {
            arrival,
            deadline,
            door,
            trace,
            client,
        } = origin;
        let refused = |e: RouterError| {
            count_refused(door, e.class());
            e
        };
        let prep = prepare(
            &self.front,
            &self.shared.cfg.model_name,
            self.context(),
            self.shared.cfg.attention,
            &req,
        )
        .map_err(refused)?;
        if deadline.is_some_and(|d| d <= Instant::now()) {
            return Err(refused(RouterError::Deadline(
                "before the request was admitted (the client's deadline had passed)",
            )));
        }
        let claim = self
            .claims
            .claim(
                (!req.request_id.is_empty()).then_some(&req.request_id),
                client,
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
            prefix_match_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
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
            self.shared.recent.clone(),
        );
        let job = Job {
            request_id,
            client_id,
            prep,
            slot,
            claim,
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

type GenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrival = Instant::now();
        authorize_grpc(self.api_keys(), &req)?;
        let origin = Origin {
            arrival,
            deadline: duet_serving::deadline::grpc_timeout(req.metadata()).map(|d| arrival + d),
            door: Door::Grpc,
            trace: TraceContext::extract(req.metadata()),
            client: req.remote_addr().map(|a| a.ip()),
        };
        let mut rx = self
            .start(req.into_inner(), origin)
            .map_err(|e| e.status())?;
        // The response headers go out with the first event, as grpc-go's servers send
        // them with the first message: one write instead of two, and a request that fails
        // before its first token ends as a trailers-only response carrying the status.
        // Waiting here is cancellation-safe: a client that goes away drops this future and
        // with it the receiver, which the request's task watches.
        let first = match rx.recv().await {
            Some(Ok(first)) => first,
            Some(Err(status)) => return Err(status),
            None => return Err(Status::internal("the request ended without an event")),
        };
        let rest = ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(
            futures::stream::once(std::future::ready(Ok(first))).chain(rest),
        )))
    }

    async fn tokenize(
        &self,
        req: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        authorize_grpc(self.api_keys(), &req)?;
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
        req: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        authorize_grpc(self.api_keys(), &req)?;
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
    keys: ApiKeys,
}

impl ClusterService {
    /// `keys`: the public doors' API keys (the worker list is not for anonymous callers).
    pub fn new(view: ClusterView, keys: ApiKeys) -> Self {
        ClusterService { view, keys }
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
        req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        authorize_grpc(&self.keys, &req)?;
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
