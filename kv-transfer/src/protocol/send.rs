//! Connection state machines shared by the stream backends (tcp, shm): [`SenderCore`] encodes
//! frames onto a [`FrameTransport`]; [`ReceiverCore`] decodes them into a sink and answers
//! with a verdict.
//!
//! Invariants:
//! - a sender moves Idle -> InTransfer (BEGIN) -> Idle (verdict read); any transport error
//!   makes it Broken for good; caller mistakes detected before writing leave it unchanged;
//! - the sender never writes a layer whose region count or region sizes disagree with the
//!   layout, and sends each layer at most once;
//! - a receiver that failed answers a verdict naming the error class when the connection
//!   still works, then drains and marks itself Broken.

use std::time::Instant;

use bytes::Bytes;

use crate::api::TransferReceipt;
use crate::error::{Error, ErrorClass, Result};
use crate::layout::{KvLayout, TransferDesc};
use crate::protocol::compress::{encode_region, Compression};
use crate::protocol::frame::{
    encode_abort, encode_block_ids, encode_end, BeginFixed, FrameHeader, Verdict, BEGIN_FIXED_LEN,
    MAC_LEN, TAG_ABORT, TAG_BEGIN, TAG_END, TAG_LAYER,
};
use crate::protocol::integrity::{tag_of, FrameAuth, FrameMac};
use crate::protocol::receive::{receive_transfer, ReceivePolicy};
use crate::protocol::transport::FrameTransport;
use crate::protocol::{HEADER_LEN, MAX_REASON_LEN};
use crate::sink::KvSink;

#[derive(Debug)]
enum SendState {
    Idle,
    InTransfer {
        desc: TransferDesc,
        seen: Vec<bool>,
        sent: u32,
        started: Instant,
    },
    Broken,
}

/// Sender half of a stream connection (after the handshake).
#[derive(Debug)]
pub(crate) struct SenderCore<T> {
    pub(crate) io: T,
    layout: KvLayout,
    /// Frame MACs (`None`: integrity off).
    auth: Option<FrameAuth>,
    /// Encoding of LAYER payloads (already [`Compression::effective`] for the layout).
    compression: Compression,
    /// Encoded layer (compressed transfers only); reused, so it grows to the largest layer.
    stage: Vec<u8>,
    state: SendState,
    #[cfg(feature = "fault-injection")]
    faults: crate::protocol::faults::Injector,
}

fn check_regions<R: AsRef<[u8]>>(
    layout: &KvLayout,
    n_blocks: usize,
    name: &str,
    regions: &[R],
) -> Result<()> {
    if regions.len() != n_blocks {
        return Err(Error::InvalidArgument(format!(
            "{name}: {} regions given, transfer has {n_blocks} blocks",
            regions.len()
        )));
    }
    let want = layout.region_bytes();
    if let Some((i, r)) = regions
        .iter()
        .enumerate()
        .find(|(_, r)| r.as_ref().len() != want)
    {
        return Err(Error::InvalidArgument(format!(
            "{name}[{i}] is {} bytes, layout region is {want}",
            r.as_ref().len()
        )));
    }
    Ok(())
}

impl<T: FrameTransport> SenderCore<T> {
    pub(crate) fn new(io: T, layout: KvLayout, auth: Option<FrameAuth>) -> Self {
        SenderCore {
            io,
            layout,
            auth,
            compression: Compression::None,
            stage: Vec::new(),
            state: SendState::Idle,
            #[cfg(feature = "fault-injection")]
            faults: Default::default(),
        }
    }

    /// Applies the sender settings of `cfg` (compression; with feature `fault-injection`,
    /// its fault plan).
    pub(crate) fn configured(self, cfg: &crate::config::TransferConfig) -> Self {
        #[allow(unused_mut)]
        let mut core = self.with_compression(cfg.compression);
        #[cfg(feature = "fault-injection")]
        {
            core.faults.plan = cfg.faults.clone();
        }
        core
    }

