//! [`MemorySink`]: an in-memory paged KV cache implementing [`KvSink`], used by tests, the
//! benchmark and as a reference for the engine's implementation.
//!
//! Storage is one buffer (from the allocator, or page-aligned: see the `buffer` module);
//! region `(block, layer, kind)` lives at
//! `((block * layers + layer) * 2 + kind) * region_bytes`. Reservations map a block to the
//! request it was reserved for. Counters record every call so tests can prove that nothing
//! was written (e.g. after a failed authentication).

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;

use crate::buffer::Buffer;
use crate::error::{ErrorClass, SinkError};
use crate::layout::{KvKind, KvLayout};
use crate::sink::KvSink;

/// In-memory [`KvSink`] with `n_blocks` blocks.
#[derive(Debug)]
pub struct MemorySink {
    layout: KvLayout,
    n_blocks: u32,
    data: Buffer,
    reserved: HashMap<u32, u64>,
    adopt_zero_copy: bool,
    adopted: HashMap<(u32, KvKind, u32), Bytes>,
    /// Number of `region_mut` calls that returned a region.
    pub regions_handed_out: u64,
    /// Number of regions adopted without copying.
    pub regions_adopted: u64,
    /// `(request_id, layer)` in the order `layer_done` was called.
    pub layers_done: Vec<(u64, u32)>,
    /// When `layer_done` was last called.
    pub last_layer_done_at: Option<Instant>,
}

impl MemorySink {
    /// A zero-filled cache of `n_blocks` blocks.
    pub fn new(layout: KvLayout, n_blocks: u32) -> Self {
        MemorySink::with_storage(layout, n_blocks, Buffer::heap)
    }

    /// Like [`MemorySink::new`], its storage in a page-aligned anonymous mapping (to face a
    /// sender whose buffers are page-aligned too: kernel copies want both sides to share
    /// their offset within a cache line).
    pub fn new_page_aligned(layout: KvLayout, n_blocks: u32) -> Self {
        MemorySink::with_storage(layout, n_blocks, |len| Buffer::mapped(len, false))
    }

    fn with_storage(
        layout: KvLayout,
        n_blocks: u32,
        storage: impl FnOnce(usize) -> Buffer,
    ) -> Self {
        let len = n_blocks as usize * layout.layers() as usize * 2 * layout.region_bytes();
        MemorySink {
            layout,
            n_blocks,
            data: storage(len),
            reserved: HashMap::new(),
            adopt_zero_copy: false,
            adopted: HashMap::new(),
            regions_handed_out: 0,
            regions_adopted: 0,
            layers_done: Vec::new(),
            last_layer_done_at: None,
        }
    }

    /// Keep `Bytes` handed over by the local backend instead of copying them.
    pub fn with_zero_copy_adoption(mut self) -> Self {
        self.adopt_zero_copy = true;
        self
    }

    /// Reserves `blocks` for `request_id`. Fails if one is out of range or already reserved.
    pub fn reserve(&mut self, request_id: u64, blocks: &[u32]) -> Result<(), SinkError> {
        for &b in blocks {
            if b >= self.n_blocks {
                return Err(SinkError::new(
                    ErrorClass::InvalidArgument,
                    format!("block {b} out of range"),
                ));
            }
            if self.reserved.contains_key(&b) {
                return Err(SinkError::new(
                    ErrorClass::ResourceExhausted,
                    format!("block {b} already reserved"),
                ));
            }
        }
        for &b in blocks {
            self.reserved.insert(b, request_id);
        }
        Ok(())
    }

    /// Releases `blocks` (unknown ids are ignored).
    pub fn release(&mut self, blocks: &[u32]) {
        for b in blocks {
            self.reserved.remove(b);
            for kind in KvKind::ORDER {
                for layer in 0..self.layout.layers() {
                    self.adopted.remove(&(layer, kind, *b));
                }
            }
        }
    }

    /// Number of currently reserved blocks.
    pub fn reserved_count(&self) -> usize {
        self.reserved.len()
    }

    fn offset(&self, layer: u32, kind: KvKind, block: u32) -> Option<usize> {
        if block >= self.n_blocks || layer >= self.layout.layers() {
            return None;
        }
        let k = match kind {
            KvKind::K => 0,
            KvKind::V => 1,
        };
        let idx = (block as usize * self.layout.layers() as usize + layer as usize) * 2 + k;
        Some(idx * self.layout.region_bytes())
    }

    /// Read access to a region (the adopted buffer when one was adopted).
    pub fn region(&self, layer: u32, kind: KvKind, block: u32) -> Option<&[u8]> {
        if let Some(b) = self.adopted.get(&(layer, kind, block)) {
            return Some(b);
        }
        let off = self.offset(layer, kind, block)?;
        self.data.get(off..off + self.layout.region_bytes())
    }

