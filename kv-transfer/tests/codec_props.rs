//! Property tests of the frame encoder/decoder over arbitrary layouts and block lists, and a
//! short random-input fuzz of the decoder (must never panic or write outside reserved
//! blocks).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_kv_transfer::protocol::compress::{decode_region, encode_region};
use duet_kv_transfer::protocol::{decode_transfer, encode_transfer, encode_transfer_compressed};
use duet_kv_transfer::{
    Compression, Dtype, Fingerprint, KvKind, KvLayout, LayerRegions, MemorySink, TransferDesc,
};
use proptest::prelude::*;

const SINK_BLOCKS: u32 = 12;

#[derive(Debug, Clone)]
struct Case {
    layout: KvLayout,
    desc: TransferDesc,
    layer_order: Vec<u32>,
    checksum: bool,
}

fn arb_layout() -> impl Strategy<Value = KvLayout> {
    (
        1u32..=4,
        1u32..=3,
        1u32..=8,
        1u32..=6,
        any::<bool>(),
        any::<u8>(),
    )
        .prop_map(|(layers, heads, dim, bs, f16, fp)| {
            let dtype = if f16 { Dtype::F16 } else { Dtype::F32 };
            KvLayout::new(Fingerprint([fp; 32]), layers, heads, dim, bs, dtype).unwrap()
        })
}

fn arb_case() -> impl Strategy<Value = Case> {
    (
        arb_layout(),
        1usize..=6,
        any::<u64>(),
        0u32..3,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(|(layout, n, req, start_blocks, checksum, seed)| {
            let bs = layout.block_size();
            let blocks = Just((0..SINK_BLOCKS).collect::<Vec<u32>>()).prop_shuffle();
            let order = Just((0..layout.layers()).collect::<Vec<u32>>()).prop_shuffle();
            let tokens = ((n as u32 - 1) * bs + 1)..=(n as u32 * bs);
            (blocks, order, tokens).prop_map(move |(blocks, order, tokens)| Case {
                layout,
                desc: TransferDesc {
                    request_id: req ^ seed,
                    token_start: start_blocks * bs,
                    token_count: tokens,
                    dst_blocks: blocks[..n].to_vec(),
                },
                layer_order: order,
                checksum,
            })
        })
}

fn encode(case: &Case) -> Vec<u8> {
    let l = &case.layout;
    let data: Vec<SourceLayer> = case
        .layer_order
        .iter()
        .map(|&layer| {
            let (k, v) =
                common::layer_regions(l, case.desc.request_id, layer, &case.desc.dst_blocks);
            (layer, k, v)
        })
        .collect();
    encode_layers(case, &data, Compression::None)
}

/// One layer's index and its K and V source regions.
type SourceLayer = (u32, Vec<Vec<u8>>, Vec<Vec<u8>>);

/// `case`'s transfer of `data` (in its order), encoded by `c`.
fn encode_layers(case: &Case, data: &[SourceLayer], c: Compression) -> Vec<u8> {
    let layers: Vec<LayerRegions<'_>> = data
        .iter()
        .map(|(layer, k, v)| LayerRegions {
            layer: *layer,
            k: k.iter().map(Vec::as_slice).collect(),
            v: v.iter().map(Vec::as_slice).collect(),
        })
        .collect();
    if c == Compression::None {
        encode_transfer(&case.layout, &case.desc, &layers, case.checksum).unwrap()
    } else {
        encode_transfer_compressed(&case.layout, &case.desc, &layers, case.checksum, c).unwrap()
    }
}

fn sink_for(case: &Case) -> MemorySink {
    let mut sink = MemorySink::new(case.layout, SINK_BLOCKS);
    sink.reserve(case.desc.request_id, &case.desc.dst_blocks)
        .unwrap();
    sink
}

fn assert_only_reserved_written(sink: &MemorySink, case: &Case) {
    for b in 0..SINK_BLOCKS {
        if !case.desc.dst_blocks.contains(&b) {
            common::assert_untouched(sink, &case.layout, b);
        }
    }
}

/// Finite KV values in `[-4, 4)` derived from the deterministic region bytes (compressed
/// encodings refuse non-finite values, which random bytes would contain).
fn float_region(layout: &KvLayout, req: u64, layer: u32, kind: KvKind, block: u32) -> Vec<u8> {
    let raw = common::region(layout, req, layer, kind, block);
    match layout.dtype() {
        Dtype::F32 => raw
            .chunks_exact(4)
            .flat_map(|c| {
                let u = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) >> 8;
                ((u as f32 / (1u32 << 24) as f32 - 0.5) * 8.0).to_le_bytes()
            })
            .collect(),
        Dtype::F16 => raw
            .chunks_exact(2)
            .flat_map(|c| {
                let u = u16::from_le_bytes([c[0], c[1]]);
                half::f16::from_f32((f32::from(u) / 65536.0 - 0.5) * 8.0).to_le_bytes()
            })
            .collect(),
    }
}

