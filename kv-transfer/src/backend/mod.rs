//! Transfer backends behind the [`KvSender`] / [`KvReceiver`] traits, plus [`AnySender`] /
//! [`AnyReceiver`] to hold whichever [`select_backend`] picked.
//!
//! Invariant: every backend uses the same validation (layout, reservations, layer range,
//! duplicates, sizes) and reports failures with the same [`crate::Error`] variants.

/// Implements [`KvSender`] / [`KvReceiver`] for a backend type that wraps a
/// `SenderCore` / `ReceiverCore` in a field named `core` (all but `local`).
macro_rules! via_core {
    (sender $t:ty) => {
        impl $crate::api::KvSender for $t {
            async fn begin(
                &mut self,
                desc: $crate::layout::TransferDesc,
            ) -> $crate::error::Result<()> {
                self.core.begin(desc).await
            }

            async fn send_layer<R: AsRef<[u8]> + Sync>(
                &mut self,
                layer: u32,
                k: &[R],
                v: &[R],
            ) -> $crate::error::Result<()> {
                self.core.send_layer(layer, k, v).await
            }

            async fn send_layer_bytes(
                &mut self,
                layer: u32,
                k: Vec<bytes::Bytes>,
                v: Vec<bytes::Bytes>,
            ) -> $crate::error::Result<()> {
                self.core.send_layer_bytes(layer, k, v).await
            }

            async fn finish(&mut self) -> $crate::error::Result<$crate::api::TransferReceipt> {
                self.core.finish().await
            }

            async fn abort(&mut self) -> $crate::error::Result<()> {
                self.core.abort().await
            }
        }
    };
    (receiver $t:ty) => {
        impl $crate::api::KvReceiver for $t {
            async fn receive<S: $crate::sink::KvSink + Send>(
                &mut self,
                sink: &mut S,
            ) -> $crate::error::Result<$crate::api::TransferReceipt> {
                self.core.receive(sink).await
            }
        }
    };
}

pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod select;
#[cfg(unix)]
pub mod shm;
pub mod tcp;

use bytes::Bytes;

use crate::api::{KvReceiver, KvSender, TransferReceipt};
use crate::error::Result;
use crate::layout::TransferDesc;
use crate::sink::KvSink;

pub use select::{select_backend, BackendCaps, BackendKind, EndpointInfo};

/// A sender of any backend.
#[derive(Debug)]
pub enum AnySender {
    /// TCP.
    Tcp(tcp::TcpSender),
    /// Shared memory (boxed: its pull and arena state make it the largest).
    #[cfg(unix)]
    Shm(Box<shm::ShmSender>),
    /// Same process.
    Local(local::LocalSender),
    /// NCCL.
    #[cfg(feature = "nccl")]
    Nccl(nccl::NcclSender),
    /// RDMA (UCX).
    #[cfg(feature = "rdma")]
    Rdma(rdma::RdmaSender),
}

/// A receiver of any backend.
#[derive(Debug)]
pub enum AnyReceiver {
    /// TCP.
    Tcp(tcp::TcpInbound),
    /// Shared memory (boxed: its pull and arena state make it the largest).
    #[cfg(unix)]
    Shm(Box<shm::ShmInbound>),
    /// Same process.
    Local(local::LocalReceiver),
    /// NCCL.
    #[cfg(feature = "nccl")]
    Nccl(nccl::NcclInbound),
    /// RDMA (UCX).
    #[cfg(feature = "rdma")]
    Rdma(rdma::RdmaInbound),
}

macro_rules! dispatch {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnySender::Tcp($s) => $e,
            #[cfg(unix)]
            AnySender::Shm($s) => $e,
            AnySender::Local($s) => $e,
            #[cfg(feature = "nccl")]
            AnySender::Nccl($s) => $e,
            #[cfg(feature = "rdma")]
            AnySender::Rdma($s) => $e,
        }
    };
}

impl AnySender {
    /// Which backend this is.
    pub fn kind(&self) -> BackendKind {
        match self {
            AnySender::Tcp(_) => BackendKind::Tcp,
            #[cfg(unix)]
            AnySender::Shm(_) => BackendKind::Shm,
            AnySender::Local(_) => BackendKind::Local,
            #[cfg(feature = "nccl")]
            AnySender::Nccl(_) => BackendKind::Nccl,
            #[cfg(feature = "rdma")]
            AnySender::Rdma(_) => BackendKind::Rdma,
        }
    }
}

