//! Dot products of K-quant weight rows with Q8_K activation rows, in the
//! float order of each kernel llama.cpp's x86 CPU backend picks
//! (`docs/research/ggml-kquants.md` §3 and §5).
//!
//! Every kernel first forms exact integers per (weight block, activation
//! block): [`Terms`], i.e. ggml's 8 integer lanes (lane `l` sums the
//! scaled products `sc*q*q8` of elements `32c+4l..32c+4l+4` of every
//! 32-value chunk `c`, as its `maddubs`/`madd` steps group them), each
//! chunk's sum where the GEMM needs it, and the mins' terms. Integer sums are
//! exact, so only the float operations that follow differ between kernels:
//! - [`Kernel::VecDot`]: `ggml_vec_dot_q*_K_q8_K` (8 lanes, `hsum_float_8`;
//!   Q4_K mins in 4 lanes, Q5_K mins in a scalar);
//! - [`Kernel::Gemv`] / [`Kernel::Gemm`]: the repacked Q4_K kernels
//!   (`ggml_gemv/gemm_q4_K_8x8_q8_K`): one chain per output, `dw*dy`
//!   rounded first, the mins in a second chain subtracted at the end; the
//!   GEMM adds once per 64 values, the GEMV once per block;
//! - [`Kernel::Tiled`]: the tiled K-quant matmul (8 or more rows), one
//!   scalar chain `acc = fma(dw*s1 - dmin*s2, dy, acc)`.
//!
//! Each output is its own chain over the blocks in order, so results do not
//! depend on threads or on how rows are grouped.

use super::ggml::hsum8;
use super::kquant::{KFormat, Unpacked};
use super::q8k::Q8KBlock;

/// Which of llama.cpp's kernels an output is computed as. `Gemv` and `Gemm`
/// are the repacked Q4_K kernels: [`Kernel::choose`] gives them for Q4_K only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    VecDot,
    Gemv,
    Gemm,
    Tiled,
}

impl Kernel {
    /// The kernel llama.cpp 0.3.36 uses on x86 (AVX2 or AVX-512) for a
    /// weight of this format with `out_rows` rows, in a matmul over `n`
    /// activation rows, for the activation row at index `i` of that matmul
    /// (§5.4): Q4_K with a multiple of 8 rows is repacked (GEMM for the rows
    /// below `n - n % 4`, GEMV for the rest); otherwise the tiled kernel from
    /// 8 rows, `vec_dot` below.
    pub fn choose(fmt: KFormat, out_rows: usize, n: usize, i: usize) -> Kernel {
        match fmt {
            KFormat::Q4K if out_rows.is_multiple_of(8) => {
                if i < n - n % 4 {
                    Kernel::Gemm
                } else {
                    Kernel::Gemv
                }
            }
            _ if n >= 8 => Kernel::Tiled,
            _ => Kernel::VecDot,
        }
    }
}

/// Exact integer terms of one (weight block, activation block) pair.
#[derive(Debug, Clone, Copy, Default)]
pub struct Terms {
    /// `vec_dot`'s 8 integer lanes: lane `l` sums, over the 8 chunks of 32
    /// values, `sc * q * q8` of elements `32c+4l..32c+4l+4` (each product
    /// times its sub-block's scale), Q6_K's offset taken out.
    pub lanes: [i32; 8],
    /// Each chunk's scaled sum (the GEMM adds them in pairs): written only when asked for.
    pub chunks: [i32; 8],
    /// Q4_K/Q5_K: `m_s * (bsums[2s] + bsums[2s+1])` per 32-value sub-block.
    pub mins: [i32; 8],
}

/// The integer terms of `w` (unpacked) with `a` into `t` (reused across calls);
/// `t.chunks` only with `need_chunks` (the GEMM's).
#[inline(always)]
pub fn terms(fmt: KFormat, w: &Unpacked, a: &Q8KBlock, need_chunks: bool, t: &mut Terms) {
    let (m_pairs, sc6) = match fmt {
        KFormat::Q4K | KFormat::Q5K => (Some(&w.m_pairs), None),
        KFormat::Q6K => (None, Some(&w.sc16)),
    };
    #[cfg(target_arch = "x86_64")]
    let vector = super::avx2_kquant::block_terms(
        &w.q,
        &a.qs,
        &w.pair_scales,
        &a.bsums,
        m_pairs,
        sc6,
        &mut t.lanes,
        need_chunks.then_some(&mut t.chunks),
        &mut t.mins,
    );
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    if !vector {
        terms_scalar(fmt, w, a, t);
    }
}

