//! The frame decoder: reads one transfer from a [`FrameTransport`] straight into a [`KvSink`].
//!
//! Invariants:
//! - no sink region is requested before BEGIN validated and every block is reserved;
//! - an uncompressed region is filled by reading exactly `region_bytes` payload bytes into the
//!   slice the sink returned (no staging buffer); a compressed layer is read into one
//!   per-connection staging buffer, MAC-checked, then decoded region by region into the
//!   sink's slices; either way nothing outside reserved regions is written;
//! - with MACs on, a frame is acted on only after its MAC verified: BEGIN before any block
//!   is looked up, END before the transfer is reported complete; a LAYER's bytes land in the
//!   transfer's own reserved blocks as they arrive (hashed in groups of [`MAC_GROUP_BYTES`]
//!   while they are in cache) and the layer counts as received only after its MAC verified,
//!   so a bad MAC fails the transfer and its blocks go back unused (no sequence reads a
//!   reserved block before the whole transfer verified);
//! - the only allocations are per transfer (block list, layer bitmap) and the staging
//!   buffer growing to the largest compressed layer seen, none per frame;
//! - any failure after the request id is known is returned as [`Error::Aborted`].

use std::time::Instant;

use crate::api::TransferReceipt;
use crate::error::{Error, ErrorClass, Result, SinkError};
use crate::layout::{KvKind, KvLayout, TransferDesc};
use crate::protocol::compress::{decode_region, Compression};
use crate::protocol::frame::{
    decode_abort, decode_block_ids, decode_end, tag_name, BeginFixed, FrameHeader, ABORT_LEN,
    BEGIN_FIXED_LEN, END_LEN, MAC_LEN, MAX_BEGIN_LEN, TAG_ABORT, TAG_BEGIN, TAG_END, TAG_LAYER,
};
use crate::protocol::integrity::{FrameAuth, FrameMac};
use crate::protocol::tracker::{aborted, Tracker};
use crate::protocol::transport::FrameTransport;
use crate::protocol::HEADER_LEN;
use crate::sink::KvSink;

/// Payload bytes read between two MAC updates: small enough to stay in a core's L2 cache
/// from the copy into the pool to the hash.
pub(crate) const MAC_GROUP_BYTES: usize = 256 << 10;

/// Receiver policy.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReceivePolicy {
    /// Refuse transfers whose frames carry no MAC.
    pub require_mac: bool,
}

/// Reads a frame's MAC trailer and checks it against `mac` (when the frame carries one).
async fn check_trailer<T: FrameTransport>(
    io: &mut T,
    frame: &'static str,
    mac: Option<FrameMac>,
) -> Result<()> {
    let Some(mac) = mac else { return Ok(()) };
    let mut t = [0u8; MAC_LEN];
    io.read_ctl(&mut t, "reading a MAC trailer").await?;
    mac.verify(frame, &t)
}

/// The MAC of the frame `hdr` heads, when it carries one.
fn start(auth: &mut FrameAuth, h: &FrameHeader, hdr: &[u8; HEADER_LEN]) -> Option<FrameMac> {
    h.mac().then(|| auth.start(hdr))
}

