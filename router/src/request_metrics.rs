//! Per-request metrics as the client sees them: time to first token, inter-token latency,
//! time per output token, end-to-end latency, queue time, outcome; plus the in-flight and
//! queued gauges by priority.
//!
//! A [`RequestMetrics`] lives as long as the request; whatever path ends the request, its
//! outcome is counted exactly once (dropping it unfinished counts `cancelled`: the client
//! went away), and the in-flight gauge is decremented exactly once.

use std::time::Instant;

use duet_discovery::control::ObservedRequest;
use duet_engine::ErrorClass;
use duet_telemetry::names::*;

use crate::recent::RecentRequests;

/// Which door a request came through (a bounded label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    Grpc,
    Http,
}

impl Door {
    pub fn label(self) -> &'static str {
        match self {
            Door::Grpc => "grpc",
            Door::Http => "http",
        }
    }
}

/// Counts a request refused before admission (bad input, queue full).
pub fn count_refused(door: Door, class: ErrorClass) {
    metrics::counter!(ROUTER_REQUESTS_TOTAL, "door" => door.label(), "outcome" => class.label())
        .increment(1);
}

/// The metrics of one admitted request.
#[derive(Debug)]
pub struct RequestMetrics {
    door: Door,
    priority: &'static str,
    arrival: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    tokens: u64,
    done: bool,
    placed: bool,
    prompt_tokens: usize,
    /// Where the request is recorded when it ends (the load the planner reads).
    recent: RecentRequests,
}

impl RequestMetrics {
    /// Starts tracking an admitted request (in flight from now); it is recorded in
    /// `recent` when it ends.
    pub fn start(
        door: Door,
        priority: &'static str,
        arrival: Instant,
        prompt_tokens: usize,
        recent: RecentRequests,
    ) -> Self {
        metrics::gauge!(ROUTER_IN_FLIGHT, "priority" => priority).increment(1.0);
        metrics::counter!(ROUTER_PROMPT_TOKENS_TOTAL).increment(prompt_tokens as u64);
        RequestMetrics {
            door,
            priority,
            arrival,
            first_token: None,
            last_token: None,
            tokens: 0,
            done: false,
            placed: false,
            prompt_tokens,
            recent,
        }
    }

    /// An attempt of the request was placed as `placement` (decisions count per attempt;
    /// the queue time only the first time the request left the queue).
    pub fn placed(&mut self, placement: &'static str) {
        if !std::mem::replace(&mut self.placed, true) {
            metrics::histogram!(ROUTER_QUEUE_SECONDS).record(self.arrival.elapsed().as_secs_f64());
        }
        metrics::counter!(ROUTER_ROUTING_DECISIONS_TOTAL, "placement" => placement).increment(1);
    }

    /// A token reached the client's stream.
    pub fn token(&mut self) {
        let now = Instant::now();
        let door = self.door.label();
        match self.last_token {
            None => {
                metrics::histogram!(ROUTER_TTFT_SECONDS, "door" => door)
                    .record(now.duration_since(self.arrival).as_secs_f64());
                self.first_token = Some(now);
            }
            Some(prev) => {
                metrics::histogram!(ROUTER_ITL_SECONDS, "door" => door)
                    .record(now.duration_since(prev).as_secs_f64());
            }
        }
        self.last_token = Some(now);
        self.tokens += 1;
        metrics::counter!(ROUTER_GENERATION_TOKENS_TOTAL).increment(1);
    }

    /// Counts the outcome and leaves the in-flight gauge, the first time only.
    fn close(&mut self, outcome: &'static str) -> bool {
        if std::mem::replace(&mut self.done, true) {
            return false;
        }
        metrics::counter!(ROUTER_REQUESTS_TOTAL, "door" => self.door.label(), "outcome" => outcome)
            .increment(1);
        metrics::gauge!(ROUTER_IN_FLIGHT, "priority" => self.priority).decrement(1.0);
        self.recent.record(self.observed(outcome == "ok"));
        true
    }

    /// The request as its client saw it, for the published load.
    fn observed(&self, ok: bool) -> ObservedRequest {
        // Hundredths of a millisecond: what the planner needs, and short in JSON.
        let round = |ms: f64| (ms * 100.0).round() / 100.0;
        let ms = |d: std::time::Duration| round(d.as_secs_f64() * 1e3);
        let age = self.arrival.elapsed().as_millis() as u64;
        ObservedRequest {
            arrival_ms: duet_discovery::now_ms().saturating_sub(age),
            prompt_tokens: u32::try_from(self.prompt_tokens).unwrap_or(u32::MAX),
            output_tokens: u32::try_from(self.tokens).unwrap_or(u32::MAX),
            ttft_ms: self.first_token.map(|t| ms(t.duration_since(self.arrival))),
            tpot_ms: match (self.first_token, self.last_token) {
                (Some(first), Some(last)) if self.tokens > 1 => Some(round(
                    ms(last.duration_since(first)) / (self.tokens - 1) as f64,
                )),
                _ => None,
            },
            ok,
        }
    }

    /// The request finished: `Ok` or the class of its error.
    pub fn finish(&mut self, outcome: Result<(), ErrorClass>) {
        let label = match outcome {
            Ok(()) => "ok",
            Err(c) => c.label(),
        };
        if !self.close(label) {
            return;
        }
        let door = self.door.label();
        if outcome.is_ok() {
            metrics::histogram!(ROUTER_E2E_SECONDS, "door" => door)
                .record(self.arrival.elapsed().as_secs_f64());
            if let (Some(first), Some(last)) = (self.first_token, self.last_token) {
                if self.tokens > 1 {
                    let per = last.duration_since(first).as_secs_f64() / (self.tokens - 1) as f64;
                    metrics::histogram!(ROUTER_TPOT_SECONDS, "door" => door).record(per);
                }
            }
        }
    }
}

impl Drop for RequestMetrics {
    fn drop(&mut self) {
        self.close("cancelled");
    }
}
