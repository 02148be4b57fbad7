//! A linear layer `y = x W^T` whose weights are kept in the form each phase
//! wants (see [`WeightMode`]): quantized blocks with a fused
//! dequantize-and-dot kernel for the few rows of a decode step, dense f32 with
//! a GEMM for the many rows of a prefill.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::kernels::kdot::{self, Kernel};
use crate::kernels::kpanel::KPanels;
use crate::kernels::kquant::KFormat;
use crate::kernels::panel::{self, PANEL};
use crate::kernels::q0panel::Q0Panels;
use crate::kernels::q8::{self, Q8Batch, TILE};
use crate::kernels::q8k::{self, Q8KBlock, Q8KRows};
use crate::kernels::{self, BlockFormat, FUSED_MAX_ROWS, FUSED_MAX_ROWS_QUANTIZED_ONLY};

/// Which forms of the weights a model keeps in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum WeightMode {
    /// Quantized only: for Q4_1/Q8_0 the integer kernel at every batch size,
    /// which computes what llama.cpp's CPU backend computes, bit for bit (other
    /// formats expand to f32 for large batches). Least memory; the decode
    /// worker's form.
    Quantized,
    /// Dense f32 only: GEMM for every batch. The prefill worker's form.
    Dense,
    /// Both: the integer kernel for decode steps (any batch) and short prompt
    /// chunks, dense GEMM for long prompts. Fastest for a process that does
    /// both phases, at the cost of the f32 copy.
    #[default]
    Hybrid,
}

impl std::str::FromStr for WeightMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "quantized" => Ok(WeightMode::Quantized),
            "dense" => Ok(WeightMode::Dense),
            "hybrid" => Ok(WeightMode::Hybrid),
            other => Err(format!(
                "unknown weight mode `{other}` (quantized, dense, hybrid)"
            )),
        }
    }
}

/// Quantized (or raw f16/f32) weight rows.
pub struct QWeight {
    pub format: BlockFormat,
    pub data: Vec<u8>,
    pub rows: usize,
    pub cols: usize,
}

impl QWeight {
    pub fn new(format: BlockFormat, data: Vec<u8>, rows: usize, cols: usize) -> Result<Self> {
        let per_block = format.block_elems();
        if !cols.is_multiple_of(per_block) {
            return Err(EngineError::Unsupported(format!(
                "{} weight with {cols} columns (not a multiple of {per_block})",
                format.name()
            )));
        }
        let want = rows * cols / per_block * format.block_bytes();
        if data.len() != want {
            return Err(EngineError::Format(format!(
                "weight data is {} bytes, {rows}x{cols} {} needs {want}",
                data.len(),
                format.name()
            )));
        }
        Ok(Self {
            format,
            data,
            rows,
            cols,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        kernels::dequant_row(self.format, self.row(r), out);
    }

    /// The whole matrix as f32, row-major `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, o)| self.dequant_row(r, o));
        out
    }

    /// The same matrix expanded to f32 blocks.
    pub fn expanded(&self) -> Result<QWeight> {
        let v = self.dequantize();
        QWeight::new(
            BlockFormat::F32,
            bytemuck::cast_slice(&v).to_vec(),
            self.rows,
            self.cols,
        )
    }

    /// Stack several matrices with equal format and columns into one, so
    /// that e.g. Q, K and V are one matmul.
    pub fn concat(parts: Vec<QWeight>) -> Result<QWeight> {
        let first = parts
            .first()
            .ok_or_else(|| EngineError::Format("empty concat".into()))?;
        let (format, cols) = (first.format, first.cols);
        let mut rows = 0;
        let mut data = Vec::new();
        for p in parts {
            if p.format != format || p.cols != cols {
                return Err(EngineError::Format("cannot stack unlike weights".into()));
            }
            rows += p.rows;
            data.extend_from_slice(&p.data);
        }
        QWeight::new(format, data, rows, cols)
    }
}

/// Weights repacked into panels of 16 rows for the AVX-512 VNNI kernels, which serve every
/// row count: the K-quants' beside their GGUF blocks (kept for the portable kernels, should
/// a panel matmul decline), the 32-value formats' instead of them.
enum Panels {
    K(KPanels),
    Q0(Q0Panels),
}

impl Panels {
    fn build(q: &QWeight) -> Option<Self> {
        if !panel::available() {
            return None;
        }
        match q.format.kquant() {
            Some(k) => KPanels::build(k, &q.data, q.rows, q.row_bytes()).map(Panels::K),
            None if Q0Panels::worth_it(q.format) => {
                Q0Panels::build(q.format, &q.data, q.rows, q.row_bytes()).map(Panels::Q0)
            }
            None => None,
        }
    }