impl KvSender for AnySender {
    async fn begin(&mut self, desc: TransferDesc) -> Result<()> {
        dispatch!(self, s => s.begin(desc).await)
    }

    async fn send_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        layer: u32,
        k: &[R],
        v: &[R],
    ) -> Result<()> {
        dispatch!(self, s => s.send_layer(layer, k, v).await)
    }

    async fn send_layer_bytes(&mut self, layer: u32, k: Vec<Bytes>, v: Vec<Bytes>) -> Result<()> {
        dispatch!(self, s => s.send_layer_bytes(layer, k, v).await)
    }

    async fn finish(&mut self) -> Result<TransferReceipt> {
        dispatch!(self, s => s.finish().await)
    }

    async fn abort(&mut self) -> Result<()> {
        dispatch!(self, s => s.abort().await)
    }
}

impl AnyReceiver {
    /// Which backend this is.
    pub fn kind(&self) -> BackendKind {
        match self {
            AnyReceiver::Tcp(_) => BackendKind::Tcp,
            #[cfg(unix)]
            AnyReceiver::Shm(_) => BackendKind::Shm,
            AnyReceiver::Local(_) => BackendKind::Local,
            #[cfg(feature = "nccl")]
            AnyReceiver::Nccl(_) => BackendKind::Nccl,
            #[cfg(feature = "rdma")]
            AnyReceiver::Rdma(_) => BackendKind::Rdma,
        }
    }

    /// Who is on the other end, for logs: the tcp peer's address, the shm sender's pid, or
    /// the backend's name where the connection has no address of its own.
    pub fn peer(&self) -> String {
        match self {
            AnyReceiver::Tcp(t) => t.peer_addr().to_string(),
            #[cfg(unix)]
            AnyReceiver::Shm(r) => r.peer(),
            AnyReceiver::Local(_) => "local".to_string(),
            #[cfg(feature = "nccl")]
            AnyReceiver::Nccl(_) => "nccl".to_string(),
            #[cfg(feature = "rdma")]
            AnyReceiver::Rdma(_) => "rdma".to_string(),
        }
    }

    /// An shm connection's layer PULLs so far, by source (`None` for other backends).
    #[cfg(unix)]
    pub fn shm_pulls(&self) -> Option<shm::ShmPulls> {
        match self {
            AnyReceiver::Shm(r) => Some(r.pulls()),
            _ => None,
        }
    }
}

impl KvReceiver for AnyReceiver {
    async fn receive<S: KvSink + Send>(&mut self, sink: &mut S) -> Result<TransferReceipt> {
        match self {
            AnyReceiver::Tcp(r) => r.receive(sink).await,
            #[cfg(unix)]
            AnyReceiver::Shm(r) => r.receive(sink).await,
            AnyReceiver::Local(r) => r.receive(sink).await,
            #[cfg(feature = "nccl")]
            AnyReceiver::Nccl(r) => r.receive(sink).await,
            #[cfg(feature = "rdma")]
            AnyReceiver::Rdma(r) => r.receive(sink).await,
        }
    }
}

impl From<tcp::TcpSender> for AnySender {
    fn from(s: tcp::TcpSender) -> Self {
        AnySender::Tcp(s)
    }
}
#[cfg(unix)]
impl From<shm::ShmSender> for AnySender {
    fn from(s: shm::ShmSender) -> Self {
        AnySender::Shm(Box::new(s))
    }
}
impl From<local::LocalSender> for AnySender {
    fn from(s: local::LocalSender) -> Self {
        AnySender::Local(s)
    }
}
impl From<tcp::TcpInbound> for AnyReceiver {
    fn from(s: tcp::TcpInbound) -> Self {
        AnyReceiver::Tcp(s)
    }
}
#[cfg(unix)]
impl From<shm::ShmInbound> for AnyReceiver {
    fn from(s: shm::ShmInbound) -> Self {
        AnyReceiver::Shm(Box::new(s))
    }
}
impl From<local::LocalReceiver> for AnyReceiver {
    fn from(s: local::LocalReceiver) -> Self {
        AnyReceiver::Local(s)
    }
}
#[cfg(feature = "rdma")]
impl From<rdma::RdmaSender> for AnySender {
    fn from(s: rdma::RdmaSender) -> Self {
        AnySender::Rdma(s)
    }
}
#[cfg(feature = "rdma")]
impl From<rdma::RdmaInbound> for AnyReceiver {
    fn from(s: rdma::RdmaInbound) -> Self {
        AnyReceiver::Rdma(s)
    }
}
