//! The shared-memory mapping: the only module of this crate with `unsafe` code.
//!
//! A [`ShmMapping`] is a file under `/dev/shm` (or another directory) mapped with
//! `memmap2::MmapRaw`. No Rust reference into the mapping is ever created: bytes move with
//! `ptr::copy_nonoverlapping` after a bounds check, so the peer process writing other parts
//! of the file can never alias a `&[u8]`/`&mut [u8]` held here.
//!
//! Invariants:
//! - every access is bounds-checked against the mapping length (checked arithmetic);
//! - the file is created with `create_new` and mode 0600 under a random name, and unlinked
//!   by its creator as soon as the peer has mapped it (or when the creator drops);
//! - the file length is never changed after mapping by this crate (a peer shrinking it
//!   could make an access fault; peers are authenticated and on the same host).
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use memmap2::MmapRaw;
use rand::RngCore;

use crate::error::{Error, Result};

/// Prefix of every shm file name this crate creates.
pub(crate) const NAME_PREFIX: &str = "duet-kv-";
/// Length of a generated file name (`duet-kv-` + 32 hex digits).
pub(crate) const NAME_LEN: usize = 8 + 32;

/// A mapped shared-memory file.
#[derive(Debug)]
pub(crate) struct ShmMapping {
    map: MmapRaw,
    _file: File,
    /// Set while this side owns the directory entry and must unlink it.
    owned_path: Option<PathBuf>,
}

/// True when `name` looks like a name [`ShmMapping::create`] generates (no path parts).
pub(crate) fn valid_name(name: &str) -> bool {
    name.len() == NAME_LEN
        && name.starts_with(NAME_PREFIX)
        && name[NAME_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl ShmMapping {
    /// Creates and maps a new `len`-byte file in `dir`; returns it and its file name.
    pub(crate) fn create(dir: &Path, len: usize) -> Result<(ShmMapping, String)> {
        let mut rnd = [0u8; 16];
        rand::rng().fill_bytes(&mut rnd);
        let name: String = std::iter::once(NAME_PREFIX.to_string())
            .chain(rnd.iter().map(|b| format!("{b:02x}")))
            .collect();
        let path = dir.join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io("creating the shm file", e))?;
        let mapping = (|| {
            file.set_len(len as u64)
                .map_err(|e| Error::io("sizing the shm file", e))?;
            let map = MmapRaw::map_raw(&file).map_err(|e| Error::io("mapping the shm file", e))?;
            Ok(map)
        })();
        match mapping {
            Ok(map) => Ok((
                ShmMapping {
                    map,
                    _file: file,
                    owned_path: Some(path),
                },
                name,
            )),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Opens and maps a file another process created; it must be exactly `len` bytes.
    pub(crate) fn open(dir: &Path, name: &str, len: usize) -> Result<ShmMapping> {
        if !valid_name(name) {
            return Err(Error::malformed("shm setup", "invalid shm file name"));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(name))
            .map_err(|e| Error::io("opening the shm file", e))?;
        let actual = file
            .metadata()
            .map_err(|e| Error::io("inspecting the shm file", e))?
            .len();
        if actual != len as u64 {
            return Err(Error::malformed(
                "shm setup",
                format!("shm file is {actual} bytes, expected {len}"),
            ));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| Error::io("mapping the shm file", e))?;
        Ok(ShmMapping {
            map,
            _file: file,
            owned_path: None,
        })
    }

    /// Backs the whole file with memory now, so that a full `/dev/shm` is an error here
    /// instead of a SIGBUS in whichever process first touches a page of a sparse file. Only
    /// ring mode writes the ring, so only ring mode reserves it.
    pub(crate) fn reserve(&self) -> Result<()> {
        let len = i64::try_from(self.map.len())
            .map_err(|_| Error::InvalidArgument("shm ring size overflows".into()))?;
        #[cfg(target_os = "linux")]
        nix::fcntl::posix_fallocate(&self._file, 0, len).map_err(|e| {
            Error::io(
                "reserving memory for the shm ring (is its directory full?)",
                std::io::Error::from(e),
            )
        })?;
        #[cfg(not(target_os = "linux"))]
        let _ = len;
        Ok(())
    }

    /// Removes the directory entry (the mapping stays valid). Idempotent.
    pub(crate) fn unlink(&mut self) {
        if let Some(p) = self.owned_path.take() {
            let _ = std::fs::remove_file(p);
        }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.map.len() => Ok(()),
            _ => Err(Error::Oversized {
                what: "shm access",
                len: (offset as u64).saturating_add(len as u64),
                limit: self.map.len() as u64,
            }),
        }
    }

    /// Copies `src` into the mapping at `offset`.
    pub(crate) fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: `check` proved `offset + src.len() <= map.len()`, so the destination range
        // lies inside the live mapping owned by `self.map` (kept alive by `&self`). `src` is
        // a Rust slice in private memory, so the ranges cannot overlap. No reference into the
        // mapping exists, so a concurrent write by the peer cannot alias a Rust reference;
        // the protocol's slot hand-over (CHUNK/CREDIT) keeps the peer off this range.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            );
        }
        Ok(())
    }

    /// Copies bytes of the mapping at `offset` into `dst`.
    pub(crate) fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        copy_out(&self.map, offset, dst, "shm access")
    }
}

/// Copies the bytes of a shared mapping at `offset` into `dst`, after a bounds check (`what`
/// names the access in the error). The mapping's file must not shrink while mapped: the
/// ring's is never resized by this crate, a send arena's size is sealed.
pub(crate) fn copy_out(
    map: &MmapRaw,
    offset: usize,
    dst: &mut [u8],
    what: &'static str,
) -> Result<()> {
    match offset.checked_add(dst.len()) {
        Some(end) if end <= map.len() => {}
        _ => {
            return Err(Error::Oversized {
                what,
                len: (offset as u64).saturating_add(dst.len() as u64),
                limit: map.len() as u64,
            })
        }
    }
    // SAFETY: the check above proved `offset + dst.len() <= map.len()`, so the source range
    // lies inside the mapping, which the borrow keeps alive and whose file keeps its size.
    // `dst` is an exclusive Rust slice in private memory, so the ranges cannot overlap. Only
    // raw pointers touch the mapping; if the peer wrote this range concurrently we would copy
    // torn bytes into `dst`, never write anywhere else.
    unsafe {
        std::ptr::copy_nonoverlapping(map.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
    }
    Ok(())
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_copy_and_bounds() {
        let dir = std::env::temp_dir();
        let (mut a, name) = ShmMapping::create(&dir, 4096).unwrap();
        assert!(valid_name(&name));
        let b = ShmMapping::open(&dir, &name, 4096).unwrap();
        a.unlink();
        assert!(!dir.join(&name).exists());
        a.write_at(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        b.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(a.write_at(4094, b"abc").is_err());
        assert!(b.read_at(usize::MAX, &mut out).is_err());
        assert!(ShmMapping::open(&dir, "../etc/passwd", 1).is_err());
        assert!(ShmMapping::open(&dir, &name, 4096).is_err()); // unlinked
        a.reserve().unwrap();
        b.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"hello", "reserving keeps the contents");
    }
}
