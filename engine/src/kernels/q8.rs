//! Integer dot products of quantized weights with 8-bit activations, the
//! way llama.cpp's CPU backend computes them: activations are quantized per
//! 32 values (`d = max|x| / 127`, `q = round_half_even(x * 127 / max|x|)`,
//! `s = d * sum(q)`, with `d` and `s` rounded to f16: the exact operations of
//! ggml's AVX2 `quantize_row_q8_1`, since one value rounded the other way
//! moves a matmul's output by ~1e-3), and a block's dot product is
//! `d_w * d_x * sum(q_w * q_x) (+ m_w * s_x for Q4_1)`.
//!
//! The integer sums are exact, so the result does not depend on how rows are
//! batched: a sequence gets the same logits alone or in a batch.

use half::f16;

use super::{BlockFormat, QK};

/// One activation row quantized to 8 bits.
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub q: Vec<i8>,
}

/// ggml's 8-bit scale of a 32-value block with largest magnitude `amax`:
/// `(d, id)` with `d = amax / 127` (stored as f16) and the multiplier
/// `id = 127 / amax` (not `1 / d`, which rounds differently).
#[inline]
pub fn scales(amax: f32) -> (f32, f32) {
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    (amax / 127.0, id)
}

impl Q8Row {
    pub fn quantize(x: &[f32]) -> Self {
        let n = x.len() / QK;
        let mut r = Q8Row {
            d: Vec::with_capacity(n),
            s: Vec::with_capacity(n),
            q: Vec::with_capacity(x.len()),
        };
        for blk in x.chunks_exact(QK) {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (d, id) = scales(amax);
            let mut sum = 0i32;
            for &v in blk {
                let q = (v * id).round_ties_even() as i32;
                sum += q;
                r.q.push(q as i8);
            }
            r.d.push(f16::from_f32(d).to_f32());
            r.s.push(f16::from_f32(sum as f32 * d).to_f32());
        }
        r
    }
}

/// Whether the integer path handles this weight format.
pub fn supported(fmt: BlockFormat) -> bool {
    matches!(fmt, BlockFormat::Q4_1 | BlockFormat::Q8_0)
}

/// `out[r] = dot(weight row, xs[r])` for up to 4 rows at a time.
pub fn dot_rows(fmt: BlockFormat, wrow: &[u8], xs: &[&Q8Row], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx2::available() {
            for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
                super::avx2::dot_rows(fmt, wrow, xs, out);
            }
            return;
        }
    }
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        *o = dot_scalar(fmt, wrow, x);
    }
}

/// Portable reference implementation (same integer sums, same scaling order).
pub fn dot_scalar(fmt: BlockFormat, wrow: &[u8], x: &Q8Row) -> f32 {
    let bb = fmt.block_bytes();
    let mut acc = 0f32;
    let mut summs = 0f32;
    for (i, blk) in wrow.chunks_exact(bb).enumerate() {
        let qx = &x.q[i * QK..(i + 1) * QK];
        let dw = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let isum: i32 = match fmt {
            BlockFormat::Q4_1 => {
                summs += f16::from_le_bytes([blk[2], blk[3]]).to_f32() * x.s[i];
                (0..QK / 2)
                    .map(|j| {
                        let b = blk[4 + j];
                        (b & 0x0f) as i32 * qx[j] as i32 + (b >> 4) as i32 * qx[j + QK / 2] as i32
                    })
                    .sum()
            }
            BlockFormat::Q8_0 => (0..QK)
                .map(|j| (blk[2 + j] as i8) as i32 * qx[j] as i32)
                .sum(),
            _ => 0,
        };
        acc = (dw * x.d[i]).mul_add(isum as f32, acc);
    }
    acc + summs
}
