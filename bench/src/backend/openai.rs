//! OpenAI-compatible servers: `POST {url}{endpoint}` (default `/v1/completions`) with
//! `"stream": true`, read as server-sent events until `data: [DONE]`.
//!
//! Body: `model`, `prompt` (token ids, or text with `--prompt-format text`), `max_tokens`,
//! `stream`, `stream_options.include_usage`, `temperature` (and `seed`), plus `ignore_eos`
//! or `min_tokens = max_tokens` to get exact output lengths. Servers ignore the fields they
//! do not know (vLLM, duet, llama.cpp; llama-cpp-python ignores `stream_options`).
//!
//! Every chunk whose `choices[0].text` is non-empty is one output chunk, timed when its
//! bytes arrived; `usage` (the last chunk with one) gives the token counts. A non-200
//! status becomes `http:<status>`, a refused connection `connect`, a chunk carrying
//! `error` or a stream without `[DONE]` `protocol`.
//!
//! HTTP/1.1 over hyper's pooled client with TCP_NODELAY; one connection per concurrent
//! request, reused across requests.

use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode, Uri};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use super::{IgnoreEos, PromptFormat, SendOptions};
use crate::error::{BenchError, Result};
use crate::record::{RequestError, Timeline};
use crate::sse::SseParser;
use crate::workload::RequestSpec;

pub struct OpenAiClient {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: Uri,
    model: String,
    opts: SendOptions,
}

/// `url` without a trailing slash, joined with `path` (which starts with `/`).
fn join(url: &str, path: &str) -> String {
    let base = url.trim_end_matches('/');
    // `--url http://host/v1` with the default endpoint `/v1/completions`.
    match (base.strip_suffix("/v1"), path.strip_prefix("/v1/")) {
        (Some(b), Some(_)) => format!("{b}{path}"),
        _ => format!("{base}{path}"),
    }
}

fn client_error(e: &hyper_util::client::legacy::Error) -> RequestError {
    let kind = if e.is_connect() { "connect" } else { "io" };
    // The source chain says what actually failed (refused, reset, ...).
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    RequestError::new(kind, msg)
}

impl OpenAiClient {
    /// Prepares the client; without `model`, asks `GET {url}/v1/models` for the first id.
    pub async fn connect(
        url: &str,
        endpoint: &str,
        model: Option<&str>,
        opts: SendOptions,
    ) -> Result<Self> {
        let target = |reason: String| BenchError::Target {
            url: url.to_string(),
            reason,
        };
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(usize::MAX)
            .build(http);
        let uri: Uri = join(url, endpoint)
            .parse()
            .map_err(|e| target(format!("bad URL: {e}")))?;
        let model = match model {
            Some(m) => m.to_string(),
            None => {
                let models: Uri = join(url, "/v1/models")
                    .parse()
                    .map_err(|e| target(format!("bad URL: {e}")))?;
                first_model(&client, models, opts.api_key.as_deref())
                    .await
                    .map_err(target)?
            }
        };
        Ok(OpenAiClient {
            client,
            uri,
            model,
            opts,
        })
    }

    pub fn model_name(&self) -> &str {
        &self.model
    }

