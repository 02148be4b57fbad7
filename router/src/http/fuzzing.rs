//! Entry point for the `openai_request` fuzz target in `fuzz/` and for the regression test
//! that replays its corpus of past findings (`fuzz/regressions/openai_request/`).
//!
//! [`openai_request`] runs the HTTP door's request reading on arbitrary bytes, the way a
//! request reaches it: the `content-type` and `x-request-id` headers, then the JSON body
//! parsed as a completion or a chat request and turned into a generation request. It never
//! panics; a request it accepts has a prompt (or messages) and a positive token budget.

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue};

use super::completions::{check_content_type, parse, request_id_of};
use super::openai_request::{ChatRequest, CompletionRequest};

/// Context length the chat default `max_tokens` is bounded by (the default model's).
const CONTEXT: usize = 8192;

/// `data`: byte 0 picks the endpoint (even: completions, odd: chat); then the
/// `content-type` value up to the first `\n`, the `x-request-id` value up to the next, and
/// the body.
pub fn openai_request(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let mut parts = rest.splitn(3, |&b| b == b'\n');
    let content_type = parts.next().unwrap_or_default();
    let request_id = parts.next().unwrap_or_default();
    let body = Bytes::copy_from_slice(parts.next().unwrap_or_default());
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(content_type) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    if let Ok(v) = HeaderValue::from_bytes(request_id) {
        headers.insert("x-request-id", v);
    }
    let _ = check_content_type(&headers);
    if let Ok(Some(id)) = request_id_of(&headers) {
        assert!(
            !id.trim().is_empty() && id.len() <= 256,
            "accepted id {id:?}"
        );
    }
    let req = if kind % 2 == 0 {
        parse::<CompletionRequest>(&body).and_then(|r| r.to_generate())
    } else {
        parse::<ChatRequest>(&body).and_then(|r| r.to_generate(CONTEXT))
    };
    if let Ok(r) = req {
        assert!(r.prompt.is_some(), "an accepted request without a prompt");
        assert!(
            r.max_tokens > 0,
            "an accepted request without a token budget"
        );
    }
}
