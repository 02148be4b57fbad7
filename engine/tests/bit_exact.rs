//! duet's exact form (quantized weights, f16 KV cache: llama.cpp's defaults)
//! computes llama.cpp's CPU arithmetic bit for bit: its logits after a prompt
//! and after each greedy decode step hash to exactly what llama.cpp 0.3.36
//! produced (`tests/data/llama-cpp-logits.json`, written by
//! `bench/llama_cpp_logits_fixture.py`). Any kernel change that alters one
//! rounding anywhere in 30 layers fails here, long before it shows up as a
//! changed token; the top-20 logits in the fixture say by how much.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{KvCache, KvDtype, Model, SeqChunk, WeightMode};
use sha2::{Digest, Sha256};

struct Step {
    fed: Vec<u32>,
    sha256: String,
    top20: Vec<(usize, f32)>,
}

/// `tests/data/llama-cpp-logits.json`, or the fixture `DUET_LOGITS_FIXTURE`
/// names (with `DUET_MODEL`, how `scripts/check-kquant-llama.sh` checks a
/// K-quant variant of the model against llama.cpp).
fn fixture() -> Vec<(String, Vec<Step>)> {
    let p = std::env::var_os("DUET_LOGITS_FIXTURE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| common::root().join("tests/data/llama-cpp-logits.json"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("fixture is JSON");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let steps = c["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .map(|s| Step {
                    fed: common::ids(&s["fed"]),
                    sha256: s["sha256"].as_str().expect("sha256").to_string(),
                    top20: s["top20"]
                        .as_array()
                        .expect("top20")
                        .iter()
                        .map(|p| {
                            (
                                p[0].as_u64().expect("id") as usize,
                                p[1].as_f64().expect("logit") as f32,
                            )
                        })
                        .collect(),
                })
                .collect();
            (c["id"].as_str().expect("id").to_string(), steps)
        })
        .collect()
}

fn hash(logits: &[f32]) -> String {
    let mut h = Sha256::new();
    for v in logits {
        h.update(v.to_le_bytes());
    }
    hex::encode(h.finalize())
}

/// Runs the fixture's steps, the prompt in chunks of `chunk` tokens (0 = whole).
fn check(model: &Model, chunk: usize) {
    for (id, steps) in fixture() {
        let total: usize = steps.iter().map(|s| s.fed.len()).sum();
        let mut cache = KvCache::new(model.kv_layout(16, KvDtype::F16), total.div_ceil(16) + 1);
        cache.add_sequence(1).expect("add");
        for (i, step) in steps.iter().enumerate() {
            let parts: Vec<&[u32]> = match (i, chunk) {
                (0, c) if c > 0 => step.fed.chunks(c).collect(),
                _ => vec![&step.fed[..]],
            };
            let mut logits = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let last = j + 1 == parts.len();
                let c = match i {
                    0 => SeqChunk::prompt(1, part, last, step.fed.len()),
                    _ => SeqChunk::new(1, part),
                };
                logits = model.forward(&mut cache, &[c]).expect("forward").remove(0);
            }
            let worst = step
                .top20
                .iter()
                .map(|&(t, want)| (logits[t] - want).abs())
                .fold(0f32, f32::max);
            assert_eq!(
                hash(&logits),
                step.sha256,
                "{id} step {i} (chunk {chunk}): logits differ from llama.cpp's; \
                 largest difference over its top 20: {worst}"
            );
        }
    }
}

#[test]
fn logits_equal_llama_cpp_bit_for_bit_whole_and_chunked() {
    let m = common::model_with(1, WeightMode::Quantized);
    check(m, 0);
    check(m, 5);
}

#[test]
fn logits_equal_llama_cpp_bit_for_bit_on_two_threads() {
    check(common::model_with(2, WeightMode::Quantized), 0);
}
