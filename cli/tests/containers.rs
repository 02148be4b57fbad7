//! The compose cluster of `deploy/compose/` as separate hosts: etcd, a router, 2 prefill and
//! 2 decode workers and Prometheus, each a container with its own address on a private
//! network, KV over tcp between containers, the KV secret from a file, every flag at its
//! default (`--kv-timeout` 10 s, `--drain` 10 s). Built here from nothing pulled: the base
//! image from Debian's packages (debootstrap), the duet image holding this test build's binary
//! (`DUET_BINARY`: a release compile would add minutes to CI; the image's build steps are the
//! ones `make image` runs), etcd and Prometheus from Debian's packages on the same base.
//!
//! One cluster, faults one after another, each printing sent / completed / failed; a request
//! completes only with `duet run`'s tokens. Afterwards every worker's KV blocks are free as
//! its own `/metrics` says (scraped by the cluster's Prometheus), and every query of the
//! Grafana dashboard and every rule returns series from this cluster.
//!
//! Needs a Docker engine with Compose and root (debootstrap): every machine of this project
//! has them; without them the test fails, it never skips.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

#[path = "containers/compose.rs"]
mod compose;
#[path = "containers/load.rs"]
mod load;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use compose::{docker, Compose, NAMESPACE, PROJECT, WORKERS};
use duet_proto::v1 as pb;
use load::{Case, Load, Tally};
use support::{generate, greedy, text};

type Client = pb::generation_client::GenerationClient<tonic::transport::Channel>;

/// `--kv-timeout`'s default: every pause below lasts longer.
const KV_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn a_compose_cluster_of_separate_hosts_serves_and_survives_killed_frozen_cut_and_restarted_containers(
) {
    let prompt = printing_press();
    // `duet run`'s references, computed while the cluster starts.
    let references = std::thread::spawn(References::compute);
    let c = Compose::up();
    compose::assert_containers_as_declared();
    assert_eq!(c.status().len(), 4, "4 workers registered");
    let r = references.join().expect("references");

    let rt = support::runtime();
    rt.block_on(async {
        let mut client = support::client(&c.grpc).await;
        // A remote prefill crosses containers (prefill worker -> decode worker over tcp, KV
        // authenticated with the secret file) and gives `duet run`'s tokens.
        let got = generate(&mut client, greedy(text(&prompt), 16))
            .await
            .unwrap();
        assert_eq!(got.ids, r.printing_press, "{:?}", got.text);
        let t = got.timings();
        assert_eq!(
            pb::PrefillPlacement::try_from(t.placement),
            Ok(pb::PrefillPlacement::Remote)
        );
        assert!(t.kv_bytes > 0, "KV crossed containers: {t:?}");

        decode_killed_mid_stream(&c, &mut client).await;
        prefill_killed_mid_transfer(&c, &r.transfer).await;
        prefill_paused(&c, &mut client, &r.frozen).await;
        decode_paused(&c, &mut client, &r.frozen_decode).await;
        prefill_cut_off(&c, &mut client, &r.cut).await;
        rolling_restart_under_load(&c, r.load.clone()).await;

        // etcd restarted: the four workers are in the router's view again and requests are
        // served.
        docker(&["restart", &Compose::container("etcd")]);
        c.wait_registered("decode-0", Duration::from_secs(60));
        let got = generate(&mut client, greedy(text(&prompt), 16)).await;
        let ok = matches!(&got, Ok(g) if g.ids == r.printing_press);
        Tally::of(ok).print("docker restart etcd");
        assert!(ok, "served after etcd restarted: {:?}", got.map(|g| g.ids));
    });
    every_block_free_on_every_worker(&c);
    dashboard_and_rules_return_series(&c);
}

/// Every reference the scenarios compare with.
struct References {
    printing_press: Vec<u32>,
    transfer: Case,
    frozen: Vec<Case>,
    frozen_decode: Vec<Case>,
    cut: Vec<Case>,
    load: Arc<Vec<Case>>,
}

impl References {
    fn compute() -> References {
        let case = |p: String| {
            let want = support::run_reference(&p, false, load::TOKENS);
            (p, want)
        };
        References {
            printing_press: support::run_reference(&printing_press(), false, 16),
            // Long enough (about 1,400 tokens) for its prefill, and so its layer-by-layer
            // transfer, to last seconds in a container.
            transfer: case(long_prompt("the printing press", 14)),
            frozen: (0..3).map(|i| case(long_prompt(TOPICS[i], 4))).collect(),
            frozen_decode: (0..3)
                .map(|i| case(format!("Again. {}", long_prompt(TOPICS[i], 3))))
                .collect(),
            cut: (0..3)
                .map(|i| case(format!("Once more. {}", long_prompt(TOPICS[i], 4))))
                .collect(),
            // Each starts differently: none is helped by another's cached prefix, so the first
            // round is prefilled remotely.
            load: Arc::new(
                (0..24)
                    .map(|i| {
                        case(format!(
                            "Question {i}. {}",
                            long_prompt(TOPICS[i % TOPICS.len()], 1)
                        ))
                    })
                    .collect(),
            ),
        }
    }
}

