//! Receiver-side bookkeeping for one transfer, shared by every backend's receiver.
//!
//! Invariants: a [`Tracker`] exists only for a header whose descriptor validated against the
//! layout and whose every block the sink confirmed as reserved for the request; each layer
//! is accepted at most once; `end` succeeds only when every layer arrived.

use crate::error::{Error, Result};
use crate::layout::{KvLayout, TransferDesc};
use crate::sink::KvSink;

/// Progress of one accepted transfer.
#[derive(Debug)]
pub(crate) struct Tracker {
    pub desc: TransferDesc,
    seen: Vec<bool>,
    received: u32,
}

/// Wraps `e` in [`Error::Aborted`] listing `blocks`.
pub(crate) fn aborted(request_id: u64, blocks: Vec<u32>, e: Error) -> Error {
    match e {
        already @ Error::Aborted { .. } => already,
        other => Error::Aborted {
            request_id,
            release: blocks,
            source: Box::new(other),
        },
    }
}

impl Tracker {
    /// Validates `desc` and the reservations, then opens the transfer at the sink
    /// ([`KvSink::begin_transfer`]). Failures after the request id is known are wrapped in
    /// [`Error::Aborted`] listing the named blocks that *are* reserved for it.
    pub(crate) fn accept<S: KvSink + ?Sized>(
        layout: &KvLayout,
        desc: TransferDesc,
        sink: &mut S,
    ) -> Result<Tracker> {
        fn reserved_subset<S: KvSink + ?Sized>(sink: &S, d: &TransferDesc) -> Vec<u32> {
            let mut v: Vec<u32> = d
                .dst_blocks
                .iter()
                .copied()
                .filter(|b| sink.is_reserved(d.request_id, *b))
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        }
        if let Err(e) = desc.validate(layout) {
            return Err(aborted(desc.request_id, reserved_subset(&*sink, &desc), e));
        }
        if let Some(&block) = desc
            .dst_blocks
            .iter()
            .find(|b| !sink.is_reserved(desc.request_id, **b))
        {
            let e = Error::BlockNotReserved {
                request_id: desc.request_id,
                block,
            };
            return Err(aborted(desc.request_id, reserved_subset(&*sink, &desc), e));
        }
        if let Err(e) = sink.begin_transfer(desc.request_id) {
            return Err(aborted(
                desc.request_id,
                reserved_subset(&*sink, &desc),
                Error::Sink(e),
            ));
        }
        Ok(Tracker {
            seen: vec![false; layout.layers() as usize],
            received: 0,
            desc,
        })
    }

    /// Checks that `layer` may be received now.
    pub(crate) fn start_layer(&self, layer: u32) -> Result<()> {
        match self.seen.get(layer as usize) {
            None => Err(Error::LayerOutOfRange {
                layer,
                layers: self.seen.len() as u32,
            }),
            Some(true) => Err(Error::DuplicateLayer { layer }),
            Some(false) => Ok(()),
        }
    }

    /// Records that `layer` was fully placed.
    pub(crate) fn finish_layer(&mut self, layer: u32) {
        if let Some(s) = self.seen.get_mut(layer as usize) {
            if !*s {
                *s = true;
                self.received += 1;
            }
        }
    }

    /// Checks an END frame.
    pub(crate) fn end(&self, request_id: u64, layers_sent: u32) -> Result<()> {
        if request_id != self.desc.request_id {
            return Err(Error::malformed(
                "END",
                format!(
                    "request id {request_id} differs from BEGIN's {}",
                    self.desc.request_id
                ),
            ));
        }
        let expected = self.seen.len() as u32;
        if self.received != expected || layers_sent != expected {
            return Err(Error::MissingLayers {
                received: self.received,
                expected,
            });
        }
        Ok(())
    }

    /// Number of layers received so far.
    pub(crate) fn received(&self) -> u32 {
        self.received
    }

    /// Wraps an error for this transfer.
    pub(crate) fn abort(&self, e: Error) -> Error {
        aborted(self.desc.request_id, self.desc.dst_blocks.clone(), e)
    }
}
