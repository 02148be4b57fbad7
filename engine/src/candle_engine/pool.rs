//! The paged KV pool on a candle device: per layer one f16 tensor for K and one for V, each
//! `blocks x block_size x (kv_heads * head_dim)` (stored as `blocks * block_size` rows).
//!
//! It holds data only. Block tables, reference counts, the prefix cache and every other
//! contract are the host [`crate::KvCache`]'s, whose block ids index this pool too: block
//! `b`'s token slot `s` is row `b * block_size + s` of every layer's tensors. The host pool
//! stays the store of record (what kv-transfer sends and receives, what the prefix cache's
//! lower tiers hold); `crate::kv::device_sync` copies to the device the blocks whose host
//! bytes changed (imported, copied on write, brought up from a lower tier) before a forward
//! reads them, and the candle forward writes every new row to both.
//!
//! Invariants:
//! - Writes happen in place ([`Tensor::slice_set`]), one run of consecutive rows at a time;
//!   reads gather rows with `index_select`, so attention sees exactly a sequence's own
//!   positions in order.
//! - A row is read only after it was written (by the forward or by an upload of its block).

use candle_core::{DType, Device, Tensor};
use half::f16;

use crate::error::{EngineError, Result};
use crate::kv::BlockId;

/// A paged KV pool whose tensors live on one device.
pub struct DeviceKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    blocks: usize,
}

impl DeviceKv {
    /// `blocks` blocks of `block_size` tokens for `layers` layers of `kv_heads * head_dim`
    /// values per token, zeroed, on `device`.
    pub fn new(
        device: &Device,
        layers: usize,
        (kv_heads, head_dim): (usize, usize),
        block_size: usize,
        blocks: usize,
    ) -> Result<Self> {
        if block_size == 0 || blocks == 0 {
            return Err(EngineError::invalid(
                "kv_pool",
                "needs at least one block of at least one token",
            ));
        }
        let zeros = || {
            Tensor::zeros(
                (blocks * block_size, kv_heads * head_dim),
                DType::F16,
                device,
            )
        };
        let k = (0..layers)
            .map(|_| zeros())
            .collect::<candle_core::Result<_>>()?;
        let v = (0..layers)
            .map(|_| zeros())
            .collect::<candle_core::Result<_>>()?;
        Ok(DeviceKv {
            k,
            v,
            block_size,
            kv_heads,
            head_dim,
            blocks,
        })
    }

    /// Whether this pool mirrors a host pool of this shape on `device`.
    pub fn fits(&self, device: &Device, layers: usize, block_size: usize, blocks: usize) -> bool {
        self.k
            .first()
            .is_some_and(|t| t.device().same_device(device))
            && (self.k.len(), self.block_size, self.blocks) == (layers, block_size, blocks)
    }

