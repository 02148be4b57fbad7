//! API keys (bearer tokens) for the public doors, as vLLM's `--api-key`: a request must carry
//! `authorization: Bearer <key>` (gRPC metadata or HTTP header) with one of the configured
//! keys. Health, reflection and `/metrics` stay open for probes and scrapers.
//!
//! Invariants: keys are kept only as SHA-256 digests and compared in constant time against
//! every configured key (no early exit, no length leak); neither the keys nor what a client
//! sent is ever logged or put in an error message.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::RouterError;

/// The configured keys; empty means the doors are open.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} configured)", self.digests.len())
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

impl ApiKeys {
    /// From the keys themselves (empty strings are ignored).
    pub fn new<I, S>(keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        ApiKeys {
            digests: keys
                .into_iter()
                .filter(|k| !k.as_ref().is_empty())
                .map(|k| digest(k.as_ref().as_bytes()))
                .collect(),
        }
    }

    /// Whether any key is required.
    pub fn enabled(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Checks an `authorization` header value.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), RouterError> {
        if !self.enabled() {
            return Ok(());
        }
        let token = authorization
            .and_then(|v| {
                let (scheme, rest) = v.split_at(v.len().min(7));
                scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
            })
            .ok_or(RouterError::Unauthenticated(
                "missing API key (send `authorization: Bearer <key>`)",
            ))?;
        let presented = digest(token.trim_ascii());
        let mut ok = subtle::Choice::from(0);
        for d in &self.digests {
            ok |= d.ct_eq(&presented);
        }
        if bool::from(ok) {
            Ok(())
        } else {
            Err(RouterError::Unauthenticated("invalid API key"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_without_keys() {
        assert!(ApiKeys::new(Vec::<String>::new()).check(None).is_ok());
        assert!(ApiKeys::new([""]).check(None).is_ok());
    }

    #[test]
    fn any_configured_key_opens_and_nothing_else_does() {
        let k = ApiKeys::new(["alpha", "beta"]);
        assert!(k.check(Some(b"Bearer alpha")).is_ok());
        assert!(k.check(Some(b"bearer beta")).is_ok());
        for bad in [
            &b"Bearer gamma"[..],
            b"Bearer alph",
            b"Bearer alphaa",
            b"alpha",
            b"Basic alpha",
            b"Bearer ",
            b"",
        ] {
            assert!(
                matches!(k.check(Some(bad)), Err(RouterError::Unauthenticated(_))),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(k.check(None).is_err());
    }

    #[test]
    fn errors_never_carry_the_key() {
        let k = ApiKeys::new(["s3cret"]);
        let e = k.check(Some(b"Bearer s3cre")).unwrap_err().to_string();
        assert!(!e.contains("s3cre"), "{e}");
        assert!(!format!("{k:?}").contains("s3cret"));
    }
}
