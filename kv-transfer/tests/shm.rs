//! Shared-memory backend: round trips through a small ring (many chunks and credits) and in
//! pull mode (plain and compressed, from ordinary memory and from the send arena),
//! authentication, and rejection of unreserved blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use duet_kv_transfer::backend::shm::{
    SendArena, ShmMode, ShmOptions, ShmPulls, ShmReceiver, ShmSender,
};
use duet_kv_transfer::{
    Compression, Error, ErrorClass, KvLayout, KvReceiver, KvSender, MemorySink, SharedSecret,
    TransferConfig, TransferDesc,
};

fn sock_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("duet-kv-test-{tag}-{}.sock", std::process::id()))
}

async fn send_all(tx: &mut ShmSender, layout: &KvLayout, d: &TransferDesc) -> Result<(), Error> {
    common::send_transfer(tx, layout, d, Compression::None).await
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
    let [d1, d2] = common::two_transfers();
    for d in [&d1, &d2] {
        common::send_transfer(&mut tx, &layout, d, compression)
            .await
            .unwrap();
    }
    let (sink, rx_mode, receipts) = server.await.unwrap();
    for (r, d) in receipts.iter().zip([&d1, &d2]) {
        assert_eq!(r.compression, compression);
        assert_eq!(r.wire_bytes, d.wire_bytes(&layout, compression));
        common::assert_landed_through(&sink, &layout, d, compression);
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

/// A receiver with default options on a fresh socket: it, the config both sides use, the
/// socket path and the directory of the ring files.
fn bind(tag: &str) -> (ShmReceiver, TransferConfig, PathBuf, PathBuf) {
    let path = sock_path(tag);
    let opts = ShmOptions::default();
    let dir = opts.dir.clone();
    let cfg = common::config(common::model_layout());
    let rx = ShmReceiver::bind(&path, cfg.clone(), opts).unwrap();
    (rx, cfg, path, dir)
}

/// Layer `layer` of `d` laid out as a prefill worker does: K then V regions in one buffer of
/// `arena`, returned as K and V slices of it.
fn arena_layer(
    arena: &Arc<SendArena>,
    layout: &KvLayout,
    d: &TransferDesc,
    layer: u32,
) -> (Vec<Bytes>, Vec<Bytes>) {
    let (k, v) = common::layer_regions_for(layout, d, layer, Compression::None);
    let region = layout.region_bytes();
    let mut buf = arena.alloc(region * (k.len() + v.len())).unwrap();
    for (i, r) in k.iter().chain(&v).enumerate() {
        buf[i * region..(i + 1) * region].copy_from_slice(r);
    }
    let data = Bytes::from_owner(buf);
    let mut slices: Vec<Bytes> = (0..k.len() + v.len())
        .map(|i| data.slice(i * region..(i + 1) * region))
        .collect();
    let vs = slices.split_off(k.len());
    (slices, vs)
}

/// Sends `d` with every layer in `arena` (as a prefill worker lays them out), or in ordinary
/// vectors when `arena` is `None`, through the borrowed `send_layer`.
async fn send_from(
    tx: &mut ShmSender,
    arena: Option<&Arc<SendArena>>,
    layout: &KvLayout,
    d: &TransferDesc,
) {
    tx.begin(d.clone()).await.unwrap();
    for layer in 0..layout.layers() {
        match arena {
            Some(arena) => {
                let (k, v) = arena_layer(arena, layout, d, layer);
                tx.send_layer(layer, &k, &v).await.unwrap();
            }
            None => {
                let (k, v) = common::layer_regions_for(layout, d, layer, Compression::None);
                tx.send_layer(layer, &k, &v).await.unwrap();
            }
        }
    }
    tx.finish().await.unwrap();
}

/// A sender with a send arena hands it to the receiver at setup; layers laid out in the
/// arena are then copied from the receiver's mapping of it (counted), layers elsewhere are
/// still pulled with `process_vm_readv`, and both land exactly in their reserved blocks.
#[tokio::test]
async fn shm_pull_copies_layers_in_the_send_arena_from_the_receivers_mapping() {
    let layout = common::model_layout();
    let (rx, cfg, path, dir) = bind("arena");
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[4, 1, 6]).unwrap();
        sink.reserve(2, &[0]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        assert!(conn.arena_mapped());
        conn.receive(&mut sink).await.unwrap();
        let after_first = conn.pulls();
        conn.receive(&mut sink).await.unwrap();
        (sink, after_first, conn.pulls())
    });
    let arena = SendArena::new(1 << 20).unwrap();
    let mut tx = ShmSender::connect_with_arena(&path, &cfg, &dir, Some(&arena))
        .await
        .unwrap();
    assert_eq!(tx.mode(), ShmMode::Pull);
    assert!(tx.arena_shared());
    let [d1, d2] = common::two_transfers();
    send_from(&mut tx, Some(&arena), &layout, &d1).await;
    send_from(&mut tx, None, &layout, &d2).await;
    let (sink, after_first, total) = server.await.unwrap();
    let layers = u64::from(layout.layers());
    assert_eq!(
        after_first,
        ShmPulls {
            send_arena: layers,
            process_memory: 0
        },
        "one arena PULL per layer"
    );
    assert_eq!(
        total,
        ShmPulls {
            send_arena: layers,
            process_memory: layers
        },
        "layers outside the arena are pulled the old way"
    );
    for d in [&d1, &d2] {
        common::assert_landed_through(&sink, &layout, d, Compression::None);
    }
    for b in [2, 3, 5, 7] {
        common::assert_untouched(&sink, &layout, b);
    }
    assert_eq!(
        arena.free_bytes(),
        arena.capacity(),
        "every layer buffer came back"
    );
}

