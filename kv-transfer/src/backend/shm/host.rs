//! Which processes can reach each other over `shm`: the host identity a decode worker
//! publishes with its socket path, compared by the prefill side before it picks `shm`.
//!
//! The identity is the kernel's boot id plus the inode of the mount namespace. Equal
//! identities mean the same running kernel and the same view of the file system, so the
//! socket path (and the ring file beside it) a decode worker advertises exists for the
//! sender too. Processes in different containers of one node have different mount
//! namespaces and fall back to tcp; pull mode additionally needs the sender's pid to be
//! visible and readable, which the set-up probes rather than assumes.

/// This process's host identity, or `None` where it cannot be read (not Linux, no /proc):
/// then `shm` is never chosen.
pub fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let boot: String = boot.trim().chars().filter(|c| *c != '-').collect();
    let ns = std::fs::read_link("/proc/self/ns/mnt").ok()?;
    // "mnt:[4026531841]" -> "4026531841"
    let ns = ns.to_str()?;
    let inode = ns.strip_prefix("mnt:[")?.strip_suffix(']')?;
    let valid = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric());
    (valid(&boot) && valid(inode)).then(|| format!("{boot}-{inode}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_stable_and_shaped_for_an_address() {
        let a = host_identity().expect("Linux with /proc");
        assert_eq!(Some(a.clone()), host_identity());
        // It is the part of an shm address before the first ':'.
        assert!(!a.contains(':') && !a.contains('/'), "{a}");
        let (boot, ns) = a.split_once('-').expect("boot id and namespace");
        assert_eq!(boot.len(), 32, "{a}");
        assert!(ns.parse::<u64>().is_ok(), "{a}");
    }
}
