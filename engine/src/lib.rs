//! duet's model engine, shared by the prefill and decode workers.
//!
//! - [`Model`]: a GGUF (llama or gemma3, its forward pass described as data by
//!   [`Architecture`]) loaded into duet's own weight structures, with its tokenizer and
//!   chat template;
//! - [`KvCache`]: a paged KV cache whose blocks can be exported to and
//!   imported from another process (what disaggregation moves);
//! - [`Model::forward`]: one forward over any mix of prefill chunks and decode
//!   steps of different sequences;
//! - [`CandleModel`]: the device-generic engine on candle (its CPU device here, CUDA on
//!   GPU nodes) with a paged KV pool on the device, selected by [`EngineChoice`];
//! - [`Generation`]: sampling and stop conditions of one sequence, and its text state
//!   (detokenizer, stop hold-back, seeded draws), which a migrated stream resumes.
//!
//! Invariants this crate keeps:
//! - **Bit-exact with llama.cpp.** With the defaults (`WeightMode::Quantized`, f16 KV) the
//!   logits equal llama.cpp's (0.3.36, its AVX-512 build, which recorded the reference in
//!   `tests/data/`) bit for bit on any x86-64-v3 machine, at any chunking of the prompt and
//!   on 1 or 2 threads: every kernel follows ggml's arithmetic order (see `docs/engine.md`
//!   and `engine/tests/`). A change that moves one rounding fails `bit_exact.rs`.
//! - **KV accounting.** A block is free, used by sequences (reference-counted,
//!   copy-on-write), or cached; `free + used == total` always (property-tested).
//! - **No panics on input.** A malformed GGUF, prompt or token id is an [`EngineError`]
//!   classified into the workspace's one [`ErrorClass`], never a crash.
//! - **Unsafe code only in the SIMD kernels** (`kernels::avx2`), each block with its SAFETY.

#![deny(unsafe_code)]

pub mod architecture;
mod attention;
mod attention_gemm;
mod attention_window;
mod bpe;
pub mod candle_engine;
pub mod chat;
mod checks;
pub mod config;
pub mod device;
pub mod engine_model;
pub mod error;
mod fingerprint;
pub mod forward;
pub mod generate;
mod gguf_check;
mod heap;
pub mod kernels;
pub mod kv;
mod layer_ops;
pub mod linear;
pub mod model;
pub mod perplexity;
mod projection;
pub mod sampling;
pub mod session;
mod snapkv;
mod spm;
pub mod tokenizer;

pub use architecture::{Activation, Architecture, Family, LayerAttention, LayerSpec, RopeStyle};
pub use candle_engine::{CandleModel, DeviceKv};
pub use chat::{ChatMessage, ChatTemplate, CHAT_ROLES};
pub use config::ModelConfig;
pub use device::{DeviceSpec, EngineChoice, EngineKind};
pub use engine_model::EngineModel;
pub use error::{EngineError, ErrorClass, Result};
pub use forward::{check_prompt, check_token_ids, Observation, SeqChunk};
pub use generate::{
    generate, generate_in, FinishReason, Generation, GenerationOutput, GenerationParams, TokenStep,
};
pub use kv::{
    group_key, reusable_tokens, servable_prefix, AttentionPolicy, BlockHash, KvCache,
    KvCacheConfig, KvDtype, KvEvent, KvExport, KvGroups, KvKind, KvLayout, KvTier, KvView,
    LeasedRegion, PoolBacking, PrefixCacheConfig, PrefixHasher, PrefixHit, RegionLease, SeqId,
    SnapKv, TierCounts, Window, WINDOWED_MAX_TOKENS,
};
pub use linear::WeightMode;
pub use model::{LoadOptions, Model, TextFrontend};
pub use sampling::{Sampler, SamplingParams};
pub use session::{CandleSession, ForwardSession, NativeSession};
pub use tokenizer::{Detokenizer, Tokenizer};
