//! Integer dot products of quantized weights with 8-bit activations, the
//! way llama.cpp's CPU backend computes them: activations are quantized per
//! 32 values (`d = max|x| / 127`, `q = round_half_even(x * 127 / max|x|)`,
//! `s = d * sum(q)`, with `d` and `s` rounded to f16: the exact operations of
//! ggml's AVX2 `quantize_row_q8_1`, since one value rounded the other way
//! moves a matmul's output by ~1e-3), and a block's dot product is
//! `d_w * d_x * sum(q_w * q_x) (+ m_w * s_x for Q4_1)`, accumulated per
//! (weight row, activation row) in ggml's 8 lanes.
//!
//! Activations are laid out in tiles of up to [`TILE`] rows so that one
//! weight block, unpacked once, meets every row of a tile while both sit in
//! registers and L1. Each output is still its own chain of the same
//! operations, so the result does not depend on how rows are batched or
//! tiled: a sequence gets the same logits alone or in a batch.

use half::f16;

use super::{BlockFormat, QK};

/// Activation rows per tile: 8 accumulators plus the weight block and
/// temporaries fill AVX2's 16 vector registers.
pub const TILE: usize = 8;

/// Up to [`TILE`] activation rows quantized to 8 bits, interleaved by block.
#[derive(Debug, Clone, Default)]
pub struct Q8Tile {
    /// Rows in this tile, 1..=[`TILE`].
    pub rows: usize,
    /// Blocks per row.
    pub blocks: usize,
    /// Block `b` of row `r` is `q[(b * rows + r) * QK..][..QK]`.
    pub q: Vec<i8>,
    /// Scale of block `b` of row `r` at `d[b * TILE + r]` (0 past `rows`).
    pub d: Vec<f32>,
    /// `d * sum(q)` of block `b` of row `r` at `s[b * TILE + r]` (0 past `rows`).
    pub s: Vec<f32>,
}

/// A batch of activation rows, tiled.
#[derive(Debug, Clone, Default)]
pub struct Q8Batch {
    pub rows: usize,
    pub tiles: Vec<Q8Tile>,
}

/// ggml's 8-bit scale of a 32-value block with largest magnitude `amax`:
/// `(d, id)` with `d = amax / 127` (stored as f16) and the multiplier
/// `id = 127 / amax` (not `1 / d`, which rounds differently).
#[inline]
pub fn scales(amax: f32) -> (f32, f32) {
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    (amax / 127.0, id)
}

/// Quantize one block of [`QK`] values into `q`; returns `(d, s)` as f16 values.
fn quantize_block(blk: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (d, id) = scales(amax);
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(blk) {
        let v = (v * id).round_ties_even() as i32;
        sum += v;
        *o = v as i8;
    }
    (
        f16::from_f32(d).to_f32(),
        f16::from_f32(sum as f32 * d).to_f32(),
    )
}

impl Q8Batch {
    /// Quantize `x`, row-major rows of `cols` values (a multiple of [`QK`]).
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let nb = cols / QK;
        let rows = x.len() / cols;
        let tiles = x
            .chunks(TILE * cols)
            .map(|tx| {
                let tr = tx.len() / cols;
                let mut t = Q8Tile {
                    rows: tr,
                    blocks: nb,
                    q: vec![0; nb * tr * QK],
                    d: vec![0.0; nb * TILE],
                    s: vec![0.0; nb * TILE],
                };
                for (r, row) in tx.chunks_exact(cols).enumerate() {
                    for (b, blk) in row.chunks_exact(QK).enumerate() {
                        let at = (b * tr + r) * QK;
                        let (d, s) = quantize_block(blk, &mut t.q[at..at + QK]);
                        t.d[b * TILE + r] = d;
                        t.s[b * TILE + r] = s;
                    }
                }
                t
            })
            .collect();
        Q8Batch { rows, tiles }
    }
}

/// Whether the integer path handles this weight format.
pub fn supported(fmt: BlockFormat) -> bool {
    matches!(
        fmt,
        BlockFormat::Q4_0
            | BlockFormat::Q4_1
            | BlockFormat::Q5_0
            | BlockFormat::Q5_1
            | BlockFormat::Q8_0
    )
}

