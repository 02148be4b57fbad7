//! KV-cache geometry ([`KvLayout`]) and the per-transfer descriptor ([`TransferDesc`]).
//!
//! The engine stores each `(block, layer, K-or-V)` region contiguously as
//! `[kv_head][slot_in_block][head_dim]` elements, so one region is
//! `kv_heads * block_size * head_dim * dtype_bytes` bytes. The wire frame for one layer is the
//! K regions of every block of the sequence in block-list order, then the V regions in the
//! same order: `layer_frame_bytes(n) = 2 * n * region_bytes()`.
//!
//! Invariants: a [`KvLayout`] can only be built through [`KvLayout::new`], which enforces the
//! limits below, so `region_bytes()` never overflows and always fits in `usize`/`u32`.
//! Two layouts are compatible iff every field (fingerprint included) is equal.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::protocol::Compression;

/// Largest accepted layer count.
pub const MAX_LAYERS: u32 = 1024;
/// Largest accepted KV head count.
pub const MAX_KV_HEADS: u32 = 1024;
/// Largest accepted head dimension.
pub const MAX_HEAD_DIM: u32 = 16 * 1024;
/// Largest accepted block size (tokens per block).
pub const MAX_BLOCK_SIZE: u32 = 4096;
/// Largest accepted size of one region in bytes (64 MiB).
pub const MAX_REGION_BYTES: u64 = 64 << 20;
/// Largest number of destination blocks in one transfer.
pub const MAX_BLOCKS_PER_TRANSFER: u32 = 1 << 16;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 => 2,
        }
    }

    pub(crate) fn wire(self) -> u8 {
        match self {
            Dtype::F32 => 1,
            Dtype::F16 => 2,
        }
    }

    pub(crate) fn from_wire(b: u8) -> Option<Dtype> {
        match b {
            1 => Some(Dtype::F32),
            2 => Some(Dtype::F16),
            _ => None,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
        })
    }
}

/// Which half of the KV pair a region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvKind {
    /// Keys.
    K,
    /// Values.
    V,
}

impl KvKind {
    /// Wire order inside a layer frame: all K regions, then all V regions.
    pub const ORDER: [KvKind; 2] = [KvKind::K, KvKind::V];
}

/// 32-byte identity of a model (architecture, dims, tokenizer, weight files) computed by the
/// engine. Two workers may exchange KV only when their fingerprints are equal.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// SHA-256 over the given parts, each length-prefixed (so part boundaries matter).
    pub fn digest(parts: &[&[u8]]) -> Fingerprint {
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        Fingerprint(h.finalize().into())
    }

    fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.hex())
    }
}

impl From<[u8; 32]> for Fingerprint {
    fn from(b: [u8; 32]) -> Self {
        Fingerprint(b)
    }
}

impl Serialize for Fingerprint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.hex())
    }
}

impl<'de> Deserialize<'de> for Fingerprint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let bytes = s.as_bytes();
        if bytes.len() != 64 {
            return Err(serde::de::Error::custom(
                "fingerprint must be 64 hex digits",
            ));
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let txt = std::str::from_utf8(pair).map_err(serde::de::Error::custom)?;
            out[i] = u8::from_str_radix(txt, 16).map_err(serde::de::Error::custom)?;
        }
        Ok(Fingerprint(out))
    }
}

/// Geometry of the KV cache that both sides of a transfer must share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "KvLayoutSpec", into = "KvLayoutSpec")]
pub struct KvLayout {
    fingerprint: Fingerprint,
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    dtype: Dtype,
}

/// Unvalidated field bag for [`KvLayout`] (serde form and a convenient constructor input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayoutSpec {
    /// Model identity.
    pub fingerprint: Fingerprint,
    /// Number of transformer layers.
    pub layers: u32,
    /// Number of KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type.
    pub dtype: Dtype,
}

impl TryFrom<KvLayoutSpec> for KvLayout {
    type Error = Error;
    fn try_from(s: KvLayoutSpec) -> Result<Self> {
        KvLayout::new(
            s.fingerprint,
            s.layers,
            s.kv_heads,
            s.head_dim,
            s.block_size,
            s.dtype,
        )
    }
}

impl From<KvLayout> for KvLayoutSpec {
    fn from(l: KvLayout) -> Self {
        KvLayoutSpec {
            fingerprint: l.fingerprint,
            layers: l.layers,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            block_size: l.block_size,
            dtype: l.dtype,
        }
    }
}

