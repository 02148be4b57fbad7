//! CPU kernels over GGML block formats, in safe Rust written so that LLVM
//! vectorises them (the workspace builds for x86-64-v3: AVX2 + FMA + F16C).
//!
//! Invariants:
//! - every weight row is a whole number of 32-element blocks;
//! - a row's dot product is computed in the same order whatever the batch
//!   size, so a sequence decoded in a batch gets bit-identical logits to the
//!   same sequence decoded alone (the fused path is used up to
//!   [`FUSED_MAX_ROWS`] activation rows).

use half::f16;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_kquant;
#[cfg(target_arch = "x86_64")]
mod avx512_kpanel;
#[cfg(target_arch = "x86_64")]
mod avx512_kvecdot;
#[cfg(target_arch = "x86_64")]
mod avx512_q0panel;
pub mod ggml;
pub mod kdot;
pub mod kpanel;
pub mod kquant;
pub mod panel;
pub mod q0panel;
pub mod q8;
pub mod q8k;

/// KV element types with vector attention kernels (f32, f16).
#[cfg(target_arch = "x86_64")]
pub use avx2::KvLoad as KvLanes;

/// KV element types with vector attention kernels (none on this target).
#[cfg(not(target_arch = "x86_64"))]
pub trait KvLanes: Copy {}
#[cfg(not(target_arch = "x86_64"))]
impl KvLanes for f32 {}
#[cfg(not(target_arch = "x86_64"))]
impl KvLanes for f16 {}

/// Attention scores `order.dot(q, row) * scale` of the rows of `k`, pushed
/// to `out`; `false` when no vector kernel covers the head size here (the
/// caller computes them row by row).
pub fn attention_scores<T: KvLanes>(
    order: ggml::DotOrder,
    q: &[f32],
    k: &[T],
    scale: f32,
    out: &mut Vec<f32>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx2::scores(order == ggml::DotOrder::Lanes64, q, k, scale, out);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (order, q, k, scale, out);
        false
    }
}

/// Attention's `PV` per lane, in ggml's order (see [`avx2::pv`]); `false`
/// when no vector kernel covers it here.
pub fn attention_pv<T: KvLanes>(
    lanes: usize,
    p: &[f32],
    v: crate::kv::KvView<'_, T>,
    bases: &[usize],
    bs: usize,
    acc: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx2::pv(lanes, p, v, bases, bs, acc);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (lanes, p, v, bases, bs, acc);
        false
    }
}

/// Elements per quantization block for every format we handle natively.
pub const QK: usize = 32;

/// Prompt rows up to which the fused kernel is used when a dense f32 copy of
/// the weights exists; above it the dense GEMM. (Decode steps take the
/// integer kernel at any batch size: see `linear::KernelRows::Decode`.)
pub const FUSED_MAX_ROWS: usize = 8;

/// Without a dense copy, formats the integer kernel does not cover (F16, F32,
/// Q4_0) use the f32 tile kernel up to this many rows and expand the weights
/// to f32 + GEMM above it.
pub const FUSED_MAX_ROWS_QUANTIZED_ONLY: usize = 64;

/// Weight block formats with native kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// ggml's K-quants: 256 values per block, Q8_K activations.
    K(kquant::KFormat),
}

impl BlockFormat {
    /// Whether llama.cpp multiplies this format with 8-bit activations.
    pub fn quantizes_activations(self) -> bool {
        matches!(
            self,
            BlockFormat::Q4_0
                | BlockFormat::Q4_1
                | BlockFormat::Q5_0
                | BlockFormat::Q5_1
                | BlockFormat::Q8_0
                | BlockFormat::K(_)
        )
    }

    /// The K-quant format, if this is one.
    pub fn kquant(self) -> Option<kquant::KFormat> {
        match self {
            BlockFormat::K(k) => Some(k),
            _ => None,
        }
    }

    /// Elements per block: [`QK`], or [`kquant::QK_K`] for K-quants.
    pub fn block_elems(self) -> usize {
        match self {
            BlockFormat::K(_) => kquant::QK_K,
            _ => QK,
        }
    }