    /// Bytes the pool's tensors hold on the device.
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.blocks * self.block_size * self.kv_heads * self.head_dim * 2
    }

    /// The row of `block`'s slot `slot`.
    pub fn row(&self, block: BlockId, slot: usize) -> Result<u32> {
        u32::try_from(block as usize * self.block_size + slot)
            .map_err(|_| EngineError::invalid("kv_pool", "more rows than u32 holds"))
    }

    /// Writes `k` and `v` (`rows.len() x kv_heads * head_dim`, any float dtype) of `layer`
    /// into `rows`: one in-place copy per run of consecutive rows.
    pub fn write(&self, layer: usize, rows: &[u32], k: &Tensor, v: &Tensor) -> Result<()> {
        let (k, v) = (k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?);
        let (pk, pv) = (&self.k[layer], &self.v[layer]);
        let mut i = 0;
        while i < rows.len() {
            let mut j = i + 1;
            while j < rows.len() && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            let at = rows[i] as usize;
            pk.slice_set(&k.narrow(0, i, j - i)?.contiguous()?, 0, at)?;
            pv.slice_set(&v.narrow(0, i, j - i)?.contiguous()?, 0, at)?;
            i = j;
        }
        Ok(())
    }

    /// K and V of `layer` at `rows` (an index tensor on the pool's device), as f16
    /// `rows x kv_heads * head_dim`.
    pub fn gather(&self, layer: usize, rows: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k[layer].index_select(rows, 0)?,
            self.v[layer].index_select(rows, 0)?,
        ))
    }

    /// Copies one block of `layer` from the host pool's region format (f16
    /// `kv_heads x block_size x head_dim`, head-major, for K and for V) into its rows
    /// (token-major: the block is transposed on the device).
    pub fn upload(&self, layer: usize, block: BlockId, k: &[f16], v: &[f16]) -> Result<()> {
        let (bs, h, d) = (self.block_size, self.kv_heads, self.head_dim);
        let at = self.row(block, 0)? as usize;
        for (pool, region) in [(&self.k[layer], k), (&self.v[layer], v)] {
            if region.len() != h * bs * d {
                return Err(EngineError::invalid(
                    "kv_region",
                    format!("{} values, expected {}", region.len(), h * bs * d),
                ));
            }
            let rows = Tensor::from_slice(region, (h, bs, d), pool.device())?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((bs, h * d))?;
            pool.slice_set(&rows, 0, at)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn rows_written_read_back_in_the_order_asked() {
        let dev = Device::Cpu;
        let p = DeviceKv::new(&dev, 2, (1, 3), 4, 8).unwrap();
        // Rows of two blocks that are not adjacent, written in two runs.
        let rows: Vec<u32> = [(5, 2), (5, 3), (1, 0)]
            .into_iter()
            .map(|(b, s)| p.row(b, s).unwrap())
            .collect();
        assert_eq!(rows, vec![22, 23, 4]);
        let k = Tensor::from_vec((0..9).map(|i| i as f32).collect(), (3, 3), &dev).unwrap();
        let v = (k.clone() * -1.0).unwrap();
        p.write(1, &rows, &k, &v).unwrap();
        let idx = Tensor::new(&[4u32, 22, 23], &dev).unwrap();
        let (gk, gv) = p.gather(1, &idx).unwrap();
        assert_eq!(f32s(&gk), vec![6., 7., 8., 0., 1., 2., 3., 4., 5.]);
        assert_eq!(f32s(&gv)[0], -6.0);
        // Layer 0 was not touched.
        assert!(f32s(&p.gather(0, &idx).unwrap().0)
            .iter()
            .all(|&x| x == 0.0));
    }

    #[test]
    fn an_uploaded_block_lands_token_major_in_its_rows() {
        let dev = Device::Cpu;
        let (h, bs, d) = (2, 3, 2);
        let p = DeviceKv::new(&dev, 1, (h, d), bs, 4).unwrap();
        // Host region: head-major, value = head*100 + slot*10 + dim.
        let region: Vec<f16> = (0..h)
            .flat_map(|hh| (0..bs).flat_map(move |s| (0..d).map(move |x| (hh, s, x))))
            .map(|(hh, s, x)| f16::from_f32((hh * 100 + s * 10 + x) as f32))
            .collect();
        p.upload(0, 2, &region, &region).unwrap();
        let idx = Tensor::new(&[p.row(2, 1).unwrap()], &dev).unwrap();
        // Slot 1: head 0 then head 1, each head_dim values.
        assert_eq!(
            f32s(&p.gather(0, &idx).unwrap().0),
            vec![10., 11., 110., 111.]
        );
        let short = &region[1..];
        assert!(p.upload(0, 2, short, short).is_err());
    }

    #[test]
    fn a_pool_knows_the_shape_it_mirrors() {
        let p = DeviceKv::new(&Device::Cpu, 2, (1, 2), 4, 8).unwrap();
        assert!(p.fits(&Device::Cpu, 2, 4, 8));
        assert!(!p.fits(&Device::Cpu, 2, 4, 9));
        assert_eq!(p.bytes(), 2 * 2 * 8 * 4 * 2 * 2);
        assert!(DeviceKv::new(&Device::Cpu, 1, (1, 2), 4, 0).is_err());
    }
}
