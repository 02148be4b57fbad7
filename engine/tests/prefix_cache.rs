//! The prefix cache with the real model: a prompt whose leading blocks are cached computes
//! only its suffix and gives the greedy tokens of a run without the cache; blocks evicted to
//! the host tier (and to disk) come back with identical tokens.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{
    sampling::argmax, ChatMessage, KvCache, KvDtype, KvTier, Model, PrefixCacheConfig, SeqChunk,
};

const STEPS: usize = 24;
const BS: usize = 16;

fn system_prompt() -> String {
    // Long enough for several full blocks; the same for every conversation.
    "You are a careful assistant for a library. Answer briefly, cite the shelf number when \
     you name a book, and never invent a title. Opening hours are nine to five on weekdays \
     and ten to two on Saturdays; the library is closed on Sundays and public holidays."
        .to_string()
}

fn chat(m: &Model, user: &str) -> Vec<u32> {
    let msgs = [
        ChatMessage::new("system", system_prompt()),
        ChatMessage::new("user", user),
    ];
    let text = m
        .chat_template
        .as_ref()
        .expect("chat template")
        .render(&msgs, true)
        .expect("template");
    m.tokenizer.encode(&text, true).expect("encode")
}

/// Prefills `prompt` as sequence `seq` (after whatever prefix is attached) and decodes
/// greedily; returns the tokens and the logits of the first step. The sequence stays in
/// the cache.
fn run(m: &Model, cache: &mut KvCache, seq: u64, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let done = cache.sequence_len(seq).expect("sequence");
    let l = m
        .forward(cache, &[SeqChunk::new(seq, &prompt[done..])])
        .expect("prefill");
    let first_logits = l[0].clone();
    let mut out = vec![argmax(&l[0])];
    for _ in 1..STEPS {
        let t = [*out.last().expect("a token")];
        let l = m.forward(cache, &[SeqChunk::new(seq, &t)]).expect("decode");
        out.push(argmax(&l[0]));
    }
    (out, first_logits)
}

fn fresh_cache(m: &Model, blocks: usize, tiers: &PrefixCacheConfig) -> KvCache {
    let mut c = KvCache::new(m.kv_layout(BS, KvDtype::F32), blocks);
    c.enable_prefix_cache(tiers).expect("prefix cache");
    c
}

/// Runs `prompt` with nothing cached.
fn uncached(m: &Model, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let mut c = KvCache::new(m.kv_layout(BS, KvDtype::F32), 64);
    c.add_sequence(0).expect("add");
    run(m, &mut c, 0, prompt)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_shared_system_prompt_is_computed_once_and_tokens_match_an_uncached_run() {
    let m = common::model(2);
    let first = chat(m, "When are you open on Saturday?");
    let second = chat(m, "Do you have books about ships?");
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared >= 3 * BS, "prompts share {shared} tokens");

    let mut cache = fresh_cache(m, 64, &PrefixCacheConfig::default());
    let hasher = cache.prefix_hasher();
    cache.add_sequence(1).expect("add");
    run(m, &mut cache, 1, &first);
    cache.register_blocks(1, &first).expect("register");
    cache.free_sequence(1);
    assert_eq!(
        cache.used_blocks(),
        0,
        "nothing held once the request ended"
    );
    assert!(cache.cached_counts().device >= shared / BS);

    cache.add_sequence(2).expect("add");
    let hit = cache
        .attach_prefix(2, &hasher.hashes(&second), second.len() - 1)
        .expect("attach");
    assert_eq!(hit.device, shared / BS, "every shared full block is reused");
    assert_eq!(cache.sequence_len(2).expect("seq"), hit.device * BS);
    let (with_cache, l1) = run(m, &mut cache, 2, &second);
    let (without, l0) = uncached(m, &second);
    println!(
        "prefix of {} tokens reused, {} computed; first-step logits differ by at most {:.2e}",
        hit.device * BS,
        second.len() - hit.device * BS,
        max_diff(&l0, &l1)
    );
    assert_eq!(
        with_cache, without,
        "greedy tokens with and without the cache"
    );
    cache.allocator().check().expect("allocator");
    cache.check_prefix_cache().expect("index");
}

#[test]
fn blocks_evicted_to_host_and_disk_come_back_with_identical_tokens() {
    let m = common::model(2);
    let prompt = chat(m, "What is the shelf number of Moby Dick?");
    let blocks_needed = (prompt.len() + STEPS).div_ceil(BS);
    let disk = std::env::temp_dir().join(format!("duet-prefix-test-{}.kv", std::process::id()));
    // Device pool: room for one request; host tier smaller than the prompt, so that its
    // oldest blocks go on to disk.
    let tiers = PrefixCacheConfig {
        host_blocks: 2,
        disk: Some((disk.clone(), 64)),
    };
    let mut cache = fresh_cache(m, blocks_needed + 1, &tiers);
    let hasher = cache.prefix_hasher();
    let hashes = hasher.hashes(&prompt);
    cache.add_sequence(1).expect("add");
    let (reference, _) = run(m, &mut cache, 1, &prompt);
    cache.register_blocks(1, &prompt).expect("register");
    cache.free_sequence(1);

    // Another request takes the whole pool: every cached block is evicted downwards.
    let pool = cache.total_blocks();
    let other: Vec<u32> = (0..(pool * BS) as u32).map(|i| 100 + i % 500).collect();
    cache.add_sequence(2).expect("add");
    m.forward(&mut cache, &[SeqChunk::new(2, &other)])
        .expect("other prefill");
    cache.free_sequence(2);
    let before = cache.lookup_prefix(&hashes);
    assert_eq!(before.device, 0, "the pool was reused");
    assert!(before.host > 0 && before.disk > 0, "{before:?}");
    assert_eq!(before.blocks(), hashes.len(), "nothing lost below the pool");
    let events = cache.take_events();
    let moved_to = |tier| {
        events
            .iter()
            .any(|e| matches!(e, duet_engine::KvEvent::Stored { tier: t, .. } if *t == tier))
    };
    assert!(
        moved_to(KvTier::Host) && moved_to(KvTier::Disk),
        "{events:?}"
    );

    cache.add_sequence(3).expect("add");
    let hit = cache
        .attach_prefix(3, &hashes, prompt.len() - 1)
        .expect("attach");
    assert_eq!(
        hit.host + hit.disk,
        hashes.len().min((prompt.len() - 1) / BS)
    );
    let (again, _) = run(m, &mut cache, 3, &prompt);
    assert_eq!(
        again, reference,
        "tokens after a round trip through host and disk"
    );
    cache.free_sequence(3);
    cache.allocator().check().expect("allocator");
    cache.check_prefix_cache().expect("index");
    drop(cache);
    assert!(
        !disk.exists(),
        "the disk tier's file is removed with the cache"
    );
}
