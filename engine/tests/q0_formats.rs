//! The 32-value block formats with 8-bit activations (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0) against llama.cpp's own CPU backend: whole matmuls at 1 to 11
//! activation rows, bit for bit, on rows of the Gemma 3 270M Q4_K_M file's
//! Q5_0 and Q8_0 tensors and on random Q4_0, Q4_1 and Q5_1 blocks
//! (`tests/data/llama-cpp-q0-matmul.json`, one-op ggml graphs run by
//! `bench/llama_cpp_q0_matmul_fixture.py` through llama-cpp-python 0.3.36's
//! libggml-cpu). Q4_1 is the default model's format and was already exact:
//! it checks the harness.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use duet_engine::kernels::{BlockFormat, QK};

fn format(name: &str) -> BlockFormat {
    match name {
        "q4_0" => BlockFormat::Q4_0,
        "q4_1" => BlockFormat::Q4_1,
        "q5_0" => BlockFormat::Q5_0,
        "q5_1" => BlockFormat::Q5_1,
        "q8_0" => BlockFormat::Q8_0,
        other => panic!("unknown format {other}"),
    }
}

#[test]
fn q0_matmuls_equal_llama_cpp_bit_for_bit() {
    let cases = common::matmul_cases("llama-cpp-q0-matmul.json", |f, cols| {
        cols / QK * format(f).block_bytes()
    });
    let mut checked = std::collections::BTreeMap::new();
    for case in cases {
        let fmt = format(&case.format);
        let outputs = common::assert_matmul(&case, fmt, |_| "the vec_dot chain".into());
        *checked.entry(fmt.name()).or_insert(0) += outputs;
    }
    assert_eq!(
        checked.keys().copied().collect::<Vec<_>>(),
        ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"],
        "every format is in the fixture"
    );
    assert!(checked.values().all(|&v| v >= 400), "{checked:?}");
}
