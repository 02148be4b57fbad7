//! A layer's KV regions, copied out of the scratch cache for the transfer task, as `Bytes`
//! slices of one buffer per layer: K regions then V regions, back to back.
//!
//! Why one buffer: a same-host (shm) receiver then pulls the whole layer as one run, one
//! allocation replaces one per region, and the buffer starts where its allocator aligns it
//! (a page in the send arena) instead of at the arbitrary 16-byte offsets of small
//! allocations, which halve the speed of the kernel's copies. For an shm transfer the buffer
//! is in the connector's send arena when it has room (the receiver copies it with a memcpy
//! from its own mapping), otherwise on the heap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use duet_kv_transfer::backend::shm::SendArena;

/// Payload bytes [`layer_bytes`] copied in this process (relaxed, one addition per layer): the
/// send path's copy, counted for `duet bench transfer --end-to-end`.
static COPIED: AtomicU64 = AtomicU64::new(0);

/// Bytes [`layer_bytes`] has copied so far in this process.
pub fn copied_bytes() -> u64 {
    COPIED.load(Ordering::Relaxed)
}

/// Copies `k` then `v` into one buffer (in `arena` when it has room) and returns them as
/// slices of it, in the same order and lengths.
pub fn layer_bytes(
    arena: Option<&Arc<SendArena>>,
    k: &[&[u8]],
    v: &[&[u8]],
) -> (Vec<Bytes>, Vec<Bytes>) {
    let total: usize = k.iter().chain(v).map(|r| r.len()).sum();
    COPIED.fetch_add(total as u64, Ordering::Relaxed);
    let data = match arena.and_then(|a| a.alloc(total)) {
        Some(mut buf) => {
            let mut at = 0;
            for r in k.iter().chain(v) {
                buf[at..at + r.len()].copy_from_slice(r);
                at += r.len();
            }
            Bytes::from_owner(buf)
        }
        None => {
            let mut buf = Vec::with_capacity(total);
            for r in k.iter().chain(v) {
                buf.extend_from_slice(r);
            }
            Bytes::from(buf)
        }
    };
    let mut at = 0;
    let mut slices = |regions: &[&[u8]]| -> Vec<Bytes> {
        regions
            .iter()
            .map(|r| {
                let s = data.slice(at..at + r.len());
                at += r.len();
                s
            })
            .collect()
    };
    let ks = slices(k);
    let vs = slices(v);
    (ks, vs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_come_back_in_order_from_one_buffer_in_the_arena_while_it_has_room() {
        let (a, b, c) = (vec![1u8; 100], vec![2u8; 50], vec![3u8; 100]);
        let arena = SendArena::new(4096).unwrap();
        for with in [None, Some(&arena)] {
            let (k, v) = layer_bytes(with, &[&a, &b], &[&c]);
            assert_eq!((k.len(), v.len()), (2, 1));
            assert_eq!((&k[0][..], &k[1][..], &v[0][..]), (&a[..], &b[..], &c[..]));
            // One buffer: each slice starts where the previous one ends.
            assert_eq!(k[1].as_ptr() as usize, k[0].as_ptr() as usize + 100);
            assert_eq!(v[0].as_ptr() as usize, k[1].as_ptr() as usize + 50);
        }
        let (k, _) = layer_bytes(Some(&arena), &[&a], &[&c]);
        assert_eq!(
            k[0].as_ptr() as usize % 4096,
            0,
            "arena buffers are page-aligned"
        );
        assert!(
            arena.free_bytes() < arena.capacity(),
            "held while the slices live"
        );
        drop(k);
        assert_eq!(
            arena.free_bytes(),
            arena.capacity(),
            "returned with the last slice"
        );
        // A layer larger than the arena goes to the heap.
        let big = vec![4u8; 8192];
        let (k, _) = layer_bytes(Some(&arena), &[&big], &[]);
        assert_eq!(&k[0][..], &big[..]);
        assert_eq!(arena.free_bytes(), arena.capacity());
    }
}
