//! OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) and their translation
//! into a `duet.v1.GenerateRequest`.
//!
//! Accepted beyond OpenAI's own fields, as vLLM does: `top_k`, `min_p`,
//! `repetition_penalty`, `ignore_eos`, token-id prompts, and duet's `attention` (sent by
//! OpenAI clients through `extra_body`): `"full"`, `"window=W,sinks=S"`,
//! `"snapkv=B"`, or `{"window": W, "sinks": S}` (sinks default to 4). Fields duet cannot honour (`n` > 1,
//! `best_of` > 1, `logprobs`, `echo`, `suffix`, non-zero presence / frequency penalties,
//! tools) are refused with a 400 that names them, never silently ignored. Unknown fields are
//! ignored, as OpenAI-compatible servers do.

use duet_proto::v1 as pb;
use serde::Deserialize;

use super::api_error::ApiError;
pub use super::openai_attention::AttentionInput;

/// `prompt`: a string, one string in a list, token ids, or one token-id list in a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and control fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub attention: Option<AttentionInput>,
    pub logprobs: Option<serde_json::Value>,
    pub user: Option<String>,
    // Accepted by OpenAI or vLLM, not implemented by duet: refused unless unset / default.
    pub response_format: Option<serde_json::Value>,
    pub logit_bias: Option<serde_json::Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub min_tokens: Option<i64>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<PromptInput>,
    #[serde(flatten)]
    pub common: Common,
    pub best_of: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
}

/// A chat message's `content`: a string or a list of parts (only text parts).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub common: Common,
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    pub top_logprobs: Option<serde_json::Value>,
}

/// OpenAI's default `max_tokens` for `/v1/completions`.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

fn positive(param: &str, v: i64) -> Result<u32, ApiError> {
    u32::try_from(v)
        .ok()
        .filter(|&v| v >= 1)
        .ok_or_else(|| ApiError::invalid(param, format!("{param} must be at least 1, got {v}")))
}

impl Common {
    /// Refuses what duet does not implement; fills the shared fields of `req`.
    fn apply(&self, req: &mut pb::GenerateRequest, chat: bool) -> Result<(), ApiError> {
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
        let is_set = |v: &Option<serde_json::Value>| match v {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Object(m)) => !m.is_empty(),
            Some(_) => true,
        };
        let text_format = self
            .response_format
            .as_ref()
            .is_some_and(|f| f.get("type").and_then(|t| t.as_str()) == Some("text"));
        if is_set(&self.response_format) && !text_format {
            return Err(ApiError::invalid(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
        if is_set(&self.logit_bias) {
            return Err(ApiError::invalid(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        if self.stop_token_ids.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(ApiError::invalid(
                "stop_token_ids",
                "stop_token_ids is not supported (use stop)",
            ));
        }
        if self.min_tokens.is_some_and(|m| m != 0) {
            return Err(ApiError::invalid(
                "min_tokens",
                "min_tokens is not supported",
            ));
        }
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(
                    "n",
                    format!("only n = 1 is supported, got {n}"),
                ));
            }
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(
                    name,
                    format!("{name} is not supported (use repetition_penalty)"),
                ));
            }
        }
        let wants_logprobs = match &self.logprobs {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
            Some(serde_json::Value::Number(n)) => !chat && n.as_i64() != Some(0),
            Some(_) => true,
        };
        if wants_logprobs {
            return Err(ApiError::invalid("logprobs", "logprobs are not supported"));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        // vLLM: -1 (or 0) disables top-k.
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1 (disabled) or positive, got {k}"),
                ))
            }
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid(
                "min_p",
                format!("min_p must be in [0, 1], got {min_p}"),
            ));
        }
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        if repetition_penalty <= 0.0 || !repetition_penalty.is_finite() {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("repetition_penalty must be positive, got {repetition_penalty}"),
            ));
        }
        // OpenAI's seed is a signed 64-bit integer: keep its bits.
        let seed = self.seed.map(|s| s as u64);
        req.sampling = Some(pb::SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed,
        });
        req.model = self.model.clone().unwrap_or_default();
        req.stop = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if req.stop.len() > 4 {
            return Err(ApiError::invalid("stop", "at most 4 stop sequences"));
        }
        if req.stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop",
                "stop sequences must not be empty",
            ));
        }
        req.ignore_eos = self.ignore_eos;
        req.attention = self.attention.as_ref().map(|a| a.to_proto()).transpose()?;
        Ok(())
    }

    /// Whether the stream ends with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