/// The prompt checked first and after etcd restarts (16 tokens), prefilled remotely.
fn printing_press() -> String {
    "Summarize the history of the printing press in Europe, from Gutenberg onwards, covering \
     literacy and the Reformation. "
        .repeat(6)
}

const TOPICS: [&str; 4] = [
    "the printing press",
    "the steam engine",
    "the telegraph",
    "the electric light",
];

/// A prompt about `topic`, `repeat` sentences long (each about 30 tokens).
fn long_prompt(topic: &str, repeat: usize) -> String {
    format!(
        "{topic}: explain who built it, when and where, and how it changed the lives of ordinary \
         people in the following century. "
    )
    .repeat(repeat)
}

/// Sends each case for 8 greedy tokens, one after another; prints and returns the tally.
async fn scenario(client: &mut Client, name: &str, cases: &[Case]) -> Tally {
    let mut t = Tally::default();
    for (i, case) in cases.iter().enumerate() {
        t.count(load::send(client, case, name, i).await);
    }
    t.print(name);
    t
}

/// A long greedy stream; once 8 tokens have arrived, `fault` is applied to the decode
/// container running it (its worker id given). Returns (the stream's tokens, the worker that
/// finished it, the worker faulted), after checking the tokens against an undisturbed run.
async fn stream_with_decode_fault(
    c: &Compose,
    client: &mut Client,
    fault: impl FnOnce(&str),
) -> (String, String) {
    let req = || pb::GenerateRequest {
        ignore_eos: true,
        ..greedy(text("Write a short story about a lighthouse keeper."), 160)
    };
    let reference = generate(client, req()).await.unwrap();
    let mut s = client.generate(req()).await.unwrap().into_inner();
    let (mut ids, mut fin, mut faulted) = (Vec::new(), None, None);
    let mut fault = Some(fault);
    while let Some(m) = s.message().await.expect("the client sees no error") {
        match m.event {
            Some(pb::generate_response::Event::Token(t)) => {
                ids.push(t.id);
                if ids.len() == 8 {
                    let who = c.busy("decode", Duration::from_secs(10));
                    if let Some(f) = fault.take() {
                        f(&who);
                    }
                    faulted = Some(who);
                }
            }
            Some(pb::generate_response::Event::Final(f)) => fin = Some(f),
            None => {}
        }
    }
    assert_eq!(ids, reference.ids, "no repeated or missing token");
    let faulted = faulted.expect("a decode container was faulted");
    let survivor = fin
        .expect("final message")
        .timings
        .expect("timings")
        .decode_worker;
    assert!(
        survivor.starts_with("decode-") && survivor != faulted,
        "{survivor} vs {faulted}"
    );
    (survivor, faulted)
}

/// `docker kill` (SIGKILL) of the decode container streaming a request: the stream continues
/// on the other one with the undisturbed tokens. The container is started again.
async fn decode_killed_mid_stream(c: &Compose, client: &mut Client) {
    let (_, killed) = stream_with_decode_fault(c, client, |who| {
        docker(&["kill", &Compose::container(who)]);
    })
    .await;
    Tally::of(true).print("docker kill decode mid-stream");
    c.start_again(&killed);
}

/// `docker kill` of the prefill container while it computes (and so streams, layer by layer)
/// a long prompt's KV: the request completes elsewhere with `duet run`'s tokens.
async fn prefill_killed_mid_transfer(c: &Compose, (prompt, want): &Case) {
    let mut client = support::client(&c.grpc).await;
    let req = greedy(text(prompt), load::TOKENS);
    let call = tokio::spawn(async move { generate(&mut client, req).await });
    let killed = c.busy("prefill", Duration::from_secs(30));
    docker(&["kill", &Compose::container(&killed)]);
    let got = call.await.expect("request task");
    let ok = matches!(&got, Ok(g) if g.ids == *want);
    Tally::of(ok).print("docker kill prefill mid-transfer");
    let got = got.expect("completed");
    assert_eq!(got.ids, *want);
    assert_ne!(got.timings().prefill_worker, killed, "prefilled elsewhere");
    c.start_again(&killed);
}

/// `docker pause` of a prefill container for longer than `--kv-timeout` under distinct long
/// prompts: all complete with `duet run`'s tokens (a request placed on the frozen worker is
/// given up after the KV wait and prefilled elsewhere).
async fn prefill_paused(c: &Compose, client: &mut Client, cases: &[Case]) {
    docker(&["pause", &Compose::container("prefill-0")]);
    let t0 = Instant::now();
    let t = scenario(client, "docker pause prefill-0", cases).await;
    unpause_past_kv_timeout("prefill-0", t0).await;
    assert_eq!(t.failed, 0);
    c.wait_registered("prefill-0", Duration::from_secs(60));
}