fn check_dim(name: &str, v: u32, max: u32) -> Result<()> {
    if v == 0 || v > max {
        return Err(Error::InvalidLayout(format!(
            "{name} = {v} must be in 1..={max}"
        )));
    }
    Ok(())
}

impl KvLayout {
    /// Builds a layout, refusing zero or out-of-limit dimensions.
    pub fn new(
        fingerprint: Fingerprint,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        dtype: Dtype,
    ) -> Result<Self> {
        check_dim("layers", layers, MAX_LAYERS)?;
        check_dim("kv_heads", kv_heads, MAX_KV_HEADS)?;
        check_dim("head_dim", head_dim, MAX_HEAD_DIM)?;
        check_dim("block_size", block_size, MAX_BLOCK_SIZE)?;
        let region = u64::from(kv_heads)
            * u64::from(block_size)
            * u64::from(head_dim)
            * u64::from(dtype.bytes());
        if region > MAX_REGION_BYTES {
            return Err(Error::InvalidLayout(format!(
                "region of {region} bytes exceeds the {MAX_REGION_BYTES}-byte limit"
            )));
        }
        Ok(KvLayout {
            fingerprint,
            layers,
            kv_heads,
            head_dim,
            block_size,
            dtype,
        })
    }

    /// Model identity.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.layers
    }
    /// Number of KV heads.
    pub fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Head dimension.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Bytes of one `(block, layer, kind)` region. Never above [`MAX_REGION_BYTES`].
    pub fn region_bytes(&self) -> usize {
        // Bounded by MAX_REGION_BYTES (checked in `new`), so this fits every usize >= 32 bits.
        (self.kv_heads * self.block_size * self.head_dim * self.dtype.bytes()) as usize
    }

    /// Bytes of one layer's wire frame payload for `n_blocks` blocks (K and V).
    pub fn layer_frame_bytes(&self, n_blocks: usize) -> u64 {
        2 * n_blocks as u64 * self.region_bytes() as u64
    }

    /// KV bytes per token over all layers (45 KiB for the default f32 model).
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype.bytes())
    }

    /// Number of blocks needed to hold `tokens` tokens.
    pub fn blocks_for_tokens(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    /// `Ok` when `remote` equals `self` in every field; otherwise an error naming both values of
    /// each mismatching field.
    pub fn check_compatible(&self, remote: &KvLayout) -> Result<(), Box<LayoutMismatch>> {
        let mut fields = Vec::new();
        if self.fingerprint != remote.fingerprint {
            fields.push("fingerprint");
        }
        if self.layers != remote.layers {
            fields.push("layers");
        }
        if self.kv_heads != remote.kv_heads {
            fields.push("kv_heads");
        }
        if self.head_dim != remote.head_dim {
            fields.push("head_dim");
        }
        if self.block_size != remote.block_size {
            fields.push("block_size");
        }
        if self.dtype != remote.dtype {
            fields.push("dtype");
        }
        if fields.is_empty() {
            Ok(())
        } else {
            Err(Box::new(LayoutMismatch {
                local: *self,
                remote: *remote,
                fields,
            }))
        }
    }

    fn field_value(&self, field: &str) -> String {
        match field {
            "fingerprint" => self.fingerprint.to_string(),
            "layers" => self.layers.to_string(),
            "kv_heads" => self.kv_heads.to_string(),
            "head_dim" => self.head_dim.to_string(),
            "block_size" => self.block_size.to_string(),
            "dtype" => self.dtype.to_string(),
            _ => String::new(),
        }
    }
}

/// Refusal of [`KvLayout::check_compatible`]: both layouts plus the differing field names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct LayoutMismatch {
    /// This process's layout.
    pub local: KvLayout,
    /// The peer's layout.
    pub remote: KvLayout,
    /// Names of the fields that differ (subset of fingerprint, layers, kv_heads, head_dim,
    /// block_size, dtype).
    pub fields: Vec<&'static str>,
}

impl fmt::Display for LayoutMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KV layout mismatch:")?;
        for (i, field) in self.fields.iter().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(
                f,
                "{sep}{field}: local={} remote={}",
                self.local.field_value(field),
                self.remote.field_value(field)
            )?;
        }
        Ok(())
    }
}

/// What one transfer carries: the request, its token range and the receiver-reserved blocks.
///
/// Invariants checked by [`TransferDesc::validate`]: `token_start` is block aligned,
/// `token_count > 0`, `dst_blocks.len() == ceil(token_count / block_size)` and is at most
/// [`MAX_BLOCKS_PER_TRANSFER`], and no block id repeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferDesc {
    /// Request the KV belongs to.
    pub request_id: u64,
    /// First token position covered (a multiple of the block size).
    pub token_start: u32,
    /// Number of tokens covered.
    pub token_count: u32,
    /// Destination block ids at the receiver, in sequence order.
    pub dst_blocks: Vec<u32>,
}