/// Reads one whole transfer. `Err(PeerClosed { during: IDLE })` means the peer closed the
/// connection cleanly before starting another transfer.
pub(crate) async fn receive_transfer<T: FrameTransport, S: KvSink + Send>(
    io: &mut T,
    layout: &KvLayout,
    sink: &mut S,
    policy: ReceivePolicy,
    auth: &mut FrameAuth,
    stage: &mut Vec<u8>,
) -> Result<TransferReceipt> {
    let mut hdr = [0u8; HEADER_LEN];
    io.read_idle(&mut hdr).await?;
    let started = Instant::now();
    let h = FrameHeader::decode(&hdr)?;
    if h.tag != TAG_BEGIN {
        return Err(Error::UnexpectedFrame {
            expected: "BEGIN",
            tag: h.tag,
        });
    }
    if h.arg != 0 {
        return Err(Error::malformed("BEGIN", "arg must be zero"));
    }
    if h.len < BEGIN_FIXED_LEN as u64 || h.len > MAX_BEGIN_LEN {
        return Err(Error::Oversized {
            what: "BEGIN body",
            len: h.len,
            limit: MAX_BEGIN_LEN,
        });
    }
    let mac_on = h.mac();
    let mut fixed = [0u8; BEGIN_FIXED_LEN];
    io.read_ctl(&mut fixed, "reading BEGIN").await?;
    let f = BeginFixed::decode(&fixed)?;
    let ids_len = 4 * u64::from(f.n_blocks);
    if h.len != BEGIN_FIXED_LEN as u64 + ids_len {
        return Err(Error::malformed(
            "BEGIN",
            format!("{} blocks disagree with body length {}", f.n_blocks, h.len),
        ));
    }
    // Bounded by MAX_BEGIN_LEN checked above.
    let mut ids = vec![0u8; ids_len as usize];
    io.read_ctl(&mut ids, "reading BEGIN block list").await?;
    let mut mac = start(auth, &h, &hdr);
    if let Some(m) = &mut mac {
        m.update(&fixed);
        m.update(&ids);
    }
    check_trailer(io, "BEGIN", mac).await?;
    let desc = TransferDesc {
        request_id: f.request_id,
        token_start: f.token_start,
        token_count: f.token_count,
        dst_blocks: decode_block_ids(&ids),
    };
    drop(ids);
    if policy.require_mac && !mac_on {
        let e = Error::malformed(
            "BEGIN",
            "receiver requires frame MACs (the sender runs with --kv-integrity off)",
        );
        return Err(aborted(desc.request_id, Vec::new(), e));
    }
    let mut tracker = Tracker::accept(layout, desc, &mut *sink)?;
    let frames = Frames { mac_on, auth };
    match receive_layers(io, layout, sink, &mut tracker, frames, f.compression, stage).await {
        Ok(()) => Ok(TransferReceipt {
            payload_bytes: tracker.desc.payload_bytes(layout),
            wire_bytes: tracker.desc.wire_bytes(layout, f.compression),
            compression: f.compression,
            layers: tracker.received(),
            desc: tracker.desc,
            elapsed: started.elapsed(),
        }),
        Err(e) => Err(tracker.abort(e)),
    }
}

/// Empties `v` and reuses its allocation for slices of another lifetime: `collect` of a
/// `vec::IntoIter` adapter into a same-layout element type happens in place, so no
/// allocation is made per layer frame.
#[allow(clippy::unnecessary_filter_map)] // `filter` cannot change the element lifetime
fn recycle<'b>(mut v: Vec<&mut [u8]>) -> Vec<&'b mut [u8]> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

fn bad_region(what: &str, got: usize) -> Error {
    Error::Sink(SinkError::new(
        ErrorClass::Internal,
        format!("sink returned a wrong {what} ({got}) for the layout"),
    ))
}

/// How the frames after BEGIN are authenticated.
struct Frames<'a> {
    /// Whether BEGIN carried a MAC (every later frame must match).
    mac_on: bool,
    auth: &'a mut FrameAuth,
}

/// Decodes a compressed LAYER body (`stage`, already read and MAC-checked) region by region
/// into the sink's blocks.
fn decode_layer<S: KvSink>(
    layout: &KvLayout,
    sink: &mut S,
    blocks: &[u32],
    layer: u32,
    compression: Compression,
    stage: &[u8],
) -> Result<()> {
    let region_len = layout.region_bytes();
    let mut src = stage.chunks_exact(compression.region_wire_bytes(layout));
    for kind in KvKind::ORDER {
        for &block in blocks {
            let enc = src
                .next()
                .ok_or_else(|| Error::Internal("compressed layer shorter than planned".into()))?;
            let dst = sink.region_mut(layer, kind, block).map_err(Error::Sink)?;
            if dst.len() != region_len {
                return Err(bad_region("region size", dst.len()));
            }
            decode_region(compression, layout, enc, dst)?;
        }
    }
    Ok(())
}

