//! Benchmark plumbing: connected sender/receiver pairs for any backend, in-process, and a
//! driver that pushes whole transfers through them.
//!
//! Invariant: receivers run on their own thread and runtime with their own [`MemorySink`],
//! return the sink when the sender closes, and never share state with the senders.

use duet_kv_transfer::buffer::Buffer;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use duet_kv_transfer::api::{KvReceiver, KvSender, TransferReceipt};
use duet_kv_transfer::backend::local;
use duet_kv_transfer::backend::shm::{SendArena, ShmMode, ShmOptions, ShmReceiver, ShmSender};
use duet_kv_transfer::backend::tcp::{TcpReceiver, TcpSender};
use duet_kv_transfer::backend::{AnyReceiver, AnySender, BackendKind};
use duet_kv_transfer::config::TransferConfig;
use duet_kv_transfer::error::{Error, Result};
use duet_kv_transfer::layout::{KvLayout, TransferDesc};
use duet_kv_transfer::mem_sink::MemorySink;

/// What a receiver thread hands back: its sink and, per transfer, when its last layer landed.
pub(crate) type ReceiverResult = Result<(MemorySink, Vec<Option<Instant>>)>;

/// Receives until the sender closes.
async fn receive_loop(mut rx: AnyReceiver, mut sink: MemorySink) -> ReceiverResult {
    let mut done = Vec::new();
    loop {
        match rx.receive(&mut sink).await {
            Ok(_) => done.push(sink.last_layer_done_at),
            Err(e) if e.is_clean_close() => return Ok((sink, done)),
            Err(e) => return Err(e),
        }
    }
}

/// The decode side of a benchmark: its own OS thread and tokio runtime (like a separate
/// decode process), so that its work never waits behind the sender's tasks.
pub(crate) struct ReceiverSide {
    results: Vec<oneshot::Receiver<ReceiverResult>>,
}

impl ReceiverSide {
    /// Waits for every receiver to finish (the senders must be dropped first).
    pub(crate) async fn join(self) -> Result<Vec<(MemorySink, Vec<Option<Instant>>)>> {
        let mut out = Vec::with_capacity(self.results.len());
        for r in self.results {
            out.push(
                r.await
                    .map_err(|_| Error::Internal("bench receiver thread died".into()))??,
            );
        }
        Ok(out)
    }
}

enum Accept {
    Tcp(std::net::TcpListener),
    #[cfg(feature = "rdma")]
    Rdma(std::net::TcpListener),
    Shm(std::path::PathBuf, ShmOptions),
    Local(Vec<local::LocalReceiver>),
}

fn spawn_receiver_thread(
    accept: Accept,
    cfg: TransferConfig,
    sinks: Vec<MemorySink>,
    ready: oneshot::Sender<Result<()>>,
) -> Result<Vec<oneshot::Receiver<ReceiverResult>>> {
    let mut txs = Vec::new();
    let mut rxs = Vec::new();
    for _ in 0..sinks.len() {
        let (t, r) = oneshot::channel();
        txs.push(t);
        rxs.push(r);
    }
    std::thread::Builder::new()
        .name("duet-kv-bench-rx".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready.send(Err(Error::io("starting the receiver runtime", e)));
                    return;
                }
            };
            rt.block_on(async move {
                let mut receivers = Vec::new();
                let accepted: Result<()> = async {
                    match accept {
                        Accept::Tcp(std_listener) => {
                            let l = TcpListener::from_std(std_listener)
                                .map_err(|e| Error::io("adopting the bench listener", e))?;
                            let _ = ready.send(Ok(()));
                            let rx = TcpReceiver::new(l, cfg);
                            for _ in 0..txs.len() {
                                receivers.push(AnyReceiver::from(rx.accept().await?));
                            }
                        }
                        #[cfg(feature = "rdma")]
                        Accept::Rdma(std_listener) => {
                            use duet_kv_transfer::backend::rdma::{RdmaOptions, RdmaReceiver};
                            let l = TcpListener::from_std(std_listener)
                                .map_err(|e| Error::io("adopting the bench listener", e))?;
                            let rx = RdmaReceiver::new(l, cfg, RdmaOptions::default())?;
                            let _ = ready.send(Ok(()));
                            for _ in 0..txs.len() {
                                receivers.push(AnyReceiver::from(rx.accept().await?));
                            }
                        }
                        Accept::Shm(path, opts) => {
                            let rx = ShmReceiver::bind(&path, cfg, opts)?;
                            let _ = ready.send(Ok(()));
                            for _ in 0..txs.len() {
                                receivers.push(AnyReceiver::from(rx.accept().await?));
                            }
                        }
                        Accept::Local(rs) => {
                            let _ = ready.send(Ok(()));
                            receivers.extend(rs.into_iter().map(AnyReceiver::from));
                        }
                    }
                    Ok(())
                }
                .await;
                if let Err(e) = accepted {
                    for t in txs {
                        let _ = t.send(Err(Error::Internal(format!("bench accept: {e}"))));
                    }
                    return;
                }
                let mut tasks = Vec::new();
                for ((rx, sink), t) in receivers.into_iter().zip(sinks).zip(txs) {
                    tasks.push(tokio::spawn(async move {
                        let _ = t.send(receive_loop(rx, sink).await);
                    }));
                }
                for task in tasks {
                    let _ = task.await;
                }
            });
        })
        .map_err(|e| Error::io("starting the receiver thread", e))?;
    Ok(rxs)
}

