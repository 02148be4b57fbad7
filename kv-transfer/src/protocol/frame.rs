//! Fixed-size encodings of frame headers and control bodies (pure functions, no I/O).
//!
//! Invariant: `FrameHeader::decode` accepts only known tags, known flag bits and zero reserved
//! bits, so every accepted header is one this crate could have produced.

use crate::error::{from_wire_code, wire_code, Error, ErrorClass, Result};
use crate::layout::MAX_BLOCKS_PER_TRANSFER;
use crate::protocol::compress::Compression;
pub(crate) use crate::protocol::integrity::MAC_LEN;
use crate::protocol::{HEADER_LEN, MAX_REASON_LEN};

pub(crate) const TAG_BEGIN: u8 = 0x01;
pub(crate) const TAG_LAYER: u8 = 0x02;
pub(crate) const TAG_END: u8 = 0x03;
pub(crate) const TAG_ABORT: u8 = 0x04;
pub(crate) const TAG_CHUNK: u8 = 0x05;
/// shm pull mode: the sender's region list for one layer (see `backend::shm`).
pub(crate) const TAG_PULL: u8 = 0x06;
pub(crate) const TAG_VERDICT: u8 = 0x81;
pub(crate) const TAG_CREDIT: u8 = 0x82;
/// shm pull mode: the receiver has copied the layer announced by the last PULL.
pub(crate) const TAG_PULLED: u8 = 0x83;

/// A MAC trailer ([`MAC_LEN`] bytes) follows the body.
pub(crate) const FLAG_MAC: u8 = 0x01;

pub(crate) const BEGIN_FIXED_LEN: usize = 24;
pub(crate) const END_LEN: usize = 16;
pub(crate) const ABORT_LEN: usize = 16;
pub(crate) const VERDICT_FIXED_LEN: usize = 16;

/// Largest BEGIN body.
pub(crate) const MAX_BEGIN_LEN: u64 = BEGIN_FIXED_LEN as u64 + 4 * MAX_BLOCKS_PER_TRANSFER as u64;

/// A decoded 16-byte frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub tag: u8,
    pub flags: u8,
    pub arg: u32,
    pub len: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

pub(crate) fn tag_name(tag: u8) -> &'static str {
    match tag {
        TAG_BEGIN => "BEGIN",
        TAG_LAYER => "LAYER",
        TAG_END => "END",
        TAG_ABORT => "ABORT",
        TAG_CHUNK => "CHUNK",
        TAG_PULL => "PULL",
        TAG_VERDICT => "VERDICT",
        TAG_CREDIT => "CREDIT",
        TAG_PULLED => "PULLED",
        _ => "unknown",
    }
}

impl FrameHeader {
    pub(crate) fn new(tag: u8, mac: bool, arg: u32, len: u64) -> Self {
        FrameHeader {
            tag,
            flags: if mac { FLAG_MAC } else { 0 },
            arg,
            len,
        }
    }

    /// Whether a MAC trailer follows the body.
    pub(crate) fn mac(&self) -> bool {
        self.flags & FLAG_MAC != 0
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.tag;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.arg.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self> {
        let tag = b[0];
        if tag_name(tag) == "unknown" {
            return Err(Error::malformed(
                "frame header",
                format!("unknown tag {tag:#04x}"),
            ));
        }
        let flags = b[1];
        if flags & !FLAG_MAC != 0 {
            return Err(Error::malformed(
                "frame header",
                format!("unknown flag bits {flags:#04x}"),
            ));
        }
        if b[2] != 0 || b[3] != 0 {
            return Err(Error::malformed("frame header", "reserved bytes not zero"));
        }
        Ok(FrameHeader {
            tag,
            flags,
            arg: u32_at(b, 4),
            len: u64_at(b, 8),
        })
    }
}

/// Fixed part of a BEGIN body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BeginFixed {
    pub request_id: u64,
    pub token_start: u32,
    pub token_count: u32,
    pub n_blocks: u32,
    /// Encoding of every LAYER payload of the transfer.
    pub compression: Compression,
}

impl BeginFixed {
    pub(crate) fn encode(&self) -> [u8; BEGIN_FIXED_LEN] {
        let mut b = [0u8; BEGIN_FIXED_LEN];
        b[0..8].copy_from_slice(&self.request_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.token_start.to_le_bytes());
        b[12..16].copy_from_slice(&self.token_count.to_le_bytes());
        b[16..20].copy_from_slice(&self.n_blocks.to_le_bytes());
        b[20] = self.compression.wire();
        b
    }

    pub(crate) fn decode(b: &[u8; BEGIN_FIXED_LEN]) -> Result<Self> {
        if b[21..24].iter().any(|&x| x != 0) {
            return Err(Error::malformed("BEGIN", "reserved field not zero"));
        }
        let compression = Compression::from_wire(b[20]).ok_or_else(|| {
            Error::malformed("BEGIN", format!("unknown compression code {}", b[20]))
        })?;
        Ok(BeginFixed {
            compression,
            request_id: u64_at(b, 0),
            token_start: u32_at(b, 8),
            token_count: u32_at(b, 12),
            n_blocks: u32_at(b, 16),
        })
    }
}

