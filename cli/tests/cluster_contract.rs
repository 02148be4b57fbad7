//! The public contract of `duet up` as a client sees it: every bad request gets the right
//! gRPC code and a message naming the field, health and the small RPCs answer sensibly.
//!
//! All tests share ONE `duet up` process (started on first use; loading the model twice per
//! test would dominate the run). Each test has its own runtime and client.

mod support;

use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use support::{generate, greedy, text, tokens, Proc};
use tonic::Code;

/// The shared cluster: the process (behind a lock: `Proc` is not `Sync`) and the router URL.
struct Cluster {
    _proc: Mutex<Proc>,
    url: String,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

/// The context requests are held to: the shared cluster runs with `--max-model-len 1024`
/// (below the model's 8192) so that over-long prompts are quick to truncate and prefill.
const CONTEXT: u32 = 1024;

/// The router URL of the shared cluster, starting it on first use (thread-safe: `OnceLock`
/// runs the start once; the other tests block until it is done). A failed start is recorded
/// once and every test reports it instead of starting another process.
fn url() -> String {
    let c = CLUSTER.get_or_init(|| {
        std::panic::catch_unwind(start).map_err(|e| {
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into())
        })
    });
    match c {
        Ok(c) => c.url.clone(),
        Err(e) => panic!("the shared `duet up` did not start: {e}"),
    }
}

/// Flags of the shared cluster beyond `--listen 127.0.0.1:0`.
///
/// `--kv-pool 512MiB` (the production default; `--kv-pool` cannot be given twice, so the
/// cluster is started here rather than by `support::up`).
///
/// `--max-attempts 1`: there is one decode worker, so a retry can only repeat the same
/// placement; a failure then surfaces with its own reason at once.
///
/// `--max-model-len 1024`: see [`CONTEXT`].
const FLAGS: &[&str] = &[
    "--kv-pool",
    "512MiB",
    "--max-attempts",
    "1",
    "--max-model-len",
    "1024",
];

