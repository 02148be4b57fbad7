//! Sealed memfd mappings behind the shm send arena (see the `arena` module): the sender's
//! read-write mapping, the receiver's read-only view of the same pages, and the byte access
//! to both. With `mapping`, the only modules of the shm backend with `unsafe` code.
//!
//! Invariants:
//! - the memfd's size is sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) right after it
//!   is sized and mapped, and a receiver maps a peer's memfd only after checking those seals
//!   and its size: no access through either mapping can fault past the end of the file;
//! - `F_SEAL_FUTURE_WRITE` (Linux 5.1+) is added too, so the fd handed to a receiver can only
//!   ever be mapped read-only and not written: a receiver cannot write the sender's memory.
//!   Where the kernel lacks it, no arena is made (the sender reads ordinary memory);
//! - a receiver maps only a tmpfs memfd (not hugetlbfs, whose holes raise SIGBUS when the
//!   huge-page pool is empty);
//! - the receiver never creates a Rust reference into its view: bytes leave it through
//!   `ptr::copy_nonoverlapping` after a bounds check (the sender writes those pages);
//! - the sender's slices ([`ArenaBuf`]) cover disjoint ranges handed out by the arena's
//!   allocator, so no two live `&mut [u8]` alias; the receiver only reads.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};

use super::arena::ArenaBuf;
use crate::error::{Error, Result};

/// Seals every arena carries: its size can never change.
fn size_seals() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL
}

fn io(during: &'static str, e: impl Into<std::io::Error>) -> Error {
    Error::io(during, e.into())
}

/// The sender's memfd, mapped read-write.
#[derive(Debug)]
pub(crate) struct SealedMemfd {
    map: MmapRaw,
    file: File,
}

impl SealedMemfd {
    /// A new `len`-byte memfd (sparse: pages are allocated when first written), mapped and
    /// sealed.
    pub(crate) fn create(len: usize) -> Result<SealedMemfd> {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd = memfd_create(
            c"duet-kv-send-arena",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| io("creating the send arena (memfd_create)", e))?;
        let file = File::from(fd);
        file.set_len(len as u64)
            .map_err(|e| io("sizing the send arena", e))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io("mapping the send arena", e))?;
        // Without F_SEAL_FUTURE_WRITE (kernels before 5.1) a receiver could write these
        // pages while this process holds slices of them: no arena then.
        let seals = size_seals() | SealFlag::F_SEAL_FUTURE_WRITE;
        fcntl(&file, FcntlArg::F_ADD_SEALS(seals))
            .map_err(|e| io("sealing the send arena (needs Linux 5.1+)", e))?;
        Ok(SealedMemfd { map, file })
    }

    /// Where the mapping starts in this process (what PULL frames name).
    pub(crate) fn base(&self) -> usize {
        self.map.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The fd a receiver maps (passed with `SCM_RIGHTS`).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl std::ops::Deref for ArenaBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let (map, off, len) = self.raw();
        debug_assert!(off + len <= map.len());
        // SAFETY: the allocator handed out `off..off + len` inside the mapping (which `self`
        // keeps alive through its `Arc` of the arena) to this buffer alone, so no `&mut`
        // alias exists while `&self` is borrowed; receivers only read these pages (sealed
        // against writable mappings where the kernel allows), and any byte value is a valid
        // `u8`.
        unsafe { std::slice::from_raw_parts(map.map.as_ptr().add(off), len) }
    }
}

impl std::ops::DerefMut for ArenaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let (map, off, len) = self.raw();
        debug_assert!(off + len <= map.len());
        // SAFETY: as for `deref`; `&mut self` makes this the only live slice of the range.
        unsafe { std::slice::from_raw_parts_mut(map.map.as_mut_ptr().add(off), len) }
    }
}

/// A receiver's read-only view of a peer's send arena, and where the peer has it mapped.
#[derive(Debug)]
pub(crate) struct ArenaView {
    map: MmapRaw,
    /// The arena's address in the sender's address space.
    peer_base: usize,
}

impl ArenaView {
    /// Maps `fd` (received from the peer, which says its arena is `len` bytes at
    /// `peer_base`) read-only, after checking that its size is sealed and is `len`.
    pub(crate) fn open(fd: OwnedFd, peer_base: usize, len: usize) -> Result<ArenaView> {
        let refuse = |why: String| Error::malformed("shm arena", why);
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS)
            .map_err(|e| refuse(format!("not a sealable memfd: {e}")))?;
        let need = (SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW).bits();
        if seals & need != need {
            return Err(refuse("its size is not sealed".into()));
        }
        let fs = nix::sys::statfs::fstatfs(&fd)
            .map_err(|e| io("inspecting the peer's send arena", e))?;
        if fs.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
            return Err(refuse("not an ordinary (tmpfs) memfd".into()));
        }
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(|e| io("inspecting the peer's send arena", e))?
            .len();
        if actual != len as u64 || len == 0 {
            return Err(refuse(format!("{actual} bytes, announced {len}")));
        }
        if peer_base.checked_add(len).is_none() {
            return Err(refuse("wraps the address space".into()));
        }
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(&file)
            .map_err(|e| io("mapping the peer's send arena", e))?;
        Ok(ArenaView { map, peer_base })
    }

    /// The offset in the arena of the peer's `addr..addr + len`, when it lies wholly inside.
    pub(crate) fn offset_of(&self, addr: usize, len: usize) -> Option<usize> {
        let off = addr.checked_sub(self.peer_base)?;
        (off.checked_add(len)? <= self.map.len()).then_some(off)
    }

    /// Copies the arena's bytes at `offset` into `dst` (its size is sealed: checked in
    /// `open`).
    pub(crate) fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        super::mapping::copy_out(&self.map, offset, dst, "shm arena access")
    }
}

