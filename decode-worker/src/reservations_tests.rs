//! The reservation table without a model: expiry, claims, and block accounting over a real
//! paged KV cache of a synthetic layout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_engine::{KvCache, KvDtype, KvKind, KvLayout, LeasedRegion, PrefixCacheConfig};
use proptest::prelude::*;

use super::*;
use crate::leases::{Held, Leases};

const BS: usize = 16;
const TOTAL: usize = 32;
const TTL: Duration = Duration::from_secs(10);
const KV_WAIT: Duration = Duration::from_secs(30);
const FULL: AttentionPolicy = AttentionPolicy::Full;

/// A claimant that can go away.
#[derive(Debug, PartialEq)]
struct Client {
    gone: bool,
}

fn cache() -> KvCache {
    let layout = KvLayout {
        fingerprint: "test".into(),
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        block_size: BS,
        dtype: KvDtype::F16,
        groups: duet_engine::KvGroups::single(2),
    };
    KvCache::new(layout, TOTAL)
}

fn table() -> (Reservations<Client>, Leases) {
    let leases = Leases::default();
    (Reservations::new(Arc::clone(&leases), TTL * 2), leases)
}

/// Every block is free, held by a live sequence (a reservation's, or one of `running`) or
/// parked behind a lease: `free + held + parked == total`, nothing leaked; the allocator is
/// consistent; and the shared map lists exactly the reservations, each with its blocks.
fn check(cache: &KvCache, t: &Reservations<Client>, leases: &Leases, running: &[u64]) {
    let held: usize = t
        .table
        .keys()
        .chain(running)
        .map(|&id| cache.sequence_blocks(id).map_or(0, |b| b.len()))
        .sum();
    assert_eq!(
        cache.free_blocks() + held + t.parked.blocks(cache),
        cache.total_blocks(),
        "a block is neither free nor held by a live or parked sequence"
    );
    assert_eq!(cache.allocator().check(), Ok(()));
    let m = leases.lock().unwrap();
    assert_eq!(m.len(), t.table.len());
    for (id, r) in &t.table {
        let fresh = cache.sequence_blocks(*id).unwrap().len() - r.cached / BS;
        assert_eq!(m[id].block_count(), fresh);
    }
}

/// Writes `byte` into every region of `blocks` in `layer` through reservation `id`'s lease,
/// as a receiver does; `false` when the lease cannot be taken.
fn write(leases: &Leases, id: u64, layer: usize, blocks: &[u32], byte: u8) -> bool {
    let Some(mut held) = Held::take(leases, id) else {
        return false;
    };
    let lease = held.lease().unwrap();
    for &b in blocks {
        for kind in [KvKind::K, KvKind::V] {
            match lease.region_mut(layer, kind, b) {
                LeasedRegion::Write(r) => r.fill(byte),
                other => panic!("block {b} layer {layer}: {other:?}"),
            }
        }
    }
    true
}

fn claim(seq: Client, at: Instant) -> Claim<Client> {
    Claim {
        seq,
        first_token: 7,
        at,
    }
}

#[test]
fn a_windowed_reservation_holds_only_the_blocks_its_prompt_keeps() {
    let (mut c, (mut t, reserved)) = (cache(), table());
    let t0 = Instant::now();
    let w = AttentionPolicy::Window(duet_engine::Window {
        window: 20,
        sinks: 4,
    });
    // 2000 tokens are 125 blocks, four times the pool; the prompt keeps its sink block and
    // the two blocks of the next query's window (tokens 1981..2000).
    let (r, hit) = t.reserve(&mut c, 1, 2000, TTL, None, w, t0).unwrap();
    assert_eq!((r.cached_tokens, r.blocks.len(), hit.blocks()), (0, 3, 0));
    check(&c, &t, &reserved, &[]);
    for layer in 0..2 {
        assert!(write(&reserved, 1, layer, &r.blocks, 1));
    }
    t.received(1, 2000, None, t0);
    assert_eq!(t.check_claim(1, 2000, |h| h.is_empty()), ClaimCheck::Free);
    assert!(t.claim(1, claim(Client { gone: false }, t0)).is_ok());
    let ready = t.take_ready(&mut c);
    assert!(matches!(ready.as_slice(), [Ok(r)] if r.prompt_tokens == 2000));
    assert_eq!(c.sequence_len(1).unwrap(), 2000);
    assert_eq!(c.sequence_blocks(1).unwrap(), r.blocks.as_slice());
    check(&c, &t, &reserved, &[1]);
    c.free_sequence(1);
    assert_eq!(c.free_blocks(), TOTAL);
}

