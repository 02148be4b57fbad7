//! Attention of one row that a local window masks (`kv::window`): the sinks scored against
//! the query rotated at its cache position, the window against the query at its own, one
//! softmax over both, the values summed in position order. Rows nothing masks never come
//! here; they take the full-attention paths of `forward` and `attention_gemm` unchanged.

use half::f16;

use crate::attention::{accumulate, KvElem};
use crate::kernels;
use crate::kernels::ggml::DotOrder;
use crate::kv::{KvKind, KvView, Window};

/// A layer's queries: `qkv` rows of `stride` (queries, then keys and values, rotated at the
/// rows' positions), and for rows a window masks their queries rotated at the cache
/// position the sinks see (`sink_q`, `[row][q_dim]`; empty when no row is masked).
pub(crate) struct Queries<'a> {
    pub(crate) qkv: &'a [f32],
    pub(crate) stride: usize,
    pub(crate) sink_q: &'a [f32],
}

/// One head of one masked row (`kv::window`): scores of the sinks against `q_sink`, of the
/// window (`w.window_start(pos)..=pos`) against `q`, one softmax over both, and the values
/// summed in position order. `at(t, kind)` is where position `t`'s head starts in `data`;
/// positions of one block are contiguous there, so the scores go a block's run at a time
/// through the same vector kernel as full attention's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn windowed_row<T: KvElem>(
    data: KvView<'_, T>,
    q: &[f32],
    q_sink: &[f32],
    w: Window,
    pos: usize,
    scale: f32,
    block_size: usize,
    at: &dyn Fn(usize, KvKind) -> usize,
    out: &mut [f32],
) {
    let hd = q.len();
    let mut buf = vec![0f32; hd];
    let mut scores = Vec::with_capacity(w.sinks + w.window);
    let ranges = [(0, w.sinks, q_sink), (w.window_start(pos), pos + 1, q)];
    for &(from, to, q) in &ranges {
        let mut t = from;
        while t < to {
            // The run of positions from `t` to the end of its block (or of the range).
            let end = to.min((t / block_size + 1) * block_size);
            let k0 = at(t, KvKind::K);
            let k = &data[k0..k0 + (end - t) * hd];
            if !kernels::attention_scores(DotOrder::Lanes64, q, k, scale, &mut scores) {
                for k in k.chunks_exact(hd) {
                    scores.push(DotOrder::Lanes64.dot(q, T::as_f32(k, &mut buf)) * scale);
                }
            }
            t = end;
        }
    }
    kernels::ggml::softmax(&mut scores);
    if T::F16_PATH {
        scores
            .iter_mut()
            .for_each(|p| *p = f16::from_f32(*p).to_f32());
    }
    out.fill(0.0);
    let visible = (0..w.sinks).chain(w.window_start(pos)..=pos);
    let terms = visible.zip(&scores).map(|(t, &p)| (at(t, KvKind::V), p));
    accumulate(out, terms, data, &mut buf);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The masked row against the formula, in f64: the sinks scored with `q_sink`, the
    /// window with `q`, nothing else.
    #[test]
    fn a_masked_row_is_softmax_over_sinks_and_window_only() {
        let (hd, n) = (4usize, 40usize);
        let w = Window {
            window: 5,
            sinks: 2,
        };
        let pos = n - 1;
        let val = |i: usize| ((i * 37 % 17) as f32 - 8.0) / 8.0;
        // Keys at 0.., values after them.
        let data: Vec<f32> = (0..2 * n * hd).map(val).collect();
        let at = |t: usize, kind: KvKind| match kind {
            KvKind::K => t * hd,
            KvKind::V => (n + t) * hd,
        };
        let q = [0.3f32, -0.7, 0.2, 0.9];
        let q_sink = [-0.4f32, 0.1, 0.8, -0.2];
        let scale = 0.5;
        let mut out = vec![f32::NAN; hd];
        // Blocks of 8 positions: the runs split at 8, 16, ... as in the pool.
        windowed_row::<f32>(
            KvView::of(&data),
            &q,
            &q_sink,
            w,
            pos,
            scale,
            8,
            &at,
            &mut out,
        );

        let visible: Vec<usize> = (0..=pos).filter(|&t| w.sees(pos, t)).collect();
        assert_eq!(visible, vec![0, 1, 35, 36, 37, 38, 39]);
        let scores: Vec<f64> = visible
            .iter()
            .map(|&t| {
                let qq = if t < w.sinks { &q_sink } else { &q };
                (0..hd)
                    .map(|i| f64::from(qq[i]) * f64::from(data[at(t, KvKind::K) + i]))
                    .sum::<f64>()
                    * f64::from(scale)
            })
            .collect();
        let max = scores.iter().copied().fold(f64::MIN, f64::max);
        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        for (i, &got) in out.iter().enumerate() {
            let want: f64 = visible
                .iter()
                .zip(&scores)
                .map(|(&t, s)| (s - max).exp() / sum * f64::from(data[at(t, KvKind::V) + i]))
                .sum();
            assert!((f64::from(got) - want).abs() < 1e-5, "{i}: {got} vs {want}");
        }
    }
}
