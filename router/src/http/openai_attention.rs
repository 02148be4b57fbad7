//! The OpenAI door's `attention` field (duet's own, which OpenAI clients send through
//! `extra_body`): the CLI's syntax as a string (`"full"`, `"window=W,sinks=S"`,
//! `"snapkv=B"`), or a window's sizes as an object (`{"window": W, "sinks": S}`, sinks 4 by
//! default). Malformed values are a 400 naming `attention`; sizes are checked against the
//! model by the router (`attention.window`).

use duet_proto::v1 as pb;
use serde::Deserialize;

use super::api_error::ApiError;

/// `attention`: the CLI's syntax as a string, or the window's sizes as an object.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum AttentionInput {
    Spec(String),
    Window {
        window: i64,
        #[serde(default = "default_sinks")]
        sinks: i64,
    },
}

fn default_sinks() -> i64 {
    4
}

impl AttentionInput {
    pub(super) fn to_proto(&self) -> Result<pb::AttentionPolicy, ApiError> {
        let policy = match self {
            AttentionInput::Spec(s) => s
                .parse::<duet_engine::AttentionPolicy>()
                .map_err(|e| ApiError::invalid("attention", e))?,
            AttentionInput::Window { window, sinks } => {
                let size = |name: &str, v: i64| {
                    usize::try_from(v).map_err(|_| {
                        ApiError::invalid("attention", format!("{name} must not be negative"))
                    })
                };
                duet_engine::AttentionPolicy::Window(duet_engine::Window {
                    window: size("window", *window)?,
                    sinks: size("sinks", *sinks)?,
                })
            }
        };
        Ok(duet_serving::convert::attention_to_proto(policy))
    }
}

#[cfg(test)]
mod tests {
    use super::super::openai_request::tests::completion;
    use super::*;

    #[test]
    fn an_attention_policy_arrives_as_the_cli_spells_it_or_as_an_object() {
        let window =
            |r: &pb::GenerateRequest| match r.attention.as_ref().and_then(|a| a.policy.as_ref()) {
                Some(pb::attention_policy::Policy::Window(w)) => Some((w.window, w.sinks)),
                _ => None,
            };
        let r = completion(serde_json::json!({"prompt": "x", "attention": "window=256,sinks=8"}))
            .unwrap();
        assert_eq!(window(&r), Some((256, 8)));
        let r =
            completion(serde_json::json!({"prompt": "x", "attention": {"window": 64}})).unwrap();
        assert_eq!(window(&r), Some((64, 4)), "sinks default to 4");
        let r = completion(serde_json::json!({"prompt": "x", "attention": "full"})).unwrap();
        assert!(matches!(
            r.attention.and_then(|a| a.policy),
            Some(pb::attention_policy::Policy::Full(_))
        ));
        assert!(completion(serde_json::json!({"prompt": "x"}))
            .unwrap()
            .attention
            .is_none());
        for bad in [
            serde_json::json!("window=0"),
            serde_json::json!("width=3"),
            serde_json::json!({"window": -1}),
        ] {
            let e = completion(serde_json::json!({"prompt": "x", "attention": bad})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("attention"), "{bad}");
        }
    }
}
