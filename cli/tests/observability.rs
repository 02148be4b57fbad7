//! Metrics as an operator sees them: every process's `/metrics` passes `promtool check
//! metrics`, and a real Prometheus scraping a real cluster (router, prefill worker, decode
//! worker registered in etcd) reports the counts, histograms and gauges that this test's
//! own requests produced.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::prometheus::Prometheus;
use support::*;

/// `promtool check metrics` on one exposition; panics with promtool's complaints.
fn promtool_check(what: &str, exposition: &str) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(exposition.as_bytes())
        .expect("write exposition");
    let o = child.wait_with_output().expect("promtool");
    assert!(
        o.status.success(),
        "promtool check metrics on the {what}'s /metrics:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_sees_what_the_requests_did_in_each_phase() {
    // Every prompt is prefilled remotely, so each phase has work to show.
    let c = Cluster::start(1, 1, &["--local-prefill-max-tokens", "0"]);
    c.wait_workers(1, 1, START).await;
    let router_m = c.router.wait_for("metrics on", START);
    let prefill_m = c.prefill[0].wait_for("metrics on", START);
    let decode_m = c.decode[0].wait_for("metrics on", START);
    let http_door = c.router.wait_for("http listening on", START);
    let prom = Prometheus::start(&[&router_m, &prefill_m, &decode_m]);

    let mut g = client(&c.url).await;
    let prompts = [
        "The lighthouse keeper counted the ships that passed in the night.",
        "Rivers carve valleys over many thousands of years of patient work.",
        "A short note on why bread rises when it is left in a warm kitchen.",
    ];
    let (mut completion, mut prompt, mut kv_bytes, mut ttft) = (0u64, 0u64, 0u64, 0f64);
    for p in prompts {
        let out = generate(&mut g, greedy(text(p), 5))
            .await
            .expect("generate");
        let fin = out.fin.clone().expect("final message");
        let usage = fin.usage.expect("usage");
        completion += u64::from(usage.completion_tokens);
        prompt += u64::from(usage.prompt_tokens);
        let t = out.timings();
        assert_eq!(t.placement, duet_proto::v1::PrefillPlacement::Remote as i32);
        kv_bytes += t.kv_bytes;
        ttft += t.time_to_first_token_seconds;
    }
    // One request the router refuses (a prompt longer than the context).
    let long = vec![1u32; 100_000];
    let refused = generate(&mut g, greedy(tokens(&long), 4))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    c.decode[0]
        .assert_decode_pools_empty(Duration::from_secs(10))
        .await;
    let status = decode_status(&c.decode[0].workers_addr()).await;

    // Each process's exposition is valid, and the router's HTTP door serves the same one.
    for (what, url) in [
        ("router", &router_m),
        ("prefill worker", &prefill_m),
        ("decode worker", &decode_m),
    ] {
        let (code, body) = http_get(url);
        assert_eq!(code, 200, "{what} {url}");
        promtool_check(what, &body);
    }
    // Every metric the Grafana dashboard and the alert rules query exists in this scrape.
    let dir = std::env::temp_dir().join(format!("duet-scrape-{:08x}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).expect("scrape dir");
    let mut check = Command::new("python3");
    check.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/tests/metric_names.py"
    ));
    for (what, url) in [
        ("router", &router_m),
        ("prefill", &prefill_m),
        ("decode", &decode_m),
    ] {
        let f = dir.join(format!("{what}.prom"));
        std::fs::write(&f, http_get(url).1).expect("write scrape");
        check.arg("--exposition").arg(f);
    }
    let o = check
        .output()
        .expect("python3 deploy/tests/metric_names.py");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        o.status.success(),
        "metrics named by deploy/grafana/duet.json or the alert rules are missing from a live \
         scrape:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );

    let (code, door) = http_get(&format!("{http_door}/metrics"));
    assert_eq!(code, 200);
    promtool_check("router's HTTP door", &door);
    assert_eq!(
        scrape_sum(
            &door,
            "duet_router_requests_total",
            &[r#"outcome="invalid_argument""#]
        ),
        1.0
    );

    // Through Prometheus: what the requests produced, phase by phase.
    let within = Duration::from_secs(30);
    let n = prompts.len() as f64;
    prom.wait_value(
        r#"sum(duet_router_requests_total{outcome="ok"})"#,
        n,
        0.0,
        within,
    );
    prom.wait_value(
        "sum(duet_router_generation_tokens_total)",
        completion as f64,
        0.0,
        within,
    );
    prom.wait_value(
        "sum(duet_router_time_to_first_token_seconds_count)",
        n,
        0.0,
        within,
    );
    // The histogram's sum is the TTFT the final messages reported (measured a few
    // microseconds apart on the same stream).
    prom.wait_value(
        "sum(duet_router_time_to_first_token_seconds_sum)",
        ttft,
        0.01 * n,
        within,
    );
    prom.wait_value(
        r#"sum(duet_router_routing_decisions_total{placement="remote"})"#,
        n,
        0.0,
        within,
    );
    prom.wait_value(
        "sum(duet_prefill_prompt_tokens_total)",
        prompt as f64,
        0.0,
        within,
    );
    prom.wait_value(
        r#"sum(duet_kv_transfer_bytes_total{direction="sent"})"#,
        kv_bytes as f64,
        0.0,
        within,
    );
    prom.wait_value(
        r#"sum(duet_kv_transfer_bytes_total{direction="received"})"#,
        kv_bytes as f64,
        0.0,
        within,
    );
    prom.wait_value(
        "sum(duet_decode_kv_blocks_capacity)",
        status.kv_blocks_total as f64,
        0.0,
        within,
    );
    prom.wait_value("sum(duet_decode_kv_blocks_used)", 0.0, 0.0, within);
    // What each worker's engine holds on its device (cpu here): weights and KV pool.
    prom.wait_value(
        r#"count(duet_engine_device_memory_bytes{device="cpu"})"#,
        4.0,
        0.0,
        within,
    );
    prom.wait_value(
        r#"count(duet_engine_device_memory_bytes{kind="weights"} > 1e7)"#,
        2.0,
        0.0,
        within,
    );
    // The first token of a remote prefill comes from the prefill worker; the decode worker
    // generated the rest.
    prom.wait_value(
        "sum(duet_decode_generated_tokens_total)",
        (completion - prompts.len() as u64) as f64,
        0.0,
        within,
    );
    prom.wait_value(
        r#"sum(duet_router_workers{role="decode",state="ready"})"#,
        1.0,
        0.0,
        within,
    );
}

/// JSON log lines of `p` (non-JSON lines are ignored).
fn json_logs(p: &Proc) -> Vec<serde_json::Value> {
    p.log_lines()
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_id_follows_a_request_through_every_process_and_no_prompt_is_logged() {
    let env = [("DUET_LOG", "info"), ("DUET_LOG_FORMAT", "json")];
    let c = Cluster::start_logged(1, 1, &["--local-prefill-max-tokens", "0"], &env);
    c.wait_workers(1, 1, START).await;
    // A word that appears only in the prompt: it must not reach any log.
    let secret = "Zanzibarquetzal";
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut req = tonic::Request::new(greedy(
        text(&format!(
            "My password is {secret} and the weather today is quite pleasant outside."
        )),
        4,
    ));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace}-00f067aa0ba902b7-01")
            .parse()
            .expect("ascii"),
    );
    let mut g = client(&c.url).await;
    let mut s = g.generate(req).await.expect("generate").into_inner();
    while let Some(m) = s.message().await.expect("stream") {
        if matches!(
            m.event,
            Some(duet_proto::v1::generate_response::Event::Final(_))
        ) {
            break;
        }
    }
    // Each process logs the request under the client's trace id.
    for (what, p, span) in [
        ("router", &c.router, "generate"),
        ("prefill worker", &c.prefill[0], "prefill"),
        ("decode worker", &c.decode[0], "decode"),
    ] {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let found = json_logs(p)
                .iter()
                .any(|l| l["span"]["name"] == span && l["span"]["trace_id"] == trace);
            if found {
                break;
            }
            assert!(
                std::time::Instant::now() < end,
                "no JSON log line of the {what} in span {span:?} with trace_id {trace}:\n{}",
                p.log_lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for line in p.log_lines() {
            assert!(!line.contains(secret), "{what} logged the prompt: {line}");
        }
    }
}