async fn receive_layers<T: FrameTransport, S: KvSink + Send>(
    io: &mut T,
    layout: &KvLayout,
    sink: &mut S,
    tracker: &mut Tracker,
    frames: Frames<'_>,
    compression: Compression,
    stage: &mut Vec<u8>,
) -> Result<()> {
    let Frames { mac_on, auth } = frames;
    let region_len = layout.region_bytes();
    let frame_len = compression.layer_wire_bytes(layout, tracker.desc.dst_blocks.len());
    let request_id = tracker.desc.request_id;
    let mut hdr = [0u8; HEADER_LEN];
    // Reused (never reallocated after the first layer) list of region slices.
    let mut spare: Vec<&'static mut [u8]> = Vec::new();
    loop {
        io.read_ctl(&mut hdr, "reading a frame header").await?;
        let h = FrameHeader::decode(&hdr)?;
        if h.mac() != mac_on {
            return Err(Error::malformed(
                tag_name(h.tag),
                "MAC flag differs from BEGIN's",
            ));
        }
        let mut mac = start(auth, &h, &hdr);
        match h.tag {
            TAG_LAYER => {
                let layer = h.arg;
                tracker.start_layer(layer)?;
                if h.len != frame_len {
                    return Err(Error::Oversized {
                        what: "LAYER payload",
                        len: h.len,
                        limit: frame_len,
                    });
                }
                io.begin_payload(frame_len).await?;
                if compression != Compression::None {
                    // Read whole and checked first: a corrupted frame (MAC on) never reaches
                    // the sink. Bounded: the length was checked against the reserved blocks.
                    stage.resize(frame_len as usize, 0);
                    io.read_payload(stage).await?;
                    if let Some(m) = &mut mac {
                        m.update(stage);
                    }
                    check_trailer(io, "LAYER", mac).await?;
                    let blocks = &tracker.desc.dst_blocks;
                    decode_layer(layout, sink, blocks, layer, compression, stage)?;
                    tracker.finish_layer(layer);
                    sink.layer_done(request_id, layer);
                    continue;
                }
                // Regions per MAC group: hashed right after they were read, while in cache.
                let group = (MAC_GROUP_BYTES / region_len.max(1)).max(1);
                for kind in KvKind::ORDER {
                    let mut batch = recycle(std::mem::take(&mut spare));
                    let batched = sink
                        .regions_mut(layer, kind, &tracker.desc.dst_blocks, &mut batch)
                        .map_err(Error::Sink)?;
                    if batched {
                        if batch.len() != tracker.desc.dst_blocks.len() {
                            return Err(bad_region("region count", batch.len()));
                        }
                        if let Some(r) = batch.iter().find(|r| r.len() != region_len) {
                            return Err(bad_region("region size", r.len()));
                        }
                        for g in batch.chunks_mut(group) {
                            io.read_payload_vectored(g).await?;
                            if let Some(m) = &mut mac {
                                m.update_all(g);
                            }
                        }
                        spare = recycle(batch);
                        continue;
                    }
                    for &block in &tracker.desc.dst_blocks {
                        let dst = sink.region_mut(layer, kind, block).map_err(Error::Sink)?;
                        if dst.len() != region_len {
                            return Err(bad_region("region size", dst.len()));
                        }
                        io.read_payload(dst).await?;
                        if let Some(m) = &mut mac {
                            m.update(dst);
                        }
                    }
                }
                check_trailer(io, "LAYER", mac).await?;
                tracker.finish_layer(layer);
                sink.layer_done(request_id, layer);
            }
            TAG_END => {
                if h.len != END_LEN as u64 || h.arg != 0 {
                    return Err(Error::malformed("END", "bad length or arg"));
                }
                let mut body = [0u8; END_LEN];
                io.read_ctl(&mut body, "reading END").await?;
                if let Some(m) = &mut mac {
                    m.update(&body);
                }
                check_trailer(io, "END", mac).await?;
                let (rid, layers_sent) = decode_end(&body)?;
                return tracker.end(rid, layers_sent);
            }
            TAG_ABORT => {
                if h.len != ABORT_LEN as u64 {
                    return Err(Error::malformed("ABORT", "bad length"));
                }
                let mut body = [0u8; ABORT_LEN];
                io.read_ctl(&mut body, "reading ABORT").await?;
                if let Some(m) = &mut mac {
                    m.update(&body);
                }
                check_trailer(io, "ABORT", mac).await?;
                let (_, class) = decode_abort(&body);
                return Err(Error::SenderAborted { class });
            }
            other => {
                return Err(Error::UnexpectedFrame {
                    expected: "LAYER, END or ABORT",
                    tag: other,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::recycle;

    #[test]
    fn recycle_keeps_the_allocation() {
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let v: Vec<&mut [u8]> = vec![&mut a[..], &mut b[..]];
        let (ptr, cap) = (v.as_ptr() as usize, v.capacity());
        let r = recycle(v);
        assert!(r.is_empty());
        assert_eq!((r.as_ptr() as usize, r.capacity()), (ptr, cap));
    }
}
