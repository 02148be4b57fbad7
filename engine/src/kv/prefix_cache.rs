//! The prefix cache of a [`KvCache`]: content-addressed full blocks that outlive the
//! sequences that computed them, with a host-memory tier and an optional disk tier below.
//!
//! - A sequence's full blocks are *registered* under their chained hash
//!   ([`KvCache::register_blocks`]) once their KV is complete. When the sequence ends they
//!   stay in the pool as cached blocks (reference count 0, in an LRU).
//! - A new sequence *attaches* every leading block it finds ([`KvCache::attach_prefix`]):
//!   device hits by reference count, host and disk hits copied back into fresh device
//!   blocks. The caller then computes only the tokens after the attached prefix.
//! - Allocation evicts the least recently used cached block only when no empty block is
//!   left; an evicted block moves to the host tier (whose own oldest block moves to disk).
//!   A block held by a sequence is never evicted (the allocator takes count-0 blocks only).
//! - Every change is recorded as a [`KvEvent`]; the worker publishes them so that a
//!   router can track what each worker holds.
//!
//! A cache with layer groups keys each group's blocks apart and hits only where every
//! group can serve the prefix (`super::prefix_groups`).
//!
//! Invariants: `by_hash[h] == b` iff `hash_of[b] == Some(h)` iff the allocator marks `b`
//! cacheable; an indexed block's content never changes (copy-on-write in
//! [`KvCache::prepare_append`]); a hash is held by at most one tier.

use std::collections::HashMap;
use std::path::PathBuf;

use super::allocator::BlockId;
use super::cache::KvCache;
use super::group_tables::Slot;
use super::prefix::{BlockHash, KvEvent, KvTier, PrefixHasher, PrefixHit};
use super::prefix_groups::group_key;
use super::tiers::TierStore;
use crate::error::{EngineError, Result};
use crate::kv::SeqId;

/// Sizes of the prefix cache's lower tiers.
#[derive(Debug, Clone, Default)]
pub struct PrefixCacheConfig {
    /// Blocks the host-memory tier holds (0: evicted blocks are dropped, or go to disk).
    pub host_blocks: usize,
    /// A file on local disk and the blocks it holds (the third tier).
    pub disk: Option<(PathBuf, usize)>,
}

/// Counts of cached blocks per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounts {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

pub(super) struct PrefixState {
    hasher: PrefixHasher,
    by_hash: HashMap<BlockHash, BlockId>,
    hash_of: Vec<Option<BlockHash>>,
    host: Option<TierStore>,
    disk: Option<TierStore>,
    events: Vec<KvEvent>,
}

impl PrefixState {
    fn emit(&mut self, stored: bool, tier: KvTier, h: BlockHash) {
        // Consecutive changes of one kind and tier share one event.
        match self.events.last_mut() {
            Some(KvEvent::Stored { tier: t, hashes }) if stored && *t == tier => hashes.push(h),
            Some(KvEvent::Removed { tier: t, hashes }) if !stored && *t == tier => hashes.push(h),
            _ => {
                let hashes = vec![h];
                self.events.push(match stored {
                    true => KvEvent::Stored { tier, hashes },
                    false => KvEvent::Removed { tier, hashes },
                });
            }
        }
    }

    /// The store of a lower tier (`None` for the device pool or a tier not configured).
    fn lower_mut(&mut self, tier: KvTier) -> Option<&mut TierStore> {
        match tier {
            KvTier::Device => None,
            KvTier::Host => self.host.as_mut(),
            KvTier::Disk => self.disk.as_mut(),
        }
    }

    pub(super) fn tier_of(&self, h: BlockHash) -> Option<KvTier> {
        if self.by_hash.contains_key(&h) {
            Some(KvTier::Device)
        } else if self.host.as_ref().is_some_and(|t| t.contains(h)) {
            Some(KvTier::Host)
        } else if self.disk.as_ref().is_some_and(|t| t.contains(h)) {
            Some(KvTier::Disk)
        } else {
            None
        }
    }

