//! Proto <-> engine conversions. Proto fields use 0 for "unset"; the engine's defaults
//! apply then (top_p 1, repetition_penalty 1).

use duet_engine::{FinishReason, KvTier, SamplingParams};
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

/// The engine's cache tier of a proto `KvTier` (unknown values read as the device tier).
pub fn tier_from_proto(t: i32) -> KvTier {
    match pb::KvTier::try_from(t) {
        Ok(pb::KvTier::Host) => KvTier::Host,
        Ok(pb::KvTier::Disk) => KvTier::Disk,
        _ => KvTier::Device,
    }
}
