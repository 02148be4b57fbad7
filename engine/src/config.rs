//! Hyper-parameters of a model, read from GGUF metadata under its family's key prefix
//! (`llama.*`, `gemma3.*`), and the description of its forward pass (`architecture`).

use candle_core::quantized::gguf_file::{Content, Value};
use serde::Serialize;

use crate::architecture::{Architecture, Dims, Family};
use crate::error::{EngineError, Result};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    pub architecture: String,
    pub name: String,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub ffn_hidden: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    /// What the forward pass does, layer by layer.
    pub arch: Architecture,
}

fn get<'a>(c: &'a Content, key: &str) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| EngineError::Format(format!("missing metadata key `{key}`")))
}

fn get_usize(c: &Content, key: &str) -> Result<usize> {
    let v = get(c, key)?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(EngineError::Format(format!(
                "metadata `{key}` is not a non-negative integer: {other:?}"
            )))
        }
    };
    usize::try_from(n).map_err(|_| EngineError::Format(format!("metadata `{key}` too large")))
}

fn get_f32(c: &Content, key: &str) -> Result<f32> {
    match get(c, key)? {
        Value::F32(x) => Ok(*x),
        Value::F64(x) => Ok(*x as f32),
        other => Err(EngineError::Format(format!(
            "metadata `{key}` is not a float: {other:?}"
        ))),
    }
}

impl ModelConfig {
    pub fn from_gguf(c: &Content) -> Result<Self> {
        let architecture = get(c, "general.architecture")?
            .to_string()
            .map_err(|_| EngineError::Format("general.architecture is not a string".into()))?
            .clone();
        let family = Family::from_name(&architecture)?;
        let a = |k: &str| format!("{}.{k}", family.name());
        let hidden = get_usize(c, &a("embedding_length"))?;
        let n_heads = get_usize(c, &a("attention.head_count"))?;
        let n_kv_heads = match c.metadata.contains_key(&a("attention.head_count_kv")) {
            true => get_usize(c, &a("attention.head_count_kv"))?,
            false => n_heads,
        };
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(EngineError::Format(format!(
                "inconsistent heads: hidden {hidden}, heads {n_heads}, kv heads {n_kv_heads}"
            )));
        }
        // The head size is `hidden / heads` unless the file says otherwise (Gemma 3's
        // `key_length`); keys and values of one size share the cache's head layout.
        let head_dim = match c.metadata.contains_key(&a("attention.key_length")) {
            true => get_usize(c, &a("attention.key_length"))?,
            false if hidden.is_multiple_of(n_heads) => hidden / n_heads,
            false => {
                return Err(EngineError::Format(format!(
                    "hidden {hidden} is not a multiple of {n_heads} heads"
                )))
            }
        };
        if c.metadata.contains_key(&a("attention.value_length"))
            && get_usize(c, &a("attention.value_length"))? != head_dim
        {
            return Err(EngineError::Unsupported(format!(
                "{} unlike {}",
                a("attention.value_length"),
                a("attention.key_length")
            )));
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(EngineError::Format(format!("odd head dim {head_dim}")));
        }
        let vocab_size = match c.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(t)) => t.len(),
            _ => get_usize(c, &a("vocab_size"))?,
        };
        let name = c
            .metadata
            .get("general.name")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_else(|| "unnamed".to_string());
        let rope_theta = match c.metadata.contains_key(&a("rope.freq_base")) {
            true => get_f32(c, &a("rope.freq_base"))?,
            false => 10_000.0,
        };
        let n_layers = get_usize(c, &a("block_count"))?;
        let dims = Dims {
            n_layers,
            hidden,
            n_heads,
            head_dim,
            rope_theta,
        };
        let arch = Architecture::describe(family, c, &dims)?;
        Ok(Self {
            architecture,
            name,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            hidden,
            ffn_hidden: get_usize(c, &a("feed_forward_length"))?,
            vocab_size,
            rope_theta,
            rms_eps: get_f32(c, &a("attention.layer_norm_rms_epsilon"))?,
            context_length: get_usize(c, &a("context_length"))?,
            arch,
        })
    }

    /// Query heads that share one KV head.
    /// How the KV cache groups this model's layers (`kv::groups`).
    pub fn kv_groups(&self) -> crate::kv::KvGroups {
        crate::kv::KvGroups::for_layers(&self.arch.layers)
    }

    /// Layers one KV block holds: a layer group's.
    pub fn layers_per_kv_block(&self) -> usize {
        self.kv_groups().per_group
    }

    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Width of the query projection (`heads * head_dim`; not always `hidden`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of the key (and of the value) projection.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
