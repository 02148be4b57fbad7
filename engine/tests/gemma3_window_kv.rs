//! Gemma 3's local layers keep only their 512-token window in the paged cache (`kv::groups`):
//! on the longest reference prompt (1,321 tokens) the grouped cache computes the logits of an
//! ungrouped one bit for bit, prompt in chunks and decode steps, with a fraction of the
//! blocks; and a prefix hit past the window (only each local group's window attached)
//! gives the logits of an uncached run bit for bit.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{
    reusable_tokens, KvCache, KvDtype, KvGroups, KvLayout, Model, PrefixCacheConfig, SeqChunk,
};

const GREEDY: &str = "gemma3-270m-q4_k_m-greedy.jsonl";
const BS: usize = 16;

fn longest_prompt() -> Vec<u32> {
    common::greedy_cases_of(GREEDY)
        .into_iter()
        .map(|c| c.prompt)
        .max_by_key(|p| p.len())
        .expect("a reference prompt")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

/// The prompt in chunks of 300 then 6 greedy steps: every chunk's and step's logits (as
/// bits), and the blocks the sequence holds at the end and at most.
fn run(m: &Model, layout: KvLayout, prompt: &[u32]) -> (Vec<Vec<u32>>, usize, usize) {
    let blocks = 6 * (prompt.len() + 8).div_ceil(BS) + 6;
    let mut cache = KvCache::new(layout, blocks);
    cache.add_sequence(1).unwrap();
    let mut out = Vec::new();
    let mut peak = 0;
    let mut last = Vec::new();
    for part in prompt.chunks(300) {
        let ch = SeqChunk::prompt(1, part, true, prompt.len());
        last = m.forward(&mut cache, &[ch]).unwrap().remove(0);
        out.push(bits(&last));
        peak = peak.max(cache.used_blocks());
    }
    for _ in 0..6 {
        let t = [argmax(&last)];
        last = m
            .forward(&mut cache, &[SeqChunk::new(1, &t)])
            .unwrap()
            .remove(0);
        out.push(bits(&last));
        peak = peak.max(cache.used_blocks());
    }
    let held = cache.used_blocks();
    cache.free_sequence(1);
    assert_eq!(cache.free_blocks(), cache.total_blocks(), "blocks leaked");
    assert!(cache.null_block_is_zero(), "the null block was written");
    (out, held, peak)
}

#[test]
fn local_layers_hold_only_their_window_with_an_ungrouped_caches_logits_bit_for_bit() {
    let m = common::gemma_model(2);
    let prompt = longest_prompt();
    assert!(prompt.len() > 1000, "{} tokens", prompt.len());
    let grouped = m.kv_layout(BS, KvDtype::F16);
    assert_eq!(
        (grouped.groups.n_groups(), grouped.groups.per_group),
        (6, 3)
    );
    let single = KvLayout {
        groups: KvGroups::single(18),
        ..grouped.clone()
    };
    let (want, held_single, peak_single) = run(m, single, &prompt);
    let (got, held, peak) = run(m, grouped, &prompt);
    assert_eq!(want.len(), got.len());
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        assert!(a == b, "logits of chunk or step {i} differ");
    }
    // Ungrouped: one block of 18 layers per 16 tokens. Grouped: the global group's block
    // per 16 tokens, and each of 5 local groups only the blocks the next query sees.
    let len = prompt.len() + 6;
    let all = len.div_ceil(BS);
    assert_eq!(held_single, all);
    let first_seen = (len + 1 - 512) / BS;
    assert_eq!(held, all + 5 * (all - first_seen));
    // In bytes: a grouped block holds 3 layers, an ungrouped one 18.
    let (bytes, bytes_single) = (held * 3, held_single * 18);
    assert!(
        bytes * 2 < bytes_single,
        "{bytes} vs {bytes_single} layer-blocks"
    );
    assert!(peak * 3 < peak_single * 18);
    eprintln!(
        "{len} tokens: {held} group blocks (x3 layers) vs {held_single} (x18): {:.1}% of the KV",
        100.0 * bytes as f64 / bytes_single as f64
    );
}

#[test]
fn a_prefix_hit_past_the_window_gives_an_uncached_runs_logits_bit_for_bit() {
    let m = common::gemma_model(2);
    let a = longest_prompt();
    let layout = m.kv_layout(BS, KvDtype::F16);
    let blocks = 6 * (a.len() + 8).div_ceil(BS) * 2;
    // B: A's first 1,000 tokens, then a tail of its own.
    let mut b = a[..1000].to_vec();
    b.extend_from_slice(&a[200..260]);

    let mut uncached = KvCache::new(layout.clone(), blocks);
    uncached.add_sequence(1).unwrap();
    let whole = m
        .forward(&mut uncached, &[SeqChunk::prompt(1, &b, true, b.len())])
        .unwrap()
        .remove(0);

    let mut cache = KvCache::new(layout, blocks);
    cache
        .enable_prefix_cache(&PrefixCacheConfig::default())
        .unwrap();
    cache.add_sequence(1).unwrap();
    let mut done = 0;
    for part in a.chunks(300) {
        let ch = SeqChunk::prompt(1, part, true, a.len());
        m.forward(&mut cache, &[ch]).unwrap();
        done += part.len();
        cache.register_blocks(1, &a[..done]).unwrap();
    }
    cache.free_sequence(1);
    let hashes = cache.prefix_hasher().hashes(&b);
    cache.add_sequence(2).unwrap();
    let hit = cache
        .attach_prefix(2, &hashes, reusable_tokens(b.len(), BS))
        .unwrap();
    let cached = hit.blocks() * BS;
    assert_eq!(cached, 992, "1,000 shared tokens: 62 whole blocks");
    // The global group attached 62 blocks, each local group only the 32 or 33 blocks the
    // query at 992 sees.
    let local = 62 - (992 + 1 - 512) / BS;
    assert_eq!(cache.held_blocks(2).unwrap(), 62 + 5 * local);
    let rest = &b[cached..];
    let got = m
        .forward(&mut cache, &[SeqChunk::prompt(2, rest, true, b.len())])
        .unwrap()
        .remove(0);
    assert!(
        bits(&got) == bits(&whole),
        "a cached prefix changed the logits"
    );
    cache.free_sequence(2);
    cache.check_prefix_cache().unwrap();
}
