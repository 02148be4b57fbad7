//! Stop strings, seeds and finish reasons as a user of `generate` sees them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{generate, FinishReason, GenerationParams, KvCache, KvDtype, SamplingParams};

fn run(prompt: &str, params: GenerationParams) -> duet_engine::GenerationOutput {
    let m = common::model(1);
    let ids = m.tokenizer.encode(prompt, false).expect("encode");
    let mut cache = KvCache::new(m.kv_layout(16, KvDtype::F32), 32);
    let mut streamed = String::new();
    let out = generate(m, &mut cache, 1, &ids, params, 0, &mut |s| {
        streamed.push_str(&s.text)
    })
    .expect("generate");
    assert_eq!(
        streamed, out.text,
        "streamed deltas add up to the final text"
    );
    assert_eq!(cache.free_blocks(), cache.total_blocks());
    out
}

#[test]
fn stop_string_spanning_tokens_ends_generation_and_is_not_emitted() {
    let free = run(
        "The capital of France is",
        GenerationParams {
            max_tokens: 24,
            ..Default::default()
        },
    );
    assert_eq!(free.finish_reason, FinishReason::Length);
    // Pick a stop string from the middle of what the model really says,
    // spanning a token boundary.
    let text = free.text.clone();
    let mid = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map(|(i, _)| i)
        .expect("mid");
    let end = text[mid..]
        .char_indices()
        .nth(4)
        .map(|(i, _)| mid + i)
        .unwrap_or(text.len());
    let stop = text[mid..end].to_string();
    let first = text.find(&stop).expect("stop occurs");
    let stopped = run(
        "The capital of France is",
        GenerationParams {
            max_tokens: 24,
            stop: vec![stop.clone()],
            ..Default::default()
        },
    );
    assert_eq!(stopped.finish_reason, FinishReason::Stop);
    assert_eq!(
        stopped.text,
        text[..first],
        "text up to (not including) {stop:?}"
    );
    assert!(stopped.ids.len() < free.ids.len());
}

#[test]
fn same_seed_same_tokens_and_different_seed_differs() {
    let p = |seed| GenerationParams {
        max_tokens: 16,
        sampling: SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(seed),
            ..Default::default()
        },
        ..Default::default()
    };
    let a = run("Write a word:", p(11));
    let b = run("Write a word:", p(11));
    assert_eq!(a.ids, b.ids);
    let others: Vec<Vec<u32>> = (12..16).map(|s| run("Write a word:", p(s)).ids).collect();
    assert!(
        others.iter().any(|o| *o != a.ids),
        "four other seeds all gave the same tokens"
    );
}

#[test]
fn invalid_parameters_and_empty_prompt_are_rejected_with_the_field_named() {
    let m = common::model(1);
    let mut cache = KvCache::new(m.kv_layout(16, KvDtype::F32), 8);
    let bad = [
        (
            GenerationParams {
                max_tokens: 0,
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            GenerationParams {
                sampling: SamplingParams {
                    temperature: -0.5,
                    ..Default::default()
                },
                ..Default::default()
            },
            "temperature",
        ),
        (
            GenerationParams {
                sampling: SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                ..Default::default()
            },
            "top_p",
        ),
        (
            GenerationParams {
                stop: vec![String::new()],
                ..Default::default()
            },
            "stop",
        ),
    ];
    for (params, field) in bad {
        let e = generate(m, &mut cache, 1, &[504], params, 0, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains(field), "{e} should name {field}");
    }
    let e = generate(
        m,
        &mut cache,
        1,
        &[],
        GenerationParams::default(),
        0,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("prompt"), "{e}");
    let e = generate(
        m,
        &mut cache,
        1,
        &[999_999],
        GenerationParams::default(),
        0,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("vocabulary"), "{e}");
    assert_eq!(
        cache.free_blocks(),
        cache.total_blocks(),
        "failed requests leave no blocks behind"
    );
    assert_eq!(cache.num_sequences(), 0);
}

/// Feeds `ids` to `g` as its samples (one-hot logits with greedy sampling); returns the text
/// emitted and whether the last token finished the generation.
fn feed(g: &mut duet_engine::Generation, ids: &[u32]) -> (String, bool) {
    let tok = &common::model(1).tokenizer;
    let mut text = String::new();
    for &id in ids {
        let mut logits = vec![0.0f32; tok.vocab_size()];
        logits[id as usize] = 1.0;
        let step = g.step(tok, &mut logits, usize::MAX);
        assert_eq!(step.id, id);
        text.push_str(&step.text);
        if step.finished.is_some() {
            return (text, true);
        }
    }
    (text, false)
}

/// Samples the end-of-stream token: what the generation flushes.
fn end_of_stream(g: &mut duet_engine::Generation) -> String {
    let tok = &common::model(1).tokenizer;
    let mut logits = vec![0.0f32; tok.vocab_size()];
    logits[tok.stop_token_ids()[0] as usize] = 1.0;
    let step = g.step(tok, &mut logits, usize::MAX);
    assert!(step.finished.is_some());
    step.text
}

/// A stream migrated after any token (a new generation that resumes the tokens sent so far)
/// gives the client exactly the text of an undisturbed run: nothing held back before the
/// migration (an unfinished character, a possible stop string) is lost, nothing is repeated.
#[test]
fn a_generation_resumed_after_any_token_continues_the_same_text() {
    let tok = &common::model(1).tokenizer;
    let prompt = tok.encode("Say it:", false).expect("encode");
    // Multi-byte characters split across byte tokens, and a stop string whose prefixes
    // occur (and are held back) several times before it completes.
    let generated = tok
        .encode(
            " caf\u{e9} \u{1f469}\u{200d}\u{1f52c} ends; end. The END",
            false,
        )
        .expect("encode");
    for stop in [
        vec![],
        vec!["END".to_string()],
        vec!["ends;".to_string(), "\u{1f52c}".to_string()],
    ] {
        let params = GenerationParams {
            max_tokens: 64,
            stop: stop.clone(),
            ..Default::default()
        };
        let mut whole = duet_engine::Generation::new(tok, &prompt, params.clone()).expect("new");
        let (reference, finished) = feed(&mut whole, &generated);
        let reference = if finished {
            reference
        } else {
            // The end of the stream flushes what was held back.
            reference + &end_of_stream(&mut whole)
        };
        for k in 1..generated.len() {
            let mut before =
                duet_engine::Generation::new(tok, &prompt, params.clone()).expect("new");
            let (sent, done) = feed(&mut before, &generated[..k]);
            if done {
                break;
            }
            let extended: Vec<u32> = prompt.iter().chain(&generated[..k]).copied().collect();
            let mut after = duet_engine::Generation::new(
                tok,
                &extended,
                GenerationParams {
                    max_tokens: 64 - k,
                    ..params.clone()
                },
            )
            .expect("new");
            assert_eq!(
                after.resume(tok, &generated[..k]),
                sent,
                "stop {stop:?}, k {k}"
            );
            let (mut rest, done) = feed(&mut after, &generated[k..]);
            if !done {
                rest.push_str(&end_of_stream(&mut after));
            }
            assert_eq!(
                format!("{sent}{rest}"),
                reference,
                "migrated after {k} tokens with stop strings {stop:?}"
            );
            assert!(after.generated().len() <= generated.len() - k + 1);
        }
    }
}
