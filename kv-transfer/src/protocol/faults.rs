//! Fault injection on the sender's side of a real connection (feature `fault-injection`,
//! which only tests and debug builds enable: release builds do not contain this module).
//!
//! A [`FaultPlan`] hands one [`Fault`] (or none) to each transfer a sender begins; the fault
//! hits one frame of the transfer (0 = BEGIN, 1.. = the LAYER frames in the order they are
//! sent, then END) after its MAC was computed over the true bytes, exactly as a damaged link
//! or a man in the middle would: a bit flipped, the frame cut short (then the connection
//! dropped), the frame sent twice, two LAYER frames swapped, or a layer held back for a while.
//!
//! Invariant: with no fault for a transfer, the bytes written are exactly those of a build
//! without this feature.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::protocol::frame::MAC_LEN;
use crate::protocol::transport::FrameTransport;
use crate::protocol::HEADER_LEN;

/// What happens to the chosen frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Flip bit `at % (8 * frame length)` of the frame (header, body or trailer).
    FlipBit,
    /// Send the first `1 + at % (frame length - 1)` bytes (at least one, not all), then drop
    /// the connection.
    Truncate,
    /// Send the frame twice.
    Duplicate,
    /// LAYER frames only: send the frame after the next one (after END for the last).
    Reorder,
    /// Wait this long before sending the frame (not a corruption).
    Delay(Duration),
}

impl FaultKind {
    /// Whether the receiver must refuse the transfer.
    pub fn corrupts(self) -> bool {
        !matches!(self, FaultKind::Delay(_))
    }
}

/// One fault for one transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// Which frame of the transfer: 0 = BEGIN, 1.. = LAYER frames in send order, then END.
    pub frame: u32,
    /// Position selector (bit or byte, taken modulo the frame's length).
    pub at: u64,
}

/// Faults for the transfers a sender begins, in order; cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan(Arc<Mutex<VecDeque<Option<Fault>>>>);

impl FaultPlan {
    /// A plan giving `faults[i]` to the i-th transfer begun, then none.
    pub fn new(faults: impl IntoIterator<Item = Option<Fault>>) -> FaultPlan {
        FaultPlan(Arc::new(Mutex::new(faults.into_iter().collect())))
    }

    /// Parses `DUET_KV_FAULTS`: comma-separated faults for successive transfers, each
    /// `flip`, `truncate`, `duplicate`, `reorder`, `none` or `delay-<ms>`, optionally
    /// `@frame` (default 1, the first LAYER frame), e.g. `flip,none,reorder@2`.
    pub fn parse(spec: &str) -> Result<FaultPlan> {
        let mut out = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (kind, frame) = match item.split_once('@') {
                Some((k, f)) => (
                    k,
                    f.parse::<u32>().map_err(|_| {
                        Error::InvalidArgument(format!("DUET_KV_FAULTS: bad frame in {item:?}"))
                    })?,
                ),
                None => (item, 1),
            };
            let kind = match kind {
                "none" => {
                    out.push(None);
                    continue;
                }
                "flip" => FaultKind::FlipBit,
                "truncate" => FaultKind::Truncate,
                "duplicate" => FaultKind::Duplicate,
                "reorder" => FaultKind::Reorder,
                d => match d
                    .strip_prefix("delay-")
                    .and_then(|ms| ms.parse::<u64>().ok())
                {
                    Some(ms) => FaultKind::Delay(Duration::from_millis(ms)),
                    None => {
                        return Err(Error::InvalidArgument(format!(
                            "DUET_KV_FAULTS: unknown fault {item:?}"
                        )))
                    }
                },
            };
            out.push(Some(Fault {
                kind,
                frame,
                at: 0x5a5a_5a5a,
            }));
        }
        Ok(FaultPlan::new(out))
    }

    pub(crate) fn next(&self) -> Option<Fault> {
        self.0.lock().ok().and_then(|mut q| q.pop_front()).flatten()
    }
}

/// A LAYER frame held back by [`FaultKind::Reorder`].
pub(crate) struct Held {
    header: [u8; HEADER_LEN],
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    trailer: Option<[u8; MAC_LEN]>,
}

/// The fault state of the transfer in progress.
#[derive(Default)]
pub(crate) struct Injector {
    pub(crate) plan: Option<FaultPlan>,
    fault: Option<Fault>,
    frame: u32,
    held: Option<Held>,
}

impl std::fmt::Debug for Injector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Injector {{ fault: {:?}, frame: {} }}",
            self.fault, self.frame
        )
    }
}

fn injected(what: &'static str) -> Error {
    Error::io(
        what,
        std::io::Error::other("fault injection: connection dropped"),
    )
}

impl Injector {
    /// A transfer begins: takes its fault from the plan.
    pub(crate) fn begin(&mut self) {
        self.fault = self.plan.as_ref().and_then(FaultPlan::next);
        self.frame = 0;
        self.held = None;
    }

    /// The fault for the frame about to be sent, if any (advances the frame count).
    fn take(&mut self) -> Option<Fault> {
        let f = self.fault.filter(|f| f.frame == self.frame);
        self.frame += 1;
        f
    }