    fn resident_bytes(&self) -> usize {
        match self {
            Panels::K(p) => p.resident_bytes(),
            Panels::Q0(p) => p.resident_bytes(),
        }
    }
}

/// How the rows of one forward pick a layer's kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelRows {
    /// As a forward over `n` rows (at least the rows given) would, whose
    /// first row here is row `first` of that forward: the rows of a prompt's
    /// later chunk take the kernel a forward over the whole prompt takes, so
    /// the KV does not depend on the chunking. (`first` matters only where
    /// llama.cpp's kernel depends on a row's index: repacked Q4_K.)
    As { n: usize, first: usize },
    /// Decode steps, one row per sequence: with Q4_1/Q8_0 weights every row
    /// takes the integer kernel, as it does alone, so a sequence's logits do
    /// not depend on the batch it decodes in.
    Decode,
}

pub struct Linear {
    quantized: Option<QWeight>,
    /// Round activations to llama.cpp's 8-bit grid before multiplying.
    round_activations: bool,
    /// Dense `[out, in]` weights.
    dense: Option<Tensor>,
    /// The weights repacked into panels (with AVX-512 VNNI only).
    panels: Option<Box<Panels>>,
    pub out_dim: usize,
    pub in_dim: usize,
}

impl Linear {
    pub fn new(q: QWeight, mode: WeightMode) -> Result<Self> {
        Self::build(q, mode, true)
    }

    fn build(q: QWeight, mode: WeightMode, panels: bool) -> Result<Self> {
        let (out_dim, in_dim) = (q.rows, q.cols);
        let round_activations = q.format.quantizes_activations();
        let dense = match mode {
            WeightMode::Quantized => None,
            WeightMode::Dense | WeightMode::Hybrid => Some(Tensor::from_vec(
                q.dequantize(),
                (out_dim, in_dim),
                &Device::Cpu,
            )?),
        };
        let mut quantized = match mode {
            WeightMode::Dense => None,
            WeightMode::Quantized | WeightMode::Hybrid => Some(q),
        };
        let panels = quantized
            .as_ref()
            .filter(|_| panels)
            .and_then(Panels::build)
            .map(Box::new);
        // The 32-value formats' blocks would only hold memory beside their panels (the
        // K-quants keep theirs: see `Panels`).
        if let Some(Panels::Q0(_)) = panels.as_deref() {
            quantized = None;
        }
        Ok(Self {
            quantized,
            round_activations,
            dense,
            panels,
            out_dim,
            in_dim,
        })
    }

    /// The output head: as [`Self::new`], with panels only for Q8_0. A prompt multiplies
    /// only its last row by the head, but every decode step all of it: Q8_0's panels
    /// replace its blocks at 1.06x their memory and run a step's head faster than the
    /// tile kernel (with tied embeddings, [`Self::dequant_row`] reads the embedding rows
    /// from them). Other formats' panels would cost up to the size of the vocabulary-sized
    /// matrix again (the K-quants keep their blocks beside them).
    pub fn head(q: QWeight, mode: WeightMode) -> Result<Self> {
        let panels = q.format == BlockFormat::Q8_0;
        Self::build(q, mode, panels)
    }

