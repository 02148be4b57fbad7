//! Real processes for the cluster tests: `duet` subcommands started on free ports (each
//! prints the address it serves, which the test reads instead of guessing), a real etcd,
//! and a gRPC client of the public door.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use duet_proto::v1::generation_client::GenerationClient;

mod cluster;
#[path = "../../../discovery/tests/support/mod.rs"]
pub mod etcd;
mod http;
pub mod prometheus;
pub mod reference;

#[allow(unused_imports)] // each test crate uses part of the support
pub use cluster::{Cluster, TTL};
#[allow(unused_imports)]
pub use http::*;

/// A runtime for a test's client side (two worker threads, as on the CI machines).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The cluster secret of every process these tests start (separate processes refuse to
/// start without one).
/// The environment of workers that move KV over tcp, as between hosts, instead of the
/// same-host default (shared memory).
pub const KV_TCP: (&str, &str) = ("DUET_KV_SHM", "off");

/// How the workers of a test move KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kv {
    /// The default between processes of one host: shared memory (the send arena).
    Shm,
    /// As between hosts.
    Tcp,
}

impl Kv {
    /// The workers' environment for it.
    pub fn env(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Kv::Shm => vec![],
            Kv::Tcp => vec![KV_TCP],
        }
    }

    /// Its `transport` label on `duet_kv_transfer_*` metrics.
    pub fn transport(self) -> &'static str {
        match self {
            Kv::Shm => "shm",
            Kv::Tcp => "tcp",
        }
    }
}

pub const TEST_SECRET: &str = "duet-test-cluster-secret-0123456789";

/// A request to a worker's internal service, with the cluster token its members carry.
pub fn internal<T>(msg: T) -> tonic::Request<T> {
    let secret = duet_kv_transfer::SharedSecret::new(TEST_SECRET).expect("test secret");
    let token = duet_serving::cluster_auth::ClusterToken::from_key(
        secret
            .derive(duet_serving::cluster_auth::TOKEN_LABEL)
            .expect("key"),
    )
    .expect("token");
    let mut req = tonic::Request::new(msg);
    token.attach(&mut req);
    req
}

pub fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The second test model, Gemma 3 270M Q4_K_M (`make model` fetches it).
pub fn gemma_model() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-q4_k_m.gguf");
    assert!(p.exists(), "{} is missing: run make model", p.display());
    p
}

/// A running `duet` process; killed (SIGKILL) on drop.
pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    errs: Arc<Mutex<Vec<String>>>,
    pub name: String,
}

impl Proc {
    /// Starts `duet <args>` with the default model; stderr goes to the test's stderr.
    pub fn start(name: &str, args: &[&str]) -> Proc {
        Proc::spawn(name, args, &[], false)
    }

    /// Starts `duet <args>` with extra environment variables, keeping its stderr (logs) in
    /// [`Proc::log_lines`].
    pub fn start_logged(name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        Proc::spawn(name, args, env, true)
    }

