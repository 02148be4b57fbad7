//! The requests of a run, drawn one after another from a seeded RNG: a prompt of exactly
//! the drawn input length (a window of corpus token ids) and an output length.
//!
//! With a shared prefix of P tokens, the first min(P, n) ids of every n-token prompt are
//! the same P ids (one window chosen from the seed), the rest a fresh window: prompt lengths
//! stay what the length distribution says.
//!
//! Invariants: `prompt.ids.len()` is exactly the drawn input length (<= the input cap);
//! `output_len` is the drawn output length; the same seed (and configuration) gives the
//! same sequence of requests, whatever the arrival process or the target.

use std::sync::Arc;

use duet_engine::Tokenizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::corpus::Corpus;
use crate::lengths::Lengths;

/// What one request asks for.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// 0-based position in the run (warm-up requests included).
    pub index: usize,
    pub prompt_ids: Vec<u32>,
    /// The prompt as text (only for targets that take text prompts).
    pub prompt_text: Option<String>,
    pub output_len: usize,
}

pub struct Workload {
    lengths: Lengths,
    corpus: Arc<Corpus>,
    prefix: Vec<u32>,
    rng: ChaCha8Rng,
    text: Option<Arc<Tokenizer>>,
    next_index: usize,
}

impl Workload {
    /// `text`: also render each prompt as text with this tokenizer.
    pub fn new(
        lengths: Lengths,
        corpus: Arc<Corpus>,
        shared_prefix_len: usize,
        seed: u64,
        text: Option<Arc<Tokenizer>>,
    ) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prefix = if shared_prefix_len > 0 {
            let at = rng.random_range(0..corpus.len());
            corpus.window(at, shared_prefix_len)
        } else {
            Vec::new()
        };
        Workload {
            lengths,
            corpus,
            prefix,
            rng,
            text,
            next_index: 0,
        }
    }

    pub fn next_request(&mut self) -> RequestSpec {
        let (n, output_len) = self.lengths.sample(&mut self.rng);
        let shared = n.min(self.prefix.len());
        let at = self.rng.random_range(0..self.corpus.len());
        let mut prompt_ids = Vec::with_capacity(n);
        prompt_ids.extend_from_slice(&self.prefix[..shared]);
        prompt_ids.extend(self.corpus.window(at, n - shared));
        let prompt_text = self.text.as_ref().map(|t| t.decode(&prompt_ids));
        let index = self.next_index;
        self.next_index += 1;
        RequestSpec {
            index,
            prompt_ids,
            prompt_text,
            output_len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lengths::LengthDist;

    fn tokenizer() -> Arc<Tokenizer> {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
        );
        Arc::new(
            duet_engine::TextFrontend::load(p)
                .expect("model (scripts/fetch-model.sh)")
                .tokenizer,
        )
    }

    fn uniform(lo: usize, hi: usize, max: usize) -> Lengths {
        Lengths::new(
            LengthDist::uniform(lo, hi).unwrap(),
            LengthDist::uniform(1, 64).unwrap(),
            max,
            max,
        )
        .unwrap()
    }

    #[test]
    fn prompts_from_the_stored_text_have_exact_lengths() {
        let tk = tokenizer();
        let corpus = Arc::new(Corpus::load(&tk, None).unwrap());
        // The stored text is long enough that windows rarely wrap.
        assert!(corpus.len() > 20_000, "{}", corpus.len());
        let corpus_len = corpus.len();
        let lengths = uniform(1, 3000, 2048);
        let mut w = Workload::new(lengths, corpus, 0, 1, Some(tk.clone()));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..200 {
            let r = w.next_request();
            // Replay the same draws: the prompt has exactly the drawn (capped) length.
            let (n, o) = uniform(1, 3000, 2048).sample(&mut rng);
            let _offset = rng.random_range(0..corpus_len);
            assert_eq!(r.prompt_ids.len(), n);
            assert_eq!(r.output_len, o);
            assert!(r
                .prompt_ids
                .iter()
                .all(|&id| (id as usize) < tk.vocab_size()));
            let text = r.prompt_text.expect("text");
            assert!(!text.trim().is_empty());
        }
    }

    #[test]
    fn shared_prefix_is_common_to_every_prompt() {
        let corpus = Arc::new(Corpus::from_ids((0..5000).collect()).unwrap());
        let p = 48;
        let mut w = Workload::new(uniform(1, 200, 200), corpus, p, 3, None);
        let reqs: Vec<RequestSpec> = (0..100).map(|_| w.next_request()).collect();
        let longest = reqs
            .iter()
            .max_by_key(|r| r.prompt_ids.len())
            .expect("requests");
        assert!(longest.prompt_ids.len() > p);
        let prefix = &longest.prompt_ids[..p];
        for r in &reqs {
            let k = r.prompt_ids.len().min(p);
            assert_eq!(&r.prompt_ids[..k], &prefix[..k], "request {}", r.index);
        }
        // Past the prefix the prompts differ from one another.
        let tails: std::collections::HashSet<&[u32]> = reqs
            .iter()
            .filter(|r| r.prompt_ids.len() > p + 8)
            .map(|r| &r.prompt_ids[p..p + 8])
            .collect();
        assert!(tails.len() > 1);
    }

    #[test]
    fn same_seed_same_requests() {
        let corpus = Arc::new(Corpus::from_ids((0..1000).collect()).unwrap());
        let draw = |seed| {
            let mut w = Workload::new(uniform(1, 100, 100), corpus.clone(), 0, seed, None);
            (0..20)
                .map(|_| {
                    let r = w.next_request();
                    (r.prompt_ids, r.output_len)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }
}