    /// Puts an evicted device block into the host tier (or, without one, the disk tier);
    /// the host tier's own oldest block then moves to disk, and the disk's oldest is
    /// dropped. A tier that cannot keep a block passes it on (a cache may forget).
    fn spill(&mut self, h: BlockHash, bytes: Vec<u8>) {
        let mut item = Some((h, bytes));
        for tier in [KvTier::Host, KvTier::Disk] {
            let (Some(store), Some((h, bytes))) = (self.lower_mut(tier), item.take()) else {
                continue;
            };
            let put = store.put(h, &bytes);
            if put.stored {
                self.emit(true, tier, h);
            }
            if let Some((out, _)) = &put.spilled {
                if *out != h {
                    self.emit(false, tier, *out);
                }
            }
            item = put.spilled;
        }
    }

    /// Drops `h` from the lower tiers (the device pool holds it now).
    fn forget_below(&mut self, h: BlockHash) {
        for tier in [KvTier::Host, KvTier::Disk] {
            if self.lower_mut(tier).is_some_and(|s| s.remove(h)) {
                self.emit(false, tier, h);
            }
        }
    }
}

impl KvCache {
    /// Turns the prefix cache on (with its lower tiers).
    pub fn enable_prefix_cache(&mut self, cfg: &PrefixCacheConfig) -> Result<()> {
        let block_bytes = self.block_bytes(0).len();
        let host = (cfg.host_blocks > 0).then(|| TierStore::memory(cfg.host_blocks, block_bytes));
        let disk = match &cfg.disk {
            Some((path, blocks)) if *blocks > 0 => Some(
                TierStore::file(path, *blocks, block_bytes).map_err(|source| EngineError::Io {
                    path: path.clone(),
                    source,
                })?,
            ),
            _ => None,
        };
        self.prefix = Some(PrefixState {
            hasher: PrefixHasher::new(&self.layout.fingerprint, self.layout.block_size),
            by_hash: HashMap::new(),
            hash_of: vec![None; self.total_blocks()],
            host,
            disk,
            events: Vec::new(),
        });
        Ok(())
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix.is_some()
    }

    /// The hasher matching this cache's model and block size.
    pub fn prefix_hasher(&self) -> PrefixHasher {
        PrefixHasher::new(&self.layout.fingerprint, self.layout.block_size)
    }

    /// Cached blocks per tier (device: indexed blocks, held or not).
    pub fn cached_counts(&self) -> TierCounts {
        self.prefix
            .as_ref()
            .map_or_else(TierCounts::default, |p| TierCounts {
                device: p.by_hash.len(),
                host: p.host.as_ref().map_or(0, |t| t.len()),
                disk: p.disk.as_ref().map_or(0, |t| t.len()),
            })
    }

