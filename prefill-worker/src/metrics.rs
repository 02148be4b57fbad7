//! The prefill worker's metric handles, labelled once with the worker id (bounded: one value
//! per worker in the process). Names and help live in `duet_telemetry::names`.
//!
//! The busy ratio is measured over windows of about a second of wall time: the share of the
//! window the engine thread spent inside forward passes.

use std::time::{Duration, Instant};

use duet_telemetry::names::*;
use metrics::{Counter, Gauge, Histogram};

const BUSY_WINDOW: Duration = Duration::from_secs(1);

pub(crate) struct PrefillMetrics {
    pub prompt_tokens: Counter,
    pub batch_tokens: Histogram,
    pub batch_seconds: Histogram,
    pub queue_depth: Gauge,
    pub queued_tokens: Gauge,
    pub kv_used: Gauge,
    pub kv_capacity: Gauge,
    /// Forwards stopped between layers: nobody waited for them.
    pub stopped: Counter,
    busy_ratio: Gauge,
    window_start: Instant,
    busy_in_window: Duration,
}

impl PrefillMetrics {
    pub(crate) fn new(worker: &str) -> Self {
        let w = worker.to_string();
        PrefillMetrics {
            prompt_tokens: metrics::counter!(PREFILL_PROMPT_TOKENS_TOTAL, "worker" => w.clone()),
            batch_tokens: metrics::histogram!(PREFILL_BATCH_TOKENS, "worker" => w.clone()),
            batch_seconds: metrics::histogram!(PREFILL_BATCH_SECONDS, "worker" => w.clone()),
            queue_depth: metrics::gauge!(PREFILL_QUEUE_DEPTH, "worker" => w.clone()),
            queued_tokens: metrics::gauge!(PREFILL_QUEUED_TOKENS, "worker" => w.clone()),
            kv_used: metrics::gauge!(PREFILL_KV_BLOCKS_USED, "worker" => w.clone()),
            kv_capacity: metrics::gauge!(PREFILL_KV_BLOCKS_CAPACITY, "worker" => w.clone()),
            stopped: metrics::counter!(PREFILL_FORWARDS_STOPPED_TOTAL, "worker" => w.clone()),
            busy_ratio: metrics::gauge!(PREFILL_BUSY_RATIO, "worker" => w),
            window_start: Instant::now(),
            busy_in_window: Duration::ZERO,
        }
    }

    /// One forward of `tokens` prompt tokens took `dt`.
    pub(crate) fn forward(&mut self, tokens: usize, dt: Duration) {
        self.prompt_tokens.increment(tokens as u64);
        self.batch_tokens.record(tokens as f64);
        self.batch_seconds.record(dt.as_secs_f64());
        self.busy_in_window += dt;
        self.tick();
    }

    /// Closes the busy window when a second has passed (also called while idle).
    pub(crate) fn tick(&mut self) {
        let wall = self.window_start.elapsed();
        if wall >= BUSY_WINDOW {
            let ratio = (self.busy_in_window.as_secs_f64() / wall.as_secs_f64()).min(1.0);
            self.busy_ratio.set(ratio);
            self.window_start = Instant::now();
            self.busy_in_window = Duration::ZERO;
        }
    }
}

/// Counts one prefill request on `worker` exactly once: [`RequestOutcome::done`] with its
/// outcome, or `cancelled` when dropped unfinished (the router dropped the call).
pub(crate) struct RequestOutcome {
    worker: String,
    counted: bool,
}

impl RequestOutcome {
    pub(crate) fn new(worker: &str) -> Self {
        RequestOutcome {
            worker: worker.to_string(),
            counted: false,
        }
    }

    /// The outcome and, when it succeeded, the duration from arrival to the decode
    /// worker's acknowledgement of the last layer.
    pub(crate) fn done(mut self, outcome: &'static str, seconds: Option<f64>) {
        self.count(outcome);
        if let Some(s) = seconds {
            metrics::histogram!(PREFILL_REQUEST_SECONDS, "worker" => self.worker.clone()).record(s);
        }
    }

    fn count(&mut self, outcome: &'static str) {
        if !std::mem::replace(&mut self.counted, true) {
            metrics::counter!(
                PREFILL_REQUESTS_TOTAL,
                "worker" => self.worker.clone(),
                "outcome" => outcome
            )
            .increment(1);
        }
    }
}

impl Drop for RequestOutcome {
    fn drop(&mut self) {
        self.count("cancelled");
    }
}
