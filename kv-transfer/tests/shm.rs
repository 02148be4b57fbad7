//! Shared-memory backend: round trips through a small ring (many chunks and credits),
//! authentication, and rejection of unreserved blocks.

mod common;

use duet_kv_transfer::backend::shm::{ShmOptions, ShmReceiver, ShmSender};
use duet_kv_transfer::{
    Error, ErrorClass, KvLayout, KvReceiver, KvSender, MemorySink, SharedSecret, TransferDesc,
};

fn sock_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("duet-kv-test-{tag}-{}.sock", std::process::id()))
}

async fn send_all(tx: &mut ShmSender, layout: &KvLayout, d: &TransferDesc) -> Result<(), Error> {
    tx.begin(d.clone()).await?;
    for layer in 0..layout.layers() {
        let (k, v) = common::layer_regions(layout, d.request_id, layer, &d.dst_blocks);
        tx.send_layer(layer, &k, &v).await?;
    }
    tx.finish().await.map(|_| ())
}

#[tokio::test]
async fn shm_round_trip_with_small_ring() {
    let layout = common::model_layout();
    let path = sock_path("rt");
    let opts = ShmOptions {
        slots: 2,
        slot_bytes: 5000,
        ..ShmOptions::default()
    };
    let dir = opts.dir.clone();
    let rx = ShmReceiver::bind(&path, common::config(layout), opts).unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[4, 1, 6]).unwrap();
        sink.reserve(2, &[0]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap();
        conn.receive(&mut sink).await.unwrap();
        sink
    });
    let mut tx = ShmSender::connect(&path, &common::config(layout), &dir)
        .await
        .unwrap();
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
    send_all(&mut tx, &layout, &d1).await.unwrap();
    send_all(&mut tx, &layout, &d2).await.unwrap();
    let sink = server.await.unwrap();
    common::assert_landed(&sink, &layout, 1, &d1.dst_blocks);
    common::assert_landed(&sink, &layout, 2, &d2.dst_blocks);
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