pub(crate) fn encode_block_ids(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|b| b.to_le_bytes()).collect()
}

pub(crate) fn decode_block_ids(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32_at(c, 0)).collect()
}

pub(crate) fn encode_end(request_id: u64, layers: u32) -> [u8; END_LEN] {
    let mut b = [0u8; END_LEN];
    b[0..8].copy_from_slice(&request_id.to_le_bytes());
    b[8..12].copy_from_slice(&layers.to_le_bytes());
    b
}

pub(crate) fn decode_end(b: &[u8; END_LEN]) -> Result<(u64, u32)> {
    if u32_at(b, 12) != 0 {
        return Err(Error::malformed("END", "reserved field not zero"));
    }
    Ok((u64_at(b, 0), u32_at(b, 8)))
}

pub(crate) fn encode_abort(request_id: u64, class: ErrorClass) -> [u8; ABORT_LEN] {
    let mut b = [0u8; ABORT_LEN];
    b[0..8].copy_from_slice(&request_id.to_le_bytes());
    b[8] = wire_code(class);
    b
}

pub(crate) fn decode_abort(b: &[u8; ABORT_LEN]) -> (u64, ErrorClass) {
    (u64_at(b, 0), from_wire_code(b[8]))
}

/// A receiver's answer to one transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub request_id: u64,
    /// `None` = success.
    pub error: Option<ErrorClass>,
    pub reason: String,
}

/// Truncates `s` to at most `max` bytes at a char boundary.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Verdict {
    /// Encodes header + body (no MAC: see `docs/security.md` for what a forged verdict can do).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let reason = truncate_utf8(&self.reason, MAX_REASON_LEN).as_bytes();
        let len = VERDICT_FIXED_LEN + reason.len();
        let mut out = Vec::with_capacity(HEADER_LEN + len);
        out.extend_from_slice(&FrameHeader::new(TAG_VERDICT, false, 0, len as u64).encode());
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.push(self.error.map_or(0, wire_code));
        out.push(0);
        out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        out.extend_from_slice(reason);
        out
    }

    /// Checks a VERDICT header's length; returns the body length to read.
    pub(crate) fn body_len(h: &FrameHeader) -> Result<usize> {
        if h.tag != TAG_VERDICT {
            return Err(Error::UnexpectedFrame {
                expected: "VERDICT",
                tag: h.tag,
            });
        }
        if h.mac() || h.arg != 0 {
            return Err(Error::malformed("VERDICT", "flags/arg must be zero"));
        }
        let max = (VERDICT_FIXED_LEN + MAX_REASON_LEN) as u64;
        if h.len < VERDICT_FIXED_LEN as u64 || h.len > max {
            return Err(Error::Oversized {
                what: "VERDICT body",
                len: h.len,
                limit: max,
            });
        }
        Ok(h.len as usize)
    }

    pub(crate) fn decode_body(b: &[u8]) -> Result<Verdict> {
        if b.len() < VERDICT_FIXED_LEN {
            return Err(Error::malformed("VERDICT", "body too short"));
        }
        let reason_len = usize::from(u16::from_le_bytes([b[10], b[11]]));
        if VERDICT_FIXED_LEN + reason_len != b.len() {
            return Err(Error::malformed(
                "VERDICT",
                "reason length disagrees with frame",
            ));
        }
        let reason = String::from_utf8_lossy(&b[VERDICT_FIXED_LEN..]).into_owned();
        Ok(Verdict {
            request_id: u64_at(b, 0),
            error: match b[8] {
                0 => None,
                c => Some(from_wire_code(c)),
            },
            reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejects() {
        let h = FrameHeader::new(TAG_LAYER, true, 7, 1 << 40);
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] = 0x42;
        assert!(FrameHeader::decode(&b).is_err());
        let mut b = h.encode();
        b[1] = 0x80;
        assert!(FrameHeader::decode(&b).is_err());
        let mut b = h.encode();
        b[3] = 1;
        assert!(FrameHeader::decode(&b).is_err());
    }

    #[test]
    fn verdict_round_trip_truncates_reason() {
        let v = Verdict {
            request_id: 9,
            error: Some(ErrorClass::NotFound),
            reason: "é".repeat(300),
        };
        let enc = v.encode();
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&enc[..HEADER_LEN]);
        let h = FrameHeader::decode(&hb).unwrap();
        let n = Verdict::body_len(&h).unwrap();
        let back = Verdict::decode_body(&enc[HEADER_LEN..HEADER_LEN + n]).unwrap();
        assert_eq!(back.request_id, 9);
        assert_eq!(back.error, Some(ErrorClass::NotFound));
        assert!(back.reason.len() <= MAX_REASON_LEN);
        assert!(back.reason.chars().all(|c| c == 'é'));
    }
}
