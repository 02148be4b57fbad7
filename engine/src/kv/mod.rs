//! Paged KV cache: block allocator and per-sequence block tables.

pub mod allocator;
pub mod cache;

pub use allocator::{BlockAllocator, BlockId};
pub use cache::{KvCache, KvCacheConfig, KvDtype, KvExport, KvKind, KvLayout, SeqId};
