//! Each kind of bad input to the frame decoder yields its typed error, and nothing is written
//! outside the reserved blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_kv_transfer::protocol::{decode_transfer, MAC_LEN};
use duet_kv_transfer::{Error, ErrorClass, KvLayout, MemorySink, TransferDesc};

const REQ: u64 = 42;

fn desc() -> TransferDesc {
    TransferDesc {
        request_id: REQ,
        token_start: 0,
        token_count: 7,
        dst_blocks: vec![5, 2],
    }
}

fn sink(layout: KvLayout) -> MemorySink {
    let mut s = MemorySink::new(layout, 8);
    s.reserve(REQ, &[5, 2]).unwrap();
    s
}

fn begin_len(d: &TransferDesc, mac: bool) -> usize {
    16 + 24 + 4 * d.dst_blocks.len() + if mac { MAC_LEN } else { 0 }
}

fn layer_len(l: &KvLayout, d: &TransferDesc, mac: bool) -> usize {
    16 + l.layer_frame_bytes(d.dst_blocks.len()) as usize + if mac { MAC_LEN } else { 0 }
}

fn decode(layout: KvLayout, bytes: &[u8]) -> (Result<(), Error>, MemorySink) {
    let mut s = sink(layout);
    let r = decode_transfer(&layout, bytes, &mut s, false).map(|_| ());
    for b in [0, 1, 3, 4, 6, 7] {
        common::assert_untouched(&s, &layout, b);
    }
    (r, s)
}

#[test]
fn valid_stream_decodes() {
    let l = common::small_layout();
    let bytes = common::encode_layers(&l, &desc(), &[0, 1, 2], true);
    let (r, s) = decode(l, &bytes);
    r.unwrap();
    common::assert_landed(&s, &l, REQ, &[5, 2]);
}

#[test]
fn never_reserved_blocks_are_refused_before_any_write() {
    let l = common::small_layout();
    let mut d = desc();
    d.dst_blocks = vec![5, 3]; // 3 is not reserved
    let bytes = common::encode_layers(&l, &d, &[0, 1, 2], false);
    let (r, s) = decode(l, &bytes);
    let e = r.unwrap_err();
    assert!(
        matches!(
            e.root(),
            Error::BlockNotReserved {
                request_id: REQ,
                block: 3
            }
        ),
        "{e}"
    );
    assert_eq!(e.class(), ErrorClass::NotFound);
    assert_eq!(e.blocks_to_release(), &[5]); // the named block that is reserved
    assert_eq!(s.regions_handed_out, 0);
}

#[test]
fn blocks_of_another_request_are_refused() {
    let l = common::small_layout();
    let mut d = desc();
    d.request_id = REQ + 1;
    let bytes = common::encode_layers(&l, &d, &[0, 1, 2], false);
    let (r, s) = decode(l, &bytes);
    assert!(matches!(
        r.unwrap_err().root(),
        Error::BlockNotReserved { .. }
    ));
    assert_eq!(s.regions_handed_out, 0);
}

