//! Smoke test of the benchmark library functions on tiny sizes (every backend, references,
//! zero-copy evidence, end-to-end figure).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::time::Duration;

use duet_bench::transfer::{end_to_end, run, BenchOptions, E2eOptions};
use duet_kv_transfer::{BackendKind, Compression};

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
            _ => {
                assert!(r.points.iter().all(|p| p.reference_gbps.is_some()));
                // Same user, same host: shm pulls from the sender's send arena, which the
                // receiver has mapped.
                assert_eq!(r.shm_mode.as_deref(), Some("pull+arena"));
            }
        }
        if backend != BackendKind::Shm {
            assert_eq!(r.shm_mode, None);
        }
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("throughput_gbps"));
    }
}

/// Compressed runs verify the received KV against one encode + decode of the source, and
/// carry the documented fraction of the bytes (local hands buffers over: nothing encoded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_runs_verify_and_shrink_the_wire() {
    // Bench regions are 4 heads x 16 slots x 64 dims of f32.
    let elems = 4.0 * 16.0 * 64.0;
    for (backend, c, ratio) in [
        (BackendKind::Tcp, Compression::F16, 0.5),
        (
            BackendKind::Shm,
            Compression::Int8,
            (elems + 16.0) / (4.0 * elems),
        ),
        (BackendKind::Local, Compression::Int8, 1.0),
    ] {
        let r = run(BenchOptions {
            compression: c,
            reference: false,
            ..tiny(backend, 1)
        })
        .await
        .unwrap();
        assert_eq!(r.compression, c);
        for p in &r.points {
            assert!(p.verified, "{backend} {c}: received KV differs");
            let measured = p.wire_bytes as f64 / p.bytes as f64;
            assert!((measured - ratio).abs() < 1e-9, "{backend} {c}: {measured}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_reports_a_tail() {
    let r = end_to_end(E2eOptions {
        backend: BackendKind::Tcp,
        tokens: 64,
        compute_per_layer: Duration::from_micros(200),
        runs: 2,
        integrity: true,
        compression: Compression::Int8,
        shm_ring: false,
        shm_arena: true,
    })
    .await
    .unwrap();
    assert_eq!(r.layers, 30);
    assert_eq!(r.bytes_per_token, 45 * 1024);
    assert_eq!(r.total_bytes, 64 * 45 * 1024);
    assert!(r.tail_us_median > 0.0);
}

/// `shm_ring` forces the two-copy ring, and the report says which mode ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_ring_mode_can_be_forced_for_comparison() {
    let r = run(BenchOptions {
        shm_ring: true,
        reference: false,
        ..tiny(BackendKind::Shm, 1)
    })
    .await
    .unwrap();
    assert_eq!(r.shm_mode.as_deref(), Some("ring"));
    assert!(r.points.iter().all(|p| p.verified));
}

/// With `huge_pages` and no send arena the payload lives in an anonymous mapping (advised
/// onto huge pages): it still arrives intact, pulled with `process_vm_readv`, and the report
/// says how it was measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_pull_from_huge_page_buffers_lands_intact() {
    let r = run(BenchOptions {
        huge_pages: true,
        shm_arena: false,
        ..tiny(BackendKind::Shm, 1)
    })
    .await
    .unwrap();
    let thp = !std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .unwrap_or_else(|_| "[never]".into())
        .contains("[never]");
    assert_eq!(
        r.huge_pages, thp,
        "the report says what was had, not what was asked"
    );
    assert_eq!(r.shm_mode.as_deref(), Some("pull"));
    assert!(r.points.iter().all(|p| p.verified));
    let note = r.reference_note.unwrap_or_default();
    assert!(note.contains("huge pages"), "{note}");
}

/// The local backend hands the huge-page payload over without copying it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_adopts_huge_page_buffers_without_a_copy() {
    let r = run(BenchOptions {
        huge_pages: true,
        reference: false,
        ..tiny(BackendKind::Local, 1)
    })
    .await
    .unwrap();
    assert!(r
        .points
        .iter()
        .all(|p| p.verified && p.zero_copy == Some(true)));
}

#[tokio::test]
async fn bench_rejects_bad_options() {
    let mut o = tiny(BackendKind::Tcp, 0);
    assert!(run(o.clone()).await.is_err());
    o.streams = 1;
    o.backend = BackendKind::Nccl;
    assert!(run(o).await.is_err());
}
