//! The router's view of what every worker's prefix cache holds: per worker (by registry
//! key), the block hashes it reported stored and not since removed, with their tier. Fed by
//! the workers' KV event streams ([`crate::kv_subscriber`]).
//!
//! Approximate by design: the index may lag a worker by a few milliseconds, or miss a
//! worker whose stream is down (then it knows nothing of it). Either way routing stays
//! correct: a worker that lacks a block the router expected computes it, and a worker the
//! index knows nothing about is routed on load alone. What the index must never do is stay
//! wrong: a gap in a stream's sequence numbers makes the subscriber start again from a
//! snapshot, and a worker that leaves the view, or whose stream breaks, is forgotten.

use std::collections::HashMap;
use std::sync::RwLock;

use duet_engine::{BlockHash, KvTier};
use duet_proto::v1 as pb;
use duet_serving::convert::tier_from_proto;

/// How much of a prompt a worker holds, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks held in any tier.
    pub blocks: usize,
    /// Of those, the blocks in the host or disk tier (a prefetch brings them up).
    pub lower: usize,
}

/// What applying a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Ok,
    /// The batch does not follow the last one (changes were lost, or the worker restarted):
    /// the subscriber must start again from a snapshot.
    Gap,
}

#[derive(Debug, Default)]
struct WorkerBlocks {
    instance: u64,
    seq: u64,
    blocks: HashMap<BlockHash, KvTier>,
}

/// Per-worker cached blocks.
#[derive(Debug, Default)]
pub struct KvIndex {
    workers: RwLock<HashMap<String, WorkerBlocks>>,
}

impl KvIndex {
    pub fn new() -> KvIndex {
        KvIndex::default()
    }

    /// Applies one batch of worker `key`'s stream. A snapshot replaces what was known;
    /// the parts of a snapshot after its first carry the same sequence number.
    pub fn apply(&self, key: &str, batch: &pb::KvEventBatch) -> Applied {
        let Ok(mut m) = self.workers.write() else {
            return Applied::Gap;
        };
        if batch.snapshot {
            m.insert(
                key.to_string(),
                WorkerBlocks {
                    instance: batch.instance,
                    seq: batch.seq,
                    blocks: HashMap::new(),
                },
            );
        }
        let Some(w) = m.get_mut(key) else {
            return Applied::Gap;
        };
        let follows = batch.instance == w.instance
            && (batch.seq == w.seq + 1 || (batch.seq == w.seq && !batch.events.is_empty()));
        if !batch.snapshot && !follows {
            m.remove(key);
            return Applied::Gap;
        }
        w.seq = batch.seq;
        for e in &batch.events {
            let tier = tier_from_proto(e.tier);
            for &h in &e.hashes {
                if e.stored {
                    w.blocks.insert(h, tier);
                } else if w.blocks.get(&h) == Some(&tier) {
                    w.blocks.remove(&h);
                }
            }
        }
        Applied::Ok
    }

    /// Forgets worker `key` (left the view, or its stream broke).
    pub fn forget(&self, key: &str) {
        if let Ok(mut m) = self.workers.write() {
            m.remove(key);
        }
    }

    /// The leading blocks of `hashes` worker `key` holds.
    pub fn matched(&self, key: &str, hashes: &[BlockHash]) -> PrefixMatch {
        self.matched_grouped(key, hashes, None)
    }

    /// [`Self::matched`] for a worker whose cache has layer groups (`groups`: each group's
    /// window, `None` for a global one, and the block size): the prefix every group serves,
    /// as the worker's cache decides it (`duet_engine::servable_prefix` over the keys it
    /// reported), not just the run of global blocks.
    pub fn matched_grouped(
        &self,
        key: &str,
        hashes: &[BlockHash],
        groups: Option<(&[Option<usize>], usize)>,
    ) -> PrefixMatch {
        let mut out = PrefixMatch::default();
        let Ok(m) = self.workers.read() else {
            return out;
        };
        let Some(w) = m.get(key) else {
            return out;
        };
        let n = match groups {
            Some((windows, bs)) => {
                let held = |k: BlockHash| w.blocks.contains_key(&k);
                duet_engine::servable_prefix(windows, bs, hashes, hashes.len(), held)
            }
            None => hashes
                .iter()
                .take_while(|h| w.blocks.contains_key(h))
                .count(),
        };
        for h in &hashes[..n] {
            out.blocks += 1;
            let lower = w.blocks.get(h).is_some_and(|t| *t != KvTier::Device);
            out.lower += usize::from(lower);
        }
        out
    }

