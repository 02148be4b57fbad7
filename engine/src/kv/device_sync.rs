//! The host pool and its copy on a candle device ([`DeviceKv`], the candle engine's): the
//! host [`KvCache`] stays the store of record (block tables, reference counts, the prefix
//! cache and its tiers, export and import all work on host bytes), and the device copy is
//! brought up to date block by block before a candle forward reads it.
//!
//! Invariants:
//! - Every host write into a block's bytes outside the candle forward (import, a receiver
//!   writing in place, copy on write, a block brought up from a lower tier, the native
//!   forward) marks the block stale; [`KvCache::sync_to_device`] uploads the stale blocks a
//!   forward will read and clears their marks.
//! - The candle forward writes each new row to the device and to the host
//!   ([`KvCache::write_rows_back`], which marks nothing), so both hold the same rows after
//!   every layer: the prefill worker streams a layer from the host while the next computes.
//! - A device copy is made the first time a candle forward runs on a cache, with every
//!   block marked stale (the host may hold imported KV already).

use candle_core::Device;
use half::f16;

use super::cache::{KvCache, KvDtype, KvKind, Storage};
use super::BlockId;
use crate::candle_engine::DeviceKv;
use crate::error::{EngineError, Result};

/// The device copy of a pool, and which blocks it lacks.
#[derive(Default)]
pub(crate) struct DeviceSync {
    kv: Option<DeviceKv>,
    /// `stale[b]`: block `b`'s host bytes changed since they were last uploaded (empty
    /// while there is no device copy).
    stale: Vec<bool>,
}

impl DeviceSync {
    /// A host write into block `b`.
    pub(super) fn host_wrote(&mut self, b: BlockId) {
        if let Some(s) = self.stale.get_mut(b as usize) {
            *s = true;
        }
    }
}

impl KvCache {
    /// Takes the device copy out of the cache for one forward (made on `device` if there is
    /// none, or none of this shape there); [`Self::put_device_kv`] gives it back.
    pub(crate) fn take_device_kv(&mut self, device: &Device) -> Result<DeviceKv> {
        let l = &self.layout;
        let blocks = self.total_blocks();
        if l.dtype != KvDtype::F16 {
            return Err(EngineError::invalid(
                "kv_dtype",
                "the candle engine keeps f16 KV (--kv-dtype f16)",
            ));
        }
        match self.device.kv.take() {
            Some(kv) if kv.fits(device, l.n_layers, l.block_size, blocks) => Ok(kv),
            _ => {
                let kv = DeviceKv::new(
                    device,
                    l.n_layers,
                    (l.n_kv_heads, l.head_dim),
                    l.block_size,
                    blocks,
                )?;
                self.device.stale = vec![true; blocks];
                Ok(kv)
            }
        }
    }

    pub(crate) fn put_device_kv(&mut self, kv: DeviceKv) {
        self.device.kv = Some(kv);
    }

    /// Bytes the device copy holds (0 before the first candle forward).
    pub fn device_bytes(&self) -> usize {
        self.device.kv.as_ref().map_or(0, DeviceKv::bytes)
    }

    /// Uploads those of `blocks` whose host bytes changed since their last upload.
    pub(crate) fn sync_to_device(&mut self, kv: &DeviceKv, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            if !self.device.stale.get(b as usize).copied().unwrap_or(false) {
                continue;
            }
            let Storage::F16(host) = &self.storage else {
                return Err(EngineError::invalid("kv_dtype", "f16 KV expected"));
            };
            let n = self.layout.region_elems();
            for layer in 0..self.layout.n_layers {
                let k = self.region_offset(b, layer, KvKind::K);
                let v = self.region_offset(b, layer, KvKind::V);
                kv.upload(layer, b, &host[k..k + n], &host[v..v + n])?;
            }
            self.device.stale[b as usize] = false;
        }
        Ok(())
    }

    /// Writes the rows a candle forward computed for `layer` into the host pool: row `i` of
    /// `k` and `v` (each `at.len() x kv_heads * head_dim`, token-major) goes to block
    /// `at[i].0`, slot `at[i].1` (head-major there). Marks nothing stale: the device has them.
    pub(crate) fn write_rows_back(
        &mut self,
        layer: usize,
        at: &[(BlockId, usize)],
        k: &[f16],
        v: &[f16],
    ) -> Result<()> {
        let (bs, hd, heads) = (
            self.layout.block_size,
            self.layout.head_dim,
            self.layout.n_kv_heads,
        );
        let width = heads * hd;
        if k.len() != at.len() * width || v.len() != k.len() {
            return Err(EngineError::invalid(
                "kv_rows",
                format!("{} values for {} rows of {width}", k.len(), at.len()),
            ));
        }
        let offsets: Vec<(usize, usize, usize)> = at
            .iter()
            .map(|&(b, slot)| {
                (
                    self.region_offset(b, layer, KvKind::K),
                    self.region_offset(b, layer, KvKind::V),
                    slot,
                )
            })
            .collect();
        let Storage::F16(host) = &mut self.storage else {
            return Err(EngineError::invalid("kv_dtype", "f16 KV expected"));
        };
        for (i, &(ko, vo, slot)) in offsets.iter().enumerate() {
            for h in 0..heads {
                let dst = (h * bs + slot) * hd;
                let src = i * width + h * hd;
                host[ko + dst..ko + dst + hd].copy_from_slice(&k[src..src + hd]);
                host[vo + dst..vo + dst + hd].copy_from_slice(&v[src..src + hd]);
            }
        }
        Ok(())
    }
}
