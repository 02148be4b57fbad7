//! Byte buffers for the reference sink ([`crate::MemorySink`]) and the transfer benchmark
//! (`duet-bench`'s `transfer`): from the allocator, or
//! page-aligned (optionally on transparent huge pages).
//!
//! The kernel's copies run at a fraction of their speed when source and destination differ
//! in their offset within a cache line (`process_vm_readv` on this machine's AMD EPYC, 64 MiB:
//! 1.9 GB/s at a 16-byte offset against 5.3 GB/s aligned). Large `Vec`s all land at the
//! same offset past a page (malloc's header), so two of them agree, as two mappings (which
//! start on a page) do; a mapping against a `Vec` does not. The benchmark therefore keeps
//! both sides of a transfer of the same kind.

use bytes::Bytes;

/// A zeroed buffer: an anonymous mapping (page-aligned), or a plain vector where mapping
/// fails.
#[derive(Debug)]
pub enum Buffer {
    /// From the allocator.
    Heap(Vec<u8>),
    /// An anonymous mapping (page-aligned).
    Map(memmap2::MmapMut),
}

/// Whether transparent huge pages can be had by advice here (`enabled` is `always` or
/// `madvise`, not `never`, and the kernel has THP at all).
pub fn thp_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

impl Buffer {
    /// `len` zero bytes from the allocator, wherever it puts them (as the workers' buffers).
    pub fn heap(len: usize) -> Buffer {
        Buffer::Heap(vec![0u8; len])
    }

    /// `len` zero bytes in an anonymous mapping (page-aligned); with `huge`, advised onto
    /// transparent huge pages (honoured where THP is `madvise` or `always`; elsewhere
    /// ordinary pages). A plain vector where mapping fails.
    pub fn mapped(len: usize, huge: bool) -> Buffer {
        if len > 0 {
            if let Ok(m) = memmap2::MmapMut::map_anon(len) {
                #[cfg(target_os = "linux")]
                if huge {
                    if let Err(e) = m.advise(memmap2::Advice::HugePage) {
                        tracing::warn!(error = %e, "madvise(MADV_HUGEPAGE) refused: small pages");
                    }
                }
                #[cfg(not(target_os = "linux"))]
                let _ = huge;
                return Buffer::Map(m);
            }
        }
        Buffer::heap(len)
    }

    /// A benchmark payload: on transparent huge pages when `huge`, else from the allocator.
    pub fn payload(len: usize, huge: bool) -> Buffer {
        if huge {
            Buffer::mapped(len, true)
        } else {
            Buffer::heap(len)
        }
    }

    /// The buffer as shared, immutable bytes (no copy).
    pub fn freeze(self) -> Bytes {
        match self {
            Buffer::Heap(v) => Bytes::from(v),
            Buffer::Map(m) => Bytes::from_owner(m),
        }
    }
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Map(m) => m,
        }
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Buffer::Heap(v) => v,
            Buffer::Map(m) => m,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_and_freeze_without_copying() {
        for (mut b, aligned) in [
            (Buffer::mapped(3 << 20, false), true),
            (Buffer::mapped(3 << 20, true), true),
            (Buffer::heap(3 << 20), false),
        ] {
            assert!(b.iter().all(|&x| x == 0));
            if aligned {
                assert_eq!(b.as_ptr() as usize % 4096, 0);
            }
            b[5] = 7;
            let p = b.as_ptr();
            let frozen = b.freeze();
            assert_eq!(frozen.as_ptr(), p);
            assert_eq!(frozen[5], 7);
        }
        assert!(Buffer::mapped(0, false).is_empty());
    }
}
