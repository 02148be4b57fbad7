//! The public doors' guards, as a client sees them: API keys (`--api-key`) on gRPC and HTTP,
//! never logged; the per-client concurrency limit (`--max-in-flight-per-client`).
//!
//! Each test runs its own `duet up` with the flags it needs.

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