    /// Blocks known over every worker.
    pub fn total_blocks(&self) -> usize {
        self.workers
            .read()
            .map(|m| m.values().map(|w| w.blocks.len()).sum())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(
        seq: u64,
        snapshot: bool,
        events: Vec<(bool, pb::KvTier, Vec<u64>)>,
    ) -> pb::KvEventBatch {
        pb::KvEventBatch {
            worker_id: "p".into(),
            instance: 7,
            seq,
            snapshot,
            events: events
                .into_iter()
                .map(|(stored, tier, hashes)| pb::KvBlockEvent {
                    stored,
                    tier: tier as i32,
                    hashes,
                })
                .collect(),
            block_size: 16,
        }
    }

    /// A worker with one global and one local group (window 8, blocks of 4) that holds the
    /// global blocks 0..10 but its local group's only from 8: it serves the whole 10-block
    /// prefix, not a 6-block prefix of it (no window there), though every global block of
    /// that prefix is cached.
    #[test]
    fn a_grouped_worker_matches_only_where_its_local_windows_are() {
        let ix = KvIndex::new();
        let hashes: Vec<u64> = (100..110).collect();
        let mut keys = hashes.clone();
        keys.extend(hashes[8..].iter().map(|&h| duet_engine::group_key(h, 1)));
        let dev = pb::KvTier::Device;
        ix.apply("w", &batch(1, true, vec![(true, dev, keys)]));
        let groups: &[Option<usize>] = &[None, Some(8)];
        let full = ix.matched_grouped("w", &hashes, Some((groups, 4)));
        assert_eq!(full.blocks, 10);
        let branch = &hashes[..6];
        assert_eq!(ix.matched("w", branch).blocks, 6, "the global run");
        assert_eq!(ix.matched_grouped("w", branch, Some((groups, 4))).blocks, 0);
    }

    #[test]
    fn follows_snapshots_and_changes_and_refuses_gaps() {
        let ix = KvIndex::new();
        let dev = pb::KvTier::Device;
        assert_eq!(
            ix.apply("w", &batch(3, false, vec![])),
            Applied::Gap,
            "no snapshot yet"
        );
        assert_eq!(
            ix.apply("w", &batch(3, true, vec![(true, dev, vec![1, 2])])),
            Applied::Ok
        );
        // The rest of the snapshot, same sequence number.
        assert_eq!(
            ix.apply(
                "w",
                &batch(3, false, vec![(true, pb::KvTier::Host, vec![3])])
            ),
            Applied::Ok
        );
        assert_eq!(
            ix.matched("w", &[1, 2, 3, 4]),
            PrefixMatch {
                blocks: 3,
                lower: 1
            }
        );
        // Moved down a tier, then evicted.
        let moved = vec![(false, dev, vec![2]), (true, pb::KvTier::Host, vec![2])];
        assert_eq!(ix.apply("w", &batch(4, false, moved)), Applied::Ok);
        assert_eq!(
            ix.matched("w", &[1, 2]),
            PrefixMatch {
                blocks: 2,
                lower: 1
            }
        );
        assert_eq!(
            ix.apply("w", &batch(5, false, vec![(false, dev, vec![1])])),
            Applied::Ok
        );
        assert_eq!(
            ix.matched("w", &[1, 2]).blocks,
            0,
            "a prefix needs its first block"
        );
        // A lost batch: the worker is forgotten until the next snapshot.
        assert_eq!(
            ix.apply("w", &batch(7, false, vec![(true, dev, vec![9])])),
            Applied::Gap
        );
        assert_eq!(ix.matched("w", &[2]).blocks, 0);
        assert_eq!(ix.total_blocks(), 0);
        assert_eq!(
            ix.apply("w", &batch(8, true, vec![(true, dev, vec![9])])),
            Applied::Ok
        );
        assert_eq!(ix.matched("w", &[9]).blocks, 1);
        ix.forget("w");
        assert_eq!(ix.total_blocks(), 0);
    }
}
