//! What one generation loop needs of an engine, whichever it is: a model with its KV cache
//! (the native engine's [`Model`] or the candle engine's [`CandleModel`], each over a
//! [`KvCache`]; the candle engine keeps its copy on the device inside the cache). [`crate::generate::generate_in`] runs on it, so
//! `duet run` drives both engines through the same sampling, stop and timing code.

use crate::candle_engine::CandleModel;
use crate::error::{EngineError, Result};
use crate::forward::{Observation, SeqChunk};
use crate::kv::{AttentionPolicy, KvCache, SeqId, SnapKv};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// A model and the KV store its sequences live in.
pub trait ForwardSession {
    fn tokenizer(&self) -> &Tokenizer;
    fn context_length(&self) -> usize;
    fn n_layers(&self) -> usize;
    fn add_sequence(&mut self, seq: SeqId) -> Result<()>;
    fn free_sequence(&mut self, seq: SeqId);
    fn sequence_len(&self, seq: SeqId) -> Result<usize>;
    /// Gives the new, empty sequence `seq` an attention policy.
    fn set_attention(&mut self, seq: SeqId, policy: AttentionPolicy) -> Result<()>;
    /// One forward over `batch`; per chunk the logits of its last token where asked.
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>>;
    /// [`Self::forward`] gathering `obs`'s observed queries (SnapKV, `kv::snapkv`).
    fn forward_observing(
        &mut self,
        batch: &[SeqChunk<'_>],
        obs: &mut Observation,
    ) -> Result<Vec<Vec<f32>>> {
        let _ = (batch, obs);
        Err(EngineError::PolicyUnsupported(
            "SnapKV needs the native engine".into(),
        ))
    }
    /// Compresses `obs`'s sequence, its prompt computed and observed, by SnapKV.
    fn compress_snapkv(&mut self, obs: &Observation, policy: SnapKv) -> Result<()> {
        let _ = obs;
        Err(EngineError::PolicyUnsupported(format!(
            "{policy} needs the native engine"
        )))
    }
}

/// The native engine over a paged CPU cache.
pub struct NativeSession<'a> {
    pub model: &'a Model,
    pub cache: &'a mut KvCache,
}

impl ForwardSession for NativeSession<'_> {
    fn tokenizer(&self) -> &Tokenizer {
        &self.model.tokenizer
    }
    fn context_length(&self) -> usize {
        self.model.config.context_length
    }
    fn n_layers(&self) -> usize {
        self.model.config.n_layers
    }
    fn add_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.cache.add_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.cache.free_sequence(seq);
    }
    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.cache.sequence_len(seq)
    }
    fn set_attention(&mut self, seq: SeqId, policy: AttentionPolicy) -> Result<()> {
        self.model.check_attention(policy)?;
        self.cache.set_attention(seq, policy)
    }
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        self.model.forward(self.cache, batch)
    }
    fn forward_observing(
        &mut self,
        batch: &[SeqChunk<'_>],
        obs: &mut Observation,
    ) -> Result<Vec<Vec<f32>>> {
        self.model
            .forward_observing(self.cache, batch, std::slice::from_mut(obs))
    }
    fn compress_snapkv(&mut self, obs: &Observation, policy: SnapKv) -> Result<()> {
        self.model.compress_snapkv(self.cache, obs, policy)
    }
}

/// The candle engine over a paged cache (f16, from [`CandleModel::new_cache`]).
pub struct CandleSession<'a> {
    pub model: &'a CandleModel,
    pub cache: &'a mut KvCache,
}

impl ForwardSession for CandleSession<'_> {
    fn tokenizer(&self) -> &Tokenizer {
        &self.model.tokenizer
    }
    fn context_length(&self) -> usize {
        self.model.config.context_length
    }
    fn n_layers(&self) -> usize {
        self.model.config.n_layers
    }
    fn add_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.cache.add_sequence(seq)
    }
    fn free_sequence(&mut self, seq: SeqId) {
        self.cache.free_sequence(seq);
    }
    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.cache.sequence_len(seq)
    }
    fn set_attention(&mut self, seq: SeqId, policy: AttentionPolicy) -> Result<()> {
        self.model.check_attention(policy)?;
        self.cache.set_attention(seq, policy)
    }
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        self.model.forward(self.cache, batch)
    }
}
