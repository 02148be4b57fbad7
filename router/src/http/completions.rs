//! `/v1/completions`, `/v1/chat/completions` and `/v1/models`.
//!
//! A request enters [`GenerationService::start`] like a gRPC one. The handler waits for the
//! first event before answering, so anything that fails before the first token (bad
//! prompt, queue full, no workers) gets its own HTTP status; after that, a stream that
//! fails carries an error object in its last `data:` event. Without `stream`, the body is
//! sent once generation finished. Dropping the response (the client closed the connection)
//! drops the event receiver, which cancels the request and frees its KV.

use std::convert::Infallible;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};

use super::tls_listener::ClientAddr;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use duet_proto::v1 as pb;
use duet_serving::trace_context::{TraceContext, TRACEPARENT};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tonic::Status;

use super::api_error::ApiError;
use super::openai_request::{ChatRequest, CompletionRequest};
use crate::request_metrics::{count_refused, Door};
use crate::service::{authorize, GenerationService, Origin};
use duet_engine::ErrorClass;

type Events = mpsc::Receiver<Result<pb::GenerateResponse, Status>>;

/// Which endpoint: decides the object names and the shape of a choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// What the response needs besides the events.
struct Shape {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_reason(f: i32) -> &'static str {
    match pb::FinishReason::try_from(f) {
        Ok(pb::FinishReason::Length) => "length",
        _ => "stop",
    }
}

fn usage_json(u: &Option<pb::Usage>) -> Value {
    let u = u.unwrap_or_default();
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        // OpenAI's shape (and vLLM's): prompt tokens served from the prefix cache.
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

pub(super) fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("invalid JSON body: {e}")))
}

/// Counts a request refused while reading its body (always a bad request), like the
/// refusals counted once the request reached the service.
fn refused(e: ApiError) -> ApiError {
    count_refused(Door::Http, ErrorClass::InvalidArgument);
    e
}

/// The caller's W3C trace context, when its `traceparent` header is valid.
fn trace_of(headers: &HeaderMap) -> Option<TraceContext> {
    headers
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse)
}

/// What the two endpoints read from their bodies: the generation request, whether to
/// stream, whether the stream ends with a usage chunk.
struct Parsed {
    req: pb::GenerateRequest,
    stream: bool,
    include_usage: bool,
}

/// The API key in the `authorization` header (a refusal is counted on the HTTP door).
fn authorize_http(svc: &GenerationService, headers: &HeaderMap) -> Result<(), ApiError> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    Ok(authorize(svc.api_keys(), auth, Door::Http)?)
}

/// The body's media type must say JSON. Absent is fine, and so is
/// `application/x-www-form-urlencoded`: curl's `-d` sends it by default with a JSON body.
pub(super) fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(v) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let media = v
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if media == "application/json"
        || media.ends_with("+json")
        || media == "application/x-www-form-urlencoded"
    {
        return Ok(());
    }
    Err(ApiError {
        status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
        message: format!("content-type `{media}`: the body must be JSON (application/json)"),
        param: Some("content-type".into()),
        retry_after: None,
    })
}

/// Reads the whole body within `timeout` (408 past it: a client trickling its body must
/// not hold a connection and a task forever), refusing more than `limit` bytes with a 413.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit))
        .await
        .map_err(|_| ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!("the request body did not arrive within {timeout:?}"),
            param: Some("body".into()),
            retry_after: None,
        })?;
    read.map_err(|e| {
        let e = e.into_inner();
        if e.downcast_ref::<http_body_util::LengthLimitError>()
            .is_some()
        {
            ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!("request body larger than {limit} bytes"),
                param: Some("body".into()),
                retry_after: None,
            }
        } else {
            ApiError::invalid("body", format!("reading the request body: {e}"))
        }
    })
}

