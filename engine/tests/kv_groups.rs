//! The paged cache with layer groups (`kv::groups`), on a small layout shaped like Gemma 3
//! (five local layers of window 8 to one global, blocks of 4): a local group holds only its
//! window, every block comes back, export and import carry what each group keeps, and a
//! prefix hit is never longer than the local windows the cache still holds.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use duet_engine::{
    KvCache, KvDtype, KvGroups, KvKind, KvLayout, LayerAttention, LayerSpec, PrefixCacheConfig,
    PrefixHasher,
};

const BS: usize = 4;
const WINDOW: usize = 8;
const LAYERS: usize = 6;

fn layout() -> KvLayout {
    let layers: Vec<LayerSpec> = (0..LAYERS)
        .map(|l| LayerSpec {
            attention: match l == 5 {
                true => LayerAttention::Global,
                false => LayerAttention::Local { window: WINDOW },
            },
            rope_base: 10_000.0,
        })
        .collect();
    KvLayout {
        fingerprint: "groups".into(),
        n_layers: LAYERS,
        n_kv_heads: 1,
        head_dim: 2,
        block_size: BS,
        dtype: KvDtype::F32,
        groups: KvGroups::for_layers(&layers),
    }
}

/// Blocks a sequence of `len` tokens holds once its local groups dropped what no later
/// query sees (the query at `len` sees `len + 1 - WINDOW..`).
fn expected_held(len: usize) -> usize {
    let all = len.div_ceil(BS);
    let first_seen = (len + 1).saturating_sub(WINDOW);
    all + 5 * (all - first_seen / BS)
}

/// Writes a value naming (layer, logical block, kind) into each region of `id`'s blocks
/// `from..to` that its groups hold.
fn mark(c: &mut KvCache, id: u64, from: usize, to: usize) {
    for layer in 0..LAYERS {
        for i in from..to {
            for kind in [KvKind::K, KvKind::V] {
                if let Some(r) = c.sequence_region_mut(id, i, layer, kind).unwrap() {
                    let v = (layer * 1000 + i * 2 + kind as usize + 1) as f32;
                    r.copy_from_slice(&[v.to_le_bytes(); 8].concat()[..r.len()]);
                }
            }
        }
    }
}

fn marked(c: &KvCache, id: u64, i: usize, layer: usize) -> f32 {
    let r = c.sequence_region(id, i, layer, KvKind::K).unwrap();
    f32::from_le_bytes([r[0], r[1], r[2], r[3]])
}

#[test]
fn the_layout_has_one_global_group_and_five_local_ones() {
    let l = layout();
    assert_eq!((l.groups.n_groups(), l.groups.per_group), (6, 1));
    assert_eq!(l.groups.group_of(5), 0, "the global layer leads");
    let c = KvCache::new(l, 10);
    // A block is one layer's K and V of 4 tokens: 2 x 4 x 2 f32.
    assert_eq!(c.pool_bytes(), 10 * 64);
}

