//! Content addresses of KV blocks, and the events a prefix cache publishes.
//!
//! A full block's hash is chained over the tokens of every block before it:
//! `h[i] = H(h[i-1] || tokens of block i)`, with `h[-1] = H(model fingerprint, block size)`.
//! Equal prefixes therefore map to equal hash sequences on every worker and in the router,
//! and a block's hash names its whole prefix, not just its own tokens. Only full blocks
//! have a hash: a partly filled block is still being written.
//!
//! The function is SHA-256 truncated to 64 bits, so every process of every release computes
//! the same values (no per-process random seed, unlike Rust's default hasher).

use sha2::{Digest, Sha256};

/// The content address of one full block (and, through the chain, of its prefix).
pub type BlockHash = u64;

/// Computes block hashes for one model and block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHasher {
    seed: BlockHash,
    block_size: usize,
}

fn digest64(parts: &[&[u8]]) -> BlockHash {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

impl PrefixHasher {
    pub fn new(fingerprint: &str, block_size: usize) -> PrefixHasher {
        let seed = digest64(&[
            b"duet-kv-prefix-v1",
            fingerprint.as_bytes(),
            &(block_size as u64).to_le_bytes(),
        ]);
        PrefixHasher {
            seed,
            block_size: block_size.max(1),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of the block after `parent` (`None`: the first block) holding `tokens`.
    pub fn next(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let parent = parent.unwrap_or(self.seed).to_le_bytes();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        digest64(&[&parent, &bytes])
    }

    /// Hashes of every full block of `tokens`, in order.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        self.extend(&[], tokens)
    }

    /// Hashes of the full blocks of `tokens` after the `known` ones (which must be the
    /// hashes of its first `known.len()` blocks): incremental hashing of a growing sequence.
    pub fn extend(&self, known: &[BlockHash], tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = known.to_vec();
        let mut parent = known.last().copied();
        for block in tokens.chunks_exact(self.block_size).skip(known.len()) {
            let h = self.next(parent, block);
            out.push(h);
            parent = Some(h);
        }
        out
    }
}

/// Prompt tokens a prefix hit may cover: whole blocks, leaving at least two tokens to
/// compute. The last token must be computed for its logits; two rather than one because a
/// prompt chunk of a single row takes another attention kernel than the same row inside a
/// longer chunk, and two keep a cached prefill bit-identical to an uncached one.
pub fn reusable_tokens(prompt: usize, block_size: usize) -> usize {
    prompt.saturating_sub(2) / block_size.max(1) * block_size.max(1)
}

/// Where a cached block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvTier {
    /// The KV pool the forward pass reads (GPU memory on a GPU node).
    Device,
    /// A bounded pool in host memory that evicted blocks move to.
    Host,
    /// A bounded file on local disk below the host tier.
    Disk,
}

impl KvTier {
    pub const ALL: [KvTier; 3] = [KvTier::Device, KvTier::Host, KvTier::Disk];

    /// A bounded metric label.
    pub fn label(self) -> &'static str {
        match self {
            KvTier::Device => "device",
            KvTier::Host => "host",
            KvTier::Disk => "disk",
        }
    }
}

/// What changed in a worker's cache: the router's per-worker index follows these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks whose KV this tier now holds.
    Stored {
        tier: KvTier,
        hashes: Vec<BlockHash>,
    },
    /// Blocks this tier no longer holds (evicted, or moved to another tier).
    Removed {
        tier: KvTier,
        hashes: Vec<BlockHash>,
    },
}

/// Leading blocks of a prompt found per tier (device first, then host, then disk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

impl PrefixHit {
    /// Blocks found in any tier.
    pub fn blocks(&self) -> usize {
        self.device + self.host + self.disk
    }

    pub fn of(&self, tier: KvTier) -> usize {
        match tier {
            KvTier::Device => self.device,
            KvTier::Host => self.host,
            KvTier::Disk => self.disk,
        }
    }

    pub(crate) fn count(&mut self, tier: KvTier) {
        match tier {
            KvTier::Device => self.device += 1,
            KvTier::Host => self.host += 1,
            KvTier::Disk => self.disk += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_hashes_and_a_hash_names_its_whole_prefix() {
        let h = PrefixHasher::new("fp", 4);
        let a = h.hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        let b = h.hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(a.len(), 2, "only full blocks have a hash");
        assert_eq!(a, b);
        // Same second block after a different first block: a different hash.
        let c = h.hashes(&[0, 2, 3, 4, 5, 6, 7, 8]);
        assert_ne!(a[1], c[1]);
        // Another model or block size: other hashes.
        assert_ne!(PrefixHasher::new("other", 4).hashes(&[1, 2, 3, 4]), a[..1]);
        // Incremental hashing equals hashing from scratch.
        let long: Vec<u32> = (0..40).collect();
        let part = h.hashes(&long[..13]);
        assert_eq!(h.extend(&part, &long), h.hashes(&long));
    }
}
