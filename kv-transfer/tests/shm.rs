//! Shared-memory backend: round trips through a small ring (many chunks and credits) and in
//! pull mode (plain and compressed), authentication, and rejection of unreserved blocks.

mod common;

use duet_kv_transfer::backend::shm::{ShmMode, ShmOptions, ShmReceiver, ShmSender};
use duet_kv_transfer::protocol::compress::{decode_region, encode_region};
use duet_kv_transfer::{
    Compression, Error, ErrorClass, KvKind, KvLayout, KvReceiver, KvSender, MemorySink,
    SharedSecret, TransferDesc,
};

fn sock_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("duet-kv-test-{tag}-{}.sock", std::process::id()))
}

async fn send_all(tx: &mut ShmSender, layout: &KvLayout, d: &TransferDesc) -> Result<(), Error> {
    tx.begin(d.clone()).await?;
    for layer in 0..layout.layers() {
        let (k, v) = regions(layout, d, layer, Compression::None);
        tx.send_layer(layer, &k, &v).await?;
    }
    tx.finish().await.map(|_| ())
}

/// The deterministic regions of `layer`; for compression, turned into finite f32 values
/// (arbitrary bytes are NaNs the encoder refuses).
fn regions(
    layout: &KvLayout,
    d: &TransferDesc,
    layer: u32,
    c: Compression,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let (mut k, mut v) = common::layer_regions(layout, d.request_id, layer, &d.dst_blocks);
    if c != Compression::None {
        for r in k.iter_mut().chain(v.iter_mut()) {
            for w in r.chunks_exact_mut(4) {
                let x = f32::from(w[0]) / 64.0 - 2.0;
                w.copy_from_slice(&x.to_le_bytes());
            }
        }
    }
    (k, v)
}

/// What a compressed region is expected to look like after the wire: one encode + decode.
fn through_codec(layout: &KvLayout, c: Compression, src: &[u8]) -> Vec<u8> {
    let mut enc = Vec::new();
    encode_region(c, layout, src, &mut enc).unwrap();
    let mut out = vec![0u8; src.len()];
    decode_region(c, layout, &enc, &mut out).unwrap();
    out
}

/// Two transfers (one spanning 3 blocks, one a single partial block) land exactly in their
/// reserved blocks over a connection of the given options; returns both sides' modes.
async fn round_trip(tag: &str, opts: ShmOptions, compression: Compression) -> (ShmMode, ShmMode) {
    let layout = common::model_layout();
    let path = sock_path(tag);
    let dir = opts.dir.clone();
    let mut cfg = common::config(layout);
    cfg.compression = compression;
    let rx = ShmReceiver::bind(&path, cfg.clone(), opts).unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[4, 1, 6]).unwrap();
        sink.reserve(2, &[0]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let receipts = [
            conn.receive(&mut sink).await.unwrap(),
            conn.receive(&mut sink).await.unwrap(),
        ];
        (sink, conn.mode(), receipts)
    });
    let mut tx = ShmSender::connect(&path, &cfg, &dir).await.unwrap();
    let d1 = TransferDesc {
        request_id: 1,
        token_start: 0,
        token_count: 40,
        dst_blocks: vec![4, 1, 6],
    };
    let d2 = TransferDesc {
        request_id: 2,
        token_start: 16,
        token_count: 3,
        dst_blocks: vec![0],
    };
    for d in [&d1, &d2] {
        tx.begin(d.clone()).await.unwrap();
        for layer in 0..layout.layers() {
            let (k, v) = regions(&layout, d, layer, compression);
            tx.send_layer(layer, &k, &v).await.unwrap();
        }
        tx.finish().await.unwrap();
    }
    let (sink, rx_mode, receipts) = server.await.unwrap();
    for (r, d) in receipts.iter().zip([&d1, &d2]) {
        assert_eq!(r.compression, compression);
        assert_eq!(r.wire_bytes, d.wire_bytes(&layout, compression));
        for layer in 0..layout.layers() {
            let (k, v) = regions(&layout, d, layer, compression);
            for (kind, srcs) in [(KvKind::K, k), (KvKind::V, v)] {
                for (&b, src) in d.dst_blocks.iter().zip(srcs) {
                    let want = if compression == Compression::None {
                        src
                    } else {
                        through_codec(&layout, compression, &src)
                    };
                    let got = sink.region(layer, kind, b).unwrap();
                    assert!(got == want.as_slice(), "layer {layer} {kind:?} block {b}");
                }
            }
        }
    }
    for b in [2, 3, 5, 7] {
        common::assert_untouched(&sink, &layout, b);
    }
    // The ring file was unlinked once both sides mapped it.
    let leftovers = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("duet-kv-"))
        .count();
    assert_eq!(leftovers, 0);
    (rx_mode, tx.mode())
}

