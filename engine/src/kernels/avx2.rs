//! AVX2 kernels for [`super::q8`] and [`super::ggml`]. This module is the engine's one use of
//! `unsafe`: the intrinsics are `unsafe` because they need CPU features,
//! which [`available`] checks at run time before any of them is called.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::f16;

use super::q8::{Q8Tile, TILE};
use super::{BlockFormat, QK};

pub fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// The tile kernels of [`super::q8::dot_tile_rows`]: weight rows
/// `w[j * row_bytes..][..row_bytes]` against the tile, `out[r * stride + j]`.
/// One check and one dispatch for all rows (per row they cost as much as a
/// batch-1 row's products). `false` (nothing written) without AVX2 or for a
/// format they do not cover.
pub fn dot_tile_rows(
    fmt: BlockFormat,
    w: &[u8],
    row_bytes: usize,
    t: &Q8Tile,
    out: &mut [f32],
    stride: usize,
) -> bool {
    if !available() || !super::q8::supported(fmt) || row_bytes == 0 {
        return false;
    }
    let nb = row_bytes / fmt.block_bytes();
    let n = w.len() / row_bytes;
    assert!(
        (1..=TILE).contains(&t.rows)
            && row_bytes.is_multiple_of(fmt.block_bytes())
            && t.blocks >= nb
            && t.q.len() >= nb * t.rows * QK
            && t.d.len() >= nb * TILE
            && t.s.len() >= nb * TILE
            && (n == 0 || out.len() >= (t.rows - 1) * stride + n),
        "tile does not cover the weight rows"
    );
    macro_rules! run {
        ($f:ident) => {
            // SAFETY: for every arm, `available()` confirmed AVX2/FMA/F16C; the assert above
            // bounds every read to the slices' lengths (blocks `i < nb` of each weight row,
            // `R = t.rows` rows) and every write to `out`.
            unsafe {
                match t.rows {
                    1 => each_row::<1>(tile::<1, $f>, w, row_bytes, nb, t, out, stride),
                    2 => each_row::<2>(tile::<2, $f>, w, row_bytes, nb, t, out, stride),
                    3 => each_row::<3>(tile::<3, $f>, w, row_bytes, nb, t, out, stride),
                    4 => each_row::<4>(tile::<4, $f>, w, row_bytes, nb, t, out, stride),
                    5 => each_row::<5>(tile::<5, $f>, w, row_bytes, nb, t, out, stride),
                    6 => each_row::<6>(tile::<6, $f>, w, row_bytes, nb, t, out, stride),
                    7 => each_row::<7>(tile::<7, $f>, w, row_bytes, nb, t, out, stride),
                    _ => each_row::<8>(tile::<8, $f>, w, row_bytes, nb, t, out, stride),
                }
            }
        };
    }
    match fmt {
        BlockFormat::Q4_1 => run!(F_Q4_1),
        BlockFormat::Q4_0 => run!(F_Q4_0),
        BlockFormat::Q5_0 => run!(F_Q5_0),
        BlockFormat::Q5_1 => run!(F_Q5_1),
        _ => run!(F_Q8_0),
    }
    true
}

/// The formats of [`tile`], as const parameters.
const F_Q8_0: u8 = 0;
const F_Q4_1: u8 = 1;
const F_Q4_0: u8 = 2;
const F_Q5_0: u8 = 3;
const F_Q5_1: u8 = 4;

/// A tile kernel over every weight row of `w`.
type TileKernel = unsafe fn(&[u8], usize, &Q8Tile, &mut [f32]);