    /// How many leading blocks of `hashes` each tier holds, without taking anything.
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        let Some(p) = &self.prefix else {
            return hit;
        };
        if self.layout.groups.is_grouped() {
            self.grouped_hit(hashes, hashes.len())
                .into_iter()
                .for_each(|t| hit.count(t));
            return hit;
        }
        for &h in hashes {
            match p.tier_of(h) {
                Some(t) => hit.count(t),
                None => break,
            }
        }
        hit
    }

    /// Attaches the longest cached prefix of `hashes` (at most `max_tokens` tokens, whole
    /// blocks) to the new, empty sequence `id`: its length becomes the attached tokens, and
    /// the caller computes only the rest. Host and disk hits are copied into fresh device
    /// blocks (which may evict other cached blocks, never attached ones).
    pub fn attach_prefix(
        &mut self,
        id: SeqId,
        hashes: &[BlockHash],
        max_tokens: usize,
    ) -> Result<PrefixHit> {
        let s = self.seq(id)?;
        if s.len != 0 || !s.blocks.is_empty() {
            return Err(EngineError::invalid(
                "sequence",
                format!("prefix attached to sequence {id}, which holds tokens"),
            ));
        }
        if s.window.is_some() {
            // A cached block holds KV computed under full attention; past `sinks + window`
            // tokens a windowed sequence's KV differs from it.
            return Ok(PrefixHit::default());
        }
        let mut hit = PrefixHit::default();
        let limit = hashes.len().min(max_tokens / self.layout.block_size);
        if self.layout.groups.is_grouped() {
            return Ok(self.attach_grouped(id, hashes, limit));
        }
        let mut blocks = Vec::with_capacity(limit);
        for &h in &hashes[..limit] {
            let Some((b, tier)) = self.bring_up(h) else {
                break;
            };
            blocks.push(b);
            hit.count(tier);
        }
        let n = blocks.len();
        if let Some(s) = self.seqs.get_mut(&id) {
            s.len = n * self.layout.block_size;
            s.blocks = blocks;
            s.hashes = hashes[..n].to_vec();
        }
        Ok(hit)
    }

    /// The device block holding `h`, with a reference taken for the caller, and the tier
    /// it was found in (host and disk blocks move up into a fresh device block). A lower
    /// tier's block is taken out before the device block is allocated, so the eviction that
    /// allocation may cause cannot push it further down.
    pub(super) fn bring_up(&mut self, h: BlockHash) -> Option<(BlockId, KvTier)> {
        let p = self.prefix.as_ref()?;
        if let Some(&b) = p.by_hash.get(&h) {
            return self.alloc.retain(b).then_some((b, KvTier::Device));
        }
        let tier = p.tier_of(h)?;
        let mut bytes = vec![0u8; self.block_bytes(0).len()];
        let p = self.prefix.as_mut()?;
        if !matches!(p.lower_mut(tier)?.take(h, &mut bytes), Ok(true)) {
            return None;
        }
        let b = match self.allocate_blocks(1).ok().and_then(|mut v| v.pop()) {
            Some(b) => b,
            None => {
                // No room: the block goes back where it was (its slot is still free).
                let p = self.prefix.as_mut()?;
                if !p.lower_mut(tier)?.put(h, &bytes).stored {
                    p.emit(false, tier, h);
                }
                return None;
            }
        };
        if let Some(p) = self.prefix.as_mut() {
            p.emit(false, tier, h);
        }
        self.block_bytes_mut(b).copy_from_slice(&bytes);
        self.index_block(b, h);
        Some((b, tier))
    }

    fn index_block(&mut self, b: BlockId, h: BlockHash) {
        let Some(p) = self.prefix.as_mut() else {
            return;
        };
        p.by_hash.insert(h, b);
        if let Some(slot) = p.hash_of.get_mut(b as usize) {
            *slot = Some(h);
        }
        p.emit(true, KvTier::Device, h);
        self.alloc.set_cacheable(b, true);
    }

    /// Registers the full blocks of sequence `id` whose KV is complete: `tokens` are the
    /// sequence's tokens from position 0 (at least its length; extra ones are ignored). A
    /// block whose content another block already holds stays private (freed with the
    /// sequence). Every layer group's blocks are indexed, each under its group's key; then
    /// local groups give back what is out of their window (cached, so later prompts can
    /// still hit them). Returns the blocks newly indexed.
    pub fn register_blocks(&mut self, id: SeqId, tokens: &[u32]) -> Result<usize> {
        let added = self.register_group_blocks(id, tokens)?;
        self.drop_out_of_local_windows(id);
        Ok(added)
    }

    fn register_group_blocks(&mut self, id: SeqId, tokens: &[u32]) -> Result<usize> {
        let Some(hasher) = self.prefix.as_ref().map(|p| p.hasher) else {
            return Ok(0);
        };
        let s = self.seq(id)?;
        if s.window.is_some() || s.shift > 0 {
            // Its KV is not what a full-attention sequence of these tokens holds, and its
            // dropped blocks are gone: a windowed or compressed sequence publishes nothing.
            return Ok(0);
        }
        let full = s.len.min(tokens.len()) / self.layout.block_size;
        if full <= s.hashes.len() {
            return Ok(0);
        }
        let hashes = hasher.extend(&s.hashes, &tokens[..full * self.layout.block_size]);
        let (known, bs) = (s.hashes.len(), self.layout.block_size);
        // Every group's blocks at logical indexes `known..full` it still holds, with their keys.
        let held: Vec<(BlockId, BlockHash)> = (0..self.layout.groups.n_groups())
            .flat_map(|g| (known..full).map(move |i| (g, i)))
            .filter_map(|(g, i)| match s.slot(g, i, bs) {
                Slot::Held(b) => Some((b, group_key(hashes[i], g))),
                Slot::Dropped | Slot::Missing => None,
            })
            .collect();
        let mut added = 0;
        for (b, h) in held {
            let Some(p) = self.prefix.as_mut() else {
                break;
            };
            let indexed = p.hash_of.get(b as usize).copied().flatten().is_some();
            if indexed || p.by_hash.contains_key(&h) {
                continue;
            }
            // Tiers are exclusive: the device copy is the one kept.
            p.forget_below(h);
            self.index_block(b, h);
            added += 1;
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.hashes = hashes;
        }
        Ok(added)
    }

    /// Brings the leading blocks of `hashes` that sit in the host or disk tier up into the
    /// device pool as cached blocks, ahead of the request that will attach them. The
    /// prefix's blocks already on the device are held meanwhile, so making room never evicts
    /// a block of this same prefix. Stops at the first block no tier holds, or when no
    /// device block can be had. Returns the blocks moved up.
    pub fn prefetch(&mut self, hashes: &[BlockHash]) -> usize {
        let mut held = Vec::new();
        let mut chain = 0;
        for &h in hashes {
            let Some(p) = &self.prefix else { break };
            match (p.tier_of(h), p.by_hash.get(&h)) {
                (Some(KvTier::Device), Some(&b)) => {
                    if self.alloc.retain(b) {
                        held.push(b);
                    }
                }
                (Some(_), _) => {}
                (None, _) => break,
            }
            chain += 1;
        }
        let mut moved = 0;
        for &h in &hashes[..chain] {
            let on_device = self
                .prefix
                .as_ref()
                .is_some_and(|p| p.by_hash.contains_key(&h));
            if on_device {
                continue;
            }
            match self.bring_up(h) {
                Some((b, _)) => {
                    moved += 1;
                    held.push(b);
                }
                None => break,
            }
        }
        for b in held {
            self.release_block(b);
        }
        moved
    }

    /// Changes since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.prefix
            .as_mut()
            .map(|p| std::mem::take(&mut p.events))
            .unwrap_or_default()
    }

    /// Everything cached, per tier (a subscriber's starting point).
    pub fn cache_snapshot(&self) -> Vec<(KvTier, Vec<BlockHash>)> {
        let Some(p) = &self.prefix else {
            return Vec::new();
        };
        let mut out = vec![(KvTier::Device, p.by_hash.keys().copied().collect())];
        if let Some(h) = &p.host {
            out.push((KvTier::Host, h.hashes()));
        }
        if let Some(d) = &p.disk {
            out.push((KvTier::Disk, d.hashes()));
        }
        out
    }

    /// Drops the index entries of blocks the allocator just evicted, moving their KV one
    /// tier down (called right after every allocation, before the blocks are written).
    pub(super) fn on_evicted(&mut self) {
        let evicted = self.alloc.take_evicted();
        if evicted.is_empty() {
            return;
        }
        for b in evicted {
            let Some(h) = self
                .prefix
                .as_mut()
                .and_then(|p| p.hash_of.get_mut(b as usize).and_then(Option::take))
            else {
                continue;
            };
            let below = self
                .prefix
                .as_ref()
                .is_some_and(|p| p.host.is_some() || p.disk.is_some());
            // Copied only when a lower tier will keep it.
            let bytes = below.then(|| self.block_bytes(b).to_vec());
            let Some(p) = self.prefix.as_mut() else {
                continue;
            };
            if p.by_hash.get(&h) == Some(&b) {
                p.by_hash.remove(&h);
            }
            p.emit(false, KvTier::Device, h);
            if let Some(bytes) = bytes {
                p.spill(h, bytes);
            }
        }
    }

    /// Checks the prefix index against the allocator (tests and debugging).
    pub fn check_prefix_cache(&self) -> std::result::Result<(), String> {
        let Some(p) = &self.prefix else {
            return Ok(());
        };
        for (&h, &b) in &p.by_hash {
            if p.hash_of.get(b as usize).copied().flatten() != Some(h) {
                return Err(format!(
                    "index: hash {h:x} -> block {b}, block says otherwise"
                ));
            }
            if !self.alloc.is_cacheable(b) {
                return Err(format!("indexed block {b} is not cacheable"));
            }
            for t in [&p.host, &p.disk].into_iter().flatten() {
                if t.contains(h) {
                    return Err(format!(
                        "hash {h:x} in device and {} tiers",
                        t.tier().label()
                    ));
                }
            }
        }
        for (b, h) in p.hash_of.iter().enumerate() {
            let b = b as BlockId;
            match h {
                Some(h) if p.by_hash.get(h) != Some(&b) => {
                    return Err(format!("block {b} names hash {h:x}, the index does not"))
                }
                None if self.alloc.is_cacheable(b) => {
                    return Err(format!("block {b} cacheable without a hash"))
                }
                _ => {}
            }
        }
        Ok(())
    }
}