/// `X-Request-Id`, as vLLM reads it: the request's id (unique while in flight), echoed back.
pub(super) fn request_id_of(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match headers.get("x-request-id") {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(id) if !id.trim().is_empty() && id.len() <= 256 => Ok(Some(id.to_string())),
            _ => Err(ApiError::invalid(
                "x-request-id",
                "X-Request-Id must be 1..=256 visible ASCII characters",
            )),
        },
    }
}

/// One endpoint: checks the key, reads the body with `read`, then generates and answers as
/// `kind`.
async fn handle(
    svc: GenerationService,
    request: Request,
    kind: Kind,
    read: impl FnOnce(&Bytes, &GenerationService) -> Result<Parsed, ApiError>,
) -> Response {
    let arrival = Instant::now();
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let client = parts
        .extensions
        .get::<ConnectInfo<ClientAddr>>()
        .map(|c| c.0 .0.ip());
    let r = async {
        authorize_http(&svc, &headers)?;
        check_content_type(&headers).map_err(refused)?;
        let id = request_id_of(&headers).map_err(refused)?;
        let body = read_body(
            body,
            svc.max_request_bytes(),
            svc.http_limits().body_timeout,
        )
        .await
        .map_err(refused)?;
        let mut p = read(&body, &svc).map_err(refused)?;
        if let Some(id) = &id {
            p.req.request_id.clone_from(id);
        }
        let shape = Shape {
            kind,
            id: String::new(),
            model: svc.model_name().to_string(),
            created: now_unix(),
            include_usage: p.include_usage,
        };
        let origin = Origin {
            arrival,
            deadline: None,
            door: Door::Http,
            trace: trace_of(&headers),
            client,
        };
        let mut resp = respond(&svc, p.req, origin, p.stream, shape).await?;
        if let Some(v) = id.and_then(|id| HeaderValue::from_str(&id).ok()) {
            resp.headers_mut().insert("x-request-id", v);
        }
        Ok::<_, ApiError>(resp)
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

pub(super) async fn completions(
    State(svc): State<GenerationService>,
    request: Request,
) -> Response {
    handle(svc, request, Kind::Completion, |body, _| {
        let r: CompletionRequest = parse(body)?;
        Ok(Parsed {
            req: r.to_generate()?,
            stream: r.common.stream,
            include_usage: r.common.include_usage(),
        })
    })
    .await
}

pub(super) async fn chat_completions(
    State(svc): State<GenerationService>,
    request: Request,
) -> Response {
    handle(svc, request, Kind::Chat, |body, svc| {
        let r: ChatRequest = parse(body)?;
        Ok(Parsed {
            req: r.to_generate(svc.context_length())?,
            stream: r.common.stream,
            include_usage: r.common.include_usage(),
        })
    })
    .await
}

pub(super) async fn models(
    State(svc): State<GenerationService>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize_http(&svc, &headers)?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": svc.model_name(),
            "object": "model",
            "created": 0,
            "owned_by": "duet",
            "max_model_len": svc.context_length(),
        }],
    })))
}

/// Starts the request, waits for its first event, then answers (streaming or not).
async fn respond(
    svc: &GenerationService,
    req: pb::GenerateRequest,
    origin: Origin,
    stream: bool,
    mut shape: Shape,
) -> Result<Response, ApiError> {
    let mut rx = svc.start(req, origin)?;
    let first = match rx.recv().await {
        Some(Ok(ev)) => ev,
        Some(Err(s)) => return Err(ApiError::from_status(&s)),
        None => return Err(ApiError::from_status(&Status::internal("no answer"))),
    };
    let prefix = match shape.kind {
        Kind::Completion => "cmpl-",
        Kind::Chat => "chatcmpl-",
    };
    shape.id = format!("{prefix}{}", first.request_id);
    if stream {
        Ok(sse(rx, first, shape))
    } else {
        whole(rx, first, shape).await
    }
}

