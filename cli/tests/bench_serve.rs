//! `duet bench serve` end to end: the real binary loads a real `duet up` and its JSON report
//! must add up (every request recorded once, exact output lengths with ignore_eos, TTFT
//! within the end-to-end latency), through the gRPC door and through the OpenAI HTTP door;
//! `duet bench plot` draws from that report.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

const PROMPTS: usize = 6;
const INPUT_LEN: usize = 40;
const OUTPUT_LEN: usize = 4;

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("duet-bench-serve-{}-{name}", std::process::id()))
}

/// Runs `duet bench serve` against `url` with the small fixed workload; returns the report.
fn bench(backend: &str, url: &str, out: &Path) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["bench", "serve", "--backend", backend, "--url", url])
        .arg("--model")
        .arg(support::model())
        .args(["--dataset", "fixed"])
        .args(["--input-len", &INPUT_LEN.to_string()])
        .args(["--output-len", &OUTPUT_LEN.to_string()])
        .args(["--num-prompts", &PROMPTS.to_string()])
        .args(["--max-concurrency", "2"])
        .args(["--slo", "ttft=60000,tpot=60000"])
        .arg("--output-json")
        .arg(out)
        .output()
        .expect("run duet bench serve");
    assert!(
        o.status.success(),
        "duet bench serve failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("TTFT"),
        "no summary table on stdout:\n{table}"
    );
    serde_json::from_slice(&std::fs::read(out).expect("report written")).expect("report JSON")
}

fn n(v: &serde_json::Value) -> usize {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}")) as usize
}

