//! duet's public gRPC door: `duet.v1.Generation/Generate`, one HTTP/2 connection shared by
//! every stream of the run.
//!
//! Each request carries the prompt as token ids (or text), `max_tokens`, `ignore_eos` and
//! greedy sampling unless a temperature is set, under a gRPC deadline. Every `Token` event
//! is one output chunk (its text may be empty while the detokenizer holds bytes back: the
//! token was still generated); the `Final` message ends the stream with usage and placement.
//! A failure becomes `grpc:<CODE>` (`timeout` for an expired deadline, `protocol` for a
//! stream that ends without its final message).

use std::time::Instant;

use duet_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use super::{IgnoreEos, PromptFormat, SendOptions};
use crate::error::{BenchError, Result};
use crate::record::{RequestError, Timeline};
use crate::workload::RequestSpec;

pub struct DuetClient {
    client: pb::generation_client::GenerationClient<Channel>,
    model: String,
    opts: SendOptions,
}

/// The canonical name of a gRPC status code (bounded, for error kinds).
fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

fn status_error(s: &tonic::Status) -> RequestError {
    RequestError::new(format!("grpc:{}", code_name(s.code())), s.message())
}

impl DuetClient {
    pub async fn connect(url: &str, model: Option<&str>, opts: SendOptions) -> Result<Self> {
        let target = |reason: String| BenchError::Target {
            url: url.to_string(),
            reason,
        };
        let channel = Endpoint::from_shared(url.to_string())
            .map_err(|e| target(e.to_string()))?
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| target(format!("cannot connect: {e}")))?;
        let mut client = pb::generation_client::GenerationClient::new(channel);
        let model = match model {
            Some(m) => m.to_string(),
            // The served model's name, for the report (empty: the router's only model).
            None => client
                .list_models(pb::ListModelsRequest {})
                .await
                .ok()
                .and_then(|r| r.into_inner().models.into_iter().next())
                .map(|m| m.name)
                .unwrap_or_default(),
        };
        Ok(DuetClient {
            client,
            model,
            opts,
        })
    }

    pub fn model_name(&self) -> &str {
        &self.model
    }

    fn request(&self, spec: &RequestSpec) -> pb::GenerateRequest {
        let prompt = match (self.opts.prompt_format, &spec.prompt_text) {
            (PromptFormat::Text, Some(t)) => pb::generate_request::Prompt::Text(t.clone()),
            _ => pb::generate_request::Prompt::Tokens(pb::TokenIds {
                ids: spec.prompt_ids.clone(),
            }),
        };
        pb::GenerateRequest {
            request_id: format!("bench-{}", spec.index),
            model: self.model.clone(),
            prompt: Some(prompt),
            sampling: Some(pb::SamplingParams {
                temperature: self.opts.temperature,
                seed: self.opts.seed,
                ..Default::default()
            }),
            max_tokens: u32::try_from(spec.output_len).unwrap_or(u32::MAX),
            ignore_eos: self.opts.ignore_eos != IgnoreEos::None,
            ..Default::default()
        }
    }

    pub async fn send(&self, spec: &RequestSpec) -> (Timeline, Option<RequestError>) {
        let mut req = tonic::Request::new(self.request(spec));
        req.set_timeout(self.opts.timeout);
        if let Some(v) = self
            .opts
            .api_key
            .as_ref()
            .and_then(|k| format!("Bearer {k}").parse().ok())
        {
            req.metadata_mut().insert("authorization", v);
        }
        let mut client = self.client.clone();
        let mut t = Timeline::start();
        let streamed = async {
            let mut stream = client.generate(req).await?.into_inner();
            while let Some(m) = stream.message().await? {
                match m.event {
                    Some(pb::generate_response::Event::Token(_)) => t.chunks.push(Instant::now()),
                    Some(pb::generate_response::Event::Final(f)) => {
                        t.end = Some(Instant::now());
                        if let Some(u) = f.usage {
                            t.prompt_tokens = Some(u.prompt_tokens as usize);
                            t.output_tokens = Some(u.completion_tokens as usize);
                            t.cached_tokens = Some(u.cached_tokens as usize);
                        }
                        t.placement = f.timings.map(|x| {
                            pb::PrefillPlacement::try_from(x.placement)
                                .map(|p| {
                                    p.as_str_name()
                                        .trim_start_matches("PREFILL_PLACEMENT_")
                                        .to_ascii_lowercase()
                                })
                                .unwrap_or_default()
                        });
                        return Ok(true);
                    }
                    None => {}
                }
            }
            Ok::<bool, tonic::Status>(false)
        };
        let res = tokio::time::timeout(self.opts.timeout, streamed).await;
        let err = match res {
            Ok(Ok(true)) => None,
            Ok(Ok(false)) => Some(RequestError::new(
                "protocol",
                "stream ended without a final message",
            )),
            Ok(Err(s)) if s.code() == tonic::Code::DeadlineExceeded => {
                Some(RequestError::new("timeout", s.message()))
            }
            Ok(Err(s)) => Some(status_error(&s)),
            Err(_) => Some(RequestError::new(
                "timeout",
                format!("no complete response within {:?}", self.opts.timeout),
            )),
        };
        (t, err)
    }
}
