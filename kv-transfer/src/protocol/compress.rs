//! Compression in flight: how a LAYER frame's regions are encoded on the wire.
//!
//! The sender chooses per transfer (BEGIN carries the code); the receiver decodes each region
//! into its own storage dtype, which is the layout's (both sides share one layout).
//!
//! ```text
//! none  the region as stored (f32 or f16 elements), region_bytes()
//! f16   every element as IEEE binary16, kv_heads * block_size * head_dim * 2 bytes
//!       (on an f16 cache this is `none`: nothing to gain)
//! int8  per kv head of the region: scale f32, then block_size * head_dim int8 values,
//!       value = q * scale, scale = max|x| / 127 over that head's slots (0 when all zero)
//! ```
//!
//! Invariants: the encoded length of a region depends only on (compression, layout), so the
//! receiver checks the LAYER length before reading a byte; decoding writes exactly one sink
//! region and refuses a non-finite or negative int8 scale (a corrupted or hostile frame
//! can put wrong numbers in reserved blocks, never bytes outside them); encoding refuses
//! non-finite KV values for int8 instead of sending a scale the receiver would refuse.

use half::f16;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::{Dtype, KvLayout};

/// Encoding of KV payload on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// As stored.
    #[default]
    None,
    /// f32 elements sent as f16 (half the bytes of an f32 cache).
    F16,
    /// int8 with one f32 scale per block, layer, K/V and kv head (about a quarter).
    Int8,
}

impl Compression {
    /// Name used in flags, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::F16 => "f16",
            Compression::Int8 => "int8",
        }
    }

    pub(crate) fn wire(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::F16 => 1,
            Compression::Int8 => 2,
        }
    }

    pub(crate) fn from_wire(b: u8) -> Option<Compression> {
        match b {
            0 => Some(Compression::None),
            1 => Some(Compression::F16),
            2 => Some(Compression::Int8),
            _ => None,
        }
    }

    /// The encoding a sender really uses for a cache of `dtype` (f16 of an f16 cache is
    /// the cache itself).
    pub fn effective(self, dtype: Dtype) -> Compression {
        match (self, dtype) {
            (Compression::F16, Dtype::F16) => Compression::None,
            (c, _) => c,
        }
    }

    /// Bytes one region of `layout` takes on the wire.
    pub fn region_wire_bytes(self, layout: &KvLayout) -> usize {
        let elems = layout.region_bytes() / layout.dtype().bytes() as usize;
        match self {
            Compression::None => layout.region_bytes(),
            Compression::F16 => elems * 2,
            Compression::Int8 => elems + 4 * layout.kv_heads() as usize,
        }
    }

    /// Bytes of one LAYER frame body for `n_blocks` blocks.
    pub fn layer_wire_bytes(self, layout: &KvLayout, n_blocks: usize) -> u64 {
        2 * n_blocks as u64 * self.region_wire_bytes(layout) as u64
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Reads the stored elements of one region as f32.
fn elements(dtype: Dtype, src: &[u8]) -> impl Iterator<Item = f32> + '_ {
    let width = dtype.bytes() as usize;
    src.chunks_exact(width).map(move |c| match dtype {
        Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
    })
}

/// Writes `values` as stored elements of `dtype` into `dst` (exactly filling it).
fn store(dtype: Dtype, dst: &mut [u8], values: impl Iterator<Item = f32>) {
    match dtype {
        Dtype::F32 => {
            for (d, x) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(values) {
                d.copy_from_slice(&f16::from_f32(x).to_le_bytes());
            }
        }
    }
}

/// Appends the wire form of one stored region; `src` must be `layout.region_bytes()` long.
pub fn encode_region(
    c: Compression,
    layout: &KvLayout,
    src: &[u8],
    out: &mut Vec<u8>,
) -> Result<()> {
    if src.len() != layout.region_bytes() {
        return Err(Error::InvalidArgument(format!(
            "a region is {} bytes, not the layout's {}",
            src.len(),
            layout.region_bytes()
        )));
    }
    let dtype = layout.dtype();
    match c {
        Compression::None => out.extend_from_slice(src),
        Compression::F16 => {
            for x in elements(dtype, src) {
                out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
            }
        }
        Compression::Int8 => {
            let head_bytes = src.len() / layout.kv_heads() as usize;
            for head in src.chunks_exact(head_bytes) {
                let mut max = 0f32;
                for x in elements(dtype, head) {
                    if !x.is_finite() {
                        return Err(Error::InvalidArgument(
                            "int8 KV compression: a KV value is not finite".into(),
                        ));
                    }
                    max = max.max(x.abs());
                }
                let scale = max / 127.0;
                out.extend_from_slice(&scale.to_le_bytes());
                // Divide (not multiply by 1/scale): a subnormal scale's inverse is infinite.
                out.extend(elements(dtype, head).map(|x| {
                    let q = if scale > 0.0 { x / scale } else { 0.0 };
                    q.round().clamp(-127.0, 127.0) as i8 as u8
                }));
            }
        }
    }
    Ok(())
}

