//! `VecDot` on K-quant panels (the decode kernel: few activation rows of Q5_K/Q6_K; Q4_K
//! takes `VecDot` only with a row count not a multiple of 8, which has no panels, so its arm
//! here runs in the tests alone), 16 weight rows per register as in
//! [`super::avx512_kpanel`]. `unsafe` for the intrinsics; [`super::panel::available`] is
//! checked before any is called.
//!
//! ggml's `vec_dot_q*_K_q8_K` keeps, per output, 8 integer lanes per block: lane `l` sums
//! the scaled products of values `32c+4l..32c+4l+4` of every 32-value chunk `c`, i.e. of
//! panel group `8c+l` (four values of one row per i32 lane). Here one register per lane `l`
//! holds that sum for 16 weight rows: `vpmaddubsw` (code times activation byte, in pairs:
//! cannot saturate, see [`super::kpanel`]) then `vpmaddwd` by the sub-block's scale pair,
//! which applies the scale for free. The float part is [`super::kdot::Acc`]'s `VecDot`,
//! lane by lane: `lanes[l] = fma(d_x*d_w, lane, lanes[l])`, the mins' accumulators of Q4_K
//! (four) or Q5_K (one), then [`super::kdot::Acc::finish`]'s sum. Equal bit for bit.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx512_kpanel::{bcast, block, bsum_pair};
use super::ggml::hsum8;
use super::kpanel::KPanels;
use super::kquant::KFormat;
use super::panel::PANEL;
use super::q8k::Q8KBlock;

/// `VecDot` of panel `p` with the activation rows `a`: `out[r][j]` for weight row `16p + j`.
///
/// # Safety
/// AVX-512 F/BW/DQ/VNNI and FMA must be available; panel `p` and blocks `0..w.blocks` of
/// every row of `a` must exist (see [`super::avx512_kpanel::quad`]'s assert).
#[allow(clippy::needless_range_loop)] // `r`, `l` and `j` index several arrays in step
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,fma")]
pub(super) unsafe fn kernel<const R: usize>(
    w: &KPanels,
    p: usize,
    a: [&[Q8KBlock]; R],
) -> [[f32; PANEL]; R] {
    let zero = _mm512_setzero_si512();
    let fzero = _mm512_setzero_ps();
    let q6 = w.fmt == KFormat::Q6K;
    let mut lanes = [[fzero; 8]; R];
    // Q4_K: four mins accumulators; Q5_K: one (`summs`).
    let mut mins = [[fzero; 4]; R];
    let mut summs = [fzero; R];
    for b in 0..w.blocks {
        let pb = p * w.blocks + b;
        // SAFETY: the kernel's features; block `pb` is within `w` (the caller's bounds).
        let wb = unsafe { block(w, pb) };
        let (codes, scp, mp, dv, dminv) = (wb.codes, wb.sc, wb.m, wb.d, wb.dmin);
        let blk: [&Q8KBlock; R] = std::array::from_fn(|r| &a[r][b]);
        for l in 0..8 {
            let mut s = [zero; R];
            for c in 0..8 {
                let gi = 8 * c + l;
                let sub = if q6 { 2 * c + l / 4 } else { c };
                // SAFETY: group `gi < 64` of the block's codes; scale row `sub < SUBS`.
                let (wv, scv) = unsafe {
                    (
                        _mm512_loadu_si512(codes.add(gi * 64).cast()),
                        _mm512_loadu_si512(scp.add(sub * PANEL).cast()),
                    )
                };
                for r in 0..R {
                    // SAFETY: `4 * gi + 4 <= 256`.
                    let x = unsafe { bcast(&blk[r].qs, 4 * gi) };
                    let pairs = _mm512_maddubs_epi16(wv, x);
                    s[r] = _mm512_add_epi32(s[r], _mm512_madd_epi16(pairs, scv));
                }
            }
            if q6 {
                // ggml's `q8sclsub`: lane `l` takes out 32 times sub-blocks `2l` and `2l+1`'s
                // activation sums times their scales.
                // SAFETY: pair row `l < 8` of this Q6_K block's `sc2`.
                let sp = unsafe { _mm512_loadu_si512(wb.sc2.add(l * PANEL).cast()) };
                for r in 0..R {
                    // SAFETY: the kernel's features; `l < 8`.
                    let v = unsafe { bsum_pair(&blk[r].bsums, l) };
                    let off = _mm512_dpwssd_epi32(zero, sp, v);
                    s[r] = _mm512_sub_epi32(s[r], _mm512_slli_epi32::<5>(off));
                }
            }
            for r in 0..R {
                let d = _mm512_mul_ps(_mm512_set1_ps(blk[r].d), dv);
                lanes[r][l] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[r]), lanes[r][l]);
            }
        }
        if !q6 {
            for r in 0..R {
                let dmin = _mm512_mul_ps(_mm512_set1_ps(-blk[r].d), dminv);
                // `m[s] * (bsums[2s] + bsums[2s+1])` per sub-block `s`.
                let mt: [__m512i; 8] = std::array::from_fn(|s| {
                    // SAFETY: row `s < 8` of this block's mins; the kernel's features.
                    unsafe {
                        let m = _mm512_loadu_si512(mp.add(s * PANEL).cast());
                        _mm512_dpwssd_epi32(zero, m, bsum_pair(&blk[r].bsums, s))
                    }
                });
                let pj: [__m512i; 4] =
                    std::array::from_fn(|j| _mm512_add_epi32(mt[2 * j], mt[2 * j + 1]));
                if w.fmt == KFormat::Q4K {
                    for j in 0..4 {
                        let pf = _mm512_cvtepi32_ps(pj[j]);
                        mins[r][j] = _mm512_fmadd_ps(dmin, pf, mins[r][j]);
                    }
                } else {
                    let isum = _mm512_add_epi32(
                        _mm512_add_epi32(pj[0], pj[1]),
                        _mm512_add_epi32(pj[2], pj[3]),
                    );
                    summs[r] = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(isum), summs[r]);
                }
            }
        }
    }
    let mut out = [[0f32; PANEL]; R];
    for r in 0..R {
        let mut lv = [[0f32; PANEL]; 8];
        let mut mv = [[0f32; PANEL]; 4];
        let mut sv = [0f32; PANEL];
        // SAFETY: 16 f32 each.
        unsafe {
            for l in 0..8 {
                _mm512_storeu_ps(lv[l].as_mut_ptr(), lanes[r][l]);
            }
            for j in 0..4 {
                _mm512_storeu_ps(mv[j].as_mut_ptr(), mins[r][j]);
            }
            _mm512_storeu_ps(sv.as_mut_ptr(), summs[r]);
        }
        for j in 0..PANEL {
            let m: [f32; 4] = std::array::from_fn(|i| mv[i][j]);
            let l8: [f32; 8] = std::array::from_fn(|l| lv[l][j]);
            out[r][j] = hsum8(&l8) + ((m[0] + m[2]) + (m[1] + m[3])) + sv[j];
        }
    }
    out
}