#[test]
fn layer_out_of_range() {
    let l = common::small_layout();
    let d = desc();
    let mut bytes = common::encode_layers(&l, &d, &[0, 1, 2], false);
    let at = begin_len(&d, false) + 4;
    bytes[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    let (r, _) = decode(l, &bytes);
    let e = r.unwrap_err();
    assert!(
        matches!(
            e.root(),
            Error::LayerOutOfRange {
                layer: 99,
                layers: 3
            }
        ),
        "{e}"
    );
    let mut release = e.blocks_to_release().to_vec();
    release.sort_unstable();
    assert_eq!(release, vec![2, 5]);
}

#[test]
fn duplicate_layer() {
    let l = common::small_layout();
    let d = desc();
    let mut bytes = common::encode_layers(&l, &d, &[0, 1, 2], false);
    let at = begin_len(&d, false) + layer_len(&l, &d, false) + 4;
    bytes[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
    let (r, _) = decode(l, &bytes);
    assert!(matches!(
        r.unwrap_err().root(),
        Error::DuplicateLayer { layer: 0 }
    ));
}

#[test]
fn oversized_layer_length() {
    let l = common::small_layout();
    let d = desc();
    let mut bytes = common::encode_layers(&l, &d, &[0, 1, 2], false);
    let at = begin_len(&d, false) + 8;
    bytes[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (r, s) = decode(l, &bytes);
    let e = r.unwrap_err();
    assert!(matches!(e.root(), Error::Oversized { .. }), "{e}");
    assert_eq!(e.class(), ErrorClass::ResourceExhausted);
    assert_eq!(s.regions_handed_out, 0);
}

#[test]
fn oversized_block_list() {
    let l = common::small_layout();
    let mut bytes = vec![1u8, 0, 0, 0, 0, 0, 0, 0];
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    let (r, _) = decode(l, &bytes);
    assert!(matches!(
        r.unwrap_err(),
        Error::Oversized {
            what: "BEGIN body",
            ..
        }
    ));
}

#[test]
fn truncated_stream() {
    let l = common::small_layout();
    let d = desc();
    let bytes = common::encode_layers(&l, &d, &[0, 1, 2], true);
    let cut = begin_len(&d, true) + 100;
    let (r, _) = decode(l, &bytes[..cut]);
    let e = r.unwrap_err();
    assert!(matches!(e.root(), Error::PeerClosed { .. }), "{e}");
    assert_eq!(e.class(), ErrorClass::Unavailable);
    assert_eq!(e.blocks_to_release().len(), 2);
}

#[test]
fn corrupted_payload_fails_the_mac() {
    let l = common::small_layout();
    let d = desc();
    let mut bytes = common::encode_layers(&l, &d, &[0, 1, 2], true);
    let at = begin_len(&d, true) + 16 + 10;
    bytes[at] ^= 0x40;
    let (r, _) = decode(l, &bytes);
    let e = r.unwrap_err();
    assert!(matches!(e.root(), Error::BadMac { frame: "LAYER" }), "{e}");
}

#[test]
fn missing_layers() {
    let l = common::small_layout();
    let bytes = common::encode_layers(&l, &desc(), &[0, 2], false);
    let (r, _) = decode(l, &bytes);
    assert!(matches!(
        r.unwrap_err().root(),
        Error::MissingLayers {
            received: 2,
            expected: 3
        }
    ));
}

#[test]
fn garbage_and_unknown_tags() {
    let l = common::small_layout();
    let (r, _) = decode(l, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(matches!(r.unwrap_err(), Error::Malformed { .. }));
    let (r, _) = decode(l, &[]);
    assert!(r.unwrap_err().is_clean_close());
}

#[test]
fn checksum_required_by_receiver() {
    let l = common::small_layout();
    let bytes = common::encode_layers(&l, &desc(), &[0, 1, 2], false);
    let mut s = sink(l);
    let e = decode_transfer(&l, &bytes, &mut s, true).unwrap_err();
    assert!(matches!(e.root(), Error::Malformed { .. }), "{e}");
    assert_eq!(s.regions_handed_out, 0);
}

#[test]
fn wrong_block_count_for_tokens() {
    let l = common::small_layout();
    let mut d = desc();
    d.token_count = 100; // needs 25 blocks of 4, header lists 2
    let bytes = {
        // The encoder refuses this descriptor, so build BEGIN by hand.
        let mut b = vec![1u8, 0, 0, 0, 0, 0, 0, 0];
        b.extend_from_slice(&(24u64 + 8).to_le_bytes());
        b.extend_from_slice(&REQ.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&100u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&5u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b
    };
    let (r, s) = decode(l, &bytes);
    assert!(matches!(r.unwrap_err().root(), Error::Malformed { .. }));
    assert_eq!(s.regions_handed_out, 0);
}
