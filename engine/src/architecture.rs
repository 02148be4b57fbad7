//! What a model family's forward pass does, as data: norms, attention kind and RoPE per
//! layer, activation, scales. `forward.rs` follows this description and never asks which
//! family it runs, so a new family is a new [`Family`] arm here (and the kernels it needs),
//! not a fork of the forward pass.
//!
//! Each family's description is what llama.cpp builds for it (`src/models/<family>.cpp`,
//! `llama-model.cpp`'s hyper-parameters): values the GGUF carries are read from it, values
//! llama.cpp hard-codes for the family (Gemma 3's local RoPE base, its 5:1 pattern of local
//! and global layers) are hard-coded here, beside the GGUF key they complete.
//!
//! Invariant: a file whose family, or a feature of it (RoPE scaling, unequal key and value
//! lengths), this description cannot express is refused at load with the name of what is
//! missing, never run approximately.

use candle_core::quantized::gguf_file::{Content, Value};
use serde::Serialize;

use crate::error::{EngineError, Result};

/// The model families duet runs (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Gemma3,
}

impl Family {
    pub const NAMES: &'static [&'static str] = &["llama", "gemma3"];

    /// The family named by `general.architecture`, or `Unsupported` naming it.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Self::Llama),
            "gemma3" => Ok(Self::Gemma3),
            other => Err(EngineError::Unsupported(format!(
                "architecture `{other}` (duet runs: {})",
                Self::NAMES.join(", ")
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Gemma3 => "gemma3",
        }
    }
}

/// How RoPE pairs the elements of a head (llama.cpp's rope types).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: GGUF llama's layout (`LLAMA_ROPE_TYPE_NORM`).
    Adjacent,
    /// Pairs `(i, i + head_dim/2)`: GPT-NeoX's layout (`LLAMA_ROPE_TYPE_NEOX`).
    Halves,
}

/// The gated feed-forward's activation of the gate: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// SwiGLU.
    Silu,
    /// GeGLU with GELU's tanh approximation, read from ggml's f16 table as its CPU
    /// backend does (`ggml_vec_geglu_f32`).
    Gelu,
}

/// Which positions a layer's queries see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerAttention {
    /// Every earlier position.
    Global,
    /// The last `window` positions, itself included (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`:
    /// key `p0` is masked for query `p1` when `p1 - p0 >= window`).
    Local { window: usize },
}

impl LayerAttention {
    /// The first position a query at `pos` sees.
    pub fn first_seen(self, pos: usize) -> usize {
        match self {
            Self::Global => 0,
            Self::Local { window } => (pos + 1).saturating_sub(window),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerSpec {
    pub attention: LayerAttention,
    pub rope_base: f32,
}

/// The forward pass of one model, as the GGUF and its family say.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Architecture {
    pub family: Family,
    /// Multiplies the embedding rows (Gemma: `sqrt(hidden)`, as f32).
    pub embed_scale: Option<f32>,
    /// RMS norms of every query and key head before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// RMS norms of the attention and feed-forward outputs before their residual adds
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    pub activation: Activation,
    pub rope: RopeStyle,
    /// Multiplies `q . k` (llama: `1/sqrt(head_dim)`; Gemma 3: `1/sqrt(key_length)`,
    /// applied to the query by llama.cpp, a power of two for every Gemma 3 size but
    /// 27B, so the products are the same).
    pub attn_scale: f32,
    pub layers: Vec<LayerSpec>,
}

impl Architecture {
    /// Whether any layer attends locally.
    pub fn has_local_layers(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.attention, LayerAttention::Local { .. }))
    }

    /// The distinct RoPE bases of the layers, in first-use order.
    pub fn rope_bases(&self) -> Vec<f32> {
        let mut bases: Vec<f32> = Vec::new();
        for l in &self.layers {
            if !bases.contains(&l.rope_base) {
                bases.push(l.rope_base);
            }
        }
        bases
    }
}

/// The hyper-parameters the description is built from.
pub(crate) struct Dims {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
}

/// Gemma 3 in llama.cpp: every 6th layer global (`set_swa_pattern(6)`), the others local
/// with RoPE base 10,000 (`rope_freq_base_train_swa`).
const GEMMA3_PATTERN: usize = 6;
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;
/// Gemma 3 27B (62 layers) scales queries by `1/sqrt(hidden / heads)`, the other sizes by
/// `1/sqrt(key_length)` (llama.cpp's `f_attention_scale`).
const GEMMA3_27B_LAYERS: usize = 62;

impl Architecture {
    pub(crate) fn describe(family: Family, c: &Content, d: &Dims) -> Result<Self> {
        let key = |k: &str| format!("{}.{k}", family.name());
        if let Some(kind) = c.metadata.get(&key("rope.scaling.type")) {
            let kind = kind.to_string().map(String::as_str).unwrap_or("?");
            if kind != "none" {
                return Err(EngineError::Unsupported(format!(
                    "RoPE scaling `{kind}` ({})",
                    key("rope.scaling.type")
                )));
            }
        }
        let global = LayerSpec {
            attention: LayerAttention::Global,
            rope_base: d.rope_theta,
        };
        Ok(match family {
            Family::Llama => Self {
                family,
                embed_scale: None,
                qk_norm: false,
                post_norms: false,
                activation: Activation::Silu,
                rope: RopeStyle::Adjacent,
                attn_scale: 1.0 / (d.head_dim as f32).sqrt(),
                layers: vec![global; d.n_layers],
            },
            Family::Gemma3 => {
                let window = match c.metadata.get(&key("attention.sliding_window")) {
                    Some(Value::U32(w)) if *w > 0 => *w as usize,
                    Some(other) => {
                        return Err(EngineError::Format(format!(
                            "metadata `{}` is not a positive integer: {other:?}",
                            key("attention.sliding_window")
                        )))
                    }
                    None => {
                        return Err(EngineError::Format(format!(
                            "missing metadata key `{}`",
                            key("attention.sliding_window")
                        )))
                    }
                };
                let local = LayerSpec {
                    attention: LayerAttention::Local { window },
                    rope_base: GEMMA3_LOCAL_ROPE_BASE,
                };
                Self {
                    family,
                    embed_scale: Some((d.hidden as f32).sqrt()),
                    qk_norm: true,
                    post_norms: true,
                    activation: Activation::Gelu,
                    rope: RopeStyle::Halves,
                    attn_scale: match d.n_layers == GEMMA3_27B_LAYERS {
                        true => 1.0 / ((d.hidden / d.n_heads) as f32).sqrt(),
                        false => 1.0 / (d.head_dim as f32).sqrt(),
                    },
                    layers: (0..d.n_layers)
                        .map(|i| match i % GEMMA3_PATTERN < GEMMA3_PATTERN - 1 {
                            true => local,
                            false => global,
                        })
                        .collect(),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_families_are_refused_by_name() {
        let err = Family::from_name("qwen3").unwrap_err().to_string();
        assert!(err.contains("qwen3") && err.contains("gemma3"), "{err}");
    }

    #[test]
    fn local_layers_see_their_window_including_themselves() {
        let l = LayerAttention::Local { window: 512 };
        assert_eq!(l.first_seen(0), 0);
        assert_eq!(l.first_seen(511), 0);
        assert_eq!(l.first_seen(512), 1);
        assert_eq!(LayerAttention::Global.first_seen(9000), 0);
    }
}
