//! The files a same-host receiver leaves in its directory, and cleaning up after receivers
//! that died without doing it themselves (`kill -9`).
//!
//! - Sockets are named `duet-sock-<tag>-<random>.sock` ([`SOCKET_PREFIX`]). They are bound
//!   under a hidden temporary name and hard-linked into place once listening, so a socket
//!   under the public name always accepts while its receiver lives: a refused connection
//!   therefore means a dead receiver, and [`remove_stale`] may delete it.
//! - Ring files (`duet-kv-<hex>`) exist only during a connection's set-up (seconds); one
//!   older than [`STALE_AFTER`] was left by a receiver that died mid set-up.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};

use super::mapping::valid_name;
use crate::error::{Error, Result};

/// Prefix of receivers' socket names.
pub(crate) const SOCKET_PREFIX: &str = "duet-sock-";
/// Prefix of the temporary names sockets are bound under.
const BINDING_PREFIX: &str = ".duet-binding-";
/// Age after which a ring file or a temporary socket name is certainly abandoned.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(600);
/// How long a liveness probe of a socket may take (a live but stopped receiver with a full
/// backlog never answers; it is then left alone).
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// Longest socket path the kernel takes (`sun_path` is 108 bytes, NUL included).
const MAX_SOCKET_PATH: usize = 107;

/// A fresh socket path in `dir` for a receiver tagged `tag` (the tag is left out when the
/// path would be too long for a unix socket).
pub(crate) fn socket_path(dir: &Path, tag: &str) -> PathBuf {
    let rnd = rand::random::<u64>();
    let tagged = dir.join(format!("{SOCKET_PREFIX}{tag}-{rnd:016x}.sock"));
    if tagged.as_os_str().len() <= MAX_SOCKET_PATH && !tag.contains('/') {
        tagged
    } else {
        dir.join(format!("{SOCKET_PREFIX}{rnd:016x}.sock"))
    }
}

/// Binds a listening socket at `path`, which must not exist: bound under a temporary name in
/// the same directory, then linked into place (atomically, never replacing a file).
pub(crate) fn bind_atomically(path: &Path) -> Result<UnixListener> {
    let dir = path.parent().ok_or_else(|| {
        Error::InvalidArgument(format!("socket path {} has no directory", path.display()))
    })?;
    let tmp = dir.join(format!("{BINDING_PREFIX}{:016x}", rand::random::<u64>()));
    let listener = UnixListener::bind(&tmp).map_err(|e| Error::io("binding the unix socket", e))?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked.map_err(|e| Error::io("placing the unix socket", e))?;
    Ok(listener)
}

/// Removes from `dir` the sockets nobody listens on any more, and ring files and temporary
/// socket names older than [`STALE_AFTER`]. Returns how many files went. Errors (another
/// user's files, a vanished file) leave that file alone.
pub async fn remove_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let path = e.path();
        let stale = if name.starts_with(SOCKET_PREFIX) {
            matches!(
                tokio::time::timeout(PROBE_TIMEOUT, UnixStream::connect(&path)).await,
                Ok(Err(err)) if err.kind() == std::io::ErrorKind::ConnectionRefused
            )
        } else if valid_name(&name) || name.starts_with(BINDING_PREFIX) {
            e.metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > STALE_AFTER)
        } else {
            false
        };
        if stale && std::fs::remove_file(&path).is_ok() {
            tracing::info!(path = %path.display(), "removed a file a dead KV receiver left");
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("duet-files-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[tokio::test]
    async fn dead_sockets_go_live_ones_and_other_files_stay() {
        let dir = scratch("stale");
        let live_path = socket_path(&dir, "decode-0");
        let live = bind_atomically(&live_path).unwrap();
        let dead_path = socket_path(&dir, "decode-1");
        drop(bind_atomically(&dead_path).unwrap());
        assert!(dead_path.exists(), "a dropped listener leaves its file");
        // Someone else's file and a fresh ring file are not ours to remove.
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        std::fs::write(dir.join(format!("duet-kv-{}", "0".repeat(32))), b"").unwrap();
        assert_eq!(remove_stale(&dir).await, 1);
        assert!(!dead_path.exists());
        assert!(live_path.exists());
        assert!(dir.join("notes.txt").exists());
        assert!(dir.join(format!("duet-kv-{}", "0".repeat(32))).exists());
        // The live one still accepts, and nothing temporary is left beside it.
        let _c = UnixStream::connect(&live_path).await.unwrap();
        let _ = live.accept().await.unwrap();
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            !names.iter().any(|n| n.starts_with(BINDING_PREFIX)),
            "{names:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn binding_never_replaces_a_file() {
        let dir = scratch("replace");
        let p = dir.join("duet-sock-x.sock");
        std::fs::write(&p, b"keep").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let r = rt.block_on(async { bind_atomically(&p).map(|_| ()) });
        assert!(r.is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"keep");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn long_tags_are_left_out_of_the_socket_name() {
        let dir = Path::new("/dev/shm");
        let short = socket_path(dir, "decode-0");
        assert!(short.to_string_lossy().contains("decode-0"));
        let long = socket_path(dir, &"x".repeat(200));
        assert!(long.as_os_str().len() <= MAX_SOCKET_PATH, "{long:?}");
        assert!(long.to_string_lossy().starts_with("/dev/shm/duet-sock-"));
    }
}
