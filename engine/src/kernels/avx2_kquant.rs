//! AVX2 integer lanes of the K-quant kernels ([`super::kdot`]) and the unpacking of their
//! codes. `unsafe` because the intrinsics need CPU features, which [`available`] checks at
//! run time before any of them is called.
//!
//! Everything here is exact integer arithmetic (or byte shuffling), so its results equal the
//! portable forms' bit for bit whatever the order of the sums: `kdot`'s and `kquant`'s tests
//! compare them.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx2::available;
use super::kquant::QK_K;

/// What one (weight block, activation block) pair gives the float kernels, all exact:
/// - `lanes[l]`: over the 8 chunks of 32 values `c`, the scaled products of elements
///   `32c+4l..32c+4l+4` (ggml's `vpmaddubsw` of the codes with the activation bytes, codes
///   below 64 times signed bytes, at most 2*63*127 a pair: no saturation; then `vpmaddwd`
///   with the 16-bit scales of the pairs), less `32 * (sc6[2l]*bsums[2l] +
///   sc6[2l+1]*bsums[2l+1])` when `sc6` (Q6_K's offset) is given;
/// - `chunks[c]`, if given: chunk `c`'s own scaled sum (the sum of its 8 lanes, offset not
///   taken);
/// - `mins[s]`: `m[s] * (bsums[2s] + bsums[2s+1])` when `m_pairs` (`m[s]` twice per `s`)
///   is given, else untouched.
///
/// `false` (nothing written) without AVX2.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn block_terms(
    q: &[u8; QK_K],
    x: &[i8; QK_K],
    scales: &[[i16; 16]; 8],
    bsums: &[i16; 16],
    m_pairs: Option<&[i16; 16]>,
    sc6: Option<&[i16; 16]>,
    lanes: &mut [i32; 8],
    chunks: Option<&mut [i32; 8]>,
    mins: &mut [i32; 8],
) -> bool {
    if !available() {
        return false;
    }
    // SAFETY: `available()` confirmed AVX2; every access is within the fixed-size arrays
    // (8 chunks of 32 bytes, 8 rows of 16 scales and 16 sums in; 8 i32 per output).
    unsafe { block_terms_avx2(q, x, scales, bsums, m_pairs, sc6, lanes, chunks, mins) };
    true
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_terms_avx2(
    q: &[u8; QK_K],
    x: &[i8; QK_K],
    scales: &[[i16; 16]; 8],
    bsums: &[i16; 16],
    m_pairs: Option<&[i16; 16]>,
    sc6: Option<&[i16; 16]>,
    lanes: &mut [i32; 8],
    chunks: Option<&mut [i32; 8]>,
    mins: &mut [i32; 8],
) {
    let mut p = [_mm256_setzero_si256(); 8];
    for (c, pc) in p.iter_mut().enumerate() {
        // SAFETY: bytes `32c..32c+32` of both 256-byte arrays and the 32 bytes of
        // `scales[c]`; unaligned loads.
        unsafe {
            let vq = _mm256_loadu_si256(q.as_ptr().add(32 * c).cast::<__m256i>());
            let vx = _mm256_loadu_si256(x.as_ptr().add(32 * c).cast::<__m256i>());
            let sc = _mm256_loadu_si256(scales[c].as_ptr().cast::<__m256i>());
            *pc = _mm256_madd_epi16(_mm256_maddubs_epi16(vq, vx), sc);
        }
    }
    let sum = _mm256_add_epi32(
        _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
        _mm256_add_epi32(_mm256_add_epi32(p[4], p[5]), _mm256_add_epi32(p[6], p[7])),
    );
    // Each chunk's horizontal sum: within 128-bit halves `hadd` gives
    // [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, ...]; twice more gives each chunk's low and high
    // half, which one cross-half add joins, chunk `c` in lane `c`.
    if let Some(chunks) = chunks {
        let h01 = _mm256_hadd_epi32(p[0], p[1]);
        let h23 = _mm256_hadd_epi32(p[2], p[3]);
        let h45 = _mm256_hadd_epi32(p[4], p[5]);
        let h67 = _mm256_hadd_epi32(p[6], p[7]);
        let g0 = _mm256_hadd_epi32(h01, h23);
        let g1 = _mm256_hadd_epi32(h45, h67);
        let per_chunk = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(g0, g1),
            _mm256_permute2x128_si256::<0x31>(g0, g1),
        );
        // SAFETY: the 32 bytes of `chunks`.
        unsafe { _mm256_storeu_si256(chunks.as_mut_ptr().cast::<__m256i>(), per_chunk) };
    }
    // SAFETY: the 32 bytes of `bsums` and of each given 16 x i16 array.
    let vb = unsafe { _mm256_loadu_si256(bsums.as_ptr().cast::<__m256i>()) };
    let lanes_v = match sc6 {
        // SAFETY: as above.
        Some(s) => unsafe {
            let vs = _mm256_loadu_si256(s.as_ptr().cast::<__m256i>());
            _mm256_sub_epi32(sum, _mm256_slli_epi32::<5>(_mm256_madd_epi16(vb, vs)))
        },
        None => sum,
    };
    // SAFETY: the 32 bytes of `lanes`.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), lanes_v) };
    if let Some(m) = m_pairs {
        // SAFETY: the 32 bytes of `m` and of `mins`.
        unsafe {
            let vm = _mm256_loadu_si256(m.as_ptr().cast::<__m256i>());
            _mm256_storeu_si256(
                mins.as_mut_ptr().cast::<__m256i>(),
                _mm256_madd_epi16(vb, vm),
            );
        }
    }
}

