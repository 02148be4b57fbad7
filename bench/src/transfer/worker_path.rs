//! `duet bench transfer --end-to-end`: the KV path the workers run, from a prefill worker's
//! KV pool to a decode worker's, beside memcpy in the same run.
//!
//! What runs is the workers' own code, not the benchmark's stand-ins: the sending side takes
//! each layer's regions in place from a real paged KV cache of the model (f16, the default
//! layout, placed by the prefill worker's `scratch_pool`) with `KvCache::pinned_regions` (pinned
//! `Bytes` over its pool, what the prefill worker sends) and sends
//! them with `send_layer_bytes` over a connection made as `duet prefill` makes it (over shm
//! the pool lives in the send arena the receiver maps); the receiving side is a real decode worker engine
//! (`DecodeHandle` over the model) behind `kv_inbound::serve`, the function `duet decode`
//! runs: the header is checked against the engine's reservations, the regions are written
//! straight into the reserved blocks of the engine's pool under the reservation's lease,
//! MACs verified. Only the prefill's forward pass is left out (its cost is the engine
//! benchmark's).
//!
//! Invariant: a point's time runs from the first `begin` to the moment a `release` of the
//! last request is answered; the sender's `finish` returns only on the receiver's verdict,
//! sent once the last byte is in the decode worker's pool and checked. Reservations are made
//! before the clock starts, as the decode worker makes them before it asks for the prefill.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::RngCore;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{bench_config, reference};
use duet_decode_worker::{DecodeConfig, DecodeHandle};
use duet_engine::{EngineModel, KvCache, KvCacheConfig, KvDtype, KvKind, LoadOptions, Model};
use duet_kv_transfer::api::KvSender;
use duet_kv_transfer::backend::shm::{ShmOptions, ShmReceiver, ShmSender};
use duet_kv_transfer::backend::tcp::{TcpReceiver, TcpSender};
use duet_kv_transfer::backend::{AnySender, BackendKind};
use duet_kv_transfer::config::TransferConfig;
use duet_kv_transfer::error::{Error, Result};
use duet_kv_transfer::layout::TransferDesc;
use duet_kv_transfer::Inbound;

/// Longest prompt one request carries here (the model's context is 8192).
const MAX_REQUEST_TOKENS: usize = 4096;

/// Options of [`worker_path`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerPathOptions {
    /// tcp or shm (the default between processes of one host).
    pub backend: BackendKind,
    /// The GGUF whose KV layout and decode engine are used.
    pub model: PathBuf,
    /// Payload sizes, bytes (each rounded down to whole blocks).
    pub sizes: Vec<u64>,
    /// Measured runs per size, alternating with memcpy (median reported).
    pub runs: u32,
    /// Frame MACs (the default).
    pub integrity: bool,
}

/// One size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerPathPoint {
    pub bytes: u64,
    /// Requests the payload was split into (at most 4096 tokens each).
    pub requests: usize,
    pub seconds_median: f64,
    pub gbps: f64,
    /// memcpy of the same bytes in the same run, median.
    pub memcpy_gbps: f64,
    pub ratio_to_memcpy: f64,
    /// Copies of each payload byte made by the workers' code, counted over the measured
    /// runs: the decode worker's into its pool (`duet_decode_worker::copies`); the prefill
    /// worker sends in place. (A kernel's copies over tcp are not counted.)
    pub copies_per_byte: f64,
}

/// Result of [`worker_path`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerPathReport {
    pub backend: BackendKind,
    pub integrity: bool,
    /// KV bytes per token of the model's layout (f16).
    pub bytes_per_token: u64,
    pub points: Vec<WorkerPathPoint>,
}

/// The receiving decode worker: its engine and its KV endpoint.
struct Decode {
    handle: DecodeHandle,
    cancel: CancellationToken,
    tcp: Option<std::net::SocketAddr>,
    shm: Option<(PathBuf, PathBuf)>,
}

