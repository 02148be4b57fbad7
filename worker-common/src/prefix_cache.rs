//! What both workers do around their engine's prefix cache: count lookups and hits per tier,
//! report the cached blocks, and hand the cache's changes to the KV event hub. One place,
//! so that prefill and decode workers report the same numbers the same way.

use duet_engine::{KvCache, KvTier, PrefixHit};
use duet_telemetry::names::{
    PREFIX_CACHE_BLOCKS, PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_PREFETCHED_BLOCKS_TOTAL,
    PREFIX_CACHE_QUERIES_TOTAL,
};
use metrics::{Counter, Gauge};

use crate::kv_events::KvEventHub;

/// A worker's prefix-cache bookkeeping (lives on its engine thread).
pub struct PrefixCacheBook {
    hub: KvEventHub,
    queries: Counter,
    hits: [Counter; 3],
    blocks: [Gauge; 3],
    prefetched: Counter,
}

fn tier_index(t: KvTier) -> usize {
    match t {
        KvTier::Device => 0,
        KvTier::Host => 1,
        KvTier::Disk => 2,
    }
}

impl PrefixCacheBook {
    /// `role` is `prefill` or `decode`; `worker` the worker id.
    pub fn new(hub: KvEventHub, role: &'static str, worker: &str) -> Self {
        let w = worker.to_string();
        let per_tier_counter = |t: KvTier| metrics::counter!(PREFIX_CACHE_HITS_TOTAL, "role" => role, "worker" => w.clone(), "tier" => t.label());
        let per_tier_gauge = |t: KvTier| metrics::gauge!(PREFIX_CACHE_BLOCKS, "role" => role, "worker" => w.clone(), "tier" => t.label());
        PrefixCacheBook {
            hub,
            queries: metrics::counter!(PREFIX_CACHE_QUERIES_TOTAL, "role" => role, "worker" => w.clone()),
            hits: KvTier::ALL.map(per_tier_counter),
            blocks: KvTier::ALL.map(per_tier_gauge),
            prefetched: metrics::counter!(PREFIX_CACHE_PREFETCHED_BLOCKS_TOTAL, "role" => role, "worker" => w.clone()),
        }
    }

    /// One lookup of a prompt of `tokens` tokens that attached `hit` (`block_size` tokens a
    /// block).
    pub fn lookup(&self, tokens: usize, hit: PrefixHit, block_size: usize) {
        self.queries.increment(tokens as u64);
        for t in KvTier::ALL {
            let n = hit.of(t) * block_size;
            if n > 0 {
                self.hits[tier_index(t)].increment(n as u64);
            }
        }
    }

    /// Blocks a prefetch brought up.
    pub fn prefetched(&self, blocks: usize) {
        self.prefetched.increment(blocks as u64);
    }

    /// Publishes the cache's changes since the last call and updates the block gauges.
    pub fn flush(&self, cache: &mut KvCache) {
        let events = cache.take_events();
        if events.is_empty() {
            return;
        }
        self.hub.publish(events);
        let c = cache.cached_counts();
        self.blocks[0].set(c.device as f64);
        self.blocks[1].set(c.host as f64);
        self.blocks[2].set(c.disk as f64);
    }

    pub fn hub(&self) -> &KvEventHub {
        &self.hub
    }
}
