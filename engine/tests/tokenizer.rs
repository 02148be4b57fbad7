//! The tokenizer built from GGUF metadata matches llama.cpp exactly.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::Detokenizer;
use proptest::prelude::*;

#[test]
fn every_reference_string_tokenizes_like_llama_cpp_and_round_trips() {
    common::assert_tokenizer_references(&common::model(1).tokenizer, "smollm2-tokenizer.jsonl", 40);
}

#[test]
fn detokenizer_never_emits_half_a_character() {
    let tk = &common::model(1).tokenizer;
    // Emoji and CJK split into several byte-level tokens.
    let text = "🚀🔥 大语言模型 café";
    let ids = tk.encode(text, false).expect("encode");
    let mut d = Detokenizer::new();
    let mut out = String::new();
    for id in ids {
        let piece = d.push(tk, id);
        assert!(!piece.contains('\u{FFFD}'), "replacement char in {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&d.flush());
    assert_eq!(out, text);
}

#[test]
fn chat_template_renders_like_llama_cpp() {
    let m = common::model(1);
    let tpl = m
        .chat_template
        .as_ref()
        .expect("the model has a chat template");
    for line in common::reference("smollm2-q4_1-greedy.jsonl") {
        if line["kind"] != "chat" {
            continue;
        }
        let user = line["prompt"].as_str().expect("prompt");
        let rendered = tpl
            .render(&[duet_engine::ChatMessage::new("user", user)], true)
            .expect("render");
        assert_eq!(
            rendered,
            line["rendered_prompt"].as_str().expect("rendered")
        );
        let ids = m.tokenizer.encode(&rendered, true).expect("encode");
        assert_eq!(ids, common::ids(&line["prompt_ids"]), "{}", line["id"]);
    }
}

/// Fragments that exercise every stage of the pipeline: special tokens whole and cut,
/// contractions, digits of several scripts (each isolated), whitespace runs (the regex's
/// `\s+(?!\S)` look-ahead), control bytes the vocabulary lacks, combining marks, CJK, emoji
/// and the words of the cache.
const FRAGMENTS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "<",
    "<reponame>",
    "'s",
    "'ll",
    "'re",
    "'D",
    "’",
    "'",
    "don't",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "0",
    "42",
    "12345",
    "٣",
    "½",
    "Ⅻ",
    "３",
    "Hello",
    " world",
    "the",
    " The",
    "router",
    "café",
    "e\u{301}",
    "naïve",
    "ß",
    "ǅ",
    "大语言模型",
    "日本語",
    "🚀",
    "🔥🔥",
    "👩‍💻",
    "\u{4}",
    "\u{7f}",
    "\u{1}",
    "!!",
    "?!",
    "...",
    "--",
    "$",
    "#include",
    "x=1;",
    "()",
    "{}",
    "A",
    "Z",
    "ﬁ",
];

fn fragment_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            4 => proptest::sample::select(FRAGMENTS).prop_map(str::to_string),
            1 => any::<char>().prop_map(|c| c.to_string()),
            1 => "[a-zA-Z0-9 ]{1,12}",
        ],
        0..24,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(768))]
    /// The direct encoder gives the `tokenizers` pipeline's ids for any text, with and
    /// without special-token parsing.
    #[test]
    fn direct_encoder_equals_the_library(text in fragment_text(), special in any::<bool>()) {
        let tk = &common::model(1).tokenizer;
        prop_assert!(tk.has_direct_encoder(), "SmolLM2 takes the direct encoder");
        let want = tk.encode_with_library(&text, special).expect("library");
        let got = tk.encode(&text, special).expect("direct");
        prop_assert_eq!(got, want, "{:?} special={}", text, special);
    }
}
