//! Connection handshake: magic, version, layouts and mutual HMAC challenge-response (byte
//! layout in [`crate::protocol`]).
//!
//! Invariants:
//! - the whole handshake is bounded by one timeout;
//! - the server returns `Ok` only after the client's MAC verified (constant time) and the
//!   layouts compared equal, so no transfer frame is ever read from an unauthenticated peer;
//! - the client returns `Ok` only after the server's MAC verified, the layouts matched and
//!   the server's verdict said ok;
//! - both sides report a layout mismatch naming both values of every differing field;
//! - both sides return the same [`SessionKey`], which depends on both nonces, so every
//!   connection's frames are MACed under keys of their own.

use std::time::Duration;

use rand::RngCore;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::auth::{SharedSecret, CLIENT_LABEL, SERVER_LABEL};
use crate::error::{Error, Result};
use crate::layout::{Dtype, Fingerprint, KvLayout};
use crate::protocol::integrity::SessionKey;
use crate::protocol::{MAGIC, VERSION};

const PREFIX_LEN: usize = 8;
const LAYOUT_LEN: usize = 56;
const HELLO_LEN: usize = PREFIX_LEN + LAYOUT_LEN + 32;
const SERVER_HELLO_LEN: usize = HELLO_LEN + 32;
const MAC_LEN: usize = 32;
const VERDICT_LEN: usize = 8;
const FLAG_VERSION_REJECT: u16 = 0x8000;

const STATUS_OK: u8 = 0;
const STATUS_UNAUTHENTICATED: u8 = 1;
const STATUS_LAYOUT_MISMATCH: u8 = 2;

pub(crate) fn encode_layout(l: &KvLayout) -> [u8; LAYOUT_LEN] {
    let mut b = [0u8; LAYOUT_LEN];
    b[..32].copy_from_slice(&l.fingerprint().0);
    b[32..36].copy_from_slice(&l.layers().to_le_bytes());
    b[36..40].copy_from_slice(&l.kv_heads().to_le_bytes());
    b[40..44].copy_from_slice(&l.head_dim().to_le_bytes());
    b[44..48].copy_from_slice(&l.block_size().to_le_bytes());
    b[48] = l.dtype().wire();
    b
}

pub(crate) fn decode_layout(b: &[u8]) -> Result<KvLayout> {
    if b.len() != LAYOUT_LEN {
        return Err(Error::malformed("layout", "wrong length"));
    }
    let u = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    if b[49..].iter().any(|&x| x != 0) {
        return Err(Error::malformed("layout", "reserved bytes not zero"));
    }
    let dtype = Dtype::from_wire(b[48])
        .ok_or_else(|| Error::malformed("layout", format!("unknown dtype code {}", b[48])))?;
    let mut fp = [0u8; 32];
    fp.copy_from_slice(&b[..32]);
    KvLayout::new(Fingerprint(fp), u(32), u(36), u(40), u(44), dtype)
}

fn prefix(flags: u16) -> [u8; PREFIX_LEN] {
    let mut p = [0u8; PREFIX_LEN];
    p[..4].copy_from_slice(&MAGIC);
    p[4..6].copy_from_slice(&VERSION.to_le_bytes());
    p[6..8].copy_from_slice(&flags.to_le_bytes());
    p
}

/// Checks magic and version; returns the flags.
fn check_prefix(p: &[u8; PREFIX_LEN]) -> Result<u16> {
    if p[..4] != MAGIC {
        let mut found = [0u8; 4];
        found.copy_from_slice(&p[..4]);
        return Err(Error::BadMagic { found });
    }
    let remote = u16::from_le_bytes([p[4], p[5]]);
    if remote != VERSION {
        return Err(Error::UnsupportedVersion {
            local: VERSION,
            remote,
        });
    }
    Ok(u16::from_le_bytes([p[6], p[7]]))
}