    fn body(&self, spec: &RequestSpec) -> Value {
        let prompt = match (self.opts.prompt_format, &spec.prompt_text) {
            (PromptFormat::Text, Some(t)) => json!(t),
            _ => json!(spec.prompt_ids),
        };
        let mut b = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": spec.output_len,
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": self.opts.temperature,
        });
        if let Some(seed) = self.opts.seed {
            b["seed"] = json!(seed);
        }
        match self.opts.ignore_eos {
            IgnoreEos::IgnoreEos => b["ignore_eos"] = json!(true),
            IgnoreEos::MinTokens => b["min_tokens"] = json!(spec.output_len),
            IgnoreEos::None => {}
        }
        for (k, v) in &self.opts.extra_body {
            b[k] = v.clone();
        }
        b
    }

    pub async fn send(&self, spec: &RequestSpec) -> (Timeline, Option<RequestError>) {
        let body = Bytes::from(self.body(spec).to_string());
        let mut t = Timeline::start();
        let res = tokio::time::timeout(self.opts.timeout, self.stream(body, &mut t)).await;
        let err = match res {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(RequestError::new(
                "timeout",
                format!("no complete response within {:?}", self.opts.timeout),
            )),
        };
        (t, err)
    }

    async fn stream(&self, body: Bytes, t: &mut Timeline) -> std::result::Result<(), RequestError> {
        let mut req = Request::post(self.uri.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "text/event-stream");
        if let Some(k) = &self.opts.api_key {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| RequestError::new("io", e.to_string()))?;
        t.sent = Instant::now();
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| client_error(&e))?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status != StatusCode::OK {
            let text = body
                .collect()
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            let text: String = text.chars().take(500).collect();
            return Err(RequestError::new(format!("http:{}", status.as_u16()), text));
        }
        let mut sse = SseParser::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| RequestError::new("io", e.to_string()))?;
            let now = Instant::now();
            let Some(data) = frame.data_ref() else {
                continue;
            };
            for event in sse.feed(data) {
                if on_event(&event, now, t)? {
                    t.end = Some(now);
                    return Ok(());
                }
            }
        }
        let now = Instant::now();
        if let Some(event) = sse.finish() {
            if on_event(&event, now, t)? {
                t.end = Some(now);
                return Ok(());
            }
        }
        Err(RequestError::new(
            "protocol",
            "stream ended without data: [DONE]",
        ))
    }
}

/// Handles one event's data; true at `[DONE]`.
fn on_event(data: &str, now: Instant, t: &mut Timeline) -> std::result::Result<bool, RequestError> {
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(true);
    }
    let v: Value = serde_json::from_str(data)
        .map_err(|e| RequestError::new("protocol", format!("bad chunk ({e}): {data}")))?;
    if let Some(err) = v.get("error") {
        return Err(RequestError::new("protocol", err.to_string()));
    }
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    if !text.is_empty() {
        t.chunks.push(now);
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        let count = |k: &str| u[k].as_u64().map(|x| x as usize);
        t.prompt_tokens = count("prompt_tokens").or(t.prompt_tokens);
        t.output_tokens = count("completion_tokens").or(t.output_tokens);
        let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64();
        t.cached_tokens = cached.map(|x| x as usize).or(t.cached_tokens);
    }
    Ok(false)
}

/// `GET /v1/models`: the first model id.
async fn first_model(
    client: &Client<HttpConnector, Full<Bytes>>,
    uri: Uri,
    api_key: Option<&str>,
) -> std::result::Result<String, String> {
    let mut req = Request::get(uri.clone());
    if let Some(k) = api_key {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("GET {uri}: {}", client_error(&e).message))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if status != StatusCode::OK {
        return Err(format!(
            "GET {uri}: HTTP {status} (pass --model-name to skip this look-up)"
        ));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("GET {uri}: {e}"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("GET {uri}: no model listed (pass --model-name)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_base_urls_with_and_without_v1() {
        let want = "http://h:1/v1/completions";
        for base in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/v1",
            "http://h:1/v1/",
        ] {
            assert_eq!(join(base, "/v1/completions"), want, "{base}");
        }
    }

    #[test]
    fn events_count_text_chunks_and_read_usage() {
        let mut t = Timeline::start();
        let now = Instant::now();
        let chunks = [
            r#"{"choices":[{"text":" a"}]}"#,
            r#"{"choices":[{"text":""}]}"#,
            r#"{"choices":[{"text":"bc"}],"usage":null}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}"#,
        ];
        for c in chunks {
            assert!(!on_event(c, now, &mut t).unwrap());
        }
        let non_empty = chunks
            .iter()
            .filter(|c| {
                let v: Value = serde_json::from_str(c).unwrap();
                v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
            })
            .count();
        assert_eq!(t.chunks.len(), non_empty);
        assert_eq!((t.prompt_tokens, t.output_tokens), (Some(9), Some(3)));
        assert!(on_event("[DONE]", now, &mut t).unwrap());
        let e = on_event(r#"{"error":{"message":"bad"}}"#, now, &mut t).unwrap_err();
        assert_eq!(e.kind, "protocol");
        assert!(on_event("not json", now, &mut t).is_err());
    }
}