    /// Whether a fault plan routes this transfer's frames through the injector.
    fn injecting(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        {
            self.faults.plan.is_some()
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }

    /// Writes a control frame (BEGIN, END, ABORT).
    async fn write_frame(&mut self, msg: &[u8], during: &'static str) -> Result<()> {
        #[cfg(feature = "fault-injection")]
        if self.injecting() {
            return self.faults.ctl(&mut self.io, msg, during).await;
        }
        self.io.write_ctl(msg, during).await
    }

    /// Writes a LAYER frame whose trailer is already computed.
    async fn write_with_trailer<R: AsRef<[u8]> + Sync>(
        &mut self,
        hdr: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; MAC_LEN]>,
    ) -> Result<()> {
        #[cfg(feature = "fault-injection")]
        if self.injecting() {
            return self.faults.layer(&mut self.io, hdr, k, v, trailer).await;
        }
        self.io.write_layer(hdr, k, v, trailer).await
    }

    /// Encodes every later transfer's layers with `c` (see [`crate::protocol::compress`]).
    pub(crate) fn with_compression(mut self, c: Compression) -> Self {
        self.compression = c.effective(self.layout.dtype());
        self
    }

    pub(crate) fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The transport (for backend-specific accessors).
    pub(crate) fn transport(&self) -> &T {
        &self.io
    }

    fn poison<V>(&mut self, r: Result<V>) -> Result<V> {
        if r.is_err() {
            self.state = SendState::Broken;
        }
        r
    }

    pub(crate) async fn begin(&mut self, desc: TransferDesc) -> Result<()> {
        match self.state {
            SendState::Idle => {}
            SendState::Broken => return Err(Error::Broken),
            SendState::InTransfer { .. } => {
                return Err(Error::InvalidArgument(
                    "begin called while a transfer is in progress".into(),
                ))
            }
        }
        desc.validate(&self.layout)?;
        let ids = encode_block_ids(&desc.dst_blocks);
        let fixed = BeginFixed {
            request_id: desc.request_id,
            token_start: desc.token_start,
            token_count: desc.token_count,
            n_blocks: desc.dst_blocks.len() as u32,
            compression: self.compression,
        }
        .encode();
        let len = (BEGIN_FIXED_LEN + ids.len()) as u64;
        let hdr = FrameHeader::new(TAG_BEGIN, self.auth.is_some(), 0, len).encode();
        let mut msg = Vec::with_capacity(HEADER_LEN + len as usize + MAC_LEN);
        msg.extend_from_slice(&hdr);
        msg.extend_from_slice(&fixed);
        msg.extend_from_slice(&ids);
        if let Some(auth) = &mut self.auth {
            msg.extend_from_slice(&tag_of(auth, &hdr, &[&fixed, &ids]));
        }
        #[cfg(feature = "fault-injection")]
        self.faults.begin();
        let r = self.write_frame(&msg, "sending BEGIN").await;
        self.poison(r)?;
        self.state = SendState::InTransfer {
            seen: vec![false; self.layout.layers() as usize],
            sent: 0,
            desc,
            started: Instant::now(),
        };
        Ok(())
    }

    /// Checks a layer against the transfer in progress; returns its block count.
    fn check_layer<R: AsRef<[u8]>>(&self, layer: u32, k: &[R], v: &[R]) -> Result<usize> {
        let n_blocks = match &self.state {
            SendState::InTransfer { desc, seen, .. } => {
                match seen.get(layer as usize) {
                    None => {
                        return Err(Error::LayerOutOfRange {
                            layer,
                            layers: self.layout.layers(),
                        })
                    }
                    Some(true) => return Err(Error::DuplicateLayer { layer }),
                    Some(false) => {}
                }
                desc.dst_blocks.len()
            }
            SendState::Idle => {
                return Err(Error::InvalidArgument(
                    "send_layer called before begin".into(),
                ))
            }
            SendState::Broken => return Err(Error::Broken),
        };
        check_regions(&self.layout, n_blocks, "k", k)?;
        check_regions(&self.layout, n_blocks, "v", v)?;
        Ok(n_blocks)
    }

