//! End-to-end figure: a 1024-token prompt of the default model (30 layers, 45 KiB/token f32)
//! sent layer by layer while a simulated prefill computes the next layer. The figure is the
//! time from handing the last layer to the sender until the receiver placed its last byte.
//!
//! Invariant: both timestamps come from the same process clock (`Instant`): the sender's just
//! before the last `send_layer`, the receiver's in `KvSink::layer_done` of the last layer.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::harness;
use super::{bench_config, percentile};
use duet_kv_transfer::api::KvSender;
use duet_kv_transfer::backend::BackendKind;
use duet_kv_transfer::error::{Error, Result};
use duet_kv_transfer::layout::{Dtype, Fingerprint, KvLayout};
use duet_kv_transfer::protocol::Compression;

/// Options of [`end_to_end`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct E2eOptions {
    /// Backend (tcp, shm or local).
    pub backend: BackendKind,
    /// Prompt length in tokens (default 1024).
    pub tokens: u32,
    /// Simulated compute time of one layer (default 2 ms).
    pub compute_per_layer: Duration,
    /// Measured runs (default 5).
    pub runs: u32,
    /// Frame MACs (the default).
    #[serde(alias = "checksum")]
    pub integrity: bool,
    /// Encoding of the layers on the wire.
    pub compression: Compression,
    /// shm: use the ring even where pull mode works.
    #[serde(default)]
    pub shm_ring: bool,
    /// shm pull mode: the sender's layers live in its send arena (see [`super::BenchOptions`]).
    #[serde(default = "super::default_true")]
    pub shm_arena: bool,
}

impl Default for E2eOptions {
    fn default() -> Self {
        E2eOptions {
            backend: BackendKind::Tcp,
            tokens: 1024,
            compute_per_layer: Duration::from_millis(2),
            runs: 5,
            integrity: true,
            compression: Compression::None,
            shm_ring: false,
            shm_arena: true,
        }
    }
}

/// Result of [`end_to_end`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E2eReport {
    /// Backend measured.
    pub backend: BackendKind,
    /// Prompt tokens.
    pub tokens: u32,
    /// Layers (30).
    pub layers: u32,
    /// KV bytes per token (46080 = 45 KiB).
    pub bytes_per_token: u64,
    /// Total payload bytes.
    pub total_bytes: u64,
    /// Payload bytes per layer frame.
    pub layer_bytes: u64,
    /// Simulated compute per layer, µs.
    pub compute_per_layer_us: f64,
    /// Last layer handed to the sender → last byte placed at the receiver; median, µs.
    pub tail_us_median: f64,
    /// Same, min, µs.
    pub tail_us_min: f64,
    /// Same, max, µs.
    pub tail_us_max: f64,
    /// For comparison: the whole transfer sent back to back (no pipelining), median, µs.
    pub whole_transfer_us_median: f64,
    /// shm: how the connection moved payload (`pull+arena`, `pull` or `ring`).
    pub shm_mode: Option<String>,
}

fn model_layout() -> Result<KvLayout> {
    KvLayout::new(
        Fingerprint::digest(&[b"duet-kv-transfer e2e"]),
        30,
        3,
        64,
        16,
        Dtype::F32,
    )
}

/// Runs the end-to-end measurement.
pub async fn end_to_end(opts: E2eOptions) -> Result<E2eReport> {
    if opts.runs == 0 || opts.tokens == 0 {
        return Err(Error::InvalidArgument(
            "e2e needs runs >= 1 and tokens >= 1".into(),
        ));
    }
    let layout = model_layout()?;
    let blocks = layout.blocks_for_tokens(opts.tokens);
    let mut cfg = bench_config(layout, opts.integrity)?;
    cfg.compression = opts.compression;
    let zero_copy = opts.backend == BackendKind::Local;
    let arena = harness::bench_arena(
        opts.backend,
        opts.shm_ring,
        opts.shm_arena,
        harness::payload_bytes(&layout, blocks),
    )?;
    let payload = harness::Payload::pick(arena.as_ref(), false);
    let mut sink = payload.sink(layout, blocks);
    if zero_copy {
        sink = sink.with_zero_copy_adoption();
    }
    let ids: Vec<u32> = (0..blocks).collect();
    sink.reserve(0, &ids).map_err(Error::Sink)?;
    let (mut senders, receiver) = harness::connect_pairs(
        opts.backend,
        &cfg,
        vec![sink],
        opts.shm_ring,
        arena.as_ref(),
    )
    .await?;
    let shm_mode = harness::shm_mode(&senders);
    let Some(mut tx) = senders.pop() else {
        return Err(Error::Internal("no bench pair".into()));
    };
    let src = harness::Source::new(&layout, 0, blocks, payload)?;
    // Warm-up, then `runs` pipelined runs, then `runs` back-to-back runs.
    harness::send_transfer(&mut tx, &src).await?;
    let mut handed = Vec::new();
    for _ in 0..opts.runs {
        tx.begin(src.desc.clone()).await?;
        let last = src.layers.len() - 1;
        for (layer, (k, v)) in src.layers.iter().enumerate() {
            tokio::time::sleep(opts.compute_per_layer).await; // the prefill computes this layer
            if layer == last {
                handed.push(Instant::now());
            }
            tx.send_layer_bytes(layer as u32, k.clone(), v.clone())
                .await?;
        }
        tx.finish().await?;
    }
    let mut whole = Vec::new();
    for _ in 0..opts.runs {
        whole.push(harness::send_transfer(&mut tx, &src).await?.0.as_secs_f64() * 1e6);
    }
    drop(tx);
    let done = receiver
        .join()
        .await?
        .pop()
        .map(|(_, done)| done)
        .unwrap_or_default();
    let mut tails: Vec<f64> = handed
        .iter()
        .zip(done.iter().skip(1))
        .filter_map(|(h, d)| d.map(|d| d.saturating_duration_since(*h).as_secs_f64() * 1e6))
        .collect();
    tails.sort_by(|a, b| a.total_cmp(b));
    whole.sort_by(|a, b| a.total_cmp(b));
    Ok(E2eReport {
        backend: opts.backend,
        tokens: opts.tokens,
        layers: layout.layers(),
        bytes_per_token: layout.bytes_per_token(),
        total_bytes: src.desc.payload_bytes(&layout),
        layer_bytes: layout.layer_frame_bytes(blocks as usize),
        compute_per_layer_us: opts.compute_per_layer.as_secs_f64() * 1e6,
        tail_us_median: percentile(&tails, 0.5),
        tail_us_min: percentile(&tails, 0.0),
        tail_us_max: percentile(&tails, 1.0),
        whole_transfer_us_median: percentile(&whole, 0.5),
        shm_mode,
    })
}
