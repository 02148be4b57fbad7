//! The compose cluster of `deploy/compose/` for the container tests: started with the same
//! scripts as `make cluster-up` (the image holding this test build's binary), removed when
//! dropped, and asked about through the router (`duet status`), Docker and the cluster's own
//! Prometheus container.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::support::prometheus::PrometheusApi;

pub const PROJECT: &str = "duet-test";
const IMAGE: &str = "duet:test";
/// The cluster name the compose file gives every process; Prometheus's `namespace` label.
pub const NAMESPACE: &str = "compose";
/// Every duet worker container.
pub const WORKERS: [&str; 4] = ["prefill-0", "prefill-1", "decode-0", "decode-1"];

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

pub fn ok(o: Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn docker(args: &[&str]) -> String {
    ok(
        Command::new("docker").args(args).output().expect("docker"),
        &format!("docker {args:?}"),
    )
}

/// The cluster, removed (containers and networks) when dropped.
pub struct Compose {
    pub grpc: String,
    pub prometheus: PrometheusApi,
}

impl Compose {
    pub fn up() -> Compose {
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
        let line = |prefix: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .unwrap_or_else(|| panic!("cluster-up prints `{prefix}`: {out}"))
                .to_string()
        };
        Compose {
            grpc: line("router gRPC: "),
            prometheus: PrometheusApi {
                url: line("prometheus: "),
            },
        }
    }

    pub fn container(role: &str) -> String {
        format!("{PROJECT}_{role}_1")
    }

    /// Worker records as the router sees them (`duet status --router`).
    pub fn status(&self) -> Vec<serde_json::Value> {
        let o = Command::new(env!("CARGO_BIN_EXE_duet"))
            .args(["status", "--router", &self.grpc])
            .output()
            .expect("duet status");
        ok(o, "duet status")
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The id of a worker of `role` the router sees busy (running a sequence, or with prompt
    /// tokens queued), waiting up to `within`.
    pub fn busy(&self, role: &str, within: Duration) -> String {
        let t0 = Instant::now();
        loop {
            let busy = self.status().into_iter().find_map(|w| {
                let c = &w["capacity"];
                (w["role"] == role
                    && (c["running"].as_u64() > Some(0)
                        || c["queued_prefill_tokens"].as_u64() > Some(0)))
                .then(|| w["id"].as_str().unwrap_or_default().to_string())
            });
            if let Some(id) = busy {
                return id;
            }
            assert!(
                t0.elapsed() < within,
                "no {role} worker busy within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the router sees all four workers, `id` among them.
    pub fn wait_registered(&self, id: &str, within: Duration) {
        let t0 = Instant::now();
        loop {
            let s = self.status();
            if s.len() == WORKERS.len() && s.iter().any(|w| w["id"] == id) {
                return;
            }
            assert!(
                t0.elapsed() < within,
                "{id} not back in the router's view within {within:?}: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Starts a container killed before and waits for its worker to register again.
    pub fn start_again(&self, id: &str) {
        docker(&["start", &Compose::container(id)]);
        self.wait_registered(id, Duration::from_secs(60));
    }

    /// Waits until `promql` (an instant query over the cluster's Prometheus) is `want`.
    pub fn wait_metric(&self, promql: &str, want: f64, within: Duration) {
        self.prometheus.wait_value(promql, want, 0.0, within);
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        let _ = script("cluster-down.sh").output();
    }
}

/// Waits until every duet container is healthy by its image's HEALTHCHECK and checks it runs
/// as uid 65532; checks every container sits on the networks the compose file gives it
/// (workers only on the internal back network; the router and Prometheus also on the front
/// one).
pub fn assert_containers_as_declared() {
    for role in [
        "router",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "prometheus",
    ] {
        let name = Compose::container(role);
        if role != "prometheus" {
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
        }
        let nets = docker(&[
            "inspect",
            "-f",
            "{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}",
            &name,
        ]);
        let want = if matches!(role, "router" | "prometheus") {
            vec![format!("{PROJECT}_back"), format!("{PROJECT}_front")]
        } else {
            vec![format!("{PROJECT}_back")]
        };
        let mut got: Vec<String> = nets.split_whitespace().map(String::from).collect();
        got.sort();
        assert_eq!(got, want, "{name}");
    }
}
