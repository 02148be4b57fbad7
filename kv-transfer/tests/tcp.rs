//! TCP backend over loopback: round trips, authentication, layout mismatch, disconnects,
//! garbage, wrong version, unreserved blocks, timeouts and parallel connections.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use std::time::Duration;

use duet_kv_transfer::backend::tcp::{connect_pool, TcpReceiver, TcpSender};
use duet_kv_transfer::protocol::VERSION;
use duet_kv_transfer::{
    Dtype, Error, ErrorClass, Fingerprint, KvLayout, KvReceiver, KvSender, MemorySink,
    SharedSecret, TransferConfig, TransferDesc,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn receiver(cfg: TransferConfig) -> TcpReceiver {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    TcpReceiver::new(listener, cfg)
}

fn desc(req: u64, layout: &KvLayout, tokens: u32, blocks: &[u32]) -> TransferDesc {
    assert_eq!(layout.blocks_for_tokens(tokens) as usize, blocks.len());
    TransferDesc {
        request_id: req,
        token_start: 0,
        token_count: tokens,
        dst_blocks: blocks.to_vec(),
    }
}

async fn send_layers<S: KvSender>(
    s: &mut S,
    layout: &KvLayout,
    d: &TransferDesc,
    layers: std::ops::Range<u32>,
) -> Result<(), Error> {
    for layer in layers {
        let (k, v) = common::layer_regions(layout, d.request_id, layer, &d.dst_blocks);
        let k: Vec<&[u8]> = k.iter().map(Vec::as_slice).collect();
        let v: Vec<&[u8]> = v.iter().map(Vec::as_slice).collect();
        s.send_layer(layer, &k, &v).await?;
    }
    Ok(())
}

#[tokio::test]
async fn loopback_round_trip_lands_in_the_right_blocks() {
    let layout = common::model_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let d1 = desc(1, &layout, 50, &[9, 3, 7, 0]);
    let d2 = desc(2, &layout, 16, &[5]);
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 12);
        sink.reserve(1, &[9, 3, 7, 0]).unwrap();
        sink.reserve(2, &[5]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let r1 = conn.receive(&mut sink).await.unwrap();
        // The second transfer goes through the one-region-at-a-time path.
        let r2 = conn
            .receive(&mut common::PlainSink(&mut sink))
            .await
            .unwrap();
        let end = conn.receive(&mut sink).await.unwrap_err();
        assert!(end.is_clean_close(), "{end}");
        (sink, r1, r2)
    });
    let mut tx = TcpSender::connect(addr, &common::config(layout))
        .await
        .unwrap();
    for d in [&d1, &d2] {
        tx.begin(d.clone()).await.unwrap();
        send_layers(&mut tx, &layout, d, 0..layout.layers())
            .await
            .unwrap();
        let receipt = tx.finish().await.unwrap();
        assert_eq!(&receipt.desc, d);
        assert_eq!(
            receipt.payload_bytes,
            u64::from(layout.layers()) * layout.layer_frame_bytes(d.dst_blocks.len())
        );
    }
    drop(tx);
    let (sink, r1, r2) = server.await.unwrap();
    assert_eq!(r1.desc, d1);
    assert_eq!(r2.desc, d2);
    common::assert_landed(&sink, &layout, 1, &d1.dst_blocks);
    common::assert_landed(&sink, &layout, 2, &d2.dst_blocks);
    for b in [1, 2, 4, 6, 8, 10, 11] {
        common::assert_untouched(&sink, &layout, b);
    }
}

#[tokio::test]
async fn wrong_secret_is_refused_by_both_sides_and_writes_nothing() {
    let layout = common::small_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let sink = MemorySink::new(layout, 4);
        let r = rx.accept().await.map(|_| ());
        (r, sink)
    });
    let mut bad = common::config(layout);
    bad.secret = SharedSecret::new(b"another secret, 16+ bytes").unwrap();
    let e = TcpSender::connect(addr, &bad).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unauthenticated, "{e}");
    let (r, sink) = server.await.unwrap();
    let e = r.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unauthenticated, "{e}");
    assert_eq!(sink.regions_handed_out, 0);
}

