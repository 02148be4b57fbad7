//! The duet KV-transfer wire protocol, version 2. All integers are little-endian.
//!
//! # Connection handshake
//!
//! The sender (prefill side) connects; the receiver (decode side) accepts.
//!
//! ```text
//! Layout (56 bytes)             Hello (96 bytes, sender -> receiver)
//!  0 fingerprint [u8; 32]         0 magic  "DKVT"
//! 32 layers      u32              4 version u16 = 1      \ bytes 0..8 keep this meaning
//! 36 kv_heads    u32              6 flags   u16 (0)      / in every future version
//! 40 head_dim    u32              8 layout  [56]
//! 44 block_size  u32             64 nonce   [u8; 32]   (client nonce)
//! 48 dtype u8 (1 = f32, 2 = f16)
//! 49 reserved [u8; 7] = 0       ServerHello (128 bytes, receiver -> sender)
//!                                 0..96 as Hello, with the receiver's layout and nonce
//!                                96 mac [u8; 32] = HMAC-SHA256(secret,
//!                                      "duet-kv-transfer/2 server" || Hello || ServerHello[0..96])
//! ClientAuth (32 bytes, sender -> receiver)
//!   mac = HMAC-SHA256(secret, "duet-kv-transfer/2 client" || Hello || ServerHello)
//! Verdict (8 bytes, receiver -> sender)
//!   "DKVT", status u8 (0 ok, 1 unauthenticated, 2 layout mismatch), reserved [u8; 3]
//! ```
//!
//! A receiver that does not speak the sender's version answers only the 8-byte prefix
//! (`"DKVT"`, its version, flags = `0x8000`) and closes. Each side verifies the other's MAC in
//! constant time; a receiver hands out no sink region before the sender's MAC verified and
//! the layouts compared equal. Both sides report a layout mismatch naming both values.
//!
//! # Transfer frames (after the handshake)
//!
//! Every frame starts with a 16-byte header:
//!
//! ```text
//!  0 tag   u8    0x01 BEGIN, 0x02 LAYER, 0x03 END, 0x04 ABORT, 0x05 CHUNK (shm)
//!                0x81 VERDICT, 0x82 CREDIT (shm)            (receiver -> sender)
//!  1 flags u8    bit 0: a 16-byte MAC trailer follows the body; other bits must be 0
//!  2 rsv   u16   must be 0
//!  4 arg   u32   LAYER: layer index; CHUNK/CREDIT: slot; otherwise 0
//!  8 len   u64   body length in bytes (LAYER: payload length; CHUNK: bytes in the slot)
//! ```
//!
//! The MAC trailer, when flagged, covers the header and the whole body under a key of its
//! own per frame (see [`integrity`]: NH-Poly1305 under keys derived from the handshake's
//! session key and the frame's index on the connection). The sender chooses the flag in BEGIN
//! (`--kv-integrity`) and must keep it on every frame of that transfer; a receiver that
//! requires MACs refuses a BEGIN without. Transport-internal frames (CHUNK, CREDIT, PULL,
//! PULLED) and VERDICT carry no MAC: the payload they move is covered by its LAYER's MAC.
//!
//! ```text
//! BEGIN   body (24 + 4n): request_id u64, token_start u32, token_count u32, n_blocks u32,
//!         compression u8 (0 none, 1 f16, 2 int8), reserved [u8; 3] = 0, then n destination
//!         block ids (u32) reserved by the receiver.
//! LAYER   body = 2 * n * wire region: the K regions of every block in block-list order,
//!         then the V regions in the same order (region = [kv_head][slot][head_dim]), each
//!         encoded as BEGIN's compression says (see [`compress`]; `none` = region_bytes).
//! END     body (16): request_id u64, layers_sent u32, reserved u32 = 0.
//! ABORT   body (16): request_id u64, error class u8, reserved [u8; 7].
//! VERDICT body (16 + r): request_id u64, status u8 (0 ok, else error class),
//!         reserved u8, reason_len u16 (= r <= 256), reserved u32, then r bytes of UTF-8.
//! CHUNK   no body on the socket: `len` bytes of the current LAYER payload are in shm slot
//!         `arg` (shm backend only; slots are used round robin).
//! CREDIT  no body: slot `arg` may be reused (shm backend only).
//! ```
//!
//! A transfer is BEGIN, exactly one LAYER per layer in any order, then END; the receiver
//! answers one VERDICT. The sender may send ABORT instead of the remaining frames.
//!
//! # Limits and decoder guarantees
//!
//! - `n_blocks <= MAX_BLOCKS_PER_TRANSFER` and must equal `ceil(token_count / block_size)`;
//!   block ids must be distinct and reserved at the receiver for `request_id`.
//! - A LAYER `len` must equal `compression.layer_wire_bytes(layout, n)` (for `none`,
//!   `layout.layer_frame_bytes(n)`); its index must be below `layers`.
//! - A compressed LAYER is read whole into one per-connection staging buffer and checked
//!   (MAC) before any region is decoded into the sink; an uncompressed one is read straight
//!   into the sink's regions.
//! - A VERDICT reason is at most [`MAX_REASON_LEN`] bytes.
//! - The decoder never allocates from an untrusted length except the block list, which is
//!   bounded by the limit above; it never panics and only writes into regions the sink hands
//!   out for blocks it confirmed as reserved.

pub(crate) mod codec;
pub mod compress;
#[cfg(feature = "fault-injection")]
pub mod faults;
pub(crate) mod frame;
pub mod integrity;
pub(crate) mod nh;
pub(crate) mod receive;
pub(crate) mod send;
pub(crate) mod tracker;
pub(crate) mod transport;

pub use codec::{decode_transfer, encode_transfer, encode_transfer_compressed};
pub use compress::Compression;
pub use integrity::{Integrity, SessionKey, MAC_LEN};

/// Protocol magic, first four bytes of every handshake message.
pub const MAGIC: [u8; 4] = *b"DKVT";
/// Protocol version spoken by this crate.
pub const VERSION: u16 = 2;
/// Size of every frame header.
pub const HEADER_LEN: usize = 16;
/// Longest accepted VERDICT reason text.
pub const MAX_REASON_LEN: usize = 256;

/// `during` value of [`crate::Error::PeerClosed`] for a clean close between transfers.
pub(crate) const IDLE: &str = "waiting for the next transfer";