/// Runs `kernel` over every weight row of `w`, `out[r * stride + j]` for row `j`.
///
/// # Safety
/// AVX2/FMA/F16C must be available; `w` must hold `nb` blocks per `row_bytes` row, the
/// tile must cover `R` rows of `nb` blocks, and `out` every `(R - 1) * stride + j`.
#[inline(always)]
unsafe fn each_row<const R: usize>(
    kernel: TileKernel,
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    t: &Q8Tile,
    out: &mut [f32],
    stride: usize,
) {
    let mut buf = [0f32; TILE];
    for (j, row) in w.chunks_exact(row_bytes).enumerate() {
        // SAFETY: the caller's checks cover `row` (nb blocks) and the tile.
        unsafe { kernel(row, nb, t, &mut buf) };
        for (r, &v) in buf[..R].iter().enumerate() {
            out[r * stride + j] = v;
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// f16 at byte `i` of `p` as f32.
///
/// # Safety
/// `p.add(i)` and `p.add(i + 1)` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees both bytes are readable.
    let b = unsafe { [*p.add(i), *p.add(i + 1)] };
    f16::from_le_bytes(b).to_f32()
}

/// Blocks whose scales [`scales`] computes ahead of the integer products.
const SPAN: usize = 8;

/// `scale[k * 8 + r] = d_w * d_x[r]` for the blocks `i0..i0 + n` of a weight
/// row of `BB`-byte blocks at `wp`, and with `M` (Q4_1's minimum)
/// `summs += m_w * s_x` per block in order, as ggml's scalar `summs` lanes.
/// Written to memory so that the products loop broadcasts each scale with a
/// load (no vector ALU op; the ALU ports are what limits it).
///
/// # Safety
/// Blocks `i0..i0 + n` of the row must be readable and the tile must hold
/// them (`t.d`, `t.s`: 8 values per block); `n <= SPAN`.
#[inline(always)]
unsafe fn scales<const BB: usize, const M: bool>(
    wp: *const u8,
    i0: usize,
    n: usize,
    t: &Q8Tile,
    summs: &mut __m256,
    scale: &mut [f32; SPAN * TILE],
) {
    let (dp, sp) = (t.d.as_ptr(), t.s.as_ptr());
    for k in 0..n {
        let i = i0 + k;
        // SAFETY: the caller's bounds.
        unsafe {
            let blk = wp.add(i * BB);
            let dx = _mm256_loadu_ps(dp.add(i * TILE));
            let dw = _mm256_set1_ps(f16_at(blk, 0));
            _mm256_storeu_ps(scale.as_mut_ptr().add(k * TILE), _mm256_mul_ps(dw, dx));
            if M {
                let mw = _mm256_set1_ps(f16_at(blk, 2));
                let sx = _mm256_loadu_ps(sp.add(i * TILE));
                *summs = _mm256_add_ps(*summs, _mm256_mul_ps(mw, sx));
            }
        }
    }
}

/// One weight row against `R` activation rows, in format `F` (Q8_0, Q4_1,
/// Q4_0, Q5_0, Q5_1): per block the weight is unpacked once (Q4_1's nibbles
/// in registers, Q8_0's bytes as they are, the others' codes by
/// [`super::signed_weights`] / [`super::unsigned_codes`]; signed weights
/// give their magnitudes, their signs moved onto the activations) and each
/// row keeps its own 8-lane accumulator: the chain of ggml's
/// `ggml_vec_dot_q*_q8_*`, so every output is bit-identical to it.
///
/// # Safety
/// AVX2/FMA/F16C must be available; `w` must hold `nb` blocks and the tile must cover
/// `R` rows of `nb` blocks; `out` holds at least `R` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const F: u8>(w: &[u8], nb: usize, t: &Q8Tile, out: &mut [f32]) {
    let fmt = match F {
        F_Q8_0 => BlockFormat::Q8_0,
        F_Q4_1 => BlockFormat::Q4_1,
        F_Q4_0 => BlockFormat::Q4_0,
        F_Q5_0 => BlockFormat::Q5_0,
        _ => BlockFormat::Q5_1,
    };
    let bb = fmt.block_bytes();
    let with_min = F == F_Q4_1 || F == F_Q5_1;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = _mm256_setzero_ps();
    let mut scale = [0f32; SPAN * TILE];
    let low = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let (wp, qp) = (w.as_ptr(), t.q.as_ptr());
    for i0 in (0..nb).step_by(SPAN) {
        let n = SPAN.min(nb - i0);
        // SAFETY: blocks `i0..i0 + n <= nb` are within the row (`bb` bytes each:
        // f16 d, Q4_1/Q5_1's f16 m, Q5's 32 fifth bits, the codes); d and s hold
        // 8 values per block; the tile's q holds `R` blocks of 32 at `i * R * 32`.
        unsafe {
            match F {
                F_Q8_0 => scales::<34, false>(wp, i0, n, t, &mut summs, &mut scale),
                F_Q4_1 => scales::<20, true>(wp, i0, n, t, &mut summs, &mut scale),
                F_Q4_0 => scales::<18, false>(wp, i0, n, t, &mut summs, &mut scale),
                F_Q5_0 => scales::<22, false>(wp, i0, n, t, &mut summs, &mut scale),
                _ => scales::<24, true>(wp, i0, n, t, &mut summs, &mut scale),
            }
            for k in 0..n {
                let blk = wp.add((i0 + k) * bb);
                // `u`: the unsigned weight operand; `signs`: the signed weights,
                // whose signs go onto the activations.
                let (u, signs) = match F {
                    F_Q4_1 => {
                        let packed = _mm_loadu_si128(blk.add(4) as *const __m128i);
                        let qw = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
                        (_mm256_and_si256(qw, low), low)
                    }
                    F_Q8_0 => {
                        let qw = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                        (_mm256_sign_epi8(qw, qw), qw)
                    }
                    F_Q4_0 => {
                        let qw = _mm256_sub_epi8(nibbles(blk.add(2), low), _mm256_set1_epi8(8));
                        (_mm256_sign_epi8(qw, qw), qw)
                    }
                    F_Q5_0 => {
                        // The fifth bit clear: the code minus 16 is the nibble | 0xF0.
                        let hi =
                            _mm256_andnot_si256(bits_to_bytes(blk.add(2)), _mm256_set1_epi8(-16));
                        let qw = _mm256_or_si256(nibbles(blk.add(6), low), hi);
                        (_mm256_sign_epi8(qw, qw), qw)
                    }
                    _ => {
                        let hi = _mm256_and_si256(bits_to_bytes(blk.add(4)), _mm256_set1_epi8(16));
                        (_mm256_or_si256(nibbles(blk.add(8), low), hi), low)
                    }
                };
                let qx = qp.add((i0 + k) * R * QK);
                for (r, a) in acc.iter_mut().enumerate() {
                    let mut x = _mm256_loadu_si256(qx.add(r * QK) as *const __m256i);
                    if !with_min {
                        x = _mm256_sign_epi8(x, signs);
                    }
                    let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
                    let sc = _mm256_broadcast_ss(&scale[k * TILE + r]);
                    *a = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(prod), *a);
                }
            }
        }
    }
    let mut sm = [0f32; 8];
    // SAFETY: `sm` has room for 8 floats.
    unsafe { _mm256_storeu_ps(sm.as_mut_ptr(), summs) };
    for r in 0..R {
        out[r] = match with_min {
            true => hsum(acc[r]) + sm[r],
            false => hsum(acc[r]),
        };
    }
}

