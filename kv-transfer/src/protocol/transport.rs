//! [`FrameTransport`]: the byte-moving half of a backend, shared by the frame encoder and
//! decoder, plus [`SliceTransport`], an in-memory transport used by the sync codec, property
//! tests and the fuzz target.
//!
//! Invariants: `read_ctl`/`read_payload` fill the whole buffer or fail (timeout, EOF, I/O);
//! `write_layer` writes the header, the K regions, the V regions and the trailer in that
//! order without concatenating them; implementations enforce their own timeouts.

use std::future::Future;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::protocol::frame::{MAC_LEN, TAG_VERDICT};
use crate::protocol::integrity::FrameMac;
use crate::protocol::{HEADER_LEN, IDLE};

/// Moves protocol bytes. Control bytes (headers, small bodies, trailers) and layer payload
/// bytes are separate so that a transport can route payload another way (shm slots).
pub(crate) trait FrameTransport: Send {
    /// Reads exactly `buf.len()` bytes of the first header of a transfer, waiting up to the
    /// idle timeout. EOF before the first byte is `PeerClosed { during: IDLE }`.
    fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> impl Future<Output = Result<()>> + Send;

    /// Reads exactly `buf.len()` control bytes.
    fn read_ctl(
        &mut self,
        buf: &mut [u8],
        during: &'static str,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Announces that a LAYER payload of `len` bytes follows (transports that move payload
    /// out of band, e.g. NCCL, size their receive by it). Default: nothing to do.
    fn begin_payload(&mut self, len: u64) -> impl Future<Output = Result<()>> + Send {
        let _ = len;
        async { Ok(()) }
    }

    /// Reads exactly `dst.len()` payload bytes of the current LAYER frame into `dst`.
    fn read_payload(&mut self, dst: &mut [u8]) -> impl Future<Output = Result<()>> + Send;

    /// Reads payload bytes into each buffer in turn, exactly filling all of them. The default
    /// reads one buffer at a time; stream transports override it with vectored reads.
    fn read_payload_vectored(
        &mut self,
        bufs: &mut [&mut [u8]],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for b in bufs.iter_mut() {
                self.read_payload(b).await?;
            }
            Ok(())
        }
    }

    /// Writes control bytes.
    fn write_ctl(
        &mut self,
        buf: &[u8],
        during: &'static str,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Writes one LAYER frame: header, K regions, V regions, optional MAC trailer. `k` and
    /// `v` may differ in length (a compressed layer comes as one staged buffer in `k`).
    fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; MAC_LEN]>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// [`write_layer`](Self::write_layer) with the trailer still to compute: `mac` must see
    /// every K then V byte in order. The default hashes everything first; a transport may
    /// hash each piece just before it writes it, while the piece is in cache.
    fn write_layer_mac<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        mac: Option<FrameMac>,
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            let trailer = mac.map(|mut m| {
                m.update_all(k);
                m.update_all(v);
                m.finish()
            });
            self.write_layer(header, k, v, trailer).await
        }
    }

    /// [`write_layer`](Self::write_layer) with owned regions, which the transport may keep
    /// until the receiver has consumed them instead of waiting for it (the default waits).
    fn write_layer_owned(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: Vec<Bytes>,
        v: Vec<Bytes>,
        trailer: Option<[u8; MAC_LEN]>,
    ) -> impl Future<Output = Result<()>> + Send {
        async move { self.write_layer(header, &k, &v, trailer).await }
    }

    /// After a successful verdict: checks that nothing of the transfer is still pending in
    /// the transport (a receiver that answered early is a protocol error).
    fn transfer_ended(&mut self) -> Result<()> {
        Ok(())
    }

    /// Reads the header of the receiver's next reply (skipping flow-control frames).
    fn read_reply_header(
        &mut self,
        buf: &mut [u8; HEADER_LEN],
    ) -> impl Future<Output = Result<()>> + Send;

    /// Non-blocking check for a reply that arrived before it was asked for (the receiver
    /// rejected the transfer early). Returns true when `buf` now holds a reply header.
    fn poll_early_reply(
        &mut self,
        buf: &mut [u8; HEADER_LEN],
    ) -> impl Future<Output = Result<bool>> + Send;

    /// After a receiver-side error: stop sending, discard what the peer still sends for a
    /// bounded time so that it can read our verdict, then give up.
    fn shutdown_and_drain(&mut self) -> impl Future<Output = ()> + Send;
}

/// In-memory transport: reads from a byte slice, appends writes to a `Vec`. Never pends.
#[derive(Debug)]
pub(crate) struct SliceTransport<'a> {
    input: &'a [u8],
    pub(crate) output: Vec<u8>,
}

impl<'a> SliceTransport<'a> {
    pub(crate) fn new(input: &'a [u8]) -> Self {
        SliceTransport {
            input,
            output: Vec::new(),
        }
    }

    fn take(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        if self.input.len() < buf.len() {
            self.input = &[];
            return Err(Error::PeerClosed { during });
        }
        let (head, rest) = self.input.split_at(buf.len());
        buf.copy_from_slice(head);
        self.input = rest;
        Ok(())
    }
}

impl FrameTransport for SliceTransport<'_> {
    async fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        if self.input.is_empty() {
            return Err(Error::PeerClosed { during: IDLE });
        }
        self.take(buf, "reading a frame header")
    }

    async fn read_ctl(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        self.take(buf, during)
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        self.take(dst, "reading layer payload")
    }

    async fn write_ctl(&mut self, buf: &[u8], _during: &'static str) -> Result<()> {
        self.output.extend_from_slice(buf);
        Ok(())
    }

    async fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; MAC_LEN]>,
    ) -> Result<()> {
        self.output.extend_from_slice(header);
        for r in k.iter().chain(v) {
            self.output.extend_from_slice(r.as_ref());
        }
        if let Some(t) = trailer {
            self.output.extend_from_slice(&t);
        }
        Ok(())
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        self.take(buf, "waiting for the verdict")
    }

    async fn poll_early_reply(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<bool> {
        if self.input.first() == Some(&TAG_VERDICT) {
            self.take(buf, "reading the verdict")?;
            return Ok(true);
        }
        Ok(false)
    }

    async fn shutdown_and_drain(&mut self) {
        self.input = &[];
    }
}
