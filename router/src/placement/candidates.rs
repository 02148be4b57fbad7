//! The two orderings placement is made of: decode workers and prefill workers, each by
//! cost. Pure functions over worker records plus the router's own count of requests it
//! sent each worker since (records lag a little).
//!
//! Decode worker: same model, not draining, enough free KV blocks for the prompt plus
//! some generated tokens (as the worker's cache counts them: `Capacity::blocks_for_tokens`); cheapest first, where a running or waiting sequence costs
//! `seq_cost_tokens` and every prompt token the worker would still have to prefill locally
//! (the prompt minus the prefix its cache holds) costs one. Prefill worker: same model
//! fingerprint as the chosen decode worker; cheapest first, where the cost is its queued
//! prefill tokens plus the prompt tokens it would compute (the prompt minus its cached
//! prefix). Without KV-aware routing every cached prefix reads as 0, and the order is by
//! load alone.

use std::collections::HashMap;

use duet_discovery::{Role, Snapshot, WorkerRecord};

use super::{CachedTokens, InFlight};

/// Decode candidates in preference order.
pub fn decode_candidates<'a>(
    snap: &'a Snapshot,
    model: &str,
    prompt_tokens: usize,
    headroom_tokens: usize,
    inflight: &InFlight,
    cached: &dyn CachedTokens,
    seq_cost_tokens: u64,
) -> Vec<&'a WorkerRecord> {
    let mut v: Vec<(&WorkerRecord, (u64, u64, usize))> = snap
        .workers(Role::Decode)
        .enumerate()
        .filter(|(_, w)| !w.draining && w.model == model)
        .filter(|(_, w)| {
            let c = &w.capacity;
            // Room for the prompt and some generated tokens, but never more than the pool
            // (a long prompt still fits an empty worker), in the worker's blocks (a cache
            // with layer groups takes a block per group).
            let need = ((prompt_tokens + headroom_tokens) as u64)
                .min(c.tokens_in_blocks(c.kv_blocks_total))
                .max(prompt_tokens as u64 + 1);
            c.kv_blocks_free >= c.blocks_for_tokens(need)
        })
        .map(|(i, w)| {
            let mine = u64::from(inflight.get(&w.id).copied().unwrap_or(0));
            let load = u64::from(w.capacity.running + w.capacity.waiting).max(mine);
            let uncached = prompt_tokens.saturating_sub(cached.cached_tokens(w)) as u64;
            // Cheapest first; then most free blocks.
            let cost = load
                .saturating_mul(seq_cost_tokens)
                .saturating_add(uncached);
            (w, (cost, u64::MAX - w.capacity.kv_blocks_free, i))
        })
        .collect();
    // Ties by id: a role's records come in id order (the registry keys differ only in the
    // id), so their position is the id's rank, compared without touching the strings.
    v.sort_unstable_by_key(|&(_, k)| k);
    v.into_iter().map(|(w, _)| w).collect()
}

