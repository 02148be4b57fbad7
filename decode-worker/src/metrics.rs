//! The decode worker's metric handles, labelled once with the worker id (bounded: one value
//! per worker in the process). Names and help live in `duet_telemetry::names`.

use duet_telemetry::names::*;
use metrics::{Counter, Gauge, Histogram};

pub(crate) struct DecodeMetrics {
    pub running: Gauge,
    pub waiting: Gauge,
    pub batch_size: Histogram,
    pub step_seconds: Histogram,
    pub generated: Counter,
    pub kv_used: Gauge,
    pub kv_capacity: Gauge,
    pub preemptions: Counter,
    pub reservations_expired: Counter,
    pub read_bytes: Counter,
    pub bandwidth: Gauge,
}

impl DecodeMetrics {
    pub(crate) fn new(worker: &str) -> Self {
        let w = worker.to_string();
        DecodeMetrics {
            running: metrics::gauge!(DECODE_RUNNING, "worker" => w.clone()),
            waiting: metrics::gauge!(DECODE_WAITING, "worker" => w.clone()),
            batch_size: metrics::histogram!(DECODE_BATCH_SIZE, "worker" => w.clone()),
            step_seconds: metrics::histogram!(DECODE_STEP_SECONDS, "worker" => w.clone()),
            generated: metrics::counter!(DECODE_GENERATED_TOKENS_TOTAL, "worker" => w.clone()),
            kv_used: metrics::gauge!(DECODE_KV_BLOCKS_USED, "worker" => w.clone()),
            kv_capacity: metrics::gauge!(DECODE_KV_BLOCKS_CAPACITY, "worker" => w.clone()),
            preemptions: metrics::counter!(DECODE_PREEMPTIONS_TOTAL, "worker" => w.clone()),
            reservations_expired: metrics::counter!(
                DECODE_RESERVATIONS_EXPIRED_TOTAL,
                "worker" => w.clone()
            ),
            read_bytes: metrics::counter!(DECODE_READ_BYTES_TOTAL, "worker" => w.clone()),
            bandwidth: metrics::gauge!(DECODE_BANDWIDTH_BYTES_PER_SECOND, "worker" => w),
        }
    }
}
