//! Library benchmark behind `duet bench transfer --backend tcp|shm|local --bytes N
//! [--streams K]`: [`run`] measures throughput and latency from 64 KiB up to the given size
//! (×4 steps) with a reference measured in the same run (iperf3 over loopback for tcp, a
//! plain memcpy for shm and local); [`end_to_end`] measures the tail latency of a layer-by-
//! layer 1024-token transfer.
//!
//! Units: GB/s are decimal (1e9 bytes per second); latencies are microseconds.
//! Invariants: both ends run in this process on loopback / this host only; every transfer
//! is verified against its source once per size; a missing iperf3 is reported, not fatal.

mod e2e;
mod harness;
mod reference;
mod worker_path;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use duet_kv_transfer::auth::SharedSecret;
use duet_kv_transfer::backend::BackendKind;
use duet_kv_transfer::config::{Timeouts, TransferConfig};
use duet_kv_transfer::error::{Error, Result};
use duet_kv_transfer::layout::{Dtype, Fingerprint, KvKind, KvLayout};
use duet_kv_transfer::mem_sink::MemorySink;
use duet_kv_transfer::protocol::compress::{decode_region, encode_region, Compression};
use duet_kv_transfer::protocol::Integrity;

pub use e2e::{end_to_end, E2eOptions, E2eReport};
pub use worker_path::{worker_path, WorkerPathOptions, WorkerPathPoint, WorkerPathReport};

/// Bytes of one bench region (4 heads × 16 slots × 64 dims × f32).
const BENCH_REGION: u64 = 16 * 1024;
/// Smallest payload a stream can carry (one block: K + V of one layer).
const MIN_STREAM_BYTES: u64 = 2 * BENCH_REGION;
/// Bytes moved per size point, roughly (bounds the iteration count).
const ITER_BUDGET: u64 = 512 << 20;

/// Options of [`run`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchOptions {
    /// Backend to measure (tcp, shm or local).
    pub backend: BackendKind,
    /// Largest payload in bytes (default 1 GiB).
    pub max_bytes: u64,
    /// Smallest payload in bytes (default 64 KiB).
    pub min_bytes: u64,
    /// Growth factor between sizes (default 4).
    pub step: u64,
    /// Parallel connections, each carrying 1/K of the payload (default 1).
    pub streams: usize,
    /// Frame MACs on every frame (default: the library default, on).
    pub integrity: bool,
    /// Measure the reference (iperf3 / memcpy) too (default true).
    pub reference: bool,
    /// Encoding of the layers on the wire (default none).
    pub compression: Compression,
    /// shm: use the ring even where pull mode works (to compare the two).
    #[serde(default)]
    pub shm_ring: bool,
    /// Put the sender's payload and both buffers of the memcpy reference on transparent
    /// huge pages (`madvise(MADV_HUGEPAGE)`), and the receiver's blocks in a page-aligned
    /// mapping: the kernel then pins one 2 MiB page where it would pin 512 small ones, which
    /// is what limits shm pull mode on large payloads. Off: every buffer comes from the
    /// allocator, as in the workers.
    #[serde(default)]
    pub huge_pages: bool,
    /// shm pull mode: the sender's payload lives in its send arena (as a prefill worker's
    /// layers do), which the receiver maps and copies from with a memcpy; off, it lives in
    /// ordinary memory (or on huge pages) and is pulled with `process_vm_readv`.
    #[serde(default = "default_true")]
    pub shm_arena: bool,
}

fn default_true() -> bool {
    true
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            backend: BackendKind::Tcp,
            max_bytes: 1 << 30,
            min_bytes: 64 << 10,
            step: 4,
            streams: 1,
            integrity: true,
            reference: true,
            compression: Compression::None,
            shm_ring: false,
            huge_pages: false,
            shm_arena: true,
        }
    }
}

