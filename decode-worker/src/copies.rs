//! How many KV payload bytes this process's receivers wrote into its KV pool: the one copy
//! of the receive path (a memcpy from the sender's arena over shm, the kernel's over tcp, a
//! copy of the sender's buffer in process), straight into the reserved blocks.
//!
//! Why: the copies per byte are the path's main cost; `duet bench transfer --end-to-end`
//! divides these counts by the payload to report them as measured, not as read off the code.
//! Process-wide relaxed counter, one addition per region or batch of regions.

use std::sync::atomic::{AtomicU64, Ordering};

static INTO_POOL: AtomicU64 = AtomicU64::new(0);

/// Bytes written into the pool so far.
pub fn into_pool_bytes() -> u64 {
    INTO_POOL.load(Ordering::Relaxed)
}

pub(crate) fn into_pool(bytes: usize) {
    INTO_POOL.fetch_add(bytes as u64, Ordering::Relaxed);
}