    /// Starts `duet <args>` inside network namespace `netns` (`ip netns exec`, which execs
    /// duet in place: the child is duet itself), logs kept.
    pub fn start_in_netns(netns: &str, name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns, env!("CARGO_BIN_EXE_duet")]);
        Proc::spawn_cmd(cmd, name, args, env, true)
    }

    fn spawn(name: &str, args: &[&str], env: &[(&str, &str)], keep_stderr: bool) -> Proc {
        let cmd = Command::new(env!("CARGO_BIN_EXE_duet"));
        Proc::spawn_cmd(cmd, name, args, env, keep_stderr)
    }

    fn spawn_cmd(
        mut cmd: Command,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        keep_stderr: bool,
    ) -> Proc {
        cmd.args(args)
            .env("DUET_MODEL", model())
            .env_remove("DUET_ETCD")
            .env(
                "DUET_LOG",
                std::env::var("DUET_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            // Workers run as users run them: workers of one host move KV over shared
            // memory (the default). A test about KV over tcp (as between hosts, or across
            // cut network namespaces) says so with `KV_TCP`.
            .env("DUET_KV_SECRET", TEST_SECRET)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(if keep_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        let mut child = cmd.spawn().expect("start duet");
        let collect = |r: Box<dyn std::io::Read + Send>| {
            let lines = Arc::new(Mutex::new(Vec::new()));
            let sink = lines.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(r).lines().map_while(Result::ok) {
                    sink.lock().unwrap().push(l);
                }
            });
            lines
        };
        let lines = collect(Box::new(child.stdout.take().expect("stdout")));
        let errs = match child.stderr.take() {
            Some(e) => collect(Box::new(e)),
            None => Arc::new(Mutex::new(Vec::new())),
        };
        Proc {
            child,
            lines,
            errs,
            name: name.to_string(),
        }
    }

    /// The stdout lines the process printed so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The stderr lines of a process started with [`Proc::start_logged`].
    pub fn log_lines(&self) -> Vec<String> {
        self.errs.lock().unwrap().clone()
    }

    /// Every stdout line so far that contains `marker`: the word after it.
    pub fn found(&self, marker: &str) -> Vec<String> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| {
                let i = l.find(marker)?;
                let rest = l[i + marker.len()..].trim_start();
                Some(
                    rest.split(|c: char| c.is_whitespace() || c == ',')
                        .next()
                        .unwrap_or("")
                        .to_string(),
                )
            })
            .collect()
    }

    /// Waits for a stdout line containing `marker` and returns the word after it.
    pub fn wait_for(&self, marker: &str, timeout: Duration) -> String {
        let end = Instant::now() + timeout;
        loop {
            if let Some(w) = self.found(marker).into_iter().next() {
                return w;
            }
            if Instant::now() > end {
                panic!("{}: no line with {marker:?} within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// gRPC addresses of the decode (or prefill) workers this process announced.
    pub fn workers(&self, role: &str) -> Vec<String> {
        let tag = format!("duet: {role} worker ");
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(&tag))
            .filter_map(|l| {
                let i = l.find("serving gRPC on ")?;
                let rest = &l[i + "serving gRPC on ".len()..];
                Some(rest.split([',', ' ']).next().unwrap_or("").to_string())
            })
            .collect()
    }

    /// The `/metrics` URL this process announced (workers of a [`Cluster`] serve one).
    pub fn metrics_url(&self) -> String {
        self.wait_for("metrics on ", START)
    }

    /// The gRPC address this worker process announced.
    pub fn workers_addr(&self) -> String {
        self.wait_for("serving gRPC on", START)
    }

    /// Waits until every decode worker's pool is empty again (no sequence, no reservation,
    /// all blocks free); panics with the last status otherwise.
    pub async fn assert_decode_pools_empty(&self, within: Duration) {
        for addr in self.workers("decode") {
            assert_pool_empty(&addr, within).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status();
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `timeout` for the process to exit on its own; its status code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// SIGTERM; waits up to `timeout` for the exit and returns its status code.
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        self.signal("-TERM");
        self.wait_exit(timeout)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Load times of a debug test binary on a loaded 2-core machine are generous.
pub const START: Duration = Duration::from_secs(120);

/// `duet up` on free ports; returns the process and the router URL.
pub fn up(extra: &[&str]) -> (Proc, String) {
    let p = Proc::start("up", &up_args(extra));
    let url = p.wait_for("router listening on", START);
    (p, url)
}

/// [`up`] with extra environment variables, its logs kept in [`Proc::log_lines`].
pub fn up_logged(extra: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
    let p = Proc::start_logged("up", &up_args(extra), env);
    let url = p.wait_for("router listening on", START);
    (p, url)
}

/// `duet up` on ephemeral ports plus `extra`; a 64 MiB KV pool unless `extra` sets one
/// (the flag may not be given twice).
fn up_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "up",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    if !extra.contains(&"--kv-pool") {
        args.extend_from_slice(&["--kv-pool", "64MiB"]);
    }
    args.extend_from_slice(extra);
    args
}

/// What one streamed completion produced.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    pub ids: Vec<u32>,
    pub text: String,
    pub fin: Option<pb::FinalMessage>,
}

impl Completion {
    pub fn timings(&self) -> pb::Timings {
        self.fin.clone().and_then(|f| f.timings).unwrap_or_default()
    }
}

pub fn greedy(prompt: pb::generate_request::Prompt, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(prompt),
        max_tokens,
        ..Default::default()
    }
}

pub fn text(t: &str) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Text(t.to_string())
}

pub fn tokens(ids: &[u32]) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Tokens(pb::TokenIds { ids: ids.to_vec() })
}

/// A client of the public gRPC door.
pub type GenClient = GenerationClient<tonic::transport::Channel>;

