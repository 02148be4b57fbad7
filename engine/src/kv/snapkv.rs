//! SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
//! arXiv:2404.14469) as a KV-memory policy of the paged cache: once a prompt is computed,
//! each layer's KV heads keep the `budget - observe` prompt positions that the prompt's last
//! `observe` queries attend to most, plus those last `observe` positions themselves; the rest
//! of the prompt's KV goes back to the pool. Votes are the attention weights of the
//! observation window's queries summed over the window and over the query heads that share
//! the KV head, then max-pooled over `pool` neighbouring positions so that a chosen token
//! keeps its neighbours (the paper's clustering step); selection is per layer and per KV
//! head, as the paper selects per head. The scoring is in `crate::snapkv`.
//!
//! Storage: every (layer, KV head) keeps the same number of positions, so the compressed
//! sequence is an ordinary sequence of `budget` slots whose slot `i` holds, for each layer
//! and head, that head's `i`-th kept position in position order (different heads keep
//! different positions in the same slot). Keys stay rotated at their own positions, so the
//! scores of kept keys are those of full attention; tokens after the prompt are written in
//! the next slots and rotated at their position in the prompt's frame, `shift` positions
//! past their slot (`Sequence::shift`). Generation attends to every kept slot.
//!
//! A compressed sequence neither feeds the prefix cache (its blocks no longer hold what the
//! tokens' hashes name) nor can be compressed twice.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::cache::{KvCache, KvKind, SeqId, Storage};
use crate::error::{EngineError, Result};

/// The sizes of SnapKV's selection, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapKv {
    /// Prompt positions each (layer, KV head) keeps, the observation window included.
    pub budget: usize,
    /// The prompt's last tokens whose queries vote, and which are always kept.
    pub observe: usize,
    /// Width of the max-pooling over neighbouring positions' votes (odd; 1: none).
    pub pool: usize,
}

impl SnapKv {
    /// The paper's observation window.
    pub const DEFAULT_OBSERVE: usize = 32;
    /// The paper's pooling kernel.
    pub const DEFAULT_POOL: usize = 7;

    /// Whether a prompt of `len` tokens is compressed (longer than the budget).
    pub fn compresses(&self, len: usize) -> bool {
        len > self.budget
    }

    /// The slots a prompt of `len` tokens holds once computed (and compressed).
    pub fn kept(&self, len: usize) -> usize {
        len.min(self.budget)
    }

    /// Sizes that can be run: an observation window of at least one token inside a budget
    /// that leaves room for at least one voted position, an odd pooling width.
    pub fn validate(&self) -> Result<()> {
        if self.observe == 0 || self.budget <= self.observe {
            return Err(EngineError::invalid(
                "attention.snapkv",
                format!(
                    "budget {} must exceed observe {} (at least 1)",
                    self.budget, self.observe
                ),
            ));
        }
        if self.pool == 0 || self.pool.is_multiple_of(2) {
            return Err(EngineError::invalid(
                "attention.pool",
                format!("{} (must be odd)", self.pool),
            ));
        }
        Ok(())
    }

    /// The positions one (layer, KV head) keeps of a prompt of `len` tokens from the votes
    /// of its first `len - observed` positions: the `budget - observed` best pooled votes
    /// (ties to the earlier position), then the observation window, in position order.
    pub fn select(&self, votes: &[f32], len: usize) -> Vec<usize> {
        let observed = len - votes.len();
        let pooled = max_pool(votes, self.pool);
        let mut order: Vec<usize> = (0..pooled.len()).collect();
        order.sort_by(|&a, &b| pooled[b].total_cmp(&pooled[a]).then(a.cmp(&b)));
        order.truncate(self.budget.saturating_sub(observed).min(votes.len()));
        order.sort_unstable();
        order.extend(len - observed..len);
        order
    }
}

impl fmt::Display for SnapKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "snapkv={},observe={},pool={}",
            self.budget, self.observe, self.pool
        )
    }
}