    pub(crate) async fn send_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        layer: u32,
        k: &[R],
        v: &[R],
    ) -> Result<()> {
        let n_blocks = self.check_layer(layer, k, v)?;
        self.stage_layer(k, v)?;
        let r = self.write_layer(layer, n_blocks, k, v).await;
        self.layer_sent(layer, r).await
    }

    /// [`send_layer`](Self::send_layer) with owned buffers: uncompressed, the transport may
    /// keep them until the receiver has consumed them instead of waiting (shm pull mode
    /// pipelines its PULLs this way).
    pub(crate) async fn send_layer_bytes(
        &mut self,
        layer: u32,
        k: Vec<Bytes>,
        v: Vec<Bytes>,
    ) -> Result<()> {
        let n_blocks = self.check_layer(layer, &k, &v)?;
        self.stage_layer(&k, &v)?;
        let r = if self.compression == Compression::None {
            let hdr = self.layer_header(layer, n_blocks);
            let trailer = self.mac(&hdr).map(|mut m| {
                m.update_all(&k);
                m.update_all(&v);
                m.finish()
            });
            if self.injecting() {
                self.write_with_trailer(&hdr, &k, &v, trailer).await
            } else {
                self.io.write_layer_owned(&hdr, k, v, trailer).await
            }
        } else {
            self.write_layer(layer, n_blocks, &k, &v).await
        };
        self.layer_sent(layer, r).await
    }

    /// With compression, encodes the layer into the stage buffer. A non-finite value is the
    /// caller's data, not a connection failure: the error leaves the connection usable.
    fn stage_layer<R: AsRef<[u8]>>(&mut self, k: &[R], v: &[R]) -> Result<()> {
        if self.compression == Compression::None {
            return Ok(());
        }
        self.stage.clear();
        for region in k.iter().chain(v) {
            encode_region(
                self.compression,
                &self.layout,
                region.as_ref(),
                &mut self.stage,
            )?;
        }
        Ok(())
    }

    /// The LAYER frame header of `layer` over `n_blocks` blocks, as encoded on the wire.
    fn layer_header(&self, layer: u32, n_blocks: usize) -> [u8; HEADER_LEN] {
        let len = self.compression.layer_wire_bytes(&self.layout, n_blocks);
        FrameHeader::new(TAG_LAYER, self.auth.is_some(), layer, len).encode()
    }

    /// The MAC of the next frame (`None`: integrity off).
    fn mac(&mut self, header: &[u8; HEADER_LEN]) -> Option<FrameMac> {
        self.auth.as_mut().map(|a| a.start(header))
    }

    /// Writes one layer frame: the regions, or with compression the staged encoding.
    async fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        layer: u32,
        n_blocks: usize,
        k: &[R],
        v: &[R],
    ) -> Result<()> {
        let hdr = self.layer_header(layer, n_blocks);
        let mac = self.mac(&hdr);
        if self.injecting() {
            let stage = std::mem::take(&mut self.stage);
            let compressed: [&[u8]; 1] = [&stage];
            let (k, v): (&[&[u8]], Vec<&[u8]>) = if self.compression == Compression::None {
                (&[], k.iter().chain(v).map(AsRef::as_ref).collect())
            } else {
                (&compressed, Vec::new())
            };
            let r = match mac {
                Some(mut m) => {
                    m.update_all(k);
                    m.update_all(&v);
                    let t = m.finish();
                    self.write_with_trailer(&hdr, k, &v, Some(t)).await
                }
                None => self.write_with_trailer(&hdr, k, &v, None).await,
            };
            self.stage = stage;
            return r;
        }
        if self.compression == Compression::None {
            self.io.write_layer_mac(&hdr, k, v, mac).await
        } else {
            let body: [&[u8]; 1] = [&self.stage];
            self.io.write_layer_mac(&hdr, &body, &[], mac).await
        }
    }

    /// Records a layer written with result `r`, then fails fast when the receiver already
    /// rejected the transfer.
    async fn layer_sent(&mut self, layer: u32, r: Result<()>) -> Result<()> {
        self.poison(r)?;
        if let SendState::InTransfer { seen, sent, .. } = &mut self.state {
            if let Some(s) = seen.get_mut(layer as usize) {
                *s = true;
            }
            *sent += 1;
        }
        // Fail fast when the receiver already rejected the transfer.
        let mut reply = [0u8; HEADER_LEN];
        let early = self.io.poll_early_reply(&mut reply).await;
        match self.poison(early)? {
            false => Ok(()),
            true => {
                let r = self.read_verdict_body(&reply).await;
                self.state = SendState::Broken;
                self.io.shutdown_and_drain().await;
                match r? {
                    v if v.error.is_some() => Err(rejected(v)),
                    _ => Err(Error::malformed("VERDICT", "success before END")),
                }
            }
        }
    }

    async fn read_verdict_body(&mut self, hdr: &[u8; HEADER_LEN]) -> Result<Verdict> {
        let h = FrameHeader::decode(hdr)?;
        let n = Verdict::body_len(&h)?;
        let mut body = [0u8; crate::protocol::frame::VERDICT_FIXED_LEN + MAX_REASON_LEN];
        self.io
            .read_ctl(&mut body[..n], "reading the verdict")
            .await?;
        Verdict::decode_body(&body[..n])
    }

    pub(crate) async fn finish(&mut self) -> Result<TransferReceipt> {
        let layers = self.layout.layers();
        match &self.state {
            SendState::InTransfer { sent, .. } if *sent != layers => {
                // Caller mistake; the transfer stays open so the missing layers can follow.
                return Err(Error::MissingLayers {
                    received: *sent,
                    expected: layers,
                });
            }
            SendState::InTransfer { .. } => {}
            SendState::Idle => {
                return Err(Error::InvalidArgument("finish called before begin".into()))
            }
            SendState::Broken => return Err(Error::Broken),
        }
        let SendState::InTransfer {
            desc,
            sent,
            started,
            ..
        } = std::mem::replace(&mut self.state, SendState::Broken)
        else {
            return Err(Error::Internal("sender state changed unexpectedly".into()));
        };
        let body = encode_end(desc.request_id, sent);
        let (msg, n) = self.control_frame(TAG_END, &body);
        self.write_frame(&msg[..n], "sending END").await?;
        let mut reply = [0u8; HEADER_LEN];
        self.io.read_reply_header(&mut reply).await?;
        let v = self.read_verdict_body(&reply).await?;
        if v.error.is_some() {
            self.io.shutdown_and_drain().await;
            return Err(rejected(v));
        }
        if v.request_id != desc.request_id {
            return Err(Error::malformed("VERDICT", "request id differs"));
        }
        self.io.transfer_ended()?;
        self.state = SendState::Idle;
        Ok(TransferReceipt {
            payload_bytes: desc.payload_bytes(&self.layout),
            wire_bytes: desc.wire_bytes(&self.layout, self.compression),
            compression: self.compression,
            layers: sent,
            desc,
            elapsed: started.elapsed(),
        })
    }

    async fn abort_inner(&mut self, request_id: u64) -> Result<()> {
        let body = encode_abort(request_id, ErrorClass::Unavailable);
        let (msg, n) = self.control_frame(TAG_ABORT, &body);
        self.state = SendState::Broken;
        self.write_frame(&msg[..n], "sending ABORT").await
    }

    /// A 16-byte-body control frame (END, ABORT) with its MAC; the bytes to send are `..n`.
    fn control_frame(
        &mut self,
        tag: u8,
        body: &[u8; 16],
    ) -> ([u8; HEADER_LEN + 16 + MAC_LEN], usize) {
        let hdr = FrameHeader::new(tag, self.auth.is_some(), 0, 16).encode();
        let mut msg = [0u8; HEADER_LEN + 16 + MAC_LEN];
        msg[..HEADER_LEN].copy_from_slice(&hdr);
        msg[HEADER_LEN..HEADER_LEN + 16].copy_from_slice(body);
        match &mut self.auth {
            Some(auth) => {
                msg[HEADER_LEN + 16..].copy_from_slice(&tag_of(auth, &hdr, &[body]));
                (msg, msg.len())
            }
            None => (msg, HEADER_LEN + 16),
        }
    }

    /// Abandons the current transfer: the receiver releases its blocks. The connection is
    /// not reused afterwards.
    pub(crate) async fn abort(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, SendState::Broken) {
            SendState::InTransfer { desc, .. } => self.abort_inner(desc.request_id).await,
            SendState::Idle => Ok(()),
            SendState::Broken => Err(Error::Broken),
        }
    }
}

