//! A whole prefill worker on a gRPC listener the caller bound: engine thread, the KV
//! connector (tcp, shm with its send arena, in-process, rdma), registry record with live
//! load, the `duet.v1.Prefill` and `duet.v1.KvCache` services, and graceful shutdown.
//! `duet prefill`, `duet up` and in-process tests start it the same way:
//!
//! ```text
//! PrefillWorker { id, model, cache, config, transfer }.serve(server, kv, shutdown).await
//! ```
//!
//! Shutdown order: the registry key goes first, then the server drains, then the engine
//! thread stops (its guard drops when `serve` returns).

use std::sync::Arc;

use duet_discovery::{Capacity, KvEndpoint, Role};
use duet_engine::{EngineModel, KvCacheConfig};
use duet_kv_transfer::backend::shm::SendArena;
use duet_kv_transfer::{Connector, LocalHub, TransferConfig};
use duet_worker_common::kv_events::KvCacheService;
use duet_worker_common::{ShmSetting, StartError, WorkerServer};
use tokio_util::sync::CancellationToken;

use crate::service::PrefillService;
use crate::{PrefillConfig, PrefillHandle};

/// How a prefill worker sends KV: tcp always; these add faster paths where the decode
/// worker offers them.
#[derive(Default)]
pub struct KvSenders {
    /// Same-host shared memory (and whether the KV pool lives in its send arena).
    pub shm: Option<ShmSetting>,
    /// The in-process hub and this process's tag (all-in-one mode).
    pub local: Option<(LocalHub, String)>,
    /// UCX options: prefer rdma toward decode workers that offer it.
    #[cfg(feature = "rdma")]
    pub rdma: Option<duet_kv_transfer::backend::rdma::RdmaOptions>,
}

/// A prefill worker's engine side.
pub struct PrefillWorker {
    pub id: String,
    pub model: Arc<EngineModel>,
    /// Its scratch KV pool.
    pub cache: KvCacheConfig,
    pub config: PrefillConfig,
    /// The KV link's settings (secret, timeouts, checksums).
    pub transfer: TransferConfig,
}

impl PrefillWorker {
    /// Runs the worker until `shutdown` fires and its server has drained.
    pub async fn serve(
        self,
        server: WorkerServer,
        kv: KvSenders,
        shutdown: CancellationToken,
    ) -> Result<(), StartError> {
        let PrefillWorker {
            id,
            model,
            cache,
            config,
            transfer,
        } = self;
        duet_worker_common::device_memory::record(&id, &model, &cache);
        let engine_stop = CancellationToken::new();
        let _stop_engine = engine_stop.clone().drop_guard();
        let connector = Connector::new(transfer, kv.local.as_ref().map(|(h, _)| h.clone()))
            .with_shm(kv.shm.is_some())
            .with_send_arena(send_arena(kv.shm.as_ref(), &model, &cache));
        #[cfg(feature = "rdma")]
        let connector = {
            if let Some(o) = &kv.rdma {
                // Asked for: a missing UCX stops the worker rather than silently using tcp.
                duet_kv_transfer::backend::rdma::probe(o).map_err(|e| {
                    StartError::Config(format!("--kv-rdma: UCX does not start: {e}"))
                })?;
            }
            connector.with_rdma(kv.rdma.clone())
        };
        let handle = PrefillHandle::start(
            model.clone(),
            cache,
            PrefillConfig {
                id: id.clone(),
                ..config
            },
            Arc::new(connector),
            tokio::runtime::Handle::current(),
            engine_stop.clone(),
        )
        .map_err(|e| StartError::Worker(format!("prefill worker {id}: {e}")))?;
        let mut rec = server.record(Role::Prefill, &id, model.fingerprint())?;
        if let Some((_, tag)) = &kv.local {
            // "Reaches the local KV listeners of process `tag`".
            rec.kv_endpoints.push(KvEndpoint {
                transport: "local".into(),
                address: tag.clone(),
            });
        }
        let block_size = handle.block_size();
        let reg = server
            .register_and_publish(rec, engine_stop.clone(), {
                let handle = handle.clone();
                move || capacity(&handle, block_size)
            })
            .await?;
        println!(
            "duet: prefill worker {id} serving gRPC on {}",
            server.grpc_addr()?
        );
        let kv_cache = KvCacheService::new(
            handle.kv_events().clone(),
            {
                let h = handle.clone();
                Arc::new(move |hashes| h.prefetch(hashes))
            },
            shutdown.clone(),
        );
        let peers = server.peers(&engine_stop);
        let routes =
            tonic::service::Routes::new(PrefillService::new(handle, id, peers).into_server())
                .add_service(kv_cache.into_server());
        let services = ["duet.v1.Prefill", "duet.v1.KvCache"];
        server.serve_until(routes, &services, reg, shutdown).await
    }
}

/// The send arena the KV pool lives in, when asked for: as large as the pool. One the
/// kernel refuses (no memfd here) is a warning: the pool is then ordinary memory, which
/// same-host decode workers read with process_vm_readv.
fn send_arena(
    shm: Option<&ShmSetting>,
    model: &EngineModel,
    kv: &KvCacheConfig,
) -> Option<Arc<SendArena>> {
    if !shm?.pool_in_arena {
        return None;
    }
    let layout = model.kv_layout(kv.block_size, kv.dtype).ok()?;
    crate::send_pool::pool_arena(&layout, kv.num_blocks)
        .inspect_err(
            |e| tracing::warn!(error = %e, "no KV send arena: the KV pool is ordinary memory"),
        )
        .ok()
}

/// The registry's view of this worker's load.
fn capacity(h: &PrefillHandle, block_size: u32) -> Capacity {
    let s = h.status();
    Capacity {
        kv_blocks_total: s.kv_blocks_total,
        kv_blocks_free: s.kv_blocks_free,
        kv_blocks_cached: s.kv_blocks_cached,
        block_size,
        running: s.running,
        waiting: s.queued,
        queued_prefill_tokens: s.queued_prefill_tokens,
        max_batch: 0,
        tokens_per_second: s.tokens_per_second,
        kv_groups: s.kv_groups,
    }
}
