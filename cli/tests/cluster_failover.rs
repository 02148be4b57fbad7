//! Registry behaviour with real processes: a decode worker killed with SIGKILL disappears
//! when its lease expires and gets no more requests; a worker started later gets requests;
//! a worker stopped with SIGTERM deletes its key at once.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use support::{client, generate, greedy, text, Cluster};

#[test]
fn killed_worker_leaves_within_ttl_and_new_worker_joins() {
    let mut cl = Cluster::start(1, 2, &["--local-prefill-max-tokens", "0"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        cl.wait_workers(1, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        generate(&mut c, greedy(text("The capital of France is"), 4))
            .await
            .expect("warm up");

        // kill -9 decode-0: its key is gone within TTL + 1 s.
        cl.decode[0].kill9();
        let killed = Instant::now();
        loop {
            let ids = cl.registered();
            if !ids.iter().any(|i| i == "decode-0") {
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(3),
                "decode-0 still registered {:?} after the kill",
                killed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cl.wait_workers(1, 1, Duration::from_secs(2)).await;
        // No request goes to it.
        for _ in 0..4 {
            let r = generate(&mut c, greedy(text("Water boils at"), 4))
                .await
                .expect("after kill");
            assert_eq!(r.timings().decode_worker, "decode-1");
        }

        // A new worker started later receives requests.
        let new = Cluster::worker(&cl.etcd, &cl.cluster, "decode", "decode-9");
        cl.wait_workers(1, 2, Duration::from_secs(10)).await;
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let mut c = c.clone();
            tasks.push(tokio::spawn(async move {
                generate(&mut c, greedy(text("The largest planet is"), 6)).await
            }));
        }
        let mut used = HashSet::new();
        for t in tasks {
            used.insert(t.await.unwrap().expect("request").timings().decode_worker);
        }
        assert!(
            used.contains("decode-9"),
            "the new worker got no request: {used:?}"
        );

        // SIGTERM: graceful, the key is deleted at once (well before the TTL).
        let mut new = new;
        let t0 = Instant::now();
        new.signal("-TERM");
        loop {
            if !cl.registered().iter().any(|i| i == "decode-9") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_millis(1500),
                "decode-9 still registered after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let code = new.terminate(Duration::from_secs(15));
        assert_eq!(code, Some(0), "graceful exit code");
    });
}
