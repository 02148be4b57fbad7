//! K-quant weights (Q4_K, Q5_K, Q6_K) against ggml's reference arithmetic:
//! dequantization bit for bit (random blocks, and every K-quant tensor of
//! the Gemma 3 270M Q4_K_M file), and the integer kernels against the exact
//! dot product of the operands they multiply.
//!
//! The reference values come from gguf-py (ggml-org's port of
//! `dequantize_row_q*_K`), written by `scripts/kquant_reference.py` into
//! `tests/data/kquant-reference.json`. The Gemma file comes from
//! `scripts/fetch-gemma.sh` (`make model`); without it these tests fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{f32_hex, gemma, root, tensor_bytes};
use duet_engine::kernels::kdot::{self, Kernel};
use duet_engine::kernels::kquant::{self, KFormat, QK_K};
use duet_engine::kernels::q8k::Q8KRows;
use duet_engine::kernels::BlockFormat;
use duet_engine::linear::{KernelRows, Linear, QWeight, WeightMode};
use sha2::{Digest, Sha256};

fn reference() -> serde_json::Value {
    let p = root().join("tests/data/kquant-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn format(name: &str) -> KFormat {
    match name {
        "q4_k" => KFormat::Q4K,
        "q5_k" => KFormat::Q5K,
        "q6_k" => KFormat::Q6K,
        other => panic!("unknown format {other}"),
    }
}

#[test]
fn random_blocks_dequantize_to_ggml_reference_bits() {
    let r = reference();
    for (name, case) in r["random"].as_object().unwrap() {
        let fmt = format(name);
        let raw = hex::decode(case["blocks_hex"].as_str().unwrap()).unwrap();
        let want: Vec<u32> = case["values_f32_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(raw.len() / fmt.block_bytes() * QK_K, want.len());
        let mut got = vec![0f32; want.len()];
        kquant::dequant_row(fmt, &raw, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                *w,
                "{name} value {i}: {g} vs {}",
                f32::from_bits(*w)
            );
        }
    }
}

#[test]
fn every_gemma_kquant_tensor_dequantizes_to_ggml_reference_bits() {
    let r = reference();
    let (mut f, c) = gemma();
    let tensors = r["gemma"].as_array().unwrap();
    assert!(
        tensors.len() >= 2,
        "the fixture lists the file's K-quant tensors"
    );
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let fmt = format(t["type"].as_str().unwrap());
        let (rows, cols) = (
            t["shape"][0].as_u64().unwrap() as usize,
            t["shape"][1].as_u64().unwrap() as usize,
        );
        let raw = tensor_bytes(&mut f, &c, name);
        let w = QWeight::new(BlockFormat::K(fmt), raw, rows, cols).unwrap();
        let vals = w.dequantize();
        let digest = hex::encode(Sha256::digest(bytemuck::cast_slice::<f32, u8>(&vals)));
        assert_eq!(digest, t["dequant_sha256"].as_str().unwrap(), "{name}");
    }
}

/// Activations with a realistic spread, and a few outliers.
fn activations(rows: usize, cols: usize, seed: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            let h = (i * 2_654_435_761 + seed * 97) % 10_007;
            let v = (h as f32 / 10_007.0 - 0.5) * 2.0;
            if h.is_multiple_of(251) {
                v * 40.0
            } else {
                v
            }
        })
        .collect()
}

