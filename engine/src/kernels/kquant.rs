//! ggml's K-quant weight blocks (Q4_K, Q5_K, Q6_K: 256 values per block)
//! kept in their file form, unpacked one block at a time for the integer
//! kernels of [`super::kdot`], and dequantized as ggml's reference does.
//!
//! Invariants (from `ggml-common.h` / `ggml-quants.c`, llama.cpp as bundled by
//! llama-cpp-python 0.3.36; `docs/research/ggml-kquants.md` §1):
//! - Q4_K: `d, dmin` (f16), 12 bytes of 6-bit scales and mins for 8
//!   sub-blocks of 32, 128 bytes of nibbles; `x = d*sc*q - dmin*m`.
//! - Q5_K: as Q4_K plus 32 bytes of fifth bits.
//! - Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit
//!   scales (one per 16 values), `d` (f16) last; `x = d*sc*(q-32)`.
//! - Dequantization rounds as ggml-base (built without FMA) does: `d*sc`
//!   and `dmin*m` rounded, then `(d*sc)*q` rounded, then `- dmin*m`.
//! - Unpacked codes are the unsigned values the AVX2 kernels multiply
//!   (Q6_K's `-32` is taken out later with the activation block sums).

use half::f16;

/// Values per K-quant block.
pub const QK_K: usize = 256;

/// The K-quant formats with native kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KFormat {
    Q4K,
    Q5K,
    Q6K,
}

impl KFormat {
    /// Bytes per block of [`QK_K`] values.
    pub const fn block_bytes(self) -> usize {
        match self {
            KFormat::Q4K => 144,
            KFormat::Q5K => 176,
            KFormat::Q6K => 210,
        }
    }

    /// Whether the format has per-sub-block mins (`x = a*q + b`).
    pub const fn has_mins(self) -> bool {
        !matches!(self, KFormat::Q6K)
    }
}

/// One weight block, unpacked.
#[derive(Debug, Clone)]
pub struct Unpacked {
    /// Super-block scale.
    pub d: f32,
    /// Super-block scale of the mins (0 for Q6_K).
    pub dmin: f32,
    /// Codes in element order: Q4_K 0..16, Q5_K 0..32, Q6_K 0..64 (unsigned).
    pub q: [u8; QK_K],
    /// Scales: Q4_K/Q5_K one per 32 values (`sc[0..8]`), Q6_K one per 16
    /// values (`sc[0..16]`, signed).
    pub sc: [i32; 16],
    /// Mins, one per 32 values (Q4_K/Q5_K).
    pub m: [i32; 8],
    /// The scale of each pair of values of each 32-value chunk (the 16-bit
    /// operand of ggml's `vpmaddwd`): chunk `c`'s pairs all have `sc[c]`
    /// (Q4_K/Q5_K), or `sc[2c]` then `sc[2c+1]` (Q6_K).
    pub pair_scales: [[i16; 16]; 8],
    /// Q4_K/Q5_K: `m[s]` at `2s` and `2s+1` (the 16-bit operand that multiplies the
    /// activation block's 16 sums into the mins' terms); zero for Q6_K.
    pub m_pairs: [i16; 16],
    /// Q6_K: `sc[0..16]` as 16-bit (the operand of its offset's terms); zero otherwise.
    pub sc16: [i16; 16],
}

impl Default for Unpacked {
    fn default() -> Self {
        Self {
            d: 0.0,
            dmin: 0.0,
            q: [0; QK_K],
            sc: [0; 16],
            m: [0; 8],
            pair_scales: [[0; 16]; 8],
            m_pairs: [0; 16],
            sc16: [0; 16],
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// ggml's `get_scale_min_k4`: 6-bit scale and min of sub-block `j` (0..8).
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((s[j] & 63) as i32, (s[j + 4] & 63) as i32)
    } else {
        (
            ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4)) as i32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as i32,
        )
    }
}

/// Unpacks one block (`blk.len() == fmt.block_bytes()`).
#[inline]
pub fn unpack(fmt: KFormat, blk: &[u8], out: &mut Unpacked) {
    match fmt {
        KFormat::Q4K | KFormat::Q5K => {
            out.d = f16_at(blk, 0);
            out.dmin = f16_at(blk, 2);
            let scales = &blk[4..16];
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                out.sc[j] = sc;
                out.m[j] = m;
            }
            out.sc[8..].fill(0);
            for (c, p) in out.pair_scales.iter_mut().enumerate() {
                *p = [out.sc[c] as i16; 16];
            }
            out.m_pairs = std::array::from_fn(|i| out.m[i / 2] as i16);
            out.sc16 = [0; 16];
        }
        KFormat::Q6K => {
            for (s, &b) in out.sc.iter_mut().zip(&blk[192..208]) {
                *s = (b as i8) as i32;
            }
            for (c, p) in out.pair_scales.iter_mut().enumerate() {
                p[..8].fill(out.sc[2 * c] as i16);
                p[8..].fill(out.sc[2 * c + 1] as i16);
            }
            out.sc16 = std::array::from_fn(|i| out.sc[i] as i16);
            out.m = [0; 8];
            out.m_pairs = [0; 16];
            out.d = f16_at(blk, 208);
            out.dmin = 0.0;
        }
    }
    if !codes_vector(fmt, blk, &mut out.q) {
        codes_scalar(fmt, blk, &mut out.q);
    }
}

