//! The public contract of `duet up` as a client sees it: every bad request gets the right
//! gRPC code and a message naming the field, health and the small RPCs answer sensibly.
//!
//! All tests share ONE `duet up` process (started on first use; loading the model twice per
//! test would dominate the run). Each test has its own runtime and client.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

/// The HTTP door's answers to bad requests.
#[path = "cluster_contract/http.rs"]
mod http;
/// The small RPCs (health, tokenize, models, status) and the KV-pool limit.
#[path = "cluster_contract/rpcs.rs"]
mod rpcs;

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
    /// The HTTP door (OpenAI API).
    http: String,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

/// The context requests are held to: the shared cluster runs with `--max-model-len 1024`
/// (below the model's 8192) so that over-long prompts are quick to truncate and prefill.
const CONTEXT: u32 = 1024;

/// The router URL of the shared cluster, starting it on first use (thread-safe: `OnceLock`
/// runs the start once; the other tests block until it is done). A failed start is recorded
/// once and every test reports it instead of starting another process.
fn url() -> String {
    cluster().url.clone()
}

/// The HTTP door's base URL (`http://host:port`) of the shared cluster.
fn http_url() -> String {
    cluster().http.clone()
}

fn cluster() -> &'static Cluster {
    let c = CLUSTER.get_or_init(|| {
        std::panic::catch_unwind(start).map_err(|e| {
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into())
        })
    });
    match c {
        Ok(c) => c,
        Err(e) => panic!("the shared `duet up` did not start: {e}"),
    }
}

/// Flags of the shared cluster beyond what `support::up` sets.
///
/// `--kv-pool 512MiB`: the production default.
///
/// `--max-attempts 1`: there is one decode worker, so a retry can only repeat the same
/// placement; a failure then surfaces with its own reason at once.
///
/// `--max-model-len 1024`: see [`CONTEXT`].
///
/// `--max-request-bytes`: see [`MAX_REQUEST_BYTES`].
const FLAGS: &[&str] = &[
    "--kv-pool",
    "512MiB",
    "--max-attempts",
    "1",
    "--max-model-len",
    "1024",
    "--max-request-bytes",
    "65536",
];

/// The shared cluster's limit on a request (gRPC message or HTTP body).
const MAX_REQUEST_BYTES: usize = 65536;

// The watchdog must outlive this process (it reaps `duet up` after we exit), so it is
// never waited on.
#[allow(clippy::zombie_processes)]
fn start() -> Cluster {
    let (p, url) = support::up(FLAGS);
    let http = p.wait_for("http listening on", support::START);
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
        http,
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
    whitespace_only_text_prompt: greedy(text(" \n\t "), 4) => InvalidArgument, "prompt";
    stop_string_longer_than_256_bytes: pb::GenerateRequest {
        stop: vec!["x".repeat(257)],
        ..greedy(text("Hello"), 4)
    } => InvalidArgument, "stop";
    prompt_over_context_keep_left_with_max_tokens_at_context: pb::GenerateRequest {
        truncation: pb::Truncation::KeepLeft as i32,
        ..greedy(over_long_prompt(), CONTEXT)
    } => InvalidArgument, "max_tokens";
    missing_prompt: req(None, 4) => InvalidArgument, "prompt";
    empty_chat_message_list: greedy(chat(vec![]), 4) => InvalidArgument, "prompt";
    chat_message_with_an_unknown_role: greedy(chat(vec![pb::ChatMessage {
        role: "wizard".into(),
        content: "Hi".into(),
    }]), 4) => InvalidArgument, "messages[0].role";
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
    attention_window_of_zero: pb::GenerateRequest {
        attention: Some(window(0, 4)),
        ..greedy(text("Hello"), 4)
    } => InvalidArgument, "attention.window";
    attention_window_wider_than_context: pb::GenerateRequest {
        attention: Some(window(CONTEXT, 4)),
        ..greedy(text("Hello"), 4)
    } => InvalidArgument, "attention.window";
}