pub async fn client(url: &str) -> GenClient {
    let end = Instant::now() + START;
    loop {
        match GenerationClient::connect(url.to_string()).await {
            Ok(c) => return c,
            Err(e) if Instant::now() > end => panic!("connect {url}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Streams one request to completion.
pub async fn generate(
    c: &mut GenerationClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
) -> Result<Completion, tonic::Status> {
    let mut s = c.generate(req).await?.into_inner();
    let mut out = Completion::default();
    while let Some(m) = s.message().await? {
        match m.event {
            Some(pb::generate_response::Event::Token(t)) => {
                out.ids.push(t.id);
                out.text.push_str(&t.text);
            }
            Some(pb::generate_response::Event::Final(f)) => {
                out.text.push_str(&f.text);
                out.fin = Some(f);
                return Ok(out);
            }
            None => {}
        }
    }
    Err(tonic::Status::internal(
        "stream ended without a final message",
    ))
}

/// `duet run --json` for a text prompt: the reference the cluster must equal.
pub fn run_reference(prompt: &str, chat: bool, max_tokens: u32) -> Vec<u32> {
    run_reference_on("native", prompt, chat, max_tokens)
}

/// [`run_reference`] on the engine named (`native` or `candle`, on the CPU device).
pub fn run_reference_on(engine: &str, prompt: &str, chat: bool, max_tokens: u32) -> Vec<u32> {
    let max = max_tokens.to_string();
    let mut args = vec!["--prompt", prompt, "--max-tokens", &max];
    if chat {
        args.push("--chat");
    }
    ids_of(&run_json(engine, &args), "ids")
}

/// `duet run --json ARGS` on the engine named: its JSON object.
pub fn run_json(engine: &str, args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["run", "--json"])
        .args(args)
        .env("DUET_MODEL", model())
        .env("DUET_ENGINE", engine)
        .output()
        .expect("duet run");
    assert!(
        o.status.success(),
        "duet run: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("json")
}

/// The token ids under `key` of a `duet run --json` object.
pub fn ids_of(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .expect(key)
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Worker status over its internal gRPC service.
pub async fn decode_status(addr: &str) -> pb::WorkerStatus {
    let mut c = duet_proto::v1::decode_client::DecodeClient::connect(addr.to_string())
        .await
        .expect("connect decode");
    c.status(internal(pb::StatusRequest {}))
        .await
        .expect("status")
        .into_inner()
}

pub async fn prefill_status(addr: &str) -> pb::WorkerStatus {
    let mut c = duet_proto::v1::prefill_client::PrefillClient::connect(addr.to_string())
        .await
        .expect("connect prefill");
    c.status(internal(pb::StatusRequest {}))
        .await
        .expect("status")
        .into_inner()
}

/// Waits until the decode worker at `addr` holds nothing.
pub async fn assert_pool_empty(addr: &str, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let s = decode_status(addr).await;
        if s.kv_blocks_free == s.kv_blocks_total
            && s.running == 0
            && s.waiting == 0
            && s.reservations == 0
        {
            return;
        }
        if Instant::now() > end {
            panic!("decode worker {addr} still holds KV after {within:?}: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Each of `prompts`, greedy, through the router at `url`: asserts the tokens equal
/// `reference` (`duet run`'s), that the prompt was prefilled remotely and that its KV took
/// measurable transfer time; the final timings of each, for the caller's own checks.
pub async fn remote_greedy(
    url: &str,
    prompts: &[&str],
    reference: &[Vec<u32>],
) -> Vec<pb::Timings> {
    let mut c = client(url).await;
    let mut out = Vec::new();
    for (p, want) in prompts.iter().zip(reference) {
        let r = generate(&mut c, greedy(text(p), want.len() as u32))
            .await
            .expect(p);
        assert_eq!(&r.ids, want, "{p}: tokens differ from duet run");
        let t = r.timings();
        assert_eq!(
            pb::PrefillPlacement::try_from(t.placement),
            Ok(pb::PrefillPlacement::Remote),
            "{p}: prefilled remotely"
        );
        assert!(t.kv_transfer_seconds > 0.0, "{p}: {t:?}");
        out.push(t);
    }
    out
}

/// KV transfers one worker counted (its /metrics at `metrics_url`) in `direction` (`sent`,
/// `received`) over `transport` (`tcp`, `shm`, `rdma`, ...).
pub fn kv_transfers(metrics_url: &str, direction: &str, transport: &str) -> f64 {
    let (_, m) = http_get(metrics_url);
    scrape_sum(
        &m,
        "duet_kv_transfer_transfers_total",
        &[
            &format!("direction=\"{direction}\""),
            &format!("transport=\"{transport}\""),
        ],
    )
}

/// Sum of the samples of `name` whose labels contain every `label="value"` in `labels`,
/// from a Prometheus text exposition.
pub fn scrape_sum(exposition: &str, name: &str, labels: &[&str]) -> f64 {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, lbls) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            (metric == name && labels.iter().all(|want| lbls.contains(want)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// Waits until every prefill worker's record in the router's view has no queued prompt
/// tokens (records are published about twice a second, so they lag the workers).
pub async fn router_sees_prefill_idle(url: &str, within: Duration) {
    let mut c = pb::cluster_client::ClusterClient::connect(url.to_string())
        .await
        .expect("connect");
    let end = Instant::now() + within;
    loop {
        let r = c
            .list_workers(pb::ListWorkersRequest {})
            .await
            .expect("ListWorkers")
            .into_inner();
        let busy: Vec<String> = r
            .records_json
            .iter()
            .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
            .filter(|v| v["role"] == "prefill")
            .filter(|v| v["capacity"]["queued_prefill_tokens"].as_u64() != Some(0))
            .map(|v| v.to_string())
            .collect();
        if busy.is_empty() {
            return;
        }
        assert!(Instant::now() < end, "prefill records still busy: {busy:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
