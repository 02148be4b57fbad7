//! Same-process backend: layers travel as `bytes::Bytes` over a bounded tokio channel and are
//! handed to the sink with [`KvSink::adopt_region`], so no payload byte is copied when the
//! sender uses [`KvSender::send_layer_bytes`] and the sink adopts buffers.
//!
//! Invariants:
//! - the receiver validates exactly as the wire decoder does (layout, reservations, layer
//!   range, duplicates, region sizes) before touching the sink;
//! - every channel wait is bounded by a timeout; a dropped peer is `PeerClosed`;
//! - no handshake secret is needed (same trust domain), but layouts must be identical;
//! - compression never applies: nothing crosses a wire, buffers are handed over.

use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::api::{KvReceiver, KvSender, TransferReceipt};
use crate::config::Timeouts;
use crate::error::{Error, ErrorClass, Result};
use crate::layout::{KvKind, KvLayout, TransferDesc};
use crate::protocol::tracker::{aborted, Tracker};
use crate::protocol::{Compression, IDLE};
use crate::sink::KvSink;

/// Layers in flight between a local sender and receiver.
pub const LOCAL_CHANNEL_DEPTH: usize = 4;

#[derive(Debug)]
enum Msg {
    Begin(TransferDesc),
    Layer {
        layer: u32,
        k: Vec<Bytes>,
        v: Vec<Bytes>,
    },
    End {
        request_id: u64,
        layers: u32,
    },
    Abort,
}

#[derive(Debug)]
struct Verdict {
    request_id: u64,
    error: Option<(ErrorClass, String)>,
}

/// Creates a connected same-process sender/receiver pair. Fails with a layout mismatch
/// naming both values when the layouts differ.
pub fn pair(
    receiver_layout: KvLayout,
    sender_layout: KvLayout,
    timeouts: Timeouts,
) -> Result<(LocalSender, LocalReceiver)> {
    receiver_layout.check_compatible(&sender_layout)?;
    let (tx, rx) = mpsc::channel(LOCAL_CHANNEL_DEPTH);
    let (vtx, vrx) = mpsc::channel(1);
    Ok((
        LocalSender {
            tx,
            verdicts: vrx,
            layout: sender_layout,
            timeouts,
            current: None,
            broken: false,
        },
        LocalReceiver {
            rx,
            verdicts: vtx,
            layout: receiver_layout,
            timeouts,
            broken: false,
        },
    ))
}

async fn bounded<T>(
    t: Duration,
    during: &'static str,
    f: impl std::future::Future<Output = Option<T>>,
) -> Result<T> {
    match tokio::time::timeout(t, f).await {
        Err(_) => Err(Error::Timeout { during, after: t }),
        Ok(None) => Err(Error::PeerClosed { during }),
        Ok(Some(v)) => Ok(v),
    }
}

#[derive(Debug)]
struct Current {
    desc: TransferDesc,
    seen: Vec<bool>,
    sent: u32,
    started: Instant,
}

/// Sending half of a same-process pair.
#[derive(Debug)]
pub struct LocalSender {
    tx: mpsc::Sender<Msg>,
    verdicts: mpsc::Receiver<Verdict>,
    layout: KvLayout,
    timeouts: Timeouts,
    current: Option<Current>,
    broken: bool,
}

