//! The engine's KV layout as kv-transfer describes it: both ends of a KV link compare
//! this at the handshake, so a decode worker never imports another model's KV.

use duet_engine::KvDtype;
use duet_kv_transfer::{Dtype, Fingerprint, KvLayout};

/// The engine's KV layout as kv-transfer describes it (the model fingerprint becomes the
/// 32-byte identity both sides compare at the handshake).
pub fn transfer_layout(l: &duet_engine::KvLayout) -> Result<KvLayout, duet_kv_transfer::Error> {
    let mut fp = [0u8; 32];
    match hex::decode(&l.fingerprint) {
        Ok(bytes) if bytes.len() == 32 => fp.copy_from_slice(&bytes),
        _ => fp = Fingerprint::digest(&[l.fingerprint.as_bytes()]).0,
    }
    let dim = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    KvLayout::new(
        Fingerprint(fp),
        dim(l.n_layers),
        dim(l.n_kv_heads),
        dim(l.head_dim),
        dim(l.block_size),
        match l.dtype {
            KvDtype::F32 => Dtype::F32,
            KvDtype::F16 => Dtype::F16,
        },
    )
}
