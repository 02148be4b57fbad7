//! AVX2 kernels for [`super::q8`] and [`super::ggml`]. This module is the engine's one use of
//! `unsafe`: the intrinsics are `unsafe` because they need CPU features,
//! which [`available`] checks at run time before any of them is called.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::f16;

use super::q8::Q8Row;
use super::{BlockFormat, QK};

pub fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Up to 4 rows. Callers check [`available`] first.
pub fn dot_rows(fmt: BlockFormat, wrow: &[u8], xs: &[&Q8Row], out: &mut [f32]) {
    debug_assert!(available() && xs.len() <= 4 && out.len() >= xs.len());
    let nb = wrow.len() / fmt.block_bytes();
    for x in xs {
        assert!(x.q.len() >= nb * QK && x.d.len() >= nb && x.s.len() >= nb);
    }
    match fmt {
        // SAFETY: `available()` confirmed AVX2/FMA/F16C; the assert above
        // and `nb` bound every read to the slices' lengths.
        BlockFormat::Q4_1 => unsafe { q4_1(wrow, nb, xs, out) },
        // SAFETY: as above.
        BlockFormat::Q8_0 => unsafe { q8_0(wrow, nb, xs, out) },
        _ => {
            for (x, o) in xs.iter().zip(out.iter_mut()) {
                *o = super::q8::dot_scalar(fmt, wrow, x);
            }
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1(w: &[u8], nb: usize, xs: &[&Q8Row], out: &mut [f32]) {
    const BB: usize = 20;
    let n = xs.len();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0f32; 4];
    let low = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    for i in 0..nb {
        let blk = &w[i * BB..(i + 1) * BB];
        let dw = f16_at(blk, 0);
        let mw = f16_at(blk, 2);
        // SAFETY: `blk` has 20 bytes; bytes 4..20 are the 16 packed nibbles.
        let packed = unsafe { _mm_loadu_si128(blk.as_ptr().add(4) as *const __m128i) };
        let qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
        for r in 0..n {
            let x = xs[r];
            // SAFETY: x.q holds at least nb * 32 values (checked by the caller).
            let qx = unsafe { _mm256_loadu_si256(x.q.as_ptr().add(i * QK) as *const __m256i) };
            let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), ones);
            let scale = _mm256_set1_ps(dw * x.d[i]);
            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(prod), acc[r]);
            summs[r] += mw * x.s[i];
        }
    }
    for r in 0..n {
        out[r] = hsum(acc[r]) + summs[r];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0(w: &[u8], nb: usize, xs: &[&Q8Row], out: &mut [f32]) {
    const BB: usize = 34;
    let n = xs.len();
    let mut acc = [_mm256_setzero_ps(); 4];
    let ones = _mm256_set1_epi16(1);
    for i in 0..nb {
        let blk = &w[i * BB..(i + 1) * BB];
        let dw = f16_at(blk, 0);
        // SAFETY: `blk` has 34 bytes; bytes 2..34 are the 32 signed weights.
        let qw = unsafe { _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i) };
        let aw = _mm256_sign_epi8(qw, qw);
        for r in 0..n {
            let x = xs[r];
            // SAFETY: x.q holds at least nb * 32 values (checked by the caller).
            let qx = unsafe { _mm256_loadu_si256(x.q.as_ptr().add(i * QK) as *const __m256i) };
            let sx = _mm256_sign_epi8(qx, qw);
            let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
            let scale = _mm256_set1_ps(dw * x.d[i]);
            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(prod), acc[r]);
        }
    }
    for r in 0..n {
        out[r] = hsum(acc[r]);
    }
}

/// `ggml_vec_dot_f32`'s four 8-lane accumulators over the first
/// `n & !31` elements, reduced as `GGML_F32x8_REDUCE`. `None` without AVX2.
pub fn dot_lanes32(a: &[f32], b: &[f32]) -> Option<f32> {
    if !available() {
        return None;
    }
    let n = a.len().min(b.len()) & !31;
    // SAFETY: `available()` confirmed AVX2/FMA/F16C; every load reads 8 floats at
    // `i + 8j + 8 <= n`, within both slices.
    Some(unsafe { lanes32(a.as_ptr(), b.as_ptr(), n) })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes32(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut s = [_mm256_setzero_ps(); 4];
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
        i += 32;
    }
    let s0 = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
    let t0 = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

/// tinyBLAS's one 8-lane accumulator over the first `n & !7` elements, then
/// its `hsum`; `None` without AVX2.
pub fn dot_lanes8(a: &[f32], b: &[f32]) -> Option<f32> {
    if !available() {
        return None;
    }
    let n = a.len().min(b.len()) & !7;
    // SAFETY: `available()` confirmed AVX2/FMA/F16C; every load reads 8 floats at
    // `i + 8 <= n`, within both slices.
    Some(unsafe { lanes8(a.as_ptr(), b.as_ptr(), n) })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes8(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n (the caller's bound).
        let (x, y) = unsafe { (_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i))) };
        s = _mm256_fmadd_ps(x, y, s);
        i += 8;
    }
    hsum(s)
}