    /// Bytes per block of [`Self::block_elems`] elements.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::F32 => 4 * QK,
            BlockFormat::F16 => 2 * QK,
            BlockFormat::Q4_0 => 2 + QK / 2,
            BlockFormat::Q4_1 => 4 + QK / 2,
            BlockFormat::Q5_0 => 6 + QK / 2,
            BlockFormat::Q5_1 => 8 + QK / 2,
            BlockFormat::Q8_0 => 2 + QK,
            BlockFormat::K(k) => k.block_bytes(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockFormat::F32 => "f32",
            BlockFormat::F16 => "f16",
            BlockFormat::Q4_0 => "q4_0",
            BlockFormat::Q4_1 => "q4_1",
            BlockFormat::Q5_0 => "q5_0",
            BlockFormat::Q5_1 => "q5_1",
            BlockFormat::Q8_0 => "q8_0",
            BlockFormat::K(kquant::KFormat::Q4K) => "q4_k",
            BlockFormat::K(kquant::KFormat::Q5K) => "q5_k",
            BlockFormat::K(kquant::KFormat::Q6K) => "q6_k",
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// A block format's dequantisation, monomorphised into the kernels.
trait Block {
    const BYTES: usize;
    fn dequant(b: &[u8], out: &mut [f32; QK]);
}

struct BF32;
struct BF16;
struct BQ4_0;
struct BQ4_1;
struct BQ5_0;
struct BQ5_1;
struct BQ8_0;

impl Block for BF32 {
    const BYTES: usize = 4 * QK;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

impl Block for BF16 {
    const BYTES: usize = 2 * QK;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
            *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
        }
    }
}

impl Block for BQ4_0 {
    const BYTES: usize = 2 + QK / 2;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        let d = f16_at(b, 0);
        let qs = &b[2..2 + QK / 2];
        for i in 0..QK / 2 {
            out[i] = ((qs[i] & 0x0f) as i32 - 8) as f32 * d;
            out[i + QK / 2] = ((qs[i] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

impl Block for BQ4_1 {
    const BYTES: usize = 4 + QK / 2;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..4 + QK / 2];
        for i in 0..QK / 2 {
            out[i] = ((qs[i] & 0x0f) as f32).mul_add(d, m);
            out[i + QK / 2] = ((qs[i] >> 4) as f32).mul_add(d, m);
        }
    }
}

/// The 32 nibbles of the 16 bytes `qs` in element order: the low nibbles
/// (elements 0..16), then the high ones (16..32).
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; QK] {
    std::array::from_fn(|j| match j < QK / 2 {
        true => qs[j] & 0x0f,
        false => qs[j - QK / 2] >> 4,
    })
}

/// A Q5_0/Q5_1 block's 5-bit codes: element `j` takes bit `j` of the
/// 32-bit `qh` at byte `at` as its fifth bit.
#[inline(always)]
fn q5_codes(b: &[u8], at: usize) -> [u8; QK] {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let mut q = nibbles(&b[at + 4..at + 4 + QK / 2]);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
    q
}

impl Block for BQ5_0 {
    const BYTES: usize = 6 + QK / 2;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        let d = f16_at(b, 0);
        for (o, q) in out.iter_mut().zip(q5_codes(b, 2)) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

impl Block for BQ5_1 {
    const BYTES: usize = 8 + QK / 2;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (o, q) in out.iter_mut().zip(q5_codes(b, 4)) {
            // ggml-base's `x*d + m`, built without FMA: two roundings.
            *o = q as f32 * d + m;
        }
    }
}

/// The signed 8-bit weights of a Q4_0 / Q5_0 / Q8_0 block, as ggml's
/// integer kernels multiply them (`q - 8`, `q - 16`, `q`).
pub(crate) fn signed_weights(fmt: BlockFormat, b: &[u8]) -> [i8; QK] {
    match fmt {
        BlockFormat::Q4_0 => nibbles(&b[2..2 + QK / 2]).map(|q| q as i8 - 8),
        BlockFormat::Q5_0 => q5_codes(b, 2).map(|q| q as i8 - 16),
        _ => std::array::from_fn(|j| b[2 + j] as i8),
    }
}

/// The unsigned codes of a Q4_1 / Q5_1 block.
pub(crate) fn unsigned_codes(fmt: BlockFormat, b: &[u8]) -> [u8; QK] {
    match fmt {
        BlockFormat::Q5_1 => q5_codes(b, 4),
        _ => nibbles(&b[4..4 + QK / 2]),
    }
}

impl Block for BQ8_0 {
    const BYTES: usize = 2 + QK;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32; QK]) {
        let d = f16_at(b, 0);
        for (o, &q) in out.iter_mut().zip(&b[2..2 + QK]) {
            *o = (q as i8) as f32 * d;
        }
    }
}

/// Dequantise one row (`row.len()` is a whole number of blocks) into `out`.
pub fn dequant_row(fmt: BlockFormat, row: &[u8], out: &mut [f32]) {
    match fmt {
        BlockFormat::F32 => dequant_row_t::<BF32>(row, out),
        BlockFormat::F16 => dequant_row_t::<BF16>(row, out),
        BlockFormat::Q4_0 => dequant_row_t::<BQ4_0>(row, out),
        BlockFormat::Q4_1 => dequant_row_t::<BQ4_1>(row, out),
        BlockFormat::Q5_0 => dequant_row_t::<BQ5_0>(row, out),
        BlockFormat::Q5_1 => dequant_row_t::<BQ5_1>(row, out),
        BlockFormat::Q8_0 => dequant_row_t::<BQ8_0>(row, out),
        BlockFormat::K(k) => kquant::dequant_row(k, row, out),
    }
}

