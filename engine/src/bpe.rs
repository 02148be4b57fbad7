//! A direct byte-level BPE encoder for the pipeline `Tokenizer` builds for SmolLM-style GGUFs:
//! special tokens split out (leftmost longest), digits isolated one by one, GPT-2's
//! pre-tokenizer regex, bytes mapped to GPT-2's printable chars, then BPE merges by rank.
//!
//! Why: the `tokenizers` crate tracks offsets and alignments through every stage and
//! allocates a string per token, about 1 us per token here, which made tokenization the
//! largest share of the router's own work per request. This encoder does the same steps on
//! plain byte slices and caches each word's ids.
//!
//! Invariant: for every input it returns exactly the ids of the `tokenizers` pipeline it
//! replaces (the same regex, run by the same engine; the same merge order: lowest rank
//! first, leftmost on a tie, as `tokenizers`' `Word::merge_all`). `engine/tests/tokenizer.rs`
//! checks this against the library on random text and against llama.cpp on the reference
//! strings. `build` refuses (returns `None`) any vocabulary it cannot encode exactly, and the
//! caller then keeps the library.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::RwLock;

use aho_corasick::{AhoCorasick, MatchKind};

/// GPT-2's pre-tokenizer pattern, as `tokenizers`' `ByteLevel` uses it.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Words up to this many bytes are cached (as `tokenizers` caches words below 256 bytes).
const CACHE_MAX_WORD: usize = 255;
/// Cached words at most (then the cache stops growing, as `tokenizers`' does).
const CACHE_CAPACITY: usize = 10_000;

/// Multiplicative hasher for the packed (left, right) pair ids: the keys are small integers
/// from our own vocabulary, not attacker-chosen strings, so SipHash buys nothing here.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PairMap = HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>;

/// Each cached word's bytes and its ids.
type WordCache = RwLock<HashMap<Box<[u8]>, Box<[u32]>>>;

