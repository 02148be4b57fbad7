//! What the decode worker's gRPC door lets through. Every field of an internal request is
//! checked against this worker's model before the request reaches the engine thread, so a
//! malformed request is refused alone (`INVALID_ARGUMENT`, naming the field) and never joins
//! a batch that other requests share. The router checks the same things for its clients;
//! this door does not rely on it (a worker port may be reached by other callers).

use duet_engine::{check_prompt, AttentionPolicy, EngineError, GenerationParams};
use duet_proto::v1 as pb;

/// What requests are checked against: this worker's model and pool.
#[derive(Debug, Clone, Copy)]
pub struct DoorLimits {
    pub vocab_size: usize,
    pub context_length: usize,
    pub block_size: usize,
}

/// More block hashes than the prompt has full blocks cannot describe its prefix.
fn check_hashes(hashes: usize, prompt_tokens: usize, l: &DoorLimits) -> Result<(), EngineError> {
    let full = prompt_tokens / l.block_size.max(1);
    if hashes > full {
        return Err(EngineError::invalid(
            "block_hashes",
            format!("{hashes} hashes for a prompt of {prompt_tokens} tokens ({full} full blocks)"),
        ));
    }
    Ok(())
}

/// A `Decode.Generate`, with the generation parameters and attention policy it was
/// converted to (a windowed sequence may run past the context; its sizes are checked
/// against the model by [`AttentionPolicy::validate`]).
pub fn check_generate(
    r: &pb::DecodeRequest,
    params: &GenerationParams,
    attention: AttentionPolicy,
    l: &DoorLimits,
) -> Result<(), EngineError> {
    attention.validate(l.context_length)?;
    let limit = attention.max_sequence_tokens(l.context_length);
    check_prompt(&r.prompt, l.vocab_size, limit)?;
    params.validate(limit)?;
    match &r.prefill {
        Some(pb::decode_request::Prefill::Local(p)) => {
            // At least one token is the prompt proper: a replay is what was generated after it.
            if p.replay_tokens as usize >= r.prompt.len() {
                return Err(EngineError::invalid(
                    "replay_tokens",
                    format!(
                        "{} for a prompt of {} tokens (must be fewer)",
                        p.replay_tokens,
                        r.prompt.len()
                    ),
                ));
            }
            Ok(())
        }
        Some(pb::decode_request::Prefill::Via(v)) => {
            if v.prefill_address.is_empty() {
                return Err(EngineError::invalid("prefill_address", "empty"));
            }
            if attention != AttentionPolicy::Full && !v.block_hashes.is_empty() {
                return Err(EngineError::invalid(
                    "block_hashes",
                    "a windowed or SnapKV prompt does not use the prefix cache",
                ));
            }
            check_hashes(v.block_hashes.len(), r.prompt.len(), l)
        }
        None => Err(EngineError::invalid("prefill", "missing (local or via)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: AttentionPolicy = AttentionPolicy::Full;

    const L: DoorLimits = DoorLimits {
        vocab_size: 100,
        context_length: 64,
        block_size: 16,
    };

    fn req(prompt: Vec<u32>, prefill: pb::decode_request::Prefill) -> pb::DecodeRequest {
        pb::DecodeRequest {
            request_id: 1,
            prompt,
            max_tokens: 8,
            prefill: Some(prefill),
            ..Default::default()
        }
    }

    fn params(max_tokens: usize) -> GenerationParams {
        GenerationParams {
            max_tokens,
            ..Default::default()
        }
    }

    fn local(replay: u32) -> pb::decode_request::Prefill {
        pb::decode_request::Prefill::Local(pb::LocalPrefill {
            replay_tokens: replay,
        })
    }

    #[test]
    fn a_well_formed_request_passes() {
        assert!(check_generate(&req(vec![1, 2, 3], local(1)), &params(8), FULL, &L).is_ok());
        let via = pb::decode_request::Prefill::Via(pb::ViaPrefill {
            prefill_address: "http://127.0.0.1:1".into(),
            block_hashes: vec![7],
            ..Default::default()
        });
        assert!(check_generate(&req(vec![5; 16], via), &params(8), FULL, &L).is_ok());
    }

    #[test]
    fn every_malformed_field_is_refused_by_name() {
        let cases: Vec<(pb::DecodeRequest, GenerationParams, &str)> = vec![
            (req(vec![1, 100, 3], local(0)), params(8), "token id 100"),
            (req(vec![], local(0)), params(8), "prompt"),
            (req(vec![1; 64], local(0)), params(8), "prompt"),
            (req(vec![1, 2], local(2)), params(8), "replay_tokens"),
            (req(vec![1, 2], local(0)), params(0), "max_tokens"),
            (req(vec![1, 2], local(0)), params(65), "max_tokens"),
            (
                req(
                    vec![1; 20],
                    pb::decode_request::Prefill::Via(pb::ViaPrefill {
                        prefill_address: "http://127.0.0.1:1".into(),
                        block_hashes: vec![1, 2],
                        ..Default::default()
                    }),
                ),
                params(8),
                "block_hashes",
            ),
            (
                req(
                    vec![1; 20],
                    pb::decode_request::Prefill::Via(pb::ViaPrefill::default()),
                ),
                params(8),
                "prefill_address",
            ),
            (
                pb::DecodeRequest {
                    prefill: None,
                    ..req(vec![1], local(0))
                },
                params(8),
                "prefill",
            ),
        ];
        for (r, p, want) in cases {
            let e = check_generate(&r, &p, FULL, &L).expect_err(want);
            assert!(e.to_string().contains(want), "{want}: {e}");
            assert_eq!(
                e.class(),
                duet_engine::ErrorClass::InvalidArgument,
                "{want}"
            );
        }
        let mut p = params(8);
        p.sampling.temperature = f32::NAN;
        assert!(check_generate(&req(vec![1], local(0)), &p, FULL, &L).is_err());
    }

    #[test]
    fn a_windowed_sequence_may_run_past_the_context_but_not_with_cached_blocks() {
        let w = AttentionPolicy::Window(duet_engine::Window {
            window: 16,
            sinks: 4,
        });
        // 64 prompt tokens and 100 to generate: past the 64-token context, within the window.
        assert!(check_generate(&req(vec![1; 64], local(0)), &params(100), w, &L).is_ok());
        let via = pb::decode_request::Prefill::Via(pb::ViaPrefill {
            prefill_address: "http://127.0.0.1:1".into(),
            block_hashes: vec![7],
            ..Default::default()
        });
        let e = check_generate(&req(vec![5; 16], via), &params(8), w, &L).unwrap_err();
        assert!(e.to_string().contains("block_hashes"), "{e}");
        let too_wide = AttentionPolicy::Window(duet_engine::Window {
            window: 64,
            sinks: 4,
        });
        let e = check_generate(&req(vec![1; 8], local(0)), &params(8), too_wide, &L).unwrap_err();
        assert!(e.to_string().contains("attention.window"), "{e}");
    }
}
