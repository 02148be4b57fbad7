//! What both engines and both workers check before a token reaches a batch: token ids
//! inside the vocabulary, prompts and chunks within the context.

use crate::error::{EngineError, Result};

/// Every id of `tokens` is inside a vocabulary of `vocab_size` (what a worker checks at its
/// door, before a request reaches a batch).
pub fn check_token_ids(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        Some(&bad) => Err(EngineError::invalid(
            "tokens",
            format!("token id {bad} outside the vocabulary of {vocab_size}"),
        )),
        None => Ok(()),
    }
}

/// A prompt a model of `context_length` can hold with room for one generated token (1 to
/// `context_length - 1` tokens), every id inside the vocabulary: what both workers check at
/// their doors.
pub fn check_prompt(prompt: &[u32], vocab_size: usize, context_length: usize) -> Result<()> {
    if prompt.is_empty() || prompt.len() >= context_length {
        return Err(EngineError::invalid(
            "prompt",
            format!("{} tokens (must be in 1..{context_length})", prompt.len()),
        ));
    }
    check_token_ids(prompt, vocab_size)
}

/// The rule every engine checks a chunk by before computing anything: some tokens, all
/// inside the vocabulary, and the sequence (`len` tokens so far) still within the context
/// when its attention is `bounded` by it (full attention).
pub(crate) fn check_chunk_fits(
    c: &crate::config::ModelConfig,
    len: usize,
    tokens: &[u32],
    bounded: bool,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(EngineError::invalid("tokens", "empty chunk"));
    }
    check_token_ids(tokens, c.vocab_size)?;
    if bounded && len + tokens.len() > c.context_length {
        return Err(EngineError::invalid(
            "tokens",
            format!(
                "{} tokens exceed the context length {}",
                len + tokens.len(),
                c.context_length
            ),
        ));
    }
    Ok(())
}