/// Makes a non-blocking socket call again while a signal interrupts it (tokio's `async_io`
/// retries only when the socket was not ready).
fn no_eintr<T>(mut call: impl FnMut() -> nix::Result<T>) -> std::io::Result<T> {
    loop {
        match call() {
            Err(nix::errno::Errno::EINTR) => continue,
            r => return r.map_err(std::io::Error::from),
        }
    }
}

/// Sends `body` with `fd` attached (`SCM_RIGHTS`) on a unix stream; the fd rides with the
/// first byte, the rest of a short write follows with `write_all`.
pub(crate) async fn send_with_fd(
    sock: &mut tokio::net::UnixStream,
    body: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    use tokio::io::AsyncWriteExt;
    let raw = sock.as_raw_fd();
    let sent = sock
        .async_io(tokio::io::Interest::WRITABLE, || {
            let iov = [std::io::IoSlice::new(body)];
            let fds = [fd.as_raw_fd()];
            let cmsg = [ControlMessage::ScmRights(&fds)];
            no_eintr(|| sendmsg::<()>(raw, &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None))
        })
        .await?;
    if sent == 0 {
        return Err(std::io::ErrorKind::WriteZero.into());
    }
    sock.write_all(&body[sent..]).await
}

/// Receives exactly `body.len()` bytes on a unix stream and the one fd sent with them (the
/// first one when several came; the others are closed). `None` when none came.
pub(crate) async fn recv_with_fd(
    sock: &mut tokio::net::UnixStream,
    body: &mut [u8],
) -> std::io::Result<Option<OwnedFd>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::{AsRawFd, FromRawFd, RawFd};
    use tokio::io::AsyncReadExt;
    let raw = sock.as_raw_fd();
    let (got, fd) = sock
        .async_io(tokio::io::Interest::READABLE, || {
            no_eintr(|| {
                let mut iov = [std::io::IoSliceMut::new(&mut body[..])];
                // Room for the most fds one SCM_RIGHTS message can carry (SCM_MAX_FD), so
                // that an extra-generous peer cannot make the kernel truncate what it
                // installs here.
                let mut space = nix::cmsg_space!([RawFd; 253]);
                let msg =
                    recvmsg::<()>(raw, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
                let mut first: Option<OwnedFd> = None;
                // Truncated (several messages' worth of fds): refused here. Whatever fds the
                // kernel installed then stay open (close-on-exec): only a misbehaving
                // authenticated peer gets there, and the connection is dropped.
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(fds) = c {
                        for f in fds {
                            // SAFETY: the kernel just installed `f` in this process for this
                            // message (SCM_RIGHTS); nothing else knows it, so this is its
                            // only owner (extra fds are closed when dropped here).
                            let owned = unsafe { OwnedFd::from_raw_fd(f) };
                            first.get_or_insert(owned);
                        }
                    }
                }
                Ok((msg.bytes, first))
            })
        })
        .await?;
    if got == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    sock.read_exact(&mut body[got..]).await?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_reads_what_the_owner_wrote_and_checks_bounds_and_seals() {
        let owner = SealedMemfd::create(1 << 16).unwrap();
        let fd = owner.fd().try_clone_to_owned().unwrap();
        let view = ArenaView::open(fd, 0x1000, 1 << 16).unwrap();
        assert_eq!(view.offset_of(0x1000 + 10, 5), Some(10));
        assert_eq!(view.offset_of(0xfff, 5), None);
        assert_eq!(view.offset_of(0x1000 + (1 << 16) - 4, 5), None);
        let mut out = [0u8; 5];
        assert!(view.read_at(usize::MAX, &mut out).is_err());
        view.read_at(10, &mut out).unwrap();
        assert_eq!(out, [0; 5], "a fresh arena reads as zeros");
        // A wrong announced size, and a plain (unsealed) file, are refused.
        let fd = owner.fd().try_clone_to_owned().unwrap();
        assert!(ArenaView::open(fd, 0, 4096).is_err());
        let plain = tempfile_fd();
        assert!(ArenaView::open(plain, 0, 4096).is_err());
        // The owner's fd cannot be mapped writable by anyone else (F_SEAL_FUTURE_WRITE).
        let fd = owner.fd().try_clone_to_owned().unwrap();
        assert!(MmapRaw::map_raw(&File::from(fd)).is_err());
    }

    fn tempfile_fd() -> OwnedFd {
        let path = std::env::temp_dir().join(format!("duet-arena-plain-{}", std::process::id()));
        let f = File::create(&path).unwrap();
        f.set_len(4096).unwrap();
        let _ = std::fs::remove_file(&path);
        OwnedFd::from(f)
    }
}
