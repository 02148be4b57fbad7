//! Loading a GGUF into duet's own weight structures, the tensors its architecture's
//! description (`architecture`) asks for: a missing tensor is refused by name.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::fingerprint::Fingerprinter;
use crate::gguf_check;
use crate::kernels::kquant::KFormat;
use crate::kernels::BlockFormat;
use crate::kv::{KvDtype, KvLayout};
use crate::linear::{Linear, QWeight, WeightMode};
use crate::projection::Projection;
use crate::tokenizer::Tokenizer;

/// How to load a model.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Compute threads of this model's pool (>= 1).
    pub threads: usize,
    pub weight_mode: WeightMode,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            threads: 1,
            weight_mode: WeightMode::Hybrid,
        }
    }
}

pub(crate) struct Layer {
    pub attn_norm: Vec<f32>,
    /// Q, K and V: one matmul when they share a format.
    pub wqkv: Projection,
    /// Per-head RMS norms of queries and keys (`Architecture::qk_norm`), `[head_dim]` each.
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    pub wo: Linear,
    /// RMS norms of the attention and feed-forward outputs (`Architecture::post_norms`).
    pub post_norms: Option<(Vec<f32>, Vec<f32>)>,
    pub ffn_norm: Vec<f32>,
    /// Gate and up: one matmul when they share a format.
    pub w_gate_up: Projection,
    pub w_down: Linear,
}

/// A loaded model: weights, tokenizer, chat template and a compute pool.
/// Immutable after loading, so one model serves many caches and threads.
pub struct Model {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// The embedding matrix; `None` when the output projection is tied to it and keeps its
    /// quantized blocks (Gemma's 262k-row table is then held once, not twice).
    pub(crate) embed: Option<QWeight>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) out_norm: Vec<f32>,
    pub(crate) output: Linear,
    pub(crate) pool: rayon::ThreadPool,
    fingerprint: String,
    options: LoadOptions,
    path: PathBuf,
}

const HEADER_PREFIX_BYTES: u64 = 256 << 20;

fn block_format(dt: GgmlDType) -> Option<BlockFormat> {
    Some(match dt {
        GgmlDType::F32 => BlockFormat::F32,
        GgmlDType::F16 => BlockFormat::F16,
        GgmlDType::Q4_0 => BlockFormat::Q4_0,
        GgmlDType::Q4_1 => BlockFormat::Q4_1,
        GgmlDType::Q5_0 => BlockFormat::Q5_0,
        GgmlDType::Q5_1 => BlockFormat::Q5_1,
        GgmlDType::Q8_0 => BlockFormat::Q8_0,
        GgmlDType::Q4K => BlockFormat::K(KFormat::Q4K),
        GgmlDType::Q5K => BlockFormat::K(KFormat::Q5K),
        GgmlDType::Q6K => BlockFormat::K(KFormat::Q6K),
        _ => return None,
    })
}

struct Loader<'a> {
    content: &'a Content,
    file: File,
    fp: Fingerprinter,
}

impl Loader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(EngineError::Format(format!("missing tensor `{name}`")));
        }
        let t = self.content.tensor(&mut self.file, name, &Device::Cpu)?;
        self.fp.tensor(name, t.data()?.as_ref());
        Ok(t)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.qtensor(name)?;
        let v = t
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if v.len() != len {
            return Err(EngineError::Format(format!(
                "tensor `{name}` has {} elements, expected {len}",
                v.len()
            )));
        }
        Ok(v)
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<QWeight> {
        let t = self.qtensor(name)?;
        let dims = t.shape().dims().to_vec();
        if dims != [rows, cols] {
            return Err(EngineError::Format(format!(
                "tensor `{name}` has shape {dims:?}, expected [{rows}, {cols}]"
            )));
        }
        match block_format(t.dtype()) {
            Some(fmt) => QWeight::new(fmt, t.data()?.into_owned(), rows, cols),
            // Formats without a native kernel (k-quants...) are expanded to f32.
            None => {
                let v = t
                    .dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                QWeight::new(
                    BlockFormat::F32,
                    bytemuck::cast_slice(&v).to_vec(),
                    rows,
                    cols,
                )
            }
        }
    }
}

