//! Proto <-> engine conversions. Proto fields use 0 for "unset"; the engine's defaults
//! apply then (top_p 1, repetition_penalty 1).

use duet_engine::{
    AttentionPolicy, EngineError, FinishReason, KvTier, SamplingParams, SnapKv, Window,
};
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

/// The engine's attention policy from the proto form; `None` when unset (the caller's
/// default applies). The sizes are checked against a model by
/// [`AttentionPolicy::validate`], not here; a window of 0 is refused here already.
pub fn attention_from_proto(
    p: Option<&pb::AttentionPolicy>,
) -> Result<Option<AttentionPolicy>, EngineError> {
    match p.and_then(|p| p.policy.as_ref()) {
        None => Ok(None),
        Some(pb::attention_policy::Policy::Full(_)) => Ok(Some(AttentionPolicy::Full)),
        Some(pb::attention_policy::Policy::Window(w)) => {
            if w.window == 0 {
                return Err(EngineError::invalid(
                    "attention.window",
                    "must be at least 1",
                ));
            }
            Ok(Some(AttentionPolicy::Window(Window {
                window: w.window as usize,
                sinks: w.sinks as usize,
            })))
        }
        Some(pb::attention_policy::Policy::Snapkv(s)) => {
            let or = |v: u32, d: usize| if v == 0 { d } else { v as usize };
            let s = SnapKv {
                budget: s.budget as usize,
                observe: or(s.observe, SnapKv::DEFAULT_OBSERVE),
                pool: or(s.pool, SnapKv::DEFAULT_POOL),
            };
            s.validate()?;
            Ok(Some(AttentionPolicy::SnapKv(s)))
        }
    }
}

/// The proto form of an attention policy.
pub fn attention_to_proto(a: AttentionPolicy) -> pb::AttentionPolicy {
    let policy = match a {
        AttentionPolicy::Full => pb::attention_policy::Policy::Full(pb::FullAttention {}),
        AttentionPolicy::Window(w) => pb::attention_policy::Policy::Window(pb::LocalWindow {
            window: u32::try_from(w.window).unwrap_or(u32::MAX),
            sinks: u32::try_from(w.sinks).unwrap_or(u32::MAX),
        }),
        AttentionPolicy::SnapKv(s) => pb::attention_policy::Policy::Snapkv(pb::SnapKvSelection {
            budget: u32::try_from(s.budget).unwrap_or(u32::MAX),
            observe: u32::try_from(s.observe).unwrap_or(u32::MAX),
            pool: u32::try_from(s.pool).unwrap_or(u32::MAX),
        }),
    };
    pb::AttentionPolicy {
        policy: Some(policy),
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
