//! `duet bench router` end to end: the real binary measures the bare relay and both
//! placements of the real router against its fake workers. Every target completes requests
//! without an error, the reference reads 1.0x of itself, and the router's write calls per
//! request are counted (a remote prefill costs more of them than a local one: two more RPCs).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::process::Command;

#[test]
fn bench_router_reports_every_target_against_the_bare_relay() {
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["bench", "router", "--json", "--rounds", "1"])
        .args(["--duration", "400ms", "--warmup", "100ms"])
        .arg("--model")
        .arg(support::model())
        .output()
        .expect("run duet bench router");
    assert!(
        o.status.success(),
        "duet bench router failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).expect("JSON rows");
    assert_eq!(
        rows.len(),
        3,
        "bare relay, local and remote prefill: {rows:?}"
    );
    for r in &rows {
        assert!(
            r["requests"].as_u64().unwrap_or(0) > 0,
            "no request completed: {r}"
        );
        assert_eq!(r["errors"].as_u64(), Some(0), "{r}");
        assert!(
            r["requests_per_router_core_second"].as_f64().unwrap_or(0.0) > 0.0,
            "{r}"
        );
        assert!(
            r["router_writes_per_request"].as_f64().unwrap_or(0.0) > 0.0,
            "{r}"
        );
    }
    assert_eq!(rows[0]["vs_bare_relay"].as_f64(), Some(1.0), "{}", rows[0]);
    let writes = |i: usize| rows[i]["router_writes_per_request"].as_f64().unwrap_or(0.0);
    assert!(
        writes(2) > writes(1),
        "a remote prefill (3 worker RPCs) writes more per request than a local one (1): {rows:?}"
    );
}