/// `docker pause` of the decode container streaming a request, for longer than
/// `--kv-timeout`: the router gives it up (its HTTP/2 keepalive fails) and the stream
/// finishes on the other decode worker with the undisturbed tokens; new long prompts sent
/// during the pause all complete with `duet run`'s tokens.
async fn decode_paused(c: &Compose, client: &mut Client, cases: &[Case]) {
    let (tx, rx) = tokio::sync::oneshot::channel::<Instant>();
    let mut other = support::client(&c.grpc).await;
    let cases = cases.to_vec();
    let during = tokio::spawn(async move {
        let t0 = rx.await.expect("paused");
        let t = scenario(
            &mut other,
            "new requests while a decode container is paused",
            &cases,
        )
        .await;
        (t0, t)
    });
    let (_, paused) = stream_with_decode_fault(c, client, |who| {
        docker(&["pause", &Compose::container(who)]);
        let _ = tx.send(Instant::now());
    })
    .await;
    let (t0, t) = during.await.expect("requests during the pause");
    unpause_past_kv_timeout(&paused, t0).await;
    Tally::of(true).print("docker pause decode mid-stream");
    assert_eq!(t.failed, 0);
    c.wait_registered(&paused, Duration::from_secs(60));
}

/// Unpauses `id`'s container, paused at `t0`, once the pause has outlasted `--kv-timeout`.
async fn unpause_past_kv_timeout(id: &str, t0: Instant) {
    let rest = (KV_TIMEOUT + Duration::from_secs(2)).saturating_sub(t0.elapsed());
    tokio::time::sleep(rest).await;
    docker(&["unpause", &Compose::container(id)]);
    eprintln!("{id} paused {:.1} s", t0.elapsed().as_secs_f64());
}

/// A prefill container cut off the back network (`docker network disconnect`): long prompts
/// all complete with `duet run`'s tokens. Connected again (same alias) afterwards.
async fn prefill_cut_off(c: &Compose, client: &mut Client, cases: &[Case]) {
    let back = format!("{PROJECT}_back");
    let p1 = Compose::container("prefill-1");
    docker(&["network", "disconnect", &back, &p1]);
    let t = scenario(client, "network disconnect prefill-1", cases).await;
    docker(&["network", "connect", "--alias", "prefill-1", &back, &p1]);
    assert_eq!(t.failed, 0);
    c.wait_registered("prefill-1", Duration::from_secs(60));
}

/// Every worker restarted one by one (`docker restart`: SIGTERM, the worker leaves the
/// registry and drains, then starts again and registers) under two clients sending requests
/// back to back: zero failed requests.
async fn rolling_restart_under_load(c: &Compose, cases: Arc<Vec<Case>>) {
    let load = Load::start(&c.grpc, cases, 2);
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in WORKERS {
        let t0 = Instant::now();
        docker(&["restart", &Compose::container(id)]);
        c.wait_registered(id, Duration::from_secs(60));
        eprintln!(
            "rolling restart: {id} back in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let t = load.stop().await;
    t.print("rolling restart of every worker under load");
    assert!(t.sent >= 8, "load ran: {t:?}");
    assert_eq!(t.failed, 0, "{t:?}");
}

/// Every worker's KV blocks are free, as its own `/metrics` says, scraped by the cluster's
/// Prometheus: every target up, and blocks held by sequences or reservations 0 on each.
fn every_block_free_on_every_worker(c: &Compose) {
    let within = Duration::from_secs(30);
    let ns = format!(r#"namespace="{NAMESPACE}""#);
    c.wait_metric(&format!("count(up{{{ns}}} == 1)"), 5.0, within);
    for (role, n) in [("decode", 2.0), ("prefill", 2.0)] {
        c.wait_metric(
            &format!("count(duet_{role}_kv_blocks_capacity{{{ns}}} > 0)"),
            n,
            within,
        );
        // Fresh samples only: a series scraped in the last 5 s, each worker's 0.
        c.wait_metric(
            &format!(
                "count(duet_{role}_kv_blocks_used{{{ns}}} == 0 \
                 and (time() - timestamp(duet_{role}_kv_blocks_used{{{ns}}})) < 5)"
            ),
            n,
            within,
        );
    }
    eprintln!("every KV block free on every worker (their /metrics, through Prometheus)");
}

/// `deploy/tests/live_queries.py` against the cluster's Prometheus: every dashboard query and
/// every rule returns series from this cluster.
fn dashboard_and_rules_return_series(c: &Compose) {
    let o = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/tests/live_queries.py"
        ))
        .args(["--prometheus", &c.prometheus.url, "--namespace", NAMESPACE])
        .args(["--wait", "90"])
        .output()
        .expect("python3 deploy/tests/live_queries.py");
    let out = String::from_utf8_lossy(&o.stdout);
    eprintln!("{}", out.lines().last().unwrap_or_default());
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
