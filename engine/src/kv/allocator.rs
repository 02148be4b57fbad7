//! Fixed pool of KV blocks with reference counts and an evictable cache.
//!
//! A block is in exactly one of three states:
//! - **used**: reference count > 0 (a sequence or a reservation holds it);
//! - **cached**: reference count 0 but its content is indexed by the prefix cache; it sits
//!   in an LRU and is handed out again (evicted) only when no empty block is left;
//! - **empty**: reference count 0, nothing worth keeping; on the free list.
//!
//! Invariants (checked by [`BlockAllocator::check`] and property tests):
//! - `free_blocks() + used_blocks() == total_blocks()` at all times, where free blocks are
//!   the empty and the cached ones (both can be allocated);
//! - a block is on the free list exactly when its reference count is 0 and it is not
//!   cacheable; it is in the LRU exactly when its count is 0 and it is cacheable;
//! - a block in use is never evicted: allocation takes only count-0 blocks.

use super::lru::Lru;
use crate::error::{EngineError, Result};

pub type BlockId = u32;

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<BlockId>,
    refcount: Vec<u32>,
    /// The block's content is indexed (prefix cache).
    cacheable: Vec<bool>,
    /// Cacheable blocks with reference count 0, least recently used first.
    idle: Lru<BlockId>,
    /// Cacheable blocks that the last allocations took from the LRU (their index entries
    /// must go); drained by the cache.
    evicted: Vec<BlockId>,
}

impl BlockAllocator {
    pub fn new(total: usize) -> Self {
        // Pop from the end: hand out low ids first (nicer to read in traces).
        let free = (0..total as BlockId).rev().collect();
        Self {
            free,
            refcount: vec![0; total],
            cacheable: vec![false; total],
            idle: Lru::default(),
            evicted: Vec::new(),
        }
    }

    pub fn total_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks an allocation can take: empty ones plus cached ones nobody holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Cached blocks nobody holds (a subset of [`Self::free_blocks`]).
    pub fn cached_blocks(&self) -> usize {
        self.idle.len()
    }

    pub fn used_blocks(&self) -> usize {
        self.total_blocks() - self.free_blocks()
    }

    /// Take `n` blocks, all or none: empty blocks first, then the least recently used
    /// cached ones (reported by [`Self::take_evicted`]).
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n > self.free_blocks() {
            return Err(EngineError::KvExhausted {
                needed: n,
                free: self.free_blocks(),
            });
        }
        let from_free = n.min(self.free.len());
        let at = self.free.len() - from_free;
        let mut blocks: Vec<BlockId> = self.free.drain(at..).rev().collect();
        while blocks.len() < n {
            let Some(b) = self.idle.pop_oldest() else {
                break;
            };
            self.cacheable[b as usize] = false;
            self.evicted.push(b);
            blocks.push(b);
        }
        for &b in &blocks {
            self.refcount[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// Cached blocks taken by allocations since the last call (their content is gone).
    pub fn take_evicted(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.evicted)
    }

    /// Add a reference to a block that is in use, or take a cached block nobody holds
    /// (a prefix hit). A reference to an empty block is refused (`false`).
    pub fn retain(&mut self, b: BlockId) -> bool {
        let i = b as usize;
        let Some(rc) = self.refcount.get_mut(i) else {
            return false;
        };
        if *rc == 0 {
            if !self.cacheable[i] {
                debug_assert!(false, "retain of an empty block {b}");
                return false;
            }
            self.idle.remove(&b);
        }
        *rc += 1;
        true
    }

    /// Drop a reference; at zero a cacheable block becomes cached (most recently used),
    /// any other returns to the free list.
    pub fn release(&mut self, b: BlockId) {
        let i = b as usize;
        if let Some(rc) = self.refcount.get_mut(i) {
            if *rc == 0 {
                debug_assert!(false, "double release of block {b}");
                return;
            }
            *rc -= 1;
            if *rc == 0 {
                if self.cacheable[i] {
                    self.idle.insert(b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// Marks whether a block's content is indexed. Un-marking a cached block nobody holds
    /// returns it to the free list.
    pub fn set_cacheable(&mut self, b: BlockId, on: bool) {
        let i = b as usize;
        if i >= self.cacheable.len() || self.cacheable[i] == on {
            return;
        }
        self.cacheable[i] = on;
        if self.refcount[i] == 0 {
            if on {
                if let Some(p) = self.free.iter().position(|&f| f == b) {
                    self.free.swap_remove(p);
                }
                self.idle.insert(b);
            } else {
                self.idle.remove(&b);
                self.free.push(b);
            }
        }
    }

    pub fn is_cacheable(&self, b: BlockId) -> bool {
        self.cacheable.get(b as usize).copied().unwrap_or(false)
    }

    /// Marks a cached block as just used (it is evicted later).
    pub fn touch(&mut self, b: BlockId) {
        if self.idle.contains(&b) {
            self.idle.insert(b);
        }
    }

    /// The cached block that would be evicted next.
    pub fn next_eviction(&self) -> Option<BlockId> {
        match self.free.is_empty() {
            true => self.idle.oldest(),
            false => None,
        }
    }

    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refcount.get(b as usize).copied().unwrap_or(0)
    }

    /// Check every invariant; returns a description of the first violation.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.refcount.len()];
        for &b in &self.free {
            let i = b as usize;
            if i >= seen.len() {
                return Err(format!("free block {b} out of range"));
            }
            if seen[i] {
                return Err(format!("block {b} free twice"));
            }
            seen[i] = true;
            if self.refcount[i] != 0 {
                return Err(format!("free block {b} has refcount {}", self.refcount[i]));
            }
            if self.cacheable[i] {
                return Err(format!("free block {b} is cacheable"));
            }
        }
        for b in self.idle.iter() {
            let i = b as usize;
            if i >= seen.len() || seen[i] {
                return Err(format!("cached block {b} out of range or also free"));
            }
            seen[i] = true;
            if self.refcount[i] != 0 || !self.cacheable[i] {
                return Err(format!(
                    "cached block {b}: refcount {} cacheable {}",
                    self.refcount[i], self.cacheable[i]
                ));
            }
        }
        let used = self.refcount.iter().filter(|&&r| r > 0).count();
        if used + self.free_blocks() != self.refcount.len() {
            return Err(format!(
                "used {used} + free {} + cached {} != total {}",
                self.free.len(),
                self.idle.len(),
                self.refcount.len()
            ));
        }
        Ok(())
    }
}
