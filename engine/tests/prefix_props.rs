//! Property test of the prefix cache under a small pool: random request streams with
//! shared prefixes start (attaching whatever is cached), grow, and finish, while the pool
//! evicts to a host tier and a disk tier. Every block carries a marker derived from the
//! tokens it holds, so the test sees any block that was handed to another sequence while
//! in use, any cached block whose content does not match its hash, and any block lost from
//! the accounting.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use duet_engine::{KvCache, KvDtype, KvKind, KvLayout, PrefixCacheConfig};
use proptest::prelude::*;

const BS: usize = 4;
const POOL: usize = 24;

#[derive(Debug, Clone)]
enum Op {
    /// A request: one of a few shared prefixes, then its own tail.
    Start { base: usize, tail: Vec<u32> },
    /// A running request generates `n` tokens.
    Grow { seq: usize, n: usize },
    /// A running request ends.
    Finish { seq: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, proptest::collection::vec(0..50u32, 1..14))
            .prop_map(|(base, tail)| Op::Start { base, tail }),
        (0..6usize, 1..9usize).prop_map(|(seq, n)| Op::Grow { seq, n }),
        (0..6usize).prop_map(|seq| Op::Finish { seq }),
    ]
}

fn layout() -> KvLayout {
    KvLayout {
        fingerprint: "props".into(),
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        block_size: BS,
        dtype: KvDtype::F32,
        groups: duet_engine::KvGroups::single(2),
    }
}

fn bases() -> [Vec<u32>; 3] {
    [
        (0..12).collect(),
        (0..8).chain(100..110).collect(),
        (200..203).collect(),
    ]
}

/// What block `i` of a sequence must hold: the hash of its prefix.
fn write_marker(cache: &mut KvCache, block: u32, hash: u64) {
    cache.region_bytes_mut(block, 1, KvKind::V)[..8].copy_from_slice(&hash.to_le_bytes());
}