#[test]
fn a_reservation_holds_the_blocks_of_its_prompt_and_lists_them_for_the_receivers() {
    let (mut c, now) = (cache(), Instant::now());
    let (mut t, reserved) = table();
    let (r, _) = t.reserve(&mut c, 1, 40, TTL, None, FULL, now).unwrap();
    assert_eq!(r.cached_tokens, 0);
    assert_eq!(r.blocks.len(), 3);
    assert_eq!(c.used_blocks(), 3);
    for &b in &r.blocks {
        assert!(crate::leases::is_reserved(&reserved, 1, b));
        assert!(!crate::leases::is_reserved(&reserved, 2, b));
    }
    check(&c, &t, &reserved, &[]);
    assert!(matches!(
        t.reserve(&mut c, 1, 40, TTL, None, FULL, now),
        Err(DecodeError::Duplicate(1))
    ));
}

#[test]
fn a_reservation_larger_than_the_free_pool_holds_nothing() {
    let (mut c, now) = (cache(), Instant::now());
    let (mut t, reserved) = table();
    assert!(t
        .reserve(&mut c, 1, TOTAL * BS + 1, TTL, None, FULL, now)
        .is_err());
    assert_eq!(c.free_blocks(), TOTAL);
    assert!(t.is_empty());
    check(&c, &t, &reserved, &[]);
}

#[test]
fn an_unclaimed_reservation_expires_after_its_ttl_and_arriving_kv_extends_it() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, reserved) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    t.reserve(&mut c, 2, 40, TTL, None, FULL, t0).unwrap();
    // KV for 2 arrives at half its lifetime.
    t.received(2, 16, None, t0 + TTL / 2);
    let ended = t.expire(&mut c, t0 + TTL - Duration::from_millis(1), KV_WAIT, |s| {
        s.gone
    });
    assert!(ended.is_empty());
    let ended = t.expire(&mut c, t0 + TTL, KV_WAIT, |s| s.gone);
    assert_eq!(ended, vec![(1, None, Ending::Expired)]);
    assert_eq!(c.used_blocks(), 3);
    let ended = t.expire(&mut c, t0 + TTL + TTL / 2, KV_WAIT, |s| s.gone);
    assert_eq!(ended, vec![(2, None, Ending::Expired)]);
    assert_eq!(c.free_blocks(), TOTAL);
    check(&c, &t, &reserved, &[]);
}

#[test]
fn a_requested_ttl_is_capped_by_the_workers_maximum() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, _) = table();
    t.reserve(&mut c, 1, 40, TTL * 100, None, FULL, t0).unwrap();
    let ended = t.expire(&mut c, t0 + TTL * 2, KV_WAIT, |s| s.gone);
    assert_eq!(ended, vec![(1, None, Ending::Expired)]);
}

#[test]
fn a_claimed_reservation_outlives_its_ttl_until_the_kv_wait_timeout() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, reserved) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    assert!(t.claim(1, claim(Client { gone: false }, t0)).is_ok());
    assert!(t
        .expire(&mut c, t0 + TTL * 2, KV_WAIT, |s| s.gone)
        .is_empty());
    let ended = t.expire(&mut c, t0 + KV_WAIT, KV_WAIT, |s| s.gone);
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].1, Some(Client { gone: false }));
    assert_eq!(ended[0].2, Ending::TransferTimeout);
    assert!(matches!(
        ended[0].2.error(1),
        Some(DecodeError::TransferTimeout(1))
    ));
    assert_eq!(c.free_blocks(), TOTAL);
    check(&c, &t, &reserved, &[]);
}

