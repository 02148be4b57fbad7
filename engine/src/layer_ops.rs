//! The element-wise operations of a layer, in ggml's arithmetic: RMS norm and RoPE.

use crate::architecture::RopeStyle;

/// RMSNorm as ggml computes it: squares summed in f64 in order, the mean
/// and the scale in f32. The result is quantized to 8 bits next, where one
/// ulp of difference can move a value to the neighbouring grid point, so
/// matching ggml bit for bit here keeps duet on llama.cpp's trajectory.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let scale = rms_scale(xr, eps);
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// [`rms_norm`] of `x` in place (every `w.len()` elements: a row, or one head).
pub(crate) fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for xr in x.chunks_exact_mut(w.len()) {
        let scale = rms_scale(xr, eps);
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// `1 / sqrt(mean(x^2) + eps)`: the squares summed in f64 in order, the rest in f32.
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss = x.iter().fold(0f64, |s, &v| s + f64::from(v * v));
    let mean = (ss / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// Rotate the pairs of every head in `x` (adjacent pairs, GGUF llama's layout; or the two
/// halves of the head, NeoX's), with the fused multiply-adds GCC makes of ggml's
/// `x0*cos - x1*sin` and `x0*sin + x1*cos` (bit-identical to llama.cpp's CPU build).
pub(crate) fn rope(x: &mut [f32], head_dim: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    let rotate = |a: f32, b: f32, i: usize| {
        (
            a.mul_add(cos[i], -(b * sin[i])),
            a.mul_add(sin[i], b * cos[i]),
        )
    };
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::Adjacent => {
                for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                    (pair[0], pair[1]) = rotate(pair[0], pair[1], i);
                }
            }
            RopeStyle::Halves => {
                let (lo, hi) = head.split_at_mut(head_dim / 2);
                for (i, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                    (*a, *b) = rotate(*a, *b, i);
                }
            }
        }
    }
}

/// ggml's RoPE angles: `theta_scale = base^(-2/dims)` in f32, and each
/// pair's angle the previous one times it, in f32.
pub(crate) fn rope_angles(
    pos: usize,
    theta_base: f32,
    head_dim: usize,
    cos: &mut [f32],
    sin: &mut [f32],
) {
    let scale = theta_base.powf(-2.0 / head_dim as f32);
    let mut theta = pos as f32;
    for (c, s) in cos.iter_mut().zip(sin.iter_mut()) {
        *c = theta.cos();
        *s = theta.sin();
        theta *= scale;
    }
}
