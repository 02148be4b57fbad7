//! NCCL backend (feature `nccl`). Moves a transfer GPU 0 -> GPU 1 and checks the bytes.
//! Where CUDA, NCCL or two GPUs are missing it checks that the backend says so
//! (`BackendUnavailable`) and prints SKIP; with `DUET_GPU_CHECK=1` (scripts/gpu-check.sh on a
//! machine with two GPUs) a missing GPU fails the test instead.
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_kv_transfer::backend::nccl::{probe, NcclOptions, NcclReceiver, NcclSender};
use duet_kv_transfer::{Error, ErrorClass, KvReceiver, KvSender, MemorySink, TransferDesc};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nccl_round_trip_or_skip() {
    let info = match probe(0) {
        Ok(i) => i,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    Error::BackendUnavailable {
                        backend: "nccl",
                        ..
                    }
                ),
                "{e}"
            );
            assert_eq!(e.class(), ErrorClass::Unavailable);
            assert!(
                std::env::var_os("DUET_GPU_CHECK").is_none(),
                "DUET_GPU_CHECK is set but NCCL cannot run: {e}"
            );
            eprintln!("SKIP nccl_round_trip_or_skip: no usable GPU/NCCL here: {e}");
            return;
        }
    };
    if info.devices < 2 {
        assert!(
            std::env::var_os("DUET_GPU_CHECK").is_none(),
            "DUET_GPU_CHECK is set but only {} CUDA device(s) are present",
            info.devices
        );
        eprintln!(
            "SKIP nccl_round_trip_or_skip: needs 2 CUDA devices, found {}",
            info.devices
        );
        return;
    }
    let layout = common::model_layout();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rx = NcclReceiver::new(
        listener,
        common::config(layout),
        NcclOptions {
            device: 0,
            staging_bytes: 1 << 20,
            ..NcclOptions::default()
        },
    )
    .unwrap();
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[3, 5, 7]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap();
        sink
    });
    let mut tx = NcclSender::connect(
        addr,
        &common::config(layout),
        NcclOptions {
            device: 1,
            staging_bytes: 1 << 20,
            ..NcclOptions::default()
        },
    )
    .await
    .unwrap();
    let d = TransferDesc {
        request_id: 1,
        token_start: 0,
        token_count: 40,
        dst_blocks: vec![3, 5, 7],
    };
    tx.begin(d.clone()).await.unwrap();
    for layer in 0..layout.layers() {
        let (k, v) = common::layer_regions(&layout, 1, layer, &d.dst_blocks);
        tx.send_layer(layer, &k, &v).await.unwrap();
    }
    tx.finish().await.unwrap();
    let sink = server.await.unwrap();
    common::assert_landed(&sink, &layout, 1, &d.dst_blocks);
}
