//! Faults with real processes: a prefill worker killed mid-prefill, a KV pool exhausted by
//! long requests, a thousand requests cancelled at random points. Each test checks what a
//! client sees (tokens, status codes) and what the workers are left holding (KV blocks,
//! sequences, the router's in-flight gauges).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

/// Either side of a KV transfer frozen mid-way.
#[path = "faults/frozen.rs"]
mod frozen;
/// Faults of the registry (etcd stopped, workers leaving the view) and live load.
#[path = "faults/registry.rs"]
mod registry;
/// Faults in the middle of a KV transfer.
#[path = "faults/transfer.rs"]
mod transfer;

#[path = "faults/migration.rs"]
mod migration;

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use rand::Rng;
use support::{client, generate, greedy, text, Cluster, Kv, Proc};
use tonic::Code;

fn rt() -> tokio::runtime::Runtime {
    support::runtime()
}

/// A prompt of roughly `words` tokens.
fn long_prompt(words: usize) -> String {
    long_prompt_from(0, words)
}

/// [`long_prompt`] starting `skip` words into the sentence: as long, but sharing no prefix
/// (no cached block) with it.
fn long_prompt_from(skip: usize, words: usize) -> String {
    let text = "the river runs past the old mill and the children watch the boats ";
    text.split(' ')
        .filter(|w| !w.is_empty())
        .cycle()
        .skip(skip)
        .take(words)
        .collect::<Vec<_>>()
        .join(" ")
}

fn usage_cached(c: &support::Completion) -> u32 {
    c.fin
        .as_ref()
        .and_then(|f| f.usage)
        .map_or(0, |u| u.cached_tokens)
}

/// The router's `/metrics` exposition.
fn scrape(http: &str) -> String {
    let (status, body) = support::http_get(&format!("{http}/metrics"));
    assert_eq!(status, 200);
    body
}

/// A cluster (real etcd, separate processes, KV over shared memory as by default) whose
/// router also serves HTTP, for `/metrics`: the cluster and that HTTP URL.
fn cluster_with_metrics(prefill: usize, decode: usize, router_args: &[&str]) -> (Cluster, String) {
    cluster_over(Kv::Shm, prefill, decode, router_args)
}

/// [`cluster_with_metrics`] with its workers moving KV over `kv`.
fn cluster_over(kv: Kv, prefill: usize, decode: usize, router_args: &[&str]) -> (Cluster, String) {
    let mut args = vec!["--http-listen", "127.0.0.1:0"];
    args.extend_from_slice(router_args);
    let env = kv.env();
    let cl = Cluster::start_logged(prefill, decode, &args, &env);
    let http = cl.router.wait_for("http listening on", support::START);
    (cl, http)
}

/// KV transfers prefill worker `p` sent over `kv` so far (its own `/metrics`): proves the
/// path a fault test disturbed is the one it names.
fn sent_over(p: &Proc, kv: Kv) -> f64 {
    support::kv_transfers(&p.metrics_url(), "sent", kv.transport())
}

/// [`scrape`] off the async runtime's threads.
async fn scrape_async(http: &str) -> String {
    let http = http.to_string();
    tokio::task::spawn_blocking(move || scrape(&http))
        .await
        .expect("join")
}

/// Streams `req` and, after `after` tokens, calls `disturb` with the index of the decode
/// worker running it (the one with a running sequence). Panics on any error the client
/// sees. Returns what the client got and that index.
async fn stream_disturbing_decode(
    c: &mut pb::generation_client::GenerationClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
    decode_addrs: &[String],
    after: usize,
    mut disturb: impl FnMut(usize),
) -> (support::Completion, usize) {
    let mut s = c.generate(req).await.expect("stream").into_inner();
    let mut got = support::Completion::default();
    let mut disturbed = None;
    while let Some(m) = s.message().await.unwrap_or_else(|e| {
        panic!(
            "the client must see no error: {e:?} after {} tokens",
            got.ids.len()
        )
    }) {
        match m.event {
            Some(pb::generate_response::Event::Token(t)) => {
                got.ids.push(t.id);
                got.text.push_str(&t.text);
                if got.ids.len() == after {
                    for (i, a) in decode_addrs.iter().enumerate() {
                        if support::decode_status(a).await.running > 0 {
                            disturbed = Some(i);
                        }
                    }
                    disturb(disturbed.expect("a decode worker runs the request"));
                }
            }
            Some(pb::generate_response::Event::Final(f)) => {
                // As a client reads it: the final message's text follows the tokens'.
                got.text.push_str(&f.text);
                got.fin = Some(f);
            }
            None => {}
        }
    }
    (got, disturbed.expect("disturbed a worker"))
}