/// One payload size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchPoint {
    /// Payload bytes of one transfer round (all streams).
    pub bytes: u64,
    /// Layers × blocks per stream used to carry it.
    pub layers: u32,
    /// Blocks per stream.
    pub blocks: u32,
    /// Timed rounds.
    pub iterations: u32,
    /// Aggregate throughput of KV payload (as stored), GB/s.
    pub throughput_gbps: f64,
    /// Layer bytes the transports carried per round, from the senders' receipts (below
    /// `bytes` with compression).
    pub wire_bytes: u64,
    /// Per-transfer latency (BEGIN to verdict), median, µs.
    pub latency_us_median: f64,
    /// Per-transfer latency, min, µs.
    pub latency_us_min: f64,
    /// Per-transfer latency, max, µs.
    pub latency_us_max: f64,
    /// Reference throughput of the same size, GB/s.
    pub reference_gbps: Option<f64>,
    /// Reference time for the same size, µs.
    pub reference_latency_us: Option<f64>,
    /// `throughput_gbps / reference_gbps`.
    pub ratio_to_reference: Option<f64>,
    /// The received bytes were compared with the source and matched.
    pub verified: bool,
    /// Local backend only: every received region is the very buffer that was sent.
    pub zero_copy: Option<bool>,
}

/// Result of [`run`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// Backend measured.
    pub backend: BackendKind,
    /// Parallel connections.
    pub streams: usize,
    /// Frame MACs on.
    #[serde(alias = "checksum")]
    pub integrity: bool,
    /// Encoding of the layers on the wire.
    pub compression: Compression,
    /// `iperf3` (tcp) or `memcpy` (shm, local).
    pub reference_kind: String,
    /// Why the reference is missing, or how it was taken.
    pub reference_note: Option<String>,
    /// Zero-copy evidence for the local backend.
    pub zero_copy_note: Option<String>,
    /// shm: how the connections moved payload (`pull+arena`, `pull`, `ring`, or `mixed`).
    pub shm_mode: Option<String>,
    /// The sender's payload (and the memcpy reference) on transparent huge pages: asked for
    /// and available (THP not `never`).
    #[serde(default)]
    pub huge_pages: bool,
    /// One entry per payload size.
    pub points: Vec<BenchPoint>,
}

fn plan(bytes_per_stream: u64) -> (u32, u32) {
    let pairs = (bytes_per_stream / MIN_STREAM_BYTES).max(1);
    let layers = pairs.min(32);
    let blocks = (pairs / layers).max(1);
    (layers as u32, blocks as u32)
}

pub(crate) fn bench_layout(layers: u32) -> Result<KvLayout> {
    KvLayout::new(
        Fingerprint::digest(&[b"duet-kv-transfer bench"]),
        layers,
        4,
        64,
        16,
        Dtype::F32,
    )
}

pub(crate) fn bench_config(layout: KvLayout, integrity: bool) -> Result<TransferConfig> {
    let mut secret = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut secret);
    let mut cfg = TransferConfig::new(layout, SharedSecret::new(secret)?);
    cfg.timeouts = Timeouts {
        io: Duration::from_secs(60),
        ..Timeouts::default()
    };
    cfg.integrity = if integrity {
        Integrity::Mac
    } else {
        Integrity::Off
    };
    Ok(cfg)
}

fn sizes(opts: &BenchOptions) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = opts.min_bytes;
    while s <= opts.max_bytes {
        out.push(s);
        match s.checked_mul(opts.step) {
            Some(n) => s = n,
            None => break,
        }
    }
    out
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Runs the transfer benchmark.
pub async fn run(opts: BenchOptions) -> Result<BenchReport> {
    if opts.streams == 0 || opts.step < 2 || opts.min_bytes == 0 || opts.min_bytes > opts.max_bytes
    {
        return Err(Error::InvalidArgument(
            "bench needs streams >= 1, step >= 2 and 0 < min_bytes <= max_bytes".into(),
        ));
    }
    let rdma = cfg!(feature = "rdma") && opts.backend == BackendKind::Rdma;
    if !(rdma
        || matches!(
            opts.backend,
            BackendKind::Tcp | BackendKind::Shm | BackendKind::Local
        ))
    {
        return Err(Error::BackendUnavailable {
            backend: opts.backend.as_str(),
            reason: "the benchmark drives tcp, shm, local and (feature rdma) rdma".into(),
        });
    }
    let mut report = BenchReport {
        backend: opts.backend,
        streams: opts.streams,
        integrity: opts.integrity,
        compression: opts.compression,
        reference_kind: match opts.backend {
            BackendKind::Tcp | BackendKind::Rdma => "iperf3".into(),
            _ => "memcpy".into(),
        },
        reference_note: None,
        zero_copy_note: None,
        shm_mode: None,
        huge_pages: opts.huge_pages && duet_kv_transfer::buffer::thp_available(),
        points: Vec::new(),
    };
    for size in sizes(&opts) {
        let point = run_size(&opts, size, &mut report).await?;
        report.points.push(point);
    }
    if opts.backend == BackendKind::Local {
        let all = report.points.iter().all(|p| p.zero_copy == Some(true));
        report.zero_copy_note = Some(format!(
            "local: received payload pointers {} the sent ones for every region of every size",
            if all { "equal" } else { "DO NOT all equal" }
        ));
    }
    Ok(report)
}