#[tokio::test]
async fn unauthenticated_frames_never_reach_the_sink() {
    // A peer that skips the handshake and sends transfer frames directly.
    let layout = common::small_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(42, &[0, 1]).unwrap();
        let r = rx.accept().await.map(|_| ());
        (r, sink)
    });
    let d = TransferDesc {
        request_id: 42,
        token_start: 0,
        token_count: 8,
        dst_blocks: vec![0, 1],
    };
    let (k, v) = common::layer_regions(&layout, 42, 0, &d.dst_blocks);
    let regions = duet_kv_transfer::LayerRegions {
        layer: 0,
        k: k.iter().map(Vec::as_slice).collect(),
        v: v.iter().map(Vec::as_slice).collect(),
    };
    let frames =
        duet_kv_transfer::protocol::encode_transfer(&layout, &d, &[regions], false).unwrap();
    let mut raw = TcpStream::connect(addr).await.unwrap();
    let _ = raw.write_all(&frames).await;
    let (r, sink) = server.await.unwrap();
    assert!(matches!(r.unwrap_err(), Error::BadMagic { .. }));
    assert_eq!(sink.regions_handed_out, 0);
    common::assert_untouched(&sink, &layout, 0);
}

#[tokio::test]
async fn layout_mismatch_names_both_values_on_both_sides() {
    let rl = common::model_layout();
    let sl = KvLayout::new(Fingerprint([2; 32]), 32, 3, 64, 16, Dtype::F16).unwrap();
    let rx = receiver(common::config(rl)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move { rx.accept().await.map(|_| ()) });
    let e = TcpSender::connect(addr, &common::config(sl))
        .await
        .unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, Error::LayoutMismatch(_)), "{s}");
    assert!(s.contains("layers: local=32 remote=30"), "{s}");
    assert!(s.contains("dtype: local=f16 remote=f32"), "{s}");
    let e = server.await.unwrap().unwrap_err();
    let s = e.to_string();
    assert!(s.contains("layers: local=30 remote=32"), "{s}");
    assert!(s.contains("dtype: local=f32 remote=f16"), "{s}");
    assert_eq!(e.class(), ErrorClass::InvalidArgument);
}

#[tokio::test]
async fn sender_disconnect_mid_transfer_reports_blocks_to_release() {
    let layout = common::model_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(7, &[6, 2]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let e = conn.receive(&mut sink).await.unwrap_err();
        (e, sink)
    });
    let d = desc(7, &layout, 20, &[6, 2]);
    let mut tx = TcpSender::connect(addr, &common::config(layout))
        .await
        .unwrap();
    tx.begin(d.clone()).await.unwrap();
    send_layers(&mut tx, &layout, &d, 0..3).await.unwrap();
    drop(tx); // the prefill worker dies
    let (e, mut sink) = server.await.unwrap();
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    assert!(matches!(e.root(), Error::PeerClosed { .. }), "{e}");
    let mut release = e.blocks_to_release().to_vec();
    release.sort_unstable();
    assert_eq!(release, vec![2, 6]);
    sink.release(e.blocks_to_release());
    assert_eq!(sink.reserved_count(), 0);
}

#[tokio::test]
async fn receiver_disconnect_mid_transfer_fails_the_sender() {
    let layout = common::model_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let (began_tx, began_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let conn = rx.accept().await.unwrap();
        began_rx.await.unwrap();
        drop(conn); // the decode worker dies with unread data: the kernel resets the stream
    });
    let d = desc(8, &layout, 64, &[0, 1, 2, 3]);
    let mut tx = TcpSender::connect(addr, &common::config(layout))
        .await
        .unwrap();
    tx.begin(d.clone()).await.unwrap();
    send_layers(&mut tx, &layout, &d, 0..1).await.unwrap();
    began_tx.send(()).unwrap();
    server.await.unwrap();
    let r = match send_layers(&mut tx, &layout, &d, 1..layout.layers()).await {
        Ok(()) => tx.finish().await.map(|_| ()),
        Err(e) => Err(e),
    };
    let e = r.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    // The connection is unusable afterwards.
    assert!(matches!(tx.begin(d).await.unwrap_err(), Error::Broken));
}

#[tokio::test]
async fn garbage_bytes_are_refused() {
    let layout = common::small_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move { rx.accept().await.map(|_| ()) });
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let e = server.await.unwrap().unwrap_err();
    assert!(
        matches!(e, Error::BadMagic { found } if &found == b"GET "),
        "{e}"
    );
    assert_eq!(e.metric_label(), "bad_magic");
}

