//! Feeds arbitrary bytes to the frame decoder. Invariants checked: no panic, and nothing is
//! written outside the reserved blocks (block 3 of request 7 is the only reservation).
#![no_main]

use duet_kv_transfer::protocol::decode_transfer;
use duet_kv_transfer::{Dtype, Fingerprint, KvKind, KvLayout, MemorySink};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks a layout so that several geometries are explored.
    let (sel, rest) = match data.split_first() {
        Some((s, r)) => (*s, r),
        None => (0, data),
    };
    let layout = KvLayout::new(
        Fingerprint([0; 32]),
        1 + u32::from(sel & 3),
        1 + u32::from((sel >> 2) & 1),
        8,
        1 + u32::from((sel >> 3) & 3),
        if sel & 0x20 == 0 { Dtype::F32 } else { Dtype::F16 },
    )
    .expect("valid layout");
    let mut sink = MemorySink::new(layout, 4);
    sink.reserve(7, &[3]).expect("reserve");
    let _ = decode_transfer(&layout, rest, &mut sink, sel & 0x40 != 0);
    for block in 0..3 {
        for layer in 0..layout.layers() {
            for kind in KvKind::ORDER {
                let region = sink.region(layer, kind, block).expect("region");
                assert!(region.iter().all(|&b| b == 0), "wrote outside reserved blocks");
            }
        }
    }
});
