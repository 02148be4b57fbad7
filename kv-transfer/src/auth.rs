//! Shared-secret authentication primitives (HMAC-SHA256).
//!
//! Invariants: the secret is never printed (`Debug` is redacted); MAC verification is
//! constant time (`hmac::Mac::verify_slice`); server and client MACs use distinct labels so
//! that one side's answer can never be replayed as the other's.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// Shortest accepted secret.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest accepted secret.
pub const MAX_SECRET_LEN: usize = 1024;

/// Label of the MAC the receiver (server) sends.
pub(crate) const SERVER_LABEL: &[u8] = b"duet-kv-transfer/2 server";
/// Label of the MAC the sender (client) sends.
pub(crate) const CLIENT_LABEL: &[u8] = b"duet-kv-transfer/2 client";

/// The secret both workers of a deployment share. Cheap to clone.
#[derive(Clone)]
pub struct SharedSecret(Arc<[u8]>);

impl SharedSecret {
    /// Wraps a secret of [`MIN_SECRET_LEN`]..=[`MAX_SECRET_LEN`] bytes.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self> {
        let b = bytes.as_ref();
        if b.len() < MIN_SECRET_LEN || b.len() > MAX_SECRET_LEN {
            return Err(Error::InvalidArgument(format!(
                "shared secret must be {MIN_SECRET_LEN}..={MAX_SECRET_LEN} bytes, got {}",
                b.len()
            )));
        }
        Ok(SharedSecret(Arc::from(b)))
    }

    fn keyed(&self) -> Result<HmacSha256> {
        HmacSha256::new_from_slice(&self.0)
            .map_err(|_| Error::Internal("HMAC rejected the key length".into()))
    }

    /// A key derived from the secret for another purpose, named by `label` (e.g. the token
    /// internal RPCs carry): HMAC-SHA256(secret, label). Knowing it reveals nothing of the
    /// secret, nor of keys with other labels.
    pub fn derive(&self, label: &[u8]) -> Result<[u8; 32]> {
        self.mac(label, &[])
    }

    /// HMAC-SHA256(secret, label || parts...).
    pub(crate) fn mac(&self, label: &[u8], parts: &[&[u8]]) -> Result<[u8; 32]> {
        let mut m = self.keyed()?;
        m.update(label);
        for p in parts {
            m.update(p);
        }
        Ok(m.finalize().into_bytes().into())
    }

    /// Constant-time check of `tag` against HMAC-SHA256(secret, label || parts...).
    pub(crate) fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> Result<bool> {
        let mut m = self.keyed()?;
        m.update(label);
        for p in parts {
            m.update(p);
        }
        Ok(m.verify_slice(tag).is_ok())
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedSecret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_verifies_and_labels_differ() {
        let s = SharedSecret::new([1u8; 32]).unwrap();
        let t = s.mac(SERVER_LABEL, &[b"abc"]).unwrap();
        assert!(s.verify(SERVER_LABEL, &[b"abc"], &t).unwrap());
        assert!(!s.verify(CLIENT_LABEL, &[b"abc"], &t).unwrap());
        let other = SharedSecret::new([2u8; 32]).unwrap();
        assert!(!other.verify(SERVER_LABEL, &[b"abc"], &t).unwrap());
        assert!(!format!("{s:?}").contains('1'));
        assert!(SharedSecret::new(b"short").is_err());
    }
}
