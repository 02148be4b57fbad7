//! The requests of a run, drawn one after another from a seeded RNG: a prompt of exactly
//! the drawn input length (a window of corpus token ids) and an output length.
//!
//! With a shared prefix of P tokens, the first min(P, n) ids of every n-token prompt are
//! the same P ids, the rest a fresh window: prompt lengths stay what the length distribution
//! says. With G prefixes (a shared system prompt per group, like SGLang's
//! generated-shared-prefix and vLLM's prefix-repetition datasets) each request takes one of
//! G such windows at random.
//!
//! Multi-turn conversations (`turns` > 1): a conversation's first turn is a request as
//! above (a shared prefix, the system prompt, then the first user message); turn k's prompt
//! is turn k-1's prompt, then the assistant's reply (a window as long as turn k-1's output
//! length; the text a chat client would send back), then a new user message as long as a
//! first message would be (a drawn input length minus the shared prefix). Every turn's
//! prompt therefore starts with the previous turn's whole prompt, as a chat client's does.
//! A conversation ends early rather than exceed the input cap.
//!
//! Invariants: a single-turn `prompt.ids.len()` is exactly the drawn input length (<= the
//! input cap); `output_len` is the drawn output length; every turn of a conversation
//! extends the one before; the same seed (and configuration) gives the same sequence of
//! requests, whatever the arrival process or the target.

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

/// How prompts share prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixShape {
    /// Tokens of each shared prefix (0: none).
    pub shared_prefix_len: usize,
    /// Distinct shared prefixes (groups); each request takes one at random.
    pub num_prefixes: usize,
    /// Requests per conversation (1: independent requests).
    pub turns: usize,
}

impl Default for PrefixShape {
    fn default() -> Self {
        PrefixShape {
            shared_prefix_len: 0,
            num_prefixes: 1,
            turns: 1,
        }
    }
}

pub struct Workload {
    lengths: Lengths,
    corpus: Arc<Corpus>,
    prefixes: Vec<Vec<u32>>,
    turns: usize,
    rng: ChaCha8Rng,
    text: Option<Arc<Tokenizer>>,
    next_index: usize,
}

impl Workload {
    /// `text`: also render each prompt as text with this tokenizer.
    pub fn new(
        lengths: Lengths,
        corpus: Arc<Corpus>,
        shape: PrefixShape,
        seed: u64,
        text: Option<Arc<Tokenizer>>,
    ) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prefixes = match shape.shared_prefix_len {
            0 => vec![Vec::new()],
            len => (0..shape.num_prefixes.max(1))
                .map(|_| {
                    let at = rng.random_range(0..corpus.len());
                    corpus.window(at, len)
                })
                .collect(),
        };
        Workload {
            lengths,
            corpus,
            prefixes,
            turns: shape.turns.max(1),
            rng,
            text,
            next_index: 0,
        }
    }

    pub fn next_request(&mut self) -> RequestSpec {
        let (n, output_len) = self.lengths.sample(&mut self.rng);
        let group = match self.prefixes.len() {
            1 => 0,
            g => self.rng.random_range(0..g),
        };
        let prefix = &self.prefixes[group];
        let shared = n.min(prefix.len());
        let at = self.rng.random_range(0..self.corpus.len());
        let mut prompt_ids = Vec::with_capacity(n);
        prompt_ids.extend_from_slice(&prefix[..shared]);
        prompt_ids.extend(self.corpus.window(at, n - shared));
        self.spec(prompt_ids, output_len)
    }

    fn spec(&mut self, prompt_ids: Vec<u32>, output_len: usize) -> RequestSpec {
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

    /// The next unit of work: one request, or a whole conversation's turns in order.
    pub fn next_unit(&mut self) -> Vec<RequestSpec> {
        let system = self.prefixes[0].len();
        let first = self.next_request();
        let mut history = first.prompt_ids.clone();
        let mut reply_len = first.output_len;
        let mut turns = vec![first];
        while turns.len() < self.turns {
            let (n, output_len) = self.lengths.sample(&mut self.rng);
            let n = n.saturating_sub(system).max(1);
            if history.len() + reply_len + n > self.lengths.max_input {
                break;
            }
            let at = self.rng.random_range(0..self.corpus.len());
            history.extend(self.corpus.window(at, reply_len));
            let at = self.rng.random_range(0..self.corpus.len());
            history.extend(self.corpus.window(at, n));
            turns.push(self.spec(history.clone(), output_len));
            reply_len = output_len;
        }
        turns
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
        let mut w = Workload::new(lengths, corpus, PrefixShape::default(), 1, Some(tk.clone()));
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
        let shape = PrefixShape {
            shared_prefix_len: p,
            ..PrefixShape::default()
        };
        let mut w = Workload::new(uniform(1, 200, 200), corpus, shape, 3, None);
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
            let mut w = Workload::new(
                uniform(1, 100, 100),
                corpus.clone(),
                PrefixShape::default(),
                seed,
                None,
            );
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

    #[test]
    fn groups_share_their_own_prefix() {
        let corpus = Arc::new(Corpus::from_ids((0..50_000).collect()).unwrap());
        let shape = PrefixShape {
            shared_prefix_len: 32,
            num_prefixes: 3,
            turns: 1,
        };
        let mut w = Workload::new(uniform(40, 80, 200), corpus, shape, 5, None);
        let heads: std::collections::HashSet<Vec<u32>> = (0..60)
            .map(|_| w.next_request().prompt_ids[..32].to_vec())
            .collect();
        assert_eq!(heads.len(), 3, "three system prompts, each used");
    }

    #[test]
    fn every_turn_extends_the_one_before_and_conversations_respect_the_cap() {
        let corpus = Arc::new(Corpus::from_ids((0..50_000).collect()).unwrap());
        let shape = PrefixShape {
            shared_prefix_len: 16,
            num_prefixes: 1,
            turns: 4,
        };
        let mut w = Workload::new(uniform(10, 30, 150), corpus, shape, 9, None);
        let mut saw_full = false;
        for _ in 0..30 {
            let conv = w.next_unit();
            assert!(!conv.is_empty() && conv.len() <= 4);
            saw_full |= conv.len() == 4;
            for pair in conv.windows(2) {
                let (a, b) = (&pair[0], &pair[1]);
                assert!(
                    b.prompt_ids.starts_with(&a.prompt_ids),
                    "a turn extends the last"
                );
                // The reply in between is as long as the last turn's output.
                assert!(b.prompt_ids.len() > a.prompt_ids.len() + a.output_len);
                assert!(b.index == a.index + 1);
            }
            assert!(conv.iter().all(|t| t.prompt_ids.len() <= 150));
        }
        assert!(saw_full, "some conversations have every turn");
    }
}
