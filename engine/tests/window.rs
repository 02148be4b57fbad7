//! Local attention with sinks (`kv::window`) on the real model, as a user of the engine
//! observes it: a sequence short enough to drop nothing is computed exactly as under full
//! attention; a longer one gives the same logits however its prompt is cut; the blocks it
//! holds stay bounded by the window; and it generates past the model's context, which full
//! attention refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{
    generate_in, AttentionPolicy, GenerationParams, KvCache, KvDtype, LoadOptions, Model,
    NativeSession, SeqChunk, WeightMode, Window,
};

/// The largest difference between two logit vectors, for a failure message.
fn diff(a: &[f32], b: &[f32]) -> String {
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    format!("largest difference {max} over {} logits", a.len())
}

fn policy(window: usize, sinks: usize) -> AttentionPolicy {
    AttentionPolicy::Window(Window { window, sinks })
}

/// The last row's logits of `prompt` fed in chunks of `chunk` under `attention`, and the
/// most blocks the sequence held between forwards.
fn last_logits(
    m: &Model,
    dtype: KvDtype,
    prompt: &[u32],
    chunk: usize,
    attention: AttentionPolicy,
) -> (Vec<f32>, usize) {
    let mut cache = KvCache::new(m.kv_layout(16, dtype), prompt.len().div_ceil(16) + 4);
    cache.add_sequence(1).unwrap();
    cache.set_attention(1, attention).unwrap();
    let (mut last, mut held) = (Vec::new(), 0);
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let logits = (i + 1) * chunk >= prompt.len();
        let out = m
            .forward(
                &mut cache,
                &[SeqChunk::prompt(1, part, logits, prompt.len())],
            )
            .unwrap();
        held = held.max(cache.used_blocks());
        if logits {
            last = out.into_iter().next().unwrap();
        }
    }
    cache.free_sequence(1);
    assert_eq!(cache.used_blocks(), 0, "every block back in the pool");
    (last, held)
}

#[test]
fn a_sequence_that_fits_in_sinks_and_window_is_computed_as_full_attention() {
    let m = common::model(1);
    let prompt = common::corpus_tokens(m, 100);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let (full, _) = last_logits(m, dtype, &prompt, 100, AttentionPolicy::Full);
        // 4 sinks + 96 = 100: the last row sees every token.
        let (win, _) = last_logits(m, dtype, &prompt, 100, policy(96, 4));
        assert!(
            win == full,
            "{dtype:?}: nothing masked: {}",
            diff(&win, &full)
        );
        // One token less of window: the last row no longer sees token 4.
        let (masked, _) = last_logits(m, dtype, &prompt, 100, policy(95, 4));
        assert_ne!(masked, full, "{dtype:?}: a masked row differs");
    }
}

#[test]
fn a_windowed_prompt_gives_the_same_logits_however_it_is_cut_and_holds_only_its_window() {
    let m = common::model(1);
    let prompt = common::corpus_tokens(m, 300);
    let w = Window {
        window: 64,
        sinks: 4,
    };
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let (whole, held_whole) = last_logits(m, dtype, &prompt, 300, AttentionPolicy::Window(w));
        assert!(
            held_whole <= w.max_blocks(16),
            "{dtype:?}: after one forward of 300 tokens the sequence kept {held_whole} blocks"
        );
        // Chunks the size chunked prefill uses (full attention's own logits differ by up
        // to 0.46 for chunks of 2 or 7 tokens here, windowed or not).
        for chunk in [64, 100, 150] {
            let (cut, held) = last_logits(m, dtype, &prompt, chunk, AttentionPolicy::Window(w));
            assert!(
                cut == whole,
                "{dtype:?}: chunks of {chunk}: {}",
                diff(&cut, &whole)
            );
            assert!(
                held <= w.max_blocks(16),
                "{dtype:?}: chunks of {chunk} held {held} blocks, the window needs {}",
                w.max_blocks(16)
            );
        }
        // And the window changes what the model predicts from 300 tokens.
        let (full, _) = last_logits(m, dtype, &prompt, 300, AttentionPolicy::Full);
        assert_ne!(full, whole);
    }
}

#[test]
fn a_windowed_generation_runs_in_a_pool_of_its_window_and_past_the_context() {
    let path = common::model_path();
    let mut m = Model::load(
        &path,
        LoadOptions {
            threads: 1,
            weight_mode: WeightMode::Hybrid,
        },
    )
    .unwrap();
    // A context of 160 tokens, so that a short run goes past it.
    m.config.context_length = 160;
    let prompt = m
        .tokenizer
        .encode("The history of the lighthouse", false)
        .unwrap();
    let params = GenerationParams {
        max_tokens: 300,
        ignore_eos: true,
        ..Default::default()
    };
    let w = Window {
        window: 48,
        sinks: 4,
    };
    // The prompt's blocks plus the window's: far fewer than 300 tokens need.
    let blocks = prompt.len().div_ceil(16) + w.max_blocks(16);
    let mut cache = KvCache::new(m.kv_layout(16, KvDtype::F16), blocks);
    let mut generate = |params: &GenerationParams, attention| {
        let mut session = NativeSession {
            model: &m,
            cache: &mut cache,
        };
        generate_in(
            &mut session,
            1,
            &prompt,
            params.clone(),
            0,
            attention,
            &mut |_| {},
        )
    };
    let out = generate(&params, AttentionPolicy::Window(w)).unwrap();
    assert_eq!(out.ids.len(), 300, "past the context of 160");
    assert!(prompt.len() + 300 > 160);

    // Full attention refuses the same run: past the context.
    let e = generate(&params, AttentionPolicy::Full).unwrap_err();
    assert!(e.to_string().contains("max_tokens"), "{e}");

    // A window wider than the context is refused, naming the field.
    let e = generate(&GenerationParams::default(), policy(200, 4)).unwrap_err();
    assert!(e.to_string().contains("attention.window"), "{e}");
    assert_eq!(cache.used_blocks(), 0, "every block back in the pool");
}
