//! Chat prompts rendered with the model's own Jinja template
//! (`tokenizer.chat_template`), through minijinja with Python string methods.

use candle_core::quantized::gguf_file::Content;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

impl ChatTemplate {
    /// The template from the GGUF metadata, if it has one.
    pub fn from_gguf(c: &Content, bos: String, eos: String) -> Result<Option<Self>> {
        let Some(src) = c
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok().cloned())
        else {
            return Ok(None);
        };
        Self::new(src, bos, eos).map(Some)
    }

    pub fn new(source: String, bos: String, eos: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(EngineError::Template)?;
        Ok(Self { env, bos, eos })
    }

    /// Render a conversation, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(EngineError::invalid("messages", "no messages"));
        }
        let t = self
            .env
            .get_template("chat")
            .map_err(EngineError::Template)?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(EngineError::Template)
    }
}
