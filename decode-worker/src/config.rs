//! Decode worker settings (the CLI fills them from flags / `DUET_*` variables).

use std::time::Duration;

use duet_engine::PrefixCacheConfig;

/// How a decode worker batches and bounds its work.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// Worker id (registry key, logs).
    pub id: String,
    /// Most sequences in one decode batch.
    pub max_batch: usize,
    /// Prompt tokens of local prefills mixed into one step (chunked prefill).
    pub prefill_chunk_tokens: usize,
    /// Sequences waiting for a slot before new ones are refused.
    pub max_waiting: usize,
    /// Free blocks kept aside when admitting local prefills, so running sequences can grow.
    pub admit_watermark_blocks: usize,
    /// A remote prefill's KV must be complete this long after Generate claimed it.
    pub kv_wait_timeout: Duration,
    /// Longest reservation lifetime a router may ask for.
    pub max_reservation_ttl: Duration,
    /// The prefix cache and its lower tiers (`None`: off; every prompt is computed or
    /// transferred whole, and blocks return to the pool when a sequence ends).
    pub prefix_cache: Option<PrefixCacheConfig>,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        DecodeConfig {
            id: "decode-0".into(),
            max_batch: 64,
            prefill_chunk_tokens: 256,
            max_waiting: 256,
            admit_watermark_blocks: 4,
            kv_wait_timeout: Duration::from_secs(30),
            max_reservation_ttl: Duration::from_secs(120),
            prefix_cache: Some(PrefixCacheConfig::default()),
        }
    }
}