/// Index of the first of `addrs` whose status `busy` says holds the request, polled every
/// millisecond for at most 20 s.
async fn holder<F, Fut>(addrs: &[String], busy: F) -> usize
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        for (i, a) in addrs.iter().enumerate() {
            if busy(a.clone()).await {
                return i;
            }
        }
        assert!(Instant::now() < end, "no worker took the request");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Waits until the prefill worker at `addr` holds no scratch KV and runs nothing.
async fn prefill_idle(addr: &str, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let s = support::prefill_status(addr).await;
        // Cached prompt blocks count as free (evictable).
        if s.kv_blocks_free == s.kv_blocks_total && s.running == 0 && s.waiting == 0 {
            return;
        }
        assert!(Instant::now() < end, "{addr} still holds KV: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the router's in-flight and queued gauges are both zero.
async fn router_idle(http: &str, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let m = scrape_async(http).await;
        let in_flight = support::scrape_sum(&m, "duet_router_requests_in_flight", &[]);
        let queued = support::scrape_sum(&m, "duet_router_requests_queued", &[]);
        if in_flight == 0.0 && queued == 0.0 {
            return;
        }
        assert!(
            Instant::now() < end,
            "router still has {in_flight} in flight and {queued} queued after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fault 2: the prefill worker computing a request is killed (SIGKILL) mid-prefill. The
/// request is retried on the other prefill worker and completes with duet run's greedy tokens;
/// the decode worker's reservation for the failed attempt is released. Over shared memory
/// (the default: the killed worker's layers were in its send arena, which the decode worker
/// had mapped) and over tcp.
#[test]
fn prefill_worker_killed_mid_prefill_request_completes_elsewhere() {
    prefill_worker_killed_mid_prefill(Kv::Shm);
}

#[test]
fn prefill_worker_killed_mid_prefill_over_tcp_request_completes_elsewhere() {
    prefill_worker_killed_mid_prefill(Kv::Tcp);
}

fn prefill_worker_killed_mid_prefill(kv: Kv) {
    let (mut cl, http) = cluster_over(kv, 2, 1, &["--local-prefill-max-tokens", "0"]);
    let decode_addr = cl.decode[0].workers_addr();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(2, 1, Duration::from_secs(20)).await;
        let prompt = long_prompt(700);
        let mut c = client(&cl.url).await;
        // The prefill time of a prompt as long, but another one: the measured prompt must
        // reach the prefill worker uncached, or its prefill would be over before the kill.
        let timing = generate(&mut c, greedy(text(&long_prompt_from(5, 700)), 8))
            .await
            .expect("undisturbed run");
        let prefill_time = timing.timings().prefill_seconds;
        eprintln!(
            "undisturbed: prefill {prefill_time:.3} s on {}",
            timing.timings().prefill_worker
        );
        // Once the router's view shows both prefill workers idle it picks by id: prefill-0.
        // The request's prefill is under way once the decode worker holds its reservation.
        let victim = 0;
        support::router_sees_prefill_idle(&cl.url, Duration::from_secs(10)).await;
        let mut c2 = c.clone();
        let req = greedy(text(&prompt), 8);
        let task = tokio::spawn(async move { generate(&mut c2, req).await });
        let end = Instant::now() + Duration::from_secs(20);
        while support::decode_status(&decode_addr).await.reservations == 0 {
            assert!(Instant::now() < end, "the request never reserved KV");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // A third of the way into the prefill.
        tokio::time::sleep(Duration::from_secs_f64(prefill_time / 3.0)).await;
        cl.prefill[victim].kill9();
        let done = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("the request ends")
            .expect("join")
            .expect("the request survives the prefill worker's death");
        assert_eq!(
            done.ids,
            support::run_reference(&prompt, false, 8),
            "same greedy tokens as duet run"
        );
        assert_eq!(usage_cached(&done), 0, "the retry found nothing cached");
        assert_eq!(
            done.timings().prefill_worker,
            format!("prefill-{}", 1 - victim),
            "completed on the surviving prefill worker"
        );
        assert!(
            sent_over(&cl.prefill[1 - victim], kv) >= 1.0,
            "the KV went over {kv:?}"
        );
        support::assert_pool_empty(&decode_addr, Duration::from_secs(10)).await;
        let m = scrape_async(&http).await;
        assert!(
            support::scrape_sum(&m, "duet_router_retries_total", &[]) >= 1.0,
            "the retry is counted"
        );
        router_idle(&http, Duration::from_secs(10)).await;
    });
}

/// Fault 6: long requests fill the decode worker's KV pool. Further requests wait in the
/// router's queue; past the queue bound they get RESOURCE_EXHAUSTED at once; the queued ones
/// complete when room frees up, and afterwards every block is free.
#[test]
fn kv_pool_exhausted_requests_queue_then_resource_exhausted() {
    // 4 MiB of f16 KV is 11 blocks of 16 tokens (176 tokens): one 120-token prompt with its
    // generation leaves no room for a second.
    let (p, url) = support::up(&[
        "--kv-pool",
        "4MiB",
        "--max-queued",
        "2",
        "--max-queue-wait",
        "120s",
    ]);
    let http = p.wait_for("http listening on", support::START);
    let decode_addr = p.workers("decode")[0].clone();
    let rt = rt();
    rt.block_on(async {
        let prompt = long_prompt(110);
        let long = || pb::GenerateRequest {
            ignore_eos: true,
            ..greedy(text(&prompt), 40)
        };
        let mut c = client(&url).await;
        // A takes the pool: in flight once its first token arrived.
        let mut a = c.generate(long()).await.expect("A").into_inner();
        a.message()
            .await
            .expect("A's first token")
            .expect("a message");
        let s = support::decode_status(&decode_addr).await;
        assert!(
            s.kv_blocks_free * 16 < 110 + 1,
            "A should leave no room for another prompt: {s:?}"
        );
        // B and C wait in the queue (its bound is 2).
        let mut queued = Vec::new();
        for _ in 0..2 {
            let mut c = c.clone();
            let r = long();
            queued.push(tokio::spawn(async move { generate(&mut c, r).await }));
        }
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let m = scrape_async(&http).await;
            if support::scrape_sum(&m, "duet_router_requests_queued", &[]) >= 2.0 {
                break;
            }
            assert!(Instant::now() < end, "B and C never queued");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // D finds the queue full: refused at once, with a retry hint.
        let t0 = Instant::now();
        let d = generate(&mut c, greedy(text("Hello"), 2))
            .await
            .expect_err("the queue is full");
        assert_eq!(d.code(), Code::ResourceExhausted, "{d:?}");
        assert!(d.metadata().get("retry-after-ms").is_some(), "{d:?}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        // A finishes; B and C follow, each with all its tokens.
        while a.message().await.expect("A streams").is_some() {}
        for q in queued {
            let done = q.await.expect("join").expect("a queued request completes");
            assert_eq!(done.ids.len(), 40);
        }
        support::assert_pool_empty(&decode_addr, Duration::from_secs(10)).await;
        router_idle(&http, Duration::from_secs(10)).await;
    });
}

/// Fault 7: 1000 requests (short prompts prefilled on the decode worker, longer ones on the
/// prefill worker) cancelled at random points: before placement, during prefill, mid-stream.
/// Afterwards every block on every worker is free and nothing is left running or queued.
#[test]
fn thousand_random_cancellations_leave_every_block_free() {
    let (cl, http) = cluster_with_metrics(
        1,
        1,
        &[
            "--local-prefill-max-tokens",
            "24",
            "--max-queue-wait",
            "300s",
        ],
    );
    let decode_addr = cl.decode[0].workers_addr();
    let prefill_addr = cl.prefill[0].workers_addr();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        let c = client(&cl.url).await;
        let gate = Arc::new(tokio::sync::Semaphore::new(16));
        let prompts: Arc<Vec<String>> =
            Arc::new([4, 12, 40, 90].iter().map(|&n| long_prompt(n)).collect());
        let started = Instant::now();
        let mut tasks = Vec::new();
        let mut completed_tokens = 0usize;
        for i in 0..1000u32 {
            let permit = gate.clone().acquire_owned().await.expect("semaphore");
            let mut c = c.clone();
            let prompts = prompts.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = permit;
                let (prompt, after_ms, after_tokens) = {
                    let mut r = rand::rng();
                    (
                        prompts[r.random_range(0..prompts.len())].clone(),
                        r.random_range(0..250u64),
                        r.random_range(0..8usize),
                    )
                };
                let req = pb::GenerateRequest {
                    ignore_eos: true,
                    ..greedy(text(&prompt), 24)
                };
                // Half are cut after a random time (maybe before they were even placed),
                // half after a random number of tokens.
                let run = async {
                    let mut s = c.generate(req).await?.into_inner();
                    let mut n = 0;
                    while let Some(m) = s.message().await? {
                        if matches!(m.event, Some(pb::generate_response::Event::Token(_))) {
                            n += 1;
                            if i % 2 == 1 && n >= after_tokens {
                                return Ok::<usize, tonic::Status>(n);
                            }
                        }
                    }
                    Ok(n)
                };
                if i % 2 == 0 {
                    tokio::time::timeout(Duration::from_millis(after_ms), run)
                        .await
                        .unwrap_or(Ok(0))
                } else {
                    run.await
                }
            }));
        }
        for t in tasks {
            match t.await.expect("join") {
                Ok(n) => completed_tokens += n,
                Err(s) => panic!("a request failed instead of being cancelled: {s:?}"),
            }
        }
        eprintln!(
            "1000 cancelled requests in {:?} ({completed_tokens} tokens streamed before the cuts)",
            started.elapsed()
        );
        assert!(
            completed_tokens > 0,
            "some requests streamed before their cut"
        );
        support::assert_pool_empty(&decode_addr, Duration::from_secs(30)).await;
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let s = support::prefill_status(&prefill_addr).await;
            if s.running == 0 && s.waiting == 0 && s.queued_prefill_tokens == 0 {
                assert_eq!(s.kv_blocks_free, s.kv_blocks_total, "prefill KV: {s:?}");
                break;
            }
            assert!(Instant::now() < end, "prefill worker still busy: {s:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        router_idle(&http, Duration::from_secs(30)).await;
        let m = scrape_async(&http).await;
        let cancelled =
            support::scrape_sum(&m, "duet_router_requests_total", &["outcome=\"cancelled\""]);
        assert!(cancelled >= 400.0, "cancellations counted: {cancelled}");
    });
}