fn dequant_row_t<B: Block>(row: &[u8], out: &mut [f32]) {
    let mut buf = [0f32; QK];
    for (blk, o) in row.chunks_exact(B::BYTES).zip(out.chunks_exact_mut(QK)) {
        B::dequant(blk, &mut buf);
        o.copy_from_slice(&buf);
    }
}

/// Dot products of one weight row with up to [`FUSED_MAX_ROWS`] activation
/// rows (`xs[r]` has the row's element count); results go to `out[r]`.
pub fn dot_rows(fmt: BlockFormat, wrow: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    match fmt {
        BlockFormat::F32 => dot_rows_t::<BF32>(wrow, xs, out),
        BlockFormat::F16 => dot_rows_t::<BF16>(wrow, xs, out),
        BlockFormat::Q4_0 => dot_rows_t::<BQ4_0>(wrow, xs, out),
        BlockFormat::Q4_1 => dot_rows_t::<BQ4_1>(wrow, xs, out),
        BlockFormat::Q5_0 => dot_rows_t::<BQ5_0>(wrow, xs, out),
        BlockFormat::Q5_1 => dot_rows_t::<BQ5_1>(wrow, xs, out),
        BlockFormat::Q8_0 => dot_rows_t::<BQ8_0>(wrow, xs, out),
        BlockFormat::K(_) => {
            // Not a kernel llama.cpp has (its K-quants always quantize the
            // activations, see `kdot`): dequantize, then the f32 tile kernel.
            let mut w = vec![0f32; xs.first().map_or(0, |x| x.len())];
            dequant_row(fmt, wrow, &mut w);
            let bytes: &[u8] = bytemuck::cast_slice(&w);
            dot_rows_t::<BF32>(bytes, xs, out)
        }
    }
}

fn dot_rows_t<B: Block>(wrow: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    // Tiles of 4 rows keep the accumulators (4 x 32 lanes) in registers.
    let mut r0 = 0;
    while r0 < xs.len() {
        let n = (xs.len() - r0).min(4);
        match n {
            4 => dot_tile::<B, 4>(wrow, &xs[r0..r0 + 4], &mut out[r0..r0 + 4]),
            3 => dot_tile::<B, 3>(wrow, &xs[r0..r0 + 3], &mut out[r0..r0 + 3]),
            2 => dot_tile::<B, 2>(wrow, &xs[r0..r0 + 2], &mut out[r0..r0 + 2]),
            _ => dot_tile::<B, 1>(wrow, &xs[r0..r0 + 1], &mut out[r0..r0 + 1]),
        }
        r0 += n;
    }
}

#[inline(always)]
fn dot_tile<B: Block, const R: usize>(wrow: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    let mut acc = [[0f32; QK]; R];
    let mut w = [0f32; QK];
    for (b, blk) in wrow.chunks_exact(B::BYTES).enumerate() {
        B::dequant(blk, &mut w);
        for r in 0..R {
            let x = &xs[r][b * QK..(b + 1) * QK];
            let a = &mut acc[r];
            for j in 0..QK {
                a[j] = w[j].mul_add(x[j], a[j]);
            }
        }
    }
    for r in 0..R {
        out[r] = hsum(&acc[r]);
    }
}

/// Horizontal sum of 32 lanes in a fixed order.
#[inline(always)]
fn hsum(a: &[f32; QK]) -> f32 {
    let mut s = [0f32; 8];
    for c in a.chunks_exact(8) {
        for l in 0..8 {
            s[l] += c[l];
        }
    }
    ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))
}

