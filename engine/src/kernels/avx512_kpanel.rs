//! The AVX-512 VNNI kernel of [`super::kpanel`]: 16 weight rows (one per i32 lane) against
//! up to four activation rows, block by block. `unsafe` because the intrinsics need CPU
//! features, which [`available`] checks at run time before any of them is called.
//!
//! Per (block, activation row) it forms, exactly, each sub-block's sum of `code * q8` with
//! `vpdpbusd` (codes unsigned, activations signed; no intermediate saturation), times the
//! sub-block's scale; then the float operations of the row's kernel, lane by lane the same
//! operations in the same order as [`super::kdot::Acc`] (see there), so results are equal
//! bit for bit.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::kdot::Kernel;
use super::kpanel::{KPanels, CODE_BYTES, QUAD, SUBS};
use super::kquant::KFormat;
use super::panel::PANEL;
use super::q8k::Q8KBlock;

pub fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("fma")
    })
}

/// Panel `p` of `w` against the activation rows `acts` (1 to [`QUAD`]), each computed as
/// `kinds[r]` (all `VecDot` or none: [`KPanels::takes`]), into `out[r]`.
///
/// Panics if `p` is past the last panel, a row is shorter than a weight row, `acts` holds
/// more than [`QUAD`] rows or `kinds` fewer than `acts`; does nothing without the CPU
/// features (the caller checks [`available`]).
pub fn quad(
    w: &KPanels,
    p: usize,
    acts: &[&[Q8KBlock]],
    kinds: &[Kernel],
    out: &mut [[f32; PANEL]; QUAD],
) {
    assert!(
        p < w.panels()
            && (1..=QUAD).contains(&acts.len())
            && kinds.len() >= acts.len()
            && KPanels::takes(&kinds[..acts.len()])
            && acts.iter().all(|a| a.len() >= w.blocks)
            && w.codes.len() >= (p + 1) * w.blocks * CODE_BYTES
            && w.sc.len() >= (p + 1) * w.blocks * SUBS * PANEL
            && w.m.len() >= (p + 1) * w.blocks * 8 * PANEL
            && (w.fmt.has_mins() || w.sc2.len() >= (p + 1) * w.blocks * 8 * PANEL)
            && w.d.len() >= (p + 1) * w.blocks * PANEL
            && w.dmin.len() >= (p + 1) * w.blocks * PANEL,
        "panel kernel arguments out of range"
    );
    if !available() {
        return;
    }
    macro_rules! run {
        ($r:literal) => {{
            let a: [&[Q8KBlock]; $r] = std::array::from_fn(|i| acts[i]);
            let k: [Kernel; $r] = std::array::from_fn(|i| kinds[i]);
            // SAFETY: `available()` confirmed the features; the assert above bounds every
            // read (blocks `0..w.blocks` of panel `p` and of each activation row).
            let o = unsafe {
                match w.fmt {
                    _ if k[0] == Kernel::VecDot => super::avx512_kvecdot::kernel::<$r>(w, p, a),
                    KFormat::Q6K => kernel::<$r, true>(w, p, a, k),
                    _ => kernel::<$r, false>(w, p, a, k),
                }
            };
            out[..$r].copy_from_slice(&o);
        }};
    }
    match acts.len() {
        1 => run!(1),
        2 => run!(2),
        3 => run!(3),
        _ => run!(4),
    }
}

/// Four activation bytes at `x[at..at + 4]` in every lane.
///
/// # Safety
/// `at + 4 <= 256`.
#[inline(always)]
pub(super) unsafe fn bcast(x: &[i8; 256], at: usize) -> __m512i {
    // SAFETY: the caller's bound; unaligned read of 4 bytes.
    let v = unsafe { std::ptr::read_unaligned(x.as_ptr().add(at).cast::<i32>()) };
    _mm512_set1_epi32(v)
}

