//! The compose cluster of `deploy/compose/` as separate hosts: etcd, a router, 2 prefill and
//! 2 decode workers, each a container with its own address on a private network, KV over
//! tcp between containers, the KV secret from a file. Built here from nothing pulled: the
//! base image from Debian's packages (debootstrap), the duet image holding this test build's
//! binary (`DUET_BINARY`: a release compile would add minutes to CI; the image's build steps
//! are the ones `make image` runs), etcd from Debian's package on the same base.
//!
//! Needs a Docker engine with Compose and root (debootstrap): every machine of this project
//! has them; without them the test fails, it never skips.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use support::{generate, greedy, text};

const PROJECT: &str = "duet-test";
const IMAGE: &str = "duet:test";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn script(name: &str) -> Command {
    let mut c = Command::new(repo().join("scripts").join(name));
    c.env("DUET_COMPOSE_PROJECT", PROJECT)
        .env("DUET_IMAGE", IMAGE)
        .env("DUET_BIN", env!("CARGO_BIN_EXE_duet"));
    c
}

fn ok(o: Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The cluster, removed (containers and networks) when dropped.
struct Compose {
    grpc: String,
}

impl Compose {
    fn up() -> Compose {
        let o = script("build-image.sh")
            .env("DUET_BINARY", env!("CARGO_BIN_EXE_duet"))
            .env("DUET_IMAGE_TAG", IMAGE)
            .output()
            .expect("scripts/build-image.sh");
        ok(o, "build-image.sh");
        let _ = script("cluster-down.sh").output();
        let out = ok(
            script("cluster-up.sh").output().expect("cluster-up"),
            "cluster-up.sh",
        );
        let grpc = out
            .lines()
            .find_map(|l| l.strip_prefix("router gRPC: "))
            .expect("cluster-up prints the router's gRPC address")
            .to_string();
        Compose { grpc }
    }

    fn container(role: &str) -> String {
        format!("{PROJECT}_{role}_1")
    }

    /// Worker records as the router sees them (`duet status --router`).
    fn status(&self) -> Vec<serde_json::Value> {
        let o = Command::new(env!("CARGO_BIN_EXE_duet"))
            .args(["status", "--router", &self.grpc])
            .output()
            .expect("duet status");
        ok(o, "duet status")
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        let _ = script("cluster-down.sh").output();
    }
}

fn docker(args: &[&str]) -> String {
    ok(
        Command::new("docker").args(args).output().expect("docker"),
        &format!("docker {args:?}"),
    )
}

/// A remote prefill crosses containers (prefill worker -> decode worker over tcp, KV
/// authenticated with the secret file) and gives `duet run`'s tokens; every container is
/// healthy by its image's HEALTHCHECK (`duet health`), runs as uid 65532, and sits on the
/// networks the compose file gives it (workers only on the internal back network).
#[test]
fn a_compose_cluster_of_separate_hosts_serves_and_survives_a_killed_decode_container() {
    let prompt = "Summarize the history of the printing press in Europe, from Gutenberg onwards, \
                  covering literacy and the Reformation. "
        .repeat(6);
    let want = support::run_reference(&prompt, false, 16);
    let c = Compose::up();
    for role in ["router", "prefill-0", "prefill-1", "decode-0", "decode-1"] {
        let name = Compose::container(role);
        let t0 = Instant::now();
        loop {
            let h = docker(&["inspect", "-f", "{{.State.Health.Status}}", &name]);
            if h.trim() == "healthy" {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{name}: {h}");
            std::thread::sleep(Duration::from_millis(500));
        }
        assert_eq!(
            docker(&["inspect", "-f", "{{.Config.User}}", &name]).trim(),
            "65532:65532"
        );
        let nets = docker(&[
            "inspect",
            "-f",
            "{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}",
            &name,
        ]);
        let want_nets = if role == "router" {
            vec![format!("{PROJECT}_back"), format!("{PROJECT}_front")]
        } else {
            vec![format!("{PROJECT}_back")]
        };
        let mut got: Vec<String> = nets.split_whitespace().map(String::from).collect();
        got.sort();
        assert_eq!(got, want_nets, "{name}");
    }
    assert_eq!(c.status().len(), 4, "4 workers registered");

    let rt = support::runtime();
    rt.block_on(async {
        let mut client = support::client(&c.grpc).await;
        let got = generate(&mut client, greedy(text(&prompt), 16))
            .await
            .unwrap();
        assert_eq!(got.ids, want, "{:?}", got.text);
        let t = got.timings();
        assert_eq!(
            pb::PrefillPlacement::try_from(t.placement),
            Ok(pb::PrefillPlacement::Remote)
        );
        assert!(t.kv_bytes > 0, "KV crossed containers: {t:?}");

        // Kill (docker kill: SIGKILL to the container) the decode container streaming a
        // request: the stream continues on the other one, with the undisturbed tokens.
        let req = || pb::GenerateRequest {
            ignore_eos: true,
            ..greedy(text("Write a short story about a lighthouse keeper."), 160)
        };
        let reference = generate(&mut client, req()).await.unwrap();
        let mut s = client.generate(req()).await.unwrap().into_inner();
        let mut ids = Vec::new();
        let mut fin = None;
        let mut killed = None;
        while let Some(m) = s.message().await.expect("the client sees no error") {
            match m.event {
                Some(pb::generate_response::Event::Token(t)) => {
                    ids.push(t.id);
                    if ids.len() == 8 {
                        let t0 = Instant::now();
                        while killed.is_none() {
                            killed = c.status().into_iter().find_map(|w| {
                                (w["role"] == "decode"
                                    && w["capacity"]["running"].as_u64() > Some(0))
                                .then(|| w["id"].as_str().unwrap_or_default().to_string())
                            });
                            assert!(
                                t0.elapsed() < Duration::from_secs(10),
                                "no decode worker runs it"
                            );
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        let who = killed.clone().unwrap_or_default();
                        docker(&["kill", &Compose::container(&who)]);
                    }
                }
                Some(pb::generate_response::Event::Final(f)) => fin = Some(f),
                None => {}
            }
        }
        assert_eq!(ids, reference.ids, "no repeated or missing token");
        let killed = killed.expect("a decode container was killed");
        let fin = fin.expect("final message");
        let survivor = fin.timings.expect("timings").decode_worker;
        assert!(
            survivor.starts_with("decode-") && survivor != killed,
            "{survivor} vs {killed}"
        );
    });
}
