//! SnapKV (`kv::snapkv`) on the real model, as a user of the engine observes it: a prompt
//! within the budget is generated exactly as under full attention; a longer one holds only
//! its budget's blocks after the prompt, keeps each head's observation window, gives the
//! prompt's own next token (its last row saw everything), and then generates on.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{
    generate_in, AttentionPolicy, GenerationParams, KvCache, KvDtype, NativeSession, Observation,
    SeqChunk, SnapKv,
};

fn snapkv(budget: usize) -> SnapKv {
    SnapKv {
        budget,
        observe: 32,
        pool: 7,
    }
}

#[test]
fn a_prompt_within_the_budget_is_generated_as_under_full_attention() {
    let m = common::model(1);
    let prompt = common::corpus_tokens(m, 200);
    let params = GenerationParams {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let mut cache = KvCache::new(m.kv_layout(16, KvDtype::F16), 64);
    let mut run = |attention| {
        let mut s = NativeSession {
            model: m,
            cache: &mut cache,
        };
        generate_in(
            &mut s,
            1,
            &prompt,
            params.clone(),
            0,
            attention,
            &mut |_| {},
        )
        .unwrap()
    };
    let full = run(AttentionPolicy::Full);
    let snap = run(AttentionPolicy::SnapKv(snapkv(256)));
    assert_eq!(snap.ids, full.ids);
    assert_eq!(cache.used_blocks(), 0);
}

#[test]
fn a_long_prompt_keeps_its_budget_per_head_and_generates_on() {
    let m = common::model(1);
    let prompt = common::corpus_tokens(m, 600);
    let policy = snapkv(256);
    let mut cache = KvCache::new(m.kv_layout(16, KvDtype::F16), 128);
    // Full attention's logits after the prompt, for the same prompt computed whole.
    cache.add_sequence(1).unwrap();
    let full = m
        .forward(
            &mut cache,
            &[SeqChunk::prompt(1, &prompt, true, prompt.len())],
        )
        .unwrap()
        .pop()
        .unwrap();
    let last_keys: Vec<Vec<f32>> = (0..m.config.n_layers)
        .map(|l| cache_keys(&cache, 1, l, prompt.len()))
        .collect();
    cache.free_sequence(1);

    cache.add_sequence(2).unwrap();
    cache
        .set_attention(2, AttentionPolicy::SnapKv(policy))
        .unwrap();
    // Cut so that the observation window (the last 32 positions) spans two chunks: the
    // votes are gathered by position, whatever the chunks.
    let mut obs = Observation::new(2, prompt.len(), policy.observe, m.config.n_layers);
    let mut logits = Vec::new();
    for (from, to) in [(0, 320), (320, 580), (580, 600)] {
        let last = to == prompt.len();
        let ch = SeqChunk::prompt(2, &prompt[from..to], last, prompt.len());
        logits = m
            .forward_observing(&mut cache, &[ch], std::slice::from_mut(&mut obs))
            .unwrap()
            .pop()
            .unwrap();
    }
    m.compress_snapkv(&mut cache, &obs, policy).unwrap();
    // The prompt's last row attended to every token before anything was dropped.
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    assert_eq!(argmax(&logits), argmax(&full));
    assert_eq!(cache.sequence_len(2).unwrap(), 256);
    assert_eq!(cache.shift(2).unwrap(), 600 - 256);
    assert_eq!(cache.used_blocks(), 16, "600 tokens' 38 blocks down to 16");
    // Every head of every layer kept the observation window (the prompt's last 32 keys) in
    // its last 32 slots, bit for bit.
    for (l, keys) in last_keys.iter().enumerate() {
        let kept = cache_keys(&cache, 2, l, 256);
        let (hd, heads) = (m.config.head_dim, m.config.n_kv_heads);
        for h in 0..heads {
            let per_head = |v: &[f32], n: usize, from: usize| -> Vec<f32> {
                (from..n)
                    .flat_map(|t| v[(h * n + t) * hd..(h * n + t + 1) * hd].to_vec())
                    .collect()
            };
            assert_eq!(
                per_head(&kept, 256, 224),
                per_head(keys, 600, 568),
                "layer {l} head {h}"
            );
        }
    }
    // Decoding goes on after the compressed prompt, positions in the prompt's frame.
    let next = argmax(&logits) as u32;
    let out = m.forward(&mut cache, &[SeqChunk::new(2, &[next])]).unwrap();
    assert_eq!(out[0].len(), m.config.vocab_size);
    assert_eq!(cache.sequence_len(2).unwrap(), 257);
    cache.free_sequence(2);
    assert_eq!(cache.used_blocks(), 0);
}

/// The first `n` keys of every KV head of `layer`, head after head.
fn cache_keys(cache: &KvCache, seq: u64, layer: usize, n: usize) -> Vec<f32> {
    (0..cache.layout().n_kv_heads)
        .flat_map(|h| cache.key_rows(seq, layer, h, n).unwrap())
        .collect()
}
