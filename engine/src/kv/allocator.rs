//! Fixed pool of KV blocks with reference counts.
//!
//! Invariants (checked by [`BlockAllocator::check`] and a property test):
//! - `free_blocks() + used_blocks() == total_blocks()` at all times;
//! - a block is on the free list exactly when its reference count is 0;
//! - no block is on the free list twice.

use crate::error::{EngineError, Result};

pub type BlockId = u32;

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<BlockId>,
    refcount: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(total: usize) -> Self {
        // Pop from the end: hand out low ids first (nicer to read in traces).
        let free = (0..total as BlockId).rev().collect();
        Self {
            free,
            refcount: vec![0; total],
        }
    }

    pub fn total_blocks(&self) -> usize {
        self.refcount.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn used_blocks(&self) -> usize {
        self.total_blocks() - self.free_blocks()
    }

    /// Take `n` blocks, all or none.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n > self.free.len() {
            return Err(EngineError::KvExhausted {
                needed: n,
                free: self.free.len(),
            });
        }
        let at = self.free.len() - n;
        let blocks: Vec<BlockId> = self.free.drain(at..).rev().collect();
        for &b in &blocks {
            self.refcount[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// Add a reference to a block that is in use (prefix sharing, forks).
    pub fn retain(&mut self, b: BlockId) {
        if let Some(rc) = self.refcount.get_mut(b as usize) {
            debug_assert!(*rc > 0, "retain of a free block {b}");
            *rc += 1;
        }
    }

    /// Drop a reference; the block returns to the pool at zero.
    pub fn release(&mut self, b: BlockId) {
        if let Some(rc) = self.refcount.get_mut(b as usize) {
            if *rc == 0 {
                debug_assert!(false, "double release of block {b}");
                return;
            }
            *rc -= 1;
            if *rc == 0 {
                self.free.push(b);
            }
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
        }
        let used = self.refcount.iter().filter(|&&r| r > 0).count();
        if used + self.free.len() != self.refcount.len() {
            return Err(format!(
                "used {used} + free {} != total {}",
                self.free.len(),
                self.refcount.len()
            ));
        }
        Ok(())
    }
}
