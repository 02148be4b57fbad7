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
/// networks the compose file gives it (workers only on the internal back network). Then
/// faults by container: a decode container killed mid-stream, a prefill container paused.
#[test]
fn a_compose_cluster_of_separate_hosts_serves_and_survives_killed_and_frozen_containers() {
    let prompt = "Summarize the history of the printing press in Europe, from Gutenberg onwards, \
                  covering literacy and the Reformation. "
        .repeat(6);
    let want = support::run_reference(&prompt, false, 16);
    // (prompt, `duet run`'s 8 greedy tokens) for the faults below.
    let with_reference = |p: String| {
        let want = support::run_reference(&p, false, 8);
        (p, want)
    };
    let frozen: Vec<_> = (0..3).map(|i| with_reference(frozen_prompt(i))).collect();
    let cut: Vec<_> = (0..3).map(|i| with_reference(cut_prompt(i))).collect();
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
        eprintln!("scenario docker kill decode: sent 1, completed 1, failed 0");

        // A prefill container frozen (docker pause): long prompts, each its own (no prefix
        // cache help), all complete with `duet run`'s tokens; a request placed on the frozen
        // worker is given up after the KV wait and prefilled elsewhere.
        docker(&["pause", &Compose::container("prefill-0")]);
        let failed = scenario(&mut client, "docker pause prefill-0", &frozen).await;
        docker(&["unpause", &Compose::container("prefill-0")]);
        assert_eq!(failed, 0);
        // A prefill container cut off the back network (docker network disconnect): the same.
        let back = format!("{PROJECT}_back");
        let p1 = Compose::container("prefill-1");
        docker(&["network", "disconnect", &back, &p1]);
        let failed = scenario(&mut client, "network disconnect prefill-1", &cut).await;
        docker(&["network", "connect", "--alias", "prefill-1", &back, &p1]);
        assert_eq!(failed, 0);

        // etcd restarted: the three live workers (one decode container was killed above) are
        // in the router's view again and requests are served.
        docker(&["restart", &Compose::container("etcd")]);
        let t0 = Instant::now();
        while c.status().len() != 3 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "workers back in etcd"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        let got = generate(&mut client, greedy(text(&prompt), 16)).await;
        assert_eq!(
            got.map(|g| g.ids).ok(),
            Some(want.clone()),
            "served after etcd restarted"
        );
        eprintln!("scenario docker restart etcd: sent 1, completed 1, failed 0");

        // Every KV block of every live decode worker is free again (as the router's view of
        // their published capacity says).
        let t0 = Instant::now();
        loop {
            let busy: Vec<String> = c
                .status()
                .into_iter()
                .filter(|w| w["role"] == "decode")
                .filter(|w| w["capacity"]["kv_blocks_free"] != w["capacity"]["kv_blocks_total"])
                .map(|w| w["id"].to_string())
                .collect();
            if busy.is_empty() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "blocks still held on {busy:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    });
}

/// Sends each prompt for 8 greedy tokens and prints sent / completed / failed for the
/// scenario; a request completes when it gets `duet run`'s tokens. Returns the failures.
async fn scenario(
    client: &mut pb::generation_client::GenerationClient<tonic::transport::Channel>,
    name: &str,
    cases: &[(String, Vec<u32>)],
) -> usize {
    let mut failed = 0;
    for (i, (prompt, want)) in cases.iter().enumerate() {
        match generate(client, greedy(text(prompt), 8)).await {
            Ok(got) if got.ids == *want => {}
            other => {
                failed += 1;
                eprintln!("{name}, prompt {i}: {:?}", other.map(|g| g.ids));
            }
        }
    }
    eprintln!(
        "scenario {name}: sent {}, completed {}, failed {failed}",
        cases.len(),
        cases.len() - failed
    );
    failed
}

/// Distinct long prompts (each prefilled remotely, none helped by another's cached prefix).
fn frozen_prompt(i: usize) -> String {
    let topics = ["the printing press", "the steam engine", "the telegraph"];
    format!(
        "{}: explain who built it, when and where, and how it changed the lives of ordinary \
         people in the following century. ",
        topics[i % topics.len()]
    )
    .repeat(4)
}

/// Other long prompts, for the network cut.
fn cut_prompt(i: usize) -> String {
    format!("Once more. {}", frozen_prompt(i))
}