/// `send_layer_bytes` pipelines: the sender goes on to the next layer while the receiver
/// still copies this one, holding the layer's buffers until its PULLED (a layer just sent
/// keeps its arena range even after the caller dropped it), and every range is back once
/// the transfer is finished; the bytes land exactly.
#[tokio::test]
async fn shm_owned_layers_are_pipelined_and_held_until_pulled() {
    let layout = common::model_layout();
    let (rx, cfg, path, dir) = bind("pipelined");
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[4, 1, 6]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap();
        (sink, conn.pulls())
    });
    let arena = SendArena::new(1 << 20).unwrap();
    let mut tx = ShmSender::connect_with_arena(&path, &cfg, &dir, Some(&arena))
        .await
        .unwrap();
    let [d1, _] = common::two_transfers();
    tx.begin(d1.clone()).await.unwrap();
    for layer in 0..layout.layers() {
        // The slices move into the sender: only it can keep the buffer alive now.
        let (k, v) = arena_layer(&arena, &layout, &d1, layer);
        tx.send_layer_bytes(layer, k, v).await.unwrap();
        if layer == 0 {
            assert!(
                arena.free_bytes() < arena.capacity(),
                "the first layer is held in flight, not waited for"
            );
        }
    }
    tx.finish().await.unwrap();
    assert_eq!(arena.free_bytes(), arena.capacity(), "released once pulled");
    let (sink, pulls) = server.await.unwrap();
    assert_eq!(pulls.send_arena, u64::from(layout.layers()));
    common::assert_landed_through(&sink, &layout, &d1, Compression::None);
}

/// A receiver that refuses the transfer while owned layers are in flight: the refusal
/// reaches the sender (from a later layer or from `finish`), nothing is written.
#[tokio::test]
async fn shm_pipelined_layers_to_unreserved_blocks_are_refused() {
    let layout = common::model_layout();
    let (rx, cfg, path, dir) = bind("pipelined-refused");
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        let mut conn = rx.accept().await.unwrap();
        let e = conn.receive(&mut sink).await.unwrap_err();
        (e, sink.regions_handed_out)
    });
    let mut tx = ShmSender::connect(&path, &cfg, &dir).await.unwrap();
    let [d1, _] = common::two_transfers();
    tx.begin(d1.clone()).await.unwrap();
    let mut refused = None;
    for layer in 0..layout.layers() {
        let (k, v) = common::layer_regions_for(&layout, &d1, layer, Compression::None);
        let owned = |r: Vec<Vec<u8>>| r.into_iter().map(Bytes::from).collect();
        if let Err(e) = tx.send_layer_bytes(layer, owned(k), owned(v)).await {
            refused = Some(e);
            break;
        }
    }
    let e = match refused {
        Some(e) => e,
        None => tx.finish().await.unwrap_err(),
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
    let (rx_err, written) = server.await.unwrap();
    assert!(
        matches!(rx_err.root(), Error::BlockNotReserved { .. }),
        "{rx_err}"
    );
    assert_eq!(written, 0);
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