/// `sinks.len()` connected pairs of `backend`: senders on the caller's runtime, receivers
/// on their own thread.
/// How the shm senders among `senders` move payload (`pull`, `ring`, `mixed`); None when
/// there are none.
pub(crate) fn shm_mode(senders: &[AnySender]) -> Option<String> {
    let mut modes = senders.iter().filter_map(|s| match s {
        #[cfg(unix)]
        AnySender::Shm(s) => Some(match (s.mode(), s.arena_shared()) {
            (ShmMode::Pull, true) => "pull+arena",
            (ShmMode::Pull, false) => "pull",
            (ShmMode::Ring, _) => "ring",
        }),
        _ => None,
    });
    let first = modes.next()?;
    Some(if modes.all(|m| m == first) {
        first.to_string()
    } else {
        "mixed".into()
    })
}

/// A non-blocking loopback listener on a free port (handed to the receiver thread).
fn bind_loopback() -> Result<(std::net::TcpListener, std::net::SocketAddr)> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| Error::io("binding the bench listener", e))?;
    let addr = l
        .local_addr()
        .map_err(|e| Error::io("reading the listener address", e))?;
    Ok((l, addr))
}

/// The senders' send arena for an shm pull-mode run that asks for one (`bytes` of payload),
/// else `None`.
pub(crate) fn bench_arena(
    backend: BackendKind,
    shm_ring: bool,
    shm_arena: bool,
    bytes: usize,
) -> Result<Option<Arc<SendArena>>> {
    if backend != BackendKind::Shm || shm_ring || !shm_arena {
        return Ok(None);
    }
    Ok(Some(SendArena::new(bytes)?))
}

pub(crate) async fn connect_pairs(
    backend: BackendKind,
    cfg: &TransferConfig,
    sinks: Vec<MemorySink>,
    shm_ring: bool,
    arena: Option<&Arc<SendArena>>,
) -> Result<(Vec<AnySender>, ReceiverSide)> {
    let k = sinks.len();
    let mut senders = Vec::with_capacity(k);
    let (ready_tx, ready_rx) = oneshot::channel();
    let results = match backend {
        #[cfg(feature = "rdma")]
        BackendKind::Rdma => {
            use duet_kv_transfer::backend::rdma::{RdmaOptions, RdmaSender};
            let (l, addr) = bind_loopback()?;
            let results = spawn_receiver_thread(Accept::Rdma(l), cfg.clone(), sinks, ready_tx)?;
            wait_ready(ready_rx).await?;
            for _ in 0..k {
                let tx = RdmaSender::connect(addr, cfg, &RdmaOptions::default()).await?;
                senders.push(AnySender::from(tx));
            }
            results
        }
        BackendKind::Tcp => {
            let (l, addr) = bind_loopback()?;
            let results = spawn_receiver_thread(Accept::Tcp(l), cfg.clone(), sinks, ready_tx)?;
            wait_ready(ready_rx).await?;
            for _ in 0..k {
                senders.push(AnySender::from(TcpSender::connect(addr, cfg).await?));
            }
            results
        }
        BackendKind::Shm => {
            let opts = ShmOptions {
                pull: !shm_ring,
                ..ShmOptions::default()
            };
            let dir = opts.dir.clone();
            let path = std::env::temp_dir().join(format!(
                "duet-kv-bench-{}-{}.sock",
                std::process::id(),
                rand::random::<u64>()
            ));
            let results = spawn_receiver_thread(
                Accept::Shm(path.clone(), opts),
                cfg.clone(),
                sinks,
                ready_tx,
            )?;
            wait_ready(ready_rx).await?;
            for _ in 0..k {
                let tx = ShmSender::connect_with_arena(&path, cfg, &dir, arena).await?;
                senders.push(AnySender::from(tx));
            }
            results
        }
        BackendKind::Local => {
            let mut receivers = Vec::with_capacity(k);
            for _ in 0..k {
                let (s, r) = local::pair(cfg.layout, cfg.layout, cfg.timeouts)?;
                receivers.push(r);
                senders.push(AnySender::from(s));
            }
            let results =
                spawn_receiver_thread(Accept::Local(receivers), cfg.clone(), sinks, ready_tx)?;
            wait_ready(ready_rx).await?;
            results
        }
        other => {
            return Err(Error::BackendUnavailable {
                backend: other.as_str(),
                reason: "the benchmark drives tcp, shm, local and (feature rdma) rdma".into(),
            })
        }
    };
    Ok((senders, ReceiverSide { results }))
}

