//! K-quant weights repacked into panels of [`PANEL`] rows, and the safe entry to their
//! kernels ([`super::avx512_kpanel`], [`super::avx512_kvecdot`]).
//!
//! Why: [`super::kdot`] unpacks a weight block and then forms each activation row's integer
//! terms separately, with horizontal sums per (weight row, activation row); that is 1.4-3.7x
//! llama.cpp's time for a prompt. Here the codes of 16 weight rows are interleaved, four
//! values of a row to a 32-bit lane, so one AVX-512 VNNI `vpdpbusd` multiplies four values of
//! 16 rows by four broadcast activation bytes and every lane stays one weight row's sum:
//! no horizontal sums, each weight load used by up to four activation rows.
//!
//! Invariants:
//! - a panel holds weight rows `16p..16p+16`; the code of row `16p+j`, value `4g+k` of block
//!   `b` is `codes[((p*blocks + b)*64 + g)*64 + 4j + k]` (unpacked, unsigned: Q4_K 0..16,
//!   Q5_K 0..32, Q6_K 0..64, as [`super::kquant::unpack`] gives them);
//! - per (panel, block) the 16 rows' `d`, `dmin` (f32); their scales as i16 pairs
//!   `(sc[s], sc[s])` in one i32 (`sc[s][j]`: 8 sub-blocks of 32 values for Q4_K/Q5_K, 16
//!   of 16 values for Q6_K), the operand of `vpmaddwd` after `vpmaddubsw` (an arithmetic
//!   shift right by 16 gives the i32 scale); their mins the same way (`m[s][j]`), and Q6_K's
//!   scales again as pairs `(sc[2t], sc[2t+1])` (`sc2[t][j]`); mins and `sc2` are
//!   `vpdpwssd`'s operands against a pair of the activations' 16-value sums. All exact:
//!   every product and sum fits in i32, and `vpmaddubsw` cannot saturate (a code times an
//!   activation byte, twice, is at most `2 * 63 * 128 < 2^15`);
//! - the kernel computes the same exact integers as [`super::kdot::terms`] and then the float
//!   operations of the output's [`Kernel`] in [`super::kdot::Acc`]'s order, so every output
//!   equals [`super::kdot::dot_rows`]' bit for bit (tested below). It covers `Gemm`, `Gemv`
//!   and `Tiled` ([`super::avx512_kpanel`]) and `VecDot` ([`super::avx512_kvecdot`]: few
//!   activation rows of Q5_K/Q6_K, i.e. decode); a quad of rows is either all `VecDot` or
//!   none (as [`Kernel::choose`] gives them).

use super::kdot::Kernel;
use super::kquant::{self, KFormat, Unpacked, QK_K};
use super::panel::{self, available, PANEL};
use super::q8k::Q8KBlock;

/// Scale slots per (panel, block) and row: Q6_K's 16 sub-blocks (Q4_K/Q5_K use 8).
pub const SUBS: usize = 16;
/// Code bytes per (panel, block).
pub const CODE_BYTES: usize = QK_K * PANEL;
/// Activation rows that share one weight load.
pub const QUAD: usize = 4;

/// One K-quant matrix in panels (see the module's invariants).
#[derive(Debug, Clone)]
pub struct KPanels {
    pub fmt: KFormat,
    pub rows: usize,
    /// Blocks per weight row.
    pub blocks: usize,
    pub codes: Vec<u8>,
    pub d: Vec<f32>,
    pub dmin: Vec<f32>,
    /// Scales as i16 pairs `(sc, sc)`.
    pub sc: Vec<i32>,
    /// Mins as i16 pairs `(m, m)`.
    pub m: Vec<i32>,
    /// Q6_K's scales as i16 pairs `(sc[2t], sc[2t+1])` (empty for Q4_K/Q5_K).
    pub sc2: Vec<i32>,
}

/// Two i16 in one i32 lane, `lo` in the low half (`vpdpwssd`'s operand layout).
fn i16_pair(lo: i32, hi: i32) -> i32 {
    ((lo as i16 as u16 as u32) | ((hi as i16 as u16 as u32) << 16)) as i32
}

