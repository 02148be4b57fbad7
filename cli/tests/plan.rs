//! `duet profile`, `duet plan simulate` and `duet plan` through the real binary: a profile
//! measured from the real model, a simulated run reported as `duet bench serve` reports
//! (and drawn by `duet bench plot`), a plan from the hand GPU profile, and bad input refused
//! with the file and field named.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("duet-plan-{}-{name}", std::process::id()))
}

fn duet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(args)
        .output()
        .expect("run duet")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "duet failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).expect("written")).expect("JSON")
}

fn gpu_profile() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../plan/profiles/a100-opt13b-distserve.json"
    )
    .into()
}

/// A profile grid that measures in seconds, in two rounds.
const TINY_GRID: [&str; 17] = [
    "--quiet",
    "--prefill-tokens",
    "16,128",
    "--prefill-cached",
    "0,64",
    "--decode-batch",
    "1,4",
    "--decode-context",
    "32",
    "--reps",
    "1",
    "--steps",
    "2",
    "--rounds",
    "2",
    "--links",
    "local",
];

#[test]
fn a_measured_profile_drives_a_simulated_run_reported_as_bench_serve_reports() {
    let model = support::model();
    let model = model.to_str().unwrap();
    let profile = tmp("profile.json");
    let p = profile.to_str().unwrap();
    let mut args = vec!["profile", "--model", model, "--output", p];
    args.extend_from_slice(&TINY_GRID);
    // Points of a few milliseconds: this test checks the tables, not the machine's calm.
    args.extend_from_slice(&["--agree-within", "1000"]);
    ok(&duet(&args));
    let prof = json(&profile);
    assert_eq!(prof["schema"], "duet-profile/1");
    // The router's overhead is measured (requests through an in-process router), and said.
    let overhead = prof["router_overhead_s"].as_f64().unwrap();
    assert!(overhead > 0.0 && overhead < 0.1, "{overhead}");
    let notes = prof["source"]["notes"].to_string();
    assert!(notes.contains("router_overhead_s measured"), "{notes}");
    // Each point is the median of two rounds, and the profile says how far they were apart.
    assert!(
        notes.contains("2 rounds of the prefill and decode tables: largest disagreement"),
        "{notes}"
    );
    // SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x f16.
    assert_eq!(prof["kv_bytes_per_token"], 30 * 3 * 64 * 2 * 2);
    let pre = &prof["prefill"]["seconds"][0];
    assert!(
        pre[1].as_f64().unwrap() > pre[0].as_f64().unwrap(),
        "128 tokens take longer than 16: {pre}"
    );
    assert_eq!(prof["links"][0]["backend"], "local");

    let report = tmp("sim.json");
    let r = report.to_str().unwrap();
    let table = ok(&duet(&[
        "plan",
        "simulate",
        "--profile",
        p,
        "--model",
        model,
        "--input-len",
        "100",
        "--output-len",
        "8",
        "--num-prompts",
        "20",
        "--rate-sweep",
        "0.5,2",
        "--slo",
        "ttft=60000,tpot=60000",
        "--output-json",
        r,
    ]));
    assert!(table.contains("TTFT"), "{table}");
    let rep = json(&report);
    assert_eq!(rep["schema"], "duet-bench-serve/1");
    assert_eq!(rep["backend"], "simulated");
    let runs = rep["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        let reqs = run["requests"].as_array().unwrap();
        assert_eq!(reqs.len(), 20);
        for q in reqs {
            assert!(q["error"].is_null(), "{q}");
            assert_eq!(q["output_tokens"], 8);
            assert!(q["ttft_s"].as_f64().unwrap() <= q["e2e_s"].as_f64().unwrap());
        }
        assert_eq!(run["summary"]["slo"]["attainment"], 1.0);
    }
    // `duet bench plot` draws simulated reports as it draws measured ones.
    let plots = tmp("plots");
    ok(&duet(&[
        "bench",
        "plot",
        "--out",
        plots.to_str().unwrap(),
        r,
    ]));
    assert!(plots.join("attainment_vs_rate.svg").exists());
    for f in [&profile, &report] {
        let _ = std::fs::remove_file(f);
    }
    let _ = std::fs::remove_dir_all(plots);
}

/// Two rounds never time a forward identically: at `--agree-within 0` the profile is
/// refused, with the worst point named, and nothing is written.
#[test]
fn a_profile_whose_rounds_disagree_is_not_written() {
    let model = support::model();
    let profile = tmp("noisy-profile.json");
    let _ = std::fs::remove_file(&profile);
    let run = |extra: &[&str]| {
        let (m, p) = (model.to_str().unwrap(), profile.to_str().unwrap());
        let mut args = vec!["profile", "--model", m, "--output", p];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--router-overhead-ms", "1"]);
        duet(&args)
    };
    let o = run(&[&TINY_GRID[..], &["--agree-within", "0"]].concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no profile written: its rounds disagree by"),
        "{err}"
    );
    assert!(
        err.contains(" tokens after ") || err.contains(" sequences of "),
        "{err}"
    );
    assert!(err.contains("more than --agree-within 0.0 %"), "{err}");
    assert!(!profile.exists(), "a refused profile is not written");
    // A negative tolerance is a mistake, named.
    let o = run(&["--agree-within=-1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--agree-within: a fraction >= 0"), "{err}");
    assert_eq!(o.status.code(), Some(1), "{err}");
}

