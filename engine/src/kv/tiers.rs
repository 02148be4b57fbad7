//! The lower tiers of the prefix cache: bounded stores of whole KV blocks, keyed by block
//! hash, in host memory or in a file on local disk.
//!
//! A store has a fixed number of slots of one block each; when full, the least recently
//! used block leaves (and the caller may move it one tier down). Tiers are exclusive: a
//! block that moves back up to the device pool leaves the store, so one block's KV is held
//! in one place.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::lru::Lru;
use super::prefix::{BlockHash, KvTier};

enum Backing {
    Memory(Vec<u8>),
    File { file: File, path: PathBuf },
}

/// One bounded tier.
pub struct TierStore {
    tier: KvTier,
    block_bytes: usize,
    backing: Backing,
    slot_of: HashMap<BlockHash, usize>,
    lru: Lru<BlockHash>,
    free: Vec<usize>,
}

/// A block pushed out of a full store (or refused by it): its hash and KV bytes.
pub type Spilled = (BlockHash, Vec<u8>);

/// What [`TierStore::put`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Put {
    /// The block is in the store now.
    pub stored: bool,
    /// A block that is not in the store (any more): the least recently used one it pushed
    /// out, or, when `stored` is false, possibly the block itself.
    pub spilled: Option<Spilled>,
}

impl TierStore {
    /// A store of `blocks` blocks of `block_bytes` in host memory (pages are touched only
    /// when a block is stored).
    pub fn memory(blocks: usize, block_bytes: usize) -> TierStore {
        TierStore::with_backing(
            KvTier::Host,
            blocks,
            block_bytes,
            Backing::Memory(vec![0u8; blocks * block_bytes]),
        )
    }

    /// A store of `blocks` blocks in a file created (or truncated) at `path`; the file is
    /// removed when the store is dropped. Its content does not outlive the process.
    pub fn file(path: &Path, blocks: usize, block_bytes: usize) -> std::io::Result<TierStore> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.set_len((blocks * block_bytes) as u64)?;
        Ok(TierStore::with_backing(
            KvTier::Disk,
            blocks,
            block_bytes,
            Backing::File {
                file,
                path: path.to_path_buf(),
            },
        ))
    }

    fn with_backing(
        tier: KvTier,
        blocks: usize,
        block_bytes: usize,
        backing: Backing,
    ) -> TierStore {
        TierStore {
            tier,
            block_bytes,
            backing,
            slot_of: HashMap::new(),
            lru: Lru::default(),
            free: (0..blocks).rev().collect(),
        }
    }

    pub fn tier(&self) -> KvTier {
        self.tier
    }

    pub fn capacity(&self) -> usize {
        self.slot_of.len() + self.free.len()
    }

    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    pub fn contains(&self, h: BlockHash) -> bool {
        self.slot_of.contains_key(&h)
    }

    /// Every block held, least recently used first.
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.lru.iter().collect()
    }

    fn write_slot(&mut self, slot: usize, data: &[u8]) -> std::io::Result<()> {
        let at = slot * self.block_bytes;
        match &mut self.backing {
            Backing::Memory(m) => {
                m[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            Backing::File { file, .. } => file.write_all_at(data, at as u64),
        }
    }

    fn read_slot(&self, slot: usize, out: &mut [u8]) -> std::io::Result<()> {
        let at = slot * self.block_bytes;
        match &self.backing {
            Backing::Memory(m) => {
                out.copy_from_slice(&m[at..at + out.len()]);
                Ok(())
            }
            Backing::File { file, .. } => file.read_exact_at(out, at as u64),
        }
    }

    /// Stores a block (the most recently used). When the store was full, its least recently
    /// used block leaves and is returned in `spilled` (the caller may move it a tier down).
    /// A block this store cannot keep (no slots, an I/O error: logged) is not stored and is
    /// returned in `spilled` itself; a store never loses a block without saying so.
    pub fn put(&mut self, h: BlockHash, data: &[u8]) -> Put {
        let refused = |data: &[u8]| Put {
            stored: false,
            spilled: Some((h, data.to_vec())),
        };
        if data.len() != self.block_bytes {
            tracing::warn!(
                tier = self.tier.label(),
                bytes = data.len(),
                slot_bytes = self.block_bytes,
                "KV tier: block of the wrong size refused"
            );
            return refused(data);
        }
        if self.slot_of.contains_key(&h) {
            self.lru.insert(h);
            return Put {
                stored: true,
                spilled: None,
            };
        }
        let (slot, spilled) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let Some((old, s)) = self
                    .lru
                    .oldest()
                    .and_then(|old| Some((old, *self.slot_of.get(&old)?)))
                else {
                    return refused(data);
                };
                let mut bytes = vec![0u8; self.block_bytes];
                if let Err(e) = self.read_slot(s, &mut bytes) {
                    tracing::warn!(tier = self.tier.label(), error = %e, "KV tier read failed");
                    return refused(data);
                }
                self.slot_of.remove(&old);
                self.lru.remove(&old);
                (s, Some((old, bytes)))
            }
        };
        if let Err(e) = self.write_slot(slot, data) {
            tracing::warn!(tier = self.tier.label(), error = %e, "KV tier write failed");
            self.free.push(slot);
            // The block that left stays reported; the new one was not stored.
            return Put {
                stored: false,
                spilled,
            };
        }
        self.slot_of.insert(h, slot);
        self.lru.insert(h);
        Put {
            stored: true,
            spilled,
        }
    }

    /// Moves a block out of the store into `out`; `false` if the store does not hold it.
    pub fn take(&mut self, h: BlockHash, out: &mut [u8]) -> std::io::Result<bool> {
        let Some(&slot) = self.slot_of.get(&h) else {
            return Ok(false);
        };
        self.read_slot(slot, out)?;
        self.slot_of.remove(&h);
        self.lru.remove(&h);
        self.free.push(slot);
        Ok(true)
    }
}

impl TierStore {
    /// Forgets a block; whether the store held it.
    pub fn remove(&mut self, h: BlockHash) -> bool {
        match self.slot_of.remove(&h) {
            Some(slot) => {
                self.lru.remove(&h);
                self.free.push(slot);
                true
            }
            None => false,
        }
    }
}

impl Drop for TierStore {
    fn drop(&mut self) {
        if let Backing::File { path, .. } = &self.backing {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(mut s: TierStore) {
        let stored = |spilled| Put {
            stored: true,
            spilled,
        };
        assert_eq!(s.put(1, &[1; 8]), stored(None));
        assert_eq!(s.put(2, &[2; 8]), stored(None));
        // Full: the least recently used (1) leaves with its bytes.
        assert_eq!(s.put(3, &[3; 8]), stored(Some((1, vec![1; 8]))));
        let mut buf = [0u8; 8];
        assert!(s.take(3, &mut buf).unwrap());
        assert_eq!(buf, [3; 8]);
        assert!(
            !s.take(3, &mut buf).unwrap(),
            "taken blocks leave the store"
        );
        assert!(s.contains(2) && s.len() == 1 && s.capacity() == 2);
        let refused = s.put(4, &[0; 7]);
        assert!(
            !refused.stored && refused.spilled.is_some(),
            "wrong block size"
        );
    }

    #[test]
    fn memory_and_file_stores_evict_oldest_and_move_blocks_out() {
        roundtrip(TierStore::memory(2, 8));
        let dir = std::env::temp_dir().join(format!("duet-tier-test-{}", std::process::id()));
        let s = TierStore::file(&dir, 2, 8).unwrap();
        roundtrip(s);
        assert!(!dir.exists(), "the file goes with the store");
    }
}
