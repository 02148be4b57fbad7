//! Smoke test of the benchmark library functions on tiny sizes (every backend, references,
//! zero-copy evidence, end-to-end figure).

use std::time::Duration;

use duet_kv_transfer::bench::{end_to_end, run, BenchOptions, E2eOptions};
use duet_kv_transfer::BackendKind;

fn tiny(backend: BackendKind, streams: usize) -> BenchOptions {
    BenchOptions {
        backend,
        max_bytes: 256 << 10,
        streams,
        ..BenchOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_on_every_backend() {
    for (backend, streams) in [
        (BackendKind::Tcp, 2),
        (BackendKind::Shm, 1),
        (BackendKind::Local, 1),
    ] {
        let t = std::time::Instant::now();
        let r = run(tiny(backend, streams)).await.unwrap();
        eprintln!(
            "{backend}: {:?} {}",
            t.elapsed(),
            serde_json::to_string(&r).unwrap()
        );
        assert_eq!(r.points.len(), 2, "{backend}");
        for p in &r.points {
            assert!(p.verified, "{backend}: bytes differ");
            assert!(p.throughput_gbps > 0.0);
            assert!(
                p.latency_us_min <= p.latency_us_median && p.latency_us_median <= p.latency_us_max
            );
        }
        match backend {
            BackendKind::Local => {
                assert!(r.points.iter().all(|p| p.zero_copy == Some(true)));
                assert!(r.zero_copy_note.as_deref().unwrap().contains("equal"));
            }
            BackendKind::Tcp => {
                // iperf3 may be missing; then the report says so.
                let have = r.points.iter().all(|p| p.reference_gbps.is_some());
                assert!(have || r.reference_note.is_some());
            }
            _ => assert!(r.points.iter().all(|p| p.reference_gbps.is_some())),
        }
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("throughput_gbps"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_reports_a_tail() {
    let r = end_to_end(E2eOptions {
        backend: BackendKind::Tcp,
        tokens: 64,
        compute_per_layer: Duration::from_micros(200),
        runs: 2,
        checksum: true,
    })
    .await
    .unwrap();
    assert_eq!(r.layers, 30);
    assert_eq!(r.bytes_per_token, 45 * 1024);
    assert_eq!(r.total_bytes, 64 * 45 * 1024);
    assert!(r.tail_us_median > 0.0);
}

#[tokio::test]
async fn bench_rejects_bad_options() {
    let mut o = tiny(BackendKind::Tcp, 0);
    assert!(run(o.clone()).await.is_err());
    o.streams = 1;
    o.backend = BackendKind::Rdma;
    assert!(run(o).await.is_err());
}