async fn run_size(opts: &BenchOptions, size: u64, report: &mut BenchReport) -> Result<BenchPoint> {
    let k = opts.streams;
    let per_stream = (size / k as u64).max(MIN_STREAM_BYTES);
    let (layers, blocks) = plan(per_stream);
    let layout = bench_layout(layers)?;
    let mut cfg = bench_config(layout, opts.integrity)?;
    cfg.compression = opts.compression;
    let zero_copy = opts.backend == BackendKind::Local;
    let arena = harness::bench_arena(
        opts.backend,
        opts.shm_ring,
        opts.shm_arena,
        k.saturating_mul(harness::payload_bytes(&layout, blocks)),
    )?;
    let payload = harness::Payload::pick(arena.as_ref(), opts.huge_pages);
    let mut sinks = Vec::with_capacity(k);
    for i in 0..k {
        let mut sink = payload.sink(layout, blocks);
        if zero_copy {
            sink = sink.with_zero_copy_adoption();
        }
        let ids: Vec<u32> = (0..blocks).collect();
        sink.reserve(i as u64, &ids).map_err(Error::Sink)?;
        sinks.push(sink);
    }
    let (senders, receivers) =
        harness::connect_pairs(opts.backend, &cfg, sinks, opts.shm_ring, arena.as_ref()).await?;
    if let Some(mode) = harness::shm_mode(&senders) {
        report.shm_mode = match &report.shm_mode {
            Some(seen) if *seen != mode => Some("mixed".into()),
            _ => Some(mode),
        };
    }
    let sources: Vec<harness::Source> = (0..k)
        .map(|i| harness::Source::new(&layout, i as u64, blocks, payload))
        .collect::<Result<_>>()?;
    let actual = sources
        .iter()
        .map(|s| s.desc.payload_bytes(&layout))
        .sum::<u64>();
    let iters = (ITER_BUDGET / actual.max(1)).clamp(2, 20) as u32;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(k + 1));
    let mut tx_tasks = Vec::with_capacity(k);
    for (mut tx, src) in senders.into_iter().zip(sources.iter().cloned()) {
        let barrier = barrier.clone();
        tx_tasks.push(tokio::spawn(async move {
            harness::send_transfer(&mut tx, &src).await?; // warm-up
            barrier.wait().await;
            let start = Instant::now();
            let mut lat = Vec::with_capacity(iters as usize);
            let mut receipt = None;
            for _ in 0..iters {
                let (took, r) = harness::send_transfer(&mut tx, &src).await?;
                lat.push(took);
                receipt = Some(r);
            }
            let end = Instant::now();
            drop(tx);
            Ok::<_, Error>((start, end, lat, receipt))
        }));
    }
    barrier.wait().await;
    let mut lat_us = Vec::new();
    let mut span: Option<(Instant, Instant)> = None;
    let mut wire_bytes = 0;
    // What the senders actually used (the local backend never encodes).
    let mut compression = Compression::None;
    for t in tx_tasks {
        let (start, end, lat, receipt) = t
            .await
            .map_err(|e| Error::Internal(format!("bench sender task: {e}")))??;
        lat_us.extend(lat.iter().map(|d| d.as_secs_f64() * 1e6));
        if let Some(r) = receipt {
            wire_bytes += r.wire_bytes;
            compression = r.compression;
        }
        span = Some(match span {
            None => (start, end),
            Some((s, e)) => (s.min(start), e.max(end)),
        });
    }
    let wall = span
        .map(|(s, e)| e.duration_since(s).as_secs_f64())
        .unwrap_or_default()
        .max(1e-9);
    let sinks: Vec<MemorySink> = receivers
        .join()
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let (verified, zc) = verify(&layout, compression, &sources, &sinks, zero_copy)?;
    lat_us.sort_by(|a, b| a.total_cmp(b));
    let throughput = actual as f64 * f64::from(iters) / wall / 1e9;
    let reference = if !opts.reference {
        None
    } else if matches!(opts.backend, BackendKind::Tcp | BackendKind::Rdma) {
        match reference::iperf3(actual, k).await {
            Ok(p) => Some(p),
            Err(note) => {
                report.reference_note = Some(note);
                None
            }
        }
    } else {
        report.reference_note = Some(format!(
            "single-threaded copy_from_slice of the same size, median{}",
            match (opts.huge_pages, report.huge_pages) {
                (true, true) =>
                    ", both buffers on transparent huge pages like the sender's payload",
                (true, false) =>
                    "; huge pages were asked for but THP is off here: small pages throughout",
                _ => "",
            }
        ));
        Some(reference::memcpy(actual, iters, opts.huge_pages))
    };
    let reference_gbps = reference.map(|r| r.bytes as f64 / r.seconds / 1e9);
    Ok(BenchPoint {
        bytes: actual,
        layers,
        blocks,
        iterations: iters,
        throughput_gbps: throughput,
        wire_bytes,
        latency_us_median: percentile(&lat_us, 0.5),
        latency_us_min: percentile(&lat_us, 0.0),
        latency_us_max: percentile(&lat_us, 1.0),
        reference_gbps,
        reference_latency_us: reference.map(|r| r.seconds * 1e6 * actual as f64 / r.bytes as f64),
        ratio_to_reference: reference_gbps.map(|r| throughput / r),
        verified,
        zero_copy: zero_copy.then_some(zc),
    })
}

