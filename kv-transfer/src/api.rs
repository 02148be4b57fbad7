//! The backend-independent API: [`KvSender`] (prefill side) and [`KvReceiver`] (decode side).
//!
//! Usage on the prefill side, layer by layer as the forward pass finishes them:
//!
//! ```text
//! sender.begin(desc).await?;                 // desc.dst_blocks were reserved by the receiver
//! for layer in 0..layers {
//!     let (k, v) = compute_layer(layer);     // K/V regions of every block, in block order
//!     sender.send_layer(layer, &k, &v).await?;
//! }
//! let receipt = sender.finish().await?;      // returns once the receiver placed every byte
//! ```
//!
//! `send_layer` returns once the layer is handed to the transport (socket buffer, shm slot,
//! channel), so the caller can compute layer i+1 while layer i is on the wire; to overlap
//! fully, poll `send_layer(i)` concurrently with computing layer i+1.
//!
//! On the decode side, `receiver.receive(&mut sink).await` places one whole transfer into the
//! sink. On error, [`crate::Error::blocks_to_release`] lists the reserved blocks to free.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use crate::error::Result;
use crate::layout::TransferDesc;
use crate::protocol::Compression;
use crate::sink::KvSink;

/// Summary of a completed transfer (both sides).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransferReceipt {
    /// The transfer's descriptor (request, tokens, destination blocks).
    pub desc: TransferDesc,
    /// Layers transferred.
    pub layers: u32,
    /// KV payload bytes transferred (all layers, K and V).
    pub payload_bytes: u64,
    /// Layer payload bytes the transport carried: `payload_bytes` encoded by the transfer's
    /// compression (equal to `payload_bytes` without compression and for `local`).
    pub wire_bytes: u64,
    /// How the layers were encoded on the wire.
    pub compression: Compression,
    /// Time from BEGIN to the verdict (sender) or to END (receiver).
    pub elapsed: Duration,
}

/// Prefill side of a connection: sends transfers one at a time.
pub trait KvSender: Send {
    /// Starts a transfer into the receiver's reserved `desc.dst_blocks`.
    fn begin(&mut self, desc: TransferDesc) -> impl Future<Output = Result<()>> + Send;

    /// Sends one layer: `k[i]` / `v[i]` are the K / V regions of `desc.dst_blocks[i]`, each
    /// exactly `layout.region_bytes()` long. Layers may come in any order, each once.
    fn send_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        layer: u32,
        k: &[R],
        v: &[R],
    ) -> impl Future<Output = Result<()>> + Send;

    /// Like [`KvSender::send_layer`] with owned, reference-counted buffers. The `local`
    /// backend hands these to the receiver without copying; others write them as slices.
    fn send_layer_bytes(
        &mut self,
        layer: u32,
        k: Vec<Bytes>,
        v: Vec<Bytes>,
    ) -> impl Future<Output = Result<()>> + Send {
        async move { self.send_layer(layer, &k, &v).await }
    }

    /// Ends the transfer and waits for the receiver's verdict.
    fn finish(&mut self) -> impl Future<Output = Result<TransferReceipt>> + Send;

    /// Abandons the current transfer (the receiver releases its blocks). The connection is
    /// unusable afterwards.
    fn abort(&mut self) -> impl Future<Output = Result<()>> + Send;
}

/// Decode side of a connection: receives transfers one at a time.
pub trait KvReceiver: Send {
    /// Receives one transfer into `sink`. A clean close by the peer between transfers is an
    /// error for which [`crate::Error::is_clean_close`] is true.
    fn receive<S: KvSink + Send>(
        &mut self,
        sink: &mut S,
    ) -> impl Future<Output = Result<TransferReceipt>> + Send;
}
