//! `duet_engine_device_memory_bytes`: what a worker's engine holds on its compute device,
//! set once when the worker starts (the weights and the KV pool are sized then and never
//! grow). The candle engine's device copy of the KV pool is made by its first forward, the
//! same size as the f16 host pool the gauge reports.

use duet_engine::{EngineModel, KvCacheConfig};
use duet_telemetry::names::ENGINE_DEVICE_MEMORY_BYTES;

/// Bytes of a KV pool of `kv` for `model` (0 for a dtype the engine refuses, which stops
/// the worker before it serves).
pub fn kv_pool_bytes(model: &EngineModel, kv: &KvCacheConfig) -> usize {
    model
        .kv_layout(kv.block_size, kv.dtype)
        .map_or(0, |l| l.bytes_per_token() * kv.block_size * kv.num_blocks)
}

/// Sets the worker's gauges (labels: worker, device, kind).
pub fn record(worker: &str, model: &EngineModel, kv: &KvCacheConfig) {
    let device = model.device().to_string();
    for (kind, bytes) in [
        ("weights", model.weight_bytes()),
        ("kv_pool", kv_pool_bytes(model, kv)),
    ] {
        metrics::gauge!(ENGINE_DEVICE_MEMORY_BYTES,
            "worker" => worker.to_string(), "device" => device.clone(), "kind" => kind)
        .set(bytes as f64);
    }
}