fn hello(layout: &KvLayout) -> [u8; HELLO_LEN] {
    let mut nonce = [0u8; 32];
    rand::rng().fill_bytes(&mut nonce);
    let mut h = [0u8; HELLO_LEN];
    h[..PREFIX_LEN].copy_from_slice(&prefix(0));
    h[PREFIX_LEN..PREFIX_LEN + LAYOUT_LEN].copy_from_slice(&encode_layout(layout));
    h[PREFIX_LEN + LAYOUT_LEN..].copy_from_slice(&nonce);
    h
}

fn verdict_msg(status: u8) -> [u8; VERDICT_LEN] {
    let mut v = [0u8; VERDICT_LEN];
    v[..4].copy_from_slice(&MAGIC);
    v[4] = status;
    v
}

async fn read<S: AsyncRead + Unpin>(s: &mut S, buf: &mut [u8], during: &'static str) -> Result<()> {
    s.read_exact(buf)
        .await
        .map(|_| ())
        .map_err(|e| Error::io(during, e))
}

async fn write<S: AsyncWrite + Unpin>(s: &mut S, buf: &[u8], during: &'static str) -> Result<()> {
    s.write_all(buf).await.map_err(|e| Error::io(during, e))?;
    s.flush().await.map_err(|e| Error::io(during, e))
}

async fn bounded<T, F: std::future::Future<Output = Result<T>>>(
    timeout: Duration,
    f: F,
) -> Result<T> {
    tokio::time::timeout(timeout, f)
        .await
        .map_err(|_| Error::Timeout {
            during: "the handshake",
            after: timeout,
        })?
}

/// Sender side of the handshake; returns the connection's frame key.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin + Send>(
    s: &mut S,
    layout: &KvLayout,
    secret: &SharedSecret,
    timeout: Duration,
) -> Result<SessionKey> {
    bounded(timeout, client_inner(s, layout, secret)).await
}

async fn client_inner<S: AsyncRead + AsyncWrite + Unpin + Send>(
    s: &mut S,
    layout: &KvLayout,
    secret: &SharedSecret,
) -> Result<SessionKey> {
    let hello = hello(layout);
    write(s, &hello, "sending the handshake").await?;
    let mut sh = [0u8; SERVER_HELLO_LEN];
    let mut p = [0u8; PREFIX_LEN];
    read(s, &mut p, "reading the handshake answer").await?;
    let flags = check_prefix(&p)?;
    if flags != 0 {
        return Err(Error::malformed(
            "handshake",
            format!("unknown flags {flags:#06x}"),
        ));
    }
    sh[..PREFIX_LEN].copy_from_slice(&p);
    read(s, &mut sh[PREFIX_LEN..], "reading the handshake answer").await?;
    // Always answer, so that a server with another secret also reports Unauthenticated.
    let mac = secret.mac(CLIENT_LABEL, &[&hello, &sh])?;
    write(s, &mac, "sending the handshake proof").await?;
    if !secret.verify(SERVER_LABEL, &[&hello, &sh[..HELLO_LEN]], &sh[HELLO_LEN..])? {
        return Err(Error::Unauthenticated(
            "the receiver did not prove knowledge of the shared secret",
        ));
    }
    let remote = decode_layout(&sh[PREFIX_LEN..PREFIX_LEN + LAYOUT_LEN])?;
    layout.check_compatible(&remote)?;
    let mut v = [0u8; VERDICT_LEN];
    read(s, &mut v, "reading the handshake verdict").await?;
    if v[..4] != MAGIC || v[5..].iter().any(|&b| b != 0) {
        return Err(Error::malformed(
            "handshake verdict",
            "bad magic or reserved bytes",
        ));
    }
    match v[4] {
        STATUS_OK => SessionKey::derive(secret, &hello, &sh),
        STATUS_UNAUTHENTICATED => Err(Error::Unauthenticated(
            "the receiver rejected our proof of the shared secret",
        )),
        STATUS_LAYOUT_MISMATCH => Err(Error::malformed(
            "handshake verdict",
            "receiver reports a layout mismatch for identical layouts",
        )),
        other => Err(Error::malformed(
            "handshake verdict",
            format!("unknown status {other}"),
        )),
    }
}

