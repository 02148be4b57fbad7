//! The crate's single error type, its coarse [`ErrorClass`] and bounded metric labels.
//!
//! Invariants:
//! - every fallible public function returns [`Error`]; causes are kept as `#[source]`;
//! - [`Error::class`] maps every variant onto duet's one [`ErrorClass`], and
//!   [`Error::metric_label`] onto a fixed set of `&'static str` (safe as a metric label);
//! - an error that happens after a receiver accepted a transfer header is wrapped in
//!   [`Error::Aborted`], which lists the reserved blocks the caller must release.

use std::time::Duration;

use crate::layout::LayoutMismatch;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub use duet_error_class::ErrorClass;

/// An [`ErrorClass`] on the wire: the code of a receiver verdict or an abort (never 0; 0
/// means success). The numbers are part of the protocol and never change; classes that
/// cannot occur in a transfer (cancelled, already exists) travel as internal, and a code
/// this build does not know reads as internal.
pub(crate) fn wire_code(class: ErrorClass) -> u8 {
    match class {
        ErrorClass::InvalidArgument => 1,
        ErrorClass::NotFound => 2,
        ErrorClass::ResourceExhausted => 3,
        ErrorClass::Unavailable => 4,
        ErrorClass::DeadlineExceeded => 5,
        ErrorClass::Unauthenticated => 7,
        ErrorClass::FailedPrecondition => 8,
        ErrorClass::Internal | ErrorClass::Cancelled | ErrorClass::AlreadyExists => 6,
    }
}

/// Inverse of [`wire_code`]; unknown codes map to `Internal`.
pub(crate) fn from_wire_code(code: u8) -> ErrorClass {
    match code {
        1 => ErrorClass::InvalidArgument,
        2 => ErrorClass::NotFound,
        3 => ErrorClass::ResourceExhausted,
        4 => ErrorClass::Unavailable,
        5 => ErrorClass::DeadlineExceeded,
        7 => ErrorClass::Unauthenticated,
        8 => ErrorClass::FailedPrecondition,
        _ => ErrorClass::Internal,
    }
}