#[tokio::test]
async fn shm_round_trip_through_a_small_ring() {
    let opts = ShmOptions {
        slots: 2,
        slot_bytes: 5000,
        pull: false,
        ..ShmOptions::default()
    };
    let modes = round_trip("ring", opts, Compression::None).await;
    assert_eq!(modes, (ShmMode::Ring, ShmMode::Ring));
}

/// Same user, same host: the receiver can read the sender's memory, so both sides agree on
/// pull mode (one copy) and the bytes land exactly as through the ring.
#[tokio::test]
async fn shm_round_trip_pulls_from_the_senders_memory() {
    let modes = round_trip("pull", ShmOptions::default(), Compression::None).await;
    assert_eq!(modes, (ShmMode::Pull, ShmMode::Pull));
}

#[tokio::test]
async fn shm_pull_mode_carries_compressed_layers() {
    for c in [Compression::F16, Compression::Int8] {
        let modes = round_trip(&format!("pull-{c:?}"), ShmOptions::default(), c).await;
        assert_eq!(modes, (ShmMode::Pull, ShmMode::Pull));
    }
}

#[tokio::test]
async fn shm_wrong_secret_and_unreserved_blocks() {
    let layout = common::small_layout();
    let path = sock_path("neg");
    let opts = ShmOptions::default();
    let dir = opts.dir.clone();
    let rx = ShmReceiver::bind(&path, common::config(layout), opts).unwrap();
    let server = tokio::spawn(async move {
        let first = rx.accept().await.map(|_| ()).unwrap_err();
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(9, &[3]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        let second = conn.receive(&mut sink).await.unwrap_err();
        (first, second, sink)
    });
    let mut bad = common::config(layout);
    bad.secret = SharedSecret::new([7u8; 20]).unwrap();
    let e = ShmSender::connect(&path, &bad, &dir).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unauthenticated);
    let mut tx = ShmSender::connect(&path, &common::config(layout), &dir)
        .await
        .unwrap();
    let d = TransferDesc {
        request_id: 9,
        token_start: 0,
        token_count: 8,
        dst_blocks: vec![3, 2],
    };
    let e = send_all(&mut tx, &layout, &d).await.unwrap_err();
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
    let (first, second, sink) = server.await.unwrap();
    assert_eq!(first.class(), ErrorClass::Unauthenticated);
    assert!(matches!(
        second.root(),
        Error::BlockNotReserved { block: 2, .. }
    ));
    assert_eq!(sink.regions_handed_out, 0);
}

#[tokio::test]
async fn shm_sender_disconnect_reports_blocks() {
    let layout = common::small_layout();
    let path = sock_path("dc");
    let opts = ShmOptions::default();
    let dir = opts.dir.clone();
    let rx = ShmReceiver::bind(&path, common::config(layout), opts).unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(4, &[1, 2]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap_err()
    });
    let mut tx = ShmSender::connect(&path, &common::config(layout), &dir)
        .await
        .unwrap();
    let d = TransferDesc {
        request_id: 4,
        token_start: 0,
        token_count: 5,
        dst_blocks: vec![1, 2],
    };
    tx.begin(d.clone()).await.unwrap();
    let (k, v) = common::layer_regions(&layout, 4, 0, &d.dst_blocks);
    tx.send_layer(0, &k, &v).await.unwrap();
    drop(tx);
    let e = server.await.unwrap();
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    let mut r = e.blocks_to_release().to_vec();
    r.sort_unstable();
    assert_eq!(r, vec![1, 2]);
}
