//! Projections that read one input and whose outputs the forward pass reads as one row:
//! Q|K|V, gate|up. Weights of one format are stacked into one matmul (one pass over the
//! activations); weights of different formats (Gemma 3 Q4_K_M: Q5_0 queries and keys,
//! Q8_0 values) each keep their own kernel, and their outputs are interleaved row by row,
//! so no weight is ever expanded to f32 for the sake of stacking.

use crate::error::Result;
use crate::linear::{KernelRows, Linear, QWeight, WeightMode};

pub(crate) enum Projection {
    Stacked(Linear),
    Parts(Vec<Linear>),
}

impl Projection {
    pub(crate) fn new(parts: Vec<QWeight>, mode: WeightMode) -> Result<Self> {
        let same = parts.windows(2).all(|w| w[0].format == w[1].format);
        Ok(match same {
            true => Self::Stacked(Linear::new(QWeight::concat(parts)?, mode)?),
            false => Self::Parts(
                parts
                    .into_iter()
                    .map(|q| Linear::new(q, mode))
                    .collect::<Result<_>>()?,
            ),
        })
    }

    fn parts(&self) -> &[Linear] {
        match self {
            Self::Stacked(l) => std::slice::from_ref(l),
            Self::Parts(p) => p,
        }
    }

    /// `x` is `[rows, in]`; returns `[rows, sum of the parts' outputs]`.
    pub(crate) fn forward_with(&self, x: &[f32], rows: usize, k: KernelRows) -> Result<Vec<f32>> {
        let parts = match self {
            Self::Stacked(l) => return l.forward_with(x, rows, k),
            Self::Parts(p) => p,
        };
        let width: usize = parts.iter().map(|p| p.out_dim).sum();
        let mut out = vec![0f32; rows * width];
        let mut offset = 0;
        for p in parts {
            let y = p.forward_with(x, rows, k)?;
            for (o, yr) in out.chunks_exact_mut(width).zip(y.chunks_exact(p.out_dim)) {
                o[offset..offset + p.out_dim].copy_from_slice(yr);
            }
            offset += p.out_dim;
        }
        Ok(out)
    }

    pub(crate) fn resident_bytes(&self) -> usize {
        self.parts().iter().map(Linear::resident_bytes).sum()
    }

    pub(crate) fn bytes_per_step(&self) -> usize {
        self.parts().iter().map(Linear::bytes_per_step).sum()
    }
}
