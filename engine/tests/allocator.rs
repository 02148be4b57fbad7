//! Property test: random allocate / append / fork / truncate / free
//! sequences keep the block accounting exact, and freeing everything returns
//! every block.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use duet_engine::{KvCache, KvDtype, KvLayout};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add,
    Append(usize, usize),
    Fork(usize),
    Truncate(usize, usize),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Add),
        (0..8usize, 1..40usize).prop_map(|(s, n)| Op::Append(s, n)),
        (0..8usize).prop_map(Op::Fork),
        (0..8usize, 0..60usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        (0..8usize).prop_map(Op::Free),
    ]
}

fn tiny_layout() -> KvLayout {
    KvLayout {
        fingerprint: "test".into(),
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        block_size: 4,
        dtype: KvDtype::F32,
        groups: duet_engine::KvGroups::single(2),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn block_accounting_stays_exact(ops in proptest::collection::vec(op(), 1..80)) {
        let mut cache = KvCache::new(tiny_layout(), 24);
        let mut live: Vec<u64> = Vec::new();
        let mut next_id = 0u64;
        for op in ops {
            match op {
                Op::Add => {
                    cache.add_sequence(next_id).unwrap();
                    live.push(next_id);
                    next_id += 1;
                }
                Op::Append(i, n) if !live.is_empty() => {
                    let id = live[i % live.len()];
                    let before = cache.free_blocks();
                    match cache.prepare_append(id, n) {
                        Ok(_) => cache.commit_append(id, n).unwrap(),
                        // All or nothing: a refused append takes no block.
                        Err(_) => prop_assert_eq!(cache.free_blocks(), before),
                    }
                }
                Op::Fork(i) if !live.is_empty() => {
                    let src = live[i % live.len()];
                    cache.fork(src, next_id).unwrap();
                    prop_assert_eq!(cache.sequence_blocks(next_id).unwrap(), cache.sequence_blocks(src).unwrap());
                    live.push(next_id);
                    next_id += 1;
                }
                Op::Truncate(i, n) if !live.is_empty() => {
                    let id = live[i % live.len()];
                    let len = cache.sequence_len(id).unwrap();
                    cache.truncate(id, n.min(len)).unwrap();
                }
                Op::Free(i) if !live.is_empty() => {
                    let id = live.remove(i % live.len());
                    cache.free_sequence(id);
                }
                _ => {}
            }
            cache.allocator().check().map_err(TestCaseError::fail)?;
            prop_assert_eq!(cache.free_blocks() + cache.used_blocks(), cache.total_blocks());
            for &id in &live {
                let len = cache.sequence_len(id).unwrap();
                prop_assert!(cache.sequence_blocks(id).unwrap().len() >= len.div_ceil(4));
            }
        }
        for id in live {
            cache.free_sequence(id);
        }
        prop_assert_eq!(cache.free_blocks(), cache.total_blocks());
    }
}

#[test]
fn writing_into_a_shared_block_copies_it_first() {
    let mut cache = KvCache::new(tiny_layout(), 8);
    cache.add_sequence(1).unwrap();
    cache.prepare_append(1, 6).unwrap();
    cache.commit_append(1, 6).unwrap();
    cache.fork(1, 2).unwrap();
    let shared_last = cache.sequence_blocks(1).unwrap()[1];
    assert_eq!(cache.allocator().refcount(shared_last), 2);
    cache.prepare_append(2, 1).unwrap();
    let b2 = cache.sequence_blocks(2).unwrap()[1];
    assert_ne!(b2, shared_last, "the writer got its own copy");
    assert_eq!(cache.allocator().refcount(shared_last), 1);
    assert_eq!(
        cache.sequence_blocks(2).unwrap()[0],
        cache.sequence_blocks(1).unwrap()[0]
    );
}

/// A block handed to a new sequence holds nothing of the sequence that held it before: the
/// slots past the new sequence's length are zero, so a sender moving a partly filled block
/// (and the int8 scale taken over all its slots) sees this sequence's KV alone.
#[test]
fn a_reused_block_holds_nothing_of_its_last_sequence() {
    use duet_engine::KvKind;
    let mut cache = KvCache::new(tiny_layout(), 1);
    cache.add_sequence(1).unwrap();
    cache.prepare_append(1, 4).unwrap();
    let b = cache.sequence_blocks(1).unwrap()[0];
    for layer in 0..2 {
        for kind in [KvKind::K, KvKind::V] {
            cache.region_bytes_mut(b, layer, kind).fill(0x5a);
        }
    }
    cache.commit_append(1, 4).unwrap();
    cache.free_sequence(1);
    cache.add_sequence(2).unwrap();
    cache.prepare_append(2, 1).unwrap();
    assert_eq!(
        cache.sequence_blocks(2).unwrap(),
        [b],
        "the one block, reused"
    );
    for layer in 0..2 {
        for kind in [KvKind::K, KvKind::V] {
            assert!(
                cache.region_bytes(b, layer, kind).iter().all(|&x| x == 0),
                "layer {layer} {kind:?} still holds the last sequence's bytes"
            );
        }
    }
}
