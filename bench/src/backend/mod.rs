//! The targets a run can load: duet's gRPC door or any OpenAI-compatible HTTP server.
//!
//! Every backend sends one [`RequestSpec`] and fills a [`Timeline`]; it never fails the run:
//! a request that fails becomes a [`RequestError`] with a bounded kind. Connecting (and, for
//! OpenAI servers, finding the model name) happens once, before the run.

mod grpc;
mod openai;

use std::time::Duration;

use serde::Serialize;

use crate::error::Result;
use crate::record::{RequestError, Timeline};
use crate::workload::RequestSpec;

pub use grpc::DuetClient;
pub use openai::OpenAiClient;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// `duet.v1.Generation/Generate`.
    Duet,
    /// `POST {url}/v1/completions`, streamed.
    Openai,
}

/// How prompts are sent to OpenAI servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// Token ids (exact lengths; vLLM, duet, llama.cpp's own server).
    Tokens,
    /// Text decoded from the ids (servers that take only strings, e.g. llama-cpp-python;
    /// the server re-tokenizes, so the length may differ by a few tokens).
    Text,
}

/// How "generate exactly max_tokens" is asked of an OpenAI server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IgnoreEos {
    /// `"ignore_eos": true` (vLLM extension; duet, llama.cpp's own server).
    IgnoreEos,
    /// `"min_tokens": max_tokens` (llama-cpp-python, which has no ignore_eos).
    MinTokens,
    /// Neither: outputs may end early at end-of-sequence.
    None,
}

/// What every request of a run shares.
#[derive(Debug, Clone, Serialize)]
pub struct SendOptions {
    pub temperature: f32,
    pub seed: Option<u64>,
    pub prompt_format: PromptFormat,
    pub ignore_eos: IgnoreEos,
    /// Fields merged into every OpenAI request body (e.g. llama-server's
    /// `{"cache_prompt": false}`); ignored by the duet backend.
    #[serde(default)]
    pub extra_body: serde_json::Map<String, serde_json::Value>,
    #[serde(rename = "timeout_s", serialize_with = "secs")]
    pub timeout: Duration,
    /// Sent as `authorization: Bearer <key>` on both backends; never written to results.
    #[serde(skip)]
    pub api_key: Option<String>,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

pub enum Target {
    Duet(Box<DuetClient>),
    OpenAi(Box<OpenAiClient>),
}

impl Target {
    /// Connects to `url` (gRPC) or prepares the HTTP client and resolves the model name.
    pub async fn connect(
        kind: BackendKind,
        url: &str,
        endpoint: &str,
        model_name: Option<&str>,
        opts: SendOptions,
    ) -> Result<Target> {
        Ok(match kind {
            BackendKind::Duet => {
                Target::Duet(Box::new(DuetClient::connect(url, model_name, opts).await?))
            }
            BackendKind::Openai => Target::OpenAi(Box::new(
                OpenAiClient::connect(url, endpoint, model_name, opts).await?,
            )),
        })
    }

    /// The model name sent with every request (empty: the server's only model).
    pub fn model_name(&self) -> &str {
        match self {
            Target::Duet(c) => c.model_name(),
            Target::OpenAi(c) => c.model_name(),
        }
    }

    /// Sends one request and streams its response to the end.
    pub async fn send(&self, spec: &RequestSpec) -> (Timeline, Option<RequestError>) {
        match self {
            Target::Duet(c) => c.send(spec).await,
            Target::OpenAi(c) => c.send(spec).await,
        }
    }
}