/// Where block `pb` (panel-major) of a [`KPanels`] starts in its code, scale, min and (Q6_K)
/// scale-pair buffers, and its 16 rows' `d` and `dmin`.
pub(super) struct Block {
    pub codes: *const u8,
    pub sc: *const i32,
    pub m: *const i32,
    /// Q6_K's scale pairs; for the other formats the empty buffer's pointer, never read.
    pub sc2: *const i32,
    pub d: __m512,
    pub dmin: __m512,
}

/// Block `pb` of `w` (see [`Block`]).
///
/// # Safety
/// AVX-512 F must be available; block `pb` must be within every buffer of `w` (as
/// [`quad`]'s assert bounds it).
#[inline(always)]
pub(super) unsafe fn block(w: &KPanels, pb: usize) -> Block {
    // SAFETY: the caller's bound on `pb` (Q6_K panels hold 8 scale-pair rows per block);
    // `d` and `dmin` hold 16 values at `pb * PANEL`.
    unsafe {
        Block {
            codes: w.codes.as_ptr().add(pb * CODE_BYTES),
            sc: w.sc.as_ptr().add(pb * SUBS * PANEL),
            m: w.m.as_ptr().add(pb * 8 * PANEL),
            sc2: if w.fmt == KFormat::Q6K {
                w.sc2.as_ptr().add(pb * 8 * PANEL)
            } else {
                w.sc2.as_ptr()
            },
            d: _mm512_loadu_ps(w.d.as_ptr().add(pb * PANEL)),
            dmin: _mm512_loadu_ps(w.dmin.as_ptr().add(pb * PANEL)),
        }
    }
}

/// The activations' 16-value sums `2t` and `2t + 1` as an i16 pair in every lane.
///
/// # Safety
/// AVX-512 F must be available; `t < 8`.
#[inline(always)]
pub(super) unsafe fn bsum_pair(bs: &[i16; 16], t: usize) -> __m512i {
    let lo = bs[2 * t] as u16 as u32;
    let hi = bs[2 * t + 1] as u16 as u32;
    _mm512_set1_epi32((lo | hi << 16) as i32)
}