/// The 32 nibbles of the 16 bytes at `p`, low nibbles first (elements
/// 0..16), then high (16..32), as bytes.
///
/// # Safety
/// AVX2 must be available; 16 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8, low: __m256i) -> __m256i {
    // SAFETY: the caller guarantees the 16 bytes.
    let packed = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low)
}

/// ggml's `bytes_from_bits_32`: byte `j` is 0xFF where bit `j` of the
/// little-endian u32 at `p` is set, else 0.
///
/// # Safety
/// AVX2 must be available; 4 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the 4 bytes (read unaligned).
    let x = unsafe { (p as *const u32).read_unaligned() };
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// `ggml_vec_dot_f32`'s four 16-lane accumulators (eight 8-lane registers:
/// register `2a + h` holds lanes `8h..8h + 8` of accumulator `a`) over the
/// first `n & !63` elements, reduced as `GGML_F32x16_REDUCE`. `None` without
/// AVX2.
pub fn dot_lanes64(a: &[f32], b: &[f32]) -> Option<f32> {
    if !available() {
        return None;
    }
    let n = a.len().min(b.len()) & !63;
    // SAFETY: `available()` confirmed AVX2/FMA/F16C; every load reads 8 floats at
    // `i + 8j + 8 <= n`, within both slices.
    Some(unsafe { lanes64(a.as_ptr(), b.as_ptr(), n) })
}

/// # Safety
/// AVX2/FMA must be available and `n` floats readable at `a` and at `b` (`n` a multiple
/// of 64).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes64(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut s = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < n {
        for (j, sj) in s.iter_mut().enumerate() {
            // SAFETY: i + 8j + 8 <= n (the caller's bound).
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.add(i + 8 * j)),
                    _mm256_loadu_ps(b.add(i + 8 * j)),
                )
            };
            *sj = _mm256_fmadd_ps(x, y, *sj);
        }
        i += 64;
    }
    reduce64(&s)
}

