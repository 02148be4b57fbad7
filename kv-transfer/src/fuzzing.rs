//! Entry points for the fuzz targets in `fuzz/` and for the regression tests that replay
//! their corpus of past findings (`fuzz/regressions/`). Each takes arbitrary bytes and
//! asserts the decoder's invariants; a panic is a finding.
//!
//! Invariants of [`kv_frames`]: decoding never panics, whatever the bytes; a transfer is
//! accepted only for blocks reserved for its request; nothing is written into a block
//! that was not reserved for it (the unreserved blocks stay zero).

use crate::layout::{Dtype, Fingerprint, KvKind, KvLayout};
use crate::mem_sink::MemorySink;
use crate::protocol::decode_transfer;

/// The request the fuzzed bytes may write into, and its reserved blocks.
pub const FUZZ_REQUEST: u64 = 7;
pub const FUZZ_RESERVED: [u32; 2] = [1, 3];
const BLOCKS: u32 = 5;

/// The layout fuzzed transfers are decoded against (small: 2 layers, 2 heads, 4 dims, 4
/// tokens per block, f32: 128-byte regions).
pub fn fuzz_layout() -> KvLayout {
    KvLayout::new(Fingerprint([9; 32]), 2, 2, 4, 4, Dtype::F32)
        .unwrap_or_else(|e| panic!("the fuzz layout is valid: {e}"))
}

/// Decodes `data` as one KV transfer (with and without MACs required) into a cache
/// where only [`FUZZ_RESERVED`] are reserved for [`FUZZ_REQUEST`].
pub fn kv_frames(data: &[u8]) {
    let layout = fuzz_layout();
    for require_mac in [false, true] {
        let mut sink = MemorySink::new(layout, BLOCKS);
        if let Err(e) = sink.reserve(FUZZ_REQUEST, &FUZZ_RESERVED) {
            panic!("reserving the fuzz blocks: {e}");
        }
        let r = decode_transfer(&layout, data, &mut sink, require_mac);
        if let Ok(receipt) = &r {
            assert_eq!(
                receipt.desc.request_id, FUZZ_REQUEST,
                "a transfer for another request was accepted"
            );
        }
        for block in (0..BLOCKS).filter(|b| !FUZZ_RESERVED.contains(b)) {
            for layer in 0..layout.layers() {
                for kind in [KvKind::K, KvKind::V] {
                    let region = sink.region(layer, kind, block).unwrap_or(&[]);
                    assert!(
                        region.iter().all(|&b| b == 0),
                        "bytes written into unreserved block {block} (layer {layer}, {kind:?})"
                    );
                }
            }
        }
    }
}
