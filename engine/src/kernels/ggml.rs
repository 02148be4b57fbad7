//! ggml's CPU arithmetic where its rounding differs from the textbook: the
//! vectorised `expf` behind softmax and SiLU, and the reduction orders of its
//! two f32/f16 dot products (`ggml_vec_dot_f32/f16`, 4 x 16 lanes; and
//! llamafile's tinyBLAS, one 16-lane accumulator), as built for AVX-512
//! (`GGML_NATIVE` on an AVX-512 CPU without AVX512-FP16).
//!
//! Why AVX-512's: the reference outputs (`tests/data/smollm2-q4_1-greedy.jsonl`)
//! were recorded by such a build, which reproduces them to the last printed
//! digit; the AVX2 build of the same llama.cpp rounds its attention sums and
//! `expf` differently and leaves the reference at step 2 of one prompt. The
//! orders are emulated here with 8-lane AVX2 registers (a 16-lane register is
//! two of them), so every x86-64-v3 machine computes the same bits.
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

const C1: u32 = 0x3f7f_fff6; // 0x1.ffffecp-1
const C2: u32 = 0x3eff_fedb; // 0x1.fffdb6p-2
const C3: u32 = 0x3e2a_af33; // 0x1.555e66p-3
const C4: u32 = 0x3d2b_9f17; // 0x1.573e2ep-5
const C5: u32 = 0x3c07_2010; // 0x1.0e4020p-7

/// ggml's AVX-512 `ggml_v_expf` for one lane: the polynomial includes the
/// leading 1 and the result is scaled by `2^n` with `vscalefps` (one rounding).
/// Flushes to 0 below about -133 (`|n| > 192` first) and to infinity above 88.7.
pub fn expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    );
    let u = b * b;
    let c = f32::from_bits;
    let j = c(C5)
        .mul_add(b, c(C4))
        .mul_add(u, c(C3).mul_add(b, c(C2)))
        .mul_add(u, c(C1).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    scalef(j, n)
}

/// `j * 2^n` rounded once, as `vscalefps` computes it (`n` integral, `|n| <= 192`).
#[inline]
fn scalef(j: f32, n: f32) -> f32 {
    let e = n as i32;
    if (-126..=127).contains(&e) {
        // 2^e is a normal f32: one multiplication, one rounding.
        return j * f32::from_bits(((e + 127) as u32) << 23);
    }
    // Exact in f64, then one rounding to f32 (subnormal or infinite results).
    (f64::from(j) * f64::from_bits(((e + 1023) as u64) << 52)) as f32
}

/// ggml's SiLU, `x / (1 + exp(-x))` with its `expf`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + expf(0.0 - x))
}

/// GELU's tanh approximation as ggml writes it (`ggml_gelu_f32`).
fn gelu_f32(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044_715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// ggml's CPU GELU (`ggml_vec_gelu_f32`, `ggml_vec_geglu_f32`): 0 at or below -10, the
/// identity at or above 10, and between them the value of its f16 table, `gelu` of `x`
/// rounded to f16, itself rounded to f16.
pub fn gelu(x: f32) -> f32 {
    static TABLE: std::sync::OnceLock<Vec<half::f16>> = std::sync::OnceLock::new();
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let table = TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| half::f16::from_f32(gelu_f32(half::f16::from_bits(b).to_f32())))
            .collect()
    });
    let i = half::f16::from_f32(x).to_bits() as usize;
    table.get(i).map_or(0.0, |g| g.to_f32())
}

/// Horizontal sum of 8 lanes in the order of ggml's and tinyBLAS's `hsum`.
/// Generic so that [`DotOrder::reduce_rows`] sums 8 columns at once ([`F8`]).
#[inline]
pub fn hsum8<T: Copy + Add<Output = T>>(x: &[T; 8]) -> T {
    ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]))
}