fn check_report(r: &serde_json::Value) {
    let runs = r["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1, "one rate, one run");
    let s = &runs[0]["summary"];
    let recs = runs[0]["requests"].as_array().expect("requests");
    assert_eq!(recs.len(), PROMPTS);
    assert_eq!(n(&s["requests"]), PROMPTS);
    assert_eq!(n(&s["completed"]) + n(&s["failed"]), n(&s["requests"]));
    assert_eq!(n(&s["failed"]), 0, "errors: {}", s["errors"]);
    // ignore_eos: every request generated exactly what it asked for.
    assert_eq!(n(&s["output_tokens"]), PROMPTS * OUTPUT_LEN);
    assert_eq!(n(&s["prompt_tokens"]), PROMPTS * INPUT_LEN);
    let mut indices: Vec<usize> = recs.iter().map(|x| n(&x["index"])).collect();
    indices.sort_unstable();
    assert_eq!(indices, (0..PROMPTS).collect::<Vec<_>>());
    for x in recs {
        assert!(x["error"].is_null(), "{x}");
        assert_eq!(n(&x["output_tokens"]), OUTPUT_LEN);
        assert_eq!(n(&x["prompt_tokens"]), INPUT_LEN);
        let ttft = x["ttft_s"].as_f64().expect("ttft");
        let e2e = x["e2e_s"].as_f64().expect("e2e");
        assert!(0.0 < ttft && ttft <= e2e, "ttft {ttft} e2e {e2e}");
        let itl = x["itl_s"].as_array().expect("itl");
        assert!(
            itl.len() < OUTPUT_LEN,
            "at most one gap between each output chunk"
        );
        let gaps: f64 = itl.iter().filter_map(|g| g.as_f64()).sum();
        assert!(ttft + gaps <= e2e + 1e-6);
    }
    // The closed loop of two never had more than two requests in flight.
    let mut spans: Vec<(f64, f64)> = recs
        .iter()
        .map(|x| {
            let a = x["arrival_s"].as_f64().expect("arrival");
            (a, a + x["e2e_s"].as_f64().expect("e2e"))
        })
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    for &(start, _) in &spans {
        let overlapping = spans
            .iter()
            .filter(|(a, b)| *a <= start && start < *b)
            .count();
        assert!(
            overlapping <= 2,
            "{overlapping} requests in flight at {start}"
        );
    }
    // Generous SLO: everything meets it.
    assert_eq!(n(&s["slo"]["met"]), PROMPTS);
    assert_eq!(r["schema"], "duet-bench-serve/1");
}

#[test]
fn bench_serve_against_duet_grpc_adds_up_and_plots() {
    let (_up, url) = support::up(&[]);
    let out = tmp("duet.json");
    let report = bench("duet", &url, &out);
    check_report(&report);
    assert_eq!(report["backend"], "duet");

    let dir = tmp("plots");
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["bench", "plot", "--out"])
        .arg(&dir)
        .arg(&out)
        .arg(&out)
        .output()
        .expect("run duet bench plot");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let listed: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    // One run without a rate: the three latency CDFs, nothing against rate.
    assert_eq!(listed.len(), 3, "{listed:?}");
    for f in &listed {
        let svg = std::fs::read_to_string(f).expect("svg written");
        assert!(svg.starts_with("<svg"), "{f}");
    }
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_serve_against_duet_openai_http_adds_up() {
    let (up, _grpc) = support::up(&[]);
    let http = up.wait_for("http listening on", support::START);
    let out = tmp("openai.json");
    let report = bench("openai", &http, &out);
    check_report(&report);
    assert_eq!(report["backend"], "openai");
    // The model name came from GET /v1/models.
    assert!(!report["model"].as_str().unwrap_or_default().is_empty());
    let _ = std::fs::remove_file(&out);
}

/// Multi-turn conversations: every turn's prompt extends the one before, the turns of a
/// conversation run one after another, and the server's prefix cache shows in the report.
#[test]
fn bench_serve_multi_turn_reports_conversations_and_cached_tokens() {
    let (_up, url) = support::up(&[]);
    let out = tmp("multi-turn.json");
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["bench", "serve", "--url", &url])
        .arg("--model")
        .arg(support::model())
        .args([
            "--dataset",
            "fixed",
            "--input-len",
            "48",
            "--output-len",
            "4",
        ])
        .args(["--shared-prefix-len", "32", "--turns", "3"])
        .args(["--num-prompts", "6", "--max-concurrency", "2"])
        .arg("--output-json")
        .arg(&out)
        .output()
        .expect("run duet bench serve");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("prefix cache:"), "{table}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("report")).expect("json");
    let run = &r["runs"][0];
    let recs = run["requests"].as_array().expect("requests");
    assert_eq!(recs.len(), 6);
    let mut by_conv: std::collections::BTreeMap<usize, Vec<&serde_json::Value>> =
        Default::default();
    for x in recs {
        assert!(x["error"].is_null(), "{x}");
        by_conv.entry(n(&x["conversation"])).or_default().push(x);
    }
    assert_eq!(by_conv.len(), 2, "two conversations of three turns");
    let mut cached_sum = 0;
    for turns in by_conv.values() {
        assert_eq!(turns.len(), 3);
        for (k, pair) in turns.windows(2).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            assert_eq!(n(&b["turn"]), k + 1);
            // Turn k+1 = turn k's prompt + its 4-token reply + a message as long as the
            // first turn's (48 tokens less the 32-token shared prefix).
            assert_eq!(n(&b["prompt_tokens"]), n(&a["prompt_tokens"]) + 4 + 16);
            // Sent after the previous turn ended.
            let a_end = a["arrival_s"].as_f64().unwrap() + a["e2e_s"].as_f64().unwrap();
            assert!(b["arrival_s"].as_f64().unwrap() >= a_end - 1e-6);
            // The previous prompt's whole blocks came from a cache.
            assert!(
                n(&b["cached_tokens"]) >= n(&a["prompt_tokens"]) / 16 * 16,
                "{b}"
            );
        }
        cached_sum += turns.iter().map(|x| n(&x["cached_tokens"])).sum::<usize>();
    }
    assert_eq!(n(&run["summary"]["cached_tokens"]), cached_sum);
    let _ = std::fs::remove_file(&out);
}