    /// Sends a control frame (`msg` = header, body, trailer).
    pub(crate) async fn ctl<T: FrameTransport>(
        &mut self,
        io: &mut T,
        msg: &[u8],
        during: &'static str,
    ) -> Result<()> {
        let fault = self.take();
        let mut bytes = msg.to_vec();
        match fault.map(|f| (f.kind, f.at)) {
            Some((FaultKind::FlipBit, at)) => {
                let bit = (at % (8 * bytes.len() as u64)) as usize;
                bytes[bit / 8] ^= 1 << (bit % 8);
            }
            Some((FaultKind::Truncate, at)) => {
                let n = 1 + (at % (bytes.len() as u64 - 1)) as usize;
                io.write_ctl(&bytes[..n], during).await?;
                return Err(injected(during));
            }
            Some((FaultKind::Duplicate, _)) => io.write_ctl(&bytes, during).await?,
            Some((FaultKind::Delay(d), _)) => tokio::time::sleep(d).await,
            Some((FaultKind::Reorder, _)) | None => {}
        }
        io.write_ctl(&bytes, during).await?;
        // END goes out before a held-back layer.
        if let Some(h) = self.held.take() {
            io.write_layer(&h.header, &h.k, &h.v, h.trailer).await?;
        }
        Ok(())
    }

    /// Sends a LAYER frame whose trailer was computed over the true bytes.
    pub(crate) async fn layer<T: FrameTransport, R: AsRef<[u8]> + Sync>(
        &mut self,
        io: &mut T,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; MAC_LEN]>,
    ) -> Result<()> {
        let fault = self.take();
        let held = self.held.take();
        let Some(fault) = fault else {
            io.write_layer(header, k, v, trailer).await?;
            if let Some(h) = held {
                io.write_layer(&h.header, &h.k, &h.v, h.trailer).await?;
            }
            return Ok(());
        };
        let mut h = Held {
            header: *header,
            k: k.iter().map(|r| r.as_ref().to_vec()).collect(),
            v: v.iter().map(|r| r.as_ref().to_vec()).collect(),
            trailer,
        };
        let body: u64 = h.k.iter().chain(&h.v).map(|r| r.len() as u64).sum();
        let tlen = if trailer.is_some() { MAC_LEN as u64 } else { 0 };
        let total = HEADER_LEN as u64 + body + tlen;
        match fault.kind {
            FaultKind::FlipBit => {
                let bit = fault.at % (8 * total);
                let (byte, mask) = ((bit / 8) as usize, 1u8 << (bit % 8));
                if byte < HEADER_LEN {
                    h.header[byte] ^= mask;
                } else if let Some(t) = h.trailer.as_mut().filter(|_| byte as u64 >= total - tlen) {
                    t[byte - (total - tlen) as usize] ^= mask;
                } else {
                    let mut off = byte - HEADER_LEN;
                    for r in h.k.iter_mut().chain(h.v.iter_mut()) {
                        if off < r.len() {
                            r[off] ^= mask;
                            break;
                        }
                        off -= r.len();
                    }
                }
            }
            FaultKind::Truncate => {
                let n = 1 + (fault.at % (total - 1)) as usize;
                let mut bytes = header.to_vec();
                for r in h.k.iter().chain(&h.v) {
                    bytes.extend_from_slice(r);
                }
                if let Some(t) = trailer {
                    bytes.extend_from_slice(&t);
                }
                io.write_ctl(&bytes[..n], "sending a layer").await?;
                return Err(injected("sending a layer"));
            }
            FaultKind::Duplicate => io.write_layer(&h.header, &h.k, &h.v, h.trailer).await?,
            FaultKind::Reorder => {
                if let Some(prev) = held {
                    io.write_layer(&prev.header, &prev.k, &prev.v, prev.trailer)
                        .await?;
                }
                self.held = Some(h);
                return Ok(());
            }
            FaultKind::Delay(d) => tokio::time::sleep(d).await,
        }
        io.write_layer(&h.header, &h.k, &h.v, h.trailer).await?;
        if let Some(prev) = held {
            io.write_layer(&prev.header, &prev.k, &prev.v, prev.trailer)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_hand_out_one_fault_per_transfer() {
        let p = FaultPlan::parse("flip, none ,reorder@2,delay-15").unwrap();
        assert_eq!(
            p.next().map(|f| (f.kind, f.frame)),
            Some((FaultKind::FlipBit, 1))
        );
        assert_eq!(p.next(), None);
        assert_eq!(
            p.next().map(|f| (f.kind, f.frame)),
            Some((FaultKind::Reorder, 2))
        );
        assert_eq!(
            p.next().map(|f| f.kind),
            Some(FaultKind::Delay(Duration::from_millis(15)))
        );
        assert_eq!(p.next(), None, "then none");
        assert!(FaultPlan::parse("melt").is_err());
        assert!(FaultPlan::parse("flip@x").is_err());
    }
}
