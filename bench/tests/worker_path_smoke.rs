//! Smoke test of `duet bench transfer --end-to-end` (the workers' own KV path) on a small
//! payload, over shm (the default between processes of one host) and tcp, with the real
//! model's layout and decode engine. Needs the default model (`make model`); fails without.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::path::PathBuf;

use duet_bench::transfer::{worker_path, WorkerPathOptions};
use duet_kv_transfer::BackendKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_path_moves_kv_into_the_decode_pool_over_shm_and_tcp() {
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        model.exists(),
        "{} missing: run make model",
        model.display()
    );
    for backend in [BackendKind::Shm, BackendKind::Tcp] {
        let r = worker_path(WorkerPathOptions {
            backend,
            model: model.clone(),
            // Two requests' worth at the largest size: 4096 tokens is one request's most.
            sizes: vec![1 << 20, 5000 * 23040],
            runs: 1,
            integrity: true,
        })
        .await
        .unwrap();
        eprintln!("{}", serde_json::to_string(&r).unwrap());
        assert_eq!(
            r.bytes_per_token, 23040,
            "30 layers x K,V x 3 heads x 64 x f16"
        );
        assert_eq!(r.points.len(), 2);
        assert_eq!(r.points[0].requests, 1);
        assert_eq!(r.points[1].requests, 2);
        for p in &r.points {
            assert!(p.bytes > 0 && p.gbps > 0.0 && p.memcpy_gbps > 0.0, "{p:?}");
            // The path, counted: one copy, from the prefill pool (read in place) straight
            // into the decode pool's reserved blocks.
            assert!((p.copies_per_byte - 1.0).abs() < 1e-9, "{p:?}");
        }
    }
}
