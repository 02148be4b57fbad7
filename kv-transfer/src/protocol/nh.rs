//! NH, the first layer of the frame MAC: the ε-almost-universal hash of UMAC, with the
//! parameters of Adiantum's NHPoly1305 (Linux `crypto/nhpoly1305.c`): four passes over
//! 1024-byte chunks, 32-bit words, a 1072-byte key, a 32-byte output per chunk.
//!
//! ```text
//! for each 16-byte unit i of the chunk (words m0..m3), key words k = key[4i..]:
//!   sum[p] += (m0 + k[4p])   * (m2 + k[4p+2])     (u32 adds, u64 products and sums,
//!   sum[p] += (m1 + k[4p+1]) * (m3 + k[4p+3])      all wrapping), p = 0..4
//! output: sum[0..4] as little-endian u64s
//! ```
//!
//! This module is the only one of the frame MAC with `unsafe` code: the AVX2 kernel, selected
//! at run time when the CPU has AVX2, and checked against the portable kernel by the tests
//! below (every length, random keys and inputs).
//!
//! Invariant: both kernels return identical sums for every input; the caller passes at most
//! [`CHUNK`] bytes, a multiple of [`UNIT`].
#![allow(unsafe_code)]

/// Bytes of one NH chunk.
pub(crate) const CHUNK: usize = 1024;
/// Bytes of one NH message unit.
pub(crate) const UNIT: usize = 16;
/// Key words: one per message word plus the Toeplitz shift of the three extra passes.
pub(crate) const KEY_WORDS: usize = CHUNK / 4 + 12;
/// Bytes of one NH output.
pub(crate) const OUT: usize = 32;

/// An NH key, with its words laid out per unit for the vector kernel.
pub(crate) struct NhKey {
    words: [u32; KEY_WORDS],
    /// Per unit `i`: `[k0,k1,k4,k5,k8,k9,k12,k13]` of `key[4i..]` (the m0/m1 operands).
    a: Box<[[u32; 8]; CHUNK / UNIT]>,
    /// Per unit `i`: `[k2,k3,k6,k7,k10,k11,k14,k15]` of `key[4i..]` (the m2/m3 operands).
    b: Box<[[u32; 8]; CHUNK / UNIT]>,
    avx2: bool,
}

impl NhKey {
    pub(crate) fn new(words: [u32; KEY_WORDS]) -> NhKey {
        let mut a = Box::new([[0u32; 8]; CHUNK / UNIT]);
        let mut b = Box::new([[0u32; 8]; CHUNK / UNIT]);
        for (i, (a, b)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
            let k = &words[4 * i..4 * i + 16];
            *a = [k[0], k[1], k[4], k[5], k[8], k[9], k[12], k[13]];
            *b = [k[2], k[3], k[6], k[7], k[10], k[11], k[14], k[15]];
        }
        NhKey {
            words,
            a,
            b,
            avx2: avx2_available(),
        }
    }

