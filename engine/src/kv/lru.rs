//! A least-recently-used set: insert / touch / remove in O(log n), oldest first out.
//!
//! Used for the device blocks no sequence holds (the prefix cache's eviction order) and for
//! the slots of the host and disk tiers. Invariant: `order` and `tick_of` describe the same
//! members (each member has exactly one tick, each tick one member).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

#[derive(Debug, Clone)]
pub struct Lru<K: Copy + Eq + Hash> {
    next_tick: u64,
    order: BTreeMap<u64, K>,
    tick_of: HashMap<K, u64>,
}

impl<K: Copy + Eq + Hash> Default for Lru<K> {
    fn default() -> Self {
        Lru {
            next_tick: 0,
            order: BTreeMap::new(),
            tick_of: HashMap::new(),
        }
    }
}

impl<K: Copy + Eq + Hash> Lru<K> {
    pub fn len(&self) -> usize {
        self.tick_of.len()
    }

    pub fn contains(&self, k: &K) -> bool {
        self.tick_of.contains_key(k)
    }

    /// Adds `k` as the most recently used (or marks it so if present).
    pub fn insert(&mut self, k: K) {
        if let Some(t) = self.tick_of.remove(&k) {
            self.order.remove(&t);
        }
        let t = self.next_tick;
        self.next_tick += 1;
        self.order.insert(t, k);
        self.tick_of.insert(k, t);
    }

    /// Removes `k`; whether it was present.
    pub fn remove(&mut self, k: &K) -> bool {
        match self.tick_of.remove(k) {
            Some(t) => {
                self.order.remove(&t);
                true
            }
            None => false,
        }
    }

    /// The least recently used member, without removing it.
    pub fn oldest(&self) -> Option<K> {
        self.order.values().next().copied()
    }

    /// Removes and returns the least recently used member.
    pub fn pop_oldest(&mut self) -> Option<K> {
        let (_, k) = self.order.pop_first()?;
        self.tick_of.remove(&k);
        Some(k)
    }

    /// Members, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = K> + '_ {
        self.order.values().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::Lru;

    #[test]
    fn oldest_goes_first_and_touch_moves_to_the_back() {
        let mut l = Lru::default();
        for k in [1, 2, 3] {
            l.insert(k);
        }
        l.insert(1);
        assert_eq!(l.pop_oldest(), Some(2));
        assert!(l.remove(&3));
        assert!(!l.remove(&3));
        assert_eq!(l.iter().collect::<Vec<_>>(), [1]);
        assert_eq!(l.len(), 1);
    }
}
