//! Tokenizer built from GGUF metadata alone, matching llama.cpp.
//!
//! Two kinds, as the GGUF's `tokenizer.ggml.model` says: `llama` is SentencePiece-style
//! (Gemma; `spm`), `gpt2` byte-level BPE (SmolLM2), below.
//!
//! candle builds a byte-level BPE from the GGUF vocab and merges; for
//! `tokenizer.ggml.pre = "smollm"` it picks GPT-2's pre-tokenizer with
//! `add_prefix_space = true`, which puts a space before every segment. We
//! replace it with what SmolLM's own tokenizer uses: split digits one by one,
//! then byte-level without a prefix space.
//!
//! Decoding goes through a per-token byte table (byte-level BPE maps every
//! token to bytes), so that incremental detokenisation can hold back an
//! incomplete UTF-8 character instead of emitting a replacement char.

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;

use crate::bpe::ByteLevelBpe;
use crate::error::{EngineError, Result};
use crate::spm::{self, Spm, TYPE_CONTROL, TYPE_UNKNOWN, TYPE_USER_DEFINED};

enum Encoder {
    ByteLevel {
        /// Parses special-token text (`<|im_start|>`) into special ids.
        with_special: Box<tokenizers::Tokenizer>,
        /// Treats special-token text as ordinary text.
        plain: Box<tokenizers::Tokenizer>,
        /// The same pipeline encoded directly, when the vocabulary allows it (see `bpe`).
        fast: Option<Box<ByteLevelBpe>>,
    },
    SentencePiece(Spm),
}

pub struct Tokenizer {
    encoder: Encoder,
    token_bytes: Vec<Vec<u8>>,
    /// The longest token's bytes: a text of `n` bytes is at least `n / max_token_bytes`
    /// tokens (decoding is lossless), which bounds a prompt before it is tokenized.
    max_token_bytes: usize,
    /// Control tokens (`<|im_start|>`...; SentencePiece's unknown token too): not part of
    /// the visible text.
    control: Vec<bool>,
    eos: Option<u32>,
    bos: Option<u32>,
    add_bos: bool,
    /// Tokens that end generation: EOS plus end-of-turn tokens.
    stop_ids: Vec<u32>,
}

/// GPT-2's reversible byte <-> printable char mapping, inverted.
fn unicode_to_byte() -> std::collections::HashMap<char, u8> {
    crate::bpe::byte_chars()
        .iter()
        .enumerate()
        .map(|(b, c)| (*c, b as u8))
        .collect()
}

fn meta_u32(c: &Content, key: &str) -> Option<u32> {
    match c.metadata.get(key)? {
        Value::U32(v) => Some(*v),
        Value::I32(v) => u32::try_from(*v).ok(),
        Value::U64(v) => u32::try_from(*v).ok(),
        _ => None,
    }
}

