//! SentencePiece-style tokenizer (`tokenizer.ggml.model = "llama"`, Gemma's), as llama.cpp
//! runs it (`llm_tokenizer_spm` in `src/llama-vocab.cpp`):
//! 1. special-token text is split out first (`tokenizer_st_partition`): the longest special
//!    tokens first, each at every place it occurs in the fragments still raw; user-defined
//!    tokens always, control and unknown tokens only when special text is parsed;
//! 2. each raw fragment has its spaces escaped to U+2581 (and a space put in front when the
//!    file asks, `tokenizer.ggml.add_space_prefix`);
//! 3. the fragment's characters are merged pairwise, the pair whose merged text is the
//!    token with the highest score first (leftmost on a tie), while a pair's text is a token;
//! 4. a piece left that is not a token (a single character: merged pieces always are
//!    tokens) is emitted as its UTF-8 bytes' `<0xXX>` tokens. (llama.cpp also records the
//!    merges to split such a piece back along them; as merges only make tokens, that path
//!    never runs there either.)
//!
//! Invariant: the ids equal llama.cpp's for the same text and flags
//! (`engine/tests/gemma3.rs` checks the reference strings `bench/gemma_references.py`
//! recorded with llama.cpp).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use aho_corasick::AhoCorasick;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
pub(crate) const TYPE_UNKNOWN: u32 = 2;
pub(crate) const TYPE_CONTROL: u32 = 3;
pub(crate) const TYPE_USER_DEFINED: u32 = 4;
pub(crate) const TYPE_BYTE: u32 = 6;

const SPACE_ESCAPE: &str = "\u{2581}";

pub(crate) struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// `<0xXX>` token of every byte, when the vocabulary has it.
    byte_tokens: Vec<Option<u32>>,
    /// Special tokens, longest text first (ties by id): `(text, id, always)`, `always`
    /// for user-defined tokens, which split the text even when special text is not parsed.
    specials: Vec<(String, u32, bool)>,
    /// Finds which special tokens occur in a text at all (most texts hold none of the
    /// thousands the vocabulary has).
    finder: Option<AhoCorasick>,
    add_space_prefix: bool,
}

/// A candidate merge of the symbols at `left` and `left + 1` (by linked-list index).
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// Highest score first, then the leftmost (llama.cpp's `llm_bigram_spm::comparator`).
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// One piece of text in the merge list: `text[start..start + len]`, or merged away (`len`
/// 0).
#[derive(Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

impl Spm {
    pub(crate) fn build(
        tokens: &[String],
        scores: &[f32],
        types: &[u32],
        add_space_prefix: bool,
    ) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        // The first id of a text wins, as in llama.cpp's `token_to_id` map built in id order
        // (it keeps the last; no GGUF here repeats a text).
        for (i, t) in tokens.iter().enumerate().rev() {
            ids.insert(t.clone(), i as u32);
        }
        let mut byte_tokens = vec![None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }
        let mut specials: Vec<(String, u32, bool)> = tokens
            .iter()
            .zip(types)
            .enumerate()
            .filter(|(_, (t, ty))| {
                !t.is_empty() && matches!(**ty, TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN)
            })
            .map(|(i, (t, ty))| (t.clone(), i as u32, *ty == TYPE_USER_DEFINED))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let finder = AhoCorasick::new(specials.iter().map(|s| s.0.as_str())).ok();
        Self {
            ids,
            scores: scores.to_vec(),
            byte_tokens,
            specials,
            finder,
            add_space_prefix,
        }
    }

    pub(crate) fn encode(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) {
        let mut prev_special = true;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Special(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Raw(raw) => {
                    let mut escaped = String::with_capacity(raw.len() + 3);
                    if self.add_space_prefix && prev_special {
                        escaped.push_str(SPACE_ESCAPE);
                    }
                    escaped.push_str(&raw.replace(' ', SPACE_ESCAPE));
                    self.encode_escaped(&escaped, out);
                    prev_special = false;
                }
            }
        }
    }

    /// The text cut at special tokens, as `tokenizer_st_partition` cuts it.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = vec![Fragment::Raw(text)];
        let Some(finder) = &self.finder else {
            return fragments;
        };
        let mut present = vec![false; self.specials.len()];
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
        }
        for (k, (special, id, always)) in self.specials.iter().enumerate() {
            if !present[k] || !(parse_special || *always) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Raw(raw) = f else {
                    next.push(f);
                    continue;
                };
                let mut rest = raw;
                while let Some(at) = rest.find(special.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Raw(&rest[..at]));
                    }
                    next.push(Fragment::Special(*id));
                    rest = &rest[at + special.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Raw(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The merges and the resegmentation of one escaped fragment.
    fn encode_escaped(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, ch)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                prev: i.checked_sub(1),
                next: Some(i + 1),
                start,
                len: ch.len_utf8(),
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }
        let mut queue = BinaryHeap::new();
        let try_add = |queue: &mut BinaryHeap<Bigram>, syms: &[Symbol], l: usize, r: usize| {
            let (a, b) = (syms[l], syms[r]);
            let piece = &text[a.start..a.start + a.len + b.len];
            if let Some(&id) = self.ids.get(piece) {
                queue.push(Bigram {
                    score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                    left: l,
                    right: r,
                    size: piece.len(),
                });
            }
        };
        for i in 1..symbols.len() {
            try_add(&mut queue, &symbols, i - 1, i);
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (symbols[bg.left], symbols[bg.right]);
            // Skip a bigram one of whose symbols merged since it was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
                continue;
            }
            symbols[bg.left].len += r.len;
            symbols[bg.right].len = 0;
            symbols[bg.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(bg.left);
            }
            if let Some(p) = symbols[bg.left].prev {
                try_add(&mut queue, &symbols, p, bg.left);
            }
            if let Some(n) = symbols[bg.left].next {
                try_add(&mut queue, &symbols, bg.left, n);
            }
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            self.emit(&text[s.start..s.start + s.len], out);
            at = s.next;
        }
    }

    /// A final piece: its token, or the byte tokens of its UTF-8 bytes.
    fn emit(&self, piece: &str, out: &mut Vec<u32>) {
        if let Some(&id) = self.ids.get(piece) {
            out.push(id);
            return;
        }
        for &b in piece.as_bytes() {
            // A vocabulary without byte tokens: the byte's one-character text, as
            // llama.cpp's `byte_to_token` falls back to (skipped when that is absent too).
            let id = self.byte_tokens[b as usize]
                .or_else(|| self.ids.get(&(b as char).to_string()).copied());
            out.extend(id);
        }
    }
}

enum Fragment<'t> {
    Raw(&'t str),
    Special(u32),
}

/// The bytes a SentencePiece token stands for: U+2581 as a space, `<0xXX>` byte tokens as
/// their byte, every other token as its text.
pub(crate) fn token_bytes(text: &str, ty: u32) -> Vec<u8> {
    if ty == TYPE_BYTE {
        if let Some(b) = text
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return vec![b];
        }
    }
    match ty {
        TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN => text.as_bytes().to_vec(),
        _ => text.replace(SPACE_ESCAPE, " ").into_bytes(),
    }
}