impl LocalSender {
    async fn send(&mut self, m: Msg, during: &'static str) -> Result<()> {
        let t = self.timeouts.io;
        // Wait for channel space, but give up as soon as the receiver answers early (it
        // only does so to reject the transfer).
        let r = tokio::time::timeout(t, async {
            tokio::select! {
                sent = self.tx.send(m) => sent.map_err(|_| Error::PeerClosed { during }),
                v = self.verdicts.recv() => Err(match v {
                    Some(Verdict { error: Some((class, reason)), .. }) => {
                        Error::Rejected { class, reason }
                    }
                    Some(_) => Error::malformed("local verdict", "success before END"),
                    None => Error::PeerClosed { during },
                }),
            }
        })
        .await
        .unwrap_or(Err(Error::Timeout { during, after: t }));
        // A receiver that rejected the transfer and went away left its verdict behind.
        let r = match r {
            Err(Error::PeerClosed { .. }) => match self.verdicts.try_recv() {
                Ok(Verdict {
                    error: Some((class, reason)),
                    ..
                }) => Err(Error::Rejected { class, reason }),
                _ => r,
            },
            other => other,
        };
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    fn check_layer<R: AsRef<[u8]>>(&self, layer: u32, k: &[R], v: &[R]) -> Result<()> {
        if self.broken {
            return Err(Error::Broken);
        }
        let cur = self
            .current
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("send_layer called before begin".into()))?;
        match cur.seen.get(layer as usize) {
            None => {
                return Err(Error::LayerOutOfRange {
                    layer,
                    layers: self.layout.layers(),
                })
            }
            Some(true) => return Err(Error::DuplicateLayer { layer }),
            Some(false) => {}
        }
        let n = cur.desc.dst_blocks.len();
        let want = self.layout.region_bytes();
        for (name, regions) in [("k", k.len()), ("v", v.len())] {
            if regions != n {
                return Err(Error::InvalidArgument(format!(
                    "{name}: {regions} regions given, transfer has {n} blocks"
                )));
            }
        }
        if k.iter().chain(v).any(|r| r.as_ref().len() != want) {
            return Err(Error::InvalidArgument(format!(
                "every region must be {want} bytes"
            )));
        }
        Ok(())
    }

    fn mark_sent(&mut self, layer: u32) {
        if let Some(cur) = &mut self.current {
            if let Some(s) = cur.seen.get_mut(layer as usize) {
                *s = true;
            }
            cur.sent += 1;
        }
    }
}

impl KvSender for LocalSender {
    async fn begin(&mut self, desc: TransferDesc) -> Result<()> {
        if self.broken {
            return Err(Error::Broken);
        }
        if self.current.is_some() {
            return Err(Error::InvalidArgument(
                "begin called while a transfer is in progress".into(),
            ));
        }
        desc.validate(&self.layout)?;
        self.send(Msg::Begin(desc.clone()), "sending BEGIN").await?;
        self.current = Some(Current {
            seen: vec![false; self.layout.layers() as usize],
            sent: 0,
            desc,
            started: Instant::now(),
        });
        Ok(())
    }

    /// Copies each region once into a `Bytes` (borrowed data cannot be handed over).
    async fn send_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        layer: u32,
        k: &[R],
        v: &[R],
    ) -> Result<()> {
        self.check_layer(layer, k, v)?;
        let k = k
            .iter()
            .map(|r| Bytes::copy_from_slice(r.as_ref()))
            .collect();
        let v = v
            .iter()
            .map(|r| Bytes::copy_from_slice(r.as_ref()))
            .collect();
        self.send(Msg::Layer { layer, k, v }, "sending a layer")
            .await?;
        self.mark_sent(layer);
        Ok(())
    }

    /// Zero copy: the receiver's sink gets these very buffers.
    async fn send_layer_bytes(&mut self, layer: u32, k: Vec<Bytes>, v: Vec<Bytes>) -> Result<()> {
        self.check_layer(layer, &k, &v)?;
        self.send(Msg::Layer { layer, k, v }, "sending a layer")
            .await?;
        self.mark_sent(layer);
        Ok(())
    }

    async fn finish(&mut self) -> Result<TransferReceipt> {
        if self.broken {
            return Err(Error::Broken);
        }
        let layers = self.layout.layers();
        match &self.current {
            None => return Err(Error::InvalidArgument("finish called before begin".into())),
            Some(c) if c.sent != layers => {
                return Err(Error::MissingLayers {
                    received: c.sent,
                    expected: layers,
                })
            }
            Some(_) => {}
        }
        let Some(cur) = self.current.take() else {
            return Err(Error::Internal("sender state changed unexpectedly".into()));
        };
        let request_id = cur.desc.request_id;
        self.send(Msg::End { request_id, layers }, "sending END")
            .await?;
        let v = bounded(
            self.timeouts.io,
            "waiting for the verdict",
            self.verdicts.recv(),
        )
        .await;
        let v = match v {
            Ok(v) => v,
            Err(e) => {
                self.broken = true;
                return Err(e);
            }
        };
        if let Some((class, reason)) = v.error {
            self.broken = true;
            return Err(Error::Rejected { class, reason });
        }
        if v.request_id != request_id {
            self.broken = true;
            return Err(Error::Internal("verdict for another request".into()));
        }
        Ok(TransferReceipt {
            payload_bytes: cur.desc.payload_bytes(&self.layout),
            wire_bytes: cur.desc.payload_bytes(&self.layout),
            compression: Compression::None,
            layers,
            desc: cur.desc,
            elapsed: cur.started.elapsed(),
        })
    }

    async fn abort(&mut self) -> Result<()> {
        if self.current.take().is_some() {
            let r = self.send(Msg::Abort, "sending ABORT").await;
            self.broken = true;
            return r;
        }
        Ok(())
    }
}

