//! Layer groups of the paged KV cache (vLLM's hybrid KV cache manager): a model whose
//! layers mix global attention and local (sliding-window) attention keeps a block table per
//! *group* of layers, so that a local group can give back the blocks that fall out of its
//! window while the global layers keep every token.
//!
//! - The layers split into groups of `per_group` layers each, `per_group` the greatest
//!   common divisor of the global and local layer counts (no padding ever). Global layers
//!   fill the first groups, local layers the rest, each kind interleaved as vLLM does
//!   (`layers[i::groups]`): Gemma 3 270M (layers 5, 11, 17 global) has one global group
//!   (5, 11, 17) and five local ones ((0, 6, 12), (1, 7, 13), ...).
//! - A block holds `per_group` layers' K and V of `block_size` tokens, and belongs to one
//!   group of one sequence at a time: the pool's blocks are shared by all groups, one
//!   allocator, one eviction order.
//! - A model whose layers are all of one kind has one group of every layer: its storage,
//!   offsets and frames are those of a cache without groups.
//!
//! Invariant of a local group's table: its `dropped` leading logical blocks hold no
//! position any later query of the sequence sees (`LayerAttention::first_seen`), and only
//! they are missing. Readers that visit such a block (the lane-preserving attention path
//! reads values at weight exactly zero) see the cache's *null block*, zeroed and never
//! written, so a grouped cache computes the same bits as an ungrouped one.

use serde::{Deserialize, Serialize};

use crate::architecture::{LayerAttention, LayerSpec};

/// How a model's layers share the pool's blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGroups {
    /// Layers per group: what one block holds.
    pub per_group: usize,
    /// Per layer, its group and its place in the group's blocks.
    pub of_layer: Vec<(usize, usize)>,
    /// Per group, the window of its local layers (`None`: global).
    pub windows: Vec<Option<usize>>,
}

impl KvGroups {
    /// One group of every layer (no layer drops anything).
    pub fn single(n_layers: usize) -> Self {
        Self {
            per_group: n_layers,
            of_layer: (0..n_layers).map(|l| (0, l)).collect(),
            windows: vec![None],
        }
    }

    /// The groups of these layers: one group unless global and local layers of one window
    /// are mixed.
    pub fn for_layers(layers: &[LayerSpec]) -> Self {
        let n = layers.len();
        let mut local = Vec::new();
        let mut global = Vec::new();
        let mut windows = Vec::new();
        for (l, s) in layers.iter().enumerate() {
            match s.attention {
                LayerAttention::Global => global.push(l),
                LayerAttention::Local { window } => {
                    local.push(l);
                    windows.push(window);
                }
            }
        }
        windows.dedup();
        let one_window = windows.len() == 1;
        if global.is_empty() || local.is_empty() || !one_window {
            return Self::single(n);
        }
        let window = windows[0];
        let per_group = gcd(global.len(), local.len());
        let (n_global, n_local) = (global.len() / per_group, local.len() / per_group);
        let mut of_layer = vec![(0, 0); n];
        for (i, &l) in global.iter().enumerate() {
            of_layer[l] = (i % n_global, i / n_global);
        }
        for (i, &l) in local.iter().enumerate() {
            of_layer[l] = (n_global + i % n_local, i / n_local);
        }
        let mut ws = vec![None; n_global];
        ws.extend(std::iter::repeat_n(Some(window), n_local));
        Self {
            per_group,
            of_layer,
            windows: ws,
        }
    }

    pub fn n_groups(&self) -> usize {
        self.windows.len()
    }

    /// Whether any group drops blocks (more than one group).
    pub fn is_grouped(&self) -> bool {
        self.windows.len() > 1
    }

    pub fn group_of(&self, layer: usize) -> usize {
        self.of_layer.get(layer).map_or(0, |g| g.0)
    }

    pub fn member_of(&self, layer: usize) -> usize {
        self.of_layer.get(layer).map_or(0, |g| g.1)
    }

    /// The window of group `g` (`None`: global).
    pub fn window(&self, g: usize) -> Option<usize> {
        self.windows.get(g).copied().flatten()
    }

