//! The prefix-cache model of a simulated worker: which prompt blocks it holds, as chained
//! block hashes, least recently used first out.
//!
//! As on a worker, cached blocks are free blocks that still hold a prefix: they count as
//! free, a hit takes them into use (they leave the cache while a sequence holds them) and a
//! finished prompt's full blocks come back. The cache never holds more blocks than are
//! free: allocating evicts the least recently used ones first.
//!
//! Simplification (stated in `docs/plan.md`): two sequences running at once never share a
//! cached block; the second one misses what the first one took.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Block hashes are already well mixed: the map uses them as they are.
#[derive(Default)]
pub struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Map = HashMap<u64, u64, BuildHasherDefault<Identity>>;

/// Chained hashes of the full `block_size`-token blocks of `ids`: block k's hash covers
/// every token up to its end, so equal hashes mean equal prefixes.
pub fn block_hashes(ids: &[u32], block_size: usize) -> Vec<u64> {
    let bs = block_size.max(1);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = Vec::with_capacity(ids.len() / bs);
    for block in ids.chunks_exact(bs) {
        for &t in block {
            h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
        }
        h = h.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15;
        out.push(h);
    }
    out
}

#[derive(Debug, Default)]
pub struct PrefixLru {
    stamp_of: Map,
    by_stamp: BTreeMap<u64, u64>,
    clock: u64,
    enabled: bool,
}

impl PrefixLru {
    pub fn new(enabled: bool) -> Self {
        PrefixLru {
            enabled,
            ..PrefixLru::default()
        }
    }

    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Leading blocks of `hashes` the cache holds.
    pub fn hit(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamp_of.contains_key(h))
            .count()
    }

    /// Takes the first `n` blocks of `hashes` into use (they leave the cache).
    pub fn take(&mut self, hashes: &[u64], n: usize) {
        for h in &hashes[..n.min(hashes.len())] {
            if let Some(s) = self.stamp_of.remove(h) {
                self.by_stamp.remove(&s);
            }
        }
    }

    /// Puts `hashes` back (a finished prompt), most recent last, keeping at most `free`.
    pub fn insert(&mut self, hashes: &[u64], free: usize) {
        if !self.enabled {
            return;
        }
        for &h in hashes {
            self.clock += 1;
            if let Some(old) = self.stamp_of.insert(h, self.clock) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.clock, h);
        }
        self.shrink_to(free);
    }

    /// Evicts the least recently used blocks until at most `free` remain.
    pub fn shrink_to(&mut self, free: usize) {
        while self.stamp_of.len() > free {
            let Some((_, h)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_hash_equal_and_the_rest_differs() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7], 2);
        let b = block_hashes(&[1, 2, 3, 4, 9, 9], 2);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn hits_are_leading_taken_blocks_leave_and_the_oldest_go_first() {
        let mut c = PrefixLru::new(true);
        c.insert(&[1, 2, 3], 10);
        assert_eq!(c.hit(&[1, 2, 9]), 2);
        assert_eq!(c.hit(&[2, 3]), 2);
        assert_eq!(c.hit(&[9, 1]), 0);
        c.take(&[1, 2], 2);
        assert_eq!(c.hit(&[1]), 0);
        assert_eq!(c.len(), 1);
        c.insert(&[4, 5], 10);
        c.shrink_to(2);
        assert_eq!(c.hit(&[3]), 0, "the oldest went first");
        assert_eq!(c.hit(&[4, 5]), 2);
        let mut off = PrefixLru::new(false);
        off.insert(&[1], 10);
        assert_eq!(off.hit(&[1]), 0);
    }
}