impl CompletionRequest {
    /// The generation request this asks for.
    pub fn to_generate(&self) -> Result<pb::GenerateRequest, ApiError> {
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::invalid(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
        if self.echo {
            return Err(ApiError::invalid("echo", "echo is not supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not supported"));
        }
        let prompt = match &self.prompt {
            None => return Err(ApiError::invalid("prompt", "prompt is required")),
            Some(PromptInput::Text(t)) => pb::generate_request::Prompt::Text(t.clone()),
            Some(PromptInput::Ids(ids)) => {
                pb::generate_request::Prompt::Tokens(pb::TokenIds { ids: ids.clone() })
            }
            Some(PromptInput::Texts(v)) if v.len() == 1 => {
                pb::generate_request::Prompt::Text(v[0].clone())
            }
            Some(PromptInput::IdLists(v)) if v.len() == 1 => {
                pb::generate_request::Prompt::Tokens(pb::TokenIds { ids: v[0].clone() })
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "prompt",
                    "exactly one prompt per request is supported",
                ))
            }
        };
        let mut req = pb::GenerateRequest {
            prompt: Some(prompt),
            max_tokens: match self.common.max_tokens {
                None => COMPLETIONS_DEFAULT_MAX_TOKENS,
                Some(v) => positive("max_tokens", v)?,
            },
            ..Default::default()
        };
        self.common.apply(&mut req, false)?;
        Ok(req)
    }
}