fn pair_key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// GPT-2's reversible byte -> printable char mapping.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u32 {
        let printable = (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        out[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    out
}

pub(crate) struct ByteLevelBpe {
    /// The id of each byte's one-char token; for a byte the vocabulary lacks, the unknown
    /// token's id, or `None` (the library then drops the byte: no unknown token, no fallback).
    byte_ids: [Option<u32>; 256],
    /// (left id, right id) -> (rank, merged id).
    merges: PairMap,
    pretokenizer: fancy_regex::Regex,
    /// Special tokens (parsed only when asked) and their ids, in the matcher's pattern order.
    specials: Option<(AhoCorasick, Vec<u32>)>,
    cache: WordCache,
}

/// Why the fast path could not run on some input (the caller falls back to the library).
#[derive(Debug)]
pub(crate) struct Unsupported;

impl ByteLevelBpe {
    /// `tokens`: the vocabulary in id order; `merges`: "left right" in rank order;
    /// `specials`: the special tokens' text (their ids as the vocabulary maps them). `None`
    /// when some byte or special token has no id or a merge names a token the vocabulary
    /// lacks (the library would then differ or refuse).
    /// `unk`: the unknown token's text, when the model names one.
    pub(crate) fn build(
        tokens: &[String],
        merges: &[String],
        specials: &[&str],
        unk: Option<&str>,
    ) -> Option<Self> {
        // As the library builds its vocabulary: a repeated string keeps its last id.
        let vocab: HashMap<&str, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i as u32))
            .collect();
        let chars = byte_chars();
        let unk = match unk {
            Some(t) => Some(*vocab.get(t)?),
            None => None,
        };
        let mut byte_ids = [None; 256];
        let mut buf = [0u8; 4];
        for (b, c) in chars.iter().enumerate() {
            byte_ids[b] = vocab.get(&*c.encode_utf8(&mut buf)).copied().or(unk);
        }
        let mut map = PairMap::default();
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            let (a, b) = m.split_once(' ')?;
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let (a, b, new) = (vocab.get(a)?, vocab.get(b)?, vocab.get(joined.as_str())?);
            // A repeated pair keeps its last rank, as the library's map does.
            map.insert(pair_key(*a, *b), (rank as u32, *new));
        }
        let specials = if specials.is_empty() {
            None
        } else {
            let ids = specials
                .iter()
                .map(|t| vocab.get(t).copied())
                .collect::<Option<Vec<u32>>>()?;
            let ac = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(specials)
                .ok()?;
            Some((ac, ids))
        };
        Some(ByteLevelBpe {
            byte_ids,
            merges: map,
            pretokenizer: fancy_regex::Regex::new(GPT2_PATTERN).ok()?,
            specials,
            cache: RwLock::new(HashMap::new()),
        })
    }

    /// Appends the ids of `text` to `out`.
    pub(crate) fn encode(
        &self,
        text: &str,
        parse_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), Unsupported> {
        let Some((ac, ids)) = self.specials.as_ref().filter(|_| parse_special) else {
            return self.encode_plain(text, out);
        };
        let mut at = 0;
        for m in ac.find_iter(text) {
            self.encode_plain(&text[at..m.start()], out)?;
            out.push(ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.encode_plain(&text[at..], out)
    }

    /// Text without special tokens: numeric chars isolated one by one, then the regex.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<(), Unsupported> {
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                self.encode_piece(&text[start..i], out)?;
                let end = i + c.len_utf8();
                self.encode_piece(&text[i..end], out)?;
                start = end;
            }
        }
        self.encode_piece(&text[start..], out)
    }

    /// One pre-tokenizer piece: every regex match and every gap between matches is a word.
    fn encode_piece(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), Unsupported> {
        let mut at = 0;
        for m in self.pretokenizer.find_iter(piece) {
            let m = m.map_err(|_| Unsupported)?;
            self.encode_word(&piece.as_bytes()[at..m.start()], out);
            self.encode_word(m.as_str().as_bytes(), out);
            at = m.end();
        }
        self.encode_word(&piece.as_bytes()[at..], out);
        Ok(())
    }

    fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        let cacheable = word.len() <= CACHE_MAX_WORD;
        if cacheable {
            if let Ok(c) = self.cache.read() {
                if let Some(ids) = c.get(word) {
                    out.extend_from_slice(ids);
                    return;
                }
            }
        }
        let from = out.len();
        self.merge_word(word, out);
        if cacheable {
            if let Ok(mut c) = self.cache.write() {
                if c.len() < CACHE_CAPACITY {
                    c.insert(word.into(), out[from..].into());
                }
            }
        }
    }

    /// BPE over one word's bytes, as `tokenizers`' `Word::merge_all` without dropout: the
    /// valid pair of lowest (rank, position) merges first; entries made stale by an earlier
    /// merge are skipped when popped.
    fn merge_word(&self, word: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        // Per symbol: id, previous and next live symbol, and whether it is still live.
        let mut id: Vec<u32> = word
            .iter()
            .filter_map(|&b| self.byte_ids[b as usize])
            .collect();
        let n = id.len();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut live = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(&(rank, new)) = self.merges.get(&pair_key(id[i], id[i + 1])) {
                heap.push(Reverse((rank, i, new)));
            }
        }
        while let Some(Reverse((_, pos, new))) = heap.pop() {
            if !live[pos] || next[pos] == NONE {
                continue;
            }
            let right = next[pos];
            match self.merges.get(&pair_key(id[pos], id[right])) {
                Some(&(_, expected)) if expected == new => {}
                _ => continue,
            }
            id[pos] = new;
            live[right] = false;
            next[pos] = next[right];
            if next[pos] != NONE {
                prev[next[pos]] = pos;
            }
            if prev[pos] != NONE {
                let p = prev[pos];
                if let Some(&(rank, new)) = self.merges.get(&pair_key(id[p], id[pos])) {
                    heap.push(Reverse((rank, p, new)));
                }
            }
            if next[pos] != NONE {
                if let Some(&(rank, new)) = self.merges.get(&pair_key(id[pos], id[next[pos]])) {
                    heap.push(Reverse((rank, pos, new)));
                }
            }
        }
        let mut i = 0;
        while i != NONE && i < n {
            out.push(id[i]);
            i = next[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of all 256 byte chars plus "ab", "abc", "bc".
    fn toy() -> ByteLevelBpe {
        let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
        tokens.extend(["ab", "abc", "bc", "<s>"].map(String::from));
        let merges = ["a b", "ab c", "b c"].map(String::from);
        ByteLevelBpe::build(&tokens, &merges, &["<s>"], None).expect("builds")
    }

    fn ids(bpe: &ByteLevelBpe, text: &str, special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.encode(text, special, &mut out).expect("encodes");
        out
    }

    #[test]
    fn merges_follow_rank_then_position() {
        let bpe = toy();
        // "abc": a+b (rank 0) first, then ab+c (rank 1), never b+c.
        assert_eq!(ids(&bpe, "abc", false), vec![257]);
        // "bcab": b+c and a+b both apply; each word merges on its own.
        assert_eq!(ids(&bpe, "bcab", false), vec![258, 256]);
        // Cached words give the same ids the second time.
        assert_eq!(ids(&bpe, "abc", false), vec![257]);
    }

    #[test]
    fn specials_split_only_when_asked_and_digits_stand_alone() {
        let bpe = toy();
        let b = |c: u8| bpe.byte_ids[c as usize].expect("every byte has a token");
        assert_eq!(ids(&bpe, "<s>", true), vec![259]);
        assert_eq!(ids(&bpe, "<s>", false), vec![b(b'<'), b(b's'), b(b'>')]);
        assert_eq!(ids(&bpe, "12", false), vec![b(b'1'), b(b'2')]);
    }

    #[test]
    fn a_byte_without_a_token_becomes_unk_or_is_dropped() {
        let mut tokens: Vec<String> = byte_chars()[..200].iter().map(|c| c.to_string()).collect();
        tokens.push("<unk>".into());
        let no_unk = ByteLevelBpe::build(&tokens, &[], &[], None).expect("builds");
        let with_unk = ByteLevelBpe::build(&tokens, &[], &[], Some("<unk>")).expect("builds");
        // '€' is the bytes E2 82 AC; byte 0xE2's char is beyond the first 200 tokens.
        let text = "a€";
        let b = |x: u8| no_unk.byte_ids[x as usize].expect("in the vocabulary");
        assert_eq!(ids(&no_unk, text, false), vec![b(b'a'), b(0x82), b(0xAC)]);
        assert_eq!(
            ids(&with_unk, text, false),
            vec![b(b'a'), 200, b(0x82), b(0xAC)]
        );
        assert!(ByteLevelBpe::build(&tokens, &[], &[], Some("<missing>")).is_none());
    }
}