#[test]
fn a_failed_transfer_or_a_gone_client_ends_a_claimed_reservation_at_once() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, reserved) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    t.reserve(&mut c, 2, 40, TTL, None, FULL, t0).unwrap();
    t.claim(1, claim(Client { gone: false }, t0)).unwrap();
    t.claim(2, claim(Client { gone: true }, t0)).unwrap();
    t.failed(1, "peer reset".into(), None);
    let mut ended = t.expire(&mut c, t0, KV_WAIT, |s| s.gone);
    ended.sort_by_key(|e| e.0);
    assert_eq!(ended[0].2, Ending::TransferFailed("peer reset".into()));
    assert_eq!(ended[1].2, Ending::ClientGone);
    assert!(ended[1].2.error(2).is_none());
    assert_eq!(c.free_blocks(), TOTAL);
    check(&c, &t, &reserved, &[]);
}

#[test]
fn only_a_claimed_complete_reservation_becomes_a_running_sequence_holding_its_blocks() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, reserved) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    t.received(1, 40, None, t0);
    // Complete but unclaimed: stays.
    assert!(t.take_ready(&mut c).is_empty());
    t.claim(1, claim(Client { gone: false }, t0)).unwrap();
    let ready = t.take_ready(&mut c);
    assert_eq!(ready.len(), 1);
    let Ok(r) = &ready[0] else {
        panic!("not ready")
    };
    assert_eq!(
        (r.id, r.prompt_tokens, r.cached, r.claim.first_token),
        (1, 40, 0, 7)
    );
    assert!(t.is_empty());
    // The blocks moved to the sequence: still used, no longer listed for receivers.
    assert_eq!(c.sequence_len(1).unwrap(), 40);
    assert_eq!(c.used_blocks(), 3);
    check(&c, &t, &reserved, &[1]);
    c.free_sequence(1);
    assert_eq!(c.free_blocks(), TOTAL);
}

#[test]
fn incomplete_or_failed_claimed_reservations_do_not_start() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, _) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    t.reserve(&mut c, 2, 40, TTL, None, FULL, t0).unwrap();
    t.claim(1, claim(Client { gone: false }, t0)).unwrap();
    t.claim(2, claim(Client { gone: false }, t0)).unwrap();
    t.received(1, 32, None, t0);
    t.received(2, 40, None, t0);
    t.failed(2, "bad frame".into(), None);
    assert!(t.take_ready(&mut c).is_empty());
    assert_eq!(t.len(), 2);
}

#[test]
fn claims_are_checked_against_the_prompt() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, _) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    assert_eq!(t.check_claim(9, 40, |_| true), ClaimCheck::Missing);
    assert_eq!(t.check_claim(1, 41, |_| true), ClaimCheck::Conflict);
    assert_eq!(t.check_claim(1, 40, |_| false), ClaimCheck::ForeignPrefix);
    assert_eq!(t.check_claim(1, 40, |_| true), ClaimCheck::Free);
    t.claim(1, claim(Client { gone: false }, t0)).unwrap();
    assert_eq!(t.check_claim(1, 40, |_| true), ClaimCheck::Conflict);
    assert!(t.claim(1, claim(Client { gone: false }, t0)).is_err());
    assert!(t.claim(9, claim(Client { gone: false }, t0)).is_err());
}