/// Error reported by a [`crate::KvSink`] implementation (the engine's KV cache).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SinkError {
    /// How the transfer layer should classify this failure.
    pub class: ErrorClass,
    /// Human readable description.
    pub message: String,
    /// Underlying cause, if any.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl SinkError {
    /// A sink error without an underlying cause.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        SinkError {
            class,
            message: message.into(),
            source: None,
        }
    }

    /// A sink error wrapping an underlying cause.
    pub fn with_source(
        class: ErrorClass,
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        SinkError {
            class,
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// Every error this crate returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller used the API wrongly (wrong region count, layer sent twice, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A layout has a zero or out-of-limit dimension.
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),

    /// The two sides' KV layouts are not compatible; names both values of every field.
    #[error(transparent)]
    LayoutMismatch(Box<LayoutMismatch>),

    /// Handshake authentication failed (wrong secret, or the peer rejected ours).
    #[error("authentication failed: {0}")]
    Unauthenticated(&'static str),

    /// The first bytes on the connection are not this protocol's magic.
    #[error("bad magic {found:02x?}: peer does not speak the duet kv-transfer protocol")]
    BadMagic {
        /// The four bytes that were received.
        found: [u8; 4],
    },

    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {remote} (this side speaks {local})")]
    UnsupportedVersion {
        /// Version spoken by this process.
        local: u16,
        /// Version announced by the peer.
        remote: u16,
    },

    /// A frame that is syntactically wrong (unknown tag, reserved bits set, bad field).
    #[error("malformed {frame} frame: {detail}")]
    Malformed {
        /// Which frame or message.
        frame: &'static str,
        /// What is wrong with it.
        detail: String,
    },

    /// A length field exceeds its protocol limit or disagrees with the layout.
    #[error("{what} is {len} bytes, limit/expected {limit}")]
    Oversized {
        /// Which length.
        what: &'static str,
        /// The announced length.
        len: u64,
        /// The limit (or the exact expected value).
        limit: u64,
    },

    /// A frame arrived that is not allowed in the current state.
    #[error("unexpected frame: expected {expected}, got tag {tag:#04x}")]
    UnexpectedFrame {
        /// What the state machine expected.
        expected: &'static str,
        /// Tag byte received.
        tag: u8,
    },

    /// A destination block is not reserved for this request at the receiver.
    #[error("block {block} is not reserved for request {request_id}")]
    BlockNotReserved {
        /// Request the transfer claims to belong to.
        request_id: u64,
        /// The offending block id.
        block: u32,
    },

    /// The same destination block appears twice in a transfer header.
    #[error("block {block} listed twice in the transfer header")]
    DuplicateBlock {
        /// The repeated block id.
        block: u32,
    },

    /// A layer index is not below the layout's layer count.
    #[error("layer {layer} out of range (layout has {layers} layers)")]
    LayerOutOfRange {
        /// Layer index received.
        layer: u32,
        /// Number of layers in the layout.
        layers: u32,
    },

    /// The same layer was sent twice in one transfer.
    #[error("layer {layer} sent twice in one transfer")]
    DuplicateLayer {
        /// The repeated layer.
        layer: u32,
    },

    /// The end frame arrived before every layer did.
    #[error("transfer ended with {received} of {expected} layers")]
    MissingLayers {
        /// Layers received.
        received: u32,
        /// Layers the layout has.
        expected: u32,
    },

    /// A frame's MAC did not verify.
    #[error(
        "bad MAC on the {frame} frame: its bytes were changed, cut, reordered or replayed on the way"
    )]
    BadMac {
        /// Which frame.
        frame: &'static str,
    },

    /// The peer closed the connection (EOF or channel closed).
    #[error("peer closed the connection while {during}")]
    PeerClosed {
        /// What this side was waiting for.
        during: &'static str,
    },

    /// A wait exceeded its configured timeout.
    #[error("timed out after {after:?} while {during}")]
    Timeout {
        /// What this side was waiting for.
        during: &'static str,
        /// The configured timeout.
        after: Duration,
    },

    /// An operating-system I/O error.
    #[error("i/o error while {during}")]
    Io {
        /// What this side was doing.
        during: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// The engine's sink refused a region.
    #[error("KV sink refused the write")]
    Sink(#[source] SinkError),

    /// The receiver rejected the transfer (its verdict).
    #[error("receiver rejected the transfer ({class}): {reason}")]
    Rejected {
        /// Class of the receiver-side error.
        class: ErrorClass,
        /// Receiver's (bounded, sanitised) reason text.
        reason: String,
    },

    /// The sender aborted the transfer.
    #[error("sender aborted the transfer ({class})")]
    SenderAborted {
        /// Class the sender gave.
        class: ErrorClass,
    },

    /// A backend cannot be used here (not compiled in, library missing, no device).
    #[error("backend {backend} unavailable: {reason}")]
    BackendUnavailable {
        /// Backend name.
        backend: &'static str,
        /// Why.
        reason: String,
    },

    /// No backend connects the two endpoints.
    #[error("no transfer backend connects {src} and {dst}: {reason}")]
    NoBackend {
        /// Source endpoint description.
        src: String,
        /// Destination endpoint description.
        dst: String,
        /// Why every candidate was ruled out.
        reason: String,
    },

    /// The connection is unusable after an earlier failure.
    #[error("connection is broken by an earlier error; open a new one")]
    Broken,

    /// A transfer failed after its header was accepted: the listed blocks must be released.
    #[error("transfer of request {request_id} aborted; {} reserved block(s) must be released", release.len())]
    Aborted {
        /// Request id from the accepted header.
        request_id: u64,
        /// Reserved destination blocks that now hold partial data and must be released.
        release: Vec<u32>,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },

    /// A bug inside this crate (should never happen).
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<Box<LayoutMismatch>> for Error {
    fn from(m: Box<LayoutMismatch>) -> Self {
        Error::LayoutMismatch(m)
    }
}

impl From<LayoutMismatch> for Error {
    fn from(m: LayoutMismatch) -> Self {
        Error::LayoutMismatch(Box::new(m))
    }
}

impl Error {
    /// Coarse class of this error. For [`Error::Aborted`] this is the class of the cause.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::InvalidArgument(_)
            | Error::InvalidLayout(_)
            | Error::LayoutMismatch(_)
            | Error::BadMagic { .. }
            | Error::UnsupportedVersion { .. }
            | Error::Malformed { .. }
            | Error::UnexpectedFrame { .. }
            | Error::DuplicateBlock { .. }
            | Error::LayerOutOfRange { .. }
            | Error::DuplicateLayer { .. }
            | Error::MissingLayers { .. }
            | Error::NoBackend { .. } => ErrorClass::InvalidArgument,
            Error::BlockNotReserved { .. } => ErrorClass::NotFound,
            Error::Oversized { .. } => ErrorClass::ResourceExhausted,
            // Damaged on the link (or by someone on it): another attempt may go through.
            Error::BadMac { .. }
            | Error::PeerClosed { .. }
            | Error::Io { .. }
            | Error::BackendUnavailable { .. }
            | Error::Broken => ErrorClass::Unavailable,
            Error::Timeout { .. } => ErrorClass::DeadlineExceeded,
            Error::Unauthenticated(_) => ErrorClass::Unauthenticated,
            Error::Sink(e) => e.class,
            Error::Rejected { class, .. } | Error::SenderAborted { class } => *class,
            Error::Aborted { source, .. } => source.class(),
            Error::Internal(_) => ErrorClass::Internal,
        }
    }

    /// Bounded label for metrics (`duet_kv_transfer_errors_total{kind=...}`).
    /// For [`Error::Aborted`] this is the label of the cause.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::InvalidArgument(_) => "invalid_argument",
            Error::InvalidLayout(_) => "invalid_layout",
            Error::LayoutMismatch(_) => "layout_mismatch",
            Error::Unauthenticated(_) => "unauthenticated",
            Error::BadMagic { .. } => "bad_magic",
            Error::UnsupportedVersion { .. } => "unsupported_version",
            Error::Malformed { .. } => "malformed_frame",
            Error::Oversized { .. } => "oversized",
            Error::UnexpectedFrame { .. } => "unexpected_frame",
            Error::BlockNotReserved { .. } => "block_not_reserved",
            Error::DuplicateBlock { .. } => "duplicate_block",
            Error::LayerOutOfRange { .. } => "layer_out_of_range",
            Error::DuplicateLayer { .. } => "duplicate_layer",
            Error::MissingLayers { .. } => "missing_layers",
            Error::BadMac { .. } => "bad_mac",
            Error::PeerClosed { .. } => "peer_closed",
            Error::Timeout { .. } => "timeout",
            Error::Io { .. } => "io",
            Error::Sink(_) => "sink",
            Error::Rejected { .. } => "rejected",
            Error::SenderAborted { .. } => "sender_aborted",
            Error::BackendUnavailable { .. } => "backend_unavailable",
            Error::NoBackend { .. } => "no_backend",
            Error::Broken => "broken_connection",
            Error::Aborted { source, .. } => source.metric_label(),
            Error::Internal(_) => "internal",
        }
    }

    /// Reserved blocks that the receiver must release because of this error (empty when
    /// the failure happened before a transfer header was accepted).
    pub fn blocks_to_release(&self) -> &[u32] {
        match self {
            Error::Aborted { release, .. } => release,
            _ => &[],
        }
    }

    /// The innermost cause, looking through [`Error::Aborted`].
    pub fn root(&self) -> &Error {
        match self {
            Error::Aborted { source, .. } => source.root(),
            other => other,
        }
    }

    /// True when the link itself failed (timed out, closed, broke, or an I/O error), as
    /// opposed to the peer refusing the transfer or this side failing.
    pub fn is_link_failure(&self) -> bool {
        matches!(
            self.root(),
            Error::PeerClosed { .. } | Error::Timeout { .. } | Error::Io { .. } | Error::Broken
        )
    }

    /// True when the peer closed the connection cleanly between two transfers.
    pub fn is_clean_close(&self) -> bool {
        matches!(self, Error::PeerClosed { during } if *during == crate::protocol::IDLE)
    }

    /// Maps an OS error; the kinds that mean "the peer went away" become [`Error::PeerClosed`].
    pub fn io(during: &'static str, source: std::io::Error) -> Error {
        use std::io::ErrorKind as K;
        match source.kind() {
            K::UnexpectedEof | K::BrokenPipe | K::ConnectionReset | K::ConnectionAborted => {
                Error::PeerClosed { during }
            }
            _ => Error::Io { during, source },
        }
    }

    pub(crate) fn malformed(frame: &'static str, detail: impl Into<String>) -> Error {
        Error::Malformed {
            frame,
            detail: detail.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_codes_round_trip_and_labels_are_distinct() {
        for c in ErrorClass::ALL {
            assert_ne!(wire_code(c), 0);
            let back = from_wire_code(wire_code(c));
            match c {
                ErrorClass::Cancelled | ErrorClass::AlreadyExists => {
                    assert_eq!(back, ErrorClass::Internal)
                }
                _ => assert_eq!(back, c),
            }
        }
        // The protocol's numbers (a peer of another build reads them).
        assert_eq!(wire_code(ErrorClass::Unavailable), 4);
        assert_eq!(wire_code(ErrorClass::Unauthenticated), 7);
        assert_eq!(wire_code(ErrorClass::FailedPrecondition), 8);
        // A code this build does not know (a newer peer's) reads as Internal.
        assert_eq!(from_wire_code(200), ErrorClass::Internal);
    }

    #[test]
    fn aborted_delegates_class_and_label() {
        let e = Error::Aborted {
            request_id: 7,
            release: vec![1, 2],
            source: Box::new(Error::Timeout {
                during: "x",
                after: Duration::from_secs(1),
            }),
        };
        assert_eq!(e.class(), ErrorClass::DeadlineExceeded);
        assert_eq!(e.metric_label(), "timeout");
        assert_eq!(e.blocks_to_release(), &[1, 2]);
        assert!(std::error::Error::source(&e).is_some());
    }
}