fn rejected(v: Verdict) -> Error {
    Error::Rejected {
        class: v.error.unwrap_or(ErrorClass::Internal),
        reason: v.reason,
    }
}

/// Receiver half of a stream connection (after the handshake).
#[derive(Debug)]
pub(crate) struct ReceiverCore<T> {
    pub(crate) io: T,
    layout: KvLayout,
    policy: ReceivePolicy,
    /// Verifies the sender's frame MACs (keys from the handshake).
    auth: FrameAuth,
    broken: bool,
    /// Staging buffer for compressed layers (grows to the largest one seen).
    stage: Vec<u8>,
}

impl<T: FrameTransport> ReceiverCore<T> {
    pub(crate) fn new(io: T, layout: KvLayout, auth: FrameAuth, require_mac: bool) -> Self {
        ReceiverCore {
            io,
            layout,
            policy: ReceivePolicy { require_mac },
            auth,
            broken: false,
            stage: Vec::new(),
        }
    }

    pub(crate) fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The transport (for backend-specific accessors).
    pub(crate) fn transport(&self) -> &T {
        &self.io
    }

    pub(crate) async fn receive<S: KvSink + Send>(
        &mut self,
        sink: &mut S,
    ) -> Result<TransferReceipt> {
        if self.broken {
            return Err(Error::Broken);
        }
        let result = receive_transfer(
            &mut self.io,
            &self.layout,
            sink,
            self.policy,
            &mut self.auth,
            &mut self.stage,
        )
        .await;
        match result {
            Ok(receipt) => {
                let v = Verdict {
                    request_id: receipt.desc.request_id,
                    error: None,
                    reason: String::new(),
                };
                if let Err(e) = self.io.write_ctl(&v.encode(), "sending the verdict").await {
                    self.broken = true;
                    tracing::warn!(error = %e, "kv transfer verdict could not be sent");
                    return Err(crate::protocol::tracker::aborted(
                        receipt.desc.request_id,
                        receipt.desc.dst_blocks,
                        e,
                    ));
                }
                tracing::debug!(
                    request_id = receipt.desc.request_id,
                    bytes = receipt.payload_bytes,
                    elapsed_us = receipt.elapsed.as_micros() as u64,
                    "kv transfer received"
                );
                Ok(receipt)
            }
            Err(e) if e.is_clean_close() => {
                self.broken = true;
                Err(e)
            }
            Err(e) => {
                self.broken = true;
                tracing::warn!(
                    error = %e,
                    cause = %e.root(),
                    class = e.class().label(),
                    release = ?e.blocks_to_release(),
                    "kv transfer failed"
                );
                let peer_gone = matches!(
                    e.root(),
                    Error::PeerClosed { .. } | Error::Io { .. } | Error::Timeout { .. }
                );
                if !peer_gone {
                    let request_id = match &e {
                        Error::Aborted { request_id, .. } => *request_id,
                        _ => 0,
                    };
                    let v = Verdict {
                        request_id,
                        error: Some(e.class()),
                        reason: e.root().to_string(),
                    };
                    if self
                        .io
                        .write_ctl(&v.encode(), "sending the verdict")
                        .await
                        .is_ok()
                    {
                        self.io.shutdown_and_drain().await;
                    }
                }
                Err(e)
            }
        }
    }
}
