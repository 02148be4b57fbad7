//! Projections that read one input and whose outputs the forward pass reads as one row:
//! Q|K|V, gate|up. Consecutive weights of one format are stacked into one matmul (one pass
//! over the activations); a weight of another format (Gemma 3 Q4_K_M: Q5_0 queries and
//! keys, Q8_0 values) starts a matmul of its own, in its own kernel, and the outputs are
//! interleaved row by row, so no weight is ever expanded to f32 for the sake of stacking.

use crate::error::Result;
use crate::linear::{KernelRows, Linear, QWeight, WeightMode};

/// One matmul per run of same-format weights, in order (one in the common case).
pub(crate) struct Projection {
    runs: Vec<Linear>,
}

impl Projection {
    pub(crate) fn new(parts: Vec<QWeight>, mode: WeightMode) -> Result<Self> {
        let mut groups: Vec<Vec<QWeight>> = Vec::new();
        for q in parts {
            match groups.last_mut() {
                Some(g) if g[0].format == q.format => g.push(q),
                _ => groups.push(vec![q]),
            }
        }
        let runs = groups
            .into_iter()
            .map(|g| Linear::new(QWeight::concat(g)?, mode))
            .collect::<Result<_>>()?;
        Ok(Self { runs })
    }

    /// `x` is `[rows, in]`; returns `[rows, sum of the parts' outputs]`.
    pub(crate) fn forward_with(&self, x: &[f32], rows: usize, k: KernelRows) -> Result<Vec<f32>> {
        if let [one] = self.runs.as_slice() {
            return one.forward_with(x, rows, k);
        }
        let width: usize = self.runs.iter().map(|p| p.out_dim).sum();
        let mut out = vec![0f32; rows * width];
        let mut offset = 0;
        for p in &self.runs {
            let y = p.forward_with(x, rows, k)?;
            for (o, yr) in out.chunks_exact_mut(width).zip(y.chunks_exact(p.out_dim)) {
                o[offset..offset + p.out_dim].copy_from_slice(yr);
            }
            offset += p.out_dim;
        }
        Ok(out)
    }

    pub(crate) fn resident_bytes(&self) -> usize {
        self.runs.iter().map(Linear::resident_bytes).sum()
    }

    pub(crate) fn bytes_per_step(&self) -> usize {
        self.runs.iter().map(Linear::bytes_per_step).sum()
    }
}
