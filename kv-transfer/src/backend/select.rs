//! Backend selection: a pure function of the two endpoints and this build's capabilities.
//!
//! Order of preference (first that both endpoints and the build support wins):
//! same process → `local`; same host → `shm`; both have GPUs and NCCL → `nccl`; both have
//! RDMA → `rdma`; both reachable over TCP → `tcp`; otherwise an error explaining why.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A transfer backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Same process: `Bytes` hand-over.
    Local,
    /// Same host: shared-memory ring plus unix-socket doorbell.
    Shm,
    /// GPU to GPU over NCCL.
    Nccl,
    /// RDMA through UCX (feature `rdma`).
    Rdma,
    /// TCP.
    Tcp,
}

impl BackendKind {
    /// Lower-case name (`tcp`, `shm`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Local => "local",
            BackendKind::Shm => "shm",
            BackendKind::Nccl => "nccl",
            BackendKind::Rdma => "rdma",
            BackendKind::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "local" => Ok(BackendKind::Local),
            "shm" => Ok(BackendKind::Shm),
            "nccl" => Ok(BackendKind::Nccl),
            "rdma" => Ok(BackendKind::Rdma),
            "tcp" => Ok(BackendKind::Tcp),
            other => Err(Error::InvalidArgument(format!(
                "unknown backend {other:?} (expected local, shm, nccl, rdma or tcp)"
            ))),
        }
    }
}

/// What one worker endpoint is and can do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointInfo {
    /// Stable host identity (e.g. `/etc/machine-id`); equal strings mean the same host.
    pub host_id: String,
    /// Identity of the process (e.g. random per start); equal on the same host means the same
    /// process.
    pub process_id: u64,
    /// Reachable over TCP.
    pub tcp: bool,
    /// Can use a shared-memory ring.
    pub shm: bool,
    /// Holds its KV cache on a GPU.
    pub gpu: bool,
    /// Has NCCL.
    pub nccl: bool,
    /// Has an RDMA-capable NIC and stack.
    pub rdma: bool,
}

/// Backends this build (or this deployment) allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendCaps {
    /// `local` allowed.
    pub local: bool,
    /// `shm` allowed.
    pub shm: bool,
    /// `nccl` allowed.
    pub nccl: bool,
    /// `rdma` allowed.
    pub rdma: bool,
    /// `tcp` allowed.
    pub tcp: bool,
}

impl BackendCaps {
    /// Backends compiled into this build: local, shm (unix), tcp, nccl with the `nccl`
    /// feature and rdma with the `rdma` feature.
    pub fn compiled() -> Self {
        BackendCaps {
            local: true,
            shm: cfg!(unix),
            nccl: cfg!(feature = "nccl"),
            rdma: cfg!(feature = "rdma"),
            tcp: true,
        }
    }
}

/// Picks the backend for sending KV from `src` to `dst`.
pub fn select_backend(
    src: &EndpointInfo,
    dst: &EndpointInfo,
    caps: &BackendCaps,
) -> Result<BackendKind> {
    if src.host_id.is_empty() || dst.host_id.is_empty() {
        return Err(Error::InvalidArgument(
            "endpoint host_id must not be empty".into(),
        ));
    }
    let same_host = src.host_id == dst.host_id;
    let same_process = same_host && src.process_id == dst.process_id;
    let mut ruled_out = Vec::new();
    if same_process {
        if caps.local {
            return Ok(BackendKind::Local);
        }
        ruled_out.push("local disabled");
    }
    if same_host {
        if caps.shm && src.shm && dst.shm {
            return Ok(BackendKind::Shm);
        }
        ruled_out.push("shm unsupported by an endpoint or disabled");
    }
    if src.gpu && dst.gpu && src.nccl && dst.nccl {
        if caps.nccl {
            return Ok(BackendKind::Nccl);
        }
        ruled_out.push("nccl not compiled in or disabled");
    }
    if src.rdma && dst.rdma {
        if caps.rdma {
            return Ok(BackendKind::Rdma);
        }
        ruled_out.push("rdma not compiled in or disabled");
    }
    if src.tcp && dst.tcp && caps.tcp {
        return Ok(BackendKind::Tcp);
    }
    ruled_out.push("tcp unsupported by an endpoint or disabled");
    Err(Error::NoBackend {
        src: format!("{}/{}", src.host_id, src.process_id),
        dst: format!("{}/{}", dst.host_id, dst.process_id),
        reason: ruled_out.join("; "),
    })
}
