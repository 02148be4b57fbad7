//! The token ids prompts are cut from: a plain text tokenized once with the model's own
//! tokenizer (special-token text is not parsed, and a BOS the tokenizer adds is dropped),
//! then read as a ring.
//!
//! Invariants: a corpus is never empty; `window(offset, n)` returns exactly `n` ids (it
//! wraps around the end, so any `n` works); the same offset gives the same ids.

use std::path::Path;

use duet_engine::Tokenizer;

use crate::error::{BenchError, Result};

/// The text stored with the crate: *Persuasion*, volume I (public domain; see
/// `bench/data/README.md`).
pub const DEFAULT_TEXT: &str = include_str!("../data/persuasion-vol1.txt");

/// `n` ordinary vocabulary ids, deterministic and distinct per `salt`: prompts for engine
/// measurements that need no text (`duet bench engine`, `duet profile`).
pub fn synthetic_ids(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (1000 + (i * 7919 + salt * 104_729) % 40_000) as u32)
        .collect()
}

#[derive(Debug, Clone)]
pub struct Corpus {
    ids: Vec<u32>,
}

impl Corpus {
    pub fn from_ids(ids: Vec<u32>) -> Result<Self> {
        if ids.is_empty() {
            return Err(BenchError::config("the prompt corpus has no tokens"));
        }
        Ok(Corpus { ids })
    }

    /// Tokenizes `text` as ordinary text.
    pub fn from_text(tokenizer: &Tokenizer, text: &str) -> Result<Self> {
        let mut ids = tokenizer.encode(text, false)?;
        if let (Some(bos), Some(&first)) = (tokenizer.bos_token_id(), ids.first()) {
            if first == bos {
                ids.remove(0);
            }
        }
        Corpus::from_ids(ids)
    }

    /// Reads and tokenizes a text file (None: the stored default text).
    pub fn load(tokenizer: &Tokenizer, path: Option<&Path>) -> Result<Self> {
        match path {
            None => Corpus::from_text(tokenizer, DEFAULT_TEXT),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| BenchError::file(p, e))?;
                Corpus::from_text(tokenizer, &text)
            }
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// `n` consecutive ids starting at `offset` (modulo the corpus length), wrapping.
    pub fn window(&self, offset: usize, n: usize) -> Vec<u32> {
        let len = self.ids.len();
        let start = offset % len;
        self.ids
            .iter()
            .cycle()
            .skip(start)
            .take(n)
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_have_exactly_the_asked_length_even_past_the_end() {
        let c = Corpus::from_ids((0..10).collect()).unwrap();
        for (offset, n) in [(0, 3), (8, 5), (3, 25), (123, 1), (0, 0)] {
            let w = c.window(offset, n);
            assert_eq!(w.len(), n);
            // Consecutive ids of the ring.
            for (k, id) in w.iter().enumerate() {
                assert_eq!(*id as usize, (offset + k) % c.len());
            }
        }
    }

    #[test]
    fn empty_corpus_is_an_error() {
        assert!(Corpus::from_ids(Vec::new()).is_err());
    }
}
