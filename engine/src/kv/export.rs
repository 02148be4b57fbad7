//! Export and import of a sequence's KV in its described layout (what kv-transfer moves
//! between workers): a layer's frame is the K regions of the sequence's logical blocks in
//! order, then the V regions in the same order. A block a local layer group dropped travels
//! as zeros and is not kept on import (`super::group_tables`). Import converts between
//! element types.

use half::f16;

use super::allocator::BlockId;
use super::cache::{KvCache, KvDtype, KvExport, KvKind, KvLayout, SeqId};
use crate::error::{EngineError, Result};

impl KvCache {
    /// One layer's frame for a sequence: K regions, then V regions.
    pub fn export_layer(&self, id: SeqId, layer: usize) -> Result<Vec<u8>> {
        let s = self.seq(id)?;
        if s.window.is_some() || s.shift > 0 {
            return Err(EngineError::invalid(
                "attention",
                "the KV of a windowed or compressed sequence cannot be exported whole: its \
                 layout has no field for dropped blocks or shifted positions",
            ));
        }
        if layer >= self.layout.n_layers {
            return Err(EngineError::invalid(
                "layer",
                format!("{layer} out of range"),
            ));
        }
        let n = s.blocks.len();
        let mut out = Vec::with_capacity(2 * n * self.layout.region_bytes());
        for kind in [KvKind::K, KvKind::V] {
            for i in 0..n {
                out.extend_from_slice(self.sequence_region(id, i, layer, kind)?);
            }
        }
        Ok(out)
    }

    /// The whole sequence's KV, detached.
    pub fn export(&self, id: SeqId) -> Result<KvExport> {
        let tokens = self.seq(id)?.len;
        let layers = (0..self.layout.n_layers)
            .map(|l| self.export_layer(id, l))
            .collect::<Result<_>>()?;
        Ok(KvExport {
            layout: self.layout.clone(),
            tokens,
            layers,
        })
    }

    /// Reserve blocks for a sequence whose KV will arrive from elsewhere (a local layer
    /// group only those it keeps). The sequence exists with length 0 until
    /// [`Self::commit_append`]. Returns group 0's blocks: the frame's block order.
    pub fn reserve_sequence(&mut self, id: SeqId, tokens: usize) -> Result<Vec<BlockId>> {
        self.add_sequence(id)?;
        if let Err(e) = self
            .expect_prompt(id, tokens)
            .and_then(|_| self.prepare_append(id, tokens))
        {
            self.seqs.remove(&id);
            return Err(e);
        }
        Ok(self.seq(id)?.blocks.clone())
    }

    /// Write one imported layer frame (in `src.dtype`) into a reserved sequence.
    pub fn import_layer(
        &mut self,
        id: SeqId,
        layer: usize,
        src: &KvLayout,
        frame: &[u8],
    ) -> Result<()> {
        self.layout.check_compatible(src)?;
        let blocks = self.seq(id)?.blocks.clone();
        let rb_src = src.region_bytes();
        if layer >= self.layout.n_layers {
            return Err(EngineError::invalid(
                "layer",
                format!("{layer} out of range"),
            ));
        }
        if frame.len() != 2 * blocks.len() * rb_src {
            return Err(EngineError::invalid(
                "frame",
                format!(
                    "{} bytes for {} blocks of {} bytes (K and V)",
                    frame.len(),
                    blocks.len(),
                    rb_src
                ),
            ));
        }
        for (i, chunk) in frame.chunks_exact(rb_src).enumerate() {
            let kind = if i < blocks.len() {
                KvKind::K
            } else {
                KvKind::V
            };
            let dtype = self.layout.dtype;
            if let Some(dst) = self.sequence_region_mut(id, i % blocks.len(), layer, kind)? {
                write_converted((dst, dtype), chunk, src.dtype);
            }
        }
        Ok(())
    }

    /// Import a whole exported sequence as a new sequence `id`.
    pub fn import(&mut self, id: SeqId, ex: &KvExport) -> Result<()> {
        self.layout.check_compatible(&ex.layout)?;
        if ex.layers.len() != self.layout.n_layers {
            return Err(EngineError::invalid(
                "layers",
                "wrong number of layer frames",
            ));
        }
        self.reserve_sequence(id, ex.tokens)?;
        let res = (|| {
            for (l, frame) in ex.layers.iter().enumerate() {
                self.import_layer(id, l, &ex.layout, frame)?;
            }
            self.commit_append(id, ex.tokens)
        })();
        if res.is_err() {
            self.free_sequence(id);
        }
        res
    }
}

/// Writes `src` (elements of `dtype`) into the region `dst` (bytes of `dst_dtype`).
fn write_converted(dst: (&mut [u8], KvDtype), src: &[u8], dtype: KvDtype) {
    match (dst.1, dtype) {
        (a, b) if a == b => dst.0.copy_from_slice(src),
        (_, KvDtype::F16) => {
            for (x, c) in dst.0.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                x.copy_from_slice(&f16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes());
            }
        }
        (_, KvDtype::F32) => {
            for (x, c) in dst.0.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                x.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
    }
}
