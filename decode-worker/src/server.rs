//! A whole decode worker on listeners the caller bound: engine thread, KV receivers (tcp,
//! shm, in-process, rdma), registry record with live capacity, the `duet.v1.Decode` and
//! `duet.v1.KvCache` services, and graceful shutdown. `duet decode`, `duet up` and
//! in-process tests start it the same way:
//!
//! ```text
//! DecodeWorker { id, model, cache, config, transfer }.serve(server, kv, shutdown).await
//! ```
//!
//! Shutdown order: the registry key goes first, then the server drains, then the engine
//! thread stops (its guard drops when `serve` returns) and frees every block.

use std::sync::Arc;

use duet_discovery::{Capacity, KvEndpoint, Role};
use duet_engine::{EngineModel, KvCacheConfig};
use duet_kv_transfer::backend::shm::{host_identity, ShmOptions, ShmReceiver};
use duet_kv_transfer::backend::tcp::TcpReceiver;
use duet_kv_transfer::{Endpoint, Inbound, LocalHub, TransferConfig};
use duet_proto::v1 as pb;
use duet_serving::channels::Channels;
use duet_worker_common::kv_events::KvCacheService;
use duet_worker_common::{ShmSetting, StartError, WorkerServer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::service::DecodeService;
use crate::{kv_inbound, DecodeConfig, DecodeHandle};

/// Where a decode worker receives KV. At least one must be offered.
#[derive(Default)]
pub struct KvReceivers {
    /// A bound tcp listener.
    pub tcp: Option<TcpListener>,
    /// Same-host shared memory.
    pub shm: Option<ShmSetting>,
    /// The in-process hub and this process's tag (all-in-one mode).
    pub local: Option<(LocalHub, String)>,
    /// UCX: the bound control listener and its options.
    #[cfg(feature = "rdma")]
    pub rdma: Option<(TcpListener, duet_kv_transfer::backend::rdma::RdmaOptions)>,
    /// Host prefill workers reach the tcp and rdma endpoints at (default: the server's
    /// advertised host).
    pub advertise_host: Option<String>,
}

/// A decode worker's engine side.
pub struct DecodeWorker {
    pub id: String,
    pub model: Arc<EngineModel>,
    /// Its KV pool.
    pub cache: KvCacheConfig,
    pub config: DecodeConfig,
    /// The KV link's settings (secret, timeouts, checksums).
    pub transfer: TransferConfig,
}

impl DecodeWorker {
    /// Runs the worker until `shutdown` fires and its server has drained.
    pub async fn serve(
        self,
        server: WorkerServer,
        kv: KvReceivers,
        shutdown: CancellationToken,
    ) -> Result<(), StartError> {
        let DecodeWorker {
            id,
            model,
            cache,
            config,
            transfer,
        } = self;
        duet_worker_common::device_memory::record(&id, &model, &cache);
        let engine_stop = CancellationToken::new();
        let _stop_engine = engine_stop.clone().drop_guard();
        let handle = DecodeHandle::start(
            model.clone(),
            cache,
            DecodeConfig {
                id: id.clone(),
                ..config
            },
            engine_stop.clone(),
        )
        .map_err(|e| StartError::Worker(format!("decode worker {id}: {e}")))?;
        let kv_host = kv
            .advertise_host
            .clone()
            .unwrap_or_else(|| server.advertise_host.clone());
        let mut endpoints = Vec::new();
        if let Some(l) = &kv.tcp {
            let port = l
                .local_addr()
                .map_err(|e| StartError::io("reading the KV listener's address", e))?
                .port();
            endpoints.push(KvEndpoint {
                transport: "tcp".into(),
                address: format!("{kv_host}:{port}"),
            });
        }
        let shm = match &kv.shm {
            Some(setting) => shm_receiver(setting, &id, &transfer).await?,
            None => None,
        };
        if let Some((_, e)) = &shm {
            endpoints.push(KvEndpoint {
                transport: "shm".into(),
                address: e.address.clone(),
            });
        }
        #[cfg(feature = "rdma")]
        let rdma = match kv.rdma {
            Some((l, options)) => {
                let port = l
                    .local_addr()
                    .map_err(|e| StartError::io("reading the rdma listener's address", e))?
                    .port();
                let rx = duet_kv_transfer::backend::rdma::RdmaReceiver::new(
                    l,
                    transfer.clone(),
                    options,
                )
                .map_err(|e| {
                    StartError::Config(format!("--kv-rdma-listen: UCX does not start: {e}"))
                })?;
                endpoints.push(KvEndpoint {
                    transport: "rdma".into(),
                    address: format!("{kv_host}:{port}"),
                });
                Some(rx)
            }
            None => None,
        };
        let local = kv.local.map(|(h, tag)| {
            let name = format!("{tag}/{id}");
            (h, name)
        });
        if let Some((_, name)) = &local {
            endpoints.push(KvEndpoint {
                transport: "local".into(),
                address: name.clone(),
            });
        }
        if endpoints.is_empty() {
            return Err(StartError::Config(format!(
                "decode worker {id}: no KV endpoint to offer (no tcp or rdma listener, shm unavailable)"
            )));
        }
        let inbound = Inbound {
            tcp: kv.tcp.map(|l| TcpReceiver::new(l, transfer)),
            shm: shm.map(|(rx, _)| rx),
            local: local.map(|(h, name)| h.listen(&name)),
            #[cfg(feature = "rdma")]
            rdma,
        };
        tokio::spawn(kv_inbound::serve(
            inbound,
            handle.clone(),
            engine_stop.clone(),
        ));
        let mut rec = server.record(Role::Decode, &id, model.fingerprint())?;
        rec.kv_endpoints = endpoints.clone();
        let reg = server
            .register_and_publish(rec, engine_stop.clone(), {
                let handle = handle.clone();
                move || capacity(&handle)
            })
            .await?;
        println!(
            "duet: decode worker {id} serving gRPC on {}, KV on {}",
            server.grpc_addr()?,
            endpoints
                .iter()
                .map(|e| format!("{}://{}", e.transport, e.address))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let kv_cache = KvCacheService::new(
            handle.kv_events().clone(),
            {
                let h = handle.clone();
                Arc::new(move |hashes| h.prefetch(hashes))
            },
            shutdown.clone(),
        );
        let svc = DecodeService::new(
            handle,
            endpoints
                .iter()
                .map(|e| pb::KvEndpoint {
                    transport: e.transport.clone(),
                    address: e.address.clone(),
                })
                .collect(),
            id,
            Arc::new(Channels::new(
                server.client_tls.clone(),
                Some(server.token.clone()),
            )),
            server.peers(&engine_stop),
        );
        let routes =
            tonic::service::Routes::new(svc.into_server()).add_service(kv_cache.into_server());
        let services = ["duet.v1.Decode", "duet.v1.KvCache"];
        server.serve_until(routes, &services, reg, shutdown).await
    }
}

/// The shm receiver (a fresh socket in the setting's directory, after what dead workers left
/// there is removed) and the endpoint it is advertised as. `None` when shm is unavailable
/// and not required: the worker says so once and offers the rest.
async fn shm_receiver(
    setting: &ShmSetting,
    id: &str,
    cfg: &TransferConfig,
) -> Result<Option<(ShmReceiver, Endpoint)>, StartError> {
    let r = async {
        let host = host_identity().ok_or_else(|| {
            StartError::Config(
                "no host identity (/proc/sys/kernel/random/boot_id, /proc/self/ns/mnt)".into(),
            )
        })?;
        // Senders must find the socket by this path from anywhere: absolute, no symlinks.
        let dir = std::fs::canonicalize(&setting.dir)
            .map_err(|e| StartError::io(format!("--kv-shm-dir {}", setting.dir.display()), e))?;
        let opts = ShmOptions {
            dir: dir.clone(),
            ..ShmOptions::default()
        };
        let rx = ShmReceiver::bind_in(id, cfg.clone(), opts)
            .await
            .map_err(|e| {
                StartError::Config(format!(
                    "binding the shm KV socket in {}: {e}",
                    dir.display()
                ))
            })?;
        let e = Endpoint::shm(&host, rx.path())?;
        Ok::<_, StartError>((rx, e))
    }
    .await;
    match r {
        Ok(x) => Ok(Some(x)),
        Err(e) if !setting.required => {
            tracing::warn!(error = %e, "KV over shm unavailable: tcp only");
            Ok(None)
        }
        Err(e) => Err(StartError::Config(format!("--kv-shm: {e}"))),
    }
}

/// The registry's view of this worker's load.
fn capacity(h: &DecodeHandle) -> Capacity {
    let s = h.status();
    Capacity {
        kv_blocks_total: s.kv_blocks_total,
        kv_blocks_free: s.kv_blocks_free,
        kv_blocks_cached: s.kv_blocks_cached,
        block_size: s.block_size,
        running: s.running,
        waiting: s.waiting,
        queued_prefill_tokens: 0,
        max_batch: s.max_batch,
        tokens_per_second: s.tokens_per_second,
        kv_groups: s.kv_groups,
    }
}