/// Opens a GGUF file after the bounds-checked header walk (so a corrupt or
/// truncated file is an error, never a panic inside the parser).
pub(crate) fn open_checked(path: &Path) -> Result<(File, Content)> {
    let io = |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut head = Vec::new();
    (&mut file)
        .take(HEADER_PREFIX_BYTES.min(file_len))
        .read_to_end(&mut head)
        .map_err(io)?;
    gguf_check::check_header(&head, file_len)?;
    drop(head);
    let mut file = File::open(path).map_err(io)?;
    let content = Content::read(&mut file)?;
    Ok((file, content))
}

/// One weight matrix of a GGUF file (`name`, e.g. `blk.0.ffn_down.weight`)
/// as the engine keeps it: its own blocks where a native kernel exists,
/// expanded to f32 otherwise. For kernel benchmarks and tests.
pub fn read_weight(path: &Path, name: &str) -> Result<QWeight> {
    let (file, content) = open_checked(path)?;
    let info = content
        .tensor_infos
        .get(name)
        .ok_or_else(|| EngineError::Format(format!("missing tensor `{name}`")))?;
    let (rows, cols) = match info.shape.dims() {
        [rows, cols] => (*rows, *cols),
        dims => {
            return Err(EngineError::Format(format!(
                "tensor `{name}` has shape {dims:?}, not a matrix"
            )))
        }
    };
    let mut loader = Loader {
        content: &content,
        file,
        fp: Fingerprinter::default(),
    };
    loader.matrix(name, rows, cols)
}

/// What a model's text side needs without its weights: hyper-parameters,
/// tokenizer and chat template. The router loads only this.
pub struct TextFrontend {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

impl TextFrontend {
    /// Reads the metadata of a GGUF file (tensors are not loaded).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let (_, content) = open_checked(path.as_ref())?;
        Self::from_content(&content)
    }

    pub(crate) fn from_content(content: &Content) -> Result<Self> {
        let config = ModelConfig::from_gguf(content)?;
        let tokenizer = Tokenizer::from_gguf(content)?;
        let chat_template = ChatTemplate::from_gguf(content, &tokenizer)?;
        Ok(Self {
            config,
            tokenizer,
            chat_template,
        })
    }

    /// Prompt tokens for chat messages: the template rendered with the
    /// generation prompt, control tokens parsed.
    pub fn chat_tokens(&self, messages: &[crate::ChatMessage]) -> Result<Vec<u32>> {
        let tpl = self
            .chat_template
            .as_ref()
            .ok_or_else(|| EngineError::invalid("messages", "the model has no chat template"))?;
        let text = tpl.render(messages, true)?;
        self.tokenizer.encode(&text, true)
    }
}

impl Model {
    pub fn load(path: impl AsRef<Path>, options: LoadOptions) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if options.threads == 0 {
            return Err(EngineError::invalid("threads", "must be at least 1"));
        }
        let (file, content) = open_checked(&path)?;
        let TextFrontend {
            config,
            tokenizer,
            chat_template,
        } = TextFrontend::from_content(&content)?;

        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(options.threads)
            .thread_name(|i| format!("duet-engine-{i}"))
            .build()
            .map_err(|e| EngineError::invalid("threads", e.to_string()))?;