/// Receiving half of a same-process pair.
#[derive(Debug)]
pub struct LocalReceiver {
    rx: mpsc::Receiver<Msg>,
    verdicts: mpsc::Sender<Verdict>,
    layout: KvLayout,
    timeouts: Timeouts,
    broken: bool,
}

impl LocalReceiver {
    async fn run<S: KvSink + Send>(&mut self, sink: &mut S) -> Result<TransferReceipt> {
        let first = bounded(self.timeouts.idle, IDLE, self.rx.recv()).await?;
        let started = Instant::now();
        let desc = match first {
            Msg::Begin(d) => d,
            _ => return Err(Error::malformed("local", "transfer must start with BEGIN")),
        };
        let mut tracker = Tracker::accept(&self.layout, desc, &mut *sink)?;
        match self.layers(sink, &mut tracker).await {
            Ok(()) => Ok(TransferReceipt {
                payload_bytes: tracker.desc.payload_bytes(&self.layout),
                wire_bytes: tracker.desc.payload_bytes(&self.layout),
                compression: Compression::None,
                layers: tracker.received(),
                desc: tracker.desc,
                elapsed: started.elapsed(),
            }),
            Err(e) => Err(tracker.abort(e)),
        }
    }

    async fn layers<S: KvSink + Send>(
        &mut self,
        sink: &mut S,
        tracker: &mut Tracker,
    ) -> Result<()> {
        let want = self.layout.region_bytes();
        let n = tracker.desc.dst_blocks.len();
        loop {
            let m = bounded(self.timeouts.io, "waiting for a layer", self.rx.recv()).await?;
            match m {
                Msg::Layer { layer, k, v } => {
                    tracker.start_layer(layer)?;
                    if k.len() != n || v.len() != n {
                        return Err(Error::malformed("local layer", "region count"));
                    }
                    for (kind, regions) in [(KvKind::K, k), (KvKind::V, v)] {
                        for (&block, data) in tracker.desc.dst_blocks.iter().zip(regions) {
                            if data.len() != want {
                                return Err(Error::malformed("local layer", "region size"));
                            }
                            sink.adopt_region(layer, kind, block, data)
                                .map_err(Error::Sink)?;
                        }
                    }
                    tracker.finish_layer(layer);
                    sink.layer_done(tracker.desc.request_id, layer);
                }
                Msg::End { request_id, layers } => return tracker.end(request_id, layers),
                Msg::Abort => {
                    return Err(Error::SenderAborted {
                        class: ErrorClass::Unavailable,
                    })
                }
                Msg::Begin(_) => return Err(Error::malformed("local", "BEGIN inside a transfer")),
            }
        }
    }
}

impl KvReceiver for LocalReceiver {
    async fn receive<S: KvSink + Send>(&mut self, sink: &mut S) -> Result<TransferReceipt> {
        if self.broken {
            return Err(Error::Broken);
        }
        let r = self.run(sink).await;
        let verdict = match &r {
            Ok(rc) => Verdict {
                request_id: rc.desc.request_id,
                error: None,
            },
            Err(e) if matches!(e.root(), Error::PeerClosed { .. } | Error::Timeout { .. }) => {
                self.broken = true;
                return r;
            }
            Err(e) => {
                self.broken = true;
                Verdict {
                    request_id: match e {
                        Error::Aborted { request_id, .. } => *request_id,
                        _ => 0,
                    },
                    error: Some((e.class(), e.root().to_string())),
                }
            }
        };
        let t = self.timeouts.io;
        match tokio::time::timeout(t, self.verdicts.send(verdict)).await {
            Ok(Ok(())) => r,
            _ => {
                self.broken = true;
                match r {
                    Ok(rc) => Err(aborted(
                        rc.desc.request_id,
                        rc.desc.dst_blocks,
                        Error::PeerClosed {
                            during: "sending the verdict",
                        },
                    )),
                    Err(e) => Err(e),
                }
            }
        }
    }
}