/// The portable form of [`terms`] (the same integers).
pub fn terms_scalar(fmt: KFormat, w: &Unpacked, a: &Q8KBlock, t: &mut Terms) {
    let mut parts = [[0i32; 8]; 8];
    for (c, out) in parts.iter_mut().enumerate() {
        let (q, x) = (&w.q[32 * c..32 * c + 32], &a.qs[32 * c..32 * c + 32]);
        for (l, o) in out.iter_mut().enumerate() {
            *o = (4 * l..4 * l + 4)
                .map(|e| w.pair_scales[c][e / 2] as i32 * q[e] as i32 * x[e] as i32)
                .sum();
        }
    }
    t.lanes = [0; 8];
    for (c, p) in parts.iter().enumerate() {
        t.chunks[c] = p.iter().sum();
        for (s, v) in t.lanes.iter_mut().zip(p) {
            *s += v;
        }
    }
    match fmt {
        KFormat::Q4K | KFormat::Q5K => {
            for s in 0..8 {
                t.mins[s] = w.m[s] * (a.bsums[2 * s] as i32 + a.bsums[2 * s + 1] as i32);
            }
        }
        KFormat::Q6K => {
            // ggml's `q8sclsub`: lane `l` takes out 32 times the sums of
            // sub-blocks `2l` and `2l+1` times their scales.
            for l in 0..8 {
                let o = w.sc[2 * l] * a.bsums[2 * l] as i32
                    + w.sc[2 * l + 1] * a.bsums[2 * l + 1] as i32;
                t.lanes[l] -= o << 5;
            }
        }
    }
}

impl Terms {
    /// `s1`: the whole block's scaled sum (Q6_K's offset taken out).
    #[inline(always)]
    fn total(&self) -> i32 {
        self.lanes.iter().sum()
    }
}

/// One output's accumulators while its blocks go by.
#[derive(Debug, Clone, Copy, Default)]
pub struct Acc {
    lanes: [f32; 8],
    mins: [f32; 4],
    summs: f32,
    acc: f32,
    accm: f32,
}

impl Acc {
    /// Adds one block pair (`w` unpacked, its terms `t` with `a`).
    #[inline(always)]
    pub fn add(&mut self, k: Kernel, fmt: KFormat, w: &Unpacked, a: &Q8KBlock, t: &Terms) {
        match k {
            Kernel::VecDot => {
                let d = a.d * w.d;
                for (acc, &s) in self.lanes.iter_mut().zip(&t.lanes) {
                    *acc = d.mul_add(s as f32, *acc);
                }
                let dmin = -a.d * w.dmin;
                match fmt {
                    KFormat::Q4K => {
                        for j in 0..4 {
                            let p = t.mins[2 * j] + t.mins[2 * j + 1];
                            self.mins[j] = dmin.mul_add(p as f32, self.mins[j]);
                        }
                    }
                    KFormat::Q5K => {
                        let p: [i32; 4] =
                            std::array::from_fn(|j| t.mins[2 * j] + t.mins[2 * j + 1]);
                        let isum = (p[0] + p[1]) + (p[2] + p[3]);
                        // `summs += dmin * isum`: GCC contracts it (-ffp-contract=fast).
                        self.summs = dmin.mul_add(isum as f32, self.summs);
                    }
                    KFormat::Q6K => {}
                }
            }
            Kernel::Gemv => {
                let (ds, dm) = (w.d * a.d, w.dmin * a.d);
                let m: i32 = t.mins.iter().sum();
                self.acc = (t.total() as f32).mul_add(ds, self.acc);
                self.accm = (m as f32).mul_add(dm, self.accm);
            }
            Kernel::Gemm => {
                let (ds, dm) = (w.d * a.d, w.dmin * a.d);
                for sb in 0..4 {
                    let s = t.chunks[2 * sb] + t.chunks[2 * sb + 1];
                    let m = t.mins[2 * sb] + t.mins[2 * sb + 1];
                    self.acc = (s as f32).mul_add(ds, self.acc);
                    self.accm = (m as f32).mul_add(dm, self.accm);
                }
            }
            Kernel::Tiled => {
                let mut r = w.d * t.total() as f32;
                if fmt.has_mins() {
                    let s2: i32 = t.mins.iter().sum();
                    r = (-w.dmin).mul_add(s2 as f32, r);
                }
                self.acc = r.mul_add(a.d, self.acc);
            }
        }
    }

