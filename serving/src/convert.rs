//! Proto <-> engine conversions. Proto fields use 0 for "unset"; the engine's defaults
//! apply then (top_p 1, repetition_penalty 1).

use duet_engine::{FinishReason, KvDtype, SamplingParams};
use duet_kv_transfer::{Dtype, Fingerprint, KvLayout};
use duet_proto::v1 as pb;

/// Engine sampling parameters from the proto form (not validated here: the engine's
/// `validate` names the bad field).
pub fn sampling_from_proto(p: Option<&pb::SamplingParams>) -> SamplingParams {
    let Some(p) = p else {
        return SamplingParams::default();
    };
    SamplingParams {
        temperature: p.temperature,
        top_k: i64::from(p.top_k),
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        min_p: p.min_p,
        repetition_penalty: if p.repetition_penalty == 0.0 {
            1.0
        } else {
            p.repetition_penalty
        },
        seed: p.seed,
    }
}

/// The proto form of engine sampling parameters.
pub fn sampling_to_proto(s: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: s.temperature,
        top_k: u32::try_from(s.top_k.max(0)).unwrap_or(u32::MAX),
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        seed: s.seed,
    }
}

/// Proto finish reason.
pub fn finish_to_proto(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
    }
}

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