/// Horizontal sum of 16 lanes as GCC's `_mm512_reduce_add_ps`: the upper 8
/// lanes added to the lower 8, then [`hsum8`].
#[inline]
pub fn hsum16<T: Copy + Add<Output = T>>(x: &[T; 16]) -> T {
    hsum8(&std::array::from_fn(|i| x[i] + x[8 + i]))
}

/// Reduction of `ggml_vec_dot_f32/f16`'s four 16-lane accumulators
/// (`GGML_F32x16_REDUCE`: `(x0 + x2) + (x1 + x3)`, then [`hsum16`]): lane
/// `i` of accumulator `a` is `acc[a * 16 + i]`.
#[inline]
pub fn reduce64<T: Copy + Add<Output = T>>(acc: &[T; 64]) -> T {
    hsum16(&std::array::from_fn(|i| {
        (acc[i] + acc[32 + i]) + (acc[16 + i] + acc[48 + i])
    }))
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
    /// `ggml_vec_dot_*`: element `i` goes to lane `i % 64` (a decode step).
    Lanes64,
    /// tinyBLAS: element `i` goes to lane `i % 16` (a multi-token batch).
    Lanes16,
}

impl DotOrder {
    pub fn lanes(self) -> usize {
        match self {
            DotOrder::Lanes64 => 64,
            DotOrder::Lanes16 => 16,
        }
    }

    /// `sum(a[i] * b[i])` as ggml computes it. `Lanes64` is
    /// `ggml_vec_dot_f32/f16`: 64 lanes over the first `n & !63` elements,
    /// the rest added one by one in f64. `Lanes16` is tinyBLAS, which ggml
    /// uses only when `n` is a multiple of 16 (otherwise it falls back to
    /// `ggml_vec_dot`, and so does this).
    #[inline]
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        match self {
            DotOrder::Lanes16 if n.is_multiple_of(16) => lanes16(a, b),
            _ => {
                let np = n & !63;
                let mut sum = f64::from(lanes64(&a[..np], &b[..np]));
                for (x, y) in a[np..n].iter().zip(&b[np..n]) {
                    sum += f64::from(x * y);
                }
                sum as f32
            }
        }
    }

    /// Reduce `lanes()` rows of `acc` (row `l` at `acc[l * n..(l + 1) * n]`)
    /// into `out[d]`: column `d` summed as [`reduce64`] or [`hsum16`] sum lanes,
    /// 8 columns at a time.
    pub fn reduce_rows(self, acc: &[f32], out: &mut [f32]) {
        let n = out.len();
        fn reduce<T: Copy + Add<Output = T>>(order: DotOrder, lane: impl Fn(usize) -> T) -> T {
            match order {
                DotOrder::Lanes64 => reduce64(&std::array::from_fn(lane)),
                DotOrder::Lanes16 => hsum16(&std::array::from_fn(lane)),
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

fn lanes64(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = super::avx2::dot_lanes64(a, b) {
        return v;
    }
    reduce64(&lane_sums(a, b))
}

fn lanes16(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = super::avx2::dot_lanes16(a, b) {
        return v;
    }
    hsum16(&lane_sums(a, b))
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

/// ggml's softmax of `x` in place: exp with [`expf`], sums of 16 in
/// `_mm512_reduce_add_ps` order accumulated in f64, then one f32 scale by
/// `1 / sum`. (llama.cpp's rows are padded with masked positions, whose
/// exponentials are 0: a short last group sums as if padded with zeros.)
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for group in x.chunks_mut(16) {
        let mut lanes = [0f32; 16];
        for (v, l) in group.iter_mut().zip(lanes.iter_mut()) {
            *v = expf(*v - max);
            *l = *v;
        }
        sum += f64::from(hsum16(&lanes));
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
        for order in [DotOrder::Lanes16, DotOrder::Lanes64] {
            assert!((f64::from(order.dot(&a, &b)) - exact).abs() < 1e-5);
        }
        // Row reductions give what the element-wise dot gives.
        for order in [DotOrder::Lanes16, DotOrder::Lanes64] {
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