/// `x` max-pooled over windows of `k` (odd) centred on each position, clipped at the ends.
fn max_pool(x: &[f32], k: usize) -> Vec<f32> {
    let r = k / 2;
    (0..x.len())
        .map(|i| {
            x[i.saturating_sub(r)..(i + r + 1).min(x.len())]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

impl KvCache {
    /// The keys of the first `n` positions of sequence `id` in one layer and KV head, as f32
    /// rows of `head_dim`.
    pub fn key_rows(&self, id: SeqId, layer: usize, head: usize, n: usize) -> Result<Vec<f32>> {
        let s = self.seq(id)?;
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        if n > s.len || s.window.is_some() {
            return Err(EngineError::invalid(
                "sequence",
                format!("{n} keys of a sequence of {} (or windowed)", s.len),
            ));
        }
        let mut out = Vec::with_capacity(n * hd);
        for t in 0..n {
            let o =
                self.region_offset(s.blocks[t / bs], layer, KvKind::K) + (head * bs + t % bs) * hd;
            match &self.storage {
                Storage::F32(d) => out.extend_from_slice(&d[o..o + hd]),
                Storage::F16(d) => out.extend(d[o..o + hd].iter().map(|v| v.to_f32())),
            }
        }
        Ok(out)
    }

    /// Prepares the new, empty sequence `id` for the KV of a prompt of `prompt_tokens`
    /// tokens that SnapKV compressed elsewhere to `kept` slots: its later tokens are rotated
    /// in the prompt's frame. The caller then reserves `kept` slots as for any prompt.
    pub fn expect_compressed_prompt(
        &mut self,
        id: SeqId,
        prompt_tokens: usize,
        kept: usize,
    ) -> Result<()> {
        let s = self.empty_seq_mut(id, "sequence")?;
        if s.window.is_some() || kept > prompt_tokens {
            return Err(EngineError::invalid(
                "sequence",
                format!("sequence {id} cannot take a compressed prompt of {kept} of {prompt_tokens} tokens"),
            ));
        }
        s.shift = prompt_tokens - kept;
        Ok(())
    }

    /// Tokens a compressed sequence's positions run ahead of its slots (0 otherwise).
    pub fn shift(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.shift)
    }

    /// Compresses sequence `id` to the positions `keep[layer * kv_heads + head]` lists for
    /// each layer and KV head (the same number for all, ascending): slot `i` of a fresh set
    /// of blocks takes each head's `i`-th kept position; the old blocks go back to the pool.
    /// All or nothing: on error the sequence is untouched.
    pub fn compact(&mut self, id: SeqId, keep: &[Vec<usize>]) -> Result<()> {
        let (bs, hd, layers, heads) = (
            self.layout.block_size,
            self.layout.head_dim,
            self.layout.n_layers,
            self.layout.n_kv_heads,
        );
        let s = self.seq(id)?;
        let m = keep.first().map_or(0, Vec::len);
        let valid = keep.len() == layers * heads
            && m > 0
            && keep
                .iter()
                .all(|k| k.len() == m && k.windows(2).all(|w| w[0] < w[1]) && k[m - 1] < s.len);
        if !valid || s.window.is_some() || s.shift > 0 {
            return Err(EngineError::invalid(
                "keep",
                format!(
                    "not one ascending run of kept positions per layer and head of sequence {id}"
                ),
            ));
        }
        let (old, len) = (s.blocks.clone(), s.len);
        let fresh = self.allocate_blocks(m.div_ceil(bs))?;
        if let Some(&b) = fresh.last() {
            self.zero_if_partial(b, m);
        }
        let range = |block, layer, kind: KvKind, head, slot| -> Range<usize> {
            let o = self.region_offset(block, layer, kind) + (head * bs + slot) * hd;
            o..o + hd
        };
        let mut moves = Vec::with_capacity(layers * heads * 2 * m);
        for layer in 0..layers {
            for head in 0..heads {
                for (i, &p) in keep[layer * heads + head].iter().enumerate() {
                    for kind in [KvKind::K, KvKind::V] {
                        moves.push((
                            range(old[p / bs], layer, kind, head, p % bs),
                            range(fresh[i / bs], layer, kind, head, i % bs).start,
                        ));
                    }
                }
            }
        }
        match &mut self.storage {
            Storage::F32(d) => moves
                .iter()
                .for_each(|(from, to)| d.copy_within(from.clone(), *to)),
            Storage::F16(d) => moves
                .iter()
                .for_each(|(from, to)| d.copy_within(from.clone(), *to)),
        }
        for &b in &fresh {
            self.device.host_wrote(b);
        }
        for b in old {
            self.release_block(b);
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.blocks = fresh;
            s.shift = len - m;
            s.len = m;
            s.hashes.clear();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kv::{KvDtype, KvLayout};

    #[test]
    fn compaction_moves_each_heads_kept_positions_into_fresh_slots_and_frees_the_rest() {
        let layout = KvLayout {
            fingerprint: "t".into(),
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 2,
            block_size: 4,
            dtype: KvDtype::F16,
            groups: crate::kv::KvGroups::single(2),
        };
        let mut c = KvCache::new(layout, 8);
        c.add_sequence(1).unwrap();
        c.prepare_append(1, 10).unwrap();
        // Token t's key in layer l, head h is (100 l + 10 h + t, -t); its value the negation.
        let blocks = c.sequence_blocks(1).unwrap().to_vec();
        for t in 0..10 {
            for l in 0..2 {
                let k: Vec<f32> = (0..2)
                    .flat_map(|h| [(100 * l + 10 * h + t) as f32, -(t as f32)])
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                c.write_token(blocks[t / 4], t % 4, l, &k, &v);
            }
        }
        c.commit_append(1, 10).unwrap();
        assert_eq!(c.used_blocks(), 3);
        // Each head keeps 5 positions of its own, the last two (the observation) shared.
        let keep = vec![
            vec![0, 1, 2, 8, 9],
            vec![3, 4, 5, 8, 9],
            vec![1, 3, 7, 8, 9],
            vec![0, 5, 6, 8, 9],
        ];
        c.compact(1, &keep).unwrap();
        assert_eq!((c.sequence_len(1).unwrap(), c.shift(1).unwrap()), (5, 5));
        assert_eq!(
            c.used_blocks(),
            2,
            "5 slots in 2 fresh blocks; the 3 old ones freed"
        );
        for l in 0..2 {
            for h in 0..2 {
                let want: Vec<f32> = keep[l * 2 + h]
                    .iter()
                    .flat_map(|&t| [(100 * l + 10 * h + t) as f32, -(t as f32)])
                    .collect();
                assert_eq!(c.key_rows(1, l, h, 5).unwrap(), want, "layer {l} head {h}");
            }
        }
        // Values moved with their keys.
        let b0 = c.sequence_blocks(1).unwrap()[0];
        let v = c.region_bytes(b0, 1, KvKind::V);
        let first: Vec<f32> = v[..4]
            .chunks_exact(2)
            .map(|x| half::f16::from_le_bytes([x[0], x[1]]).to_f32())
            .collect();
        assert_eq!(
            first,
            vec![-(100.0 + 1.0), 1.0],
            "layer 1 head 0 slot 0: token 1"
        );
        // A second compaction, or a bad keep list, is refused and changes nothing.
        assert!(c.compact(1, &keep).is_err());
        c.free_sequence(1);
        assert_eq!(c.used_blocks(), 0);
    }

    #[test]
    fn selection_keeps_the_best_pooled_votes_and_the_observation_window_in_order() {
        let s = SnapKv {
            budget: 4,
            observe: 2,
            pool: 1,
        };
        // 8 tokens: votes for the first 6; the last 2 observe and are kept.
        let votes = [0.1, 0.9, 0.0, 0.3, 0.8, 0.2];
        assert_eq!(s.select(&votes, 8), vec![1, 4, 6, 7]);
        // Pooling over 3 lifts the neighbours of a strong vote; ties go to the earlier one.
        let pooled = SnapKv { pool: 3, ..s };
        assert_eq!(max_pool(&votes, 3), vec![0.9, 0.9, 0.9, 0.8, 0.8, 0.8]);
        assert_eq!(pooled.select(&votes, 8), vec![0, 1, 6, 7]);
        assert!(s.compresses(5) && !s.compresses(4));
        assert!(s.validate().is_ok());
        for bad in [
            SnapKv { budget: 2, ..s },
            SnapKv { observe: 0, ..s },
            SnapKv { pool: 2, ..s },
        ] {
            assert!(bad.validate().is_err(), "{bad}");
        }
    }
}