    /// Row `r` of the matrix, dequantized (an embedding row of tied embeddings), from the
    /// blocks or, where they were dropped, from the panels: the same values either way.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        if let Some(q) = &self.quantized {
            q.dequant_row(r, out);
            return Ok(());
        }
        match self.panels.as_deref() {
            Some(Panels::Q0(p)) if p.dequant_row(r, out) => Ok(()),
            _ => Err(EngineError::Format(format!(
                "row {r} of a matrix without quantized blocks or dequantizable panels"
            ))),
        }
    }

    /// The quantized blocks this layer keeps (`None` in the dense form).
    pub fn quantized(&self) -> Option<&QWeight> {
        self.quantized.as_ref()
    }

    /// Bytes this layer keeps resident.
    pub fn resident_bytes(&self) -> usize {
        self.quantized.as_ref().map_or(0, |q| q.data.len())
            + self.panels.as_deref().map_or(0, Panels::resident_bytes)
            + self
                .dense
                .as_ref()
                .map_or(0, |_| self.out_dim * self.in_dim * 4)
    }

    /// Bytes read from the weights by one forward over a small batch.
    pub fn bytes_per_step(&self) -> usize {
        match (&self.quantized, self.panels.as_deref()) {
            (Some(q), _) => q.data.len(),
            (None, Some(p)) => p.resident_bytes(),
            (None, None) => self.out_dim * self.in_dim * 4,
        }
    }

    /// `x` is `[rows, in]` row-major; returns `[rows, out]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        self.forward_with(x, rows, KernelRows::As { n: rows, first: 0 })
    }

    /// [`Self::forward`], with the kernel chosen by `kernel` (see [`KernelRows`]).
    pub fn forward_with(&self, x: &[f32], rows: usize, kernel: KernelRows) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), rows * self.in_dim);
        // Without a dense copy, Q4_1/Q8_0 take the integer kernel at every batch
        // size: it computes what llama.cpp's CPU backend computes, bit for bit.
        // Other formats expand to f32 for prompt-sized batches. With a dense
        // copy, decode steps keep the integer kernel at any batch size too
        // (it is as fast as the GEMM there, and batch-invariant).
        let (rows_max, decode) = match kernel {
            KernelRows::As { n, .. } => (n.max(rows), false),
            KernelRows::Decode => (rows, true),
        };
        let integer = |f: BlockFormat| q8::supported(f) || f.kquant().is_some();
        let q0 = match self.panels.as_deref() {
            Some(Panels::Q0(p)) => Some(p),
            _ => None,
        };
        let format = self
            .quantized
            .as_ref()
            .map(|q| q.format)
            .or(q0.map(|p| p.fmt));
        let fused = match (&self.dense, format) {
            (Some(_), Some(f)) if decode && integer(f) => true,
            (Some(_), _) => rows_max <= FUSED_MAX_ROWS,
            (None, Some(f)) => integer(f) || rows_max <= FUSED_MAX_ROWS_QUANTIZED_ONLY,
            (None, None) => false,
        };
        if let (true, Some(p)) = (fused, q0) {
            return self.q0_matmul(p, &Q8Batch::quantize(x, self.in_dim));
        }
        if let Some(q) = &self.quantized {
            if let (true, Some(k)) = (fused, q.format.kquant()) {
                return Ok(self.k_matmul(q, k, x, rows, kernel));
            }
            if fused && q8::supported(q.format) {
                let acts = Q8Batch::quantize(x, self.in_dim);
                return Ok(self.q8_matmul(q, &acts));
            }
        }
        let rounded;
        let x = match self.round_activations {
            true => {
                let mut r = x.to_vec();
                match self.quantized.as_ref().and_then(|q| q.format.kquant()) {
                    Some(_) => q8k::round_to_grid(&mut r),
                    None => kernels::round_to_q8_grid(&mut r),
                }
                rounded = r;
                &rounded[..]
            }
            false => x,
        };
        match (&self.quantized, &self.dense) {
            (Some(q), _) if fused => {
                let xs: Vec<&[f32]> = x.chunks_exact(self.in_dim).collect();
                Ok(self.per_output_row(rows, |w, out| {
                    kernels::dot_rows(q.format, q.row(w), &xs, out)
                }))
            }
            (_, Some(w)) => gemm(x, rows, w, self.in_dim, self.out_dim),
            (Some(q), None) => {
                let w =
                    Tensor::from_vec(q.dequantize(), (self.out_dim, self.in_dim), &Device::Cpu)?;
                gemm(x, rows, &w, self.in_dim, self.out_dim)
            }
            (None, None) => Err(EngineError::Format("linear layer without weights".into())),
        }
    }

    /// `x W^T` with the integer kernel (see [`Self::by_output_runs`]).
    fn q8_matmul(&self, q: &QWeight, acts: &Q8Batch) -> Vec<f32> {
        self.by_output_runs(
            &q.data,
            q.row_bytes(),
            acts.rows,
            |_, w, rb, chunk, n_out| {
                for (ti, tile) in acts.tiles.iter().enumerate() {
                    let out = &mut chunk[ti * TILE * n_out..];
                    q8::dot_tile_rows(q.format, w, rb, tile, out, n_out);
                }
            },
        )
    }

    /// `x W^T` with the panel kernel of the 32-value formats (the same outputs as
    /// [`Self::q8_matmul`], bit for bit).
    fn q0_matmul(&self, p: &Q0Panels, acts: &Q8Batch) -> Result<Vec<f32>> {
        let pa = p.acts(acts);
        let y = self.panel_runs(acts.rows, |first, count, chunk, n_out| {
            p.matmul(first, count, &pa, chunk, n_out)
        });
        // `matmul` declines only for arguments that `Panels::build` and this layer fixed.
        y.ok_or_else(|| {
            EngineError::Format(format!(
                "the {} panel kernel declined a {}x{} matmul of {} rows",
                p.fmt.name(),
                self.out_dim,
                self.in_dim,
                acts.rows
            ))
        })
    }

    /// [`Self::by_output_runs`] over panels: `run(first, count, out, n_out)` multiplies the
    /// panels `first..first + count` (the task's output features); `None` if any task's
    /// kernel declined.
    fn panel_runs(
        &self,
        rows: usize,
        run: impl Fn(usize, usize, &mut [f32], usize) -> bool + Sync,
    ) -> Option<Vec<f32>> {
        let done = AtomicBool::new(true);
        let y = self.by_output_runs(&[], 0, rows, |o0, _, _, chunk, n_out| {
            if !run(o0 / PANEL, n_out / PANEL, chunk, n_out) {
                done.store(false, Ordering::Relaxed);
            }
        });
        done.into_inner().then_some(y)
    }

    /// `x W^T` for `rows` activation rows, in parallel tasks that each own a
    /// run of output features: `run(o0, w, row_bytes, out, n_out)` gets the run's
    /// first feature and weight rows and fills `out[r * n_out + j]`, meeting every activation
    /// row with them, so the activations stay in L1 while the run's weights
    /// come from L2. A task's results are row-major within the task, so the
    /// final layout is one contiguous copy per (task, row).
    fn by_output_runs(
        &self,
        data: &[u8],
        rb: usize,
        rows: usize,
        run: impl Fn(usize, &[u8], usize, &mut [f32], usize) + Sync,
    ) -> Vec<f32> {
        const OUT_PER_TASK: usize = 64;
        let mut t = vec![0f32; self.out_dim * rows];
        t.par_chunks_mut(OUT_PER_TASK * rows)
            .enumerate()
            .for_each(|(task, chunk)| {
                let o0 = task * OUT_PER_TASK;
                let n_out = chunk.len() / rows;
                let w = data.get(o0 * rb..(o0 + n_out) * rb).unwrap_or_default();
                run(o0, w, rb, chunk, n_out);
            });
        self.untile(t, rows, OUT_PER_TASK)
    }

    /// Row-major `[rows][out]` from per-task runs of `per_task` output
    /// features, each `[rows][n_out]` row-major.
    fn untile(&self, t: Vec<f32>, rows: usize, per_task: usize) -> Vec<f32> {
        if rows == 1 {
            return t;
        }
        let mut y = vec![0f32; rows * self.out_dim];
        for (task, chunk) in t.chunks(per_task * rows).enumerate() {
            let (o0, n_out) = (task * per_task, chunk.len() / rows);
            for (r, src) in chunk.chunks_exact(n_out).enumerate() {
                y[r * self.out_dim + o0..r * self.out_dim + o0 + n_out].copy_from_slice(src);
            }
        }
        y
    }

    /// `x W^T` with the K-quant integer kernels, each row computed as the
    /// kernel llama.cpp would pick for it (see [`Kernel::choose`]).
    fn k_matmul(
        &self,
        q: &QWeight,
        k: KFormat,
        x: &[f32],
        rows: usize,
        kernel: KernelRows,
    ) -> Vec<f32> {
        let acts = Q8KRows::quantize(x, self.in_dim);
        let refs: Vec<&[Q8KBlock]> = (0..rows).map(|r| acts.row(r)).collect();
        let out_rows = self.out_dim;
        let choose = |r: usize| match kernel {
            KernelRows::Decode => Kernel::choose(k, out_rows, 1, 0),
            KernelRows::As { n, first } => Kernel::choose(k, out_rows, n.max(rows), first + r),
        };
        let kinds: Vec<Kernel> = (0..rows).map(choose).collect();
        let panels = match self.panels.as_deref() {
            Some(Panels::K(p)) if KPanels::takes(&kinds) => Some(p),
            _ => None,
        };
        // `matmul` declines only for arguments checked above; should it, the portable
        // kernels compute the whole matmul again.
        let by_panels = panels.and_then(|p| {
            self.panel_runs(rows, |first, count, chunk, n_out| {
                p.matmul(first, count, &refs, &kinds, chunk, n_out)
            })
        });
        if let Some(y) = by_panels {
            return y;
        }
        self.by_output_runs(&q.data, q.row_bytes(), rows, |_, w, rb, chunk, n_out| {
            kdot::dot_rows(k, w, rb, &refs, |r| kinds[r], chunk, n_out)
        })
    }

    /// Runs `dot(w, out)` for every output feature `w` in parallel, where
    /// `out` receives that feature's value for each of the `rows`.
    fn per_output_row(&self, rows: usize, dot: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
        // Column-major result: each task owns a run of output features.
        const OUT_PER_TASK: usize = 64;
        let mut t = vec![0f32; self.out_dim * rows];
        t.par_chunks_mut(OUT_PER_TASK * rows)
            .enumerate()
            .for_each(|(task, chunk)| {
                let o0 = task * OUT_PER_TASK;
                for (i, out) in chunk.chunks_exact_mut(rows).enumerate() {
                    dot(o0 + i, out);
                }
            });
        transpose(t, rows, self.out_dim)
    }
}

