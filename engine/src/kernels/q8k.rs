//! Activations quantized to ggml's Q8_K (256 values per block), the form
//! every K-quant dot product multiplies.
//!
//! Exactly ggml's `quantize_row_q8_K_ref`, which is also what its x86 CPU
//! backend runs (`docs/research/ggml-kquants.md` §2):
//! - `max` is the signed value of the first element of largest magnitude;
//! - `iscale = -127 / max` (f32), `q = min(127, round_half_even(iscale * x))`
//!   with the product rounded first (ggml-base is built without FMA);
//! - `d = 1 / iscale` (f32, negative when `max > 0`), never rounded to f16;
//! - `bsums[j]` is the sum of the 16 codes `16j..16j+16`;
//! - an all-zero block has `d = 0`, zero codes and zero sums.
//!
//! ggml's 4-row repacking quantizer (used by its Q4_K GEMM) can negate a
//! whole block's codes, sums and `d` together; every kernel multiplies `d`
//! by an integer linear in them, so the products are the same bits.

use super::kquant::QK_K;

/// One quantized activation block.
#[derive(Debug, Clone, Copy)]
pub struct Q8KBlock {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// Quantizes one block of [`QK_K`] values.
pub fn quantize_block(x: &[f32], out: &mut Q8KBlock) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *out = Q8KBlock::default();
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in out.qs.iter_mut().zip(x) {
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    for (s, q) in out.bsums.iter_mut().zip(out.qs.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    out.d = 1.0 / iscale;
}

/// Rows of activations, each a run of Q8_K blocks.
#[derive(Debug, Clone, Default)]
pub struct Q8KRows {
    pub rows: usize,
    /// Blocks per row.
    pub blocks: usize,
    /// Block `b` of row `r` at `data[r * blocks + b]`.
    pub data: Vec<Q8KBlock>,
}

impl Q8KRows {
    /// Quantizes `x`, row-major rows of `cols` values (a multiple of [`QK_K`]).
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let blocks = cols / QK_K;
        let rows = x.len().checked_div(cols).unwrap_or(0);
        let mut data = vec![Q8KBlock::default(); rows * blocks];
        for (o, v) in data.iter_mut().zip(x.chunks_exact(QK_K)) {
            quantize_block(v, o);
        }
        Self { rows, blocks, data }
    }

    pub fn row(&self, r: usize) -> &[Q8KBlock] {
        &self.data[r * self.blocks..(r + 1) * self.blocks]
    }
}

/// Rounds activations to the Q8_K grid (`q * d` per 256 values), so a dense
/// GEMM sees the values the K-quant integer kernels multiply.
pub fn round_to_grid(x: &mut [f32]) {
    let mut b = Q8KBlock::default();
    for v in x.chunks_exact_mut(QK_K) {
        quantize_block(v, &mut b);
        for (y, &q) in v.iter_mut().zip(&b.qs) {
            *y = q as f32 * b.d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_follows_ggml_reference_rules() {
        let mut x: Vec<f32> = (0..QK_K)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.031)
            .collect();
        // The largest magnitude appears twice with opposite signs: the first wins.
        x[3] = -2.5;
        x[200] = 2.5;
        let mut b = Q8KBlock::default();
        quantize_block(&x, &mut b);
        let iscale = -127.0f32 / -2.5;
        assert_eq!(b.d, 1.0 / iscale);
        assert_eq!(b.qs[3], -127);
        assert_eq!(b.qs[200], 127);
        for (i, &v) in x.iter().enumerate() {
            assert_eq!(b.qs[i] as f32, (iscale * v).round_ties_even().min(127.0));
        }
        for j in 0..16 {
            let s: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
            assert_eq!(b.bsums[j] as i32, s);
        }
        // Positive maximum: d is negative and the maximum maps to -127.
        let y: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        quantize_block(&y, &mut b);
        assert!(b.d < 0.0);
        assert_eq!(b.qs[3], -127);
        // Ties round to even.
        let mut t = vec![0f32; QK_K];
        t[0] = -127.0;
        t[1] = 2.5;
        t[2] = 3.5;
        quantize_block(&t, &mut b);
        assert_eq!((b.qs[1], b.qs[2]), (2, 4));
        // Zero blocks have zero scale and sums.
        quantize_block(&[0.0; QK_K], &mut b);
        assert_eq!(b.d, 0.0);
        assert!(b.qs.iter().all(|&q| q == 0) && b.bsums.iter().all(|&s| s == 0));
    }
}