/// Round activations to the grid llama.cpp's CPU path multiplies quantized
/// weights with: per 32 values, `q = round_half_even(x * 127 / max|x|)`
/// times `d = max|x| / 127` stored as f16 (its Q8_0 / Q8_1 activation
/// blocks), so the dense GEMM sees the values the integer kernel sees.
pub fn round_to_q8_grid(x: &mut [f32]) {
    for blk in x.chunks_exact_mut(QK) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (d, id) = q8::scales(amax);
        let d16 = f16::from_f32(d).to_f32();
        for v in blk.iter_mut() {
            *v = (*v * id).round_ties_even() * d16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4_1_block(d: f32, m: f32, qs: [u8; 16]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(m).to_le_bytes());
        b.extend_from_slice(&qs);
        b
    }

    #[test]
    fn q4_1_dequant_matches_definition() {
        let qs: [u8; 16] = std::array::from_fn(|i| (i as u8) | ((15 - i as u8) << 4));
        let b = q4_1_block(0.5, -1.0, qs);
        let mut out = [0f32; QK];
        dequant_row(BlockFormat::Q4_1, &b, &mut out);
        for i in 0..16 {
            assert_eq!(out[i], i as f32 * 0.5 - 1.0);
            assert_eq!(out[i + 16], (15 - i) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn fused_dot_equals_dequant_then_dot_for_any_tile() {
        let qs: [u8; 16] = std::array::from_fn(|i| (i as u8 * 7) ^ 0x5a);
        let mut row = q4_1_block(0.25, 0.125, qs);
        row.extend(q4_1_block(-0.5, 2.0, [0x3c; 16]));
        let mut w = vec![0f32; 64];
        dequant_row(BlockFormat::Q4_1, &row, &mut w);
        let xs: Vec<Vec<f32>> = (0..7)
            .map(|r| {
                (0..64)
                    .map(|i| ((i * 31 + r * 17) % 23) as f32 * 0.1 - 1.0)
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
        let mut all = vec![0f32; 7];
        dot_rows(BlockFormat::Q4_1, &row, &refs, &mut all);
        for r in 0..7 {
            let mut one = [0f32];
            dot_rows(BlockFormat::Q4_1, &row, &refs[r..r + 1], &mut one);
            assert_eq!(one[0], all[r], "row {r} differs between tile sizes");
            let naive: f32 = w.iter().zip(&xs[r]).map(|(a, b)| a * b).sum();
            assert!((naive - one[0]).abs() < 1e-3, "{naive} vs {}", one[0]);
        }
    }

    /// The vector attention kernels give the element-wise definitions' bits:
    /// scores as `DotOrder::dot`, PV as fused multiply-adds per lane in
    /// position order, for both orders, f32 and f16 rows, head sizes 64, 128 and 256
    /// (Gemma 3's).
    #[test]
    fn attention_kernels_equal_the_elementwise_orders() {
        use ggml::DotOrder;
        fn check<T: KvLanes>(hd: usize, conv: impl Fn(f32) -> T, back: impl Fn(T) -> f32) {
            let (bs, n): (usize, usize) = (16, 45);
            let blocks = n.div_ceil(bs);
            // Blocks deliberately out of order in the pool, as a block table has them.
            let order = [2usize, 0, 1];
            let pool: Vec<T> = (0..blocks * bs * hd)
                .map(|i| conv(((i * 7919 % 1013) as f32 - 506.0) * 1.3e-3))
                .collect();
            let bases: Vec<usize> = order.iter().map(|&b| b * bs * hd).collect();
            let q: Vec<f32> = (0..hd)
                .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.07)
                .collect();
            let row = |t: usize| -> Vec<f32> {
                let at = bases[t / bs] + (t % bs) * hd;
                pool[at..at + hd].iter().map(|&v| back(v)).collect()
            };
            for order_ in [DotOrder::Lanes64, DotOrder::Lanes16] {
                let mut fast = Vec::new();
                for (bi, &b) in bases.iter().enumerate() {
                    let count = bs.min(n - bi * bs);
                    let vector =
                        attention_scores(order_, &q, &pool[b..b + count * hd], 0.125, &mut fast);
                    #[cfg(target_arch = "x86_64")]
                    assert_eq!(vector, avx2::available(), "AVX2 machines take the kernel");
                    if !vector {
                        return; // no vector kernel on this machine: nothing to compare
                    }
                }
                let slow: Vec<f32> = (0..n).map(|t| order_.dot(&q, &row(t)) * 0.125).collect();
                assert_eq!(fast, slow, "scores, {order_:?}, hd {hd}");

                let lanes = order_.lanes();
                let p: Vec<f32> = (0..n).map(|t| 1.0 / (t as f32 + 3.0)).collect();
                let mut acc = vec![0f32; lanes * hd];
                assert!(attention_pv(
                    lanes,
                    &p,
                    crate::kv::KvView::of(&pool),
                    &bases,
                    bs,
                    &mut acc
                ));
                let mut want = vec![0f32; lanes * hd];
                for t in 0..n {
                    let v = row(t);
                    let r = &mut want[(t % lanes) * hd..(t % lanes + 1) * hd];
                    for (a, x) in r.iter_mut().zip(&v) {
                        *a = p[t].mul_add(*x, *a);
                    }
                }
                assert_eq!(acc, want, "pv, {lanes} lanes, hd {hd}");
            }
        }
        for hd in [64, 128, 256] {
            check(hd, |v| v, |v| v);
            check(hd, f16::from_f32, f16::to_f32);
        }
    }
}