async fn start_decode(
    opts: &WorkerPathOptions,
    tcfg: TransferConfig,
    model: Arc<EngineModel>,
    blocks: usize,
) -> Result<Decode> {
    let kv = KvCacheConfig {
        block_size: 16,
        num_blocks: blocks,
        dtype: KvDtype::F16,
    };
    let cancel = CancellationToken::new();
    let cfg = DecodeConfig {
        prefix_cache: None,
        ..DecodeConfig::default()
    };
    let handle = DecodeHandle::start(model, kv, cfg, cancel.clone())
        .map_err(|e| Error::Internal(format!("decode engine: {e}")))?;
    let mut inbound = Inbound::default();
    let (mut tcp, mut shm) = (None, None);
    match opts.backend {
        BackendKind::Tcp => {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| Error::io("binding", e))?;
            tcp = Some(l.local_addr().map_err(|e| Error::io("binding", e))?);
            inbound.tcp = Some(TcpReceiver::new(l, tcfg));
        }
        BackendKind::Shm => {
            let opts = ShmOptions::default();
            let tag = format!("bench-e2e-{}", rand::random::<u32>());
            let rx = ShmReceiver::bind_in(&tag, tcfg, opts.clone()).await?;
            shm = Some((rx.path().to_path_buf(), opts.dir));
            inbound.shm = Some(rx);
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "--end-to-end runs the workers' tcp or shm path, not {other:?}"
            )))
        }
    }
    tokio::spawn(duet_decode_worker::kv_inbound::serve(
        inbound,
        handle.clone(),
        cancel.clone(),
    ));
    Ok(Decode {
        handle,
        cancel,
        tcp,
        shm,
    })
}

