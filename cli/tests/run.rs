//! `duet run` (and the other one-process commands: `bench engine`, `eval perplexity`) as a
//! user calls it: real binary, real model, and every bad input ends with a clear message
//! and a non-zero exit, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::path::PathBuf;

#[path = "support/reference.rs"]
#[allow(dead_code)]
mod reference;
use std::process::{Command, Output};

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn duet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(args)
        .env_remove("DUET_MODEL")
        .output()
        .expect("run duet")
}

/// `duet eval perplexity` on the bench corpus with `args`.
fn eval_perplexity(args: &[&str]) -> Output {
    let (m, corpus) = (model(), corpus());
    let mut all = vec![
        "eval",
        "perplexity",
        "--model",
        m.to_str().unwrap(),
        "--file",
        corpus.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    duet(&all)
}

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/data/persuasion-vol1.txt")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failure the user can read: exit code 1 (not a panic's 101) and a message.
fn assert_clean_failure(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(
        err.contains(needle),
        "stderr should mention {needle:?}: {err}"
    );
}

#[test]
fn json_output_has_ids_text_and_timings() {
    let m = model();
    let o = duet(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "6",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    let ids = v["ids"].as_array().expect("ids");
    assert_eq!(ids.len(), 6);
    // llama.cpp's first greedy token for this prompt is " Paris" (id 7042).
    assert_eq!(ids[0], 7042);
    assert_eq!(v["prompt_ids"].as_array().expect("prompt_ids").len(), 5);
    assert!(v["text"].as_str().expect("text").starts_with(" Paris"));
    assert!(v["timings"]["prefill_ms"].as_f64().expect("prefill_ms") > 0.0);
    assert!(
        v["timings"]["decode_ms_per_token"]
            .as_f64()
            .expect("decode_ms_per_token")
            > 0.0
    );
}

#[test]
fn streaming_chat_prints_text_and_a_summary() {
    let m = model();
    let o = duet(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--chat",
        "--prompt",
        "Say hello.",
        "--max-tokens",
        "8",
        "--stop",
        "zzzz",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).trim().is_empty());
    assert!(stderr(&o).contains("prompt tokens"));
}

#[test]
fn missing_model_file() {
    let o = duet(&[
        "run",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
    ]);
    assert_clean_failure(&o, "/nonexistent/model.gguf");
}

#[test]
fn corrupt_and_truncated_gguf() {
    let dir = std::env::temp_dir().join(format!("duet-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a gguf file at all").unwrap();
    assert_clean_failure(
        &duet(&[
            "run",
            "--model",
            garbage.to_str().unwrap(),
            "--prompt",
            "hi",
        ]),
        "GGUF",
    );
    // The real model cut inside its metadata, then inside its tensor data.
    let real = std::fs::read(model()).expect("model");
    for (name, len) in [("head.gguf", 1 << 20), ("tail.gguf", real.len() - 4096)] {
        let p = dir.join(name);
        std::fs::write(&p, &real[..len]).unwrap();
        let o = duet(&["run", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
        assert_clean_failure(&o, "loading");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn empty_prompt_and_invalid_sampling_parameters_name_the_field() {
    let m = model();
    let m = m.to_str().unwrap();
    assert_clean_failure(&duet(&["run", "--model", m, "--prompt", "   "]), "prompt");
    for (flag, value, field) in [
        ("--temperature", "-1", "temperature"),
        ("--temperature", "NaN", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-p", "1.5", "top_p"),
        ("--top-k", "-3", "top_k"),
        ("--min-p", "2", "min_p"),
        ("--max-tokens", "0", "max_tokens"),
    ] {
        let o = duet(&["run", "--model", m, "--prompt", "hi", flag, value]);
        assert_clean_failure(&o, field);
    }
}

/// `--engine candle` on the CPU device: the reference prompt on which the candle engine
/// keeps llama.cpp's rule longest (v08, 48 checked steps) gives llama.cpp's tokens through
/// `duet run`, as the native engine does.
#[test]
fn candle_engine_on_the_cpu_device_gives_llama_cpp_tokens() {
    let v08 = reference::case("v08-emoji");
    let m = model();
    let n = v08.greedy_ids.len().to_string();
    for engine in ["native", "candle"] {
        let o = duet(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--device",
            "cpu",
            "--engine",
            engine,
            "--prompt",
            &v08.prompt,
            "--max-tokens",
            &n,
            "--json",
        ]);
        assert!(o.status.success(), "{engine}: {}", stderr(&o));
        let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let ids: Vec<u32> = serde_json::from_value(out["ids"].clone()).unwrap();
        assert_eq!(ids, v08.greedy_ids, "{engine}");
    }
}

/// `duet run` on the second architecture (Gemma 3 270M Q4_K_M): every reference prompt
/// keeps llama.cpp's rule, the text is the tokens' text, and `--engine candle` refuses the
/// architecture by name (its graph is llama's).
#[test]
fn duet_run_serves_gemma3_by_the_reference_rule() {
    let gemma =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        gemma.exists(),
        "{} is missing: run make model",
        gemma.display()
    );
    for case in reference::gemma_cases() {
        let n = case.greedy_ids.len().to_string();
        let o = duet(&[
            "run",
            "--model",
            gemma.to_str().unwrap(),
            "--prompt",
            &case.prompt,
            "--max-tokens",
            &n,
            "--json",
        ]);
        assert!(o.status.success(), "{}: {}", case.id, stderr(&o));
        let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let ids: Vec<u32> = serde_json::from_value(out["ids"].clone()).unwrap();
        assert!(
            case.keeps_rule(&ids),
            "{}: got {ids:?}, llama.cpp {:?}",
            case.id,
            case.greedy_ids
        );
    }
    let o = duet(&[
        "run",
        "--model",
        gemma.to_str().unwrap(),
        "--engine",
        "candle",
        "--prompt",
        "Hi",
    ]);
    assert_clean_failure(&o, "gemma3");
    // This base model's GGUF has no chat template: --chat says how to give one, and a
    // template that does not compile is refused naming the flag and the file.
    let g = gemma.to_str().unwrap();
    let o = duet(&["run", "--model", g, "--chat", "--prompt", "Hi"]);
    assert_clean_failure(&o, "--chat-template FILE");
    let bad = std::env::temp_dir().join(format!("duet-bad-template-{}.jinja", std::process::id()));
    std::fs::write(&bad, "{% for m in messages %}{{ m.content }}").unwrap();
    let o = duet(&[
        "run",
        "--model",
        g,
        "--chat",
        "--chat-template",
        bad.to_str().unwrap(),
        "--prompt",
        "Hi",
    ]);
    std::fs::remove_file(&bad).unwrap();
    assert_clean_failure(&o, "--chat-template");
    assert!(stderr(&o).contains(bad.to_str().unwrap()), "{}", stderr(&o));
}

/// A device that is not there is refused at start, exit code 2, naming what is missing.
#[test]
fn a_device_that_is_not_there_is_refused_with_exit_code_2() {
    let m = model();
    let m = m.to_str().unwrap();
    for (args, needle) in [
        (vec!["--device", "cuda"], "cuda:0"),
        (vec!["--device", "cuda:1", "--engine", "native"], "cpu only"),
        (vec!["--device", "gpu"], "`gpu` is not a device"),
        (vec!["--engine", "fast"], "`fast` is not an engine"),
    ] {
        let mut a = vec!["run", "--model", m, "--prompt", "Hi"];
        a.extend(&args);
        let o = duet(&a);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // The workers of `duet up` load on the same rule before anything listens.
    let o = duet(&["up", "--model", m, "--device", "cuda:0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("cuda:0"), "{}", stderr(&o));
}

/// `duet bench engine` measures either engine and says which one it measured.
#[test]
fn bench_engine_reports_the_engine_and_device_it_measured() {
    let m = model();
    let dir = std::env::temp_dir().join(format!("duet-bench-engine-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for engine in ["native", "candle"] {
        let out = dir.join(format!("{engine}.json"));
        let o = duet(&[
            "bench",
            "engine",
            "--model",
            m.to_str().unwrap(),
            "--engine",
            engine,
            "--prefill",
            "32",
            "--batch",
            "2",
            "--context",
            "32",
            "--steps",
            "2",
            "--kv-pool-bytes",
            "16777216",
            "--json",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{engine}: {}", stderr(&o));
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(r["engine_kind"], engine, "{r}");
        assert_eq!(r["device"], "cpu", "{r}");
        assert_eq!(r["prefill"][0]["tokens"], 32, "{r}");
        assert!(r["prefill"][0]["tok_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["decode"][0]["batch"], 2, "{r}");
        assert!(r["decode"][0]["tok_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["weight_bytes"].as_u64().unwrap() > 50_000_000, "{r}");
        assert!(r["kv_pool_bytes"].as_u64().unwrap() > 0, "{r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `duet eval perplexity` on the bench corpus equals llama.cpp's figure for the same GGUF,
/// text and windows (`tests/data/smollm2-q4_1-perplexity.json`, written by
/// `bench/llama_cpp_perplexity.py` from llama-cpp-python's logits) within 0.5 %, as the
/// issue asks; measured: equal to 1e-8 (the logits are llama.cpp's bit for bit, only the
/// order of the final sums differs).
#[test]
fn eval_perplexity_equals_llama_cpps() {
    let want: serde_json::Value = serde_json::from_str(include_str!(
        "../../tests/data/smollm2-q4_1-perplexity.json"
    ))
    .unwrap();
    let o = eval_perplexity(&["--ctx", "256", "--chunks", "4", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in ["tokens_scored", "tokens_total", "windows", "ctx"] {
        assert_eq!(got[k], want[k], "{k}: {got} vs {want}");
    }
    let (p, q) = (got["ppl"].as_f64().unwrap(), want["ppl"].as_f64().unwrap());
    assert!((p / q - 1.0).abs() < 0.005, "ppl {p} vs llama.cpp's {q}");
    assert!(
        (p / q - 1.0).abs() < 1e-6,
        "ppl {p} vs llama.cpp's {q}: no longer bit-exact"
    );
    let se = got["ppl_stderr"].as_f64().unwrap();
    assert!(
        (se / want["ppl_stderr"].as_f64().unwrap() - 1.0).abs() < 1e-4,
        "{got}"
    );
    // 256 tokens of f16 KV: 16 blocks x 30 layers x K,V x 3 heads x 16 x 64 x 2 bytes.
    assert_eq!(got["kv_bytes_peak"], 16 * 30 * 2 * 3 * 16 * 64 * 2, "{got}");
    // Too short a text for the windows: refused naming the file.
    assert_clean_failure(&eval_perplexity(&["--ctx", "100000"]), "ctx");
}

/// `--attention window=W,sinks=S` (StreamingLLM) as a user measures it: a window at least
/// as long as the text changes nothing; a short window holds a fraction of the KV and costs
/// some perplexity, reported; bad windows are refused naming the field; `duet run`
/// generates under a window, and the candle engine, which cannot, says so.
#[test]
fn eval_perplexity_under_a_window_holds_less_kv_at_a_measured_quality_cost() {
    let ppl = |attention: &str| -> serde_json::Value {
        let o = eval_perplexity(&[
            "--ctx",
            "512",
            "--chunks",
            "2",
            "--attention",
            attention,
            "--json",
        ]);
        assert!(o.status.success(), "{attention}: {}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let full = ppl("full");
    let wide = ppl("window=600,sinks=4");
    let short = ppl("window=128,sinks=4");
    assert_eq!(
        wide["ppl"], full["ppl"],
        "a window past the text masks nothing"
    );
    assert_eq!(wide["attention"], "window=600,sinks=4");
    let f = full["ppl"].as_f64().unwrap();
    let s = short["ppl"].as_f64().unwrap();
    assert!(s > f && s < 2.0 * f, "window 128: ppl {s} vs full {f}");
    // f16 KV, blocks of 16 tokens: 30 layers x K,V x 3 heads x 16 x 64 x 2 bytes per block.
    let block = 30 * 2 * 3 * 16 * 64 * 2;
    assert_eq!(full["kv_bytes_peak"], 32 * block, "{full}");
    // The sink block, the window's 8 (+1 straddling), and the 4 of the next 64-token chunk.
    let peak = short["kv_bytes_peak"].as_u64().unwrap();
    assert!(
        peak <= 14 * block && peak >= 9 * block,
        "window 128 held {} blocks",
        peak / block
    );

    // SnapKV: each window's first half is a prompt, its second half fed token by token.
    // With a budget that holds the prompt (257 tokens) nothing is compressed: full
    // attention fed one position at a time, the same figure but for the rounding of the
    // one-row kernels; a budget of 128 costs perplexity and holds less.
    let snap_all = ppl("snapkv=300").as_object().cloned().unwrap();
    let a = snap_all["ppl"].as_f64().unwrap();
    assert!(
        (a / f - 1.0).abs() < 0.01,
        "snapkv holding the prompt: {a} vs full {f}"
    );
    // The prompt's KV through kv-transfer's codec, as a remote prefill moves it: unchanged
    // bytes (`none`) are the same stepped evaluation as a budget that compresses nothing,
    // bit for bit; int8 changes the figure, a little.
    let in_flight = |codec: &str| -> serde_json::Value {
        let args = [
            "--ctx",
            "512",
            "--chunks",
            "2",
            "--kv-in-flight",
            codec,
            "--json",
        ];
        let o = eval_perplexity(&args);
        assert!(o.status.success(), "{codec}: {}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let (none, int8) = (in_flight("none"), in_flight("int8"));
    assert_eq!(none["ppl"], snap_all["ppl"], "{none}");
    assert_eq!(int8["kv_in_flight"], "int8", "{int8}");
    assert_eq!(int8["kv_bytes_peak"], none["kv_bytes_peak"], "{int8}");
    let i = int8["ppl"].as_f64().unwrap();
    assert!(
        i != a && (i / a - 1.0).abs() < 0.05,
        "int8 in flight: ppl {i} vs {a} unchanged"
    );
    let snap = ppl("snapkv=128");
    let c = snap["ppl"].as_f64().unwrap();
    assert!(c > a && c < 2.0 * f, "snapkv=128: ppl {c} vs full {f}");
    assert!(
        snap["kv_bytes_peak"].as_u64() < full["kv_bytes_peak"].as_u64(),
        "{snap}"
    );

    let bad = |attention: &str| eval_perplexity(&["--attention", attention]);
    // A malformed flag is a usage error (exit code 2, clap's); a window the model cannot
    // hold is refused after loading it, naming the field.
    let o = bad("window=0");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("window must be at least 1"),
        "{}",
        stderr(&o)
    );
    assert_clean_failure(&bad("window=9000,sinks=4"), "attention.window");

    // `duet run` under a window, then the candle engine refusing one.
    let m = model();
    let run = |engine: &str| {
        duet(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "80",
            "--attention",
            "window=32,sinks=4",
            "--engine",
            engine,
            "--json",
        ])
    };
    let o = run("native");
    assert!(o.status.success(), "{}", stderr(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!out["ids"].as_array().unwrap().is_empty(), "{out}");
    assert_clean_failure(&run("candle"), "full attention only");
}
