//! The runner and the OpenAI backend against a fake OpenAI-compatible server on loopback:
//! a plain TCP server that streams server-sent events in chunked HTTP, splitting events
//! across writes, packing two tokens into one chunk, and refusing some prompts with 503.
//! Checks what the records and the summary must say about it, and that the concurrency cap
//! and the arrival schedule hold.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use duet_bench::{
    BackendKind, DatasetKind, IgnoreEos, LengthParams, PromptFormat, SendOptions, ServeConfig, Slo,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Requests asking for this many tokens get HTTP 503.
const REFUSED_MAX_TOKENS: u64 = 4;
/// Pause between the output chunks of the fake server.
const GAP: Duration = Duration::from_millis(15);

#[derive(Default)]
struct Counters {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    bodies: std::sync::Mutex<Vec<Value>>,
}

async fn read_request(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Some((head, buf[head_end..head_end + len].to_vec()))
}

async fn chunk(s: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(format!("{:x}\r\n", data.len()).as_bytes())
        .await?;
    s.write_all(data).await?;
    s.write_all(b"\r\n").await?;
    s.flush().await
}

/// Streams `max_tokens` tokens: the first two in one chunk, then one per chunk, each SSE
/// event split in two writes; then usage and [DONE].
async fn serve_one(mut s: TcpStream, c: Arc<Counters>) -> std::io::Result<()> {
    let Some((head, body)) = read_request(&mut s).await else {
        return Ok(());
    };
    if head.starts_with("GET /v1/models") {
        let b = r#"{"object":"list","data":[{"id":"fake-model","object":"model"}]}"#;
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
            b.len()
        );
        return s.write_all(resp.as_bytes()).await;
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    c.bodies.lock().unwrap().push(v.clone());
    let prompt_len = v["prompt"].as_array().map_or(0, Vec::len);
    if v["max_tokens"].as_u64() == Some(REFUSED_MAX_TOKENS) {
        let b = r#"{"error":{"message":"overloaded"}}"#;
        let resp = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
            b.len()
        );
        return s.write_all(resp.as_bytes()).await;
    }
    let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    c.max_in_flight.fetch_max(now, Ordering::SeqCst);
    s.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    )
    .await?;
    let max_tokens = v["max_tokens"].as_u64().unwrap_or(1) as usize;
    let mut texts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < max_tokens {
        if i == 0 && max_tokens >= 2 {
            texts.push(" t0 t1".into());
            i += 2;
        } else {
            texts.push(format!(" t{i}"));
            i += 1;
        }
    }
    for t in &texts {
        tokio::time::sleep(GAP).await;
        let ev = format!(
            "data: {}\r\n\r\n",
            serde_json::json!({"choices":[{"index":0,"text":t,"finish_reason":null}]})
        );
        let (a, b) = ev.as_bytes().split_at(ev.len() / 2);
        chunk(&mut s, a).await?;
        chunk(&mut s, b).await?;
    }
    let usage = serde_json::json!({"choices":[],"usage":{"prompt_tokens":prompt_len,"completion_tokens":max_tokens}});
    chunk(&mut s, format!("data: {usage}\r\n\r\n").as_bytes()).await?;
    chunk(&mut s, b"data: [DONE]\r\n\r\n").await?;
    c.in_flight.fetch_sub(1, Ordering::SeqCst);
    s.write_all(b"0\r\n\r\n").await?;
    s.flush().await
}

async fn fake_server() -> (String, Arc<Counters>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let c = Arc::new(Counters::default());
    let c2 = c.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let _ = s.set_nodelay(true);
            tokio::spawn(serve_one(s, c2.clone()));
        }
    });
    (url, c)
}

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn config(url: String, lengths: LengthParams, dataset: DatasetKind) -> ServeConfig {
    ServeConfig {
        label: "fake".into(),
        backend: BackendKind::Openai,
        url,
        endpoint: "/v1/completions".into(),
        model_name: None,
        tokenizer: model(),
        dataset,
        lengths: lengths.lengths(dataset).unwrap(),
        length_params: lengths,
        corpus: None,
        shared_prefix_len: 0,
        num_prefixes: 1,
        turns: 1,
        seed: 1,
        send: SendOptions {
            api_key: None,
            temperature: 0.0,
            seed: None,
            prompt_format: PromptFormat::Tokens,
            ignore_eos: IgnoreEos::IgnoreEos,
            extra_body: Default::default(),
            timeout: Duration::from_secs(30),
        },
        rates: vec![None],
        burstiness: 1.0,
        max_concurrency: Some(3),
        num_prompts: Some(12),
        duration: None,
        warmup: 1,
        slo: Some(Slo::parse("ttft=10000,tpot=10000").unwrap()),
        attainment_target: 0.9,
    }
}

fn lengths(input: usize, output: usize, ratio: f64) -> LengthParams {
    LengthParams {
        input_len: input,
        output_len: output,
        range_ratio: ratio,
        input_median: None,
        output_median: None,
        length_scale: 1.0,
        max_input_len: 4096,
        max_output_len: 4096,
    }
}

