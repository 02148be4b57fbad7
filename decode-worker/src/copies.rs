//! How many KV payload bytes this process copied on the receive path, by stage: into a
//! staging region (the transport's copy: a memcpy from the sender's arena over shm, the
//! kernel's over tcp) and from staging into the pool (the engine thread's import). Regions
//! adopted without a copy (the in-process backend) are not counted.
//!
//! Why: the copies per byte are the path's main cost; `duet bench transfer --end-to-end`
//! divides these counts by the payload to report them as measured, not as read off the code.
//! Process-wide relaxed counters, one addition per region.

use std::sync::atomic::{AtomicU64, Ordering};

static STAGED: AtomicU64 = AtomicU64::new(0);
static IMPORTED: AtomicU64 = AtomicU64::new(0);

/// Bytes copied so far, by stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiveCopies {
    /// Into staging regions.
    pub staged: u64,
    /// From staging into the KV pool.
    pub imported: u64,
}

/// The counts so far.
pub fn snapshot() -> ReceiveCopies {
    ReceiveCopies {
        staged: STAGED.load(Ordering::Relaxed),
        imported: IMPORTED.load(Ordering::Relaxed),
    }
}

pub(crate) fn staged(bytes: usize) {
    STAGED.fetch_add(bytes as u64, Ordering::Relaxed);
}

pub(crate) fn imported(bytes: usize) {
    IMPORTED.fetch_add(bytes as u64, Ordering::Relaxed);
}
