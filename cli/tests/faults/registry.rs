//! Faults of the registry and what the router sees of it: etcd stopped under load, the last
//! decode worker leaving the view, and a prefill worker's published load during a long
//! prefill.

use super::*;

/// Fault 3: etcd stops for 30 s under steady load. No request fails (the router routes on
/// its last view and says it is stale); when etcd is back, every worker is registered
/// again and the router's view is fresh.
#[test]
fn etcd_down_for_30_seconds_then_frozen_under_load_fails_no_request() {
    let (mut cl, http) = cluster_with_metrics(1, 1, &["--local-prefill-max-tokens", "8"]);
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        let c = client(&cl.url).await;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Steady load: two clients, short and longer prompts (local and remote prefill).
        let load: Vec<_> = (0..2)
            .map(|k| {
                let (mut c, stop) = (c.clone(), stop.clone());
                let prompt = if k == 0 {
                    long_prompt(4)
                } else {
                    long_prompt(60)
                };
                tokio::spawn(async move {
                    let (mut ok, mut failed) = (0u32, Vec::new());
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        match generate(&mut c, greedy(text(&prompt), 4)).await {
                            Ok(r) if r.ids.len() == 4 => ok += 1,
                            Ok(r) => failed.push(format!("short completion: {r:?}")),
                            Err(s) => failed.push(format!("{s:?}")),
                        }
                    }
                    (ok, failed)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        cl.etcd.kill();
        let down = Instant::now();
        // The router notices and says so, and keeps routing.
        loop {
            let m = scrape_async(&http).await;
            if support::scrape_sum(&m, "duet_registry_view_stale", &[]) == 1.0 {
                break;
            }
            assert!(
                down.elapsed() < Duration::from_secs(10),
                "the view never went stale"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(30).saturating_sub(down.elapsed())).await;
        cl.etcd.restart();
        let back = Instant::now();
        // Both workers are registered again (their leases expired during the outage) and
        // the router's view is fresh.
        loop {
            let ids = {
                let cl = &cl;
                tokio::task::block_in_place(|| cl.registered())
            };
            let m = scrape_async(&http).await;
            let fresh = support::scrape_sum(&m, "duet_registry_view_stale", &[]) == 0.0;
            if fresh && ids.len() == 2 {
                eprintln!(
                    "registered and fresh {:?} after etcd came back",
                    back.elapsed()
                );
                break;
            }
            assert!(
                back.elapsed() < Duration::from_secs(20),
                "after etcd came back: registered {ids:?}, view fresh: {fresh}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        cl.wait_workers(1, 1, Duration::from_secs(10)).await;
        // Frozen (SIGSTOP) longer than the leases: when it thaws, etcd revokes the expired
        // leases and the workers vanish from the view for a moment before they register
        // again. Requests arriving in that gap wait for them instead of failing.
        cl.etcd.pause();
        tokio::time::sleep(Duration::from_secs(6)).await;
        cl.etcd.resume();
        let thawed = Instant::now();
        loop {
            let ids = {
                let cl = &cl;
                tokio::task::block_in_place(|| cl.registered())
            };
            if ids.len() == 2 {
                break;
            }
            assert!(
                thawed.elapsed() < Duration::from_secs(20),
                "after etcd thawed: registered {ids:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        cl.wait_workers(1, 1, Duration::from_secs(10)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut total = 0;
        for t in load {
            let (ok, failed) = t.await.expect("join");
            assert!(failed.is_empty(), "requests failed: {failed:?}");
            total += ok;
        }
        eprintln!("{total} requests completed across a 30 s etcd outage and a 6 s freeze");
        assert!(total >= 20, "steady load kept going: {total}");
    });
}

/// When the last decode worker has just left the view (its lease expired), a request waits
/// for one to come back instead of failing after `--no-worker-grace`: that is what a worker
/// re-registering after a registry hiccup looks like from the router.
#[test]
fn requests_wait_for_decode_workers_that_just_left() {
    let mut cl = Cluster::start(
        0,
        1,
        &[
            "--no-worker-grace",
            "100ms",
            "--local-prefill-max-tokens",
            "64",
        ],
    );
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(0, 1, Duration::from_secs(20)).await;
        cl.decode[0].kill9();
        // Its lease (2 s) runs out and the router's view loses it.
        cl.wait_workers(0, 0, Duration::from_secs(10)).await;
        let lost = Instant::now();
        let replacement = {
            let (etcd, cluster) = (&cl.etcd, cl.cluster.clone());
            let ep = etcd.endpoint();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                let p = Proc::start(
                    "decode-1",
                    &[
                        "decode",
                        "--etcd",
                        &ep,
                        "--cluster",
                        &cluster,
                        "--lease-ttl",
                        "2s",
                        "--id",
                        "decode-1",
                        "--kv-pool",
                        "64MiB",
                    ],
                );
                p.wait_for("serving gRPC on", support::START);
                p
            })
        };
        let mut c = client(&cl.url).await;
        let asked = Instant::now();
        let done = generate(&mut c, greedy(text("Hello there"), 4))
            .await
            .expect("the request waits for the returning decode worker");
        let waited = asked.elapsed();
        assert_eq!(done.ids.len(), 4);
        assert_eq!(done.timings().decode_worker, "decode-1");
        assert!(
            waited > Duration::from_millis(300),
            "it waited past the 100 ms grace for the new worker: {waited:?} ({:?} after the loss)",
            lost.elapsed()
        );
        cl.decode
            .push(replacement.join().expect("replacement worker"));
    });
}

/// The prefill worker's published load is live: while one long prompt is being prefilled
/// (one forward of ~800 tokens), its `Status` and its registry record, which the router
/// places work by, show it running with its prompt tokens queued, not an idle worker.
#[test]
fn prefill_status_is_live_during_a_long_prefill() {
    let (cl, _http) = cluster_with_metrics(1, 1, &["--local-prefill-max-tokens", "0"]);
    let prefill = cl.prefill[0].workers_addr();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        let req = greedy(text(&long_prompt(800)), 2);
        let task = tokio::spawn(async move { generate(&mut c, req).await });
        let mut router = pb::cluster_client::ClusterClient::connect(cl.url.clone())
            .await
            .expect("connect");
        let (mut status_seen, mut record_seen) = (None, None);
        while !task.is_finished() && (status_seen.is_none() || record_seen.is_none()) {
            let s = support::prefill_status(&prefill).await;
            if s.running > 0 && s.queued_prefill_tokens > 0 {
                status_seen.get_or_insert(s);
            }
            let listed = router
                .list_workers(pb::ListWorkersRequest {})
                .await
                .expect("ListWorkers")
                .into_inner();
            for j in &listed.records_json {
                let v: serde_json::Value = serde_json::from_str(j).expect("record");
                if v["role"] == "prefill"
                    && v["capacity"]["queued_prefill_tokens"].as_u64() > Some(0)
                {
                    record_seen.get_or_insert(v["capacity"].clone());
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let done = task.await.expect("join").expect("the request completes");
        assert_eq!(done.ids.len(), 2);
        let s = status_seen.expect("Status showed the prefill running during its forward");
        assert!(s.queued_prefill_tokens >= 700, "{s:?}");
        let r = record_seen.expect("the registry record showed queued prompt tokens");
        eprintln!("live prefill status {s:?}; record {r}");
        support::router_sees_prefill_idle(&cl.url, Duration::from_secs(10)).await;
    });
}
