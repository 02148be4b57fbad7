//! Same-process backend: zero-copy hand-over (pointer equality), copying path, layout
//! mismatch, validation and peer loss.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use bytes::Bytes;
use duet_kv_transfer::backend::local;
use duet_kv_transfer::{
    Dtype, Error, ErrorClass, Fingerprint, KvKind, KvLayout, KvReceiver, KvSender, MemorySink,
    TransferDesc,
};

#[tokio::test]
async fn local_hand_over_is_zero_copy() {
    let layout = common::model_layout();
    let (mut tx, mut rx) = local::pair(layout, layout, common::fast_timeouts()).unwrap();
    let d = TransferDesc {
        request_id: 11,
        token_start: 0,
        token_count: 32,
        dst_blocks: vec![3, 1],
    };
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 4).with_zero_copy_adoption();
        sink.reserve(11, &[3, 1]).unwrap();
        rx.receive(&mut sink).await.unwrap();
        sink
    });
    tx.begin(d.clone()).await.unwrap();
    let mut sent_ptrs = Vec::new();
    for layer in 0..layout.layers() {
        let (k, v) = common::layer_regions(&layout, 11, layer, &d.dst_blocks);
        let k: Vec<Bytes> = k.into_iter().map(Bytes::from).collect();
        let v: Vec<Bytes> = v.into_iter().map(Bytes::from).collect();
        for (i, &b) in d.dst_blocks.iter().enumerate() {
            sent_ptrs.push((layer, KvKind::K, b, k[i].as_ptr() as usize));
            sent_ptrs.push((layer, KvKind::V, b, v[i].as_ptr() as usize));
        }
        tx.send_layer_bytes(layer, k, v).await.unwrap();
    }
    tx.finish().await.unwrap();
    let sink = server.await.unwrap();
    assert_eq!(sink.regions_handed_out, 0, "no region was copied into");
    for (layer, kind, b, ptr) in sent_ptrs {
        let got = sink.adopted(layer, kind, b).unwrap();
        assert_eq!(
            got.as_ptr() as usize,
            ptr,
            "payload pointer changed: a copy happened"
        );
    }
    common::assert_landed(&sink, &layout, 11, &d.dst_blocks);
}

#[tokio::test]
async fn local_borrowed_slices_are_copied_into_blocks() {
    let layout = common::small_layout();
    let (mut tx, mut rx) = local::pair(layout, layout, common::fast_timeouts()).unwrap();
    let d = TransferDesc {
        request_id: 1,
        token_start: 0,
        token_count: 4,
        dst_blocks: vec![2],
    };
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 3);
        sink.reserve(1, &[2]).unwrap();
        rx.receive(&mut sink).await.unwrap();
        sink
    });
    tx.begin(d.clone()).await.unwrap();
    for layer in 0..layout.layers() {
        let (k, v) = common::layer_regions(&layout, 1, layer, &d.dst_blocks);
        tx.send_layer(layer, &k, &v).await.unwrap();
    }
    tx.finish().await.unwrap();
    let sink = server.await.unwrap();
    common::assert_landed(&sink, &layout, 1, &[2]);
    common::assert_untouched(&sink, &layout, 0);
}

#[tokio::test]
async fn local_layout_mismatch_and_rejections() {
    let a = common::small_layout();
    let b = KvLayout::new(Fingerprint([1; 32]), 3, 2, 8, 8, Dtype::F32).unwrap();
    let e = local::pair(a, b, common::fast_timeouts()).unwrap_err();
    assert!(
        e.to_string().contains("block_size: local=4 remote=8"),
        "{e}"
    );

    let (mut tx, mut rx) = local::pair(a, a, common::fast_timeouts()).unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(a, 3);
        let e = rx.receive(&mut sink).await.unwrap_err();
        (e, sink)
    });
    let d = TransferDesc {
        request_id: 5,
        token_start: 0,
        token_count: 4,
        dst_blocks: vec![0],
    };
    tx.begin(d.clone()).await.unwrap();
    let mut r = Ok(());
    for layer in 0..a.layers() {
        let (k, v) = common::layer_regions(&a, 5, layer, &d.dst_blocks);
        r = tx.send_layer(layer, &k, &v).await;
        if r.is_err() {
            break;
        }
    }
    let e = match r {
        Ok(()) => tx.finish().await.unwrap_err(),
        Err(e) => e,
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
    let (e, sink) = server.await.unwrap();
    assert!(matches!(e.root(), Error::BlockNotReserved { .. }));
    assert_eq!(sink.regions_handed_out, 0);
}

#[tokio::test]
async fn local_sender_drop_reports_blocks_and_bad_regions_are_refused() {
    let l = common::small_layout();
    let (mut tx, mut rx) = local::pair(l, l, common::fast_timeouts()).unwrap();
    let d = TransferDesc {
        request_id: 2,
        token_start: 0,
        token_count: 8,
        dst_blocks: vec![0, 1],
    };
    tx.begin(d.clone()).await.unwrap();
    // Caller mistakes are refused locally and leave the transfer usable.
    let short = vec![vec![0u8; 3]; 2];
    assert!(matches!(
        tx.send_layer(0, &short, &short).await,
        Err(Error::InvalidArgument(_))
    ));
    let (k, v) = common::layer_regions(&l, 2, 0, &d.dst_blocks);
    tx.send_layer(0, &k, &v).await.unwrap();
    assert!(matches!(
        tx.send_layer(0, &k, &v).await,
        Err(Error::DuplicateLayer { layer: 0 })
    ));
    assert!(matches!(
        tx.send_layer(7, &k, &v).await,
        Err(Error::LayerOutOfRange { .. })
    ));
    drop(tx);
    let mut sink = MemorySink::new(l, 2);
    sink.reserve(2, &[0, 1]).unwrap();
    let e = rx.receive(&mut sink).await.unwrap_err();
    assert_eq!(e.class(), ErrorClass::Unavailable);
    assert_eq!(e.blocks_to_release().len(), 2);
}