/// Every kernel computes, up to float rounding, the dot product of the
/// dequantized weights with the dequantized Q8_K activations; on real Gemma
/// weights of both K types in the file.
#[test]
fn every_kernel_computes_the_dot_product_of_its_operands() {
    let (mut f, c) = gemma();
    for (name, fmt) in [
        ("blk.0.attn_output.weight", KFormat::Q4K),
        ("blk.0.ffn_down.weight", KFormat::Q6K),
    ] {
        let info = &c.tensor_infos[name];
        let cols = info.shape.dims()[1];
        let raw = tensor_bytes(&mut f, &c, name);
        let rb = cols / QK_K * fmt.block_bytes();
        let rows = 48;
        let x = activations(3, cols, 1);
        let acts = Q8KRows::quantize(&x, cols);
        for r in 0..acts.rows {
            let a = acts.row(r);
            let xq: Vec<f64> = a
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| q as f64 * b.d as f64))
                .collect();
            let mut w = vec![0f32; cols];
            for j in 0..rows {
                let row = &raw[j * rb..(j + 1) * rb];
                kquant::dequant_row(fmt, row, &mut w);
                let exact: f64 = w.iter().zip(&xq).map(|(&a, b)| a as f64 * b).sum();
                let mag: f64 = w.iter().zip(&xq).map(|(&a, b)| (a as f64 * b).abs()).sum();
                let kernels: &[Kernel] = match fmt {
                    // The repacked GEMV/GEMM exist for Q4_K only.
                    KFormat::Q4K => &[Kernel::VecDot, Kernel::Gemv, Kernel::Gemm, Kernel::Tiled],
                    _ => &[Kernel::VecDot, Kernel::Tiled],
                };
                for &k in kernels {
                    let got = kdot::dot(fmt, k, row, a) as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * mag + 1e-6,
                        "{name} row {j} act {r} {k:?}: {got} vs {exact} (magnitude {mag})"
                    );
                }
            }
        }
    }
}

/// llama.cpp's kernel choice (x86, 0.3.36): repacked Q4_K (rows a multiple
/// of 8) takes the GEMM for the rows below `n - n % 4` and the GEMV for the
/// rest; other K-quants the tiled kernel from 8 rows, `vec_dot` below.
#[test]
fn kernel_choice_follows_llama_cpp() {
    use Kernel::*;
    let q4 = |n, i| Kernel::choose(KFormat::Q4K, 640, n, i);
    assert_eq!((q4(1, 0), q4(3, 2)), (Gemv, Gemv));
    assert_eq!((q4(6, 3), q4(6, 4), q4(6, 5)), (Gemm, Gemv, Gemv));
    assert_eq!((q4(512, 511), q4(9, 8)), (Gemm, Gemv));
    assert_eq!(Kernel::choose(KFormat::Q4K, 644, 16, 0), Tiled);
    assert_eq!(Kernel::choose(KFormat::Q4K, 644, 7, 0), VecDot);
    for fmt in [KFormat::Q5K, KFormat::Q6K] {
        assert_eq!(Kernel::choose(fmt, 640, 7, 6), VecDot);
        assert_eq!(Kernel::choose(fmt, 640, 8, 0), Tiled);
    }
}

/// A K-quant linear layer keeps the quantized blocks (no f32 copy in the
/// quantized mode; prompts take the panels where the CPU has AVX-512 VNNI),
/// gives each decode row the value it has alone, and each prompt row the
/// kernel its index in the prompt asks for, whatever the chunk it comes in.
#[test]
fn kquant_linear_is_batch_invariant_for_decode_and_chunk_invariant_for_prompts() {
    let (mut f, c) = gemma();
    let name = "blk.3.attn_output.weight";
    let raw = tensor_bytes(&mut f, &c, name);
    let (rows, cols) = (640, 1024);
    let w = QWeight::new(BlockFormat::K(KFormat::Q4K), raw.clone(), rows, cols).unwrap();
    let lin = Linear::new(w, WeightMode::Quantized).unwrap();
    assert!(
        lin.quantized().is_some_and(|q| q.data == raw),
        "blocks kept as they are"
    );
    // The blocks and (with AVX-512 VNNI) the panels' byte codes: well under an f32 copy.
    assert!(
        lin.resident_bytes() < raw.len() + 2 * rows * cols,
        "no f32 copy"
    );
    let x = activations(11, cols, 7);

    let batch = lin.forward_with(&x, 11, KernelRows::Decode).unwrap();
    for r in 0..11 {
        let one = lin
            .forward_with(&x[r * cols..(r + 1) * cols], 1, KernelRows::Decode)
            .unwrap();
        assert_eq!(one[..], batch[r * rows..(r + 1) * rows], "decode row {r}");
    }

    let whole = lin
        .forward_with(&x, 11, KernelRows::As { n: 11, first: 0 })
        .unwrap();
    let head = lin
        .forward_with(&x[..5 * cols], 5, KernelRows::As { n: 11, first: 0 })
        .unwrap();
    let tail = lin
        .forward_with(&x[5 * cols..], 6, KernelRows::As { n: 11, first: 5 })
        .unwrap();
    assert_eq!(head[..], whole[..5 * rows]);
    assert_eq!(tail[..], whole[5 * rows..]);
    // Rows 0..8 of 11 are GEMM rows, 8..11 GEMV rows: the last one equals
    // the decode (GEMV) value, and the kernels do round differently.
    assert_eq!(whole[10 * rows..], batch[10 * rows..]);
    assert_ne!(
        whole[..rows],
        batch[..rows],
        "GEMM and GEMV differ somewhere"
    );
}

