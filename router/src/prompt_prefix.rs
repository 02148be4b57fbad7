//! One prompt seen through the KV index, as placement asks about it: the prefix of the
//! prompt each worker holds ([`CachedTokens`]), with the prompt's block hashes computed once
//! per (model fingerprint, block size) of the workers asked about.

use std::sync::Arc;

use duet_discovery::WorkerRecord;

use crate::kv_index::{KvIndex, PrefixMatch};
use crate::placement::CachedTokens;

/// One prompt seen through the KV index: its block hashes per (fingerprint, block size) of
/// the workers asked about (computed once each), and the prefix each worker holds.
pub struct PromptPrefix<'a> {
    pub prompt: &'a [u32],
    index: &'a KvIndex,
    /// `false`: every worker reads as holding nothing (routing on load alone).
    routing: bool,
    /// Usually one entry, so a scan without allocating.
    hashes: std::sync::Mutex<Vec<LayoutHashes>>,
}

/// A prompt's block hashes for one (model fingerprint, block size).
type LayoutHashes = (String, usize, Arc<Vec<u64>>);

impl<'a> PromptPrefix<'a> {
    pub fn new(prompt: &'a [u32], index: &'a KvIndex, routing: bool) -> Self {
        PromptPrefix {
            prompt,
            index,
            routing,
            hashes: Default::default(),
        }
    }

    fn block_size(w: &WorkerRecord) -> usize {
        (w.capacity.block_size as usize).max(1)
    }

    /// The prompt's block hashes as worker `w` computes them.
    pub fn hashes(&self, w: &WorkerRecord) -> Arc<Vec<u64>> {
        let bs = Self::block_size(w);
        if self.prompt.len() < bs {
            return Arc::default();
        }
        let Ok(mut m) = self.hashes.lock() else {
            return Arc::default();
        };
        if let Some((_, _, h)) = m.iter().find(|(f, b, _)| *b == bs && *f == w.fingerprint) {
            return h.clone();
        }
        let h = Arc::new(duet_engine::PrefixHasher::new(&w.fingerprint, bs).hashes(self.prompt));
        m.push((w.fingerprint.clone(), bs, h.clone()));
        h
    }

    /// The leading blocks `w` holds, as far as the index knows.
    pub fn matched(&self, w: &WorkerRecord) -> PrefixMatch {
        if !self.routing || self.prompt.len() < Self::block_size(w) {
            return PrefixMatch::default();
        }
        let hashes = self.hashes(w);
        let Some(g) = w.capacity.kv_groups else {
            return self.index.matched(&w.key(), &hashes);
        };
        let windows = g.windows();
        let groups = (windows.as_slice(), Self::block_size(w));
        self.index.matched_grouped(&w.key(), &hashes, Some(groups))
    }
}

impl CachedTokens for PromptPrefix<'_> {
    /// Tokens `w` would not compute: its matched blocks, as far as a worker reuses them.
    fn cached_tokens(&self, w: &WorkerRecord) -> usize {
        let bs = Self::block_size(w);
        (self.matched(w).blocks * bs).min(duet_engine::reusable_tokens(self.prompt.len(), bs))
    }
}