#[test]
fn the_plan_for_the_gpu_profile_meets_the_target_within_the_budget() {
    let model = support::model();
    let profile = gpu_profile();
    // `duet plan` on the GPU profile for 40 req/s within `--slo ttft=400,tpot=50`.
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--profile",
            &profile,
            "--model",
            model.to_str().unwrap(),
            "--input-len",
            "512",
            "--output-len",
            "64",
            "--request-rate",
            "40",
            "--slo",
            "ttft=400,tpot=50",
        ];
        args.extend_from_slice(extra);
        ok(&duet(&args))
    };
    let out = tmp("plan.json");
    let text = plan(&[
        "--num-prompts",
        "100",
        "--devices",
        "128",
        "--max-prefill-per-unit",
        "2",
        "--max-decode-per-unit",
        "2",
        "--output-json",
        out.to_str().unwrap(),
    ]);
    assert!(text.contains("cheapest:"), "{text}");
    let plan_json = json(&out);
    let best = &plan_json["best"];
    let devices = best["devices"].as_u64().expect("a layout fits");
    assert!(devices <= 128);
    // The units it names serve the target: units x unit goodput >= the rate.
    let served = best["units"].as_f64().unwrap() * best["unit_goodput_rps"].as_f64().unwrap();
    assert!(served >= 40.0, "{best}");
    assert!(plan_json["best_colocated"]["unit_goodput_rps"]
        .as_f64()
        .is_some());
    let _ = std::fs::remove_file(out);

    // A budget nothing fits: said, with the closest layout.
    let text = plan(&[
        "--num-prompts",
        "60",
        "--devices",
        "2",
        "--max-prefill-per-unit",
        "1",
        "--max-decode-per-unit",
        "1",
        "--local-prefill-thresholds",
        "0",
    ]);
    assert!(
        text.contains("no layout meets the target within 2 devices; closest"),
        "{text}"
    );
}

#[test]
fn bad_profiles_are_refused_with_the_file_and_field_named() {
    let model = support::model();
    let bad = tmp("bad.json");
    // Writes `v` as the profile and simulates on it: the error message.
    let refused = |v: &serde_json::Value| {
        std::fs::write(&bad, v.to_string()).unwrap();
        let o = duet(&[
            "plan",
            "simulate",
            "--profile",
            bad.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--num-prompts",
            "2",
        ]);
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(gpu_profile()).unwrap()).unwrap();
    v["decode_step"]["seconds"][0][2] = serde_json::json!(-0.5);
    let err = refused(&v);
    assert!(
        err.contains(&format!("{}: decode_step: seconds[0][2]", bad.display())),
        "{err}"
    );
    v["schema"] = serde_json::json!("duet-profile/7");
    let err = refused(&v);
    assert!(err.contains("schema: unknown version"), "{err}");
    let _ = std::fs::remove_file(bad);
}

#[test]
fn a_mooncake_trace_replays_its_times_and_shared_blocks() {
    let trace = tmp("trace.jsonl");
    // Two requests 5 s apart sharing their first 512-token block, a third sharing nothing.
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [7, 8]}\n\
         {\"timestamp\": 5000, \"input_length\": 700, \"output_length\": 4, \"hash_ids\": [7, 9]}\n\
         {\"timestamp\": 6000, \"input_length\": 300, \"output_length\": 4, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out = tmp("trace-report.json");
    ok(&duet(&[
        "plan",
        "simulate",
        "--profile",
        &gpu_profile(),
        "--trace",
        trace.to_str().unwrap(),
        "--slo",
        "ttft=1000,tpot=100",
        "--output-json",
        out.to_str().unwrap(),
    ]));
    let rep = json(&out);
    let reqs = rep["runs"][0]["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 3);
    let at = |i: usize| reqs[i]["arrival_s"].as_f64().unwrap();
    assert!((at(1) - at(0) - 5.0).abs() < 1e-9 && (at(2) - at(0) - 6.0).abs() < 1e-9);
    assert_eq!(reqs[0]["cached_tokens"], 0);
    assert_eq!(
        reqs[1]["cached_tokens"], 512,
        "the shared block came from the cache"
    );
    assert_eq!(reqs[2]["cached_tokens"], 0);
    for f in [&trace, &out] {
        let _ = std::fs::remove_file(f);
    }
}
