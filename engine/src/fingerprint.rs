//! A model's identity, the same whichever engine loads it: a hash of every tensor (name and
//! raw GGUF bytes), the hyper-parameters and the tokenizer. KV layouts carry it, so a KV
//! transfer between workers of different models is refused, while the native and the
//! candle engine loading one file agree (their KV frames are interchangeable).
//!
//! Each tensor is hashed on its own as it is loaded and the digests are combined in name
//! order, so the value does not depend on the order a loader reads tensors in.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::tokenizer::Tokenizer;

/// Collects per-tensor digests while a model loads.
#[derive(Default)]
pub(crate) struct Fingerprinter {
    tensors: BTreeMap<String, [u8; 32]>,
}

impl Fingerprinter {
    /// One tensor's raw bytes as stored in the GGUF (loading it twice hashes it once).
    pub(crate) fn tensor(&mut self, name: &str, data: &[u8]) {
        if self.tensors.contains_key(name) {
            return;
        }
        let mut h = Sha256::new();
        h.update(data);
        self.tensors.insert(name.to_string(), h.finalize().into());
    }

    /// The fingerprint (hex, 32 digits).
    pub(crate) fn finish(self, config: &ModelConfig, tokenizer: &Tokenizer) -> String {
        let mut h = Sha256::new();
        for (name, digest) in &self.tensors {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(digest);
        }
        h.update(serde_json::to_vec(config).unwrap_or_default());
        tokenizer.digest_into(&mut h);
        hex::encode(&h.finalize()[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_tensors_are_read_in_does_not_matter_but_their_bytes_do() {
        let mut a = Fingerprinter::default();
        a.tensor("x", b"1");
        a.tensor("y", b"2");
        let mut b = Fingerprinter::default();
        b.tensor("y", b"2");
        b.tensor("x", b"1");
        b.tensor("x", b"1");
        assert_eq!(a.tensors, b.tensors);
        let mut c = Fingerprinter::default();
        c.tensor("x", b"1");
        c.tensor("y", b"3");
        assert_ne!(a.tensors, c.tensors);
    }
}
