//! KV over RDMA (UCX) between separate worker processes, in a build with `--features rdma`
//! (`make test` runs `cargo test -p duet --features rdma --test kv_rdma`; without the
//! feature this file is empty): real etcd, a router, a prefill and a decode worker. The
//! decode worker offers `--kv-rdma-listen` beside tcp, shm is off (on one host it would win),
//! UCX runs over its tcp transport (no RDMA device here). The prefill worker picks rdma, the
//! tokens equal `duet run`'s, both workers count the transfers under `transport="rdma"` and
//! none under tcp, and every block is free afterwards. A prefill worker started with
//! `--kv-rdma off` sends to the same decode worker over tcp.
#![cfg(feature = "rdma")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::time::Duration;

use support::{assert_pool_empty, kv_transfers, remote_greedy, run_reference, Cluster, START};

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Photosynthesis is the process by which plants",
];

#[test]
fn separate_workers_move_kv_over_ucx() {
    let env = [
        ("DUET_KV_SHM", "off"),
        ("DUET_KV_RDMA_LISTEN", "127.0.0.1:0"),
        ("DUET_KV_UCX_TLS", "tcp"),
    ];
    let mut cl = Cluster::start_logged(1, 1, &["--local-prefill-max-tokens", "0"], &env);
    let reference: Vec<Vec<u32>> = PROMPTS.iter().map(|p| run_reference(p, false, 8)).collect();
    let announced = cl.decode[0].wait_for("rdma://", START);
    assert!(announced.starts_with("127.0.0.1:"), "{announced}");
    let prefill_m = cl.prefill[0].wait_for("metrics on", START);
    let decode_m = cl.decode[0].wait_for("metrics on", START);
    let decode_addr = cl.decode[0].workers_addr();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = PROMPTS.len() as f64;

    rt.block_on(async {
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        remote_greedy(&cl.url, PROMPTS, &reference).await;
        assert_pool_empty(&decode_addr, Duration::from_secs(5)).await;
    });
    assert_eq!(kv_transfers(&decode_m, "received", "rdma"), n);
    assert_eq!(kv_transfers(&decode_m, "received", "tcp"), 0.0);
    assert_eq!(kv_transfers(&prefill_m, "sent", "rdma"), n);
    assert_eq!(kv_transfers(&prefill_m, "sent", "tcp"), 0.0);

    // The same decode worker, from a prefill worker that keeps rdma off: tcp.
    cl.prefill[0].kill9();
    let tcp_env = [("DUET_KV_SHM", "off"), ("DUET_KV_RDMA", "off")];
    let tcp_prefill = Cluster::worker_with(
        &cl.etcd,
        &cl.cluster,
        "prefill",
        "prefill-1",
        Some(&tcp_env),
    );
    let tcp_m = tcp_prefill.wait_for("metrics on", START);
    rt.block_on(async {
        // The killed worker's key expires with its lease.
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while cl.registered().iter().any(|i| i == "prefill-0") {
            assert!(
                std::time::Instant::now() < end,
                "prefill-0 still registered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        remote_greedy(&cl.url, PROMPTS, &reference).await;
        assert_pool_empty(&decode_addr, Duration::from_secs(5)).await;
    });
    assert_eq!(kv_transfers(&tcp_m, "sent", "tcp"), n);
    assert_eq!(kv_transfers(&tcp_m, "sent", "rdma"), 0.0);
    assert_eq!(kv_transfers(&decode_m, "received", "tcp"), n);
}