#[test]
fn a_growing_sequence_holds_the_global_blocks_and_only_each_local_window() {
    let mut c = KvCache::new(layout(), 200);
    c.add_sequence(1).unwrap();
    let mut len = 0;
    for step in [5, 1, 7, 3, 16, 1, 1, 9] {
        let want = c.blocks_to_append(1, step).unwrap();
        let before = c.used_blocks();
        c.prepare_append(1, step).unwrap();
        let dropped_first = before + want - c.used_blocks();
        c.commit_append(1, step).unwrap();
        len += step;
        assert_eq!(
            c.held_blocks(1).unwrap(),
            expected_held(len),
            "after {len} tokens"
        );
        assert_eq!(c.used_blocks(), expected_held(len));
        // Without a prefix cache the drop happens at the commit: prepare takes exactly
        // what `blocks_to_append` said.
        assert_eq!(dropped_first, 0, "step {step}");
    }
    assert_eq!(len, 43);
    assert_eq!(expected_held(43), 11 + 5 * 2);
    // A local group's dropped blocks read as zeros (the null block); kept ones are held.
    assert!(c
        .sequence_region(1, 0, 0, KvKind::V)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    c.free_sequence(1);
    assert_eq!(c.free_blocks(), c.total_blocks(), "every block came back");
    c.allocator().check().unwrap();
    assert!(c.null_block_is_zero());
}

#[test]
fn peak_blocks_bound_what_a_chunked_prompt_holds() {
    let mut c = KvCache::new(layout(), 400);
    let (tokens, chunk) = (203, 16);
    c.add_sequence(7).unwrap();
    let mut peak = 0;
    let mut done = 0;
    while done < tokens {
        let n = chunk.min(tokens - done);
        c.prepare_append(7, n).unwrap();
        peak = peak.max(c.used_blocks());
        c.commit_append(7, n).unwrap();
        done += n;
    }
    assert!(peak <= c.peak_blocks(tokens, chunk), "{peak} > bound");
    assert!(
        c.peak_blocks(tokens, chunk) < 6 * tokens.div_ceil(BS),
        "the bound is below an ungrouped cache's"
    );
    assert_eq!(c.used_blocks(), c.kept_blocks(tokens));
}

#[test]
fn export_and_import_carry_each_groups_kept_blocks_into_a_pool_of_another_size() {
    let mut a = KvCache::new(layout(), 300);
    a.add_sequence(1).unwrap();
    let tokens = 30;
    // One append, then the marks, then the commit that drops.
    a.prepare_append(1, tokens).unwrap();
    mark(&mut a, 1, 0, tokens.div_ceil(BS));
    a.commit_append(1, tokens).unwrap();
    let ex = a.export(1).unwrap();
    let n = tokens.div_ceil(BS);
    // Every layer's frame lists every logical block (K then V), dropped ones as zeros.
    for frame in &ex.layers {
        assert_eq!(frame.len(), 2 * n * a.layout().region_bytes());
    }
    let mut b = KvCache::new(layout(), 60);
    b.import(9, &ex).unwrap();
    assert_eq!(b.held_blocks(9).unwrap(), expected_held(tokens));
    assert_eq!(b.used_blocks(), a.used_blocks());
    let first_kept = (tokens + 1 - WINDOW) / BS;
    for layer in 0..LAYERS {
        for i in 0..n {
            let kept = layer == 5 || i >= first_kept;
            let want = match kept {
                true => (layer * 1000 + i * 2 + 1) as f32,
                false => 0.0,
            };
            assert_eq!(marked(&b, 9, i, layer), want, "layer {layer} block {i}");
            assert_eq!(marked(&a, 1, i, layer), want);
        }
    }
    b.free_sequence(9);
    assert_eq!(b.free_blocks(), b.total_blocks());
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// A prompt of `shared` tokens (another prompt's prefix) and a `tail` of its own.
fn prompt(shared: std::ops::Range<u32>, tail: std::ops::Range<u32>) -> Vec<u32> {
    shared.chain(tail).collect()
}

/// `times` appends of `n` tokens to sequence `id`, registering none of them.
fn grow(c: &mut KvCache, id: u64, n: usize, times: usize) {
    for _ in 0..times {
        c.prepare_append(id, n).unwrap();
        c.commit_append(id, n).unwrap();
    }
}

/// A pool of 400 blocks with a prefix cache, and the hasher of its keys.
fn cached_pool() -> (KvCache, PrefixHasher) {
    let mut c = KvCache::new(layout(), 400);
    c.enable_prefix_cache(&PrefixCacheConfig::default())
        .unwrap();
    (c, PrefixHasher::new("groups", BS))
}

#[test]
fn a_prefix_hit_attaches_each_local_window_and_never_outruns_a_missing_one() {
    let (mut c, hasher) = cached_pool();
    let a = tokens(0..80);
    c.add_sequence(1).unwrap();
    // 40 tokens, registered; 40 more, registered: every block of every group is indexed
    // before a local group drops it.
    for half in [0..40, 40..80] {
        c.prepare_append(1, 40).unwrap();
        mark(&mut c, 1, half.start / BS, half.end / BS);
        c.commit_append(1, 40).unwrap();
        c.register_blocks(1, &a[..half.end]).unwrap();
        assert_eq!(c.held_blocks(1).unwrap(), expected_held(half.end));
    }
    c.free_sequence(1);
    c.check_prefix_cache().unwrap();
    // B shares 12 blocks (48 tokens) with A.
    let b = prompt(0..48, 500..530);
    let hashes = hasher.hashes(&b);
    assert_eq!(c.lookup_prefix(&hashes).blocks(), 12);
    c.add_sequence(2).unwrap();
    let hit = c.attach_prefix(2, &hashes, b.len()).unwrap();
    assert_eq!(hit.blocks(), 12);
    assert_eq!(c.sequence_len(2).unwrap(), 48);
    // Global: blocks 0..12; each local group: only the blocks the query at 48 sees.
    assert_eq!(c.held_blocks(2).unwrap(), expected_held(48));
    for layer in [0, 5] {
        assert_eq!(marked(&c, 2, 11, layer), (layer * 1000 + 23) as f32);
    }
    c.free_sequence(2);
    c.check_prefix_cache().unwrap();

    // C computes 40 tokens and 40 more without registering in between: its local groups
    // drop blocks 0..8 unindexed before the next append.
    let cc = tokens(1000..1080);
    c.add_sequence(3).unwrap();
    grow(&mut c, 3, 40, 2);
    c.register_blocks(3, &cc).unwrap();
    c.free_sequence(3);
    // D shares 8 blocks with C: the global group holds them, but no local group holds the
    // window of any prefix of them, so nothing is attached.
    let d = prompt(1000..1032, 2000..2010);
    let hashes = hasher.hashes(&d);
    c.add_sequence(4).unwrap();
    assert_eq!(c.attach_prefix(4, &hashes, d.len()).unwrap().blocks(), 0);
    assert_eq!(c.held_blocks(4).unwrap(), 0);
    // E shares 16 blocks: the windows from block 8 on are indexed, so the hit is 16.
    let e = prompt(1000..1064, 3000..3010);
    let hashes = hasher.hashes(&e);
    c.add_sequence(5).unwrap();
    assert_eq!(c.attach_prefix(5, &hashes, e.len()).unwrap().blocks(), 16);
    assert_eq!(c.held_blocks(5).unwrap(), expected_held(64));
    for id in [4, 5] {
        c.free_sequence(id);
    }
    c.check_prefix_cache().unwrap();
    c.allocator().check().unwrap();
    assert_eq!(c.free_blocks(), c.total_blocks());
}

/// A gap in the local windows (blocks a sequence dropped before it registered them, between
/// blocks another sequence registered): the hit is the longest prefix below the gap whose
/// windows are all there, not the global run, and not nothing.
#[test]
fn a_gap_in_the_local_windows_lowers_the_hit_to_below_it() {
    let (mut c, hasher) = cached_pool();
    let a = tokens(0..80);
    // A1: 40 tokens, registered: every group indexes blocks 0..10.
    c.add_sequence(1).unwrap();
    grow(&mut c, 1, 40, 1);
    c.register_blocks(1, &a[..40]).unwrap();
    c.free_sequence(1);
    // A2 attaches A1's 10 blocks, then computes 20 and 20 more tokens, registering only at
    // the end: its local groups drop blocks 8..13 at the second append, and 10..13 were
    // never indexed.
    c.add_sequence(2).unwrap();
    let hit = c.attach_prefix(2, &hasher.hashes(&a), 80).unwrap();
    assert_eq!(hit.blocks(), 10);
    grow(&mut c, 2, 20, 2);
    c.register_blocks(2, &a).unwrap();
    c.free_sequence(2);
    // F shares 13 blocks: 13, 12 and 11 need a local block in 10..13; 10 needs 8 and 9.
    let f = prompt(0..52, 900..910);
    let hashes = hasher.hashes(&f);
    assert_eq!(c.lookup_prefix(&hashes).blocks(), 10);
    c.add_sequence(3).unwrap();
    assert_eq!(c.attach_prefix(3, &hashes, f.len()).unwrap().blocks(), 10);
    assert_eq!(c.held_blocks(3).unwrap(), expected_held(40));
    c.free_sequence(3);
    c.check_prefix_cache().unwrap();
    assert_eq!(c.free_blocks(), c.total_blocks());
}

/// With a prefix cache, a local group gives back what falls out of its window before the
/// next append allocates: `blocks_to_append` counts the free blocks that append needs,
/// which is what a scheduler compares with the pool's free blocks.
#[test]
fn blocks_to_append_counts_what_a_local_group_gives_back_first() {
    let (mut c, _) = cached_pool();
    c.add_sequence(1).unwrap();
    grow(&mut c, 1, 40, 1);
    // Nothing registered: every local group still holds blocks 0..10.
    assert_eq!(c.held_blocks(1).unwrap(), 6 * 10);
    let need = c.blocks_to_append(1, 40).unwrap();
    let free = c.free_blocks();
    c.prepare_append(1, 40).unwrap();
    assert_eq!(free - c.free_blocks(), need);
    // 10 fresh blocks in each of 6 groups, less the 8 each local group drops first.
    assert_eq!(need, 6 * 10 - 5 * 8);
    // Once indexed and dropped, one more token takes a block in every group.
    c.commit_append(1, 40).unwrap();
    c.register_blocks(1, &tokens(0..80)).unwrap();
    assert_eq!(c.blocks_to_append(1, 1).unwrap(), 6);
}
