//! A model on whichever engine runs it ([`EngineModel`]): what the workers, `duet up` and
//! the benchmarks hold, so that one worker code path serves the native CPU engine and the
//! candle engine (candle's CPU device here and in CI, CUDA on GPU nodes).
//!
//! Both engines take the same [`KvCache`] (block tables, prefix cache, export and import in
//! one frame format) and the same [`SeqChunk`] batches with a per-layer hook, so everything
//! above the forward (scheduling, reservations, KV transfer, the prefix cache's events) is
//! shared. The candle engine keeps f16 KV only: an f32 layout is refused with the reason.

use std::ops::ControlFlow;
use std::path::Path;

use crate::candle_engine::CandleModel;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::device::{DeviceSpec, EngineChoice, EngineKind};
use crate::error::{EngineError, Result};
use crate::forward::{LayerHook, Observation, SeqChunk};
use crate::kv::{AttentionPolicy, KvCache, KvDtype, KvLayout, SnapKv};
use crate::model::{LoadOptions, Model};
use crate::tokenizer::Tokenizer;

/// A loaded model and the engine that runs it.
pub enum EngineModel {
    Native(Model),
    Candle(CandleModel),
}

impl From<Model> for EngineModel {
    fn from(m: Model) -> Self {
        EngineModel::Native(m)
    }
}

impl From<CandleModel> for EngineModel {
    fn from(m: CandleModel) -> Self {
        EngineModel::Candle(m)
    }
}

impl EngineModel {
    /// Loads `path` on the engine and device `choice` resolves to (`options` are the native
    /// engine's; the candle engine's threads are candle's own, `RAYON_NUM_THREADS`).
    pub fn load(
        path: impl AsRef<Path>,
        options: LoadOptions,
        choice: EngineChoice,
    ) -> Result<Self> {
        Ok(match choice.resolve()? {
            EngineKind::Native => EngineModel::Native(Model::load(path, options)?),
            EngineKind::Candle => EngineModel::Candle(CandleModel::load(path, choice.device)?),
        })
    }

    pub fn kind(&self) -> EngineKind {
        match self {
            EngineModel::Native(_) => EngineKind::Native,
            EngineModel::Candle(_) => EngineKind::Candle,
        }
    }

    pub fn device(&self) -> DeviceSpec {
        match self {
            EngineModel::Native(_) => DeviceSpec::Cpu,
            EngineModel::Candle(m) => m.device(),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            EngineModel::Native(m) => &m.config,
            EngineModel::Candle(m) => &m.config,
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        match self {
            EngineModel::Native(m) => &m.tokenizer,
            EngineModel::Candle(m) => &m.tokenizer,
        }
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match self {
            EngineModel::Native(m) => m.chat_template.as_ref(),
            EngineModel::Candle(m) => m.chat_template.as_ref(),
        }
    }

    pub fn fingerprint(&self) -> &str {
        match self {
            EngineModel::Native(m) => m.fingerprint(),
            EngineModel::Candle(m) => m.fingerprint(),
        }
    }

    /// The KV layout of a cache for this engine; the candle engine refuses f32.
    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> Result<KvLayout> {
        match (self, dtype) {
            (EngineModel::Native(m), _) => Ok(m.kv_layout(block_size, dtype)),
            (EngineModel::Candle(m), KvDtype::F16) => Ok(m.kv_layout(block_size)),
            (EngineModel::Candle(_), KvDtype::F32) => Err(EngineError::invalid(
                "kv_dtype",
                "the candle engine keeps f16 KV (--kv-dtype f16)",
            )),
        }
    }

    /// Bytes the weights hold (on the device, for the candle engine).
    pub fn weight_bytes(&self) -> usize {
        match self {
            EngineModel::Native(m) => m.weight_bytes(),
            EngineModel::Candle(m) => m.weight_bytes(),
        }
    }

    /// Weight bytes one decode step reads (the roofline's numerator). The candle engine
    /// reads every matrix once per step, so all its weights but the embedding table.
    pub fn weight_bytes_per_step(&self) -> usize {
        match self {
            EngineModel::Native(m) => m.weight_bytes_per_step(),
            EngineModel::Candle(m) => m.weight_bytes(),
        }
    }

    /// Whether this engine and model run `policy`: `InvalidArgument` for a size no model
    /// could run, `PolicyUnsupported` (failed precondition) for one this one cannot.
    pub fn check_attention(&self, policy: AttentionPolicy) -> Result<()> {
        match self {
            EngineModel::Native(m) => m.check_attention(policy),
            EngineModel::Candle(m) => m.check_attention(policy),
        }
    }

    /// Whether `ch` can be computed on its own (tokens, sequence, context).
    pub fn check_chunk(&self, cache: &KvCache, ch: &SeqChunk<'_>) -> Result<()> {
        match self {
            EngineModel::Native(m) => m.check_chunk(cache, ch),
            EngineModel::Candle(m) => m.check_chunk(cache, ch),
        }
    }

    /// One forward over `batch` (see [`Model::forward_with`]: the per-layer hook and the
    /// contract on errors are the same for both engines).
    pub fn forward_with(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        match self {
            EngineModel::Native(m) => m.forward_with(cache, batch, on_layer),
            EngineModel::Candle(m) => m.forward_with(cache, batch, on_layer),
        }
    }

    /// [`Self::forward_with`] gathering the observed queries of SnapKV sequences (native
    /// engine; with none observed, any engine).
    pub fn forward_with_observing(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut LayerHook<'_>,
        observed: &mut [Observation],
    ) -> Result<Vec<Vec<f32>>> {
        match self {
            _ if observed.is_empty() => self.forward_with(cache, batch, on_layer),
            EngineModel::Native(m) => m.forward_with_observing(cache, batch, on_layer, observed),
            EngineModel::Candle(_) => Err(EngineError::PolicyUnsupported(
                "SnapKV needs the native engine".into(),
            )),
        }
    }

    /// [`Self::forward`] gathering the observed queries of SnapKV sequences.
    pub fn forward_observing(
        &self,
        cache: &mut KvCache,
        batch: &[SeqChunk<'_>],
        observed: &mut [Observation],
    ) -> Result<Vec<Vec<f32>>> {
        let mut hook = |_: usize, _: &KvCache| ControlFlow::Continue(());
        self.forward_with_observing(cache, batch, &mut hook, observed)
    }

    /// Compresses an observed prompt's KV by SnapKV (native engine).
    pub fn compress_snapkv(
        &self,
        cache: &mut KvCache,
        obs: &Observation,
        policy: SnapKv,
    ) -> Result<()> {
        match self {
            EngineModel::Native(m) => m.compress_snapkv(cache, obs, policy),
            EngineModel::Candle(_) => Err(EngineError::PolicyUnsupported(format!(
                "{policy} needs the native engine"
            ))),
        }
    }

    pub fn forward(&self, cache: &mut KvCache, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        self.forward_with(cache, batch, &mut |_, _| ControlFlow::Continue(()))
    }
}