/// `[out_dim][rows]` (one run per output feature) to row-major `[rows][out_dim]`.
fn transpose(t: Vec<f32>, rows: usize, out_dim: usize) -> Vec<f32> {
    if rows == 1 {
        return t;
    }
    // 64 x 64 tiles: both sides stay in L1.
    const T: usize = 64;
    let mut y = vec![0f32; rows * out_dim];
    for o0 in (0..out_dim).step_by(T) {
        for r0 in (0..rows).step_by(T) {
            for o in o0..(o0 + T).min(out_dim) {
                for r in r0..(r0 + T).min(rows) {
                    y[r * out_dim + o] = t[o * rows + r];
                }
            }
        }
    }
    y
}

fn gemm(x: &[f32], rows: usize, w: &Tensor, in_dim: usize, out_dim: usize) -> Result<Vec<f32>> {
    let xt = Tensor::from_slice(x, (rows, in_dim), &Device::Cpu)?;
    let y = xt.matmul(&w.t()?)?;
    debug_assert_eq!(y.dims(), &[rows, out_dim]);
    Ok(y.flatten_all()?.to_vec1::<f32>()?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::kernels::panel::{test_bytes, test_values};

    /// A Q8_0 head on panels (its blocks dropped where the CPU has the kernel) gives the
    /// logits of the same head without panels and the blocks' embedding rows, bit for bit.
    #[test]
    fn a_q8_0_head_on_panels_keeps_its_logits_and_embedding_rows() {
        let (rows, cols) = (48, 96);
        let mut data = test_bytes(rows * cols / 32 * 34, 11);
        for (k, blk) in data.chunks_exact_mut(34).enumerate() {
            let d = half::f16::from_f32(0.002 + 0.0005 * (k % 13) as f32);
            blk[0..2].copy_from_slice(&d.to_le_bytes());
        }
        let q = || QWeight::new(BlockFormat::Q8_0, data.clone(), rows, cols).unwrap();
        let head = Linear::head(q(), WeightMode::Quantized).unwrap();
        let plain = Linear::build(q(), WeightMode::Quantized, false).unwrap();
        assert_eq!(
            head.quantized().is_none(),
            panel::available(),
            "with AVX-512 VNNI the head's panels replace its blocks"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in [1, 3] {
            let x = test_values(n * cols, n as u32);
            for kernel in [KernelRows::Decode, KernelRows::As { n, first: 0 }] {
                let got = head.forward_with(&x, n, kernel).unwrap();
                let want = plain.forward_with(&x, n, kernel).unwrap();
                assert_eq!(bits(&got), bits(&want), "{n} rows, {kernel:?}");
            }
        }
        for r in [0, 17, 47] {
            let (mut got, mut want) = (vec![f32::NAN; cols], vec![0f32; cols]);
            head.dequant_row(r, &mut got).unwrap();
            q().dequant_row(r, &mut want);
            assert_eq!(bits(&got), bits(&want), "embedding row {r}");
        }
    }
}