/// `out[r * stride + j] = dot(weight row j, row r of the tile)` for the
/// weight rows `w[j * row_bytes..][..row_bytes]` and the tile's rows.
pub fn dot_tile_rows(
    fmt: BlockFormat,
    w: &[u8],
    row_bytes: usize,
    t: &Q8Tile,
    out: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::dot_tile_rows(fmt, w, row_bytes, t, out, stride) {
        return;
    }
    for (j, row) in w.chunks_exact(row_bytes).enumerate() {
        for r in 0..t.rows {
            out[r * stride + j] = dot_scalar(fmt, row, t, r);
        }
    }
}

/// Portable reference implementation (same integer sums, same scaling order).
pub fn dot_scalar(fmt: BlockFormat, wrow: &[u8], t: &Q8Tile, r: usize) -> f32 {
    let bb = fmt.block_bytes();
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (i, blk) in wrow.chunks_exact(bb).enumerate().take(t.blocks) {
        let at = (i * t.rows + r) * QK;
        let qx = &t.q[at..at + QK];
        let (dx, sx) = (t.d[i * TILE + r], t.s[i * TILE + r]);
        let dw = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        // Lane l of ggml's accumulator sums products 4l..4l+4 of the
        // block's 32 values in element order.
        let prods: [i32; QK] = match fmt {
            BlockFormat::Q4_1 | BlockFormat::Q5_1 => {
                summs += f16::from_le_bytes([blk[2], blk[3]]).to_f32() * sx;
                let w = super::unsigned_codes(fmt, blk);
                std::array::from_fn(|j| w[j] as i32 * qx[j] as i32)
            }
            _ => {
                let w = super::signed_weights(fmt, blk);
                std::array::from_fn(|j| w[j] as i32 * qx[j] as i32)
            }
        };
        let scale = dw * dx;
        for (l, a) in acc.iter_mut().enumerate() {
            let lane: i32 = prods[4 * l..4 * l + 4].iter().sum();
            *a = scale.mul_add(lane as f32, *a);
        }
    }
    super::ggml::hsum8(&acc) + summs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(fmt: BlockFormat, nb: usize, seed: u32) -> Vec<u8> {
        let mut state = seed;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 24) as u8
        };
        let mut w = Vec::new();
        for _ in 0..nb {
            let d = f16::from_f32(0.01 + f32::from(next()) * 1e-4);
            w.extend_from_slice(&d.to_le_bytes());
            let rest = match fmt {
                BlockFormat::Q4_1 => {
                    w.extend_from_slice(&f16::from_f32(-0.05).to_le_bytes());
                    16
                }
                _ => 32,
            };
            for _ in 0..rest {
                w.push(next());
            }
        }
        w
    }

    #[test]
    fn every_tile_size_gives_each_row_its_own_dot_product() {
        let nb = 6;
        let cols = nb * QK;
        let x: Vec<f32> = (0..19 * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        for fmt in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let w = weights(fmt, nb, 7);
            let batch = Q8Batch::quantize(&x, cols);
            assert_eq!(batch.tiles.len(), 3);
            let mut all = Vec::new();
            for t in &batch.tiles {
                let mut out = vec![0f32; t.rows];
                dot_tile_rows(fmt, &w, w.len(), t, &mut out, 1);
                for (r, &o) in out.iter().enumerate() {
                    assert_eq!(o, dot_scalar(fmt, &w, t, r), "{fmt:?} row {r}");
                }
                all.extend(out);
            }
            // The same row alone (a tile of one) gives the same bits.
            for (r, row) in x.chunks_exact(cols).enumerate() {
                let one = Q8Batch::quantize(row, cols);
                let mut o = [0f32];
                dot_tile_rows(fmt, &w, w.len(), &one.tiles[0], &mut o, 1);
                assert_eq!(o[0], all[r], "{fmt:?} row {r} alone");
            }
            // And the value is the dot product of the dequantized operands.
            let mut wf = vec![0f32; cols];
            super::super::dequant_row(fmt, &w, &mut wf);
            let naive: f32 = wf.iter().zip(&x[..cols]).map(|(a, b)| a * b).sum();
            assert!(
                (naive - all[0]).abs() < 0.02 * naive.abs().max(1.0),
                "{naive} vs {}",
                all[0]
            );
        }
    }
}