    /// The logical blocks of group `g` that no query at `len` or later sees: every block
    /// before the one holding the first position the query at `len` sees (0 for a global
    /// group).
    pub fn droppable_below(&self, g: usize, len: usize, block_size: usize) -> usize {
        match self.window(g) {
            Some(w) => LayerAttention::Local { window: w }.first_seen(len) / block_size,
            None => 0,
        }
    }

    /// The most blocks a sequence of `tokens` tokens holds at once while it is computed in
    /// chunks of at most `chunk` tokens (vLLM's bound for a local group: the window and a
    /// chunk, plus one block because the window need not start on a block boundary).
    pub fn peak_blocks(&self, tokens: usize, chunk: usize, block_size: usize) -> usize {
        let all = tokens.div_ceil(block_size);
        self.windows
            .iter()
            .map(|w| match w {
                None => all,
                Some(w) => all.min((w - 1 + chunk.max(1)).div_ceil(block_size) + 1),
            })
            .sum()
    }

    /// The blocks a sequence of `tokens` tokens keeps once its KV is complete: what an
    /// imported prompt reserves.
    pub fn kept_blocks(&self, tokens: usize, block_size: usize) -> usize {
        let all = tokens.div_ceil(block_size);
        (0..self.n_groups())
            .map(|g| all - self.droppable_below(g, tokens, block_size).min(all))
            .sum()
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a.max(1),
        _ => gcd(b, a % b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma_like(n: usize, every: usize, window: usize) -> Vec<LayerSpec> {
        (0..n)
            .map(|l| LayerSpec {
                attention: match (l + 1) % every == 0 {
                    true => LayerAttention::Global,
                    false => LayerAttention::Local { window },
                },
                rope_base: 10_000.0,
            })
            .collect()
    }

    #[test]
    fn gemma_270m_has_one_global_group_and_five_local_ones_of_three_layers() {
        let g = KvGroups::for_layers(&gemma_like(18, 6, 512));
        assert_eq!(g.per_group, 3);
        assert_eq!(g.n_groups(), 6);
        assert_eq!(g.windows[0], None);
        assert!(g.windows[1..].iter().all(|w| *w == Some(512)));
        let global: Vec<usize> = (0..18).filter(|&l| g.group_of(l) == 0).collect();
        assert_eq!(global, vec![5, 11, 17]);
        assert_eq!(g.of_layer[0], (1, 0));
        assert_eq!(
            g.of_layer[1],
            (2, 0),
            "local layers interleave over the groups"
        );
        assert_eq!(g.of_layer[6], (1, 1), "group 1 holds layers 0, 6 and 12");
        // Every (group, member) is taken by exactly one layer.
        let mut seen = g.of_layer.clone();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 18);
        assert!(seen.iter().all(|&(grp, m)| grp < 6 && m < 3));
    }

    #[test]
    fn models_of_one_attention_kind_have_one_group() {
        let all_global: Vec<LayerSpec> = gemma_like(4, 1, 8);
        let g = KvGroups::for_layers(&all_global);
        assert_eq!(g, KvGroups::single(4));
        assert!(!g.is_grouped());
        assert_eq!(g.peak_blocks(100, 16, 16), 7);
    }

    #[test]
    fn local_groups_keep_only_their_window() {
        let g = KvGroups::for_layers(&gemma_like(18, 6, 512));
        // 4,096 tokens: the next query sees 3,585.., block 224 on: 32 blocks per local group.
        assert_eq!(g.droppable_below(1, 4096, 16), 224);
        assert_eq!(g.droppable_below(0, 4096, 16), 0);
        assert_eq!(g.kept_blocks(4096, 16), 256 + 5 * 32);
        assert_eq!(
            g.kept_blocks(100, 16),
            6 * 7,
            "nothing drops inside the window"
        );
        // Chunks of 256: a local group holds at most cdiv(511 + 256, 16) + 1 = 49 blocks.
        assert_eq!(g.peak_blocks(4096, 256, 16), 256 + 5 * 49);
        assert_eq!(g.peak_blocks(64, 256, 16), 6 * 4);
    }
}