/// Receiver side of the handshake; returns the connection's frame key.
pub(crate) async fn server<S: AsyncRead + AsyncWrite + Unpin + Send>(
    s: &mut S,
    layout: &KvLayout,
    secret: &SharedSecret,
    timeout: Duration,
) -> Result<SessionKey> {
    bounded(timeout, server_inner(s, layout, secret)).await
}

async fn server_inner<S: AsyncRead + AsyncWrite + Unpin + Send>(
    s: &mut S,
    layout: &KvLayout,
    secret: &SharedSecret,
) -> Result<SessionKey> {
    let mut hello = [0u8; HELLO_LEN];
    let mut p = [0u8; PREFIX_LEN];
    read(s, &mut p, "reading the handshake").await?;
    let flags = match check_prefix(&p) {
        Ok(f) => f,
        Err(e @ Error::UnsupportedVersion { .. }) => {
            // Best effort: tell the peer which version we speak.
            let _ = write(s, &prefix(FLAG_VERSION_REJECT), "rejecting the version").await;
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    if flags != 0 {
        return Err(Error::malformed(
            "handshake",
            format!("unknown flags {flags:#06x}"),
        ));
    }
    hello[..PREFIX_LEN].copy_from_slice(&p);
    read(s, &mut hello[PREFIX_LEN..], "reading the handshake").await?;
    let remote = decode_layout(&hello[PREFIX_LEN..PREFIX_LEN + LAYOUT_LEN])?;
    let mut sh = [0u8; SERVER_HELLO_LEN];
    sh[..HELLO_LEN].copy_from_slice(&self::hello(layout));
    let mac = secret.mac(SERVER_LABEL, &[&hello, &sh[..HELLO_LEN]])?;
    sh[HELLO_LEN..].copy_from_slice(&mac);
    write(s, &sh, "answering the handshake").await?;
    let mut proof = [0u8; MAC_LEN];
    read(s, &mut proof, "reading the handshake proof").await?;
    if !secret.verify(CLIENT_LABEL, &[&hello, &sh], &proof)? {
        let _ = write(s, &verdict_msg(STATUS_UNAUTHENTICATED), "rejecting").await;
        return Err(Error::Unauthenticated(
            "the sender did not prove knowledge of the shared secret",
        ));
    }
    if let Err(m) = layout.check_compatible(&remote) {
        let _ = write(s, &verdict_msg(STATUS_LAYOUT_MISMATCH), "rejecting").await;
        return Err(m.into());
    }
    write(s, &verdict_msg(STATUS_OK), "accepting the handshake").await?;
    SessionKey::derive(secret, &hello, &sh)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_round_trip() {
        let l = KvLayout::new(Fingerprint([3; 32]), 30, 3, 64, 16, Dtype::F16).unwrap();
        assert_eq!(decode_layout(&encode_layout(&l)).unwrap(), l);
        let mut b = encode_layout(&l);
        b[48] = 9;
        assert!(decode_layout(&b).is_err());
    }

    #[tokio::test]
    async fn wrong_version_is_refused_by_both() {
        let l = KvLayout::new(Fingerprint([3; 32]), 2, 1, 8, 4, Dtype::F32).unwrap();
        let secret = SharedSecret::new([9u8; 32]).unwrap();
        let (mut a, mut b) = tokio::io::duplex(4096);
        let srv = tokio::spawn({
            let secret = secret.clone();
            async move { server(&mut b, &l, &secret, Duration::from_secs(5)).await }
        });
        let mut h = hello(&l);
        h[4] = 3;
        a.write_all(&h).await.unwrap();
        let mut p = [0u8; PREFIX_LEN];
        a.read_exact(&mut p).await.unwrap();
        let e = srv.await.unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                Error::UnsupportedVersion {
                    local: 2,
                    remote: 3
                }
            ),
            "{e}"
        );
        assert_eq!(u16::from_le_bytes([p[6], p[7]]), FLAG_VERSION_REJECT);
    }
}
