//! KV over shared memory between separate worker processes on one host: real etcd, a
//! router, a prefill and a decode worker started with their defaults (shm on). The decode
//! worker offers a unix socket beside tcp, the prefill worker sees it is on the same host and
//! picks shm, and the tokens equal `duet run`'s. A decode worker killed with SIGKILL leaves
//! its socket behind; the next one to start in that directory removes it, serves over shm in
//! turn, and removes its own socket when it stops gracefully. The decode worker copies every
//! layer from its mapping of the prefill worker's send arena. A `--kv-shm-dir` that cannot
//! be used stops the decode worker with an error naming the flag.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::{kv_transfers, remote_greedy, run_reference, Cluster, START};

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Photosynthesis is the process by which plants",
];

/// The socket path a decode worker announced (`KV on ..., shm://<host>:<path>`).
fn announced_socket(p: &support::Proc) -> PathBuf {
    let addr = p.wait_for("shm://", START);
    let (_, path) = addr.split_once(':').expect("<host>:<path>");
    PathBuf::from(path)
}

/// Layers a decode worker pulled over shm from `source` (`send_arena`, `process_memory`).
fn shm_pulls(metrics_url: &str, source: &str) -> f64 {
    let (_, m) = support::http_get(metrics_url);
    support::scrape_sum(
        &m,
        "duet_kv_transfer_shm_pulls_total",
        &[&format!("source=\"{source}\"")],
    )
}

/// Every prompt, greedy: `duet run`'s tokens, prefilled remotely, decoded on `worker`.
async fn run_all(cl: &Cluster, reference: &[Vec<u32>], worker: &str) {
    cl.wait_workers(1, 1, Duration::from_secs(20)).await;
    for t in remote_greedy(&cl.url, PROMPTS, reference).await {
        assert_eq!(t.decode_worker, worker);
    }
}

#[test]
fn separate_workers_on_one_host_move_kv_over_shm() {
    let dir = std::env::temp_dir().join(format!("duet-kv-shm-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir_s = dir.to_string_lossy().to_string();
    let env = [("DUET_KV_SHM", "on"), ("DUET_KV_SHM_DIR", dir_s.as_str())];
    let mut cl = Cluster::start_logged(1, 1, &["--local-prefill-max-tokens", "0"], &env);
    let reference: Vec<Vec<u32>> = PROMPTS.iter().map(|p| run_reference(p, false, 8)).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let socket = announced_socket(&cl.decode[0]);
    assert!(socket.starts_with(&dir), "{socket:?} not in {dir:?}");
    assert!(socket.exists(), "{socket:?}");
    let prefill_m = cl.prefill[0].wait_for("metrics on", START);
    let decode_m = cl.decode[0].wait_for("metrics on", START);

    rt.block_on(run_all(&cl, &reference, "decode-0"));
    let n = PROMPTS.len() as f64;
    assert!(kv_transfers(&decode_m, "received", "shm") >= n);
    assert_eq!(kv_transfers(&decode_m, "received", "tcp"), 0.0);
    assert!(kv_transfers(&prefill_m, "sent", "shm") >= n);
    assert_eq!(kv_transfers(&prefill_m, "sent", "tcp"), 0.0);
    // The prefill worker lays its layers out in its send arena (on by default), which the
    // decode worker maps: every layer is a memcpy from it, none a process_vm_readv.
    assert!(shm_pulls(&decode_m, "send_arena") >= 30.0 * n);
    assert_eq!(shm_pulls(&decode_m, "process_memory"), 0.0);

    // SIGKILL: nothing removes the socket...
    cl.decode[0].kill9();
    assert!(socket.exists(), "a killed worker cannot clean up");
    // ...until the next decode worker starting in that directory.
    let next = Cluster::worker_with(&cl.etcd, &cl.cluster, "decode", "decode-1", Some(&env));
    assert!(
        !socket.exists(),
        "the stale socket {socket:?} is still there"
    );
    let next_socket = announced_socket(&next);
    let next_m = next.wait_for("metrics on", START);
    rt.block_on(async {
        // The killed worker's key expires with its lease.
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while cl.registered().iter().any(|i| i == "decode-0") {
            assert!(std::time::Instant::now() < end, "decode-0 still registered");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    rt.block_on(run_all(&cl, &reference, "decode-1"));
    assert!(kv_transfers(&next_m, "received", "shm") >= n);

    // A graceful stop removes the socket.
    let mut next = next;
    assert_eq!(next.terminate(Duration::from_secs(20)), Some(0));
    assert!(!next_socket.exists(), "{next_socket:?} left after SIGTERM");

    // Asked for explicitly, a directory that cannot hold the socket is an error at start.
    let ep = cl.etcd.endpoint();
    let mut bad = support::Proc::start_logged(
        "decode-bad",
        &[
            "decode",
            "--etcd",
            &ep,
            "--cluster",
            &cl.cluster,
            "--kv-shm-dir",
            "/nonexistent/duet-kv",
        ],
        &[("DUET_KV_SHM", "on")],
    );
    let code = bad.wait_exit(START);
    assert!(matches!(code, Some(c) if c != 0), "exit {code:?}");
    let logs = bad.log_lines().join("\n");
    assert!(logs.contains("--kv-shm-dir /nonexistent/duet-kv"), "{logs}");
    let _ = std::fs::remove_dir_all(&dir);
}
