//! The KV pool's memory: one zeroed, page-aligned allocation that the engine thread and KV
//! receivers (through a [`super::lease::RegionLease`]) both write, each in its own blocks.
//!
//! Why not a `Vec`: a decode worker's receivers write arriving KV straight into the blocks
//! reserved for it while the engine thread computes other sequences' steps over the same
//! pool. A `Vec` hands out references to the whole pool (`&mut vec[..]` before any
//! sub-slice), which would alias the receivers' regions. Here no reference to the whole pool
//! is ever made: [`PoolVec`] and [`KvView`] index by range only, so every reference covers
//! exactly the elements its user touches.
//!
//! Invariants:
//! - the allocation never moves or shrinks while a [`PoolVec`] or a lease holds it (shared
//!   ownership through `Arc`), so a lease's pointers stay valid even past the cache's end;
//! - the engine makes references only to blocks it owns (those of running sequences, the
//!   prefix cache's, the null block, blocks it is copying or zeroing); a leased block is none
//!   of these until its lease is returned (`decode-worker`'s reservation table keeps a
//!   leased block out of the free list until then), so engine and receiver references never
//!   overlap.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::marker::PhantomData;
use std::ops::{Index, IndexMut, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;

/// Pages: the kernel maps zeroed pages lazily, and page-aligned blocks copy fastest.
const ALIGN: usize = 4096;

/// Memory a caller lends the pool (a prefill worker's shared-memory send arena, which the
/// decode workers of its host map): zeroed, and kept where it is while the value lives (the
/// pool takes the slice once and never asks again).
pub type PoolBacking = Box<dyn AsMut<[u8]> + Send + Sync>;

/// The pool's bytes: a zeroed allocation of its own, or lent ([`PoolBacking`]).
pub(crate) struct PoolMemory {
    ptr: NonNull<u8>,
    owner: Owner,
}

enum Owner {
    /// Allocated here with this layout.
    Heap(Layout),
    /// Lent; dropped (never touched otherwise) when the memory goes.
    Lent(#[allow(dead_code)] PoolBacking),
}

// SAFETY: `PoolMemory` owns its allocation like a `Box<[u8]>` (or holds the `Send + Sync`
// value that lends it); it hands out only a raw pointer, and who may write where through it
// is governed by the leases and pins (module docs).
unsafe impl Send for PoolMemory {}
// SAFETY: as above; shared access only yields the base pointer.
unsafe impl Sync for PoolMemory {}

impl PoolMemory {
    fn zeroed(bytes: usize) -> PoolMemory {
        let layout = match Layout::from_size_align(bytes.max(ALIGN), ALIGN) {
            Ok(l) => l,
            // Only when `bytes` overflows isize: the same as a failed allocation.
            Err(_) => handle_alloc_error(Layout::new::<u8>()),
        };
        // SAFETY: the layout's size is non-zero.
        let raw = unsafe { alloc_zeroed(layout) };
        match NonNull::new(raw) {
            Some(ptr) => PoolMemory {
                ptr,
                owner: Owner::Heap(layout),
            },
            None => handle_alloc_error(layout),
        }
    }

    /// The memory `backing` lends, when it has `bytes` bytes aligned for `align`.
    fn lent(mut backing: PoolBacking, bytes: usize, align: usize) -> Option<PoolMemory> {
        let s: &mut [u8] = AsMut::<[u8]>::as_mut(&mut *backing);
        if s.len() < bytes || !(s.as_ptr() as usize).is_multiple_of(align) {
            return None;
        }
        let ptr = NonNull::new(s.as_mut_ptr())?;
        Some(PoolMemory {
            ptr,
            owner: Owner::Lent(backing),
        })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        if let Owner::Heap(layout) = self.owner {
            // SAFETY: allocated in `zeroed` with this layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// `len` elements of `T` over a shared [`PoolMemory`], indexed by range.
pub(crate) struct PoolVec<T> {
    mem: Arc<PoolMemory>,
    len: usize,
    _t: PhantomData<T>,
}

fn check(r: &Range<usize>, len: usize) {
    assert!(
        r.start <= r.end && r.end <= len,
        "range {r:?} out of a pool of {len}"
    );
}

impl<T: Pod> PoolVec<T> {
    /// `len` zeroed elements (`T`'s zero bit pattern: 0.0 for f32 and f16).
    pub(crate) fn zeroed(len: usize) -> PoolVec<T> {
        // Saturated: an impossible size fails as an allocation would.
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        PoolVec {
            mem: Arc::new(PoolMemory::zeroed(bytes)),
            len,
            _t: PhantomData,
        }
    }

    /// `len` elements in the memory `backing` lends (`None`: too short, or misaligned).
    pub(crate) fn lent(len: usize, backing: PoolBacking) -> Option<PoolVec<T>> {
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        Some(PoolVec {
            mem: Arc::new(PoolMemory::lent(backing, bytes, std::mem::align_of::<T>())?),
            len,
            _t: PhantomData,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The memory, for a lease.
    pub(crate) fn memory(&self) -> &Arc<PoolMemory> {
        &self.mem
    }

    fn ptr(&self) -> *mut T {
        self.mem.base().cast()
    }

    /// A read view over the whole pool that makes references per range only.
    pub(crate) fn view(&self) -> KvView<'_, T> {
        KvView {
            ptr: self.ptr(),
            len: self.len,
            _l: PhantomData,
        }
    }

    /// Copies `src` to `dst..` (ranges may overlap), like `slice::copy_within`.
    pub(crate) fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        check(&src, self.len);
        check(&(dst..dst + src.len()), self.len);
        // SAFETY: both ranges are inside the allocation (checked); `ptr::copy` allows overlap;
        // `&mut self` makes the engine the only writer of its own blocks here.
        unsafe { std::ptr::copy(self.ptr().add(src.start), self.ptr().add(dst), src.len()) }
    }
}

impl<T: Pod> Index<Range<usize>> for PoolVec<T> {
    type Output = [T];
    fn index(&self, r: Range<usize>) -> &[T] {
        check(&r, self.len);
        // SAFETY: inside the allocation (checked), initialized (zeroed, `T: Pod`); the
        // engine only reads ranges of blocks it owns (module invariants).
        unsafe { std::slice::from_raw_parts(self.ptr().add(r.start), r.len()) }
    }
}

impl<T: Pod> IndexMut<Range<usize>> for PoolVec<T> {
    fn index_mut(&mut self, r: Range<usize>) -> &mut [T] {
        check(&r, self.len);
        // SAFETY: as for `index`; `&mut self` excludes every other engine reference, and a
        // leased range is never one the engine writes (module invariants).
        unsafe { std::slice::from_raw_parts_mut(self.ptr().add(r.start), r.len()) }
    }
}

/// A read-only view of a pool (or of any slice, in tests) that makes a reference only for
/// the range it is indexed by; copied into attention's kernels in place of `&[T]`.
#[derive(Clone, Copy)]
pub struct KvView<'a, T> {
    ptr: *const T,
    len: usize,
    _l: PhantomData<&'a T>,
}

// SAFETY: a view is a shared borrow of `T`s, which are `Sync` (plain numbers).
unsafe impl<T: Sync> Send for KvView<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for KvView<'_, T> {}

impl<'a, T> KvView<'a, T> {
    /// A view of a slice.
    pub fn of(s: &'a [T]) -> KvView<'a, T> {
        KvView {
            ptr: s.as_ptr(),
            len: s.len(),
            _l: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first element, for kernels that bound their reads by [`KvView::len`] themselves.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }
}

impl<T> Index<Range<usize>> for KvView<'_, T> {
    type Output = [T];
    fn index(&self, r: Range<usize>) -> &[T] {
        check(&r, self.len);
        // SAFETY: inside the viewed memory (checked), which outlives the view (`'a`) and is
        // initialized; the range is one the engine owns (module invariants).
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_read_and_write_the_same_zeroed_memory() {
        let mut p = PoolVec::<f32>::zeroed(10_000);
        assert_eq!(p.len(), 10_000);
        assert!(p[0..10_000].iter().all(|&x| x == 0.0));
        p[100..104].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(&p.view()[100..104], &[1.0, 2.0, 3.0, 4.0]);
        p.copy_within(100..104, 102);
        assert_eq!(&p[100..106], &[1.0, 2.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(p.memory().base() as usize % ALIGN, 0);
        let held = p.memory().clone();
        drop(p);
        assert_eq!(
            Arc::strong_count(&held),
            1,
            "a holder keeps the memory alive"
        );
    }

    #[test]
    fn a_pool_lives_in_memory_lent_to_it_when_that_is_long_and_aligned_enough() {
        let lent = PoolVec::<f32>::lent(1000, Box::new(vec![0u8; 4000]));
        let mut p = lent.unwrap();
        p[998..1000].copy_from_slice(&[5.0, 6.0]);
        assert_eq!(&p.view()[998..1000], &[5.0, 6.0]);
        assert!(PoolVec::<f32>::lent(1001, Box::new(vec![0u8; 4000])).is_none());
        let misaligned = Box::new(Shifted(vec![0u8; 4004]));
        assert!(PoolVec::<f32>::lent(10, misaligned).is_none());
    }

    /// Lends its bytes from offset 1 (never aligned for f32).
    struct Shifted(Vec<u8>);
    impl AsMut<[u8]> for Shifted {
        fn as_mut(&mut self) -> &mut [u8] {
            let at = 4 - self.0.as_ptr() as usize % 4 + 1;
            &mut self.0[at..]
        }
    }

    #[test]
    #[should_panic(expected = "out of a pool")]
    fn a_range_past_the_end_panics_like_a_slice() {
        let p = PoolVec::<f32>::zeroed(8);
        let _ = &p[4..9];
    }
}
