//! The public doors' guards, as a client sees them: API keys (`--api-key`) on gRPC and HTTP,
//! never logged; the per-client concurrency limit (`--max-in-flight-per-client`).
//!
//! Each test runs its own `duet up` with the flags it needs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use support::{greedy, text, Proc};
use tonic::Code;

const KEYS: &str = "first-k3y,second-k3y";

/// `duet up` with `extra` flags: (process, gRPC URL, HTTP base URL). Logs are kept at debug
/// level so a test can search them.
fn up(extra: &[&str]) -> (Proc, String, String) {
    let (p, url) = support::up_logged(extra, &[("DUET_LOG", "debug")]);
    let http = p.wait_for("http listening on", support::START);
    (p, url, http)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().expect("tokio runtime")
}

/// A gRPC request carrying `authorization: <auth>` when given.
fn with_auth<T>(msg: T, auth: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(a) = auth {
        r.metadata_mut()
            .insert("authorization", a.parse().expect("header value"));
    }
    r
}

async fn complete(
    c: &mut pb::generation_client::GenerationClient<tonic::transport::Channel>,
    r: tonic::Request<pb::GenerateRequest>,
) -> Result<Vec<u32>, tonic::Status> {
    let mut s = c.generate(r).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(m) = s.message().await? {
        if let Some(pb::generate_response::Event::Token(t)) = m.event {
            ids.push(t.id);
        }
    }
    Ok(ids)
}

#[test]
fn grpc_requires_the_api_key() {
    let (p, url, _) = up(&["--api-key", KEYS]);
    rt().block_on(async {
        let mut c = support::client(&url).await;
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("first-k3y"),
            Some("Basic first-k3y"),
        ] {
            let s = complete(&mut c, with_auth(greedy(text("Hi"), 2), auth))
                .await
                .expect_err("refused without a valid key");
            assert_eq!(s.code(), Code::Unauthenticated, "{auth:?}: {s:?}");
            assert!(s.message().contains("API key"), "{auth:?}: {s:?}");
        }
        // Every configured key opens the door.
        for key in ["first-k3y", "second-k3y"] {
            let auth = format!("Bearer {key}");
            let ids = complete(&mut c, with_auth(greedy(text("Hi"), 2), Some(&auth)))
                .await
                .unwrap_or_else(|s| panic!("{key}: {s:?}"));
            assert_eq!(ids.len(), 2);
        }
        // The small RPCs are guarded too.
        let s = c
            .list_models(pb::ListModelsRequest {})
            .await
            .expect_err("ListModels without a key");
        assert_eq!(s.code(), Code::Unauthenticated);
        // Health stays open for probes.
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .expect("url")
            .connect()
            .await
            .expect("connect");
        let mut h = tonic_health::pb::health_client::HealthClient::new(channel);
        h.check(tonic_health::pb::HealthCheckRequest {
            service: "duet.v1.Generation".into(),
        })
        .await
        .expect("health needs no key");
    });
    // Neither the keys nor what clients sent appear in the (debug-level) logs.
    let logs = p.log_lines().join("\n");
    for secret in ["first-k3y", "second-k3y", "wrong"] {
        assert!(!logs.contains(secret), "{secret:?} was logged");
    }
}

