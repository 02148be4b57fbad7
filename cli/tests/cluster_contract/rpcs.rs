//! The small RPCs of `duet up` (health, tokenize, models, status) and a prompt larger than
//! every KV pool, against the shared cluster.

use super::*;

#[test]
fn health_serving_for_server_and_generation_service() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let url = url();
    rt().block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .expect("url")
            .connect()
            .await
            .expect("connect");
        let mut h = HealthClient::new(channel);
        for service in ["", "duet.v1.Generation"] {
            let r = h
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap_or_else(|e| panic!("Check({service:?}): {e}"))
                .into_inner();
            assert_eq!(r.status(), ServingStatus::Serving, "Check({service:?})");
        }
        // An unknown service is NOT_FOUND (the standard health contract).
        let e = h
            .check(HealthCheckRequest {
                service: "no.such.Service".into(),
            })
            .await
            .expect_err("unknown service");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
    });
}

#[test]
fn tokenize_text() {
    let url = url();
    rt().block_on(async {
        let mut c = support::client(&url).await;
        let r = c
            .tokenize(pb::TokenizeRequest {
                model: String::new(),
                input: Some(pb::tokenize_request::Input::Text(
                    "The capital of France is".into(),
                )),
            })
            .await
            .expect("Tokenize")
            .into_inner();
        assert_eq!(r.ids, vec![504, 3575, 282, 4649, 314]);
        assert_eq!(r.count, 5);
        assert_eq!(r.max_context, CONTEXT);
    });
}

#[test]
fn tokenize_chat_renders_the_template() {
    let url = url();
    rt().block_on(async {
        let mut c = support::client(&url).await;
        let plain = c
            .tokenize(pb::TokenizeRequest {
                model: String::new(),
                input: Some(pb::tokenize_request::Input::Text("Hi".into())),
            })
            .await
            .expect("Tokenize text")
            .into_inner();
        let r = c
            .tokenize(pb::TokenizeRequest {
                model: String::new(),
                input: Some(pb::tokenize_request::Input::Chat(pb::ChatMessages {
                    messages: vec![pb::ChatMessage {
                        role: "user".into(),
                        content: "Hi".into(),
                    }],
                })),
            })
            .await
            .expect("Tokenize chat")
            .into_inner();
        assert_eq!(r.count as usize, r.ids.len());
        assert!(
            r.ids.len() > plain.ids.len(),
            "the chat template adds tokens: {:?} vs {:?}",
            r.ids,
            plain.ids
        );
    });
}

#[test]
fn tokenize_bad_requests() {
    let url = url();
    rt().block_on(async {
        let mut c = support::client(&url).await;
        let e = c
            .tokenize(pb::TokenizeRequest {
                model: "nope".into(),
                input: Some(pb::tokenize_request::Input::Text("Hi".into())),
            })
            .await
            .expect_err("unknown model");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        assert!(e.message().contains("model"), "{e:?}");
        let e = c
            .tokenize(pb::TokenizeRequest {
                model: String::new(),
                input: None,
            })
            .await
            .expect_err("missing input");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("input"), "{e:?}");
    });
}

#[test]
fn list_models_shows_the_model_and_its_workers() {
    let url = url();
    rt().block_on(async {
        let mut c = support::client(&url).await;
        let r = c
            .list_models(pb::ListModelsRequest {})
            .await
            .expect("ListModels")
            .into_inner();
        assert_eq!(r.models.len(), 1, "{r:?}");
        let m = &r.models[0];
        assert!(!m.name.is_empty(), "{m:?}");
        assert!(!m.fingerprint.is_empty(), "{m:?}");
        assert_eq!(m.context_length, CONTEXT, "{m:?}");
        assert!(m.prefill_workers >= 1, "{m:?}");
        assert!(m.decode_workers >= 1, "{m:?}");
        // The listed name is accepted as `model` by Generate.
        let done = generate(
            &mut c,
            pb::GenerateRequest {
                model: m.name.clone(),
                ..greedy(text("The capital of France is"), 1)
            },
        )
        .await
        .expect("Generate with the listed model name");
        assert_eq!(done.ids.len(), 1);
    });
}

/// A prompt that fits the model's context but can never fit a decode worker's whole KV pool
/// (64 MiB of f16 KV holds ~2,900 tokens) fails at once with a code that does not invite a retry,
/// instead of waiting for room that can never appear. Starts its own cluster (the shared
/// one's pool is large enough for any prompt within its context).
#[test]
fn prompt_larger_than_every_kv_pool_fails_fast() {
    let (_p, url) = support::up(&[]);
    let started = Instant::now();
    let r = rt().block_on(async {
        let mut c = support::client(&url).await;
        generate(&mut c, greedy(tokens(&vec![504; 4000]), 1)).await
    });
    let s = r.expect_err("4,000 prompt tokens cannot fit 64 MiB of f16 KV");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}: {s:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            s.code(),
            Code::ResourceExhausted
                | Code::InvalidArgument
                | Code::OutOfRange
                | Code::FailedPrecondition
        ),
        "a non-retryable code: {s:?}"
    );
    assert!(s.message().contains("prompt"), "{s:?}");
}

/// `duet status --router` prints the router's view: one record per worker with its role,
/// address and published capacity.
#[test]
fn status_from_the_router_lists_every_worker_with_capacity() {
    let url = url();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["status", "--router", &url])
        .output()
        .expect("duet status");
    assert!(
        o.status.success(),
        "duet status: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let records: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON record per line"))
        .collect();
    let roles: Vec<&str> = records
        .iter()
        .map(|r| r["role"].as_str().unwrap_or_default())
        .collect();
    assert!(
        roles.contains(&"prefill") && roles.contains(&"decode"),
        "{records:?}"
    );
    for r in &records {
        assert!(r["grpc_addr"]
            .as_str()
            .unwrap_or_default()
            .starts_with("http://127.0.0.1:"));
        assert!(
            r["capacity"]["kv_blocks_total"].as_u64().unwrap_or(0) > 0,
            "{r}"
        );
        assert_eq!(r["fingerprint"], records[0]["fingerprint"], "one model");
    }
}

// ---- gRPC rows that need more than a request value ----
