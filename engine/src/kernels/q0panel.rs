//! The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) repacked into panels of [`PANEL`]
//! weight rows for matmuls of any row count, and the safe entry to their kernel
//! ([`super::avx512_q0panel`]).
//!
//! Why: the tile kernel of [`super::q8`] holds one weight row against up to 8 activation
//! rows with AVX2 (`maddubs`, `madd`, a sign trick for signed codes); Gemma 3's Q5_0
//! matrices, two thirds of its multiply-adds, ran at 1.35x llama.cpp's time. Here 16 weight
//! rows sit in the 16 i32 lanes of an AVX-512 register, four values each, and one VNNI
//! `vpdpbusd` forms ggml's 4-value integer lane for all 16 rows at once.
//!
//! Invariants:
//! - codes are stored unsigned (`Q4_0` nibble, `Q5_0` nibble plus fifth bit, `Q8_0` code
//!   plus 128, `Q4_1`/`Q5_1` as they are): the code of row `16p+j`, value `4g+k` of block
//!   `b` is `codes[((p*blocks + b)*8 + g)*64 + 4j + k]`; each format's offset (8, 16, 128)
//!   is taken out exactly with the activations' 4-value sums ([`Q0Acts`]), so every lane
//!   holds the exact integer of ggml's `ggml_vec_dot_q*_q8_*` lane;
//! - per (panel, block) the 16 rows' `d` (and `m` for Q4_1/Q5_1) as f32;
//! - each output is then the float chain of the tile kernel (`kernels/avx2.rs::tile`): per
//!   block `acc[l] = fma(d_w * d_x, lane[l], acc[l])` for its 8 lanes, `summs += m_w * s_x`
//!   unfused, and at the end ggml's `hsum_float_8` of the lanes plus `summs`; equal to the
//!   tile kernel's bit for bit (tested below).

use half::f16;

use super::panel::{self, available, PANEL};
use super::q8::{Q8Batch, TILE};
use super::{BlockFormat, QK};

/// Code bytes per (panel, block).
pub const CODE_BYTES: usize = QK * PANEL;

/// One matrix of a 32-value format in panels (see the module's invariants).
#[derive(Debug, Clone)]
pub struct Q0Panels {
    pub fmt: BlockFormat,
    pub rows: usize,
    /// Blocks per weight row.
    pub blocks: usize,
    pub codes: Vec<u8>,
    pub d: Vec<f32>,
    /// Q4_1/Q5_1's minimums (empty for the others).
    pub m: Vec<f32>,
}

/// The activations of one matmul as the panel kernel reads them: the tiles of a
/// [`Q8Batch`] and, per (tile, block, row), eight corrections `-offset * sum(q[4g..4g+4])`.
pub struct Q0Acts<'a> {
    pub batch: &'a Q8Batch,
    /// Tile `t`, block `b`, row `r`, group `g` at `corr[t][(b * rows + r) * 8 + g]`.
    pub corr: Vec<Vec<i32>>,
}

/// The unsigned code offset of a format (what its stored code exceeds the signed value by).
fn offset(fmt: BlockFormat) -> i32 {
    match fmt {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q5_0 => 16,
        BlockFormat::Q8_0 => 128,
        _ => 0,
    }
}