/// A local attention window of `window` tokens with `sinks` sinks.
fn window(window: u32, sinks: u32) -> pb::AttentionPolicy {
    pb::AttentionPolicy {
        policy: Some(pb::attention_policy::Policy::Window(pb::LocalWindow {
            window,
            sinks,
        })),
    }
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

/// A deadline that passes before the router can act on the request fails at once, nothing
/// queued: DEADLINE_EXCEEDED when duet's own check sees it, CANCELLED "Timeout expired" when
/// tonic's deadline timer (client or server side) fires first; which one wins is a race.
#[test]
fn already_expired_deadline() {
    let url = url();
    let s = rt()
        .block_on(async {
            let mut c = support::client(&url).await;
            let mut r = tonic::Request::new(greedy(text("Hello"), 4));
            r.set_timeout(Duration::from_nanos(1));
            generate_req(&mut c, r).await
        })
        .expect_err("an expired deadline must fail");
    match s.code() {
        Code::DeadlineExceeded => assert!(s.message().contains("deadline"), "{s:?}"),
        Code::Cancelled => assert!(s.message().contains("Timeout expired"), "{s:?}"),
        other => panic!("expected DEADLINE_EXCEEDED or CANCELLED, got {other:?}: {s:?}"),
    }
}

async fn generate_req(
    c: &mut duet_proto::v1::generation_client::GenerationClient<tonic::transport::Channel>,
    r: tonic::Request<pb::GenerateRequest>,
) -> Result<support::Completion, tonic::Status> {
    let mut s = c.generate(r).await?.into_inner();
    let mut out = support::Completion::default();
    while let Some(m) = s.message().await? {
        match m.event {
            Some(pb::generate_response::Event::Token(t)) => out.ids.push(t.id),
            Some(pb::generate_response::Event::Final(f)) => out.fin = Some(f),
            None => {}
        }
    }
    Ok(out)
}

/// A request id may not be reused while a request with that id is in flight (ALREADY_EXISTS);
/// once it finished, the id is free again.
#[test]
fn request_id_reused_while_in_flight() {
    let url = url();
    rt().block_on(async {
        let id = format!("dup-{}", rand::random::<u32>());
        let mut c = support::client(&url).await;
        let long = pb::GenerateRequest {
            request_id: id.clone(),
            ignore_eos: true,
            ..greedy(text("Count slowly"), 200)
        };
        // The first request is in flight once its first token arrived.
        let mut first = c.generate(long).await.expect("first request").into_inner();
        let m = first
            .message()
            .await
            .expect("first token")
            .expect("a message");
        assert!(matches!(
            m.event,
            Some(pb::generate_response::Event::Token(_))
        ));
        let mut c2 = support::client(&url).await;
        let s = generate(
            &mut c2,
            pb::GenerateRequest {
                request_id: id.clone(),
                ..greedy(text("Hello"), 2)
            },
        )
        .await
        .expect_err("the id is in flight");
        assert_eq!(s.code(), Code::AlreadyExists, "{s:?}");
        assert!(s.message().contains(&id), "the message names the id: {s:?}");
        // Hanging up ends the first request; its id becomes free.
        drop(first);
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let again = generate(
                &mut c2,
                pb::GenerateRequest {
                    request_id: id.clone(),
                    ..greedy(text("Hello"), 2)
                },
            )
            .await;
            match again {
                Ok(done) => {
                    assert_eq!(done.ids.len(), 2);
                    break;
                }
                Err(s) if s.code() == Code::AlreadyExists && Instant::now() < end => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(s) => panic!("the id should be free after the first request ended: {s:?}"),
            }
        }
    });
}

/// A message above `--max-request-bytes` is refused by the gRPC layer (OUT_OF_RANGE, as
/// tonic reports it) before it is decoded.
#[test]
fn oversized_grpc_message() {
    let s = send(greedy(text(&"a ".repeat(MAX_REQUEST_BYTES)), 1)).expect_err("too large");
    assert_eq!(s.code(), Code::OutOfRange, "{s:?}");
    assert!(s.message().contains("too large"), "{s:?}");
}

/// A `string` field that is not UTF-8 cannot be decoded: INTERNAL with the decoder's
/// reason, per gRPC's status-code table ("error parsing request proto"); nothing runs.
#[test]
fn invalid_utf8_in_a_text_prompt() {
    /// `GenerateRequest` with its `text` prompt (tag 3) as raw bytes.
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawTextRequest {
        #[prost(bytes = "vec", tag = "3")]
        text: Vec<u8>,
        #[prost(uint32, tag = "7")]
        max_tokens: u32,
    }
    let url = url();
    let s = rt().block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url)
            .expect("url")
            .connect()
            .await
            .expect("connect");
        let mut g = tonic::client::Grpc::new(channel);
        g.ready().await.expect("ready");
        let path =
            tonic::codegen::http::uri::PathAndQuery::from_static("/duet.v1.Generation/Generate");
        let codec = tonic_prost::ProstCodec::<RawTextRequest, pb::GenerateResponse>::default();
        let req = tonic::Request::new(RawTextRequest {
            text: vec![b'H', 0xff, 0xfe, b'i'],
            max_tokens: 2,
        });
        match g.server_streaming(req, path, codec).await {
            Err(s) => s,
            Ok(r) => {
                let mut st = r.into_inner();
                match st.message().await {
                    Err(s) => s,
                    Ok(m) => panic!("invalid UTF-8 was accepted: {m:?}"),
                }
            }
        }
    });
    assert_eq!(s.code(), Code::Internal, "{s:?}");
    assert!(
        s.message().contains("UTF-8"),
        "the message names the problem: {s:?}"
    );
}