/// A block's code bytes: the 128 bytes of nibbles, then the high bits (Q5_K's 32 bytes of
/// fifth bits, Q6_K's 64 bytes of 2-bit pairs, none for Q4_K).
#[inline]
fn code_bytes(fmt: KFormat, blk: &[u8]) -> (&[u8], &[u8]) {
    match fmt {
        KFormat::Q4K => (&blk[16..144], &[]),
        KFormat::Q5K => (&blk[48..176], &blk[16..48]),
        KFormat::Q6K => (&blk[0..128], &blk[128..192]),
    }
}

/// The block's codes in element order with AVX2 (`false`: not on this CPU).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn codes_vector(fmt: KFormat, blk: &[u8], q: &mut [u8; QK_K]) -> bool {
    use super::avx2_kquant::{unpack_q45, unpack_q6};
    let (lo, hi) = code_bytes(fmt, blk);
    let Ok(lo) = lo.try_into() else { return false };
    match fmt {
        KFormat::Q4K => unpack_q45(lo, None, q),
        KFormat::Q5K => hi.try_into().is_ok_and(|h| unpack_q45(lo, Some(h), q)),
        KFormat::Q6K => hi.try_into().is_ok_and(|h| unpack_q6(lo, h, q)),
    }
}

/// No vector unpacking off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn codes_vector(_: KFormat, _: &[u8], _: &mut [u8; QK_K]) -> bool {
    false
}

/// The block's codes in element order, portably (the vector form's reference).
pub(crate) fn codes_scalar(fmt: KFormat, blk: &[u8], q: &mut [u8; QK_K]) {
    let (ql, qh) = code_bytes(fmt, blk);
    match fmt {
        KFormat::Q4K | KFormat::Q5K => {
            for c in 0..4 {
                for e in 0..32 {
                    let b = ql[32 * c + e];
                    let (mut lo, mut hi) = (b & 0x0f, b >> 4);
                    if let Some(&h) = qh.get(e) {
                        lo |= ((h >> (2 * c)) & 1) << 4;
                        hi |= ((h >> (2 * c + 1)) & 1) << 4;
                    }
                    q[64 * c + e] = lo;
                    q[64 * c + 32 + e] = hi;
                }
            }
        }
        KFormat::Q6K => {
            for h in 0..2 {
                let (ql, qh) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32]);
                let y = &mut q[128 * h..128 * h + 128];
                for l in 0..32 {
                    y[l] = (ql[l] & 0x0f) | (qh[l] & 3) << 4;
                    y[l + 32] = (ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4;
                    y[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                    y[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
                }
            }
        }
    }
}

/// ggml's reference dequantization of one block (`dequantize_row_q*_K`),
/// unpacked into `u`.
fn dequant_block(fmt: KFormat, blk: &[u8], u: &mut Unpacked, out: &mut [f32]) {
    unpack(fmt, blk, u);
    match fmt {
        KFormat::Q4K | KFormat::Q5K => {
            for (s, o) in out.chunks_exact_mut(32).enumerate().take(8) {
                // Two roundings each, as ggml-base (no FMA) computes them.
                let d1 = u.d * u.sc[s] as f32;
                let m1 = u.dmin * u.m[s] as f32;
                for (y, &q) in o.iter_mut().zip(&u.q[32 * s..32 * s + 32]) {
                    *y = d1 * q as f32 - m1;
                }
            }
        }
        KFormat::Q6K => {
            for (s, o) in out.chunks_exact_mut(16).enumerate().take(16) {
                let d1 = u.d * u.sc[s] as f32;
                for (y, &q) in o.iter_mut().zip(&u.q[16 * s..16 * s + 16]) {
                    *y = d1 * (q as i32 - 32) as f32;
                }
            }
        }
    }
}

/// Dequantizes a row (`row.len()` a whole number of blocks) into `out`.
pub fn dequant_row(fmt: KFormat, row: &[u8], out: &mut [f32]) {
    let mut u = Unpacked::default();
    for (blk, o) in row
        .chunks_exact(fmt.block_bytes())
        .zip(out.chunks_exact_mut(QK_K))
    {
        dequant_block(fmt, blk, &mut u, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 6-bit packing round-trips: every (scale, min) pair written the way
    /// ggml's `quantize_row_q4_K_ref` packs them reads back unchanged.
    #[test]
    fn scale_and_min_packing_round_trips() {
        let ls: [u8; 8] = [0, 1, 17, 63, 32, 5, 62, 40];
        let lm: [u8; 8] = [63, 2, 0, 31, 7, 60, 33, 1];
        let mut s = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                s[j] = ls[j];
                s[j + 4] = lm[j];
            } else {
                s[j + 4] = (ls[j] & 0xf) | ((lm[j] & 0xf) << 4);
                s[j - 4] |= (ls[j] >> 4) << 6;
                s[j] |= (lm[j] >> 4) << 6;
            }
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &s), (ls[j] as i32, lm[j] as i32), "j {j}");
        }
    }

    /// The vector unpacking gives the portable one's codes, every bit of every byte used.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_and_scalar_codes_agree() {
        assert!(
            crate::kernels::avx2::available(),
            "this test checks the AVX2 unpacking: run it on an x86-64-v3 CPU"
        );
        for fmt in [KFormat::Q4K, KFormat::Q5K, KFormat::Q6K] {
            for seed in 0..16u32 {
                let blk: Vec<u8> = (0..fmt.block_bytes() as u32)
                    .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 13) as u8)
                    .collect();
                let (mut v, mut s) = ([0u8; QK_K], [0u8; QK_K]);
                assert!(codes_vector(fmt, &blk, &mut v));
                codes_scalar(fmt, &blk, &mut s);
                assert_eq!(v, s, "{fmt:?} seed {seed}");
            }
        }
    }
}
