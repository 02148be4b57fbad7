//! Property tests of the frame encoder/decoder over arbitrary layouts and block lists, and a
//! short random-input fuzz of the decoder (must never panic or write outside reserved
//! blocks).

mod common;

use duet_kv_transfer::protocol::{decode_transfer, encode_transfer};
use duet_kv_transfer::{
    Dtype, Fingerprint, KvKind, KvLayout, LayerRegions, MemorySink, TransferDesc,
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
    type Regions = Vec<Vec<u8>>;
    let data: Vec<(u32, Regions, Regions)> = case
        .layer_order
        .iter()
        .map(|&layer| {
            let (k, v) =
                common::layer_regions(l, case.desc.request_id, layer, &case.desc.dst_blocks);
            (layer, k, v)
        })
        .collect();
    let layers: Vec<LayerRegions<'_>> = data
        .iter()
        .map(|(layer, k, v)| LayerRegions {
            layer: *layer,
            k: k.iter().map(Vec::as_slice).collect(),
            v: v.iter().map(Vec::as_slice).collect(),
        })
        .collect();
    encode_transfer(l, &case.desc, &layers, case.checksum).unwrap()
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

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
            prop_assert!(r.is_err(), "crc must catch a flipped byte at {}", i);
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
