//! The receiver-side interface to the engine's KV cache: [`KvSink`].
//!
//! Invariants the receivers in this crate uphold:
//! - a region is requested only for a block that [`KvSink::is_reserved`] confirmed for the
//!   transfer's request, and only after the peer authenticated and its layout matched;
//! - exactly `layout.region_bytes()` bytes are written into a region; a sink returning a
//!   slice of another length makes the transfer fail without writing it;
//! - bytes are read from the transport straight into the returned slice (no staging copy of
//!   the sequence);
//! - after a failure the receiver reports, via [`crate::Error::blocks_to_release`], every
//!   block of the accepted header: it may hold partial data and must be released.

use bytes::Bytes;

use crate::error::SinkError;
use crate::layout::KvKind;

/// Destination of received KV data. Implemented by the engine over its paged KV cache.
pub trait KvSink {
    /// True when `block` is reserved at this receiver for `request_id`.
    fn is_reserved(&self, request_id: u64, block: u32) -> bool;

    /// A transfer for `request_id` was accepted (its header checked against
    /// [`KvSink::is_reserved`]); regions of it are asked for next. A sink that lends its
    /// blocks to one transfer at a time takes them here, and refuses (failing the transfer)
    /// when it cannot. The default accepts.
    fn begin_transfer(&mut self, request_id: u64) -> Result<(), SinkError> {
        let _ = request_id;
        Ok(())
    }

    /// The `(layer, kind, block)` region to fill; must be exactly `region_bytes()` long.
    fn region_mut(&mut self, layer: u32, kind: KvKind, block: u32) -> Result<&mut [u8], SinkError>;

    /// Optional batch access for vectored socket reads: pushes the `(layer, kind)` regions of
    /// `blocks`, in that order, onto `out` (each exactly `region_bytes()` long, pairwise
    /// disjoint) and returns `Ok(true)`. The default returns `Ok(false)` and the receiver
    /// falls back to one [`KvSink::region_mut`] call per block. Implementing it lets the tcp
    /// backend fill up to 64 regions per `readv` instead of one per `read`.
    fn regions_mut<'a>(
        &'a mut self,
        layer: u32,
        kind: KvKind,
        blocks: &[u32],
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<bool, SinkError> {
        let _ = (layer, kind, blocks, out);
        Ok(false)
    }

    /// Takes ownership of a region's bytes (used by the same-process `local` backend).
    ///
    /// The default copies into [`KvSink::region_mut`]. A sink that can keep `Bytes` (for
    /// example a cache whose blocks are reference-counted buffers) overrides this to adopt the
    /// sender's buffer without copying.
    fn adopt_region(
        &mut self,
        layer: u32,
        kind: KvKind,
        block: u32,
        data: Bytes,
    ) -> Result<(), SinkError> {
        let region = self.region_mut(layer, kind, block)?;
        if region.len() != data.len() {
            return Err(SinkError::new(
                crate::ErrorClass::Internal,
                format!(
                    "sink region is {} bytes, payload region is {}",
                    region.len(),
                    data.len()
                ),
            ));
        }
        region.copy_from_slice(&data);
        Ok(())
    }

    /// Called after every byte of `layer` has been placed and its MAC (when on) verified.
    fn layer_done(&mut self, _request_id: u64, _layer: u32) {}
}

impl<S: KvSink + ?Sized> KvSink for &mut S {
    fn is_reserved(&self, request_id: u64, block: u32) -> bool {
        (**self).is_reserved(request_id, block)
    }
    fn begin_transfer(&mut self, request_id: u64) -> Result<(), SinkError> {
        (**self).begin_transfer(request_id)
    }
    fn region_mut(&mut self, layer: u32, kind: KvKind, block: u32) -> Result<&mut [u8], SinkError> {
        (**self).region_mut(layer, kind, block)
    }
    fn regions_mut<'a>(
        &'a mut self,
        layer: u32,
        kind: KvKind,
        blocks: &[u32],
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<bool, SinkError> {
        (**self).regions_mut(layer, kind, blocks, out)
    }
    fn adopt_region(
        &mut self,
        layer: u32,
        kind: KvKind,
        block: u32,
        data: Bytes,
    ) -> Result<(), SinkError> {
        (**self).adopt_region(layer, kind, block, data)
    }
    fn layer_done(&mut self, request_id: u64, layer: u32) {
        (**self).layer_done(request_id, layer)
    }
}