/// Keys from `--api-key-file` (one per line, `#` comments) open the doors like `--api-key`;
/// a key file with no key stops `duet up` before it serves anything, naming the flag.
#[test]
fn api_keys_from_a_file_open_the_doors_and_an_empty_file_is_refused() {
    let dir = std::env::temp_dir().join(format!("duet-api-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, "# the router's clients\nfile-k3y\n\n  other-k3y  \n").unwrap();
    let empty = dir.join("empty");
    std::fs::write(&empty, "# nothing yet\n\n").unwrap();

    let o = std::process::Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["up", "--api-key-file"])
        .arg(&empty)
        .env("DUET_MODEL", support::model())
        .output()
        .expect("duet up");
    assert!(
        !o.status.success(),
        "an empty key file must not open the doors"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--api-key-file") && err.contains("no key"),
        "{err}"
    );

    let (p, _, http) = up(&["--api-key-file", keys.to_str().unwrap()]);
    let body = br#"{"prompt": "Hi", "max_tokens": 2}"#;
    let post = |auth: &str| {
        support::http_raw(
            "POST",
            &format!("{http}/v1/completions"),
            &[
                ("Content-Type", "application/json"),
                ("Authorization", auth),
            ],
            Some(body),
        )
    };
    for key in ["file-k3y", "other-k3y"] {
        let r = post(&format!("Bearer {key}"));
        assert_eq!(r.status, 200, "{key}: {}", r.body);
    }
    for auth in ["Bearer # the router's clients", "Bearer ", "Bearer nope"] {
        assert_eq!(post(auth).status, 401, "{auth:?}");
    }
    let logs = p.log_lines().join("\n");
    assert!(!logs.contains("file-k3y"), "a key from the file was logged");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn http_requires_the_api_key() {
    let (p, _, http) = up(&["--api-key", KEYS]);
    let body = br#"{"prompt": "Hi", "max_tokens": 2}"#;
    let json = ("Content-Type", "application/json");
    let post = |auth: Option<&str>| {
        let mut headers = vec![json];
        if let Some(a) = auth {
            headers.push(("Authorization", a));
        }
        support::http_raw(
            "POST",
            &format!("{http}/v1/completions"),
            &headers,
            Some(body),
        )
    };
    for auth in [
        None,
        Some("Bearer nope"),
        Some("Bearer first-k3y-but-longer"),
    ] {
        let r = post(auth);
        assert_eq!(r.status, 401, "{auth:?}: {}", r.body);
        assert_eq!(r.header("www-authenticate").as_deref(), Some("Bearer"));
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
        assert_eq!(v["error"]["code"], 401, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("API key"),
            "{v}"
        );
    }
    let r = post(Some("Bearer second-k3y"));
    assert_eq!(r.status, 200, "{}", r.body);
    // /v1/models is guarded; /health and /metrics are open for probes and scrapers.
    let r = support::http_raw("GET", &format!("{http}/v1/models"), &[], None);
    assert_eq!(r.status, 401, "{}", r.body);
    let r = support::http_raw(
        "GET",
        &format!("{http}/v1/models"),
        &[("Authorization", "Bearer first-k3y")],
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    for open in ["/health", "/metrics"] {
        let (status, _) = support::http_get(&format!("{http}{open}"));
        assert_eq!(status, 200, "{open}");
    }
    // The refusals are counted by class.
    let (_, metrics) = support::http_get(&format!("{http}/metrics"));
    let refused = support::scrape_sum(
        &metrics,
        "duet_router_requests_total",
        &["door=\"http\"", "outcome=\"unauthenticated\""],
    );
    assert!(refused >= 4.0, "401s counted: {refused}");
    let logs = p.log_lines().join("\n");
    for secret in ["first-k3y", "second-k3y", "nope"] {
        assert!(!logs.contains(secret), "{secret:?} was logged");
    }
}

#[test]
fn per_client_concurrency_limit() {
    let (_p, url, http) = up(&["--max-in-flight-per-client", "2"]);
    rt().block_on(async {
        // Two long generations from this client, each in flight once its first token arrived.
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut c = support::client(&url).await;
            let mut s = c
                .generate(pb::GenerateRequest {
                    ignore_eos: true,
                    ..greedy(text("Count slowly"), 300)
                })
                .await
                .expect("in flight")
                .into_inner();
            s.message().await.expect("first token").expect("a message");
            held.push(s);
        }
        // A third, on either door, is refused at once.
        let mut c = support::client(&url).await;
        let started = Instant::now();
        let s = complete(&mut c, tonic::Request::new(greedy(text("Hi"), 2)))
            .await
            .expect_err("over the per-client limit");
        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        assert!(s.message().contains("per-client limit"), "{s:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let http2 = http.clone();
        let r = tokio::task::spawn_blocking(move || {
            support::http_raw(
                "POST",
                &format!("{http2}/v1/completions"),
                &[("Content-Type", "application/json")],
                Some(br#"{"prompt": "Hi", "max_tokens": 2}"#),
            )
        })
        .await
        .expect("join");
        assert_eq!(r.status, 429, "{}", r.body);
        assert!(r.header("retry-after").is_some(), "{}", r.head);
        // Ending one frees its unit: the next request completes.
        held.pop();
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            match complete(&mut c, tonic::Request::new(greedy(text("Hi"), 2))).await {
                Ok(ids) => {
                    assert_eq!(ids.len(), 2);
                    break;
                }
                Err(s) if s.code() == Code::ResourceExhausted && Instant::now() < end => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(s) => panic!("a unit should be free again: {s:?}"),
            }
        }
    });
}

/// The HTTP door's limits, as a slow or greedy client meets them: a body trickled past
/// `--http-body-timeout` is answered 408; a connection that sends no request head within
/// `--http-header-timeout` (new, or idle after a response) is closed; one connection over
/// `--http-max-connections` is answered 503 at once; a prompt too long for the context in
/// bytes is refused before it is tokenized. The door still serves afterwards.
#[test]
fn http_door_limits_slow_idle_and_greedy_clients() {
    use std::io::{Read, Write};
    let (_p, _url, http) = up(&[
        "--http-header-timeout",
        "1s",
        "--http-body-timeout",
        "1s",
        "--http-max-connections",
        "8",
    ]);
    let host = http.strip_prefix("http://").expect("http url").to_string();
    let connect = || {
        let s = std::net::TcpStream::connect(&host).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s
    };
    let read_all = |s: &mut std::net::TcpStream| {
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };

    // A body promised and trickled: 408 within about the body timeout.
    let mut s = connect();
    let t0 = Instant::now();
    s.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n\
             content-length: 100\r\n\r\n{{\"prompt\""
        )
        .as_bytes(),
    )
    .expect("write head");
    let reply = read_all(&mut s);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());

    // Silent connections, new or kept alive after a response, are closed by the header timeout.
    let mut silent = connect();
    let t0 = Instant::now();
    assert_eq!(read_all(&mut silent), "", "closed without an answer");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(5),
        "closed after {waited:?}"
    );
    let mut kept = connect();
    kept.write_all(format!("GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .expect("write");
    let t0 = Instant::now();
    let reply = read_all(&mut kept);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "an idle keep-alive connection is closed"
    );

    // More connections than the cap: the extra one is answered 503 at once.
    let held: Vec<_> = (0..8).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut extra = connect();
    let t0 = Instant::now();
    let reply = read_all(&mut extra);
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    assert!(reply.contains("retry-after"), "{reply}");
    assert!(
        t0.elapsed() < Duration::from_millis(800),
        "refused at once, not timed out"
    );
    drop(held);

    // 4 MB of prompt: refused on its size in bytes, before the tokenizer sees it.
    std::thread::sleep(Duration::from_millis(1500));
    let prompt = "word ".repeat(800_000);
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 4}).to_string();
    let t0 = Instant::now();
    let r = support::http_raw(
        "POST",
        &format!("{http}/v1/completions"),
        &[("content-type", "application/json")],
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("bytes cannot fit the context"),
        "{}",
        r.body
    );
    eprintln!("4 MB prompt refused in {:?}", t0.elapsed());

    // And the door still serves.
    let r = support::http_raw(
        "POST",
        &format!("{http}/v1/completions"),
        &[("content-type", "application/json")],
        Some(br#"{"prompt": "Hello", "max_tokens": 2}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}
