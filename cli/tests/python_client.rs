//! A client in another language works from the published proto alone: Python stubs
//! generated with grpcio-tools from proto/ stream a completion from `duet up` and get the
//! same tokens as the Rust client, and the standard health service answers SERVING.
//!
//! Python's official reflection client (grpcio-reflection, v1alpha) lists and describes the
//! services of every server of a cluster.
//!
//! Needs grpcio, grpcio-tools, protobuf, grpcio-health-checking and grpcio-reflection for
//! python3: installed by scripts/install-test-deps.sh. Without them the test fails (it is
//! never skipped).
//! `DUET_TEST_PYTHON` names another interpreter (default: python3 on PATH).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{SystemTime, UNIX_EPOCH};

use duet_proto::v1 as pb;
use support::{generate, greedy, text};

const PROMPT: &str = "The capital of France is";
const MAX_TOKENS: u32 = 8;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> String {
    std::env::var("DUET_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn out_text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Fails (never skips) when the Python packages are missing, saying how to install them.
fn require_python_packages() {
    let o = Command::new(python())
        .args([
            "-c",
            "import grpc, grpc_tools.protoc, google.protobuf, grpc_health.v1.health_pb2, \
             grpc_reflection.v1alpha.proto_reflection_descriptor_database",
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {}: {e}; run scripts/install-test-deps.sh to install python3 and \
                 the gRPC packages",
                python()
            )
        });
    assert!(
        o.status.success(),
        "the Python gRPC packages are missing: run scripts/install-test-deps.sh \
         (it installs grpcio, grpcio-tools, protobuf, grpcio-health-checking and \
         grpcio-reflection)\n{}",
        out_text(&o)
    );
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("duet-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Python stubs of the public protos, generated into `dir` as a user would.
fn generate_stubs(dir: &Path) {
    let d = dir.to_str().expect("utf-8 temp path");
    let o = Command::new(python())
        .current_dir(workspace())
        .args([
            "-m",
            "grpc_tools.protoc",
            "-I",
            "proto",
            &format!("--python_out={d}"),
            &format!("--grpc_python_out={d}"),
            "proto/duet/v1/generation.proto",
            "proto/duet/v1/worker.proto",
        ])
        .output()
        .expect("run grpc_tools.protoc");
    assert!(
        o.status.success(),
        "grpc_tools.protoc failed\n{}",
        out_text(&o)
    );
    for f in [
        "generation_pb2.py",
        "generation_pb2_grpc.py",
        "worker_pb2.py",
        "worker_pb2_grpc.py",
    ] {
        let p = dir.join("duet/v1").join(f);
        assert!(p.is_file(), "protoc did not write {}", p.display());
    }
}

#[test]
fn python_client_streams_the_same_tokens_as_rust() {
    require_python_packages();
    let tmp = TempDir::new("pyclient");
    generate_stubs(&tmp.0);

    let (_up, url) = support::up(&[]);
    let target = url
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("router URL {url:?} is not http://host:port"));

    // The reference: the Rust client, same request.
    let rust = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async {
            let mut c = support::client(&url).await;
            generate(&mut c, greedy(text(PROMPT), MAX_TOKENS)).await
        })
        .expect("Rust client generate");
    let rust_fin = rust.fin.clone().expect("final message");
    assert_eq!(rust.ids.len(), MAX_TOKENS as usize, "{rust:?}");

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/stream_client.py");
    let o = Command::new(python())
        .arg(&script)
        .args(["--target", target, "--stubs"])
        .arg(&tmp.0)
        .args(["--prompt", PROMPT, "--max-tokens", &MAX_TOKENS.to_string()])
        .output()
        .expect("run stream_client.py");
    assert!(
        o.status.success(),
        "stream_client.py failed\n{}",
        out_text(&o)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stream_client.py printed no JSON ({e})\n{}", out_text(&o)));

    let ids: Vec<u32> = v["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect();
    assert_eq!(
        ids, rust.ids,
        "Python and Rust clients got different tokens"
    );
    assert_eq!(v["text"].as_str(), Some(rust.text.as_str()), "{v}");
    assert_eq!(v["finish_reason"], "FINISH_REASON_LENGTH", "{v}");
    assert_eq!(rust_fin.finish_reason, pb::FinishReason::Length as i32);
    assert_eq!(v["usage"]["completion_tokens"], MAX_TOKENS, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 5, "{v}");
    assert!(
        !v["request_id"].as_str().unwrap_or("").is_empty(),
        "the router assigns a request id: {v}"
    );
    assert_eq!(v["health"][""], "SERVING", "{v}");
    assert_eq!(v["health"]["duet.v1.Generation"], "SERVING", "{v}");
}

/// Reflection as Python's official `grpcio-reflection` (v1alpha only) sees every server of a
/// cluster: a program given nothing but the address lists the services and describes
/// `duet.v1.Generation`'s methods from the server's descriptors; workers answer members
/// (cluster token) only, as for every internal call.
#[test]
fn python_reflection_v1alpha_lists_and_describes_every_server() {
    require_python_packages();
    let cl = support::Cluster::start(1, 1, &[]);
    let host = |url: &str| {
        url.strip_prefix("http://")
            .unwrap_or_else(|| panic!("{url:?} is not http://host:port"))
            .to_string()
    };
    let secret = duet_kv_transfer::SharedSecret::new(support::TEST_SECRET).expect("secret");
    let token: String = secret
        .derive(duet_serving::cluster_auth::TOKEN_LABEL)
        .expect("key")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/reflection_client.py");
    let reflect = |target: &str, token: Option<&str>| -> serde_json::Value {
        let mut cmd = Command::new(python());
        cmd.arg(&script).args(["--target", target]);
        if let Some(t) = token {
            cmd.args(["--token", t]);
        }
        let o = cmd.output().expect("run reflection_client.py");
        assert!(
            o.status.success(),
            "reflection_client.py failed\n{}",
            out_text(&o)
        );
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!(
                "reflection_client.py printed no JSON ({e})\n{}",
                out_text(&o)
            )
        })
    };
    let servers = [
        ("router", host(&cl.url), None),
        (
            "prefill",
            host(&cl.prefill[0].workers_addr()),
            Some(token.as_str()),
        ),
        (
            "decode",
            host(&cl.decode[0].workers_addr()),
            Some(token.as_str()),
        ),
    ];
    for (name, target, token) in &servers {
        let v = reflect(target, *token);
        let services: Vec<&str> = v["services"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no services listed: {v}"))
            .iter()
            .filter_map(|s| s.as_str())
            .collect();
        for want in [
            "duet.v1.Generation",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(
                services.contains(&want),
                "{name}: {want} not listed: {services:?}"
            );
        }
        let generate = &v["generation"]["methods"]["Generate"];
        assert_eq!(generate["input"], "duet.v1.GenerateRequest", "{name}: {v}");
        assert_eq!(
            generate["output"], "duet.v1.GenerateResponse",
            "{name}: {v}"
        );
        assert_eq!(generate["server_streaming"], true, "{name}: {v}");
        if token.is_some() {
            let stranger = reflect(target, None);
            assert_eq!(stranger["error"], "UNAUTHENTICATED", "{name}: {stranger}");
        }
    }
}
