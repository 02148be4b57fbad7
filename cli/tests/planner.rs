//! Live role switching with real processes on a real etcd: three `duet worker`s (one
//! prefill, two decode), a router and `duet planner` with this machine's measured profile
//! (`tests/data/profile-smollm2-q4_1-1thread.json`, one engine thread per worker, as the
//! workers here run).
//!
//! A burst of long prompts must move a decode worker to prefill, then long answers must
//! move it back, under load, with every flag at its default but the planner's pace (1 s
//! evaluations, 12 s window, 5 s dwell) and the engine threads. What a user would observe
//! is asserted: no request fails, every completion equals `duet run`'s greedy tokens, the
//! planner asked for both switches and the workers made them, and no worker holds a KV
//! block afterwards.
//!
//! A second test asks for switches by hand in the middle of a stream, as the planner
//! would: the stream finishes during the drain, or is cut and migrates, with the same tokens.
//!
//! The planner models each worker as its own machine (`--workers-per-host 1`, its default),
//! as in a real cluster; on this 2-core machine the three workers share the cores, so the
//! switches are judged, not paid off here (docs/plan.md).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_discovery::control::{self, RoleRequest};
use duet_discovery::{EtcdOptions, EtcdRegistry, Role};
use duet_proto::v1 as pb;
use support::{client, generate, greedy, run_reference, scrape_sum, text, Proc, START, TTL};

const CLUSTER: &str = "planner";

/// The two tests run one after the other: each starts four processes on two cores, and a
/// stream that must outlast (or fit in) a drain should not depend on what the other test
/// is computing.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn profile() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/profile-smollm2-q4_1-1thread.json"
    )
    .to_string()
}

/// `n` prompts of about 500 tokens, cut from the bench corpus.
fn long_prompts(n: usize) -> Vec<String> {
    let corpus = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/data/persuasion-vol1.txt"
    ))
    .expect("bench corpus");
    (0..n)
        .map(|i| corpus.chars().skip(5_000 + i * 3_000).take(2_000).collect())
        .collect()
}

const SHORT: [&str; 3] = [
    "Why is the sky blue?",
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
];

fn chat(t: &str) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Chat(pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: t.into(),
        }],
    })
}

fn worker(etcd: &str, id: &str, role: &str) -> Proc {
    worker_with(etcd, id, role, &[])
}

fn worker_with(etcd: &str, id: &str, role: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "worker",
        "--role",
        role,
        "--etcd",
        etcd,
        "--cluster",
        CLUSTER,
        "--lease-ttl",
        TTL,
        "--id",
        id,
        // Room for the burst's backlog of reservations on one decode worker while the
        // prefill queue waits for the switch, on slower machines too: with 64 MiB (about
        // 2,900 tokens of SmolLM2) a 2.1 GHz Xeon running another test binary beside this
        // one filled it, and requests waited out the router's 30 s for room.
        "--kv-pool",
        "128MiB",
        "--threads",
        "1",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let p = Proc::start(id, &args);
    p.wait_for("serving gRPC on", START);
    p
}

/// (prefill, decode) workers the router sees.
async fn layout(url: &str) -> (u32, u32) {
    let mut c = client(url).await;
    let m = c
        .list_models(pb::ListModelsRequest {})
        .await
        .expect("list models")
        .into_inner();
    (m.models[0].prefill_workers, m.models[0].decode_workers)
}