impl ChatRequest {
    /// The generation request this asks for; `context` bounds the default `max_tokens`
    /// (without one, generation may run to the end of the context, as in vLLM).
    pub fn to_generate(&self, context: usize) -> Result<pb::GenerateRequest, ApiError> {
        for (name, v) in [
            ("tools", &self.tools),
            ("functions", &self.functions),
            ("function_call", &self.function_call),
        ] {
            if v.as_ref().is_some_and(|t| !t.is_null()) {
                return Err(ApiError::invalid(name, "tool calls are not supported"));
            }
        }
        // "none" (or unset) is the only tool choice without tools.
        if self
            .tool_choice
            .as_ref()
            .is_some_and(|t| !t.is_null() && t.as_str() != Some("none"))
        {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool calls are not supported",
            ));
        }
        if self.top_logprobs.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(ApiError::invalid(
                "top_logprobs",
                "logprobs are not supported",
            ));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "at least one message is required",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            // The engine's one rule for roles; OpenAI names the field `messages.[i].role`.
            let probe = duet_engine::ChatMessage::new(m.role.clone(), String::new());
            if let Err(why) = probe.template_role() {
                return Err(ApiError::invalid(
                    &format!("messages.[{i}].role"),
                    format!("messages[{i}].role: {why}"),
                ));
            }
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    "messages",
                                    format!(
                                        "messages[{i}]: content part of type `{kind}` is not \
                                         supported (text only)"
                                    ),
                                ))
                            }
                        }
                    }
                    s
                }
            };
            messages.push(pb::ChatMessage {
                role: m.role.clone(),
                content,
            });
        }
        let max = self.max_completion_tokens.or(self.common.max_tokens);
        let mut req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
                messages,
            })),
            max_tokens: match max {
                None => u32::try_from(context.saturating_sub(1).max(1)).unwrap_or(u32::MAX),
                Some(v) => positive(
                    if self.max_completion_tokens.is_some() {
                        "max_completion_tokens"
                    } else {
                        "max_tokens"
                    },
                    v,
                )?,
            },
            ..Default::default()
        };
        self.common.apply(&mut req, true)?;
        Ok(req)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A `/v1/completions` body as the door translates it.
    pub(in crate::http) fn completion(
        v: serde_json::Value,
    ) -> Result<pb::GenerateRequest, ApiError> {
        serde_json::from_value::<CompletionRequest>(v)
            .map_err(|e| ApiError::invalid("body", e.to_string()))?
            .to_generate()
    }

    #[test]
    fn prompts_of_every_shape_become_one_request() {
        let r = completion(serde_json::json!({"prompt": "hi", "max_tokens": 3})).unwrap();
        assert!(matches!(r.prompt, Some(pb::generate_request::Prompt::Text(ref t)) if t == "hi"));
        assert_eq!(r.max_tokens, 3);
        let r = completion(serde_json::json!({"prompt": [1, 2, 3]})).unwrap();
        assert!(
            matches!(r.prompt, Some(pb::generate_request::Prompt::Tokens(ref t)) if t.ids == [1, 2, 3])
        );
        // OpenAI's default for completions.
        assert_eq!(r.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS);
        let r = completion(serde_json::json!({"prompt": [[5, 6]]})).unwrap();
        assert!(
            matches!(r.prompt, Some(pb::generate_request::Prompt::Tokens(ref t)) if t.ids == [5, 6])
        );
        let e = completion(serde_json::json!({"prompt": ["a", "b"]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn sampling_fields_and_vllm_extensions_carry_over() {
        let r = completion(serde_json::json!({
            "prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "repetition_penalty": 1.1, "seed": -1, "stop": "\n", "ignore_eos": true
        }))
        .unwrap();
        let s = r.sampling.unwrap();
        assert_eq!(
            (
                s.temperature,
                s.top_p,
                s.top_k,
                s.min_p,
                s.repetition_penalty
            ),
            (0.5, 0.9, 40, 0.05, 1.1)
        );
        assert_eq!(s.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert!(r.ignore_eos);
        // Unset temperature follows OpenAI (1.0), not greedy.
        let r = completion(serde_json::json!({"prompt": "x", "top_k": -1})).unwrap();
        let s = r.sampling.unwrap();
        assert_eq!((s.temperature, s.top_k), (1.0, 0));
    }

    #[test]
    fn unsupported_fields_are_refused_by_name() {
        for (body, param) in [
            (serde_json::json!({"prompt": "x", "n": 2}), "n"),
            (serde_json::json!({"prompt": "x", "best_of": 3}), "best_of"),
            (serde_json::json!({"prompt": "x", "echo": true}), "echo"),
            (
                serde_json::json!({"prompt": "x", "logprobs": 2}),
                "logprobs",
            ),
            (
                serde_json::json!({"prompt": "x", "presence_penalty": 0.5}),
                "presence_penalty",
            ),
            (
                serde_json::json!({"prompt": "x", "temperature": 3.0}),
                "temperature",
            ),
            (serde_json::json!({"prompt": "x", "top_p": 0.0}), "top_p"),
            (serde_json::json!({"prompt": "x", "top_k": -5}), "top_k"),
            (
                serde_json::json!({"prompt": "x", "max_tokens": 0}),
                "max_tokens",
            ),
            (
                serde_json::json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}),
                "stop",
            ),
            (serde_json::json!({"max_tokens": 4}), "prompt"),
            (
                serde_json::json!({"prompt": "x", "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                serde_json::json!({"prompt": "x", "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                serde_json::json!({"prompt": "x", "logit_bias": {"50256": -100}}),
                "logit_bias",
            ),
            (
                serde_json::json!({"prompt": "x", "min_tokens": 3}),
                "min_tokens",
            ),
        ] {
            let e = completion(body.clone()).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn chat_messages_and_token_limits() {
        let c: ChatRequest = serde_json::from_value(serde_json::json!({
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99
        }))
        .unwrap();
        let r = c.to_generate(2048).unwrap();
        let Some(pb::generate_request::Prompt::Chat(m)) = r.prompt else {
            panic!("chat prompt")
        };
        assert_eq!(m.messages[1].content, "hi there");
        // max_completion_tokens wins over the deprecated max_tokens.
        assert_eq!(r.max_tokens, 7);
        let c: ChatRequest = serde_json::from_value(
            serde_json::json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .unwrap();
        // No limit: up to the end of the context.
        assert_eq!(c.to_generate(2048).unwrap().max_tokens, 2047);
        let c: ChatRequest = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        }))
        .unwrap();
        assert_eq!(
            c.to_generate(2048).unwrap_err().param.as_deref(),
            Some("messages")
        );
        let c: ChatRequest = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]
        }))
        .unwrap();
        let e = c.to_generate(2048).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("messages.[1].role"));
        assert!(e.message.contains("`wizard`"), "{}", e.message);
    }
}
