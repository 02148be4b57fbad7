//! Paged KV cache: block allocator, per-sequence block tables, and the prefix cache
//! (content-addressed blocks, LRU eviction, host and disk tiers).

pub mod allocator;
mod append;
pub mod cache;
mod device_sync;
mod export;
mod group_tables;
pub mod groups;
pub mod lease;
mod lru;
mod pins;
pub(crate) mod pool_memory;
pub mod prefix;
pub mod prefix_cache;
pub mod prefix_groups;
pub mod snapkv;
pub mod tiers;
pub mod window;

pub use allocator::{BlockAllocator, BlockId};
pub use cache::{KvCache, KvCacheConfig, KvDtype, KvExport, KvKind, KvLayout, SeqId};
pub use groups::KvGroups;
pub use lease::{LeasedRegion, RegionLease};
pub use pool_memory::{KvView, PoolBacking};
pub use prefix::{reusable_tokens, BlockHash, KvEvent, KvTier, PrefixHasher, PrefixHit};
pub use prefix_cache::{PrefixCacheConfig, TierCounts};
pub use prefix_groups::{group_key, servable_prefix};
pub use snapkv::SnapKv;
pub use window::{AttentionPolicy, Window, WINDOWED_MAX_TOKENS};
