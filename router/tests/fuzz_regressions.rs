//! The `openai_request` fuzz target's inputs replayed as ordinary tests: its seeds and every
//! input a fuzzing run found to crash or hang (`fuzz/regressions/openai_request/`, added by
//! `scripts/fuzz.sh`). None may panic.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::path::PathBuf;

use duet_router::http::fuzzing::openai_request;

#[test]
fn past_findings_and_seeds_do_not_panic() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut n = 0;
    for kind in ["seeds", "regressions"] {
        let Ok(dir) = std::fs::read_dir(root.join(kind).join("openai_request")) else {
            continue;
        };
        for entry in dir {
            let path = entry.expect("dir entry").path();
            if path.is_file() && path.file_name().is_some_and(|n| n != ".gitkeep") {
                openai_request(&std::fs::read(&path).expect("read input"));
                n += 1;
            }
        }
    }
    assert!(
        n >= 4,
        "the seeds under fuzz/seeds/openai_request are missing"
    );
}