/// Compares every received region with its source (after the same encode and decode when
/// compressed: the lossy result is exact); for local also compares pointers.
fn verify(
    layout: &KvLayout,
    compression: Compression,
    sources: &[harness::Source],
    sinks: &[MemorySink],
    zero_copy: bool,
) -> Result<(bool, bool)> {
    let mut same = true;
    let mut ptr_equal = true;
    let mut wire = Vec::new();
    let mut expected = vec![0u8; layout.region_bytes()];
    for (src, sink) in sources.iter().zip(sinks) {
        for (l, (k, v)) in src.layers.iter().enumerate() {
            for (kind, regions) in [(KvKind::K, k), (KvKind::V, v)] {
                for (b, data) in regions.iter().enumerate() {
                    let got = sink.region(l as u32, kind, b as u32);
                    let want: &[u8] = if compression == Compression::None {
                        data
                    } else {
                        wire.clear();
                        encode_region(compression, layout, data, &mut wire)?;
                        decode_region(compression, layout, &wire, &mut expected)?;
                        &expected
                    };
                    same &= got == Some(want);
                    if zero_copy {
                        ptr_equal &= sink
                            .adopted(l as u32, kind, b as u32)
                            .is_some_and(|a| a.as_ptr() == data.as_ptr());
                    }
                }
            }
        }
    }
    Ok((same, zero_copy && ptr_equal))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_sizes() {
        assert_eq!(plan(64 << 10), (2, 1));
        assert_eq!(plan(1 << 30), (32, 1024));
        let sizes = sizes(&BenchOptions::default());
        assert_eq!(sizes.first(), Some(&(64 << 10)));
        assert_eq!(sizes.last(), Some(&(1 << 30)));
        assert_eq!(sizes.len(), 8);
    }
}
