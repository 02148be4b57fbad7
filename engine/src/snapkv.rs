//! SnapKV's votes and the prompt step that applies them (the policy, the selection and the
//! compaction of the paged cache are in `kv::snapkv`).
//!
//! The last chunk of a prompt runs as any forward does, keeping its last `observe` rows'
//! queries (rotated, as attention used them). Then, for each layer and KV head, every one of
//! those queries and every query head of the group scores the prompt's keys up to its own
//! position (softmax of `q . k * scale`, as the model's attention weighs them), and the
//! weights of each earlier position are summed into its vote. The logits the step returns
//! are those of full attention: the prompt's last row saw every token; only what later
//! tokens see is compressed.

use rayon::prelude::*;

use crate::error::Result;
use crate::forward::{Observed, SeqChunk};
use crate::kv::{KvCache, SeqId, SnapKv};
use crate::model::Model;

impl Model {
    /// Computes the last chunk of `chunk.seq`'s prompt, then, when the prompt is longer
    /// than the budget, compresses its KV to what SnapKV selects. Returns the chunk's
    /// logits.
    pub fn forward_snapkv(
        &self,
        cache: &mut KvCache,
        chunk: SeqChunk<'_>,
        policy: SnapKv,
    ) -> Result<Vec<f32>> {
        let seq = chunk.seq;
        let (logits, obs) = self.forward_observed(cache, chunk, policy.observe)?;
        let len = cache.sequence_len(seq)?;
        if policy.compresses(len) {
            let keep = self.snapkv_keep(cache, seq, &obs, len, policy)?;
            cache.compact(seq, &keep)?;
        }
        Ok(logits)
    }

    /// The positions each (layer, KV head) keeps, `layer * kv_heads + head`.
    fn snapkv_keep(
        &self,
        cache: &KvCache,
        seq: SeqId,
        obs: &Observed,
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