async fn wait_ready(rx: oneshot::Receiver<Result<()>>) -> Result<()> {
    match tokio::time::timeout(Duration::from_secs(10), rx).await {
        Ok(Ok(r)) => r,
        _ => Err(Error::Internal(
            "bench receiver thread did not start".into(),
        )),
    }
}

/// Where a source's payload lives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Payload<'a> {
    /// An allocator buffer (as the workers' buffers without a send arena).
    Heap,
    /// A page-aligned mapping advised onto transparent huge pages.
    HugePages,
    /// The senders' send arena.
    Arena(&'a Arc<SendArena>),
}

impl<'a> Payload<'a> {
    /// The send arena when there is one, else huge pages when asked for, else the heap.
    pub(crate) fn pick(arena: Option<&'a Arc<SendArena>>, huge: bool) -> Self {
        match arena {
            Some(a) => Payload::Arena(a),
            None if huge => Payload::HugePages,
            None => Payload::Heap,
        }
    }

    /// A receiver's `blocks` blocks aligned like this payload (see `buffer`): page-aligned
    /// unless the payload comes from the allocator.
    pub(crate) fn sink(self, layout: KvLayout, blocks: u32) -> MemorySink {
        match self {
            Payload::Heap => MemorySink::new(layout, blocks),
            _ => MemorySink::new_page_aligned(layout, blocks),
        }
    }
}

/// Payload bytes of one stream's transfer of `blocks` blocks (every layer, K and V).
pub(crate) fn payload_bytes(layout: &KvLayout, blocks: u32) -> usize {
    layout.layers() as usize * 2 * blocks as usize * layout.region_bytes()
}

/// The source of one stream: per layer, the K and V regions as `Bytes` slices of one
/// allocation.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    pub desc: TransferDesc,
    pub layers: Vec<(Vec<Bytes>, Vec<Bytes>)>,
}

impl Source {
    /// Fills a buffer with finite f32 values (a pattern of period 251, so compressed
    /// encodings have something to round) and slices it into regions; the buffer lives
    /// where `payload` says.
    pub(crate) fn new(
        layout: &KvLayout,
        request_id: u64,
        blocks: u32,
        payload: Payload<'_>,
    ) -> Result<Source> {
        let region = layout.region_bytes();
        let n = blocks as usize;
        let total = payload_bytes(layout, blocks);
        let fill = |data: &mut [u8]| {
            for (i, w) in data.chunks_exact_mut(4).enumerate() {
                w.copy_from_slice(&((i % 251) as f32 * 0.01 - 1.25).to_le_bytes());
            }
        };
        let data = match payload {
            Payload::Arena(arena) => {
                let mut buf = arena.alloc(total).ok_or_else(|| {
                    Error::Internal(format!("the bench's send arena has no {total} bytes free"))
                })?;
                fill(&mut buf);
                Bytes::from_owner(buf)
            }
            other => {
                let mut buf = Buffer::payload(total, matches!(other, Payload::HugePages));
                fill(&mut buf);
                buf.freeze()
            }
        };
        let mut layers = Vec::with_capacity(layout.layers() as usize);
        for l in 0..layout.layers() as usize {
            let base = l * 2 * n * region;
            let k = (0..n)
                .map(|b| data.slice(base + b * region..base + (b + 1) * region))
                .collect();
            let v = (0..n)
                .map(|b| data.slice(base + (n + b) * region..base + (n + b + 1) * region))
                .collect();
            layers.push((k, v));
        }
        Ok(Source {
            desc: TransferDesc {
                request_id,
                token_start: 0,
                token_count: blocks * layout.block_size(),
                dst_blocks: (0..blocks).collect(),
            },
            layers,
        })
    }
}

/// Sends one whole transfer with owned buffers, as the prefill worker does (`local` hands
/// them over, shm pull mode keeps layers in flight); returns its latency (BEGIN to verdict)
/// and the sender's receipt.
pub(crate) async fn send_transfer(
    tx: &mut AnySender,
    src: &Source,
) -> Result<(Duration, TransferReceipt)> {
    let start = Instant::now();
    tx.begin(src.desc.clone()).await?;
    for (layer, (k, v)) in src.layers.iter().enumerate() {
        tx.send_layer_bytes(layer as u32, k.clone(), v.clone())
            .await?;
    }
    let receipt = tx.finish().await?;
    Ok((start.elapsed(), receipt))
}
