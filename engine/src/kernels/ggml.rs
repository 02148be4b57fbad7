//! ggml's CPU arithmetic where its rounding differs from the textbook: the
//! vectorised `expf` behind softmax and SiLU, and the reduction orders of its
//! two f32/f16 dot products (`ggml_vec_dot_f32/f16`, 4 x 8 lanes; and
//! llamafile's tinyBLAS, one 8-lane accumulator), as built for AVX2 + FMA.
//!
//! Why bit-exactness: every matmul input is quantized to 8 bits first, and a
//! value one ulp away from a rounding boundary lands on the neighbouring grid
//! point, moving that matmul's output by ~1e-3. On this model such flips
//! compound over 30 layers into logit differences of ~0.3, which is enough to
//! swap near-tied tokens. Reproducing ggml's operations exactly keeps duet on
//! llama.cpp's trajectory. The code is safe scalar Rust whose operation order
//! mirrors the SIMD lanes; the two dot products run as AVX2 intrinsics in
//! [`super::avx2`] where available (same order), with scalar fallbacks.

use std::ops::Add;

/// ggml's `ggml_v_expf` for one lane (max error 1.45 ulp; flushes to 0
/// below about -104 and to infinity above 88.4).
pub fn expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    );
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010)
        .mul_add(b, f32::from_bits(0x3d2b_9f17))
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)),
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        return s1 * s1;
    }
    s2.mul_add(j, s2) * s1
}

/// ggml's SiLU, `x / (1 + exp(-x))` with its `expf`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + expf(0.0 - x))
}

/// Horizontal sum of 8 lanes in the order of ggml's and tinyBLAS's `hsum`.
/// Generic so that [`DotOrder::reduce_rows`] sums 8 columns at once ([`F8`]).
#[inline]
pub fn hsum8<T: Copy + Add<Output = T>>(x: &[T; 8]) -> T {
    ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]))
}

/// Reduction of `ggml_vec_dot_f32/f16`'s four 8-lane accumulators
/// (`GGML_F32x8_REDUCE`): lane `i` of accumulator `a` is `acc[a * 8 + i]`.
#[inline]
pub fn reduce32<T: Copy + Add<Output = T>>(acc: &[T; 32]) -> T {
    let t: [T; 8] = std::array::from_fn(|i| (acc[i] + acc[16 + i]) + (acc[8 + i] + acc[24 + i]));
    let t0 = [t[0] + t[4], t[1] + t[5], t[2] + t[6], t[3] + t[7]];
    (t0[0] + t0[1]) + (t0[2] + t0[3])
}

/// Eight independent f32 sums, added lane-wise (one AVX add).
#[derive(Debug, Clone, Copy)]
pub struct F8([f32; 8]);

impl Add for F8 {
    type Output = F8;
    #[inline]
    fn add(self, o: F8) -> F8 {
        F8(std::array::from_fn(|i| self.0[i] + o.0[i]))
    }
}

/// Which of ggml's dot products a row's attention follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotOrder {
    /// `ggml_vec_dot_*`: element `i` goes to lane `i % 32` (a decode step).
    Lanes32,
    /// tinyBLAS: element `i` goes to lane `i % 8` (a multi-token batch).
    Lanes8,
}

impl DotOrder {
    pub fn lanes(self) -> usize {
        match self {
            DotOrder::Lanes32 => 32,
            DotOrder::Lanes8 => 8,
        }
    }