impl TransferDesc {
    /// Checks the descriptor against `layout`.
    pub fn validate(&self, layout: &KvLayout) -> Result<()> {
        let bad = |d: String| Err(Error::malformed("transfer header", d));
        if self.token_count == 0 {
            return bad("token_count is 0".into());
        }
        if self.token_start % layout.block_size() != 0 {
            return bad(format!(
                "token_start {} is not a multiple of block_size {}",
                self.token_start,
                layout.block_size()
            ));
        }
        if self.token_start.checked_add(self.token_count).is_none() {
            return bad("token range overflows u32".into());
        }
        if self.dst_blocks.len() > MAX_BLOCKS_PER_TRANSFER as usize {
            return Err(Error::Oversized {
                what: "block list",
                len: self.dst_blocks.len() as u64,
                limit: u64::from(MAX_BLOCKS_PER_TRANSFER),
            });
        }
        let need = layout.blocks_for_tokens(self.token_count) as usize;
        if self.dst_blocks.len() != need {
            return bad(format!(
                "{} tokens need {need} blocks of {}, header lists {}",
                self.token_count,
                layout.block_size(),
                self.dst_blocks.len()
            ));
        }
        let mut sorted = self.dst_blocks.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::DuplicateBlock { block: w[0] });
        }
        Ok(())
    }

    /// Payload bytes of the whole transfer (all layers).
    pub fn payload_bytes(&self, layout: &KvLayout) -> u64 {
        u64::from(layout.layers()) * layout.layer_frame_bytes(self.dst_blocks.len())
    }

    /// Layer bytes the whole transfer puts on the wire when encoded by `c`.
    pub fn wire_bytes(&self, layout: &KvLayout, c: Compression) -> u64 {
        u64::from(layout.layers()) * c.layer_wire_bytes(layout, self.dst_blocks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> KvLayout {
        KvLayout::new(Fingerprint([7; 32]), 30, 3, 64, 16, Dtype::F32).unwrap()
    }

    #[test]
    fn default_model_sizes() {
        let l = model();
        assert_eq!(l.region_bytes(), 12 * 1024);
        assert_eq!(l.bytes_per_token(), 45 * 1024);
        assert_eq!(l.layer_frame_bytes(64), 2 * 64 * 12 * 1024);
    }

    #[test]
    fn rejects_bad_dims() {
        assert!(KvLayout::new(Fingerprint::default(), 0, 3, 64, 16, Dtype::F32).is_err());
        assert!(KvLayout::new(Fingerprint::default(), 1, 1024, 16384, 4096, Dtype::F32).is_err());
    }

    #[test]
    fn mismatch_names_both_values() {
        let a = model();
        let b = KvLayout::new(Fingerprint([7; 32]), 32, 3, 64, 16, Dtype::F16).unwrap();
        let e = a.check_compatible(&b).unwrap_err();
        assert_eq!(e.fields, vec!["layers", "dtype"]);
        let s = e.to_string();
        assert!(s.contains("layers: local=30 remote=32"), "{s}");
        assert!(s.contains("dtype: local=f32 remote=f16"), "{s}");
    }

    #[test]
    fn serde_round_trip() {
        let l = model();
        let j = serde_json::to_string(&l).unwrap();
        let back: KvLayout = serde_json::from_str(&j).unwrap();
        assert_eq!(back, l);
        let bad = j.replace("\"layers\":30", "\"layers\":0");
        assert!(serde_json::from_str::<KvLayout>(&bad).is_err());
    }

    #[test]
    fn desc_validation() {
        let l = model();
        let ok = TransferDesc {
            request_id: 1,
            token_start: 0,
            token_count: 17,
            dst_blocks: vec![4, 9],
        };
        ok.validate(&l).unwrap();
        let mut d = ok.clone();
        d.dst_blocks = vec![4, 4];
        assert!(matches!(
            d.validate(&l),
            Err(Error::DuplicateBlock { block: 4 })
        ));
        let mut d = ok.clone();
        d.dst_blocks = vec![4];
        assert!(d.validate(&l).is_err());
        let mut d = ok;
        d.token_start = 3;
        assert!(d.validate(&l).is_err());
    }
}