/// # Safety
/// AVX-512 F/BW/DQ/VNNI and FMA must be available; panel `p` and blocks `0..w.blocks` of
/// every row of `a` must exist (see [`quad`]'s assert).
#[allow(clippy::needless_range_loop)] // `r` and `b` index several arrays in step
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,fma")]
unsafe fn kernel<const R: usize, const Q6: bool>(
    w: &KPanels,
    p: usize,
    a: [&[Q8KBlock]; R],
    kinds: [Kernel; R],
) -> [[f32; PANEL]; R] {
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut accm = [_mm512_setzero_ps(); R];
    let mins = w.fmt.has_mins();
    for b in 0..w.blocks {
        let pb = p * w.blocks + b;
        // SAFETY: the kernel's features; block `pb` is within `w` (the caller's bounds).
        let wb = unsafe { block(w, pb) };
        let (codes, scp, mp, sc2p, dv, dminv) = (wb.codes, wb.sc, wb.m, wb.sc2, wb.d, wb.dmin);
        let blk: [&Q8KBlock; R] = std::array::from_fn(|r| &a[r][b]);
        let ad: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(blk[r].d));
        // Scale and min rows `s` of this block.
        macro_rules! sc {
            ($s:expr) => {
                // SAFETY: row `s < SUBS` of this block's scales (pairs `(sc, sc)`: the
                // high half, sign-extended, is the scale).
                _mm512_srai_epi32::<16>(unsafe { _mm512_loadu_si512(scp.add($s * PANEL).cast()) })
            };
        }
        // `m[s] * (bsums[2s] + bsums[2s+1])` of row `r`, summed over the sub-blocks `s`
        // (`vpdpwssd` of the pair `(m, m)` with the pair of sums: the same integer).
        macro_rules! min_terms {
            ($r:expr, $range:expr) => {{
                let bs = &blk[$r].bsums;
                let mut t = zero;
                for s in $range {
                    // SAFETY: row `s < 8` of this block's mins.
                    let m = unsafe { _mm512_loadu_si512(mp.add(s * PANEL).cast()) };
                    // SAFETY: the kernel's features; `s < 8`.
                    let v = unsafe { bsum_pair(bs, s) };
                    t = _mm512_dpwssd_epi32(t, m, v);
                }
                t
            }};
        }
        let mut total = [zero; R];
        for sb in 0..4 {
            let mut pair = [zero; R];
            for c in 2 * sb..2 * sb + 2 {
                // Q6_K: two sub-blocks of 16 values per chunk; otherwise one of 32.
                let (subs, groups) = if Q6 { (2, 4) } else { (1, 8) };
                for h in 0..subs {
                    let mut s = [zero; R];
                    for g in 0..groups {
                        let gi = 8 * c + groups * h + g;
                        // SAFETY: group `gi < 64` of the block's codes (64 bytes each).
                        let wv = unsafe { _mm512_loadu_si512(codes.add(gi * 64).cast()) };
                        for r in 0..R {
                            // SAFETY: `4 * gi + 4 <= 256`.
                            let x = unsafe { bcast(&blk[r].qs, 4 * gi) };
                            s[r] = _mm512_dpbusd_epi32(s[r], wv, x);
                        }
                    }
                    let scv = sc!(subs * c + h);
                    for r in 0..R {
                        pair[r] = _mm512_add_epi32(pair[r], _mm512_mullo_epi32(s[r], scv));
                    }
                }
            }
            for r in 0..R {
                if kinds[r] == Kernel::Gemm {
                    let mi = min_terms!(r, 2 * sb..2 * sb + 2);
                    let ds = _mm512_mul_ps(dv, ad[r]);
                    let dm = _mm512_mul_ps(dminv, ad[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair[r]), ds, acc[r]);
                    accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mi), dm, accm[r]);
                } else {
                    total[r] = _mm512_add_epi32(total[r], pair[r]);
                }
            }
        }
        for r in 0..R {
            match kinds[r] {
                Kernel::Gemm | Kernel::VecDot => {}
                Kernel::Gemv => {
                    let mt = min_terms!(r, 0..8);
                    let ds = _mm512_mul_ps(dv, ad[r]);
                    let dm = _mm512_mul_ps(dminv, ad[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), ds, acc[r]);
                    accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mt), dm, accm[r]);
                }
                Kernel::Tiled => {
                    let mut t = total[r];
                    if Q6 {
                        // ggml's offset: 32 * sum of scale * sub-block sum of the activations,
                        // two sub-blocks per `vpdpwssd`.
                        let bs = &blk[r].bsums;
                        let mut off = zero;
                        for pair in 0..8 {
                            // SAFETY: pair row `pair < 8` of this Q6_K block's scales.
                            let sp = unsafe { _mm512_loadu_si512(sc2p.add(pair * PANEL).cast()) };
                            // SAFETY: the kernel's features; `pair < 8`.
                            let v = unsafe { bsum_pair(bs, pair) };
                            off = _mm512_dpwssd_epi32(off, sp, v);
                        }
                        t = _mm512_sub_epi32(t, _mm512_slli_epi32::<5>(off));
                    }
                    let mut res = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(t));
                    if mins {
                        let mt = _mm512_cvtepi32_ps(min_terms!(r, 0..8));
                        res = _mm512_fnmadd_ps(dminv, mt, res);
                    }
                    acc[r] = _mm512_fmadd_ps(res, ad[r], acc[r]);
                }
            }
        }
    }
    let mut out = [[0f32; PANEL]; R];
    for r in 0..R {
        let v = match kinds[r] {
            Kernel::Tiled => acc[r],
            _ => _mm512_sub_ps(acc[r], accm[r]),
        };
        // SAFETY: 16 f32 of `out[r]`.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), v) };
    }
    out
}
