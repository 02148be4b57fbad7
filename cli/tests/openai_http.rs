//! The OpenAI-compatible HTTP door, checked with clients nobody here wrote: the official
//! `openai` Python package and `curl`. Greedy outputs must equal the gRPC door's (same
//! routing, same engine); errors must come in OpenAI's JSON shape with the right status;
//! closing the connection must free the request's KV.
//!
//! Needs python3 with `openai` and `curl`: installed by scripts/install-test-deps.sh.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use serde_json::Value;
use support::*;

const PROMPT: &str = "The capital of France is";

fn python() -> String {
    std::env::var("DUET_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// `curl -sS` with `args`; returns (HTTP status, body). Fails (never skips) without curl.
fn curl(args: &[&str]) -> (u16, String) {
    let o = Command::new("curl")
        .args(["-sS", "-N", "--max-time", "120", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl (scripts/install-test-deps.sh installs it)");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn post(url: &str, body: &Value) -> (u16, String) {
    curl(&[
        "-H",
        "content-type: application/json",
        "-d",
        &body.to_string(),
        url,
    ])
}

/// The `data:` payloads of a server-sent event stream.
fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// Greedy output of the gRPC door for the same request.
async fn grpc_greedy(url: &str, prompt: pb::generate_request::Prompt, max: u32) -> Completion {
    let mut c = client(url).await;
    generate(&mut c, greedy(prompt, max))
        .await
        .expect("gRPC generate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_package_gets_what_the_grpc_door_gives() {
    let (up, url) = up(&[]);
    let http = up.wait_for("http listening on", START);
    let want = grpc_greedy(&url, text(PROMPT), 8).await;
    let chat_prompt = pb::generate_request::Prompt::Chat(pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }],
    });
    let want_chat = grpc_greedy(&url, chat_prompt, 12).await;

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let o = Command::new(python())
        .arg(script)
        .arg(format!("{http}/v1"))
        .output()
        .expect("python3");
    assert!(
        o.status.success(),
        "openai client failed (is the `openai` package installed? scripts/install-test-deps.sh \
         installs it)\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_slice(&o.stdout).expect("client json");
    let fin = want.fin.clone().expect("final");
    let usage = fin.usage.expect("usage");

    assert_eq!(v["models"][0], "SmolLM2-135M-Instruct.Q4_1");
    // Completions, whole and streamed: the gRPC door's greedy text and usage.
    for key in ["completion", "completion_stream"] {
        assert_eq!(v[key]["text"], want.text.as_str(), "{key}: {v}");
        assert_eq!(v[key]["finish_reason"], "length", "{key}");
        assert_eq!(
            v[key]["usage"]["completion_tokens"], usage.completion_tokens,
            "{key}"
        );
        assert_eq!(
            v[key]["usage"]["prompt_tokens"], usage.prompt_tokens,
            "{key}"
        );
        assert_eq!(
            v[key]["usage"]["total_tokens"],
            usage.prompt_tokens + usage.completion_tokens
        );
    }
    assert!(
        v["completion_stream"]["chunks"].as_u64().unwrap_or(0) >= 3,
        "{v}"
    );
    // Chat: the chat template is applied the same way on both doors.
    assert_eq!(v["chat"]["text"], want_chat.text.as_str(), "{v}");
    assert_eq!(v["chat"]["role"], "assistant");
    assert_eq!(v["chat_stream"]["text"], want_chat.text.as_str(), "{v}");
    assert_eq!(v["chat_stream"]["roles"], serde_json::json!(["assistant"]));
    let chat_usage = want_chat.fin.and_then(|f| f.usage).expect("chat usage");
    assert_eq!(
        v["chat"]["usage"]["prompt_tokens"],
        chat_usage.prompt_tokens
    );
    // vLLM's extensions are accepted; ignore_eos makes the length exact.
    assert_eq!(v["extras"]["completion_tokens"], 5);
    // Errors the client raises as typed exceptions.
    assert_eq!(v["errors"]["n"]["status"], 400, "{v}");
    assert_eq!(v["errors"]["n"]["param"], "n");
    assert_eq!(v["errors"]["model"]["status"], 404, "{v}");
    assert_eq!(v["errors"]["messages"]["status"], 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_streams_sse_and_a_closed_connection_frees_the_kv() {
    let (up, url) = up(&[]);
    let http = up.wait_for("http listening on", START);
    let ids = {
        let mut c = client(&url).await;
        c.tokenize(pb::TokenizeRequest {
            model: String::new(),
            input: Some(pb::tokenize_request::Input::Text(PROMPT.into())),
        })
        .await
        .expect("tokenize")
        .into_inner()
        .ids
    };
    let want = grpc_greedy(&url, tokens(&ids), 6).await;

    // Token-id prompt, whole answer.
    let body = serde_json::json!({"prompt": ids, "max_tokens": 6, "temperature": 0});
    let (code, whole) = post(&format!("{http}/v1/completions"), &body);
    assert_eq!(code, 200, "{whole}");
    let whole: Value = serde_json::from_str(&whole).expect("json");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["choices"][0]["text"], want.text.as_str());

    // The same as server-sent events.
    let mut body = body;
    body["stream"] = Value::Bool(true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let (code, stream) = post(&format!("{http}/v1/completions"), &body);
    assert_eq!(code, 200, "{stream}");
    let events = sse_events(&stream);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{stream}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, want.text);
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));

    // /v1/models and /health.
    let (code, models) = curl(&[&format!("{http}/v1/models")]);
    assert_eq!(code, 200);
    let models: Value = serde_json::from_str(&models).expect("json");
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(curl(&[&format!("{http}/health")]).0, 200);

    // Bad requests: OpenAI's error shape, 400, the parameter named.
    for (body, param) in [
        (
            serde_json::json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            serde_json::json!({"prompt": "x", "temperature": 9}),
            "temperature",
        ),
        (
            serde_json::json!({"prompt": [999999], "max_tokens": 2}),
            "prompt",
        ),
        (serde_json::json!({"max_tokens": 2}), "prompt"),
    ] {
        let (code, e) = post(&format!("{http}/v1/completions"), &body);
        assert_eq!(code, 400, "{body} -> {e}");
        let e: Value = serde_json::from_str(&e).expect("error json");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert_eq!(e["error"]["param"], param, "{e}");
        assert!(!e["error"]["message"].as_str().unwrap_or("").is_empty());
    }

    // A client that hangs up mid-stream: the request is cancelled and its KV freed.
    let host = http.trim_start_matches("http://").to_string();
    let mut s = std::net::TcpStream::connect(&host).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    let req = serde_json::json!({
        "prompt": ids, "max_tokens": 2000, "ignore_eos": true, "stream": true, "temperature": 0
    })
    .to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{req}",
        req.len()
    )
    .expect("send");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let mut line = String::new();
    let end = Instant::now() + Duration::from_secs(60);
    let mut seen = 0;
    while seen < 3 && Instant::now() < end {
        line.clear();
        if r.read_line(&mut line).expect("read") == 0 {
            break;
        }
        if line.contains("\"text\"") {
            seen += 1;
        }
    }
    assert_eq!(seen, 3, "no tokens streamed before hanging up");
    drop(r);
    drop(s);
    up.assert_decode_pools_empty(Duration::from_secs(10)).await;
    // The router counts the request as cancelled once it released the worker.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m) = http_get(&format!("{http}/metrics"));
        let cancelled = scrape_sum(
            &m,
            "duet_router_requests_total",
            &[r#"door="http""#, r#"outcome="cancelled""#],
        );
        let in_flight = scrape_sum(&m, "duet_router_requests_in_flight", &[]);
        if cancelled == 1.0 && in_flight == 0.0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "cancelled {cancelled}, in flight {in_flight}, want 1 and 0"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Unknown routes answer in OpenAI's error shape too.
    let (code, e) = curl(&[&format!("{http}/v1/embeddings")]);
    assert_eq!(code, 404, "{e}");
    assert!(e.contains("\"error\""), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_workers_503_and_past_the_queue_bound_429() {
    // A router whose registry holds no worker; one waiting request fills the queue.
    // The first request waits up to 5 s for a decode worker to appear: time for the test
    // to see it queued and send the second.
    let c = Cluster::start(0, 0, &["--max-queued", "1", "--no-worker-grace", "5s"]);
    let http = c.router.wait_for("http listening on", START);
    let (code, h) = curl(&[&format!("{http}/health")]);
    assert_eq!(code, 503, "{h}");

    let body = serde_json::json!({"prompt": "hello", "max_tokens": 2});
    let url = format!("{http}/v1/completions");
    let waiting = {
        let (url, body) = (url.clone(), body.clone());
        std::thread::spawn(move || post(&url, &body))
    };
    // Once the first request holds the only queue place, the next is refused at once.
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, m) = http_get(&format!("{http}/metrics"));
        if scrape_sum(&m, "duet_router_requests_queued", &[]) == 1.0 {
            break;
        }
        assert!(Instant::now() < end, "the first request never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = Command::new("curl")
        .args([
            "-sS",
            "-i",
            "--max-time",
            "60",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(body.to_string())
        .arg(&url)
        .output()
        .expect("curl");
    let full = String::from_utf8_lossy(&o.stdout).to_lowercase();
    assert!(full.starts_with("http/1.1 429"), "{full}");
    assert!(full.contains("retry-after: "), "{full}");
    assert!(full.contains("rate_limit_error"), "{full}");

    // The waiting one gives up: no decode worker exists.
    let (code, e) = waiting.join().expect("thread");
    assert_eq!(code, 503, "{e}");
    let e: Value = serde_json::from_str(&e).expect("error json");
    assert_eq!(e["error"]["type"], "service_unavailable_error");
}