#[test]
fn a_lease_writes_only_the_reservations_own_blocks_and_one_receiver_at_a_time() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, leases) = table();
    let (r, _) = t.reserve(&mut c, 1, 20, TTL, None, FULL, t0).unwrap();
    let mine = r.blocks[0];
    let other = (0..TOTAL as u32).find(|b| !r.blocks.contains(b)).unwrap();
    let mut held = Held::take(&leases, 1).unwrap();
    assert!(Held::take(&leases, 1).is_none(), "a second receiver");
    assert!(Held::take(&leases, 2).is_none(), "no such reservation");
    let lease = held.lease().unwrap();
    match lease.region_mut(1, KvKind::V, mine) {
        LeasedRegion::Write(dst) => dst.fill(0xab),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        lease.region_mut(1, KvKind::V, other),
        LeasedRegion::Outside
    ));
    assert!(matches!(
        lease.region_mut(2, KvKind::V, mine),
        LeasedRegion::Outside
    ));
    {
        let mut out = Vec::new();
        let twice = lease.regions_mut(1, KvKind::K, &[mine, mine], &mut out);
        assert!(!twice && out.is_empty(), "a block twice");
    }
    let mut out = Vec::new();
    assert!(lease.regions_mut(1, KvKind::K, &r.blocks, &mut out));
    assert_eq!(out.len(), r.blocks.len());
    drop(out);
    drop(held);
    assert!(Held::take(&leases, 1).is_some(), "given back when dropped");
    assert!(c
        .region_bytes(mine, 1, KvKind::V)
        .iter()
        .all(|&b| b == 0xab));
    assert!(c.region_bytes(other, 1, KvKind::V).iter().all(|&b| b == 0));
    assert!(c.region_bytes(mine, 1, KvKind::K).iter().all(|&b| b == 0));
}

#[test]
fn a_reservation_ending_while_a_receiver_writes_keeps_its_blocks_until_the_lease_is_back() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, leases) = table();
    let (r, _) = t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    let held = Held::take(&leases, 1).unwrap();
    t.drop(&mut c, 1);
    assert_eq!(t.parked(), 1);
    assert_eq!(
        c.free_blocks(),
        TOTAL - r.blocks.len(),
        "not free while leased"
    );
    check(&c, &t, &leases, &[]);
    // The request id is free again for a retry while the old blocks stay parked; what the
    // old receiver reports is about the old reservation and changes nothing here.
    let (again, _) = t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    assert!(again.blocks.iter().all(|b| !r.blocks.contains(b)));
    let (old, new) = (held.generation(), leases.lock().unwrap()[&1].generation());
    assert_ne!(old, new);
    t.received(1, 40, Some(old), t0);
    t.failed(1, "old link".into(), Some(old));
    assert!(t.claim(1, claim(Client { gone: false }, t0)).is_ok());
    assert!(
        t.take_ready(&mut c).is_empty(),
        "an old transfer completed nothing"
    );
    assert!(
        t.expire(&mut c, t0, KV_WAIT, |s| s.gone).is_empty(),
        "nor failed it"
    );
    t.received(1, 40, Some(new), t0);
    assert_eq!(t.reclaim(&mut c), 1);
    drop(held);
    assert_eq!(t.reclaim(&mut c), 0);
    check(&c, &t, &leases, &[]);
    assert_eq!(t.take_ready(&mut c).len(), 1);
    c.free_sequence(1);
    assert_eq!(c.free_blocks(), TOTAL);
}

#[test]
fn a_receiver_that_looked_a_reservation_up_cannot_write_once_it_ended() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, leases) = table();
    t.reserve(&mut c, 1, 40, TTL, None, FULL, t0).unwrap();
    // A receiver has found the cell but not taken the lease yet...
    let cell = leases.lock().unwrap()[&1].clone();
    // ...when the reservation ends: the engine takes the lease and frees the blocks.
    t.drop(&mut c, 1);
    assert_eq!((t.parked(), c.free_blocks()), (0, TOTAL));
    assert!(cell.take().is_none(), "nothing left to write with");
    assert!(Held::take(&leases, 1).is_none());
}

#[test]
fn complete_kv_runs_only_once_the_receiver_let_the_lease_go() {
    let (mut c, t0) = (cache(), Instant::now());
    let (mut t, leases) = table();
    t.reserve(&mut c, 1, 20, TTL, None, FULL, t0).unwrap();
    t.received(1, 20, None, t0);
    assert!(t.claim(1, claim(Client { gone: false }, t0)).is_ok());
    let held = Held::take(&leases, 1).unwrap();
    assert!(
        t.take_ready(&mut c).is_empty(),
        "a receiver may still be writing"
    );
    drop(held);
    assert_eq!(t.take_ready(&mut c).len(), 1);
    check(&c, &t, &leases, &[1]);
}

