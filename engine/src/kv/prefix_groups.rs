//! The prefix cache of a cache with layer groups (`super::groups`), after vLLM's hybrid
//! KV cache manager: each group's blocks are cached under their own key (the block's
//! chained hash, mixed with the group for groups after the first), evicted independently
//! from the one LRU, and a hit is the longest prefix that every group can serve.
//!
//! A global group serves `n` blocks when it holds all of `0..n`; a local group when it
//! holds the blocks the next query (at position `n * block_size`) sees, from
//! `droppable_below(n * block_size)` to `n` (found right to left as `n` shrinks). The hit
//! is the largest `n` both accept: the longest global run, lowered until every local
//! window is there. Only what a group serves is attached: a local group attaches its
//! window, the blocks before it count as dropped.

use super::allocator::BlockId;
use super::cache::KvCache;
use super::prefix::{BlockHash, KvTier, PrefixHit};
use crate::kv::SeqId;

/// The key of group `g`'s block whose chained hash is `h` (group 0: `h` itself, so the
/// hashes a router computes name the global group's blocks).
pub fn group_key(h: BlockHash, g: usize) -> BlockHash {
    if g == 0 {
        return h;
    }
    // splitmix64 of the hash and the group.
    let mut z = h ^ (g as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The longest prefix of `hashes` (at most `limit` blocks) that every layer group serves,
/// by the rule of the module docs, where group `g` has window `windows[g]` (`None`: global)
/// and `held(key)` says whether a group's block is cached ([`group_key`]). One rule for the
/// cache that attaches the prefix and for a router that tracks the keys a worker reports.
pub fn servable_prefix(
    windows: &[Option<usize>],
    block_size: usize,
    hashes: &[BlockHash],
    limit: usize,
    held: impl Fn(BlockHash) -> bool,
) -> usize {
    let bs = block_size.max(1);
    let has = |i: usize, g: usize| held(group_key(hashes[i], g));
    let groups = 0..windows.len();
    let mut n = 0;
    while n < limit.min(hashes.len())
        && groups
            .clone()
            .filter(|&g| windows[g].is_none())
            .all(|g| has(n, g))
    {
        n += 1;
    }
    while n > 0 {
        let serves = |g: usize| {
            let from = windows[g].map_or(0, |w| (n * bs + 1).saturating_sub(w) / bs);
            (from..n).rev().all(|i| has(i, g))
        };
        if groups.clone().filter(|&g| windows[g].is_some()).all(serves) {
            break;
        }
        n -= 1;
    }
    n
}

impl KvCache {
    /// The longest prefix of `hashes` (at most `limit` blocks) every group can serve, and
    /// the tier of each of group 0's blocks in it.
    pub(super) fn grouped_hit(&self, hashes: &[BlockHash], limit: usize) -> Vec<KvTier> {
        let Some(p) = &self.prefix else {
            return Vec::new();
        };
        let groups = &self.layout.groups;
        let n = servable_prefix(
            &groups.windows,
            self.layout.block_size,
            hashes,
            limit,
            |k| p.tier_of(k).is_some(),
        );
        hashes[..n].iter().filter_map(|&h| p.tier_of(h)).collect()
    }

    /// [`KvCache::attach_prefix`] for a grouped cache: attaches every group's part of the
    /// longest prefix all groups serve, or nothing when one of its blocks cannot be brought
    /// up (no room in the pool, a lower tier that fails to read).
    pub(super) fn attach_grouped(
        &mut self,
        id: SeqId,
        hashes: &[BlockHash],
        limit: usize,
    ) -> PrefixHit {
        let n = self.grouped_hit(hashes, limit).len();
        let bs = self.layout.block_size;
        let n_groups = self.layout.groups.n_groups();
        let mut hit = PrefixHit::default();
        let mut tables: Vec<(usize, Vec<BlockId>)> = Vec::with_capacity(n_groups);
        let mut complete = true;
        'groups: for g in 0..n_groups {
            let from = self.layout.groups.droppable_below(g, n * bs, bs);
            let mut blocks = Vec::with_capacity(n - from);
            for &h in &hashes[from..n] {
                match self.bring_up(group_key(h, g)) {
                    Some((b, tier)) => {
                        blocks.push(b);
                        if g == 0 {
                            hit.count(tier);
                        }
                    }
                    None => {
                        tables.push((from, blocks));
                        complete = false;
                        break 'groups;
                    }
                }
            }
            tables.push((from, blocks));
        }
        if !complete {
            for b in tables.into_iter().flat_map(|(_, b)| b) {
                self.release_block(b);
            }
            return PrefixHit::default();
        }
        let mut tables = tables.into_iter();
        if let Some(s) = self.seqs.get_mut(&id) {
            s.len = n * bs;
            s.hashes = hashes[..n].to_vec();
            if let Some((_, blocks)) = tables.next() {
                s.blocks = blocks;
            }
            for (t, (from, blocks)) in s.groups.iter_mut().zip(tables) {
                t.dropped = from;
                t.blocks = blocks;
            }
        }
        hit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_zero_keeps_the_chain_hash_and_other_groups_get_their_own() {
        assert_eq!(group_key(42, 0), 42);
        let keys: Vec<BlockHash> = (1..6).map(|g| group_key(42, g)).collect();
        let mut unique = keys.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 5);
        assert!(!keys.contains(&42));
    }
}
