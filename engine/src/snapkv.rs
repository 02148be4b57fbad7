//! SnapKV's votes and the step that applies them (the policy, the selection and the
//! compaction of the paged cache are in `kv::snapkv`).
//!
//! A prompt is computed as any other, in whatever chunks, while an [`Observation`] gathers
//! the rotated queries of its last `observe` positions ([`Model::forward_observing`]), so
//! the votes do not depend on how the prompt was cut. Then, for each layer and KV head,
//! every observed query and every query head of the group scores the prompt's keys up to
//! its own position (softmax of `q . k * scale`, as the model's attention weighs them), and
//! the weights of each earlier position are summed into its vote. The logits of the
//! prompt's last row are full attention's: it saw every token; only what later tokens see
//! is compressed.

use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::forward::Observation;
use crate::kv::{KvCache, SeqId, SnapKv};
use crate::model::Model;

impl Model {
    /// Compresses the KV of `obs`'s sequence, whose whole prompt is computed and observed,
    /// to what SnapKV selects (nothing when the prompt is within the budget).
    pub fn compress_snapkv(
        &self,
        cache: &mut KvCache,
        obs: &Observation,
        policy: SnapKv,
    ) -> Result<()> {
        let len = cache.sequence_len(obs.seq)?;
        if obs.from + obs.rows != len || obs.rows == 0 {
            return Err(EngineError::invalid(
                "observation",
                format!(
                    "{} observed rows from {} for a prompt of {len} tokens",
                    obs.rows, obs.from
                ),
            ));
        }
        if !policy.compresses(len) {
            return Ok(());
        }
        let keep = self.snapkv_keep(cache, obs.seq, obs, len, policy)?;
        cache.compact(obs.seq, &keep)
    }

    /// The positions each (layer, KV head) keeps, `layer * kv_heads + head`.
    fn snapkv_keep(
        &self,
        cache: &KvCache,
        seq: SeqId,
        obs: &Observation,
        len: usize,
        policy: SnapKv,
    ) -> Result<Vec<Vec<usize>>> {
        let c = &self.config;
        let (hd, nkv, group) = (c.head_dim, c.n_kv_heads, c.group_size());
        let q_dim = c.q_dim();
        let voters = len - obs.rows;
        let scale = c.arch.attn_scale;
        self.pool.install(|| {
            (0..c.n_layers * nkv)
                .into_par_iter()
                .map(|idx| {
                    let (l, g) = (idx / nkv, idx % nkv);
                    let keys = cache.key_rows(seq, l, g, len)?;
                    let mut votes = vec![0f32; voters];
                    let mut w = Vec::with_capacity(len);
                    for r in 0..obs.rows {
                        let seen = voters + r + 1;
                        for h in g * group..(g + 1) * group {
                            let q = &obs.q[l][r * q_dim + h * hd..r * q_dim + (h + 1) * hd];
                            w.clear();
                            w.extend(
                                keys.chunks_exact(hd).take(seen).map(|k| {
                                    q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                                }),
                            );
                            softmax(&mut w);
                            for (v, p) in votes.iter_mut().zip(&w) {
                                *v += p;
                            }
                        }
                    }
                    Ok(policy.select(&votes, len))
                })
                .collect()
        })
    }
}

fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}
