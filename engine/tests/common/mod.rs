//! Shared by the engine's integration tests: the real default model, loaded
//! once per test binary and thread count, and the llama.cpp reference data.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use duet_engine::{LoadOptions, Model, WeightMode};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The first `n` tokens of the bench corpus (`bench/data/persuasion-vol1.txt`).
pub fn corpus_tokens(m: &Model, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(root().join("bench/data/persuasion-vol1.txt"))
        .expect("bench corpus");
    let ids = m.tokenizer.encode(&text[..n * 8], false).expect("encode");
    assert!(ids.len() >= n, "{} tokens", ids.len());
    ids[..n].to_vec()
}

pub fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("DUET_MODEL") {
        return PathBuf::from(p);
    }
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A new copy of the default test model on `threads` threads (its own pool).
pub fn load(threads: usize, weight_mode: WeightMode) -> Model {
    let p = model_path();
    assert!(
        p.exists(),
        "{} is missing: run ./scripts/fetch-model.sh (make test does)",
        p.display()
    );
    Model::load(
        &p,
        LoadOptions {
            threads,
            weight_mode,
        },
    )
    .unwrap_or_else(|e| panic!("loading {}: {e}", p.display()))
}

/// The model with hybrid weights (`duet run`'s default).
pub fn model(threads: usize) -> &'static Model {
    model_with(threads, WeightMode::Hybrid)
}

/// The model on 1 or 2 threads with the given weight form, loaded once per test binary.
pub fn model_with(threads: usize, mode: WeightMode) -> &'static Model {
    static MODELS: [[OnceLock<Model>; 2]; 3] = [const { [const { OnceLock::new() }; 2] }; 3];
    let m = match mode {
        WeightMode::Quantized => 0,
        WeightMode::Dense => 1,
        WeightMode::Hybrid => 2,
    };
    let t = usize::from(threads > 1);
    MODELS[m][t].get_or_init(|| load(t + 1, mode))
}

pub fn reference(name: &str) -> Vec<serde_json::Value> {
    let p = root().join("tests/data").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("reference line is JSON"))
        .collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// llama.cpp's top-2 margin below which a greedy step may break either way.
pub const NEAR_TIE: f64 = 0.05;

/// One reference prompt: llama.cpp's greedy ids and how many steps the rule checks (up to
/// llama.cpp's first near-tie).
pub struct Case {
    pub id: String,
    pub prompt: Vec<u32>,
    pub want: Vec<u32>,
    pub checked: usize,
    /// llama.cpp's top-1 minus top-2 logit at each step.
    pub margins: Vec<f64>,
}

/// The 10 reference prompts of `smollm2-q4_1-greedy.jsonl`, in file order.
pub fn greedy_cases() -> Vec<Case> {
    greedy_cases_of("smollm2-q4_1-greedy.jsonl")
}

/// The reference prompts of one of llama.cpp's greedy files in `tests/data`, in file order.
pub fn greedy_cases_of(file: &str) -> Vec<Case> {
    reference(file)
        .into_iter()
        .map(|l| {
            let margins: Vec<f64> = l["top2_margin"]
                .as_array()
                .expect("margins")
                .iter()
                .map(|m| m.as_f64().expect("margin"))
                .collect();
            let want = ids(&l["greedy_ids"]);
            let checked = margins
                .iter()
                .position(|&m| m < NEAR_TIE)
                .unwrap_or(want.len());
            Case {
                id: l["id"].as_str().expect("id").to_string(),
                prompt: ids(&l["prompt_ids"]),
                want,
                checked,
                margins,
            }
        })
        .collect()
}

pub fn gemma_path() -> PathBuf {
    root().join("models/gemma-3-270m-q4_k_m.gguf")
}

/// The second test model loaded with quantized weights (llama.cpp's arithmetic) on 1 or 2
/// threads, once per test binary; fails loudly when it is missing.
pub fn gemma_model(threads: usize) -> &'static Model {
    static MODELS: [OnceLock<Model>; 2] = [const { OnceLock::new() }; 2];
    let t = usize::from(threads > 1);
    MODELS[t].get_or_init(|| gemma_model_loaded(t + 1))
}

/// A new copy of [`gemma_model`] on `threads` threads (its own pool).
pub fn gemma_model_loaded(threads: usize) -> Model {
    let p = gemma_path();
    assert!(p.exists(), "{} is missing: run make model", p.display());
    let options = LoadOptions {
        threads,
        weight_mode: WeightMode::Quantized,
    };
    Model::load(&p, options).unwrap_or_else(|e| panic!("loading {}: {e}", p.display()))
}

/// The second test model (Gemma 3 270M Q4_K_M, `scripts/fetch-gemma.sh`), opened
/// for its tensors; fails loudly when it is missing.
pub fn gemma() -> (std::fs::File, candle_core::quantized::gguf_file::Content) {
    let p = root().join("models/gemma-3-270m-q4_k_m.gguf");
    let mut f = std::fs::File::open(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; fetch it with scripts/fetch-gemma.sh (make model)",
            p.display()
        )
    });
    let c = candle_core::quantized::gguf_file::Content::read(&mut f).expect("GGUF header");
    (f, c)
}

/// Raw bytes of a tensor of an opened GGUF file.
pub fn tensor_bytes(
    f: &mut std::fs::File,
    c: &candle_core::quantized::gguf_file::Content,
    name: &str,
) -> Vec<u8> {
    let t = c
        .tensor(f, name, &candle_core::Device::Cpu)
        .expect("tensor");
    t.data().expect("tensor data").into_owned()
}

