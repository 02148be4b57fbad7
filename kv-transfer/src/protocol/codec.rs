//! Synchronous, in-memory encoder and decoder for one transfer's frames (the byte stream
//! after the handshake). They run exactly the code the network backends run, over a
//! transport that reads from a slice; used by property tests, the fuzz target and tools.
//!
//! Invariant: `decode_transfer` never panics and never blocks, whatever `bytes` holds.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use crate::api::TransferReceipt;
use crate::error::{Error, Result};
use crate::layout::{KvLayout, TransferDesc};
use crate::protocol::compress::Compression;
use crate::protocol::frame::{encode_end, FrameHeader, END_LEN, TAG_END};
use crate::protocol::integrity::{tag_of, FrameAuth, SessionKey};
use crate::protocol::receive::{receive_transfer, ReceivePolicy};
use crate::protocol::send::SenderCore;
use crate::protocol::transport::SliceTransport;
use crate::sink::KvSink;

/// Runs a future that never waits (all its I/O is in memory) to completion.
fn run_ready<F: Future>(f: F) -> Result<F::Output> {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => Ok(v),
        Poll::Pending => Err(Error::Internal("in-memory codec future pended".into())),
    }
}

/// One layer's regions for [`encode_transfer`].
#[derive(Debug, Clone)]
pub struct LayerRegions<'a> {
    /// Layer index.
    pub layer: u32,
    /// K regions, one per destination block, in block-list order.
    pub k: Vec<&'a [u8]>,
    /// V regions, one per destination block, in block-list order.
    pub v: Vec<&'a [u8]>,
}

/// Encodes BEGIN, the given layers (in the given order) and END; with `mac`, every frame
/// carries its MAC under [`SessionKey::for_codec`] (the codec has no handshake), exactly as a
/// connection's first transfer would.
pub fn encode_transfer(
    layout: &KvLayout,
    desc: &TransferDesc,
    layers: &[LayerRegions<'_>],
    mac: bool,
) -> Result<Vec<u8>> {
    encode_transfer_compressed(layout, desc, layers, mac, Compression::None)
}

/// [`encode_transfer`] with the layers encoded by `compression`.
pub fn encode_transfer_compressed(
    layout: &KvLayout,
    desc: &TransferDesc,
    layers: &[LayerRegions<'_>],
    mac: bool,
    compression: Compression,
) -> Result<Vec<u8>> {
    let empty: &[u8] = &[];
    let auth = mac.then(|| FrameAuth::new(&SessionKey::for_codec()));
    let mut core = SenderCore::new(SliceTransport::new(empty), *layout, auth.clone())
        .with_compression(compression);
    run_ready(async {
        core.begin(desc.clone()).await?;
        for l in layers {
            core.send_layer(l.layer, &l.k, &l.v).await?;
        }
        Ok::<(), Error>(())
    })??;
    // END without waiting for a verdict (there is no receiver here), under the next frame
    // key: BEGIN and one per layer went before it.
    let mut out = std::mem::take(&mut core.io.output);
    let mac_on = auth.is_some();
    let hdr = FrameHeader::new(TAG_END, mac_on, 0, END_LEN as u64).encode();
    let body = encode_end(desc.request_id, layers.len() as u32);
    out.extend_from_slice(&hdr);
    out.extend_from_slice(&body);
    if let Some(mut auth) = auth {
        for _ in 0..=layers.len() {
            auth.start(&hdr);
        }
        out.extend_from_slice(&tag_of(&mut auth, &hdr, &[&body]));
    }
    Ok(out)
}

/// Decodes one transfer from `bytes` into `sink`, exactly as a network receiver would on a
/// connection keyed with [`SessionKey::for_codec`]; `require_mac` refuses frames without.
pub fn decode_transfer<S: KvSink + Send>(
    layout: &KvLayout,
    bytes: &[u8],
    sink: &mut S,
    require_mac: bool,
) -> Result<TransferReceipt> {
    let mut io = SliceTransport::new(bytes);
    let mut auth = FrameAuth::new(&SessionKey::for_codec());
    run_ready(receive_transfer(
        &mut io,
        layout,
        sink,
        ReceivePolicy { require_mac },
        &mut auth,
        &mut Vec::new(),
    ))?
}
