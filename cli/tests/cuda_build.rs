//! The binary built with `--features duet/cuda` (scripts/check-cuda-build.sh), as a user
//! without a GPU meets it: it starts, `--device cuda[:N]` is refused at start with exit code
//! 2 naming the missing driver (never a panic, never a hang), and the CPU device still
//! serves. On CI the driver is a stub library whose every call fails
//! (`CUDA_ERROR_STUB_LIBRARY`), which is what cudarc sees on a machine without one.
//!
//! Compiled only into the cuda build: the CPU-only build has its own device tests
//! (`run.rs::a_device_that_is_not_there_is_refused_with_exit_code_2`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::path::PathBuf;

#[path = "support/reference.rs"]
#[allow(dead_code)]
mod reference;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Runs duet and gives up (killing it) after `limit`: a refusal must be prompt.
fn duet_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(args)
        .env_remove("DUET_MODEL")
        // candle appends a backtrace to its errors when this is set: the refusal must not.
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start duet: does the loader find libcuda.so.1 (source .venv/cuda/env.sh)?");
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            child.kill().unwrap();
            panic!("duet {args:?} still running after {limit:?}: a hang, not a refusal");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_cuda_build_starts_without_a_gpu() {
    let o = duet_within(&["--version"], Duration::from_secs(30));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("duet "));
}

#[test]
fn device_cuda_is_refused_at_start_naming_the_driver() {
    let m = model();
    let m = m.to_str().unwrap();
    let cases: [&[&str]; 5] = [
        &["run", "--model", m, "--prompt", "Hi", "--device", "cuda"],
        &["run", "--model", m, "--prompt", "Hi", "--device", "cuda:7"],
        &[
            "run", "--model", m, "--prompt", "Hi", "--device", "cuda:0", "--engine", "candle",
        ],
        &["bench", "engine", "--model", m, "--device", "cuda:0"],
        &["up", "--model", m, "--device", "cuda:0"],
    ];
    for args in cases {
        let o = duet_within(args, Duration::from_secs(60));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("libcuda.so.1"), "{args:?}: {err}");
        assert!(err.contains("cuda:"), "{args:?} names the device: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one line: {err}"
        );
        assert!(o.stdout.is_empty(), "{args:?}: nothing generated");
    }
}

/// The CPU device still serves in a cuda build: the candle engine (compiled with CUDA
/// support, running on the CPU device) gives llama.cpp's tokens on the reference prompt it
/// follows longest (v08, as `run.rs` checks in the CPU-only build).
#[test]
fn the_cpu_device_serves_in_a_cuda_build() {
    let v08 = reference::case("v08-emoji");
    let n = v08.greedy_ids.len().to_string();
    let m = model();
    let o = duet_within(
        &[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--device",
            "cpu",
            "--engine",
            "candle",
            "--prompt",
            &v08.prompt,
            "--max-tokens",
            &n,
            "--json",
        ],
        Duration::from_secs(300),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ids: Vec<u32> = serde_json::from_value(out["ids"].clone()).unwrap();
    assert_eq!(ids, v08.greedy_ids);
}
