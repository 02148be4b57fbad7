//! Helpers shared by the integration tests: layouts, secrets, deterministic region contents.
#![allow(dead_code)]

use std::time::Duration;

use duet_kv_transfer::protocol::compress::{decode_region, encode_region};
use duet_kv_transfer::protocol::encode_transfer;
use duet_kv_transfer::{
    Compression, Dtype, Fingerprint, KvKind, KvLayout, KvSender, KvSink, LayerRegions, MemorySink,
    SharedSecret, SinkError, Timeouts, TransferConfig, TransferDesc,
};

/// A sink that implements only the required methods, so receivers take the one-region-at-a-
/// time path instead of `regions_mut` batches.
pub struct PlainSink<'a>(pub &'a mut MemorySink);

impl KvSink for PlainSink<'_> {
    fn is_reserved(&self, request_id: u64, block: u32) -> bool {
        self.0.is_reserved(request_id, block)
    }
    fn region_mut(&mut self, layer: u32, kind: KvKind, block: u32) -> Result<&mut [u8], SinkError> {
        self.0.region_mut(layer, kind, block)
    }
    fn layer_done(&mut self, request_id: u64, layer: u32) {
        self.0.layer_done(request_id, layer)
    }
}

/// A small layout (region = 2 heads * 4 slots * 8 dims * 4 bytes = 256 bytes).
pub fn small_layout() -> KvLayout {
    KvLayout::new(Fingerprint([1; 32]), 3, 2, 8, 4, Dtype::F32).unwrap()
}

/// The default model's layout: 30 layers, 3 KV heads, head dim 64, block 16, f32.
pub fn model_layout() -> KvLayout {
    KvLayout::new(Fingerprint([2; 32]), 30, 3, 64, 16, Dtype::F32).unwrap()
}

pub fn secret() -> SharedSecret {
    SharedSecret::new(b"test secret of at least 16 bytes").unwrap()
}

pub fn fast_timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(5),
        handshake: Duration::from_secs(5),
        io: Duration::from_secs(5),
        idle: Duration::from_secs(5),
        drain: Duration::from_millis(200),
    }
}

pub fn config(layout: KvLayout) -> TransferConfig {
    let mut c = TransferConfig::new(layout, secret());
    c.timeouts = fast_timeouts();
    c
}

/// Deterministic content of region `(layer, kind, block)` of request `req`.
pub fn region(layout: &KvLayout, req: u64, layer: u32, kind: KvKind, block: u32) -> Vec<u8> {
    let k = match kind {
        KvKind::K => 1u64,
        KvKind::V => 2,
    };
    let mut x = req
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(layer) << 40)
        .wrapping_add(k << 32)
        .wrapping_add(u64::from(block))
        | 1;
    (0..layout.region_bytes())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// K and V regions of `layer` for `blocks`.
pub fn layer_regions(
    layout: &KvLayout,
    req: u64,
    layer: u32,
    blocks: &[u32],
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let k = blocks
        .iter()
        .map(|&b| region(layout, req, layer, KvKind::K, b))
        .collect();
    let v = blocks
        .iter()
        .map(|&b| region(layout, req, layer, KvKind::V, b))
        .collect();
    (k, v)
}

/// Asserts that every layer of `blocks` holds the expected content.
pub fn assert_landed(sink: &MemorySink, layout: &KvLayout, req: u64, blocks: &[u32]) {
    for layer in 0..layout.layers() {
        for kind in KvKind::ORDER {
            for &b in blocks {
                let got = sink.region(layer, kind, b).unwrap();
                assert!(
                    got == region(layout, req, layer, kind, b).as_slice(),
                    "layer {layer} {kind:?} block {b} differs"
                );
            }
        }
    }
}

/// Asserts that `block` is still all zeros in every layer.
pub fn assert_untouched(sink: &MemorySink, layout: &KvLayout, block: u32) {
    for layer in 0..layout.layers() {
        for kind in KvKind::ORDER {
            assert!(
                sink.region(layer, kind, block)
                    .unwrap()
                    .iter()
                    .all(|&b| b == 0),
                "block {block} layer {layer} {kind:?} was written"
            );
        }
    }
}

/// A whole transfer of `layers` of request `d`, with the deterministic region contents.
pub fn encode_layers(layout: &KvLayout, d: &TransferDesc, layers: &[u32], crc: bool) -> Vec<u8> {
    let data: Vec<_> = layers
        .iter()
        .map(|&l| (l, layer_regions(layout, d.request_id, l, &d.dst_blocks)))
        .collect();
    let regions: Vec<LayerRegions<'_>> = data
        .iter()
        .map(|(l, (k, v))| LayerRegions {
            layer: *l,
            k: k.iter().map(Vec::as_slice).collect(),
            v: v.iter().map(Vec::as_slice).collect(),
        })
        .collect();
    encode_transfer(layout, d, &regions, crc).unwrap()
}

/// `layer_regions` of `d`; for compression turned into finite f32 values (arbitrary bytes are
/// NaNs the encoder refuses).
pub fn layer_regions_for(
    layout: &KvLayout,
    d: &TransferDesc,
    layer: u32,
    c: Compression,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let (mut k, mut v) = layer_regions(layout, d.request_id, layer, &d.dst_blocks);
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

/// Asserts that every region of `d` holds what `layer_regions_for` sent, after one encode
/// and decode when `c` compresses.
pub fn assert_landed_through(
    sink: &MemorySink,
    layout: &KvLayout,
    d: &TransferDesc,
    c: Compression,
) {
    for layer in 0..layout.layers() {
        let (k, v) = layer_regions_for(layout, d, layer, c);
        for (kind, srcs) in [(KvKind::K, k), (KvKind::V, v)] {
            for (&b, src) in d.dst_blocks.iter().zip(srcs) {
                let want = if c == Compression::None {
                    src
                } else {
                    let mut enc = Vec::new();
                    encode_region(c, layout, &src, &mut enc).unwrap();
                    let mut out = vec![0u8; src.len()];
                    decode_region(c, layout, &enc, &mut out).unwrap();
                    out
                };
                let got = sink.region(layer, kind, b).unwrap();
                assert!(got == want.as_slice(), "layer {layer} {kind:?} block {b}");
            }
        }
    }
}

/// Two transfers for round trips: one spanning blocks 4, 1, 6 (40 tokens), one a single
/// partial block 0 starting at token 16; blocks 2, 3, 5, 7 of an 8-block sink stay untouched.
pub fn two_transfers() -> [TransferDesc; 2] {
    [
        TransferDesc {
            request_id: 1,
            token_start: 0,
            token_count: 40,
            dst_blocks: vec![4, 1, 6],
        },
        TransferDesc {
            request_id: 2,
            token_start: 16,
            token_count: 3,
            dst_blocks: vec![0],
        },
    ]
}

/// Sends every layer of `d` (`layer_regions_for` contents) and finishes.
pub async fn send_transfer(
    tx: &mut impl KvSender,
    layout: &KvLayout,
    d: &TransferDesc,
    c: Compression,
) -> Result<(), duet_kv_transfer::Error> {
    tx.begin(d.clone()).await?;
    for layer in 0..layout.layers() {
        let (k, v) = layer_regions_for(layout, d, layer, c);
        tx.send_layer(layer, &k, &v).await?;
    }
    tx.finish().await.map(|_| ())
}