/// Little-endian f32 values from hex.
pub fn f32_hex(s: &str) -> Vec<f32> {
    hex::decode(s)
        .expect("hex")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// One case of a matmul fixture written by `bench/llama_cpp_*matmul_fixture.py`:
/// llama.cpp's `y = x W^T` for `n` activation rows.
pub struct MatmulCase {
    /// `q4_0`, `q5_k`, ...
    pub format: String,
    /// The Gemma tensor the rows come from, or `random`.
    pub weights: String,
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub repacked: bool,
    /// The first `rows` rows of the weight, as stored.
    pub raw: Vec<u8>,
    /// `n` activation rows of `cols` values.
    pub x: Vec<f32>,
    /// llama.cpp's outputs: `want[r][j]` for activation row `r`, output `j`.
    pub want: Vec<Vec<u32>>,
}

/// The cases of `tests/data/<name>`; `row_bytes(format, cols)` sizes a weight row.
pub fn matmul_cases(name: &str, row_bytes: impl Fn(&str, usize) -> usize) -> Vec<MatmulCase> {
    let p = root().join("tests/data").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let fx: serde_json::Value = serde_json::from_str(&text).expect("fixture is JSON");
    let (mut f, c) = gemma();
    let u = |v: &serde_json::Value| v.as_u64().expect("integer") as usize;
    fx["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| {
            let format = case["type"].as_str().expect("type").to_string();
            let (rows, cols, n) = (u(&case["rows"]), u(&case["cols"]), u(&case["n"]));
            let weights = case["weights"].as_str().expect("weights").to_string();
            let raw = match weights.as_str() {
                "random" => hex::decode(case["weights_hex"].as_str().expect("hex")).expect("hex"),
                name => tensor_bytes(&mut f, &c, name)[..rows * row_bytes(&format, cols)].to_vec(),
            };
            let mut x = f32_hex(
                fx["activations_f32_hex"][cols.to_string()]
                    .as_str()
                    .expect("x"),
            );
            x.truncate(n * cols);
            let want = (0..n)
                .map(|r| {
                    (0..rows)
                        .map(|j| u(&case["out_f32_bits"][r][j]) as u32)
                        .collect()
                })
                .collect();
            MatmulCase {
                format,
                weights,
                rows,
                cols,
                n,
                repacked: case["repacked"].as_bool().unwrap_or(false),
                raw,
                x,
                want,
            }
        })
        .collect()
}

/// Multiplies the case's activations by its weights (format `fmt`, kept
/// quantized) as a forward over its `n` rows, and asserts every output has
/// llama.cpp's bits (`label(r)` names row `r`'s kernel in a failure).
/// Returns the number of outputs compared.
pub fn assert_matmul(
    case: &MatmulCase,
    fmt: duet_engine::kernels::BlockFormat,
    label: impl Fn(usize) -> String,
) -> usize {
    use duet_engine::linear::{KernelRows, Linear, QWeight};
    let (rows, cols, n) = (case.rows, case.cols, case.n);
    let w = QWeight::new(fmt, case.raw.clone(), rows, cols).expect("weight");
    let lin = Linear::new(w, WeightMode::Quantized).expect("linear");
    let y = lin
        .forward_with(&case.x, n, KernelRows::As { n, first: 0 })
        .expect("forward");
    for (r, want) in case.want.iter().enumerate() {
        for (j, &want) in want.iter().enumerate() {
            let got = y[r * rows + j];
            assert_eq!(
                got.to_bits(),
                want,
                "{} {fmt:?} {rows}x{cols}, n {n}, row {r} ({}), output {j}: {got} vs llama.cpp {}",
                case.weights,
                label(r),
                f32::from_bits(want)
            );
        }
    }
    n * rows
}

/// Checks `tk` against one of llama.cpp's tokenizer reference files (at least `min` lines):
/// the ids of every string (after the BOS the tokenizer adds, when it adds one: the
/// references carry none), its decoding to llama.cpp's round trip, and incremental decoding
/// to the same text in whole characters. Panics listing every mismatch.
pub fn assert_tokenizer_references(tk: &duet_engine::Tokenizer, file: &str, min: usize) {
    let lines = reference(file);
    assert!(lines.len() >= min, "{file} is incomplete");
    let bos: Vec<u32> = tk
        .bos_token_id()
        .filter(|_| tk.adds_bos())
        .into_iter()
        .collect();
    let mut failures = Vec::new();
    for line in &lines {
        let text = line["text"].as_str().expect("text");
        let special = line["parse_special"].as_bool().expect("parse_special");
        let want = ids(&line["ids"]);
        let got = tk.encode(text, special).expect("encode");
        let got = got
            .strip_prefix(bos.as_slice())
            .expect("BOS first")
            .to_vec();
        if got != want {
            failures.push(format!(
                "{text:?} special={special}: got {got:?}, want {want:?}"
            ));
            continue;
        }
        let roundtrip = line["roundtrip"].as_str().expect("roundtrip");
        let decoded = tk.decode(&got);
        if decoded != roundtrip {
            failures.push(format!("{text:?}: decoded {decoded:?}, want {roundtrip:?}"));
        }
        let mut d = duet_engine::Detokenizer::new();
        let mut inc: String = got.iter().map(|&id| d.push(tk, id)).collect();
        inc.push_str(&d.flush());
        if inc != decoded {
            failures.push(format!("{text:?}: incremental {inc:?} != {decoded:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} mismatch:\n{}",
        failures.len(),
        lines.len(),
        failures.join("\n")
    );
}