fn marker(cache: &KvCache, block: u32) -> u64 {
    let b = cache.region_bytes(block, 1, KvKind::V);
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

struct Live {
    id: u64,
    tokens: Vec<u32>,
}

/// Computes `live`'s tokens past what its cache sequence holds ("the forward pass"): room
/// for them, a marker in every block that became full, then their registration.
fn compute(cache: &mut KvCache, live: &Live) -> Result<(), String> {
    let len = cache.sequence_len(live.id).map_err(|e| e.to_string())?;
    let n = live.tokens.len() - len;
    if cache.prepare_append(live.id, n).is_err() {
        return Err("full".into());
    }
    cache.commit_append(live.id, n).map_err(|e| e.to_string())?;
    let hashes = cache.prefix_hasher().hashes(&live.tokens);
    let blocks = cache
        .sequence_blocks(live.id)
        .map_err(|e| e.to_string())?
        .to_vec();
    for (i, &h) in hashes.iter().enumerate().skip(len / BS) {
        write_marker(cache, blocks[i], h);
    }
    cache
        .register_blocks(live.id, &live.tokens)
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn check(cache: &KvCache, live: &[Live]) -> Result<(), TestCaseError> {
    cache.allocator().check().map_err(TestCaseError::fail)?;
    cache.check_prefix_cache().map_err(TestCaseError::fail)?;
    let held: usize = live
        .iter()
        .map(|l| cache.sequence_blocks(l.id).map_or(0, |b| b.len()))
        .sum();
    prop_assert!(cache.used_blocks() <= held, "a block is used by nobody");
    for l in live {
        // Every full block of a running sequence still holds its own content.
        let hashes = cache.prefix_hasher().hashes(&l.tokens);
        let blocks = cache
            .sequence_blocks(l.id)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, &h) in hashes.iter().enumerate() {
            prop_assert_eq!(
                marker(cache, blocks[i]),
                h,
                "block {} of seq {} changed",
                i,
                l.id
            );
            prop_assert!(cache.allocator().refcount(blocks[i]) > 0);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn no_block_in_use_is_evicted_and_cached_blocks_hold_their_prefix(
        ops in proptest::collection::vec(op(), 1..120)
    ) {
        let disk = std::env::temp_dir().join(format!(
            "duet-prefix-props-{}-{:?}.kv",
            std::process::id(),
            std::thread::current().id()
        ));
        let mut cache = KvCache::new(layout(), POOL);
        cache
            .enable_prefix_cache(&PrefixCacheConfig { host_blocks: 4, disk: Some((disk, 4)) })
            .expect("prefix cache");
        let mut live: Vec<Live> = Vec::new();
        let mut next = 0u64;
        for op in ops {
            match op {
                Op::Start { base, tail } => {
                    let tokens: Vec<u32> = bases()[base].iter().copied().chain(tail).collect();
                    let id = next;
                    next += 1;
                    cache.add_sequence(id).expect("add");
                    let hashes = cache.prefix_hasher().hashes(&tokens);
                    let hit = cache.attach_prefix(id, &hashes, tokens.len() - 1).expect("attach");
                    prop_assert!(hit.blocks() * BS < tokens.len(), "at least one token is computed");
                    // Attached blocks hold exactly the prefix they were found under.
                    let blocks = cache.sequence_blocks(id).expect("seq").to_vec();
                    for (i, b) in blocks.iter().enumerate() {
                        prop_assert_eq!(marker(&cache, *b), hashes[i]);
                    }
                    let l = Live { id, tokens };
                    match compute(&mut cache, &l) {
                        Ok(()) => live.push(l),
                        Err(_) => cache.free_sequence(id),
                    }
                }
                Op::Grow { seq, n } if !live.is_empty() => {
                    let i = seq % live.len();
                    let before = live[i].tokens.len();
                    let start = live[i].tokens.last().copied().unwrap_or(0);
                    live[i].tokens.extend((1..=n as u32).map(|k| (start + k) % 60));
                    if compute(&mut cache, &live[i]).is_err() {
                        // No room: the request is preempted (freed), as a scheduler would.
                        let l = live.swap_remove(i);
                        cache.free_sequence(l.id);
                    } else {
                        prop_assert!(live[i].tokens.len() > before);
                    }
                }
                Op::Finish { seq } if !live.is_empty() => {
                    let l = live.swap_remove(seq % live.len());
                    cache.free_sequence(l.id);
                }
                _ => {}
            }
            check(&cache, &live)?;
        }
        for l in live.drain(..) {
            cache.free_sequence(l.id);
        }
        prop_assert_eq!(cache.used_blocks(), 0);
        prop_assert_eq!(cache.free_blocks(), POOL);
    }
}

/// A block coming back from a full host tier is taken out before the device block it needs
/// is allocated: the eviction that allocation causes moves another block into the freed
/// slot instead of pushing the wanted block out of the tier.
#[test]
fn a_hit_in_a_full_host_tier_survives_the_eviction_it_causes() {
    let mut cache = KvCache::new(layout(), 2);
    cache
        .enable_prefix_cache(&PrefixCacheConfig {
            host_blocks: 1,
            disk: None,
        })
        .expect("prefix cache");
    let run = |cache: &mut KvCache, id: u64, tokens: &[u32]| {
        cache.add_sequence(id).expect("add");
        cache.prepare_append(id, tokens.len()).expect("room");
        cache.commit_append(id, tokens.len()).expect("commit");
        let b = cache.sequence_blocks(id).expect("seq")[0];
        write_marker(cache, b, cache.prefix_hasher().hashes(tokens)[0]);
        cache.register_blocks(id, tokens).expect("register");
        cache.free_sequence(id);
    };
    let (a, b, c) = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]);
    run(&mut cache, 1, &a);
    run(&mut cache, 2, &b);
    // The pool is full of cached blocks: c evicts a (the oldest) to the host tier.
    run(&mut cache, 3, &c);
    let ha = cache.prefix_hasher().hashes(&a);
    assert_eq!(cache.lookup_prefix(&ha).host, 1);
    // Bringing a back evicts b, whose spill needs the host tier's only slot.
    cache.add_sequence(4).expect("add");
    let hit = cache.attach_prefix(4, &ha, 4).expect("attach");
    assert_eq!(hit.host, 1, "{hit:?}");
    let blk = cache.sequence_blocks(4).expect("seq")[0];
    assert_eq!(marker(&cache, blk), ha[0], "a's KV came back");
    assert_eq!(
        cache.lookup_prefix(&cache.prefix_hasher().hashes(&b)).host,
        1,
        "b went down"
    );
    cache.free_sequence(4);
    cache.allocator().check().expect("allocator");
    cache.check_prefix_cache().expect("index");
}
