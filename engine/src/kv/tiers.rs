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

/// A block pushed out of a full store: its hash and KV bytes.
pub type Spilled = (BlockHash, Vec<u8>);

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

    /// Stores a block (the most recently used). When the store was full, the least recently
    /// used block leaves and is returned with its bytes. A store of 0 blocks keeps nothing
    /// and returns the block itself.
    pub fn put(&mut self, h: BlockHash, data: &[u8]) -> std::io::Result<Option<Spilled>> {
        if data.len() != self.block_bytes {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} tier: block of {} bytes, slots hold {}",
                    self.tier.label(),
                    data.len(),
                    self.block_bytes
                ),
            ));
        }
        if self.slot_of.contains_key(&h) {
            self.lru.insert(h);
            return Ok(None);
        }
        let mut spilled = None;
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let Some(old) = self.lru.pop_oldest() else {
                    return Ok(Some((h, data.to_vec())));
                };
                let Some(s) = self.slot_of.remove(&old) else {
                    return Ok(Some((h, data.to_vec())));
                };
                let mut bytes = vec![0u8; self.block_bytes];
                self.read_slot(s, &mut bytes)?;
                spilled = Some((old, bytes));
                s
            }
        };
        if let Err(e) = self.write_slot(slot, data) {
            self.free.push(slot);
            return Err(e);
        }
        self.slot_of.insert(h, slot);
        self.lru.insert(h);
        Ok(spilled)
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
        assert!(s.put(1, &[1; 8]).unwrap().is_none());
        assert!(s.put(2, &[2; 8]).unwrap().is_none());
        // Full: the least recently used (1) leaves with its bytes.
        let out = s.put(3, &[3; 8]).unwrap();
        assert_eq!(out, Some((1, vec![1; 8])));
        let mut buf = [0u8; 8];
        assert!(s.take(3, &mut buf).unwrap());
        assert_eq!(buf, [3; 8]);
        assert!(
            !s.take(3, &mut buf).unwrap(),
            "taken blocks leave the store"
        );
        assert!(s.contains(2) && s.len() == 1 && s.capacity() == 2);
        assert!(s.put(4, &[0; 7]).is_err(), "wrong block size");
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