/// `GGML_F32x16_REDUCE` of four 16-lane accumulators held as eight 8-lane
/// registers: `(x0 + x2) + (x1 + x3)` lane-wise, then `_mm512_reduce_add_ps`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce64(s: &[__m256; 8]) -> f32 {
    let lo = _mm256_add_ps(_mm256_add_ps(s[0], s[4]), _mm256_add_ps(s[2], s[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(s[1], s[5]), _mm256_add_ps(s[3], s[7]));
    hsum(_mm256_add_ps(lo, hi))
}

/// tinyBLAS's one 16-lane accumulator (two 8-lane registers) over the first
/// `n & !15` elements, then `_mm512_reduce_add_ps`; `None` without AVX2.
pub fn dot_lanes16(a: &[f32], b: &[f32]) -> Option<f32> {
    if !available() {
        return None;
    }
    let n = a.len().min(b.len()) & !15;
    // SAFETY: `available()` confirmed AVX2/FMA/F16C; every load reads 8 floats at
    // `i + 8h + 8 <= n`, within both slices.
    Some(unsafe { lanes16(a.as_ptr(), b.as_ptr(), n) })
}

/// # Safety
/// AVX2/FMA must be available and `n` floats readable at `a` and at `b` (`n` a multiple
/// of 16).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes16(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut s = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i < n {
        for (h, sh) in s.iter_mut().enumerate() {
            // SAFETY: i + 8h + 8 <= n (the caller's bound).
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.add(i + 8 * h)),
                    _mm256_loadu_ps(b.add(i + 8 * h)),
                )
            };
            *sh = _mm256_fmadd_ps(x, y, *sh);
        }
        i += 16;
    }
    hsum(_mm256_add_ps(s[0], s[1]))
}

/// KV element types the attention kernels read: 8 of them widened to f32.
pub trait KvLoad: Copy {
    /// # Safety
    /// 8 elements must be readable at `p`, and AVX2/F16C available.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvLoad for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl KvLoad for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller's contract (8 halves are 16 bytes).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// `out.push(dot(q, row) * scale)` for each row of `k` (rows of `q.len()`
/// elements), in the order of [`dot_lanes64`] (`lanes64`) or [`dot_lanes16`],
/// with `q` held in registers (at 256, partly in L1). `false` (nothing pushed) without AVX2
/// or for a head size other than 64, 128 or 256.
pub fn scores<T: KvLoad>(
    lanes64: bool,
    q: &[f32],
    k: &[T],
    scale: f32,
    out: &mut Vec<f32>,
) -> bool {
    if !available() {
        return false;
    }
    let rows = k.len() / q.len().max(1);
    // SAFETY: for both arms, `available()` confirmed AVX2/FMA/F16C; `q` has
    // `8 * N` elements and `k` at least `rows * 8 * N`.
    unsafe {
        match q.len() {
            64 => scores_n::<T, 8>(lanes64, q.as_ptr(), k.as_ptr(), rows, scale, out),
            128 => scores_n::<T, 16>(lanes64, q.as_ptr(), k.as_ptr(), rows, scale, out),
            256 => scores_n::<T, 32>(lanes64, q.as_ptr(), k.as_ptr(), rows, scale, out),
            _ => return false,
        }
    }
    true
}

/// Head size `8 * N` (`N` a multiple of 8).
///
/// # Safety
/// AVX2/FMA/F16C must be available; `8 * N` elements readable at `q` and
/// `rows * 8 * N` at `k`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_n<T: KvLoad, const N: usize>(
    lanes64: bool,
    q: *const f32,
    k: *const T,
    rows: usize,
    scale: f32,
    out: &mut Vec<f32>,
) {
    // SAFETY: `q` holds 8 * N floats.
    let qv: [__m256; N] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(q.add(8 * i)) });
    let base = out.len();
    out.resize(base + rows, 0.0);
    let dst = &mut out[base..];
    // One loop per order, so that `q` and the accumulators stay in registers.
    if lanes64 {
        for (j, d) in dst.iter_mut().enumerate() {
            // SAFETY: row `j < rows` has 8 * N elements within `k`.
            let kp = unsafe { k.add(j * 8 * N) };
            let mut s = [_mm256_setzero_ps(); 8];
            for i in 0..N {
                // SAFETY: element 8i + 8 <= 8N of the row.
                let kv = unsafe { T::load8(kp.add(8 * i)) };
                s[i % 8] = _mm256_fmadd_ps(qv[i], kv, s[i % 8]);
            }
            *d = reduce64(&s) * scale;
        }
    } else {
        for (j, d) in dst.iter_mut().enumerate() {
            // SAFETY: as above.
            let kp = unsafe { k.add(j * 8 * N) };
            let mut s = [_mm256_setzero_ps(); 2];
            for (i, qi) in qv.iter().enumerate() {
                // SAFETY: as above.
                let kv = unsafe { T::load8(kp.add(8 * i)) };
                s[i % 2] = _mm256_fmadd_ps(*qi, kv, s[i % 2]);
            }
            *d = hsum(_mm256_add_ps(s[0], s[1])) * scale;
        }
    }
}

