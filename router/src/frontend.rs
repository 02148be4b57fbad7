//! Request validation, tokenization and truncation: everything the router decides about a
//! request before placing it. Pure (no I/O), so every rule is unit-tested.

use duet_engine::{AttentionPolicy, ChatMessage, GenerationParams, TextFrontend};
use duet_proto::v1 as pb;
use duet_serving::convert::{attention_from_proto, sampling_from_proto};

use crate::error::RouterError;

/// A validated request, ready to place.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub params: GenerationParams,
    pub truncated: usize,
    pub priority: pb::Priority,
    /// The request's policy, or the router's default.
    pub attention: AttentionPolicy,
}

/// Refuses, before tokenizing it, a text prompt too long for the context whatever its
/// tokens: decoding is lossless, so a text of `n` bytes has at least
/// `n / max_token_bytes` tokens. Only for `truncation: error` (a truncating request needs
/// its tokens; the request size limit bounds it). Chat messages count their contents
/// alone (the template only adds to them).
fn check_prompt_bytes(
    front: &TextFrontend,
    ctx: usize,
    req: &pb::GenerateRequest,
) -> Result<(), RouterError> {
    let truncation = pb::Truncation::try_from(req.truncation).unwrap_or(pb::Truncation::Error);
    if !matches!(
        truncation,
        pb::Truncation::Error | pb::Truncation::Unspecified
    ) {
        return Ok(());
    }
    let bytes = match &req.prompt {
        Some(pb::generate_request::Prompt::Text(t)) => t.len(),
        Some(pb::generate_request::Prompt::Chat(c)) => {
            c.messages.iter().map(|m| m.content.len()).sum()
        }
        _ => return Ok(()),
    };
    let room = ctx.saturating_sub(1);
    let per_token = front.tokenizer.max_token_bytes();
    let most = room.saturating_mul(per_token);
    if bytes > most {
        return Err(RouterError::invalid(
            "prompt",
            format!(
                "{bytes} bytes cannot fit the context: it holds {ctx} tokens, so a prompt may                  have at most {room} tokens of at most {per_token} bytes each ({most} bytes;                  truncation: error)"
            ),
        ));
    }
    Ok(())
}

/// Validates and tokenizes `req` against the served model.
/// `ctx`: the context length requests are held to; `attention`: the policy of a request
/// that names none. A windowed request's sequence may run past `ctx` (its queries never
/// see further back than its window and sinks, which must fit in it).
pub fn prepare(
    front: &TextFrontend,
    model_name: &str,
    ctx: usize,
    attention: AttentionPolicy,
    req: &pb::GenerateRequest,
) -> Result<Prepared, RouterError> {
    if !req.model.is_empty() && req.model != model_name {
        return Err(RouterError::UnknownModel(req.model.clone()));
    }
    let attention = attention_from_proto(req.attention.as_ref())?.unwrap_or(attention);
    attention.validate(ctx)?;
    let ctx = attention.max_sequence_tokens(ctx);
    check_prompt_bytes(front, ctx, req)?;
    let mut prompt = match &req.prompt {
        None => {
            return Err(RouterError::invalid(
                "prompt",
                "missing (text, chat or tokens)",
            ))
        }
        Some(pb::generate_request::Prompt::Text(t)) => {
            if t.trim().is_empty() {
                return Err(RouterError::invalid("prompt", "empty or only whitespace"));
            }
            front.tokenizer.encode(t, false)?
        }
        Some(pb::generate_request::Prompt::Chat(c)) => {
            if c.messages.is_empty() {
                return Err(RouterError::invalid("prompt", "no chat messages"));
            }
            let msgs: Vec<ChatMessage> = c
                .messages
                .iter()
                .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
                .collect();
            front.chat_tokens(&msgs)?
        }
        Some(pb::generate_request::Prompt::Tokens(t)) => {
            let vocab = front.config.vocab_size;
            if let Some(bad) = t.ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(RouterError::invalid(
                    "prompt",
                    format!("token id {bad} outside the vocabulary of {vocab}"),
                ));
            }
            t.ids.clone()
        }
    };
    if prompt.is_empty() {
        return Err(RouterError::invalid("prompt", "no tokens"));
    }
    if req.max_tokens == 0 {
        return Err(RouterError::invalid("max_tokens", "must be at least 1"));
    }
    let max_tokens = req.max_tokens as usize;
    if max_tokens >= ctx {
        return Err(RouterError::invalid(
            "max_tokens",
            format!("{max_tokens} (the context holds {ctx} tokens)"),
        ));
    }
    // The prompt keeps room for at least one generated token.
    let room = ctx - 1;
    let mut truncated = 0;
    if prompt.len() > room {
        let truncation = pb::Truncation::try_from(req.truncation).unwrap_or(pb::Truncation::Error);
        truncated = prompt.len() - room;
        match truncation {
            pb::Truncation::KeepRight => {
                prompt.drain(..truncated);
            }
            pb::Truncation::KeepLeft => prompt.truncate(room),
            pb::Truncation::Error | pb::Truncation::Unspecified => {
                return Err(RouterError::invalid(
                    "prompt",
                    format!(
                        "{} tokens leave no room to generate: the context holds {ctx} tokens, \
                         so a prompt may have at most {room} (truncation: error)",
                        prompt.len()
                    ),
                ))
            }
        }
    }
    let params = GenerationParams {
        sampling: sampling_from_proto(req.sampling.as_ref()),
        max_tokens,
        stop: req.stop.clone(),
        stop_token_ids: Vec::new(),
        ignore_eos: req.ignore_eos,
    };
    params.validate(ctx)?;
    let priority = match pb::Priority::try_from(req.priority) {
        Ok(pb::Priority::Batch) => pb::Priority::Batch,
        Ok(_) => pb::Priority::Interactive,
        Err(_) => {
            return Err(RouterError::invalid(
                "priority",
                format!("unknown value {}", req.priority),
            ))
        }
    };
    Ok(Prepared {
        prompt,
        params,
        truncated,
        priority,
        attention,
    })
}