    /// The adopted buffer for a region, if the local backend handed one over.
    pub fn adopted(&self, layer: u32, kind: KvKind, block: u32) -> Option<&Bytes> {
        self.adopted.get(&(layer, kind, block))
    }

    /// The whole backing store (all regions, adopted ones excluded).
    pub fn raw(&self) -> &[u8] {
        &self.data
    }
}

impl KvSink for MemorySink {
    fn is_reserved(&self, request_id: u64, block: u32) -> bool {
        self.reserved.get(&block) == Some(&request_id)
    }

    fn region_mut(&mut self, layer: u32, kind: KvKind, block: u32) -> Result<&mut [u8], SinkError> {
        let len = self.layout.region_bytes();
        let off = self
            .offset(layer, kind, block)
            .ok_or_else(|| SinkError::new(ErrorClass::NotFound, "no such region"))?;
        self.regions_handed_out += 1;
        self.adopted.remove(&(layer, kind, block));
        self.data
            .get_mut(off..off + len)
            .ok_or_else(|| SinkError::new(ErrorClass::Internal, "region beyond storage"))
    }

    fn regions_mut<'a>(
        &'a mut self,
        layer: u32,
        kind: KvKind,
        blocks: &[u32],
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<bool, SinkError> {
        let len = self.layout.region_bytes();
        // (offset, position in `blocks`), sorted by offset so that `split_at_mut` can carve
        // disjoint slices out of the backing store in one pass.
        let mut order = Vec::with_capacity(blocks.len());
        for (i, &b) in blocks.iter().enumerate() {
            let off = self
                .offset(layer, kind, b)
                .ok_or_else(|| SinkError::new(ErrorClass::NotFound, "no such region"))?;
            order.push((off, i));
            self.adopted.remove(&(layer, kind, b));
        }
        order.sort_unstable();
        if order.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(SinkError::new(
                ErrorClass::InvalidArgument,
                "block listed twice",
            ));
        }
        let mut slots: Vec<Option<&'a mut [u8]>> = (0..blocks.len()).map(|_| None).collect();
        let mut rest: &'a mut [u8] = &mut self.data;
        let mut consumed = 0;
        for (off, i) in order {
            let tail = std::mem::take(&mut rest);
            let beyond = || SinkError::new(ErrorClass::Internal, "region beyond storage");
            let (_, tail) = tail
                .split_at_mut_checked(off - consumed)
                .ok_or_else(beyond)?;
            let (region, tail) = tail.split_at_mut_checked(len).ok_or_else(beyond)?;
            slots[i] = Some(region);
            rest = tail;
            consumed = off + len;
        }
        self.regions_handed_out += blocks.len() as u64;
        out.extend(slots.into_iter().flatten());
        Ok(true)
    }

    fn adopt_region(
        &mut self,
        layer: u32,
        kind: KvKind,
        block: u32,
        data: Bytes,
    ) -> Result<(), SinkError> {
        if !self.adopt_zero_copy {
            let region = self.region_mut(layer, kind, block)?;
            if region.len() != data.len() {
                return Err(SinkError::new(ErrorClass::Internal, "region size mismatch"));
            }
            region.copy_from_slice(&data);
            return Ok(());
        }
        if self.offset(layer, kind, block).is_none() {
            return Err(SinkError::new(ErrorClass::NotFound, "no such region"));
        }
        self.regions_adopted += 1;
        self.adopted.insert((layer, kind, block), data);
        Ok(())
    }

    fn layer_done(&mut self, request_id: u64, layer: u32) {
        self.layers_done.push((request_id, layer));
        self.last_layer_done_at = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Dtype, Fingerprint};

    #[test]
    fn page_aligned_storage_starts_zeroed_and_works_like_the_plain_one() {
        let layout = KvLayout::new(Fingerprint([3; 32]), 2, 2, 8, 4, Dtype::F32).unwrap();
        let mut a = MemorySink::new_page_aligned(layout, 4);
        let mut b = MemorySink::new(layout, 4);
        assert_eq!(a.raw().as_ptr() as usize % 4096, 0);
        assert_eq!(a.raw().len(), b.raw().len());
        assert!(a.raw().iter().all(|&x| x == 0));
        for s in [&mut a, &mut b] {
            s.reserve(9, &[2]).unwrap();
            s.region_mut(1, KvKind::V, 2).unwrap().fill(7);
        }
        assert_eq!(a.raw(), b.raw());
        assert!(a.region(1, KvKind::V, 2).unwrap().iter().all(|&x| x == 7));
        assert!(a.region(0, KvKind::K, 2).unwrap().iter().all(|&x| x == 0));
    }
}