        let c = &config;
        let mut ld = Loader {
            content: &content,
            file,
            fp: Fingerprinter::default(),
        };
        let mode = options.weight_mode;
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let (layers, embed, out_norm, output) = pool.install(|| -> Result<_> {
            let mut layers = Vec::with_capacity(c.n_layers);
            for i in 0..c.n_layers {
                let p = |s: &str| format!("blk.{i}.{s}.weight");
                let wq = ld.matrix(&p("attn_q"), q_dim, c.hidden)?;
                let wk = ld.matrix(&p("attn_k"), kv_dim, c.hidden)?;
                let wv = ld.matrix(&p("attn_v"), kv_dim, c.hidden)?;
                let gate = ld.matrix(&p("ffn_gate"), c.ffn_hidden, c.hidden)?;
                let up = ld.matrix(&p("ffn_up"), c.ffn_hidden, c.hidden)?;
                let qk_norm = match c.arch.qk_norm {
                    true => Some((
                        ld.vector(&p("attn_q_norm"), c.head_dim)?,
                        ld.vector(&p("attn_k_norm"), c.head_dim)?,
                    )),
                    false => None,
                };
                let post_norms = match c.arch.post_norms {
                    true => Some((
                        ld.vector(&p("post_attention_norm"), c.hidden)?,
                        ld.vector(&p("post_ffw_norm"), c.hidden)?,
                    )),
                    false => None,
                };
                layers.push(Layer {
                    attn_norm: ld.vector(&p("attn_norm"), c.hidden)?,
                    wqkv: Projection::new(vec![wq, wk, wv], mode)?,
                    qk_norm,
                    wo: Linear::new(ld.matrix(&p("attn_output"), c.hidden, q_dim)?, mode)?,
                    post_norms,
                    ffn_norm: ld.vector(&p("ffn_norm"), c.hidden)?,
                    w_gate_up: Projection::new(vec![gate, up], mode)?,
                    w_down: Linear::new(ld.matrix(&p("ffn_down"), c.hidden, c.ffn_hidden)?, mode)?,
                });
            }
            let embed = ld.matrix("token_embd.weight", c.vocab_size, c.hidden)?;
            let out_norm = ld.vector("output_norm.weight", c.hidden)?;
            // Tied embeddings: without `output.weight` the embedding matrix doubles as the
            // output projection, whose quantized blocks then serve the embedding rows too
            // (the dense form alone keeps no blocks: it keeps its own copy).
            let (embed, output) = match content.tensor_infos.contains_key("output.weight") {
                true => {
                    let output = ld.matrix("output.weight", c.vocab_size, c.hidden)?;
                    (Some(embed), Linear::head(output, mode)?)
                }
                false if mode == WeightMode::Dense => {
                    let copy =
                        QWeight::new(embed.format, embed.data.clone(), embed.rows, embed.cols)?;
                    (Some(embed), Linear::head(copy, mode)?)
                }
                false => (None, Linear::head(embed, mode)?),
            };
            Ok((layers, embed, out_norm, output))
        })?;

        let fingerprint = ld.fp.finish(&config, &tokenizer);
        crate::heap::release_free_pages();
        Ok(Self {
            config,
            tokenizer,
            chat_template,
            embed,
            layers,
            out_norm,
            output,
            pool,
            fingerprint,
            options,
            path,
        })
    }

    /// Identity of architecture, dims, tokenizer and weights (hex).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn options(&self) -> LoadOptions {
        self.options
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The KV layout this model produces with the given block size and dtype.
    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> KvLayout {
        KvLayout {
            fingerprint: self.fingerprint.clone(),
            n_layers: self.config.n_layers,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
            dtype,
            groups: self.config.kv_groups(),
        }
    }

    /// Row `token` of the embedding matrix, dequantized into `out`.
    pub(crate) fn embedding_row(&self, token: usize, out: &mut [f32]) -> Result<()> {
        match &self.embed {
            Some(e) => {
                e.dequant_row(token, out);
                Ok(())
            }
            None => self.output.dequant_row(token, out),
        }
    }

    /// Bytes the weights occupy in memory.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.wqkv.resident_bytes()
                    + l.wo.resident_bytes()
                    + l.w_gate_up.resident_bytes()
                    + l.w_down.resident_bytes()
            })
            .sum();
        layers + self.embed.as_ref().map_or(0, |e| e.data.len()) + self.output.resident_bytes()
    }

    /// Weight bytes one decode step reads (the bandwidth model's numerator).
    pub fn weight_bytes_per_step(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.wqkv.bytes_per_step()
                    + l.wo.bytes_per_step()
                    + l.w_gate_up.bytes_per_step()
                    + l.w_down.bytes_per_step()
            })
            .sum();
        layers + self.output.bytes_per_step()
    }
}