/// Prefill candidates for a decode worker with `fingerprint`, in preference order.
pub fn prefill_candidates<'a>(
    snap: &'a Snapshot,
    model: &str,
    fingerprint: &str,
    prompt_tokens: usize,
    inflight_tokens: &HashMap<String, u64>,
    cached: &dyn CachedTokens,
) -> Vec<&'a WorkerRecord> {
    let mut v: Vec<(&WorkerRecord, (u64, usize))> = snap
        .workers(Role::Prefill)
        .enumerate()
        .filter(|(_, w)| !w.draining && w.model == model && w.fingerprint == fingerprint)
        .map(|(i, w)| {
            let mine = inflight_tokens.get(&w.id).copied().unwrap_or(0);
            let uncached = prompt_tokens.saturating_sub(cached.cached_tokens(w)) as u64;
            (
                w,
                (w.capacity.queued_prefill_tokens.max(mine) + uncached, i),
            )
        })
        .collect();
    // Ties by id, through the records' id order (see decode_candidates).
    v.sort_unstable_by_key(|&(_, k)| k);
    v.into_iter().map(|(w, _)| w).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::NoCache;
    use duet_discovery::{Capacity, WorkerRecord};

    fn worker(role: Role, id: &str, free: u64, load: u32, queued: u64) -> WorkerRecord {
        let mut w = WorkerRecord::new("c", role, id, "http://127.0.0.1:1");
        w.model = "m".into();
        w.fingerprint = "f".into();
        w.capacity = Capacity {
            kv_blocks_total: 100,
            kv_blocks_free: free,
            block_size: 16,
            running: load,
            queued_prefill_tokens: queued,
            ..Capacity::default()
        };
        w
    }

    fn snap(ws: Vec<WorkerRecord>) -> Snapshot {
        Snapshot {
            workers: ws.into_iter().map(|w| (w.key(), w)).collect(),
            revision: 1,
            stale: false,
            stale_since: None,
            lost_at: Default::default(),
        }
    }

    #[test]
    fn decode_prefers_least_loaded_with_room_and_skips_full_or_draining() {
        let mut draining = worker(Role::Decode, "d", 100, 0, 0);
        draining.draining = true;
        let s = snap(vec![
            worker(Role::Decode, "a", 100, 5, 0),
            worker(Role::Decode, "b", 100, 1, 0),
            worker(Role::Decode, "full", 2, 0, 0),
            draining,
        ]);
        let c = decode_candidates(&s, "m", 100, 16, &InFlight::new(), &NoCache, 256);
        let ids: Vec<&str> = c.iter().map(|w| w.id.as_str()).collect();
        assert_eq!(ids, ["b", "a"]);
        // The router's own in-flight count outweighs a stale record.
        let inflight = InFlight::from([("b".to_string(), 9)]);
        let c = decode_candidates(&s, "m", 100, 16, &inflight, &NoCache, 256);
        assert_eq!(c[0].id, "a");
        assert!(decode_candidates(&s, "other", 1, 0, &InFlight::new(), &NoCache, 256).is_empty());
    }

    #[test]
    fn a_grouped_cache_needs_a_block_per_group_but_only_a_window_of_local_ones() {
        let grouped = |id: &str, free: u64| {
            let mut w = worker(Role::Decode, id, free, 0, 0);
            w.capacity.kv_blocks_total = 1000;
            w.capacity.kv_groups = Some(duet_discovery::KvGroupShape {
                global: 1,
                local: 5,
                window: 512,
                chunk: 256,
            });
            w
        };
        // 100 prompt tokens + 16: 8 blocks in each of 6 groups.
        let s = snap(vec![grouped("short", 47), grouped("room", 48)]);
        let c = decode_candidates(&s, "m", 100, 16, &InFlight::new(), &NoCache, 256);
        assert_eq!(
            c.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(),
            ["room"]
        );
        // 4,000 + 16 tokens: 251 global blocks, 49 per local group (not 6 x 251).
        let s = snap(vec![grouped("short", 495), grouped("room", 496)]);
        let c = decode_candidates(&s, "m", 4000, 16, &InFlight::new(), &NoCache, 256);
        assert_eq!(
            c.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(),
            ["room"]
        );
    }

    #[test]
    fn a_cached_prefix_outweighs_a_little_load_but_not_a_lot() {
        let s = snap(vec![
            worker(Role::Decode, "a", 100, 1, 0),
            worker(Role::Decode, "b", 100, 2, 0),
            worker(Role::Prefill, "p1", 0, 0, 100),
            worker(Role::Prefill, "p2", 0, 0, 0),
        ]);
        // b holds 800 of the 1000 prompt tokens: one more sequence (256) is worth it.
        let cached = |w: &WorkerRecord| if w.id == "b" || w.id == "p1" { 800 } else { 0 };
        let c = decode_candidates(&s, "m", 1000, 16, &InFlight::new(), &cached, 256);
        assert_eq!(c[0].id, "b");
        // Four more sequences (1024 tokens of load) are not.
        let busy = InFlight::from([("b".to_string(), 5)]);
        let c = decode_candidates(&s, "m", 1000, 16, &busy, &cached, 256);
        assert_eq!(c[0].id, "a");
        // The prefill worker holding the prefix wins despite its queue (100 + 200 < 1000).
        let p = prefill_candidates(&s, "m", "f", 1000, &HashMap::new(), &cached);
        assert_eq!(p[0].id, "p1");
        let p = prefill_candidates(&s, "m", "f", 1000, &HashMap::new(), &NoCache);
        assert_eq!(p[0].id, "p2", "on load alone");
    }

    #[test]
    fn prefill_prefers_fewest_queued_tokens_with_same_fingerprint() {
        let mut other = worker(Role::Prefill, "x", 0, 0, 0);
        other.fingerprint = "g".into();
        let s = snap(vec![
            worker(Role::Prefill, "p1", 0, 0, 900),
            worker(Role::Prefill, "p2", 0, 0, 100),
            other,
        ]);
        let c = prefill_candidates(&s, "m", "f", 10, &HashMap::new(), &NoCache);
        let ids: Vec<&str> = c.iter().map(|w| w.id.as_str()).collect();
        assert_eq!(ids, ["p2", "p1"]);
    }
}