impl Tokenizer {
    pub fn from_gguf(c: &Content) -> Result<Self> {
        let tokens: Vec<String> = match c.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.to_string().cloned().unwrap_or_default())
                .collect(),
            _ => return Err(EngineError::Tokenizer("no tokenizer.ggml.tokens".into())),
        };
        let types: Vec<u32> = match c.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::I32(x) => *x as u32,
                    Value::U32(x) => *x,
                    _ => 1,
                })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        let model = c
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        let (encoder, token_bytes) = match model.as_str() {
            "llama" => {
                let scores: Vec<f32> = match c.metadata.get("tokenizer.ggml.scores") {
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|v| match v {
                            Value::F32(x) => *x,
                            _ => 0.0,
                        })
                        .collect(),
                    _ => return Err(EngineError::Tokenizer("no tokenizer.ggml.scores".into())),
                };
                // SentencePiece files put a space in front unless they say otherwise.
                let prefix = !matches!(
                    c.metadata.get("tokenizer.ggml.add_space_prefix"),
                    Some(Value::Bool(false))
                );
                let bytes = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| spm::token_bytes(t, types.get(i).copied().unwrap_or(1)))
                    .collect();
                let spm = Spm::build(&tokens, &scores, &types, prefix);
                (Encoder::SentencePiece(spm), bytes)
            }
            "gpt2" => Self::byte_level(c, &tokens, &types)?,
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tokenizer `{other}` (tokenizer.ggml.model; duet reads llama and gpt2)"
                )))
            }
        };
        let control = (0..tokens.len())
            .map(|i| matches!(types.get(i), Some(&TYPE_CONTROL) | Some(&TYPE_UNKNOWN)))
            .collect();
        let eos = meta_u32(c, "tokenizer.ggml.eos_token_id");
        let bos = meta_u32(c, "tokenizer.ggml.bos_token_id");
        let add_bos = matches!(
            c.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        // End-of-generation tokens as llama.cpp counts them: EOS, EOT and the
        // usual end-of-turn markers when the vocabulary has them.
        let mut stop_ids: Vec<u32> = eos.into_iter().collect();
        stop_ids.extend(meta_u32(c, "tokenizer.ggml.eot_token_id"));
        for name in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<|end|>",
            "<end_of_turn>",
        ] {
            if let Some(i) = tokens.iter().position(|t| t == name) {
                if matches!(types.get(i), Some(&TYPE_CONTROL) | Some(&TYPE_USER_DEFINED)) {
                    stop_ids.push(i as u32);
                }
            }
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(Self {
            encoder,
            max_token_bytes: token_bytes.iter().map(Vec::len).max().unwrap_or(1).max(1),
            token_bytes,
            control,
            eos,
            bos,
            add_bos,
            stop_ids,
        })
    }

    /// The byte-level BPE pipeline (`tokenizer.ggml.model = "gpt2"`) and its tokens' bytes.
    fn byte_level(
        c: &Content,
        tokens: &[String],
        types: &[u32],
    ) -> Result<(Encoder, Vec<Vec<u8>>)> {
        let flag = |key: &str| matches!(c.metadata.get(key), Some(Value::Bool(true)));
        let mut tk = tokenizers::Tokenizer::from_gguf(c)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let pre = c
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        if pre == "smollm" {
            let seq = Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
            ]);
            tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(seq)));
        }
        let mut plain = tk.clone();
        plain.set_encode_special_tokens(true);
        let exact_pipeline = pre == "smollm"
            && !flag("tokenizer.ggml.byte_fallback")
            && !flag("tokenizer.ggml.ignore_merges");
        let map = unicode_to_byte();
        let token_bytes: Vec<Vec<u8>> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                // Control and user-defined tokens: literal text, not byte-mapped.
                if matches!(types.get(i), Some(&TYPE_CONTROL) | Some(&TYPE_USER_DEFINED)) {
                    return t.as_bytes().to_vec();
                }
                t.chars()
                    .flat_map(|ch| match map.get(&ch) {
                        Some(b) => vec![*b],
                        None => ch.to_string().into_bytes(),
                    })
                    .collect()
            })
            .collect();
        let fast = match exact_pipeline {
            true => Self::fast_encoder(c, tokens, types).map(Box::new),
            false => None,
        };
        let encoder = Encoder::ByteLevel {
            with_special: Box::new(tk),
            plain: Box::new(plain),
            fast,
        };
        Ok((encoder, token_bytes))
    }

    /// The direct encoder for this vocabulary, with the special tokens the library splits
    /// out (candle marks token types 2..=5 and the bos/eos/pad/sep/unk ids special).
    fn fast_encoder(c: &Content, tokens: &[String], types: &[u32]) -> Option<ByteLevelBpe> {
        let merges: Vec<String> = match c.metadata.get("tokenizer.ggml.merges") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.to_string().ok().cloned())
                .collect::<Option<_>>()?,
            _ => return None,
        };
        let mut special: Vec<&str> = tokens
            .iter()
            .zip(types)
            .filter(|(_, t)| (2..=5).contains(*t))
            .map(|(s, _)| s.as_str())
            .collect();
        for key in [
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.pad_token_id",
            "tokenizer.ggml.sep_token_id",
            "tokenizer.ggml.unk_token_id",
        ] {
            if let Some(t) = meta_u32(c, key).and_then(|i| tokens.get(i as usize)) {
                special.push(t.as_str());
            }
        }
        special.sort_unstable();
        special.dedup();
        // The library drops empty added tokens; an empty pattern would match everywhere.
        if special.iter().any(|t| t.is_empty()) {
            return None;
        }
        let unk = meta_u32(c, "tokenizer.ggml.unk_token_id")
            .and_then(|i| tokens.get(i as usize))
            .map(String::as_str);
        ByteLevelBpe::build(tokens, &merges, &special, unk)
    }

    /// Token ids of `text`. With `parse_special`, special-token text becomes
    /// the special token (chat prompts); without, it is ordinary text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos {
            ids.extend(self.bos);
        }
        let fast = match &self.encoder {
            Encoder::SentencePiece(spm) => {
                spm.encode(text, parse_special, &mut ids);
                return Ok(ids);
            }
            Encoder::ByteLevel { fast: None, .. } => {
                return self.encode_with_library(text, parse_special)
            }
            Encoder::ByteLevel { fast: Some(f), .. } => f,
        };
        match fast.encode(text, parse_special, &mut ids) {
            Ok(()) => Ok(ids),
            // The regex gave up (backtracking limit): the library decides, as before.
            Err(_) => self.encode_with_library(text, parse_special),
        }
    }

    /// Whether `encode` runs the direct encoder (else the `tokenizers` pipeline).
    pub fn has_direct_encoder(&self) -> bool {
        matches!(self.encoder, Encoder::ByteLevel { fast: Some(_), .. })
    }

    /// Token ids of `text` through the `tokenizers` crate's pipeline: what `encode` returns
    /// for every input (its reference in tests, and its fallback). A SentencePiece
    /// vocabulary has no library pipeline: its own encoder answers.
    pub fn encode_with_library(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let (with_special, plain) = match &self.encoder {
            Encoder::ByteLevel {
                with_special,
                plain,
                ..
            } => (with_special, plain),
            Encoder::SentencePiece(_) => return self.encode(text, parse_special),
        };
        let tk = if parse_special { with_special } else { plain };
        let enc = tk
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The longest token, in bytes (at least 1).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The raw bytes of one token (special tokens as their literal text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(|b| b.as_slice())
    }

    /// Whether a token is a control token (its text is never shown).
    pub fn is_control(&self, id: u32) -> bool {
        self.control.get(id as usize).copied().unwrap_or(false)
    }

    /// Decode ids to the text a user sees: control tokens are left out and
    /// invalid UTF-8 is replaced (as llama.cpp's detokenizer does).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .filter(|&&i| !self.is_control(i))
            .filter_map(|&i| self.token_bytes(i))
            .flatten()
            .copied()
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether [`Self::encode`] starts the ids with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
    }

    /// Ids that end generation (EOS and end-of-turn tokens).
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// A digest of the vocabulary, for the model fingerprint.
    pub fn digest_into(&self, h: &mut impl sha2::Digest) {
        for t in &self.token_bytes {
            h.update((t.len() as u32).to_le_bytes());
            h.update(t);
        }
    }
}

/// Turns a stream of token ids into text pieces that are always whole UTF-8
/// characters: bytes of an incomplete character wait for the next token.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one token; returns the text that became complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if tok.is_control(id) {
            return String::new();
        }
        if let Some(b) = tok.token_bytes(id) {
            self.pending.extend_from_slice(b);
        }
        self.take_complete()
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: keep it for later.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        // Invalid bytes: replace them, as a lossy decode would.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// Text left at the end of generation (an incomplete character is
    /// replaced).
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