/// The codes of one Q4_K (`qh` absent) or Q5_K (`qh`: the 32 bytes of fifth bits) block in
/// element order: chunk `c` of 64 takes the low nibbles of `qs[32c..32c+32]` then their high
/// nibbles, bit `2c` / `2c+1` of `qh[e]` on top. `false` (nothing written) without AVX2.
#[inline]
pub fn unpack_q45(qs: &[u8; 128], qh: Option<&[u8; 32]>, out: &mut [u8; QK_K]) -> bool {
    if !available() {
        return false;
    }
    // SAFETY: `available()` confirmed AVX2; 4 loads of 32 bytes within `qs`, one of `qh`,
    // 8 stores of 32 bytes within `out`.
    unsafe { unpack_q45_avx2(qs, qh, out) };
    true
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_q45_avx2(qs: &[u8; 128], qh: Option<&[u8; 32]>, out: &mut [u8; QK_K]) {
    let low = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    // SAFETY: the 32 bytes of `qh`.
    let vh = qh.map(|h| unsafe { _mm256_loadu_si256(h.as_ptr().cast::<__m256i>()) });
    for c in 0..4 {
        // SAFETY: bytes `32c..32c+32` of `qs`, `64c..64c+64` of `out`.
        unsafe {
            let b = _mm256_loadu_si256(qs.as_ptr().add(32 * c).cast::<__m256i>());
            let mut lo = _mm256_and_si256(b, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(b), low);
            if let Some(vh) = vh {
                // Bit `2c` of each byte to bit 4 of `lo`, bit `2c+1` to bit 4 of `hi`
                // (shifts of 16-bit lanes: the mask keeps each byte's own bit).
                let s = _mm_cvtsi32_si128(2 * c as i32);
                let bits = _mm256_srl_epi16(vh, s);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(bits, one)));
                let bits = _mm256_srli_epi16::<1>(bits);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(bits, one)));
            }
            _mm256_storeu_si256(out.as_mut_ptr().add(64 * c).cast::<__m256i>(), lo);
            _mm256_storeu_si256(out.as_mut_ptr().add(64 * c + 32).cast::<__m256i>(), hi);
        }
    }
}

/// The codes of one Q6_K block (`ql`: 128 bytes of low nibbles, `qh`: 64 bytes of 2-bit
/// pairs) in element order, unsigned (0..64): half `h`, element `l` of each 32-value quarter
/// `k`: low nibble (`k` 0, 1) or high nibble (`k` 2, 3) of `ql[64h + l (+32 for k odd)]`,
/// with bits `2k..2k+2` of `qh[32h + l]` above. `false` (nothing written) without AVX2.
#[inline]
pub fn unpack_q6(ql: &[u8; 128], qh: &[u8; 64], out: &mut [u8; QK_K]) -> bool {
    if !available() {
        return false;
    }
    // SAFETY: `available()` confirmed AVX2; loads of 32 bytes within `ql` and `qh`, stores
    // of 32 bytes within `out`.
    unsafe { unpack_q6_avx2(ql, qh, out) };
    true
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_q6_avx2(ql: &[u8; 128], qh: &[u8; 64], out: &mut [u8; QK_K]) {
    let low = _mm256_set1_epi8(0x0f);
    let two = _mm256_set1_epi8(0x30);
    for h in 0..2 {
        // SAFETY: bytes `64h..64h+64` of `ql`, `32h..32h+32` of `qh`, `128h..128h+128` of
        // `out`.
        unsafe {
            let a = _mm256_loadu_si256(ql.as_ptr().add(64 * h).cast::<__m256i>());
            let b = _mm256_loadu_si256(ql.as_ptr().add(64 * h + 32).cast::<__m256i>());
            let vh = _mm256_loadu_si256(qh.as_ptr().add(32 * h).cast::<__m256i>());
            // Bits 2k..2k+2 of qh moved to bits 4..6 (16-bit shifts, then masked per byte).
            let h0 = _mm256_and_si256(_mm256_slli_epi16::<4>(vh), two);
            let h1 = _mm256_and_si256(_mm256_slli_epi16::<2>(vh), two);
            let h2 = _mm256_and_si256(vh, two);
            let h3 = _mm256_and_si256(_mm256_srli_epi16::<2>(vh), two);
            let quarters = [
                _mm256_or_si256(_mm256_and_si256(a, low), h0),
                _mm256_or_si256(_mm256_and_si256(b, low), h1),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), low), h2),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b), low), h3),
            ];
            for (k, v) in quarters.into_iter().enumerate() {
                _mm256_storeu_si256(out.as_mut_ptr().add(128 * h + 32 * k).cast::<__m256i>(), v);
            }
        }
    }
}
