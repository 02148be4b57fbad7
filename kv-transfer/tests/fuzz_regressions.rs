//! The fuzz target's inputs, replayed as ordinary tests: the seeds (valid transfers the
//! fuzzer starts from) and every input a fuzzing run found to crash or hang
//! (`fuzz/regressions/kv_frames/`, added by `scripts/fuzz.sh`). Each must run through the
//! decoder without a panic and without writing outside the reserved blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use std::path::PathBuf;

use duet_kv_transfer::fuzzing::{fuzz_layout, kv_frames, FUZZ_REQUEST, FUZZ_RESERVED};
use duet_kv_transfer::protocol::decode_transfer;
use duet_kv_transfer::{MemorySink, TransferDesc};

fn fuzz_dir(kind: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../fuzz/{kind}/kv_frames"))
}

fn valid_transfer(mac: bool) -> Vec<u8> {
    let layout = fuzz_layout();
    let desc = TransferDesc {
        request_id: FUZZ_REQUEST,
        token_start: 0,
        token_count: 6,
        dst_blocks: FUZZ_RESERVED.to_vec(),
    };
    let layers: Vec<u32> = (0..layout.layers()).collect();
    common::encode_layers(&layout, &desc, &layers, mac)
}

/// The seeds are what the encoder writes today, and the decoder lands them in the reserved
/// blocks: a fuzzer starting from them explores past the header checks. Set
/// `DUET_WRITE_FUZZ_SEEDS=1` to rewrite them after a protocol change.
#[test]
fn seeds_are_valid_transfers() {
    let layout = fuzz_layout();
    for mac in [false, true] {
        let bytes = valid_transfer(mac);
        let mut sink = MemorySink::new(layout, 5);
        sink.reserve(FUZZ_REQUEST, &FUZZ_RESERVED).expect("reserve");
        let receipt = decode_transfer(&layout, &bytes, &mut sink, mac).expect("decode seed");
        assert_eq!(receipt.desc.dst_blocks, FUZZ_RESERVED);
        common::assert_landed(&sink, &layout, FUZZ_REQUEST, &FUZZ_RESERVED);
        let path = fuzz_dir("seeds").join(if mac { "valid-mac.bin" } else { "valid.bin" });
        if std::env::var_os("DUET_WRITE_FUZZ_SEEDS").is_some() {
            std::fs::write(&path, &bytes).expect("write seed");
        }
        let stored = std::fs::read(&path).expect("read seed");
        assert_eq!(
            stored,
            bytes,
            "{} is stale: rerun with DUET_WRITE_FUZZ_SEEDS=1",
            path.display()
        );
    }
}

#[test]
fn past_findings_and_seeds_do_not_panic() {
    let mut n = 0;
    for kind in ["seeds", "regressions"] {
        let Ok(dir) = std::fs::read_dir(fuzz_dir(kind)) else {
            continue;
        };
        for entry in dir {
            let path = entry.expect("dir entry").path();
            if path.is_file() && path.file_name().is_some_and(|n| n != ".gitkeep") {
                kv_frames(&std::fs::read(&path).expect("read input"));
                n += 1;
            }
        }
    }
    assert!(
        n >= 2,
        "no fuzz inputs found under fuzz/seeds and fuzz/regressions"
    );
}