/// Fault 1: the decode worker streaming a request is killed (SIGKILL) mid-stream. The router
/// prefills the prompt plus the tokens already sent on the other decode worker and continues
/// the same stream: no error, no repeated or missing token, the greedy text of an
/// undisturbed run. Over shared memory (the default) and over tcp.
/// Fault 5: hung workers (SIGSTOP). A prefill worker that stops answering is given up after
/// `--prefill-timeout` and the request completes on the other one; a decode worker that
/// stops mid-stream is given up after `--stream-stall-timeout` and the stream migrates,
/// unchanged. Nothing waits for the hung processes' leases to expire. Over shared memory
/// (the default) and over tcp.
#[test]
fn hung_workers_are_given_up_and_requests_complete_elsewhere() {
    hung_workers(Kv::Shm);
}

#[test]
fn hung_workers_over_tcp_are_given_up_and_requests_complete_elsewhere() {
    hung_workers(Kv::Tcp);
}

fn hung_workers(kv: Kv) {
    let (cl, http) = cluster_over(
        kv,
        2,
        2,
        &[
            "--local-prefill-max-tokens",
            "0",
            "--prefill-timeout",
            "3s",
            "--stream-stall-timeout",
            "2s",
        ],
    );
    let decode_addrs: Vec<String> = cl.decode.iter().map(Proc::workers_addr).collect();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(2, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        let req = || pb::GenerateRequest {
            ignore_eos: true,
            ..greedy(text("Write a short story about a lighthouse keeper."), 32)
        };
        let reference = generate(&mut c, req()).await.expect("undisturbed run");

        // Prefill: once both look idle the router picks prefill-0 by id; it is stopped.
        support::router_sees_prefill_idle(&cl.url, Duration::from_secs(10)).await;
        cl.prefill[0].signal("-STOP");
        let t0 = Instant::now();
        let done = generate(&mut c, req())
            .await
            .expect("completes on the other prefill worker");
        assert_eq!(done.ids, reference.ids);
        assert_eq!(done.timings().prefill_worker, "prefill-1");
        eprintln!("hung prefill worker: completed in {:?}", t0.elapsed());
        assert!(
            t0.elapsed() >= Duration::from_secs(3),
            "the request went to the stopped worker first and waited out --prefill-timeout"
        );

        // Decode: stop the worker streaming a request after 8 tokens.
        let (got, stopped) = stream_disturbing_decode(&mut c, req(), &decode_addrs, 8, |i| {
            cl.decode[i].signal("-STOP")
        })
        .await;
        assert_eq!(got.ids, reference.ids, "the migrated stream is unchanged");
        assert_eq!(got.text, reference.text, "the same text, nothing repeated");
        assert_eq!(
            got.fin.and_then(|f| f.timings).map(|t| t.decode_worker),
            Some(format!("decode-{}", 1 - stopped))
        );
        let m = scrape_async(&http).await;
        assert_eq!(
            support::scrape_sum(&m, "duet_router_migrations_total", &[]),
            1.0
        );
        router_idle(&http, Duration::from_secs(10)).await;
        support::assert_pool_empty(&decode_addrs[1 - stopped], Duration::from_secs(10)).await;
        assert!(
            sent_over(&cl.prefill[1], kv) >= 1.0,
            "the KV went over {kv:?}"
        );
        cl.prefill[0].signal("-CONT");
        cl.decode[stopped].signal("-CONT");
    });
}