/// Whether the format has a per-block minimum.
pub fn has_min(fmt: BlockFormat) -> bool {
    matches!(fmt, BlockFormat::Q4_1 | BlockFormat::Q5_1)
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// One block's unsigned codes in element order, its `d` and its minimum (0 if none).
fn unpack(fmt: BlockFormat, blk: &[u8], q: &mut [u8; QK]) -> (f32, f32) {
    let nib = |ql: &[u8], q: &mut [u8; QK]| {
        for i in 0..16 {
            q[i] = ql[i] & 0x0f;
            q[i + 16] = ql[i] >> 4;
        }
    };
    let fifth = |qh: &[u8], q: &mut [u8; QK]| {
        let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
        for (j, v) in q.iter_mut().enumerate() {
            *v |= (((h >> j) & 1) as u8) << 4;
        }
    };
    match fmt {
        BlockFormat::Q4_0 => {
            nib(&blk[2..18], q);
            (f16_at(blk, 0), 0.0)
        }
        BlockFormat::Q4_1 => {
            nib(&blk[4..20], q);
            (f16_at(blk, 0), f16_at(blk, 2))
        }
        BlockFormat::Q5_0 => {
            nib(&blk[6..22], q);
            fifth(&blk[2..6], q);
            (f16_at(blk, 0), 0.0)
        }
        BlockFormat::Q5_1 => {
            nib(&blk[8..24], q);
            fifth(&blk[4..8], q);
            (f16_at(blk, 0), f16_at(blk, 2))
        }
        _ => {
            for (v, &b) in q.iter_mut().zip(&blk[2..34]) {
                *v = b ^ 0x80;
            }
            (f16_at(blk, 0), 0.0)
        }
    }
}

impl Q0Panels {
    /// Whether a matrix of this format is worth repacking: the 5- and 8-bit formats, whose
    /// codes grow by at most 1.8x as bytes (Gemma 3's Q5_0 and Q8_0 matrices). Q4_0 and
    /// Q4_1 codes would grow 2x and 1.6x for a model whose matrices are nearly all of them
    /// (the default SmolLM2), which the tile kernel already runs faster than llama.cpp.
    pub fn worth_it(fmt: BlockFormat) -> bool {
        matches!(
            fmt,
            BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q8_0
        )
    }

    /// Row `r` dequantized into `out` (`blocks * 32` values) as [`super::dequant_row`] gives
    /// it from the GGUF blocks, bit for bit: `(code - offset) as f32 * d`. `false` (nothing
    /// written) for the formats with a minimum, or when `r` or `out` is out of range.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) -> bool {
        if has_min(self.fmt) || r >= self.rows || out.len() != self.blocks * QK {
            return false;
        }
        let (p, j) = (r / PANEL, r % PANEL);
        let off = offset(self.fmt);
        for (b, o) in out.chunks_exact_mut(QK).enumerate() {
            let pb = p * self.blocks + b;
            let d = self.d[pb * PANEL + j];
            let codes = &self.codes[pb * CODE_BYTES..(pb + 1) * CODE_BYTES];
            for (v, x) in o.iter_mut().enumerate() {
                let code = codes[(v / 4) * 64 + 4 * j + v % 4];
                *x = (code as i32 - off) as f32 * d;
            }
        }
        true
    }

    /// Repacks `rows` weight rows of `row_bytes` each (any 32-value format); `None` for
    /// other formats, when `rows` is not a multiple of [`PANEL`], or when the data does
    /// not hold them.
    pub fn build(fmt: BlockFormat, data: &[u8], rows: usize, row_bytes: usize) -> Option<Self> {
        if !super::q8::supported(fmt) {
            return None;
        }
        let bb = fmt.block_bytes();
        let blocks = panel::blocks_per_row(rows, row_bytes, bb, data.len())?;
        let pbs = rows / PANEL * blocks;
        let mut p = Self {
            fmt,
            rows,
            blocks,
            codes: vec![0; pbs * CODE_BYTES],
            d: vec![0.0; pbs * PANEL],
            m: if has_min(fmt) {
                vec![0.0; pbs * PANEL]
            } else {
                Vec::new()
            },
        };
        let mut q = [0u8; QK];
        for (r, row) in data.chunks_exact(row_bytes).enumerate() {
            let (pn, j) = (r / PANEL, r % PANEL);
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let (d, m) = unpack(fmt, blk, &mut q);
                let pb = pn * blocks + b;
                panel::interleave(&mut p.codes[pb * CODE_BYTES..], j, &q);
                p.d[pb * PANEL + j] = d;
                if let Some(v) = p.m.get_mut(pb * PANEL + j) {
                    *v = m;
                }
            }
        }
        Some(p)
    }

    /// Number of panels.
    pub fn panels(&self) -> usize {
        self.rows / PANEL
    }

    /// Bytes this repacked copy holds.
    pub fn resident_bytes(&self) -> usize {
        self.codes.len() + 4 * (self.d.len() + self.m.len())
    }

    /// The activations of `batch` with this format's corrections.
    pub fn acts<'a>(&self, batch: &'a Q8Batch) -> Q0Acts<'a> {
        let off = offset(self.fmt);
        let corr = batch
            .tiles
            .iter()
            .map(|t| {
                let mut c = vec![0i32; t.blocks * t.rows * 8];
                if off != 0 {
                    for (i, v) in c.iter_mut().enumerate() {
                        let q = &t.q[i * 4..i * 4 + 4];
                        *v = -off * q.iter().map(|&x| x as i32).sum::<i32>();
                    }
                }
                c
            })
            .collect();
        Q0Acts { batch, corr }
    }

    /// `out[r * stride + 16 * (p - first) + j]` = weight row `16p + j` times activation row
    /// `r`, for the panels `first..first + count`. `false` (nothing written) when this CPU
    /// lacks the kernel or the arguments do not fit.
    pub fn matmul(
        &self,
        first: usize,
        count: usize,
        acts: &Q0Acts<'_>,
        out: &mut [f32],
        stride: usize,
    ) -> bool {
        let rows = acts.batch.rows;
        let ok = available()
            && first + count <= self.panels()
            && acts.corr.len() == acts.batch.tiles.len()
            && acts.batch.tiles.iter().all(|t| t.blocks == self.blocks)
            && (rows == 0 || out.len() >= (rows - 1) * stride + count * PANEL);
        if !ok {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            for (ti, (t, corr)) in acts.batch.tiles.iter().zip(&acts.corr).enumerate() {
                for p in first..first + count {
                    let mut r0 = 0;
                    while r0 < t.rows {
                        let n = (t.rows - r0).min(super::avx512_q0panel::ROWS);
                        let o = super::avx512_q0panel::rows(self, p, t, corr, r0, n);
                        for (i, v) in o[..n].iter().enumerate() {
                            let at = (ti * TILE + r0 + i) * stride + (p - first) * PANEL;
                            out[at..at + PANEL].copy_from_slice(v);
                        }
                        r0 += n;
                    }
                }
            }
            true
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::panel::{test_bytes, test_values};
    use super::super::q8;
    use super::*;

    /// Blocks of deterministic bytes with small normal f16 scales (and minimums).
    fn weights(fmt: BlockFormat, rows: usize, blocks: usize, seed: u32) -> Vec<u8> {
        let bb = fmt.block_bytes();
        let mut v = test_bytes(rows * blocks * bb, seed);
        for (k, blk) in v.chunks_exact_mut(bb).enumerate() {
            let d = f16::from_f32(0.01 + 0.003 * (k % 17) as f32).to_le_bytes();
            let m = f16::from_f32(-0.07 + 0.002 * (k % 5) as f32).to_le_bytes();
            blk[0..2].copy_from_slice(&d);
            if has_min(fmt) {
                blk[2..4].copy_from_slice(&m);
            }
        }
        v
    }

    /// Every output of the panel kernel equals the tile kernel's (checked against llama.cpp)
    /// bit for bit, for each format and 1 to 19 activation rows (whole and partial tiles).
    #[test]
    fn panel_kernel_equals_the_tile_kernel() {
        assert!(
            available(),
            "this test checks the AVX-512 VNNI panel kernel: run it on a CPU with AVX-512 VNNI"
        );
        let (rows, blocks) = (32, 5);
        for fmt in [
            BlockFormat::Q4_0,
            BlockFormat::Q4_1,
            BlockFormat::Q5_0,
            BlockFormat::Q5_1,
            BlockFormat::Q8_0,
        ] {
            let w = weights(fmt, rows, blocks, fmt.block_bytes() as u32);
            let rb = blocks * fmt.block_bytes();
            let p = Q0Panels::build(fmt, &w, rows, rb).unwrap();
            for n in [1, 2, 3, 7, 8, 9, 16, 19] {
                let x = test_values(n * blocks * QK, 0);
                let batch = Q8Batch::quantize(&x, blocks * QK);
                let mut want = vec![0f32; n * rows];
                for (ti, t) in batch.tiles.iter().enumerate() {
                    q8::dot_tile_rows(fmt, &w, rb, t, &mut want[ti * TILE * rows..], rows);
                }
                let acts = p.acts(&batch);
                let mut got = vec![f32::NAN; n * rows];
                assert!(p.matmul(0, p.panels(), &acts, &mut got, rows));
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        e.to_bits(),
                        "{fmt:?} n {n} output {i}: {g} vs {e}"
                    );
                }
                let mut mid = vec![f32::NAN; n * PANEL];
                assert!(p.matmul(1, 1, &acts, &mut mid, PANEL));
                for r in 0..n {
                    assert_eq!(
                        mid[r * PANEL..(r + 1) * PANEL],
                        got[r * rows + 16..r * rows + 32]
                    );
                }
            }
        }
        assert!(Q0Panels::build(BlockFormat::F32, &[0; 128], 16, 8).is_none());
    }

    /// A row read back from the panels (tied embeddings whose head dropped its blocks) is
    /// the GGUF blocks' dequantized row bit for bit; formats with a minimum decline.
    #[test]
    fn dequantized_rows_equal_the_blocks() {
        let (rows, blocks) = (32, 3);
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q5_0, BlockFormat::Q8_0] {
            let w = weights(fmt, rows, blocks, 7);
            let rb = blocks * fmt.block_bytes();
            let p = Q0Panels::build(fmt, &w, rows, rb).unwrap();
            for r in [0, 5, 16, 31] {
                let mut want = vec![0f32; blocks * QK];
                super::super::dequant_row(fmt, &w[r * rb..(r + 1) * rb], &mut want);
                let mut got = vec![f32::NAN; blocks * QK];
                assert!(p.dequant_row(r, &mut got), "{fmt:?} row {r}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{fmt:?} row {r}");
            }
            assert!(!p.dequant_row(rows, &mut [0f32; 96]), "past the last row");
        }
        let w = weights(BlockFormat::Q5_1, rows, blocks, 7);
        let p = Q0Panels::build(BlockFormat::Q5_1, &w, rows, blocks * 24).unwrap();
        assert!(
            !p.dequant_row(0, &mut [0f32; 96]),
            "a format with a minimum"
        );
    }
}
