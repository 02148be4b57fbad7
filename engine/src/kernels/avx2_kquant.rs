//! AVX2 integer lanes of the K-quant kernels ([`super::kdot`]). `unsafe`
//! because the intrinsics need CPU features, which [`available`] checks at
//! run time before any of them is called.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx2::available;

/// The integer lanes of ggml's K-quant kernels for one (weight block,
/// activation block) pair: per 32-value chunk `c`, `vpmaddubsw` of the codes
/// with the activation bytes (codes below 64 times signed bytes: a pair is at
/// most 2*63*127, no saturation), then `vpmaddwd` with the 16-bit scales of
/// the pairs, giving lane `l` = the scaled products of bytes `4l..4l+4`.
/// `lanes` gets their sum over the chunks; `parts[c]`, if given, each
/// chunk's own lanes. Exact integers. `false` (nothing written) without AVX2.
pub fn kquant_lanes(
    q: &[u8; 256],
    x: &[i8; 256],
    scales: &[[i16; 16]; 8],
    lanes: &mut [i32; 8],
    parts: Option<&mut [[i32; 8]; 8]>,
) -> bool {
    if !available() {
        return false;
    }
    // SAFETY: `available()` confirmed AVX2; every access is within the
    // fixed-size arrays (8 chunks of 32 bytes and 16 scales in, 8 i32 lanes
    // and 8 rows of 8 i32 out).
    unsafe { kquant_lanes_avx2(q, x, scales, lanes, parts) };
    true
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant_lanes_avx2(
    q: &[u8; 256],
    x: &[i8; 256],
    scales: &[[i16; 16]; 8],
    lanes: &mut [i32; 8],
    mut parts: Option<&mut [[i32; 8]; 8]>,
) {
    let mut sum = _mm256_setzero_si256();
    for c in 0..8 {
        // SAFETY: bytes `32c..32c+32` of both 256-byte arrays, the 32 bytes of
        // `scales[c]`, of `parts[c]` and of `lanes`; unaligned loads and stores.
        unsafe {
            let vq = _mm256_loadu_si256(q.as_ptr().add(32 * c).cast::<__m256i>());
            let vx = _mm256_loadu_si256(x.as_ptr().add(32 * c).cast::<__m256i>());
            let sc = _mm256_loadu_si256(scales[c].as_ptr().cast::<__m256i>());
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(vq, vx), sc);
            sum = _mm256_add_epi32(sum, p);
            if let Some(parts) = parts.as_deref_mut() {
                _mm256_storeu_si256(parts[c].as_mut_ptr().cast::<__m256i>(), p);
            }
        }
    }
    // SAFETY: the 32 bytes of `lanes`.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), sum) };
}