/// Decodes one region's wire form (`c.region_wire_bytes(layout)` bytes) into a stored region
/// (`layout.region_bytes()` bytes); other lengths are an error.
pub fn decode_region(c: Compression, layout: &KvLayout, src: &[u8], dst: &mut [u8]) -> Result<()> {
    if src.len() != c.region_wire_bytes(layout) || dst.len() != layout.region_bytes() {
        return Err(Error::malformed(
            "LAYER",
            "encoded or stored region has the wrong length for the layout",
        ));
    }
    let dtype = layout.dtype();
    match c {
        Compression::None => dst.copy_from_slice(src),
        Compression::F16 => store(
            dtype,
            dst,
            src.chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Compression::Int8 => {
            let heads = layout.kv_heads() as usize;
            let src_head = src.len() / heads;
            let dst_head = dst.len() / heads;
            for (s, d) in src
                .chunks_exact(src_head)
                .zip(dst.chunks_exact_mut(dst_head))
            {
                let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                if !scale.is_finite() || scale < 0.0 {
                    return Err(Error::malformed(
                        "LAYER",
                        "int8 scale is not a finite, non-negative number",
                    ));
                }
                store(dtype, d, s[4..].iter().map(|&q| f32::from(q as i8) * scale));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Fingerprint;

    fn layout(dtype: Dtype) -> KvLayout {
        KvLayout::new(Fingerprint([1; 32]), 2, 3, 8, 4, dtype).unwrap()
    }

    fn region(l: &KvLayout, f: impl Fn(usize) -> f32) -> Vec<u8> {
        let n = l.region_bytes() / l.dtype().bytes() as usize;
        let mut out = vec![0u8; l.region_bytes()];
        store(l.dtype(), &mut out, (0..n).map(f));
        out
    }

    fn round_trip(c: Compression, l: &KvLayout, src: &[u8]) -> Vec<f32> {
        let mut wire = Vec::new();
        encode_region(c, l, src, &mut wire).unwrap();
        assert_eq!(wire.len(), c.region_wire_bytes(l));
        let mut dst = vec![0u8; l.region_bytes()];
        decode_region(c, l, &wire, &mut dst).unwrap();
        elements(l.dtype(), &dst).collect()
    }

    #[test]
    fn sizes_shrink_as_documented() {
        let l = layout(Dtype::F32);
        assert_eq!(Compression::None.region_wire_bytes(&l), 3 * 4 * 8 * 4);
        assert_eq!(Compression::F16.region_wire_bytes(&l), 3 * 4 * 8 * 2);
        assert_eq!(Compression::Int8.region_wire_bytes(&l), 3 * 4 * 8 + 3 * 4);
        assert_eq!(Compression::F16.effective(Dtype::F16), Compression::None);
        assert_eq!(Compression::Int8.effective(Dtype::F16), Compression::Int8);
        for c in [Compression::None, Compression::F16, Compression::Int8] {
            assert_eq!(Compression::from_wire(c.wire()), Some(c));
        }
        assert_eq!(Compression::from_wire(3), None);
    }

    #[test]
    fn f16_and_int8_stay_within_their_error_bounds() {
        for dtype in [Dtype::F32, Dtype::F16] {
            let l = layout(dtype);
            let src = region(&l, |i| ((i as f32) * 0.37).sin() * (1 + i % 5) as f32);
            let exact: Vec<f32> = elements(dtype, &src).collect();
            assert_eq!(round_trip(Compression::None, &l, &src), exact);
            for (a, b) in round_trip(Compression::F16, &l, &src).iter().zip(&exact) {
                assert!((a - b).abs() <= b.abs() * 1e-3 + 1e-6, "{a} vs {b}");
            }
            let per_head = exact.len() / 3;
            let got = round_trip(Compression::Int8, &l, &src);
            for (h, (g, e)) in got.chunks(per_head).zip(exact.chunks(per_head)).enumerate() {
                let max = e.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (a, b) in g.iter().zip(e) {
                    // Half a quantisation step, plus f16 storage rounding.
                    let tol = max / 127.0 * 0.5 + b.abs() * 1e-3 + 1e-6;
                    assert!((a - b).abs() <= tol, "head {h}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn int8_zero_region_and_bad_values() {
        let l = layout(Dtype::F32);
        let zeros = vec![0u8; l.region_bytes()];
        assert!(round_trip(Compression::Int8, &l, &zeros)
            .iter()
            .all(|&x| x == 0.0));
        let inf = region(&l, |i| if i == 5 { f32::INFINITY } else { 1.0 });
        assert!(encode_region(Compression::Int8, &l, &inf, &mut Vec::new()).is_err());
        let mut wire = Vec::new();
        encode_region(Compression::Int8, &l, &zeros, &mut wire).unwrap();
        wire[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        let mut dst = vec![0u8; l.region_bytes()];
        assert!(decode_region(Compression::Int8, &l, &wire, &mut dst).is_err());
        wire[..4].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(decode_region(Compression::Int8, &l, &wire, &mut dst).is_err());
        wire[..4].copy_from_slice(&1.0f32.to_le_bytes());
        assert!(decode_region(Compression::Int8, &l, &wire, &mut dst).is_ok());
        assert!(decode_region(Compression::Int8, &l, &wire[1..], &mut dst).is_err());
        assert!(decode_region(Compression::F16, &l, &wire, &mut dst).is_err());
        assert!(encode_region(Compression::F16, &l, &zeros[1..], &mut Vec::new()).is_err());
    }

    #[test]
    fn int8_keeps_tiny_regions_within_half_a_step() {
        // max / 127 is subnormal here: its inverse would be infinite.
        let l = layout(Dtype::F32);
        let src = region(&l, |i| if i % 2 == 0 { 1e-37 } else { -3e-38 });
        let exact: Vec<f32> = elements(Dtype::F32, &src).collect();
        for (a, b) in round_trip(Compression::Int8, &l, &src).iter().zip(&exact) {
            assert!((a - b).abs() <= 1e-37 / 127.0, "{a} vs {b}");
        }
    }
}