#[test]
fn a_cached_prefix_is_not_reserved_again_and_stays_cached_after_the_reservation_ends() {
    let (mut c, t0) = (cache(), Instant::now());
    c.enable_prefix_cache(&PrefixCacheConfig::default())
        .unwrap();
    let tokens: Vec<u32> = (0..40).collect();
    // An earlier sequence computed and registered the prompt's two full blocks.
    c.add_sequence(100).unwrap();
    c.prepare_append(100, 40).unwrap();
    c.commit_append(100, 40).unwrap();
    c.register_blocks(100, &tokens).unwrap();
    c.free_sequence(100);
    let hashes = c.prefix_hasher().hashes(&tokens[..32]);
    let (mut t, reserved) = table();
    let (r, hit) = t
        .reserve(&mut c, 1, 40, TTL, Some(&hashes), FULL, t0)
        .unwrap();
    assert_eq!((r.cached_tokens, r.blocks.len(), hit.blocks()), (32, 1, 2));
    assert_eq!(reserved.lock().unwrap()[&1].block_count(), 1);
    t.drop(&mut c, 1);
    check(&c, &t, &reserved, &[]);
    assert_eq!(c.allocator().cached_blocks(), 2);
    assert_eq!(c.free_blocks(), TOTAL);
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(u64, usize),
    /// A receiver takes the reservation's lease (and holds it until `LetGo`).
    Hold(u64),
    LetGo,
    Receive(u64, usize),
    Claim(u64, bool),
    Fail(u64),
    Drop(u64),
    Advance(u64),
    Start,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u64..6;
    prop_oneof![
        (id.clone(), 1usize..200).prop_map(|(i, n)| Op::Reserve(i, n)),
        id.clone().prop_map(Op::Hold),
        Just(Op::LetGo),
        (id.clone(), 0usize..200).prop_map(|(i, n)| Op::Receive(i, n)),
        (id.clone(), any::<bool>()).prop_map(|(i, g)| Op::Claim(i, g)),
        id.clone().prop_map(Op::Fail),
        id.prop_map(Op::Drop),
        (0u64..40).prop_map(Op::Advance),
        Just(Op::Start),
    ]
}

proptest! {
    /// Whatever happens to reservations and their leases, `free + held + parked == total`,
    /// the receivers' map lists exactly the reservations, and once every reservation and sequence has ended the
    /// whole pool is free.
    #[test]
    fn block_accounting_holds_under_any_sequence_of_events(ops in prop::collection::vec(op(), 1..60)) {
        let (mut c, t0) = (cache(), Instant::now());
        let (mut t, reserved) = table();
        let mut now = t0;
        let mut running = Vec::new();
        let mut held = Vec::new();
        for o in ops {
            match o {
                Op::Hold(id) => held.extend(Held::take(&reserved, id)),
                Op::LetGo => {
                    held.clear();
                    t.reclaim(&mut c);
                }
                Op::Reserve(id, n) => {
                    if !running.contains(&id) {
                        let _ = t.reserve(&mut c, id, n, TTL, None, FULL, now);
                    }
                }
                Op::Receive(id, n) => t.received(id, n, None, now),
                Op::Claim(id, gone) => {
                    let _ = t.claim(id, claim(Client { gone }, now));
                }
                Op::Fail(id) => t.failed(id, "x".into(), None),
                Op::Drop(id) => {
                    t.drop(&mut c, id);
                }
                Op::Advance(s) => {
                    now += Duration::from_secs(s);
                    t.expire(&mut c, now, KV_WAIT, |s| s.gone);
                }
                Op::Start => {
                    for r in t.take_ready(&mut c).into_iter().flatten() {
                        running.push(r.id);
                    }
                }
            }
            check(&c, &t, &reserved, &running);
        }
        t.drain(&mut c);
        prop_assert!(t.is_empty());
        drop(held);
        t.reclaim(&mut c);
        for id in running {
            c.free_sequence(id);
        }
        check(&c, &t, &reserved, &[]);
        prop_assert_eq!(c.free_blocks(), TOTAL);
    }
}
