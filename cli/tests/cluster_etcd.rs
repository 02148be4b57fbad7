//! A real cluster: etcd, a router, 2 prefill and 2 decode workers as separate processes of
//! one host, KV over their default transport (shared memory).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::collections::HashSet;
use std::time::Duration;

use rand::Rng;
use support::{
    assert_pool_empty, client, generate, greedy, http_get, prefill_status, scrape_sum, text,
    Cluster,
};

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "Photosynthesis is the process by which plants",
];

#[test]
fn concurrent_requests_use_every_worker_and_cancellations_free_every_block() {
    // Every prompt is prefilled remotely (no local prefill), so KV crosses tcp.
    let cl = Cluster::start(2, 2, &["--local-prefill-max-tokens", "0"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        cl.wait_workers(2, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        // Reference tokens: each prompt alone.
        let mut reference = Vec::new();
        for p in PROMPTS {
            let r = generate(&mut c, greedy(text(p), 8))
                .await
                .expect("reference");
            assert_eq!(r.ids.len(), 8);
            reference.push(r.ids);
        }
        // 32 concurrent streams.
        let mut tasks = Vec::new();
        for i in 0..32 {
            let mut c = c.clone();
            tasks.push(tokio::spawn(async move {
                let r = generate(&mut c, greedy(text(PROMPTS[i % PROMPTS.len()]), 8)).await;
                (i, r)
            }));
        }
        let mut prefill_seen = HashSet::new();
        let mut decode_seen = HashSet::new();
        for t in tasks {
            let (i, r) = t.await.unwrap();
            let r = r.unwrap_or_else(|e| panic!("request {i}: {e}"));
            let want = &reference[i % PROMPTS.len()];
            // Batching changes float summation order; the tokens must still agree while the
            // model is confident (the first four greedy steps of these prompts are).
            assert_eq!(
                r.ids[..4],
                want[..4],
                "request {i}: {:?} vs {:?}",
                r.ids,
                want
            );
            assert_eq!(r.ids.len(), 8);
            let t = r.timings();
            assert_eq!(t.placement, duet_proto::v1::PrefillPlacement::Remote as i32);
            prefill_seen.insert(t.prefill_worker);
            decode_seen.insert(t.decode_worker);
        }
        assert_eq!(
            prefill_seen.len(),
            2,
            "prefill workers used: {prefill_seen:?}"
        );
        assert_eq!(decode_seen.len(), 2, "decode workers used: {decode_seen:?}");

        // 100 requests cancelled at random points (queued, prefilling, transferring or
        // decoding): afterwards every block on every worker is free.
        let long = "Tell me a long story about a dragon who learns to cook. ".repeat(6);
        let mut tasks = Vec::new();
        for _ in 0..100 {
            let mut c = c.clone();
            let long = long.clone();
            let wait = Duration::from_millis(rand::rng().random_range(0..1500));
            tasks.push(tokio::spawn(async move {
                let _ = tokio::time::timeout(wait, generate(&mut c, greedy(text(&long), 64))).await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for d in &cl.decode {
            assert_pool_empty(&d.workers_addr(), Duration::from_secs(5)).await;
        }
        for p in &cl.prefill {
            let addr = p.workers_addr();
            let end = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                let s = prefill_status(&addr).await;
                if s.running == 0 && s.waiting == 0 && s.kv_blocks_free == s.kv_blocks_total {
                    break;
                }
                assert!(
                    std::time::Instant::now() < end,
                    "prefill {addr} still busy: {s:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // The cluster still serves.
        let r = generate(&mut c, greedy(text(PROMPTS[0]), 8))
            .await
            .expect("after cancellations");
        assert_eq!(r.ids, reference[0]);
    });
}

/// A client that gives up while its long prompt is being computed stops the prefill worker's
/// forward between layers (nobody waits for it any more): the prefill worker is idle with
/// every block free, counted the forward as stopped and none of its tokens as computed, and
/// serves the next request with the tokens it gave before.
#[test]
fn a_cancelled_prompt_stops_the_prefill_forward_it_is_in() {
    let cl = Cluster::start(1, 1, &["--local-prefill-max-tokens", "0"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        let before = generate(&mut c, greedy(text(PROMPTS[1]), 8))
            .await
            .expect("reference");
        let p = &cl.prefill[0];
        let (addr, metrics) = (p.workers_addr(), p.metrics_url());
        let computed = |m: &str| scrape_sum(m, "duet_prefill_prompt_tokens_total", &[]);
        let computed_before = computed(&http_get(&metrics).1);

        // About 1,600 tokens: one forward of a second or more on these machines.
        let long = "the river runs past the old mill and the children watch the boats ".repeat(120);
        let mut c2 = c.clone();
        let call = tokio::spawn(async move { generate(&mut c2, greedy(text(&long), 4)).await });
        let end = std::time::Instant::now() + Duration::from_secs(20);
        while prefill_status(&addr).await.running == 0 {
            assert!(std::time::Instant::now() < end, "the prompt never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        call.abort();

        let end = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let s = prefill_status(&addr).await;
            if s.running == 0 && s.waiting == 0 && s.kv_blocks_free == s.kv_blocks_total {
                break;
            }
            assert!(
                std::time::Instant::now() < end,
                "prefill {addr} still busy: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let m = http_get(&metrics).1;
        assert_eq!(
            scrape_sum(&m, "duet_prefill_forwards_stopped_total", &[]),
            1.0,
            "the cancelled prompt's forward was not stopped"
        );
        assert_eq!(
            computed(&m),
            computed_before,
            "the cancelled forward was counted as computed"
        );
        assert_pool_empty(&cl.decode[0].workers_addr(), Duration::from_secs(5)).await;

        let after = generate(&mut c, greedy(text(PROMPTS[1]), 8))
            .await
            .expect("after the stopped forward");
        assert_eq!(after.ids, before.ids);
    });
}