    /// The output's value after its last block.
    #[inline]
    pub fn finish(&self, k: Kernel) -> f32 {
        match k {
            Kernel::VecDot => {
                let m = &self.mins;
                hsum8(&self.lanes) + ((m[0] + m[2]) + (m[1] + m[3])) + self.summs
            }
            Kernel::Gemv | Kernel::Gemm => self.acc - self.accm,
            Kernel::Tiled => self.acc,
        }
    }
}

/// The dot product of one weight row (`row`, whole blocks of `fmt`) with
/// one activation row, as kernel `k` computes it.
pub fn dot(fmt: KFormat, k: Kernel, row: &[u8], a: &[Q8KBlock]) -> f32 {
    let mut u = Unpacked::default();
    let mut acc = Acc::default();
    let mut t = Terms::default();
    for (blk, ab) in row.chunks_exact(fmt.block_bytes()).zip(a) {
        super::kquant::unpack(fmt, blk, &mut u);
        terms(fmt, &u, ab, k == Kernel::Gemm, &mut t);
        acc.add(k, fmt, &u, ab, &t);
    }
    acc.finish(k)
}

/// `out[r][j]` for weight rows `j` of `w` (each `row_bytes`) and the
/// activation rows `acts[r]`, each output by the kernel `kernel(r)`.
/// `out` is `[acts.len()][n_out]` row-major with stride `stride`.
pub fn dot_rows(
    fmt: KFormat,
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8KBlock]],
    kernel: impl Fn(usize) -> Kernel,
    out: &mut [f32],
    stride: usize,
) {
    let nb = row_bytes / fmt.block_bytes();
    let mut u = Unpacked::default();
    let mut t = Terms::default();
    let mut accs = vec![Acc::default(); acts.len()];
    let kernels: Vec<Kernel> = (0..acts.len()).map(&kernel).collect();
    for (j, row) in w.chunks_exact(row_bytes).enumerate() {
        accs.iter_mut().for_each(|a| *a = Acc::default());
        for b in 0..nb {
            let blk = &row[b * fmt.block_bytes()..(b + 1) * fmt.block_bytes()];
            super::kquant::unpack(fmt, blk, &mut u);
            for (r, a) in acts.iter().enumerate() {
                terms(fmt, &u, &a[b], kernels[r] == Kernel::Gemm, &mut t);
                accs[r].add(kernels[r], fmt, &u, &a[b], &t);
            }
        }
        for (r, acc) in accs.iter().enumerate() {
            out[r * stride + j] = acc.finish(kernels[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::kquant::QK_K;
    use super::*;

    /// The vector and portable integer terms agree for every format, at the extremes of the
    /// codes (63), activations (-128..=127), scales, mins and block sums too.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_and_scalar_terms_agree() {
        assert!(
            super::super::avx2::available(),
            "this test checks the AVX2 terms: run it on an x86-64-v3 CPU"
        );
        let q: [u8; QK_K] =
            std::array::from_fn(|i| if i % 7 == 0 { 63 } else { (i * 13 % 64) as u8 });
        let x: [i8; QK_K] = std::array::from_fn(|i| match i % 5 {
            0 => -128,
            1 => 127,
            _ => (i as i32 * 37 % 255 - 127) as i8,
        });
        let a = Q8KBlock {
            qs: x,
            d: 0.5,
            bsums: std::array::from_fn(|s| x[16 * s..16 * s + 16].iter().map(|&v| v as i16).sum()),
        };
        for fmt in [KFormat::Q4K, KFormat::Q5K, KFormat::Q6K] {
            let mut w = Unpacked {
                q,
                ..Unpacked::default()
            };
            for (c, p) in w.pair_scales.iter_mut().enumerate() {
                *p = std::array::from_fn(|j| {
                    (c as i16 * 16 + j as i16) - 128 + if j < 8 { 0 } else { 7 }
                });
            }
            w.sc = std::array::from_fn(|i| i as i32 * 9 - 70);
            w.m = std::array::from_fn(|i| 63 - 5 * i as i32);
            w.m_pairs = std::array::from_fn(|i| w.m[i / 2] as i16);
            w.sc16 = std::array::from_fn(|i| w.sc[i] as i16);
            let (mut v, mut s) = (Terms::default(), Terms::default());
            terms(fmt, &w, &a, true, &mut v);
            terms_scalar(fmt, &w, &a, &mut s);
            assert_eq!(v.lanes, s.lanes, "{fmt:?} lanes");
            assert_eq!(v.chunks, s.chunks, "{fmt:?} chunks");
            if fmt.has_mins() {
                assert_eq!(v.mins, s.mins, "{fmt:?} mins");
            }
        }
    }
}
