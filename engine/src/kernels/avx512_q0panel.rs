//! The AVX-512 VNNI kernel of [`super::q0panel`]: 16 weight rows (one per i32 lane) of a
//! 32-value format against a few activation rows of a [`Q8Tile`]. `unsafe` because the
//! intrinsics need CPU features, which [`super::panel::available`] checks at run time
//! before any of them is called.
//!
//! Per (block, activation row) each of ggml's 8 integer lanes (values `4g..4g+4`) is one
//! `vpdpbusd` of the unsigned codes with the activation bytes, started from the format's
//! offset correction, so it is exact; the float operations that follow are the tile
//! kernel's, in its order (see [`super::q0panel`]).

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::panel::{available, PANEL};
use super::q0panel::{has_min, Q0Panels, CODE_BYTES};
use super::q8::{Q8Tile, TILE};
use super::QK;

/// Activation rows per call: 8 float accumulators each (24 of the 32 registers at 3).
pub const ROWS: usize = 3;

/// Panel `p` of `w` against rows `r0..r0 + n` of tile `t` (`corr`: the tile's
/// corrections), one array of 16 outputs per row (the first `n` meaningful).
///
/// Panics if the panel, the rows or the tile's blocks are out of range; returns zeros
/// without the CPU features (the caller checks [`available`]).
pub fn rows(
    w: &Q0Panels,
    p: usize,
    t: &Q8Tile,
    corr: &[i32],
    r0: usize,
    n: usize,
) -> [[f32; PANEL]; ROWS] {
    assert!(
        p < w.panels()
            && (1..=ROWS).contains(&n)
            && r0 + n <= t.rows
            && t.blocks == w.blocks
            && t.q.len() >= w.blocks * t.rows * QK
            && t.d.len() >= w.blocks * TILE
            && t.s.len() >= w.blocks * TILE
            && corr.len() >= w.blocks * t.rows * 8
            && w.codes.len() >= (p + 1) * w.blocks * CODE_BYTES
            && w.d.len() >= (p + 1) * w.blocks * PANEL
            && (!has_min(w.fmt) || w.m.len() >= (p + 1) * w.blocks * PANEL),
        "panel kernel arguments out of range"
    );
    let mut out = [[0f32; PANEL]; ROWS];
    if !available() {
        return out;
    }
    let min = has_min(w.fmt);
    // SAFETY: `available()` confirmed the features; the assert above bounds every read.
    unsafe {
        match (n, min) {
            (1, false) => out[..1].copy_from_slice(&kernel::<1, false>(w, p, t, corr, r0)),
            (1, true) => out[..1].copy_from_slice(&kernel::<1, true>(w, p, t, corr, r0)),
            (2, false) => out[..2].copy_from_slice(&kernel::<2, false>(w, p, t, corr, r0)),
            (2, true) => out[..2].copy_from_slice(&kernel::<2, true>(w, p, t, corr, r0)),
            (_, false) => out.copy_from_slice(&kernel::<3, false>(w, p, t, corr, r0)),
            (_, true) => out.copy_from_slice(&kernel::<3, true>(w, p, t, corr, r0)),
        }
    }
    out
}

/// # Safety
/// AVX-512 F/BW/DQ/VNNI and FMA must be available; the bounds of [`rows`]' assert hold
/// for rows `r0..r0 + R`.
#[allow(clippy::needless_range_loop)] // `r` and `g` index several arrays in step
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,fma")]
unsafe fn kernel<const R: usize, const MIN: bool>(
    w: &Q0Panels,
    p: usize,
    t: &Q8Tile,
    corr: &[i32],
    r0: usize,
) -> [[f32; PANEL]; R] {
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut summs = [_mm512_setzero_ps(); R];
    let (qp, cp) = (t.q.as_ptr(), corr.as_ptr());
    for b in 0..w.blocks {
        let pb = p * w.blocks + b;
        // SAFETY: panel `p`'s block `b` starts within the codes (the caller's bounds).
        let codes = unsafe { w.codes.as_ptr().add(pb * CODE_BYTES) };
        // SAFETY: 16 values of `d` at `pb * PANEL` (the caller's bounds).
        let dw = unsafe { _mm512_loadu_ps(w.d.as_ptr().add(pb * PANEL)) };
        let ds: [__m512; R] =
            std::array::from_fn(|r| _mm512_mul_ps(dw, _mm512_set1_ps(t.d[b * TILE + r0 + r])));
        if MIN {
            // SAFETY: 16 values of `m` at `pb * PANEL` (the caller's bounds).
            let mw = unsafe { _mm512_loadu_ps(w.m.as_ptr().add(pb * PANEL)) };
            for (r, s) in summs.iter_mut().enumerate() {
                let sx = _mm512_set1_ps(t.s[b * TILE + r0 + r]);
                *s = _mm512_add_ps(*s, _mm512_mul_ps(mw, sx));
            }
        }
        for g in 0..8 {
            // SAFETY: group `g < 8` of the block's 512 code bytes.
            let wv = unsafe { _mm512_loadu_si512(codes.add(g * 64).cast()) };
            for r in 0..R {
                let row = b * t.rows + r0 + r;
                // SAFETY: 4 bytes of the tile's block `b` of row `r0 + r` and its correction
                // `g` (the caller's bounds).
                let (x, c) = unsafe {
                    (
                        std::ptr::read_unaligned(qp.add(row * QK + 4 * g).cast::<i32>()),
                        *cp.add(row * 8 + g),
                    )
                };
                let lane = _mm512_dpbusd_epi32(_mm512_set1_epi32(c), wv, _mm512_set1_epi32(x));
                acc[r][g] = _mm512_fmadd_ps(ds[r], _mm512_cvtepi32_ps(lane), acc[r][g]);
            }
        }
    }
    let mut out = [[0f32; PANEL]; R];
    for r in 0..R {
        let a = &acc[r];
        // ggml's `hsum_float_8`: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
        let even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
        let odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
        let mut v = _mm512_add_ps(even, odd);
        if MIN {
            v = _mm512_add_ps(v, summs[r]);
        }
        // SAFETY: 16 f32 of `out[r]`.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), v) };
    }
    out
}