fn q8k_bytes(b: &duet_engine::kernels::q8k::Q8KBlock) -> Vec<u8> {
    let mut v = b.d.to_le_bytes().to_vec();
    v.extend(b.qs.iter().map(|&q| q as u8));
    for s in b.bsums {
        v.extend_from_slice(&s.to_le_bytes());
    }
    v
}

/// duet's Q8_K quantizer and `vec_dot` kernels give the bits of llama.cpp's
/// own (`quantize_row_q8_K`, `ggml_vec_dot_q{4,5,6}_K_q8_K` of the
/// libggml-cpu that llama-cpp-python 0.3.36 builds, called directly by
/// `bench/llama_cpp_kquant_fixture.py`), on rows of the Gemma file's Q4_K
/// and Q6_K tensors and on random Q5_K blocks.
#[test]
fn q8k_quantization_and_vec_dot_equal_llama_cpp_bit_for_bit() {
    let p = root().join("tests/data/llama-cpp-kquant-vecdot.json");
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let (mut f, c) = gemma();
    let mut checked = 0;
    for case in fx["cases"].as_array().unwrap() {
        let fmt = format(case["type"].as_str().unwrap());
        let cols = case["cols"].as_u64().unwrap() as usize;
        let n_rows = case["rows"].as_u64().unwrap() as usize;
        let raw = match case["source"].as_str().unwrap() {
            "gemma" => tensor_bytes(&mut f, &c, case["weights"].as_str().unwrap()),
            _ => hex::decode(case["weights_hex"].as_str().unwrap()).unwrap(),
        };
        let rb = cols / QK_K * fmt.block_bytes();
        for (a, act) in case["activations_f32_hex"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let x = f32_hex(act.as_str().unwrap());
            let q = Q8KRows::quantize(&x, cols);
            let ours: Vec<u8> = q.row(0).iter().flat_map(q8k_bytes).collect();
            let theirs = hex::decode(case["q8k_hex"][a].as_str().unwrap()).unwrap();
            assert_eq!(ours, theirs, "{fmt:?} activation {a}: Q8_K bytes");
            for j in 0..n_rows {
                let want = case["vec_dot_f32_bits"][a][j].as_u64().unwrap() as u32;
                let got = kdot::dot(fmt, Kernel::VecDot, &raw[j * rb..(j + 1) * rb], q.row(0));
                assert_eq!(
                    got.to_bits(),
                    want,
                    "{fmt:?} act {a} row {j}: {got} vs llama.cpp {}",
                    f32::from_bits(want)
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 100, "only {checked} outputs compared");
}

/// duet's K-quant matmuls give the bits of llama.cpp's CPU backend for every
/// row: repacked Q4_K (GEMM for rows below `n - n % 4`, GEMV for the rest),
/// Q4_K that is not repacked, Q5_K and Q6_K (tiled from 8 rows, vec_dot
/// below), at 1 to 11 activation rows (one-op ggml graphs run by
/// `bench/llama_cpp_kquant_matmul_fixture.py` through llama-cpp-python
/// 0.3.36's libggml-cpu).
#[test]
fn kquant_matmuls_equal_llama_cpp_bit_for_bit_for_every_kernel() {
    let cases = common::matmul_cases("llama-cpp-kquant-matmul.json", |f, cols| {
        cols / QK_K * format(f).block_bytes()
    });
    let mut checked = 0;
    for case in cases {
        let fmt = format(&case.format);
        let (rows, n) = (case.rows, case.n);
        assert_eq!(
            case.repacked,
            fmt == KFormat::Q4K && rows.is_multiple_of(8),
            "fixture and rule agree"
        );
        checked += common::assert_matmul(&case, BlockFormat::K(fmt), |r| {
            format!("{:?}", Kernel::choose(fmt, rows, n, r))
        });
    }
    assert!(checked >= 1000, "only {checked} outputs compared");
}
