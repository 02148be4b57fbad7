//! Connection configuration: layout, secret, integrity policy and the timeouts that bound
//! every wait.
//!
//! Invariant: every blocking wait in this crate (connect, handshake, each read/write, the
//! idle wait for the next transfer, the verdict, the drain after an error) is bounded by one
//! of these durations.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::auth::SharedSecret;
use crate::layout::KvLayout;
use crate::protocol::{Compression, Integrity};

/// Timeouts for every wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeouts {
    /// Establishing a connection.
    pub connect: Duration,
    /// The whole handshake.
    pub handshake: Duration,
    /// Any single read or write making no progress (also the sender's wait for the verdict
    /// after END, and the local backend's channel waits).
    pub io: Duration,
    /// A receiver waiting for the next transfer on an idle connection.
    pub idle: Duration,
    /// After a receiver-side error: how long to keep discarding incoming bytes so that the
    /// sender can read the verdict before the connection is closed.
    pub drain: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            handshake: Duration::from_secs(5),
            io: Duration::from_secs(10),
            idle: Duration::from_secs(300),
            drain: Duration::from_millis(500),
        }
    }
}

/// Configuration of one side of a connection.
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// This side's KV layout; the peer's must be identical.
    pub layout: KvLayout,
    /// Shared secret for the handshake.
    pub secret: SharedSecret,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Sender: MAC every frame. Receiver: refuse transfers whose frames carry no MAC.
    pub integrity: Integrity,
    /// Sender: encoding of layer payloads on the wire (receivers decode any).
    pub compression: Compression,
    /// Sender: faults to inject into its transfers (tests only).
    #[cfg(feature = "fault-injection")]
    pub faults: Option<crate::protocol::faults::FaultPlan>,
}

impl TransferConfig {
    /// Default timeouts, frame MACs on.
    pub fn new(layout: KvLayout, secret: SharedSecret) -> Self {
        TransferConfig {
            layout,
            secret,
            timeouts: Timeouts::default(),
            integrity: Integrity::Mac,
            compression: Compression::None,
            #[cfg(feature = "fault-injection")]
            faults: None,
        }
    }
}