/// A compressed transfer of `case` (its layer order and block list) and its regions.
fn encode_compressed(case: &Case, c: Compression) -> (Vec<u8>, Vec<SourceLayer>) {
    let l = &case.layout;
    let r = |layer, kind, b| float_region(l, case.desc.request_id, layer, kind, b);
    let data: Vec<SourceLayer> = case
        .layer_order
        .iter()
        .map(|&layer| {
            let blocks = &case.desc.dst_blocks;
            let k = blocks.iter().map(|&b| r(layer, KvKind::K, b)).collect();
            let v = blocks.iter().map(|&b| r(layer, KvKind::V, b)).collect();
            (layer, k, v)
        })
        .collect();
    (encode_layers(case, &data, c), data)
}

fn arb_compression() -> impl Strategy<Value = Compression> {
    prop_oneof![Just(Compression::F16), Just(Compression::Int8)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn compressed_round_trip(case in arb_case(), c in arb_compression()) {
        let (bytes, data) = encode_compressed(&case, c);
        let l = &case.layout;
        let used = c.effective(l.dtype());
        let mut sink = sink_for(&case);
        let receipt = decode_transfer(l, &bytes, &mut sink, case.checksum).unwrap();
        let n = case.desc.dst_blocks.len();
        prop_assert_eq!(receipt.compression, used);
        prop_assert_eq!(receipt.payload_bytes, u64::from(l.layers()) * l.layer_frame_bytes(n));
        prop_assert_eq!(receipt.wire_bytes, u64::from(l.layers()) * used.layer_wire_bytes(l, n));
        // Smaller once a head's slots outweigh its 4-byte int8 scale.
        let saved_per_head = u64::from(l.block_size() * l.head_dim() * (l.dtype().bytes() - 1));
        if used == Compression::F16 || (used == Compression::Int8 && saved_per_head > 4) {
            prop_assert!(receipt.wire_bytes < receipt.payload_bytes);
        }
        // Every region holds exactly what one encode + decode of its source gives.
        let mut wire = Vec::new();
        let mut want = vec![0u8; l.region_bytes()];
        for (layer, k, v) in &data {
            for (kind, regions) in [(KvKind::K, k), (KvKind::V, v)] {
                for (src, &b) in regions.iter().zip(&case.desc.dst_blocks) {
                    wire.clear();
                    encode_region(used, l, src, &mut wire).unwrap();
                    decode_region(used, l, &wire, &mut want).unwrap();
                    prop_assert!(sink.region(*layer, kind, b) == Some(&want[..]));
                }
            }
        }
        assert_only_reserved_written(&sink, &case);
    }

    #[test]
    fn compressed_corruption_stays_in_reserved_blocks(case in arb_case(), c in arb_compression(), pos in any::<prop::sample::Index>(), xor in 1u8..=255, cut in any::<prop::sample::Index>()) {
        let (bytes, _) = encode_compressed(&case, c);
        let mut flipped = bytes.clone();
        let i = pos.index(flipped.len());
        flipped[i] ^= xor;
        let mut sink = sink_for(&case);
        let r = decode_transfer(&case.layout, &flipped, &mut sink, false);
        if case.checksum {
            prop_assert!(r.is_err(), "the MAC must catch a flipped byte at {}", i);
        }
        assert_only_reserved_written(&sink, &case);
        let n = cut.index(bytes.len());
        let mut sink = sink_for(&case);
        prop_assert!(decode_transfer(&case.layout, &bytes[..n], &mut sink, false).is_err());
        assert_only_reserved_written(&sink, &case);
    }

    #[test]
    fn round_trip(case in arb_case(), batched in any::<bool>()) {
        let bytes = encode(&case);
        let mut sink = sink_for(&case);
        let receipt = if batched {
            decode_transfer(&case.layout, &bytes, &mut sink, case.checksum).unwrap()
        } else {
            decode_transfer(&case.layout, &bytes, &mut common::PlainSink(&mut sink), case.checksum).unwrap()
        };
        prop_assert_eq!(&receipt.desc, &case.desc);
        prop_assert_eq!(receipt.layers, case.layout.layers());
        prop_assert_eq!(
            receipt.payload_bytes,
            u64::from(case.layout.layers()) * case.layout.layer_frame_bytes(case.desc.dst_blocks.len())
        );
        common::assert_landed(&sink, &case.layout, case.desc.request_id, &case.desc.dst_blocks);
        assert_only_reserved_written(&sink, &case);
        let done: Vec<u32> = sink.layers_done.iter().map(|(_, l)| *l).collect();
        prop_assert_eq!(done, case.layer_order.clone());
    }

    #[test]
    fn corrupted_streams_fail_cleanly(case in arb_case(), pos in any::<prop::sample::Index>(), xor in 1u8..=255, cut in any::<prop::sample::Index>()) {
        let bytes = encode(&case);
        // Flip one byte.
        let mut flipped = bytes.clone();
        let i = pos.index(flipped.len());
        flipped[i] ^= xor;
        let mut sink = sink_for(&case);
        let r = decode_transfer(&case.layout, &flipped, &mut common::PlainSink(&mut sink), false);
        if case.checksum {
            prop_assert!(r.is_err(), "the MAC must catch a flipped byte at {}", i);
        }
        assert_only_reserved_written(&sink, &case);
        // Truncate.
        let n = cut.index(bytes.len());
        let mut sink = sink_for(&case);
        let r = decode_transfer(&case.layout, &bytes[..n], &mut sink, false);
        prop_assert!(r.is_err());
        assert_only_reserved_written(&sink, &case);
        if let Err(e) = r {
            // Once the header was accepted, every reserved block is reported for release.
            if !e.blocks_to_release().is_empty() {
                let mut want = case.desc.dst_blocks.clone();
                let mut got = e.blocks_to_release().to_vec();
                want.sort_unstable();
                got.sort_unstable();
                prop_assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048), layout in arb_layout(), prefix in any::<bool>()) {
        // Optionally start with a plausible BEGIN header so that deeper states are reached.
        let mut input = Vec::new();
        if prefix {
            input.extend_from_slice(&[1u8, 0, 0, 0, 0, 0, 0, 0]);
            input.extend_from_slice(&(24u64 + 4).to_le_bytes());
            input.extend_from_slice(&7u64.to_le_bytes());
            input.extend_from_slice(&0u32.to_le_bytes());
            input.extend_from_slice(&layout.block_size().to_le_bytes());
            input.extend_from_slice(&1u32.to_le_bytes());
            input.extend_from_slice(&0u32.to_le_bytes());
            input.extend_from_slice(&3u32.to_le_bytes());
        }
        input.extend_from_slice(&bytes);
        let mut sink = MemorySink::new(layout, 4);
        sink.reserve(7, &[3]).unwrap();
        let _ = decode_transfer(&layout, &input, &mut sink, false);
        for b in 0..3 {
            common::assert_untouched(&sink, &layout, b);
        }
        let _ = KvKind::K;
    }
}