    /// `sum(a[i] * b[i])` as ggml computes it. `Lanes32` is
    /// `ggml_vec_dot_f32/f16`: 32 lanes over the first `n & !31` elements,
    /// the rest added one by one in f64. `Lanes8` is tinyBLAS, which ggml
    /// uses only when `n` is a multiple of 8 (otherwise it falls back to
    /// `ggml_vec_dot`, and so does this).
    #[inline]
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        match self {
            DotOrder::Lanes8 if n.is_multiple_of(8) => lanes8(a, b),
            _ => {
                let np = n & !31;
                let mut sum = f64::from(lanes32(&a[..np], &b[..np]));
                for (x, y) in a[np..n].iter().zip(&b[np..n]) {
                    sum += f64::from(x * y);
                }
                sum as f32
            }
        }
    }

    /// Reduce `lanes()` rows of `acc` (row `l` at `acc[l * n..(l + 1) * n]`)
    /// into `out[d]`: column `d` summed as [`reduce32`] or [`hsum8`] sum lanes,
    /// 8 columns at a time.
    pub fn reduce_rows(self, acc: &[f32], out: &mut [f32]) {
        let n = out.len();
        fn reduce<T: Copy + Add<Output = T>>(order: DotOrder, lane: impl Fn(usize) -> T) -> T {
            match order {
                DotOrder::Lanes32 => reduce32(&std::array::from_fn(lane)),
                DotOrder::Lanes8 => hsum8(&std::array::from_fn(lane)),
            }
        }
        let mut d = 0;
        for o in out.chunks_exact_mut(8) {
            let at = |l: usize| F8(std::array::from_fn(|i| acc[l * n + d + i]));
            o.copy_from_slice(&reduce(self, at).0);
            d += 8;
        }
        for (j, o) in out[d..].iter_mut().enumerate() {
            *o = reduce(self, |l| acc[l * n + d + j]);
        }
    }
}

fn lanes32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = super::avx2::dot_lanes32(a, b) {
        return v;
    }
    reduce32(&lane_sums(a, b))
}

fn lanes8(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = super::avx2::dot_lanes8(a, b) {
        return v;
    }
    hsum8(&lane_sums(a, b))
}

/// Scalar lane accumulators: element `i` of each whole chunk of `L` goes to lane `i % L`.
fn lane_sums<const L: usize>(a: &[f32], b: &[f32]) -> [f32; L] {
    let mut acc = [0f32; L];
    for (x, y) in a.chunks_exact(L).zip(b.chunks_exact(L)) {
        for l in 0..L {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    acc
}

/// ggml's softmax of `x` in place: exp with [`expf`], sums of 8 in `hsum`
/// order accumulated in f64, then one f32 scale by `1 / sum`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for group in x.chunks_mut(8) {
        let mut lanes = [0f32; 8];
        for (v, l) in group.iter_mut().zip(lanes.iter_mut()) {
            *v = expf(*v - max);
            *l = *v;
        }
        sum += f64::from(hsum8(&lanes));
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_within_two_ulps_of_libm_and_flushes_like_ggml() {
        for i in -2000..2000 {
            let x = i as f32 * 0.0437;
            let (ours, exact) = (expf(x), x.exp());
            let ulp = (exact.to_bits() as i64 - ours.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {ours}, libm {exact}");
        }
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(-200.0), 0.0);
        assert!(expf(100.0).is_infinite());
    }

    #[test]
    fn reduction_orders_differ_from_sequential_sums_but_agree_in_value() {
        let a: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let exact: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        for order in [DotOrder::Lanes8, DotOrder::Lanes32] {
            assert!((f64::from(order.dot(&a, &b)) - exact).abs() < 1e-5);
        }
        // Row reductions give what the element-wise dot gives.
        for order in [DotOrder::Lanes8, DotOrder::Lanes32] {
            let l = order.lanes();
            let mut acc = vec![0f32; l * 3];
            let cols: Vec<Vec<f32>> = (0..3)
                .map(|c| (0..l).map(|i| (i * 7 + c) as f32 * 0.1).collect())
                .collect();
            for c in 0..3 {
                for i in 0..l {
                    acc[i * 3 + c] = cols[c][i];
                }
            }
            let mut out = [0f32; 3];
            order.reduce_rows(&acc, &mut out);
            for c in 0..3 {
                assert_eq!(out[c], order.dot(&cols[c], &vec![1.0; l]));
            }
        }
        let mut p = vec![1.0, 2.0, 3.0, f32::NEG_INFINITY];
        softmax(&mut p);
        assert_eq!(p[3], 0.0);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