// The watchdog must outlive this process (it reaps `duet up` after we exit), so it is
// never waited on.
#[allow(clippy::zombie_processes)]
fn start() -> Cluster {
    let mut args = vec![
        "up",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(FLAGS);
    let p = Proc::start("up", &args);
    let url = p.wait_for("router listening on", support::START);
    // A static is never dropped, so `Proc`'s kill-on-drop does not run at exit. A watchdog
    // holds the read end of a pipe whose write end only this test process has (Rust opens
    // pipes close-on-exec): when this process exits, however it exits, the read sees EOF and
    // the watchdog kills `duet up`.
    let mut dog = Command::new("sh")
        .args(["-c", "read _ ; kill -9 \"$1\" 2>/dev/null", "watchdog"])
        .arg(p.pid().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the watchdog (sh)");
    std::mem::forget(dog.stdin.take());
    // Workers register shortly after the router prints its address: wait until both roles
    // are listed so no test races the registration.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut c = support::client(&url).await;
        let end = Instant::now() + support::START;
        loop {
            let m = c
                .list_models(pb::ListModelsRequest {})
                .await
                .expect("ListModels")
                .into_inner();
            if m.models
                .iter()
                .any(|m| m.prefill_workers >= 1 && m.decode_workers >= 1)
            {
                break;
            }
            assert!(Instant::now() < end, "workers never registered: {m:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    Cluster {
        _proc: Mutex::new(p),
        url,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().expect("tokio runtime")
}

/// Sends `req` and returns the completion or the error status.
fn send(req: pb::GenerateRequest) -> Result<support::Completion, tonic::Status> {
    let url = url();
    rt().block_on(async {
        let mut c = support::client(&url).await;
        generate(&mut c, req).await
    })
}

/// `req` must fail with `code` and a message naming `field`.
fn expect_error(case: &str, req: pb::GenerateRequest, code: Code, field: &str) {
    let started = Instant::now();
    let r = send(req);
    let s = match r {
        Ok(c) => panic!("{case}: expected {code:?} naming {field:?}, got a completion: {c:?}"),
        Err(s) => s,
    };
    eprintln!("{case}: {:?} {:?}", s.code(), s.message());
    assert_eq!(
        s.code(),
        code,
        "{case}: wrong gRPC code (message: {:?})",
        s.message()
    );
    assert!(
        s.message().contains(field),
        "{case}: the message should name {field:?}: {:?}",
        s.message()
    );
    assert!(
        !s.message().contains("panicked"),
        "{case}: panic in the server: {:?}",
        s.message()
    );
    // Validation happens before placement: rejecting a request must not wait on workers.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{case}: the rejection took {:?}",
        started.elapsed()
    );
}

fn req(prompt: Option<pb::generate_request::Prompt>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt,
        max_tokens,
        ..Default::default()
    }
}

fn sampled(s: pb::SamplingParams) -> pb::GenerateRequest {
    pb::GenerateRequest {
        sampling: Some(s),
        ..greedy(text("Hello"), 4)
    }
}

fn chat(messages: Vec<pb::ChatMessage>) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Chat(pb::ChatMessages { messages })
}

/// Longer than the context: 1100 copies of one ordinary token.
const OVER_LONG: u32 = 1100;
fn over_long_prompt() -> pb::generate_request::Prompt {
    tokens(&vec![504; OVER_LONG as usize])
}

/// One `#[test]` per bad request: `name: request => code, "field the message names";`.
macro_rules! bad_requests {
    ($($name:ident: $req:expr => $code:ident, $field:literal;)*) => {
        $(
            #[test]
            fn $name() {
                expect_error(stringify!($name), $req, Code::$code, $field);
            }
        )*
    };
}

bad_requests! {
    empty_text_prompt: greedy(text(""), 4) => InvalidArgument, "prompt";
    missing_prompt: req(None, 4) => InvalidArgument, "prompt";
    empty_chat_message_list: greedy(chat(vec![]), 4) => InvalidArgument, "prompt";
    empty_token_list: greedy(tokens(&[]), 4) => InvalidArgument, "prompt";
    token_id_outside_vocabulary: greedy(tokens(&[504, 999_999]), 4) => InvalidArgument, "prompt";
    unknown_model: pb::GenerateRequest { model: "nope".into(), ..greedy(text("Hello"), 4) }
        => NotFound, "model";
    max_tokens_zero: greedy(text("Hello"), 0) => InvalidArgument, "max_tokens";
    max_tokens_larger_than_context: greedy(text("Hello"), 100_000) => InvalidArgument, "max_tokens";
    max_tokens_equal_to_context: greedy(text("Hello"), CONTEXT) => InvalidArgument, "max_tokens";
    prompt_of_exactly_the_context_length: greedy(tokens(&vec![504; CONTEXT as usize]), 1)
        => InvalidArgument, "prompt";
    prompt_longer_than_context_default_truncation: greedy(over_long_prompt(), 1)
        => InvalidArgument, "prompt";
    prompt_longer_than_context_truncation_error: pb::GenerateRequest {
        truncation: pb::Truncation::Error as i32,
        ..greedy(over_long_prompt(), 1)
    } => InvalidArgument, "prompt";
    negative_temperature: sampled(pb::SamplingParams { temperature: -1.0, ..Default::default() })
        => InvalidArgument, "temperature";
    nan_temperature: sampled(pb::SamplingParams { temperature: f32::NAN, ..Default::default() })
        => InvalidArgument, "temperature";
    top_p_above_one: sampled(pb::SamplingParams { top_p: 1.5, ..Default::default() })
        => InvalidArgument, "top_p";
    negative_top_p: sampled(pb::SamplingParams { top_p: -0.5, ..Default::default() })
        => InvalidArgument, "top_p";
    min_p_above_one: sampled(pb::SamplingParams { min_p: 2.0, ..Default::default() })
        => InvalidArgument, "min_p";
    negative_repetition_penalty: sampled(pb::SamplingParams {
        repetition_penalty: -1.0,
        ..Default::default()
    }) => InvalidArgument, "repetition_penalty";
    seventeen_stop_strings: pb::GenerateRequest {
        stop: (0..17).map(|i| format!("stop{i}")).collect(),
        ..greedy(text("Hello"), 4)
    } => InvalidArgument, "stop";
    empty_stop_string: pb::GenerateRequest {
        stop: vec![String::new()],
        ..greedy(text("Hello"), 4)
    } => InvalidArgument, "stop";
    unknown_priority: pb::GenerateRequest { priority: 99, ..greedy(text("Hello"), 4) }
        => InvalidArgument, "priority";
}

#[test]
fn sixteen_stop_strings_are_accepted() {
    let c = send(pb::GenerateRequest {
        stop: (0..16).map(|i| format!("zzstop{i}")).collect(),
        ..greedy(text("The capital of France is"), 2)
    })
    .expect("16 stop strings are within the limit");
    assert_eq!(c.ids.len(), 2, "{c:?}");
}

#[test]
fn top_k_with_temperature_is_fine() {
    let c = send(sampled(pb::SamplingParams {
        temperature: 0.8,
        top_k: 40,
        seed: Some(7),
        ..Default::default()
    }))
    .expect("top_k with temperature is a valid request");
    let fin = c.fin.expect("final message");
    assert!(!c.ids.is_empty() && c.ids.len() <= 4, "{:?}", c.ids);
    let usage = fin.usage.expect("usage");
    assert_eq!(usage.completion_tokens as usize, c.ids.len());
}

#[test]
fn over_long_prompt_with_keep_right_is_truncated() {
    let started = Instant::now();
    let url = url();
    // A 1023-token prefill takes seconds; the bound only keeps a hang from blocking the
    // suite forever.
    let limit = Duration::from_secs(5 * 60);
    let c = rt()
        .block_on(async {
            let mut c = support::client(&url).await;
            let req = pb::GenerateRequest {
                truncation: pb::Truncation::KeepRight as i32,
                ..greedy(over_long_prompt(), 1)
            };
            tokio::time::timeout(limit, generate(&mut c, req)).await
        })
        .unwrap_or_else(|_| panic!("no answer within {limit:?}"))
        .unwrap_or_else(|e| {
            panic!(
                "KEEP_RIGHT should truncate and generate; after {:?}: {e:?}",
                started.elapsed()
            )
        });
    eprintln!("over-long prompt with KEEP_RIGHT: {:?}", started.elapsed());
    let fin = c.fin.expect("final message");
    let usage = fin.usage.expect("usage");
    assert!(usage.truncated_tokens > 0, "{usage:?}");
    assert!(usage.prompt_tokens < CONTEXT, "{usage:?}");
    assert_eq!(
        usage.prompt_tokens + usage.truncated_tokens,
        OVER_LONG,
        "kept + dropped = the prompt: {usage:?}"
    );
    assert_eq!(c.ids.len(), 1);
    assert_eq!(fin.finish_reason, pb::FinishReason::Length as i32);
}

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
/// (64 MiB holds ~1,450 tokens) fails at once with a code that does not invite a retry,
/// instead of waiting for room that can never appear. Starts its own cluster (the shared
/// one's pool is large enough for any prompt within its context).
#[test]
fn prompt_larger_than_every_kv_pool_fails_fast() {
    let (_p, url) = support::up(&[]);
    let started = Instant::now();
    let r = rt().block_on(async {
        let mut c = support::client(&url).await;
        generate(&mut c, greedy(tokens(&vec![504; 2000]), 1)).await
    });
    let s = r.expect_err("2,000 prompt tokens cannot fit 64 MiB of f32 KV");
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
