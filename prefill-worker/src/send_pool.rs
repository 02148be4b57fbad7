//! The prefill worker's KV pool as the source of its transfers: placed in the connector's
//! send arena (a sealed memfd that same-host decode workers map), and read in place: a
//! layer's regions go to the transfer task as `Bytes` over the pool's own memory, whose
//! blocks stay pinned (never reused) until the last of them is dropped (`duet_engine`'s
//! `kv::pins`).
//!
//! Why: the engine thread copies nothing after a layer (it goes on with the next one at
//! once), and the transport makes the path's one copy: over shm the decode worker's memcpy
//! from its mapping of the arena straight into its pool; over tcp the kernel's from these
//! pages; in process the decode worker's into its pool. A pool the arena cannot hold (or no
//! arena) is ordinary memory, which a same-host decode worker reads with process_vm_readv.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use duet_engine::{KvCache, KvLayout, SeqId};
use duet_kv_transfer::backend::shm::{ArenaBuf, SendArena, ARENA_ALIGN};

use crate::error::PrefillError;

/// A send arena just large enough for a pool of `blocks` blocks of `layout`.
pub fn pool_arena(layout: &KvLayout, blocks: usize) -> duet_kv_transfer::Result<Arc<SendArena>> {
    SendArena::new(KvCache::memory_bytes(layout, blocks).next_multiple_of(ARENA_ALIGN))
}

/// A pool of `blocks` blocks of `layout`: in `arena` when it has room, else in ordinary
/// memory.
pub fn scratch_pool(
    arena: Option<&Arc<SendArena>>,
    layout: KvLayout,
    blocks: usize,
) -> Result<KvCache, PrefillError> {
    let bytes = KvCache::memory_bytes(&layout, blocks);
    match arena.and_then(|a| a.alloc(bytes)) {
        Some(buf) => Ok(KvCache::new_in(layout, blocks, Box::new(ArenaPool(buf)))?),
        None => Ok(KvCache::new(layout, blocks)),
    }
}

/// A send-arena buffer lent to the KV pool (fresh, so zeroed).
struct ArenaPool(ArenaBuf);

impl AsMut<[u8]> for ArenaPool {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// `layer`'s K regions then V regions of sequence `seq`'s logical blocks `range` (each from
/// the table of `layer`'s group), in order, read in place from `cache`; `None` when one of
/// them is not in the cache.
pub fn sequence_regions(
    cache: &KvCache,
    seq: SeqId,
    range: Range<usize>,
    layer: usize,
) -> Option<(Vec<Bytes>, Vec<Bytes>)> {
    let blocks: Option<Vec<u32>> = range
        .map(|i| cache.sequence_block(seq, i, layer).ok())
        .collect();
    Some(cache.pinned_regions(layer, &blocks?))
}