#[tokio::test]
async fn wrong_version_is_refused() {
    let layout = common::small_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move { rx.accept().await.map(|_| ()) });
    let mut raw = TcpStream::connect(addr).await.unwrap();
    let mut hello = vec![0u8; 96];
    hello[..4].copy_from_slice(b"DKVT");
    hello[4..6].copy_from_slice(&9u16.to_le_bytes());
    raw.write_all(&hello).await.unwrap();
    let mut answer = [0u8; 8];
    raw.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer[..4], b"DKVT");
    assert_eq!(u16::from_le_bytes([answer[4], answer[5]]), VERSION);
    let e = server.await.unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedVersion {
                local: VERSION,
                remote: 9
            }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn never_reserved_blocks_are_rejected_and_untouched() {
    let layout = common::small_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(3, &[0]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let e = conn.receive(&mut sink).await.unwrap_err();
        (e, sink)
    });
    let d = desc(3, &layout, 8, &[0, 1]); // block 1 was never reserved
    let mut tx = TcpSender::connect(addr, &common::config(layout))
        .await
        .unwrap();
    tx.begin(d.clone()).await.unwrap();
    let r = match send_layers(&mut tx, &layout, &d, 0..layout.layers()).await {
        Ok(()) => tx.finish().await.map(|_| ()),
        Err(e) => Err(e),
    };
    let se = r.unwrap_err();
    assert!(
        matches!(
            se,
            Error::Rejected {
                class: ErrorClass::NotFound,
                ..
            }
        ),
        "{se}"
    );
    assert!(se.to_string().contains("block 1 is not reserved"), "{se}");
    let (e, sink) = server.await.unwrap();
    assert!(
        matches!(e.root(), Error::BlockNotReserved { block: 1, .. }),
        "{e}"
    );
    assert_eq!(e.blocks_to_release(), &[0]);
    assert_eq!(sink.regions_handed_out, 0);
    for b in 0..4 {
        common::assert_untouched(&sink, &layout, b);
    }
}

#[tokio::test]
async fn stalled_sender_times_out_and_blocks_are_reported() {
    let layout = common::small_layout();
    let mut cfg = common::config(layout);
    cfg.timeouts.io = Duration::from_millis(150);
    let rx = receiver(cfg).await;
    let addr = rx.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(5, &[2, 3]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap_err()
    });
    let d = desc(5, &layout, 8, &[2, 3]);
    let mut tx = TcpSender::connect(addr, &common::config(layout))
        .await
        .unwrap();
    tx.begin(d).await.unwrap();
    let e = server.await.unwrap(); // the sender is alive but sends nothing more
    assert_eq!(e.class(), ErrorClass::DeadlineExceeded, "{e}");
    assert_eq!(e.blocks_to_release().len(), 2);
    drop(tx);
}

#[tokio::test]
async fn parallel_connections_carry_concurrent_transfers() {
    let layout = common::model_layout();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    const K: usize = 3;
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..K {
            let mut conn = rx.accept().await.unwrap();
            tasks.push(tokio::spawn(async move {
                let mut sink = MemorySink::new(layout, 4);
                for req in 100..100 + K as u64 {
                    sink.reserve(req, &[req as u32 % 4]).unwrap();
                }
                let r = conn.receive(&mut sink).await.unwrap();
                (r.desc.request_id, sink)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let pool = connect_pool(addr, &common::config(layout), K)
        .await
        .unwrap();
    let mut sends = Vec::new();
    for (i, mut tx) in pool.into_iter().enumerate() {
        let req = 100 + i as u64;
        sends.push(tokio::spawn(async move {
            let d = desc(req, &layout, 16, &[req as u32 % 4]);
            tx.begin(d.clone()).await.unwrap();
            send_layers(&mut tx, &layout, &d, 0..layout.layers())
                .await
                .unwrap();
            tx.finish().await.unwrap()
        }));
    }
    for s in sends {
        s.await.unwrap();
    }
    for (req, sink) in server.await.unwrap() {
        common::assert_landed(&sink, &layout, req, &[req as u32 % 4]);
    }
}

#[tokio::test]
async fn many_blocks_cross_the_iovec_limit() {
    // 130 regions per half-frame: more than one 64-entry writev/readv batch.
    let layout = common::small_layout();
    let blocks: Vec<u32> = (0..130).rev().collect();
    let rx = receiver(common::config(layout)).await;
    let addr = rx.local_addr().unwrap();
    let ids = blocks.clone();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 140);
        sink.reserve(77, &ids).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap();
        sink
    });
    let d = desc(77, &layout, 130 * layout.block_size(), &blocks);
    let mut tx = TcpSender::connect(addr, &common::config(layout))
        .await
        .unwrap();
    tx.begin(d.clone()).await.unwrap();
    send_layers(&mut tx, &layout, &d, 0..layout.layers())
        .await
        .unwrap();
    tx.finish().await.unwrap();
    let sink = server.await.unwrap();
    common::assert_landed(&sink, &layout, 77, &blocks);
    for b in 130..140 {
        common::assert_untouched(&sink, &layout, b);
    }
}