    /// NH of `m` (at most [`CHUNK`] bytes, a multiple of [`UNIT`]; the caller pads).
    pub(crate) fn hash(&self, m: &[u8]) -> [u8; OUT] {
        debug_assert!(m.len() <= CHUNK && m.len() % UNIT == 0);
        let sums = if self.avx2 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `avx2` is true only when the CPU reported AVX2 at construction.
            unsafe {
                x86::nh_avx2(self, m)
            }
            #[cfg(not(target_arch = "x86_64"))]
            nh_portable(&self.words, m)
        } else {
            nh_portable(&self.words, m)
        };
        let mut out = [0u8; OUT];
        for (o, s) in out.chunks_exact_mut(8).zip(sums) {
            o.copy_from_slice(&s.to_le_bytes());
        }
        out
    }
}

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn word(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// The portable kernel, a transcription of Linux's `nh_generic`.
pub(crate) fn nh_portable(key: &[u32; KEY_WORDS], m: &[u8]) -> [u64; 4] {
    let mut sums = [0u64; 4];
    for (i, u) in m.chunks_exact(UNIT).take(CHUNK / UNIT).enumerate() {
        let (m0, m1, m2, m3) = (word(u, 0), word(u, 1), word(u, 2), word(u, 3));
        let k = &key[4 * i..4 * i + 16];
        for (p, sum) in sums.iter_mut().enumerate() {
            let x = u64::from(m0.wrapping_add(k[4 * p])) * u64::from(m2.wrapping_add(k[4 * p + 2]));
            let y =
                u64::from(m1.wrapping_add(k[4 * p + 1])) * u64::from(m3.wrapping_add(k[4 * p + 3]));
            *sum = sum.wrapping_add(x).wrapping_add(y);
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32,
        _mm256_set1_epi64x, _mm256_setzero_si256, _mm256_srli_epi64, _mm256_storeu_si256,
    };

    use super::{NhKey, CHUNK, UNIT};

    /// One unit: 64-bit lane `p` of the result holds pass `p`'s two products.
    ///
    /// # Safety
    /// The CPU must support AVX2; `at + UNIT <= m.len()`; `unit < CHUNK / UNIT`.
    #[target_feature(enable = "avx2")]
    unsafe fn unit(key: &NhKey, m: &[u8], at: usize, unit: usize) -> __m256i {
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        lo.copy_from_slice(&m[at..at + 8]);
        hi.copy_from_slice(&m[at + 8..at + UNIT]);
        // Every 64-bit lane holds (m0, m1), resp. (m2, m3).
        let mlo = _mm256_set1_epi64x(i64::from_le_bytes(lo));
        let mhi = _mm256_set1_epi64x(i64::from_le_bytes(hi));
        // SAFETY: `unit < CHUNK / UNIT` indexes a `[u32; 8]` (32 bytes); unaligned load.
        let (ka, kb) = unsafe {
            (
                _mm256_loadu_si256(key.a[unit].as_ptr().cast::<__m256i>()),
                _mm256_loadu_si256(key.b[unit].as_ptr().cast::<__m256i>()),
            )
        };
        let x = _mm256_add_epi32(mlo, ka);
        let y = _mm256_add_epi32(mhi, kb);
        // Even u32 lanes: (m0 + k[4p]) * (m2 + k[4p+2]); odd lanes shifted down: m1 * m3 terms.
        let even = _mm256_mul_epu32(x, y);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(y, 32));
        _mm256_add_epi64(even, odd)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn nh_avx2(key: &NhKey, m: &[u8]) -> [u64; 4] {
        let units = (m.len() / UNIT).min(CHUNK / UNIT);
        let mut acc0 = _mm256_setzero_si256();
        let mut acc1 = _mm256_setzero_si256();
        let mut i = 0;
        while i + 1 < units {
            // SAFETY: AVX2 per this function's contract; `i + 1 < units` bounds both units.
            unsafe {
                acc0 = _mm256_add_epi64(acc0, unit(key, m, i * UNIT, i));
                acc1 = _mm256_add_epi64(acc1, unit(key, m, (i + 1) * UNIT, i + 1));
            }
            i += 2;
        }
        if i < units {
            // SAFETY: as above, for the last unit.
            unsafe {
                acc0 = _mm256_add_epi64(acc0, unit(key, m, i * UNIT, i));
            }
        }
        let mut out = [0u64; 4];
        // SAFETY: `out` is 32 bytes; unaligned store.
        unsafe {
            _mm256_storeu_si256(
                out.as_mut_ptr().cast::<__m256i>(),
                _mm256_add_epi64(acc0, acc1),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key_from(seed: u32) -> [u32; KEY_WORDS] {
        let mut k = [0u32; KEY_WORDS];
        let mut x = seed | 1;
        for w in &mut k {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *w = x;
        }
        k
    }

    #[test]
    fn portable_kernel_matches_the_definition_on_one_unit() {
        let mut key = [0u32; KEY_WORDS];
        for (i, k) in key.iter_mut().enumerate() {
            *k = i as u32;
        }
        let m: Vec<u8> = [u32::MAX, 2, 3, 4]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let s = nh_portable(&key, &m);
        // pass 0: (MAX + 0) wraps to MAX; (2 + 1) * (4 + 3)
        let want0 = u64::from(u32::MAX) * u64::from(3u32 + 2) + 3 * 7;
        assert_eq!(s[0], want0);
        // pass 1 uses key words 4..8: (MAX + 4) wraps to 3.
        assert_eq!(s[1], 3 * (3 + 6) + (2 + 5) * (4 + 7));
    }

    proptest! {
        #[test]
        fn vector_and_portable_kernels_agree(seed in any::<u32>(), units in 0usize..=64, fill in any::<u8>()) {
            let key = NhKey::new(key_from(seed));
            let m: Vec<u8> = (0..units * UNIT).map(|i| (i as u8).wrapping_mul(fill) ^ (seed as u8)).collect();
            let want = nh_portable(&key.words, &m);
            let mut bytes = [0u8; OUT];
            for (o, s) in bytes.chunks_exact_mut(8).zip(want) {
                o.copy_from_slice(&s.to_le_bytes());
            }
            prop_assert_eq!(key.hash(&m), bytes);
        }
    }

    #[test]
    fn this_machine_uses_the_vector_kernel_where_it_has_avx2() {
        let key = NhKey::new(key_from(7));
        #[cfg(target_arch = "x86_64")]
        assert_eq!(key.avx2, std::is_x86_feature_detected!("avx2"));
        let _ = key;
    }
}
