//! The device-generic engine: a llama-architecture GGUF on candle, on any device candle
//! has (its CPU device here and in CI; CUDA on GPU nodes, in a build with the `cuda`
//! feature, which has never run on a GPU: see `docs/gpu.md`).
//!
//! - Weights stay in the GGUF's own quantized blocks on the device ([`QMatMul`]: candle's
//!   quantized kernels for Q4_0/Q4_1/Q8_0 and the K-quants); norms and the embedding
//!   table are dequantized to f32 once.
//! - KV lives in a paged pool on the device ([`DeviceKv`]) whose block tables, reference
//!   counts and prefix cache are the host [`KvCache`]'s: the engine takes a `KvCache` as the
//!   native engine does, so workers, export/import and the prefix cache work unchanged.
//! - One forward runs any mix of prompt chunks and decode steps of different sequences
//!   ([`CandleModel::forward`], the same [`SeqChunk`] batch as the native engine): the dense
//!   parts over every row at once, attention per chunk over its sequence's gathered rows.
//!
//! Invariant: on the CPU device its greedy output follows llama.cpp's by the reference
//! rule on the reference prompts, as the native engine's does, but it is not bit-exact
//! (candle's kernels round in their own order): `engine/tests/candle_parity.rs` states the
//! logit tolerance against the native engine.

mod forward;
pub mod pool;

use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Tensor};

use crate::architecture::Family;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::device::DeviceSpec;
use crate::error::{EngineError, Result};
use crate::fingerprint::Fingerprinter;
use crate::kv::{KvCache, KvDtype, KvLayout};
use crate::model::TextFrontend;
use crate::tokenizer::Tokenizer;

pub use pool::DeviceKv;

struct Layer {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
}

/// A model loaded on a candle device. Immutable after loading.
pub struct CandleModel {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    device: Device,
    spec: DeviceSpec,
    embed: Tensor,
    layers: Vec<Layer>,
    out_norm: Tensor,
    output: QMatMul,
    fingerprint: String,
    path: PathBuf,
}

struct Loader<'a> {
    content: &'a Content,
    file: File,
    device: &'a Device,
    fp: Fingerprinter,
}

impl Loader<'_> {
    /// A tensor on the device, hashed into the model's fingerprint from its GGUF bytes
    /// (read on the host: on a GPU, read a second time onto the device).
    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(EngineError::Format(format!("missing tensor `{name}`")));
        }
        let host = self.content.tensor(&mut self.file, name, &Device::Cpu)?;
        self.fp.tensor(name, host.data()?.as_ref());
        if self.device.is_cpu() {
            return Ok(host);
        }
        Ok(self.content.tensor(&mut self.file, name, self.device)?)
    }

    fn matmul(&mut self, name: &str, rows: usize, cols: usize) -> Result<QMatMul> {
        let t = self.qtensor(name)?;
        if t.shape().dims() != [rows, cols] {
            return Err(EngineError::Format(format!(
                "tensor `{name}` has shape {:?}, expected [{rows}, {cols}]",
                t.shape().dims()
            )));
        }
        Ok(QMatMul::from_qtensor(t)?)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let t = self.qtensor(name)?.dequantize(self.device)?.flatten_all()?;
        if t.elem_count() != len {
            return Err(EngineError::Format(format!(
                "tensor `{name}` has {} elements, expected {len}",
                t.elem_count()
            )));
        }
        Ok(t)
    }
}

impl CandleModel {
    /// Loads `path` onto `spec`'s device (refused with the reason when the device is not
    /// there).
    pub fn load(path: impl AsRef<Path>, spec: DeviceSpec) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let device = spec.candle_device()?;
        let (file, content) = crate::model::open_checked(&path)?;
        let TextFrontend {
            config,
            tokenizer,
            chat_template,
        } = TextFrontend::from_content(&content)?;
        let c = &config;
        // This engine's graph is llama's: any other description is refused by name.
        if c.arch.family != Family::Llama {
            return Err(EngineError::Unsupported(format!(
                "architecture `{}` on --engine candle (it runs llama; use --engine native)",
                c.architecture
            )));
        }
        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut ld = Loader {
            content: &content,
            file,
            device: &device,
            fp: Fingerprinter::default(),
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: ld.vector(&p("attn_norm"), c.hidden)?,
                wq: ld.matmul(&p("attn_q"), q_dim, c.hidden)?,
                wk: ld.matmul(&p("attn_k"), kv_dim, c.hidden)?,
                wv: ld.matmul(&p("attn_v"), kv_dim, c.hidden)?,
                wo: ld.matmul(&p("attn_output"), c.hidden, q_dim)?,
                ffn_norm: ld.vector(&p("ffn_norm"), c.hidden)?,
                w_gate: ld.matmul(&p("ffn_gate"), c.ffn_hidden, c.hidden)?,
                w_up: ld.matmul(&p("ffn_up"), c.ffn_hidden, c.hidden)?,
                w_down: ld.matmul(&p("ffn_down"), c.hidden, c.ffn_hidden)?,
            });
        }
        let embed = ld.qtensor("token_embd.weight")?.dequantize(&device)?;
        if embed.dims() != [c.vocab_size, c.hidden] {
            return Err(EngineError::Format(format!(
                "tensor `token_embd.weight` has shape {:?}, expected [{}, {}]",
                embed.dims(),
                c.vocab_size,
                c.hidden
            )));
        }
        let out_norm = ld.vector("output_norm.weight", c.hidden)?;
        // Tied embeddings: without `output.weight` the embedding matrix is the output.
        let output = match content.tensor_infos.contains_key("output.weight") {
            true => ld.matmul("output.weight", c.vocab_size, c.hidden)?,
            false => ld.matmul("token_embd.weight", c.vocab_size, c.hidden)?,
        };
        let fingerprint = ld.fp.finish(&config, &tokenizer);
        Ok(CandleModel {
            config,
            tokenizer,
            chat_template,
            device,
            spec,
            embed,
            layers,
            out_norm,
            output,
            fingerprint,
            path,
        })
    }

    /// The model's identity, equal to the native engine's for the same file.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The KV layout of this engine's cache and frames: the native engine's f16 layout.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            fingerprint: self.fingerprint.clone(),
            n_layers: self.config.n_layers,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
            dtype: KvDtype::F16,
            // Loads only llama's graph (see `load`), whose layers are all global: one group.
            groups: crate::kv::KvGroups::single(self.config.n_layers),
        }
    }

    pub fn device(&self) -> DeviceSpec {
        self.spec
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the weights hold on the device (quantized blocks, f32 norms and embedding).
    pub fn weight_bytes(&self) -> usize {
        fn mm(m: &QMatMul) -> usize {
            match m {
                QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                    t.elem_count() * t.dtype().size_in_bytes()
                }
            }
        }
        let f32s = |t: &Tensor| t.elem_count() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .into_iter()
                    .map(mm)
                    .sum::<usize>()
                    + f32s(&l.attn_norm)
                    + f32s(&l.ffn_norm)
            })
            .sum();
        layers + f32s(&self.embed) + f32s(&self.out_norm) + mm(&self.output)
    }

    /// A KV cache for this model: `blocks` blocks of `block_size` tokens, f16, whose copy
    /// on the model's device is made by the first forward.
    pub fn new_cache(&self, block_size: usize, blocks: usize) -> KvCache {
        KvCache::new(self.kv_layout(block_size), blocks)
    }
}
