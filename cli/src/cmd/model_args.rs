//! Flags shared by every command that loads the model.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use duet_engine::{
    ChatTemplate, DeviceSpec, EngineChoice, EngineKind, EngineModel, LoadOptions, Model, Tokenizer,
    WeightMode,
};

/// Where `make up` puts the default model.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file (architecture llama or gemma3).
    #[arg(long, env = "DUET_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Compute threads.
    #[arg(long, env = "DUET_THREADS", default_value_t = 1)]
    pub threads: usize,
    /// Weight form: `quantized` (the GGUF's blocks only, llama.cpp's arithmetic: with an
    /// f16 KV cache its logits bit for bit), `dense` (f32 GEMM), or `hybrid` (quantized for
    /// decode steps, dense f32 for prompts: faster prefill, 4x the memory, other rounding).
    #[arg(long, env = "DUET_WEIGHTS", default_value = "quantized")]
    pub weights: WeightMode,
}

impl ModelArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.threads == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        Ok(())
    }

    pub fn load(&self) -> anyhow::Result<Model> {
        self.validate()?;
        Model::load(
            &self.model,
            LoadOptions {
                threads: self.threads,
                weight_mode: self.weights,
            },
        )
        .with_context(|| format!("loading {}", self.model.display()))
    }

    /// The model on the engine and device `e` names (`--threads` and `--weights` are the
    /// native engine's).
    pub fn load_engine(&self, e: &EngineArgs) -> anyhow::Result<EngineModel> {
        self.validate()?;
        let options = LoadOptions {
            threads: self.threads,
            weight_mode: self.weights,
        };
        EngineModel::load(&self.model, options, e.choice())
            .with_context(|| format!("loading {}", self.model.display()))
    }
}

/// Where the model runs and which engine runs it (`duet run`, `bench engine`, `up`,
/// `prefill`, `decode`).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Compute device: `cpu`, `cuda` or `cuda:N` (CUDA needs a build with the `cuda`
    /// feature and a driver).
    #[arg(long, env = "DUET_DEVICE", default_value = "cpu")]
    pub device: DeviceSpec,
    /// Engine: `native` (the bit-exact CPU engine; the default on `cpu`) or `candle` (the
    /// device-generic engine; the only one on `cuda`).
    #[arg(long, env = "DUET_ENGINE")]
    pub engine: Option<EngineKind>,
}

impl EngineArgs {
    pub fn choice(&self) -> EngineChoice {
        EngineChoice {
            device: self.device,
            engine: self.engine,
        }
    }

    /// The engine that runs, or which flag is wrong.
    pub fn resolve(&self) -> anyhow::Result<EngineKind> {
        self.choice().resolve().context("--engine/--device")
    }
}

/// `--chat-template FILE`: a Jinja chat template that replaces the GGUF's (vLLM's
/// `--chat-template`, llama.cpp's `--chat-template-file`), read and compiled for
/// `tokenizer`'s BOS and EOS; a failure names the flag and the file.
pub fn chat_template(path: &Path, tokenizer: &Tokenizer) -> anyhow::Result<ChatTemplate> {
    let source = std::fs::read_to_string(path)
        .with_context(|| format!("--chat-template: reading {}", path.display()))?;
    ChatTemplate::for_tokenizer(source, tokenizer)
        .with_context(|| format!("--chat-template: {}", path.display()))
}