#[tokio::test(flavor = "current_thread")]
async fn records_match_what_the_fake_server_streamed() {
    let (url, counters) = fake_server().await;
    let output = 5;
    let cfg = config(url, lengths(24, output, 0.0), DatasetKind::Fixed);
    let report = duet_bench::run(&cfg, false).await.unwrap();
    assert_eq!(report.model, "fake-model");
    let run = &report.runs[0];
    let n = cfg.num_prompts.unwrap();
    assert_eq!(run.requests.len(), n);
    assert_eq!(run.summary.completed, n);
    assert_eq!(run.summary.output_tokens, n * output);
    for r in &run.requests {
        assert!(r.ok(), "{r:?}");
        // The first chunk carried two tokens: one chunk fewer than tokens.
        assert_eq!(r.output_tokens, output);
        assert_eq!(r.itl_s.len(), output - 2);
        let (ttft, e2e) = (r.ttft_s.unwrap(), r.e2e_s.unwrap());
        assert!(ttft >= GAP.as_secs_f64() * 0.9 && ttft <= e2e);
        assert!(r.itl_s.iter().all(|g| *g >= GAP.as_secs_f64() * 0.5));
    }
    // Closed loop of three.
    let cap = cfg.max_concurrency.unwrap();
    assert!(counters.max_in_flight.load(Ordering::SeqCst) <= cap);
    // What the server received: token-id prompts of the exact length, exact-length asks.
    let bodies = counters.bodies.lock().unwrap();
    assert_eq!(bodies.len(), n + cfg.warmup);
    for b in bodies.iter() {
        assert_eq!(b["prompt"].as_array().map(Vec::len), Some(24));
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream"], true);
        assert_eq!(b["model"], "fake-model");
        assert_eq!(b["max_tokens"].as_u64(), Some(output as u64));
    }
}

#[tokio::test(flavor = "current_thread")]
async fn refused_requests_are_counted_by_status_and_rates_are_kept() {
    let (url, counters) = fake_server().await;
    // Outputs uniform in 2..=4: the requests asking for 4 tokens are refused.
    let mut cfg = config(url, lengths(20, 3, 0.2), DatasetKind::Uniform);
    cfg.max_concurrency = None;
    cfg.warmup = 0;
    cfg.num_prompts = Some(40);
    let rates = [40.0, 80.0];
    cfg.rates = rates.iter().copied().map(Some).collect();
    cfg.send.ignore_eos = IgnoreEos::MinTokens;
    cfg.send.prompt_format = PromptFormat::Text;
    let report = duet_bench::run(&cfg, false).await.unwrap();
    assert_eq!(report.runs.len(), rates.len());
    for (run, rate) in report.runs.iter().zip(rates) {
        let s = &run.summary;
        assert_eq!(s.rate, Some(rate));
        assert_eq!(s.completed + s.failed, s.requests);
        let refused = run
            .requests
            .iter()
            .filter(|r| r.error.as_ref().is_some_and(|e| e.kind == "http:503"))
            .count();
        assert_eq!(s.errors.get("http:503").copied().unwrap_or(0), refused);
        assert_eq!(s.failed, refused);
        let asked_refused = run
            .requests
            .iter()
            .filter(|r| r.requested_output_tokens as u64 == REFUSED_MAX_TOKENS)
            .count();
        assert_eq!(refused, asked_refused);
        assert!(refused > 0 && refused < s.requests);
        // The planned schedule is increasing and no request left before its time.
        let sched: Vec<f64> = run.requests.iter().map(|r| r.scheduled_s).collect();
        assert!(sched.windows(2).all(|w| w[0] <= w[1]));
        assert!(run
            .requests
            .iter()
            .all(|r| r.arrival_s + 1e-3 >= r.scheduled_s));
        // Mean gap near 1/rate (40 samples: loose).
        let mean_gap = sched.last().unwrap() / (sched.len() - 1) as f64;
        assert!(
            mean_gap > 0.4 / rate && mean_gap < 2.0 / rate,
            "rate {rate}: mean gap {mean_gap}"
        );
    }
    // Both runs drew the same workload: same failures at the same indices.
    let failed = |i: usize| -> Vec<usize> {
        report.runs[i]
            .requests
            .iter()
            .filter(|r| !r.ok())
            .map(|r| r.index)
            .collect()
    };
    assert_eq!(failed(0), failed(1));
    // Text prompts, and min_tokens instead of ignore_eos.
    let bodies = counters.bodies.lock().unwrap();
    assert!(bodies.iter().all(|b| b["prompt"].is_string()
        && b["min_tokens"] == b["max_tokens"]
        && b.get("ignore_eos").is_none()));
    let sweep = report.sweep.as_ref().expect("sweep with an SLO");
    assert_eq!(sweep.points.len(), rates.len());
}
