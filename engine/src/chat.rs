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

/// The roles a chat message may have, as OpenAI's API names them. `developer` is OpenAI's
/// newer name for `system` and is rendered as one (the model was trained on `system`).
/// `tool` and `function` messages answer tool calls, which duet does not serve.
pub const CHAT_ROLES: &[&str] = &["system", "user", "assistant", "developer"];

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// The role the chat template sees, or why this message's role is refused (the one rule
    /// of every door: gRPC, the OpenAI API, tokenize).
    pub fn template_role(&self) -> std::result::Result<&'static str, String> {
        match self.role.as_str() {
            "system" | "developer" => Ok("system"),
            "user" => Ok("user"),
            "assistant" => Ok("assistant"),
            "tool" | "function" => Err(format!(
                "role `{}` answers a tool call, and duet does not serve tool calls",
                self.role
            )),
            other => Err(format!(
                "role `{other}` is not one of {}",
                CHAT_ROLES.join(", ")
            )),
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
    pub fn from_gguf(c: &Content, tokenizer: &crate::Tokenizer) -> Result<Option<Self>> {
        let Some(src) = c
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok().cloned())
        else {
            return Ok(None);
        };
        Self::for_tokenizer(src, tokenizer).map(Some)
    }

    /// A template given by the user (like vLLM's `--chat-template` and llama.cpp's
    /// `--chat-template-file`), for a model whose GGUF has none or another: `bos_token` and
    /// `eos_token` are the tokenizer's.
    pub fn for_tokenizer(source: String, tokenizer: &crate::Tokenizer) -> Result<Self> {
        let text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        Self::new(
            source,
            text(tokenizer.bos_token_id()),
            text(tokenizer.eos_token_id()),
        )
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
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| match m.template_role() {
                Ok(role) => Ok(ChatMessage::new(role, m.content.clone())),
                Err(why) => Err(EngineError::invalid(
                    "messages",
                    format!("messages[{i}].role: {why}"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> ChatTemplate {
        ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap()
    }

    #[test]
    fn developer_is_rendered_as_system_and_the_others_as_given() {
        let t = template();
        let msgs = [
            ChatMessage::new("developer", "a"),
            ChatMessage::new("system", "b"),
            ChatMessage::new("user", "c"),
            ChatMessage::new("assistant", "d"),
        ];
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            "system:a;system:b;user:c;assistant:d;"
        );
    }

    #[test]
    fn unknown_and_tool_roles_are_refused_naming_the_message() {
        let t = template();
        for role in ["wizard", "tool", "function", "", "User"] {
            let msgs = [ChatMessage::new("user", "x"), ChatMessage::new(role, "y")];
            let e = t.render(&msgs, true).unwrap_err();
            assert!(
                matches!(
                    e,
                    EngineError::InvalidArgument {
                        field: "messages",
                        ..
                    }
                ),
                "{role}: {e}"
            );
            let text = e.to_string();
            assert!(text.contains("messages[1].role"), "{role}: {text}");
            assert!(text.contains(&format!("`{role}`")), "{role}: {text}");
        }
    }
}