/// The non-streaming answer: everything at once.
async fn whole(
    mut rx: Events,
    first: pb::GenerateResponse,
    shape: Shape,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut ev = Some(Ok(first));
    loop {
        match ev {
            Some(Ok(pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Token(t)),
                ..
            })) => text.push_str(&t.text),
            Some(Ok(pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Final(f)),
                ..
            })) => {
                text.push_str(&f.text);
                let reason = finish_reason(f.finish_reason);
                let choice = match shape.kind {
                    Kind::Completion => json!({
                        "index": 0, "text": text, "logprobs": null, "finish_reason": reason,
                    }),
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": reason,
                    }),
                };
                let body = json!({
                    "id": shape.id,
                    "object": match shape.kind {
                        Kind::Completion => "text_completion",
                        Kind::Chat => "chat.completion",
                    },
                    "created": shape.created,
                    "model": shape.model,
                    "choices": [choice],
                    "usage": usage_json(&f.usage),
                });
                return Ok((StatusCode::OK, Json(body)).into_response());
            }
            Some(Ok(_)) => {}
            Some(Err(s)) => return Err(ApiError::from_status(&s)),
            None => {
                return Err(ApiError::from_status(&Status::internal(
                    "stream ended early",
                )))
            }
        }
        ev = rx.recv().await;
    }
}

impl Shape {
    fn object(&self) -> &'static str {
        match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    /// One `data:` event with one choice.
    fn chunk(&self, text: Option<&str>, finish: Option<&str>, role: bool) -> Bytes {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = json!({
            "id": self.id, "object": self.object(), "created": self.created,
            "model": self.model, "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        data(&v)
    }

    fn usage_chunk(&self, u: &Option<pb::Usage>) -> Bytes {
        data(&json!({
            "id": self.id, "object": self.object(), "created": self.created,
            "model": self.model, "choices": [], "usage": usage_json(u),
        }))
    }
}

fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// Server-sent events: one chunk per token (text deltas), the finish chunk, the usage
/// chunk when asked, then `data: [DONE]`.
fn sse(rx: Events, first: pb::GenerateResponse, shape: Shape) -> Response {
    struct St {
        rx: Events,
        pending: Option<Result<pb::GenerateResponse, Status>>,
        shape: Shape,
        started: bool,
        done: bool,
    }
    let st = St {
        rx,
        pending: Some(Ok(first)),
        shape,
        started: false,
        done: false,
    };
    let stream = futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let ev = match st.pending.take() {
            Some(e) => Some(e),
            None => st.rx.recv().await,
        };
        let mut out: Vec<u8> = Vec::new();
        // Chat streams open with the assistant role.
        if !st.started && st.shape.kind == Kind::Chat {
            out.extend_from_slice(&st.shape.chunk(Some(""), None, true));
        }
        st.started = true;
        match ev {
            Some(Ok(pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Token(t)),
                ..
            })) => {
                if !t.text.is_empty() {
                    out.extend_from_slice(&st.shape.chunk(Some(&t.text), None, false));
                }
            }
            Some(Ok(pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Final(f)),
                ..
            })) => {
                if !f.text.is_empty() {
                    out.extend_from_slice(&st.shape.chunk(Some(&f.text), None, false));
                }
                let reason = finish_reason(f.finish_reason);
                let text = match st.shape.kind {
                    Kind::Completion => Some(""),
                    Kind::Chat => None,
                };
                out.extend_from_slice(&st.shape.chunk(text, Some(reason), false));
                if st.shape.include_usage {
                    out.extend_from_slice(&st.shape.usage_chunk(&f.usage));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                st.done = true;
            }
            Some(Ok(_)) => {}
            Some(Err(s)) => {
                out.extend_from_slice(&data(&ApiError::from_status(&s).body()));
                out.extend_from_slice(b"data: [DONE]\n\n");
                st.done = true;
            }
            None => {
                let e = ApiError::from_status(&Status::internal("stream ended early"));
                out.extend_from_slice(&data(&e.body()));
                out.extend_from_slice(b"data: [DONE]\n\n");
                st.done = true;
            }
        }
        Some((Ok::<Bytes, Infallible>(Bytes::from(out)), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