/// Attention's `PV` in ggml's order: for each lane `l < lanes`, row `l` of
/// `acc` (rows of `hd`) becomes `sum p[t] * V_t` over `t = l, l + lanes, ...
/// < p.len()`, accumulated in increasing `t` with fused multiply-adds. `V_t`
/// is the row at `v[bases[t / bs] + (t % bs) * hd..]`. The lane's row stays
/// in registers, 64 columns at a time (each column's sum is its own chain, so the split
/// does not change it; 16 accumulators of 8 would not fit AVX2's 16 registers, and their
/// spills made the kernel's speed depend on where the KV pool sits, by up to 2x). `false` (nothing written) without AVX2,
/// for a head size other than 64, 128 or 256, or a block size that is not a power of two.
pub fn pv<T: KvLoad>(
    lanes: usize,
    p: &[f32],
    v: crate::kv::KvView<'_, T>,
    bases: &[usize],
    bs: usize,
    acc: &mut [f32],
) -> bool {
    let hd = acc.len() / lanes.max(1);
    if !available() || !bs.is_power_of_two() || !matches!(hd, 64 | 128 | 256) {
        return false;
    }
    assert!(
        p.len() <= bases.len() * bs && bases.iter().all(|&b| b + bs * hd <= v.len()),
        "positions outside the KV rows"
    );
    // SAFETY: `available()` confirmed AVX2/FMA/F16C; the assert bounds every row
    // `t < p.len()` (of `hd` elements) to `v`, `acc` has `lanes` rows of `hd`, and each
    // call's columns `col..col + 64` lie within `hd` (a multiple of 64).
    unsafe {
        for col in (0..hd).step_by(64) {
            pv_n::<T, 8>(lanes, p, v.as_ptr(), bases, bs, acc, hd, col);
        }
    }
    true
}

/// Columns `col..col + 8N` of rows of `hd` elements.
///
/// # Safety
/// AVX2/FMA/F16C must be available; `col + 8 * N <= hd`; for every position `t < p.len()`
/// the row `bases[t / bs] + (t % bs) * hd` of `hd` elements must be readable at `v`, and
/// `acc` must hold `lanes` rows of `hd`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_n<T: KvLoad, const N: usize>(
    lanes: usize,
    p: &[f32],
    v: *const T,
    bases: &[usize],
    bs: usize,
    acc: &mut [f32],
    hd: usize,
    col: usize,
) {
    let shift = bs.trailing_zeros();
    let n = p.len();
    for (lane, row) in acc.chunks_exact_mut(hd).enumerate().take(n.min(lanes)) {
        let mut a = [_mm256_setzero_ps(); N];
        let mut t = lane;
        while t < n {
            let pt = _mm256_set1_ps(p[t]);
            // SAFETY: `t < n`, so its row is within `v` (the caller's assert), and
            // `col + 8N <= hd`.
            let vp = unsafe { v.add(bases[t >> shift] + (t & (bs - 1)) * hd + col) };
            for (i, ai) in a.iter_mut().enumerate() {
                // SAFETY: element 8i + 8 <= 8N of the row.
                *ai = _mm256_fmadd_ps(pt, unsafe { T::load8(vp.add(8 * i)) }, *ai);
            }
            t += lanes;
        }
        for (i, ai) in a.iter().enumerate() {
            // SAFETY: `row` has `hd >= col + 8N` floats.
            unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(col + 8 * i), *ai) };
        }
    }
}