impl KPanels {
    /// Repacks `rows` weight rows of `row_bytes` each (whole blocks of `fmt`); `None` when
    /// `rows` is not a multiple of [`PANEL`] or the data does not hold them.
    pub fn build(fmt: KFormat, data: &[u8], rows: usize, row_bytes: usize) -> Option<Self> {
        let bb = fmt.block_bytes();
        let blocks = panel::blocks_per_row(rows, row_bytes, bb, data.len())?;
        let pbs = rows / PANEL * blocks;
        let mut p = Self {
            fmt,
            rows,
            blocks,
            codes: vec![0; pbs * CODE_BYTES],
            d: vec![0.0; pbs * PANEL],
            dmin: vec![0.0; pbs * PANEL],
            sc: vec![0; pbs * SUBS * PANEL],
            m: vec![0; pbs * 8 * PANEL],
            sc2: vec![0; if fmt.has_mins() { 0 } else { pbs * 8 * PANEL }],
        };
        let mut u = Unpacked::default();
        for (r, row) in data.chunks_exact(row_bytes).enumerate() {
            let (pn, j) = (r / PANEL, r % PANEL);
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                kquant::unpack(fmt, blk, &mut u);
                let pb = pn * blocks + b;
                panel::interleave(&mut p.codes[pb * CODE_BYTES..], j, &u.q);
                p.d[pb * PANEL + j] = u.d;
                p.dmin[pb * PANEL + j] = u.dmin;
                for (s, &v) in u.sc.iter().enumerate() {
                    p.sc[(pb * SUBS + s) * PANEL + j] = i16_pair(v, v);
                }
                for (s, &v) in u.m.iter().enumerate() {
                    p.m[(pb * 8 + s) * PANEL + j] = i16_pair(v, v);
                }
                if !fmt.has_mins() {
                    for t in 0..8 {
                        p.sc2[(pb * 8 + t) * PANEL + j] = i16_pair(u.sc[2 * t], u.sc[2 * t + 1]);
                    }
                }
            }
        }
        Some(p)
    }

    /// Whether the panel kernels compute these rows' kernels: all `VecDot` or none.
    pub fn takes(kinds: &[Kernel]) -> bool {
        let v = kinds.iter().filter(|&&k| k == Kernel::VecDot).count();
        v == 0 || v == kinds.len()
    }

    /// Number of panels.
    pub fn panels(&self) -> usize {
        self.rows / PANEL
    }

    /// Bytes this repacked copy holds.
    pub fn resident_bytes(&self) -> usize {
        self.codes.len()
            + 4 * (self.d.len() + self.dmin.len() + self.sc.len() + self.m.len() + self.sc2.len())
    }

    /// `out[r * stride + 16 * (p - first) + j]` = weight row `16p + j` times activation row
    /// `acts[r]`, computed as `kinds[r]` says, for the panels `first..first + count`.
    /// `false` (nothing written) when this CPU lacks the kernel, an activation row is
    /// short, or `VecDot` rows are mixed with others.
    pub fn matmul(
        &self,
        first: usize,
        count: usize,
        acts: &[&[Q8KBlock]],
        kinds: &[Kernel],
        out: &mut [f32],
        stride: usize,
    ) -> bool {
        let ok = available()
            && first + count <= self.panels()
            && kinds.len() == acts.len()
            && acts.iter().all(|a| a.len() >= self.blocks)
            && Self::takes(kinds)
            && (acts.is_empty() || out.len() >= (acts.len() - 1) * stride + count * PANEL);
        if !ok {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            // Row groups small enough that their activations stay in L2 while every panel
            // of the run meets them.
            const ROW_GROUP: usize = 32;
            let mut buf = [[0f32; PANEL]; QUAD];
            for (g, rows) in acts.chunks(ROW_GROUP).enumerate() {
                for p in first..first + count {
                    for (q, quad) in rows.chunks(QUAD).enumerate() {
                        let r0 = g * ROW_GROUP + q * QUAD;
                        let ks = &kinds[r0..r0 + quad.len()];
                        super::avx512_kpanel::quad(self, p, quad, ks, &mut buf);
                        for (i, o) in buf[..quad.len()].iter().enumerate() {
                            let at = (r0 + i) * stride + (p - first) * PANEL;
                            out[at..at + PANEL].copy_from_slice(o);
                        }
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
    use super::super::kdot;
    use super::super::panel::{test_bytes, test_values};
    use super::super::q8k::{quantize_block, Q8KRows};
    use super::*;

    /// Blocks of deterministic bytes with small normal f16 scales; the first block at the
    /// extremes: every code its largest, Q6_K's first two scales -128 and 127 (Q4_K/Q5_K's
    /// scales and mins 63).
    fn weights(fmt: KFormat, rows: usize, blocks: usize, seed: u32) -> Vec<u8> {
        let bb = fmt.block_bytes();
        let mut v = test_bytes(rows * blocks * bb, seed);
        v[..bb].fill(0xff);
        if fmt == KFormat::Q6K {
            v[192] = 0x80;
            v[193] = 0x7f;
        }
        for (k, blk) in v.chunks_exact_mut(bb).enumerate() {
            let d = half::f16::from_f32(0.001 + 0.0003 * (k % 17) as f32).to_le_bytes();
            let dm = half::f16::from_f32(0.0007 + 0.0002 * (k % 5) as f32).to_le_bytes();
            match fmt {
                KFormat::Q6K => blk[208..210].copy_from_slice(&d),
                _ => {
                    blk[0..2].copy_from_slice(&d);
                    blk[2..4].copy_from_slice(&dm);
                }
            }
        }
        v
    }

    fn activations(rows: usize, blocks: usize, seed: u32) -> Q8KRows {
        let x = test_values(rows * blocks * QK_K, seed);
        let mut a = Q8KRows::quantize(&x, blocks * QK_K);
        // Blocks at the extremes: a lone -128 is impossible (the quantizer gives -127..127)
        // but the largest magnitudes are in, alternating in pairs (`vpmaddubsw`'s largest
        // pair sums), then all of one sign (the largest 16-value sums, `vpdpwssd`'s operand).
        let extreme = |f: &dyn Fn(usize) -> f32| {
            let mut ext = Q8KBlock::default();
            let e: Vec<f32> = (0..QK_K).map(f).collect();
            quantize_block(&e, &mut ext);
            ext
        };
        a.data[0] = extreme(&|i| if i % 4 < 2 { 1.0 } else { -1.0 });
        if a.data.len() > 1 {
            a.data[1] = extreme(&|_| 1.0);
        }
        if a.data.len() > 2 {
            a.data[2] = extreme(&|_| -1.0);
        }
        a
    }

    /// Every output of the panel kernels equals `kdot::dot_rows`' (the kernels whose order
    /// was checked against llama.cpp) bit for bit, for each format, each kernel,
    /// 1 to 11 activation rows (whole and partial quads) and rows of mixed kernels.
    #[test]
    fn panel_kernel_equals_the_reference_kernels() {
        assert!(
            available(),
            "this test checks the AVX-512 VNNI panel kernel: run it on a CPU with AVX-512 VNNI"
        );
        let (rows, blocks) = (32, 3);
        for fmt in [KFormat::Q4K, KFormat::Q5K, KFormat::Q6K] {
            let w = weights(fmt, rows, blocks, fmt.block_bytes() as u32);
            let rb = blocks * fmt.block_bytes();
            let p = KPanels::build(fmt, &w, rows, rb).unwrap();
            for n in 1..=11 {
                let a = activations(n, blocks, n as u32);
                let refs: Vec<&[Q8KBlock]> = (0..n).map(|r| a.row(r)).collect();
                let mixes: Vec<Vec<Kernel>> = match fmt {
                    KFormat::Q4K => vec![
                        (0..n).map(|i| Kernel::choose(fmt, rows, n, i)).collect(),
                        vec![Kernel::Tiled; n],
                        vec![Kernel::VecDot; n],
                        (0..n)
                            .map(|i| [Kernel::Gemm, Kernel::Gemv, Kernel::Tiled][i % 3])
                            .collect(),
                    ],
                    _ => vec![vec![Kernel::Tiled; n], vec![Kernel::VecDot; n]],
                };
                for kinds in mixes {
                    let mut want = vec![0f32; n * rows];
                    kdot::dot_rows(fmt, &w, rb, &refs, |r| kinds[r], &mut want, rows);
                    let mut got = vec![f32::NAN; n * rows];
                    assert!(p.matmul(0, p.panels(), &refs, &kinds, &mut got, rows));
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{fmt:?} n {n} kinds {kinds:?} output {i}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }

    /// A run of panels writes only its own columns, at its offset.
    #[test]
    fn a_run_of_panels_writes_its_columns() {
        let fmt = KFormat::Q4K;
        let (rows, blocks) = (48, 2);
        let w = weights(fmt, rows, blocks, 3);
        let rb = blocks * fmt.block_bytes();
        let p = KPanels::build(fmt, &w, rows, rb).unwrap();
        let a = activations(5, blocks, 9);
        let refs: Vec<&[Q8KBlock]> = (0..5).map(|r| a.row(r)).collect();
        let kinds = vec![Kernel::Tiled; 5];
        let mut all = vec![0f32; 5 * rows];
        assert!(p.matmul(0, 3, &refs, &kinds, &mut all, rows));
        let mut mid = vec![f32::NAN; 5 * PANEL];
        assert!(p.matmul(1, 1, &refs, &kinds, &mut mid, PANEL));
        for r in 0..5 {
            assert_eq!(
                mid[r * PANEL..(r + 1) * PANEL],
                all[r * rows + 16..r * rows + 32]
            );
        }
        assert!(
            !p.matmul(2, 2, &refs, &kinds, &mut all, rows),
            "past the last panel"
        );
        let mixed = [Kernel::VecDot, Kernel::Tiled];
        assert!(
            !p.matmul(0, 1, &refs[..2], &mixed, &mut all, rows),
            "VecDot rows mixed with others"
        );
        assert!(
            KPanels::build(fmt, &w[..rb * 8], 8, rb).is_none(),
            "8 rows: no panel"
        );
    }
}