/// Runs the measurement.
pub async fn worker_path(opts: WorkerPathOptions) -> Result<WorkerPathReport> {
    if opts.runs == 0 || opts.sizes.is_empty() {
        return Err(Error::InvalidArgument(
            "--end-to-end needs runs >= 1 and a size".into(),
        ));
    }
    let model = Model::load(&opts.model, LoadOptions::default())
        .map_err(|e| Error::InvalidArgument(format!("{}: {e}", opts.model.display())))?;
    let layout = model.kv_layout(16, KvDtype::F16);
    if layout.groups.is_grouped() {
        // Its pools and sends below address one block table for every layer.
        return Err(Error::InvalidArgument(format!(
            "{}: --end-to-end measures models whose layers share one block table; this \
             model's local layers keep their own (layer groups)",
            opts.model.display()
        )));
    }
    let model = Arc::new(EngineModel::from(model));
    let block_bytes = (layout.region_bytes() * 2 * layout.n_layers) as u64;
    let max = opts.sizes.iter().copied().max().unwrap_or(0);
    let blocks = (max / block_bytes) as usize + 8;
    // One secret for both ends, as a cluster shares it.
    let tcfg = bench_config(
        duet_worker_common::transfer_layout(&layout)?,
        opts.integrity,
    )?;
    let decode = start_decode(&opts, tcfg.clone(), model, blocks).await?;
    // The prefill worker's pool, in its send arena over shm as `duet prefill` places it,
    // with the largest payload's prompt in it.
    let arena = match opts.backend {
        BackendKind::Shm => Some(duet_prefill_worker::send_pool::pool_arena(&layout, blocks)?),
        _ => None,
    };
    let mut prefill =
        duet_prefill_worker::send_pool::scratch_pool(arena.as_ref(), layout.clone(), blocks)
            .map_err(|e| Error::Internal(e.to_string()))?;
    let mut rng = rand::rng();
    let src_blocks = prefill
        .reserve_sequence(1, blocks * 16)
        .map_err(|e| Error::Internal(e.to_string()))?;
    for &b in &src_blocks {
        for l in 0..layout.n_layers {
            for k in [KvKind::K, KvKind::V] {
                // Finite f16 values (random bytes would hold NaNs, which nothing checks).
                for (i, x) in prefill.region_bytes_mut(b, l, k).iter_mut().enumerate() {
                    *x = if i % 2 == 1 {
                        0x3c
                    } else {
                        rng.next_u32() as u8
                    };
                }
            }
        }
    }
    let mut tx: AnySender = match (&decode.tcp, &decode.shm) {
        (Some(addr), _) => TcpSender::connect(addr, &tcfg).await?.into(),
        (_, Some((path, dir))) => ShmSender::connect_with_arena(path, &tcfg, dir, arena.as_ref())
            .await?
            .into(),
        _ => return Err(Error::Internal("no endpoint".into())),
    };
    let mut next_id = 100u64;
    let mut points = Vec::new();
    for &size in &opts.sizes {
        let tokens = ((size / block_bytes) * 16) as usize;
        if tokens == 0 {
            continue;
        }
        let requests = tokens.div_ceil(MAX_REQUEST_TOKENS);
        let per = (tokens / requests).div_ceil(16) * 16;
        let bytes = (per / 16) as u64 * block_bytes * requests as u64;
        let (mut times, mut memcpys) = (Vec::new(), Vec::new());
        let mut copied = 0u64;
        // A warm-up round, then `runs` measured ones alternating with memcpy.
        for run in 0..=opts.runs {
            let before = copied_so_far();
            let t = one_round(
                &decode.handle,
                &prefill,
                &src_blocks,
                &mut tx,
                (per, requests),
                &mut next_id,
            )
            .await?;
            if run > 0 {
                copied += copied_so_far() - before;
                times.push(t.as_secs_f64());
                memcpys.push(reference::memcpy(bytes, 3, false).seconds);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        memcpys.sort_by(|a, b| a.total_cmp(b));
        let (t, m) = (times[times.len() / 2], memcpys[memcpys.len() / 2]);
        let gbps = bytes as f64 / t / 1e9;
        let memcpy_gbps = bytes as f64 / m / 1e9;
        points.push(WorkerPathPoint {
            bytes,
            requests,
            seconds_median: t,
            gbps,
            memcpy_gbps,
            ratio_to_memcpy: gbps / memcpy_gbps,
            copies_per_byte: copied as f64 / (bytes as f64 * f64::from(opts.runs)),
        });
    }
    drop(tx);
    decode.cancel.cancel();
    Ok(WorkerPathReport {
        backend: opts.backend,
        integrity: opts.integrity,
        bytes_per_token: layout.bytes_per_token() as u64,
        points,
    })
}

/// Payload bytes the workers' code copied so far in this process: the prefill worker sends
/// its regions in place, so these are the decode worker's, into its pool.
fn copied_so_far() -> u64 {
    duet_decode_worker::copies::into_pool_bytes()
}

/// Reserves `requests` prompts of `per` tokens at the decode worker, then sends each from
/// the prefill pool as the prefill worker does and waits until the last byte is in the
/// decode worker's pool. Returns the time from the first `begin`.
async fn one_round(
    decode: &DecodeHandle,
    prefill: &KvCache,
    src_blocks: &[u32],
    tx: &mut AnySender,
    (per, requests): (usize, usize),
    next_id: &mut u64,
) -> Result<Duration> {
    let ttl = Duration::from_secs(60);
    let mut reserved = Vec::with_capacity(requests);
    for _ in 0..requests {
        *next_id += 1;
        let r = decode
            .reserve(
                *next_id,
                per,
                ttl,
                Vec::new(),
                duet_engine::AttentionPolicy::Full,
            )
            .await
            .map_err(|e| Error::Internal(format!("reserve: {e}")))?;
        reserved.push((*next_id, r.blocks));
    }
    let t0 = Instant::now();
    let layers = decode.layout().n_layers;
    for (i, (id, dst)) in reserved.iter().enumerate() {
        let src = &src_blocks[i * dst.len()..(i + 1) * dst.len()];
        tx.begin(TransferDesc {
            request_id: *id,
            token_start: 0,
            token_count: per as u32,
            dst_blocks: dst.clone(),
        })
        .await?;
        for layer in 0..layers {
            let (k, v) = prefill.pinned_regions(layer, src);
            tx.send_layer_bytes(layer as u32, k, v).await?;
        }
        tx.finish().await?;
    }
    // Every transfer's verdict came after its bytes were placed; the releases end the round.
    for (id, _) in &reserved {
        if !decode.release(*id).await {
            return Err(Error::Internal(format!("request {id} was not held")));
        }
    }
    Ok(t0.elapsed())
}
