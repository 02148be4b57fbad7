//! RDMA backend (feature `rdma`) through UCX. These machines have no RDMA device, so the
//! round trips run over UCX's tcp and shared-memory transports, which exercise the same code:
//! tag messages received straight into the reserved blocks, the control connection beside
//! them, authentication, rejection and a vanished sender.
#![cfg(feature = "rdma")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_kv_transfer::backend::rdma::{probe, RdmaOptions, RdmaReceiver, RdmaSender};
use duet_kv_transfer::{
    BackendKind, Compression, Error, ErrorClass, KvKind, KvReceiver, KvSender, MemorySink,
    SharedSecret, TransferDesc,
};
use tokio::net::TcpListener;

fn opts(tls: &str) -> RdmaOptions {
    RdmaOptions { tls: tls.into() }
}

async fn round_trip(tls: &str, c: Compression) {
    let layout = common::model_layout();
    let mut cfg = common::config(layout);
    cfg.compression = c;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rx = RdmaReceiver::new(listener, cfg.clone(), opts(tls)).unwrap();
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[4, 1, 6]).unwrap();
        sink.reserve(2, &[0]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let a = conn.receive(&mut sink).await.unwrap();
        let b = conn.receive(&mut sink).await.unwrap();
        (sink, [a, b])
    });
    let mut tx = RdmaSender::connect(addr, &cfg, &opts(tls)).await.unwrap();
    let [d1, d2] = common::two_transfers();
    for d in [&d1, &d2] {
        common::send_transfer(&mut tx, &layout, d, c).await.unwrap();
    }
    let (sink, receipts) = server.await.unwrap();
    for (r, d) in receipts.iter().zip([&d1, &d2]) {
        assert_eq!(r.compression, c);
        assert_eq!(r.wire_bytes, d.wire_bytes(&layout, c));
        common::assert_landed_through(&sink, &layout, d, c);
    }
    for b in [2, 3, 5, 7] {
        common::assert_untouched(&sink, &layout, b);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_round_trip_over_ucx_tcp() {
    round_trip("tcp", Compression::None).await;
    round_trip("tcp", Compression::Int8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_round_trip_over_ucx_shared_memory() {
    round_trip("shm", Compression::None).await;
    round_trip("shm", Compression::F16).await;
}

#[test]
fn rdma_is_compiled_in_and_selected_between_rdma_endpoints() {
    assert!(duet_kv_transfer::BackendCaps::compiled().rdma);
    let ep = |host: &str| duet_kv_transfer::EndpointInfo {
        host_id: host.into(),
        process_id: 1,
        shm: false,
        gpu: false,
        nccl: false,
        rdma: true,
        tcp: true,
    };
    let kind = duet_kv_transfer::select_backend(
        &ep("a"),
        &ep("b"),
        &duet_kv_transfer::BackendCaps::compiled(),
    )
    .unwrap();
    assert_eq!(kind, BackendKind::Rdma);
}

#[test]
fn unknown_ucx_transport_is_a_clear_error() {
    let e = probe(&opts("no-such-transport")).unwrap_err();
    assert!(
        matches!(
            e,
            Error::BackendUnavailable {
                backend: "rdma",
                ..
            }
        ),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_wrong_secret_unreserved_blocks_and_vanished_sender() {
    let layout = common::small_layout();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rx = RdmaReceiver::new(listener, common::config(layout), opts("tcp")).unwrap();
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let first = rx.accept().await.map(|_| ()).unwrap_err();
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(9, &[3]).unwrap();
        sink.reserve(4, &[1, 2]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let rejected = conn.receive(&mut sink).await.unwrap_err();
        let handed_out = sink.regions_handed_out;
        let mut conn = rx.accept().await.unwrap();
        let vanished = conn.receive(&mut sink).await.unwrap_err();
        (first, rejected, handed_out, vanished)
    });
    let mut bad = common::config(layout);
    bad.secret = SharedSecret::new([7u8; 20]).unwrap();
    let e = RdmaSender::connect(addr, &bad, &opts("tcp"))
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unauthenticated);

    let cfg = common::config(layout);
    let mut tx = RdmaSender::connect(addr, &cfg, &opts("tcp")).await.unwrap();
    let d = TransferDesc {
        request_id: 9,
        token_start: 0,
        token_count: 8,
        dst_blocks: vec![3, 2],
    };
    tx.begin(d.clone()).await.unwrap();
    let mut sent = Ok(());
    for layer in 0..layout.layers() {
        let (k, v) = common::layer_regions(&layout, 9, layer, &d.dst_blocks);
        sent = tx.send_layer(layer, &k, &v).await;
        if sent.is_err() {
            break;
        }
    }
    let e = match sent {
        Err(e) => e,
        Ok(()) => tx.finish().await.map(|_| ()).unwrap_err(),
    };
    assert!(
        matches!(
            e,
            Error::Rejected {
                class: ErrorClass::NotFound,
                ..
            }
        ),
        "{e}"
    );

    let mut tx = RdmaSender::connect(addr, &cfg, &opts("tcp")).await.unwrap();
    let d = TransferDesc {
        request_id: 4,
        token_start: 0,
        token_count: 5,
        dst_blocks: vec![1, 2],
    };
    tx.begin(d.clone()).await.unwrap();
    let (k, v) = common::layer_regions(&layout, 4, 0, &d.dst_blocks);
    tx.send_layer(0, &k, &v).await.unwrap();
    let t = std::time::Instant::now();
    drop(tx);
    let (first, rejected, handed_out, vanished) = server.await.unwrap();
    assert_eq!(first.class(), ErrorClass::Unauthenticated);
    assert!(
        matches!(rejected.root(), Error::BlockNotReserved { block: 2, .. }),
        "{rejected}"
    );
    assert_eq!(handed_out, 0, "a rejected transfer wrote into the sink");
    assert_eq!(vanished.class(), ErrorClass::Unavailable, "{vanished}");
    let mut r = vanished.blocks_to_release().to_vec();
    r.sort_unstable();
    assert_eq!(r, vec![1, 2]);
    // Noticed through the control connection, not the 5 s i/o timeout.
    assert!(
        t.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        t.elapsed()
    );
}

/// Regression: a receiver that stopped progressing UCX while it waited on the control
/// connection deadlocked against a sender waiting for rendezvous acknowledgements still
/// queued in the receiver's worker (UCX shared memory, a 1024-token prompt's 64 blocks per
/// layer, a pause between layers as the prefill computes them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_long_prompt_over_ucx_shared_memory_completes() {
    let layout = common::model_layout();
    let cfg = common::config(layout);
    let blocks: Vec<u32> = (0..64).collect();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rx = RdmaReceiver::new(listener, cfg.clone(), opts("shm")).unwrap();
    let addr = rx.local_addr().unwrap();
    let want = blocks.clone();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 64);
        let mut conn = rx.accept().await.unwrap();
        for req in 0..3u64 {
            sink.reserve(req, &want).unwrap();
            conn.receive(&mut sink).await.unwrap();
            sink.release(&want);
        }
        sink
    });
    let mut tx = RdmaSender::connect(addr, &cfg, &opts("shm")).await.unwrap();
    let region = |req: u64, layer: u32, kind: u8, b: u32| {
        vec![(req as u8) ^ (layer as u8).wrapping_mul(7) ^ kind ^ (b as u8); layout.region_bytes()]
    };
    for req in 0..3u64 {
        let d = TransferDesc {
            request_id: req,
            token_start: 0,
            token_count: 1024,
            dst_blocks: blocks.clone(),
        };
        tx.begin(d).await.unwrap();
        for layer in 0..layout.layers() {
            let k: Vec<Vec<u8>> = blocks.iter().map(|&b| region(req, layer, 1, b)).collect();
            let v: Vec<Vec<u8>> = blocks.iter().map(|&b| region(req, layer, 2, b)).collect();
            tx.send_layer(layer, &k, &v).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        tx.finish().await.unwrap();
    }
    let sink = server.await.unwrap();
    for layer in 0..layout.layers() {
        for &b in &blocks {
            assert!(sink.region(layer, KvKind::V, b).unwrap() == region(2, layer, 2, b).as_slice());
        }
    }
}
