//! Table test of `select_backend`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use duet_kv_transfer::{select_backend, BackendCaps, BackendKind, EndpointInfo, ErrorClass};

fn ep(host: &str, pid: u64, gpu: bool, nccl: bool, rdma: bool, tcp: bool) -> EndpointInfo {
    EndpointInfo {
        host_id: host.into(),
        process_id: pid,
        tcp,
        shm: true,
        gpu,
        nccl,
        rdma,
    }
}

const ALL: BackendCaps = BackendCaps {
    local: true,
    shm: true,
    nccl: true,
    rdma: true,
    tcp: true,
};
const CPU_ONLY: BackendCaps = BackendCaps {
    local: true,
    shm: true,
    nccl: false,
    rdma: false,
    tcp: true,
};
const NONE: BackendCaps = BackendCaps {
    local: false,
    shm: false,
    nccl: false,
    rdma: false,
    tcp: false,
};

#[test]
fn selection_table() {
    let plain_a = ep("a", 1, false, false, false, true);
    let gpu_a = ep("a", 1, true, true, false, true);
    let gpu_b = ep("b", 2, true, true, false, true);
    let rdma_a = ep("a", 1, false, false, true, true);
    let rdma_b = ep("b", 2, false, false, true, true);
    let cases: Vec<(
        &str,
        EndpointInfo,
        EndpointInfo,
        BackendCaps,
        Option<BackendKind>,
    )> = vec![
        (
            "same process",
            plain_a.clone(),
            ep("a", 1, false, false, false, true),
            ALL,
            Some(BackendKind::Local),
        ),
        (
            "same process, local off -> shm",
            plain_a.clone(),
            plain_a.clone(),
            BackendCaps {
                local: false,
                ..ALL
            },
            Some(BackendKind::Shm),
        ),
        (
            "same host",
            plain_a.clone(),
            ep("a", 2, false, false, false, true),
            ALL,
            Some(BackendKind::Shm),
        ),
        (
            "same host, GPUs: shm still first",
            gpu_a.clone(),
            ep("a", 9, true, true, false, true),
            ALL,
            Some(BackendKind::Shm),
        ),
        (
            "same host, dst without shm -> tcp",
            plain_a.clone(),
            EndpointInfo {
                shm: false,
                ..ep("a", 2, false, false, false, true)
            },
            CPU_ONLY,
            Some(BackendKind::Tcp),
        ),
        (
            "gpus + nccl",
            gpu_a.clone(),
            gpu_b.clone(),
            ALL,
            Some(BackendKind::Nccl),
        ),
        (
            "gpus + nccl, not compiled -> tcp",
            gpu_a.clone(),
            gpu_b.clone(),
            CPU_ONLY,
            Some(BackendKind::Tcp),
        ),
        (
            "one side without nccl -> tcp",
            gpu_a.clone(),
            ep("b", 2, true, false, false, true),
            ALL,
            Some(BackendKind::Tcp),
        ),
        (
            "rdma",
            rdma_a.clone(),
            rdma_b.clone(),
            ALL,
            Some(BackendKind::Rdma),
        ),
        (
            "rdma on one side -> tcp",
            rdma_a.clone(),
            ep("b", 2, false, false, false, true),
            ALL,
            Some(BackendKind::Tcp),
        ),
        (
            "plain remote",
            plain_a.clone(),
            ep("b", 1, false, false, false, true),
            ALL,
            Some(BackendKind::Tcp),
        ),
        (
            "remote without tcp",
            plain_a.clone(),
            ep("b", 1, false, false, false, false),
            ALL,
            None,
        ),
        (
            "nothing enabled",
            plain_a.clone(),
            plain_a.clone(),
            NONE,
            None,
        ),
        (
            "empty host id",
            ep("", 1, false, false, false, true),
            plain_a.clone(),
            ALL,
            None,
        ),
    ];
    for (name, src, dst, caps, want) in cases {
        let got = select_backend(&src, &dst, &caps);
        match (want, got) {
            (Some(w), Ok(g)) => assert_eq!(g, w, "{name}"),
            (None, Err(e)) => assert_eq!(e.class(), ErrorClass::InvalidArgument, "{name}: {e}"),
            (w, g) => panic!("{name}: wanted {w:?}, got {g:?}"),
        }
    }
}

#[test]
fn compiled_caps_and_names() {
    let caps = BackendCaps::compiled();
    assert!(caps.tcp && caps.local);
    assert_eq!(caps.nccl, cfg!(feature = "nccl"));
    assert_eq!(caps.rdma, cfg!(feature = "rdma"));
    for k in [
        BackendKind::Local,
        BackendKind::Shm,
        BackendKind::Nccl,
        BackendKind::Rdma,
        BackendKind::Tcp,
    ] {
        assert_eq!(k.as_str().parse::<BackendKind>().unwrap(), k);
    }
    assert!("carrier-pigeon".parse::<BackendKind>().is_err());
}
