//! The KV link's frame decoder on arbitrary bytes (what an unauthenticated or broken peer
//! could send after the handshake). Invariants: `duet_kv_transfer::fuzzing::kv_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    duet_kv_transfer::fuzzing::kv_frames(data);
});