async fn wait_layout(url: &str, want: (u32, u32), within: Duration, planner: &Proc) {
    let end = Instant::now() + within;
    loop {
        if layout(url).await == want {
            return;
        }
        if Instant::now() > end {
            panic!(
                "the router sees {:?}, want {want:?}; the planner said:\n{}",
                layout(url).await,
                planner.lines().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Tallies of a load phase.
#[derive(Default)]
struct Tally {
    sent: AtomicUsize,
    ok: AtomicUsize,
    failed: AtomicUsize,
}

/// Sends `prompts` in turn, one every `every`, until `stop`; each completion must equal its
/// reference.
async fn load(
    url: String,
    prompts: Vec<(pb::generate_request::Prompt, Vec<u32>)>,
    max_tokens: u32,
    every: Duration,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        let (prompt, want) = prompts[i % prompts.len()].clone();
        i += 1;
        let (url, tally) = (url.clone(), tally.clone());
        tally.sent.fetch_add(1, Ordering::SeqCst);
        tasks.spawn(async move {
            let mut c = client(&url).await;
            match generate(&mut c, greedy(prompt.clone(), max_tokens)).await {
                Ok(done) => {
                    assert_eq!(done.ids, want, "greedy tokens changed for {prompt:?}");
                    tally.ok.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => {
                    eprintln!("request failed: {e}");
                    tally.failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        tokio::time::sleep(every).await;
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("a request's task panicked (wrong tokens)");
    }
}

fn metric(url: &str, name: &str, labels: &[&str]) -> f64 {
    let (status, body) = support::http_get(url);
    assert_eq!(status, 200, "{url}");
    scrape_sum(&body, name, labels)
}

#[test]
fn a_burst_of_long_prompts_moves_a_decode_worker_to_prefill_and_long_answers_move_it_back() {
    let _serial = serial();
    // References first, before the cluster takes the cores.
    let long: Vec<_> = long_prompts(3)
        .into_iter()
        .map(|p| {
            let ids = run_reference(&p, false, 4);
            (text(&p), ids)
        })
        .collect();
    // Chat questions: their answers run the full 64 tokens.
    let short: Vec<_> = SHORT
        .iter()
        .map(|p| (chat(p), run_reference(p, true, 64)))
        .collect();

    let etcd = support::etcd::EtcdServer::start();
    let ep = etcd.endpoint();
    let workers = [
        worker(&ep, "w0", "prefill"),
        worker(&ep, "w1", "decode"),
        worker(&ep, "w2", "decode"),
    ];
    let router = Proc::start("router", &["router", "--etcd", &ep, "--cluster", CLUSTER]);
    let url = router.wait_for("router listening on", START);
    let profile = profile();
    let planner = Proc::start(
        "planner",
        &[
            "planner",
            "--etcd",
            &ep,
            "--cluster",
            CLUSTER,
            "--profile",
            &profile,
            "--slo",
            "ttft=8000,tpot=150",
            "--interval",
            "1s",
            "--window",
            "12s",
            "--dwell",
            "5s",
            "--min-requests",
            "3",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let planner_metrics = planner.metrics_url();
    let rt = support::runtime();
    rt.block_on(async {
        wait_layout(&url, (1, 2), START, &planner).await;

        // 1. About 500-token prompts every 2 s: one prefill worker (3.5 s each) falls behind.
        let tally = Arc::new(Tally::default());
        let stop = Arc::new(AtomicBool::new(false));
        let burst = tokio::spawn(load(
            url.clone(),
            long.clone(),
            4,
            Duration::from_secs(2),
            stop.clone(),
            tally.clone(),
        ));
        wait_layout(&url, (2, 1), Duration::from_secs(120), &planner).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.store(true, Ordering::SeqCst);
        burst.await.expect("the burst's requests");
        let burst_sent = tally.sent.load(Ordering::SeqCst);
        eprintln!(
            "burst: sent {burst_sent}, completed {}, failed {}",
            tally.ok.load(Ordering::SeqCst),
            tally.failed.load(Ordering::SeqCst)
        );

        // 2. Short chat questions with 64-token answers: decode is now the scarce role.
        let stop = Arc::new(AtomicBool::new(false));
        let answers = tokio::spawn(load(
            url.clone(),
            short.clone(),
            64,
            Duration::from_millis(1500),
            stop.clone(),
            tally.clone(),
        ));
        wait_layout(&url, (1, 2), Duration::from_secs(120), &planner).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.store(true, Ordering::SeqCst);
        answers.await.expect("the answers' requests");
        let (sent, ok, failed) = (
            tally.sent.load(Ordering::SeqCst),
            tally.ok.load(Ordering::SeqCst),
            tally.failed.load(Ordering::SeqCst),
        );
        eprintln!("in all: sent {sent}, completed {ok}, failed {failed}");
        assert_eq!(failed, 0, "requests failed across the switches");
        assert_eq!(ok, sent);
    });

    // The planner asked for exactly the two switches, and one worker made both.
    let asked = |from: &str, to: &str| {
        metric(
            &planner_metrics,
            "duet_planner_role_switches_total",
            &[&format!("from=\"{from}\""), &format!("to=\"{to}\"")],
        )
    };
    assert_eq!(asked("decode", "prefill"), 1.0);
    assert_eq!(asked("prefill", "decode"), 1.0);
    // The workers made them: one decode -> prefill, one prefill -> decode (the planner
    // moves the least loaded worker of the shrinking role, which need not be the same).
    let made = |from: &str, to: &str| -> f64 {
        workers
            .iter()
            .map(|w| {
                metric(
                    &w.metrics_url(),
                    "duet_worker_role_switches_total",
                    &[&format!("from=\"{from}\""), &format!("to=\"{to}\"")],
                )
            })
            .sum()
    };
    assert_eq!(made("decode", "prefill"), 1.0);
    assert_eq!(made("prefill", "decode"), 1.0);
    for l in planner.lines().iter().filter(|l| !l.ends_with(": keep")) {
        eprintln!("{l}");
    }

    // No KV block is held anywhere once the load is over.
    for w in &workers {
        let m = w.metrics_url();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let used = metric(&m, "duet_decode_kv_blocks_used", &[])
                + metric(&m, "duet_prefill_kv_blocks_used", &[]);
            if used == 0.0 {
                break;
            }
            assert!(Instant::now() < end, "{} holds {used} KV blocks", w.name);
            std::thread::sleep(Duration::from_millis(200));
        }
        let m = w.metrics_url();
        let secs = metric(&m, "duet_worker_role_switch_duration_seconds_sum", &[]);
        let n = metric(&m, "duet_worker_role_switch_duration_seconds_count", &[]);
        if n > 0.0 {
            eprintln!("{}: {n} switch(es), {:.2} s each", w.name, secs / n);
        }
    }
}

/// Asks worker `id` to serve `role`, as the planner does.
async fn ask(etcd: &str, id: &str, role: Role) {
    let reg = EtcdRegistry::connect(EtcdOptions::new([etcd]))
        .await
        .unwrap();
    control::request_role(&reg, CLUSTER, id, &RoleRequest::new(role, "test"))
        .await
        .unwrap();
}

/// A switch asked while a decode worker streams: with the default drain the stream ends
/// on that worker, with a drain shorter than the stream it is cut and the router resumes
/// it on the other decode worker by token replay. Either way the client gets `duet run`'s
/// tokens and nothing fails; the switched worker then serves its new role.
#[test]
fn a_switch_asked_mid_stream_lets_the_stream_finish_or_migrate_with_the_same_tokens() {
    let _serial = serial();
    let question = "Write a short story about a lighthouse keeper.";
    let want = run_reference(question, true, LONG_ANSWER);
    // The first stream must end inside d0's default 10 s drain: 48 tokens take about 3 s
    // even when the cores are shared (CI once streamed 174 of 200 tokens in the drain).
    let short_want = &want[..(SHORT_ANSWER as usize).min(want.len())];
    let etcd = support::etcd::EtcdServer::start();
    let ep = etcd.endpoint();
    // d0 drains for as long as it takes (the default 10 s); d1 only for a second. An idle
    // cluster places on the first record: d0.
    let _p0 = worker(&ep, "p0", "prefill");
    let d0 = worker(&ep, "d0", "decode");
    let d1 = worker_with(&ep, "d1", "decode", &["--drain", "1s"]);
    let router = Proc::start("router", &["router", "--etcd", &ep, "--cluster", CLUSTER]);
    let url = router.wait_for("router listening on", START);
    let http = router.wait_for("http listening on", START);
    let migrations = || {
        metric(
            &format!("{http}/metrics"),
            "duet_router_migrations_total",
            &[],
        )
    };
    let rt = support::runtime();
    rt.block_on(async {
        wait_layout(&url, (1, 2), START, &router).await;
        // 1. d0 is asked to prefill mid-stream: the stream finishes there (the drain
        //    outlasts it), then d0 serves prefill.
        let stream = tokio::spawn(stream_of(url.clone(), question, SHORT_ANSWER));
        wait_running(&d0.metrics_url(), "d0").await;
        ask(&ep, "d0", Role::Prefill).await;
        assert!(!stream.is_finished(), "the switch was asked mid-stream");
        let done = stream.await.unwrap().expect("the stream across the switch");
        assert_eq!(
            done.ids, short_want,
            "tokens of a stream that finished while its worker drained"
        );
        wait_layout(&url, (2, 1), Duration::from_secs(30), &router).await;
        assert_eq!(migrations(), 0.0, "the stream finished where it ran");

        // 2. d1 (1 s drain) is asked to prefill mid-stream while d0 comes back to decode:
        //    the stream is cut and resumed on d0 with the same tokens.
        let stream = tokio::spawn(stream_of(url.clone(), question, LONG_ANSWER));
        wait_running(&d1.metrics_url(), "d1").await;
        ask(&ep, "d0", Role::Decode).await;
        wait_layout(&url, (1, 2), Duration::from_secs(30), &router).await;
        assert!(!stream.is_finished(), "the switch is asked mid-stream");
        ask(&ep, "d1", Role::Prefill).await;
        let done = stream.await.unwrap().expect("the stream across the switch");
        assert_eq!(done.ids, want, "tokens of a stream resumed elsewhere");
        assert_eq!(migrations(), 1.0, "the cut stream moved once");
        wait_layout(&url, (2, 1), Duration::from_secs(30), &router).await;
        // Nothing is held: d1's decode pool is gone with its role, d0's drained.
        for (p, name) in [(&d0, "d0"), (&d1, "d1")] {
            let m = p.metrics_url();
            let used = metric(&m, "duet_decode_kv_blocks_used", &[])
                + metric(&m, "duet_prefill_kv_blocks_used", &[]);
            assert_eq!(used, 0.0, "{name} holds KV blocks");
        }
    });
}

/// Tokens of the stream that must finish inside the default drain.
const SHORT_ANSWER: u32 = 48;
/// Tokens of the stream that must outlast a 1 s drain and d0's return to decode.
const LONG_ANSWER: u32 = 200;

/// A greedy answer of `max_tokens` to `question`, streamed through the router at `url`.
async fn stream_of(
    url: String,
    question: &str,
    max_tokens: u32,
) -> Result<support::Completion, tonic::Status> {
    let mut c = client(&url).await;
    generate(&mut c, greedy(chat(question), max_tokens)).await
}

/// Waits until the decode worker behind `metrics` runs a sequence.
async fn wait_running(metrics: &str, name: &str) {
    let end = Instant::now() + Duration::from_secs(60);
    while metric(metrics, "duet_decode_running_sequences", &[]) < 1.0 {
        assert!(Instant::now() < end, "{name} never ran the stream");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
