//! What one request did, as the client saw it.
//!
//! A backend fills a [`Timeline`] while the response streams (the send instant, the arrival
//! instant of every chunk that carried output, the end, what the server reported); a
//! [`RequestRecord`] is the timeline turned into offsets and latencies in seconds.
//!
//! Definitions (as vLLM's `bench serve`):
//! - TTFT: send until the first output chunk arrived.
//! - ITL: gaps between consecutive output chunks (a chunk may carry several tokens).
//! - E2E: send until the response ended.
//! - TPOT: (E2E − TTFT) / (output tokens − 1), only with more than one output token.
//! - output tokens: the server's usage count when it sent one, else the output chunks.
//!
//! Invariants: a successful record has `ttft_s <= e2e_s`, and `itl_s.len()` is the number of
//! output chunks minus one; a failed record has `error` set and is never counted as
//! completed (its partial timings are kept for inspection).

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Why a request failed: `kind` is bounded (`grpc:UNAVAILABLE`, `http:503`, `connect`,
/// `timeout`, `protocol`, `io`), `message` is free text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestError {
    pub kind: String,
    pub message: String,
}

impl RequestError {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError {
            kind: kind.into(),
            message: message.into(),
        }
    }
}

/// Raw observations of one request.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub sent: Instant,
    /// Arrival of each chunk that carried output.
    pub chunks: Vec<Instant>,
    pub end: Option<Instant>,
    /// Server-reported counts (usage), when the server sent them.
    pub prompt_tokens: Option<usize>,
    pub output_tokens: Option<usize>,
    /// Where the server prefilled the prompt (duet only).
    pub placement: Option<String>,
    /// Prompt tokens the server served from its prefix cache (duet's usage, OpenAI's
    /// `usage.prompt_tokens_details.cached_tokens`), when it said.
    pub cached_tokens: Option<usize>,
}

impl Timeline {
    pub fn start() -> Self {
        Timeline {
            sent: Instant::now(),
            chunks: Vec::new(),
            end: None,
            prompt_tokens: None,
            output_tokens: None,
            placement: None,
            cached_tokens: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the run (warm-up requests not counted).
    pub index: usize,
    /// Planned send time, seconds after the run started.
    pub scheduled_s: f64,
    /// Actual send time, seconds after the run started (later than planned when the
    /// concurrency cap held the request back).
    pub arrival_s: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Output tokens asked for (max_tokens).
    pub requested_output_tokens: usize,
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
    pub itl_s: Vec<f64>,
    pub e2e_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// Prompt tokens served from the server's prefix cache, when it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<usize>,
    /// Multi-turn workloads: the conversation (its first request's index) and the turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    pub error: Option<RequestError>,
}

impl RequestRecord {
    /// `run_start`: the instant offsets are measured from.
    pub fn new(
        index: usize,
        run_start: Instant,
        scheduled_s: f64,
        sent_prompt_tokens: usize,
        requested_output_tokens: usize,
        t: Timeline,
        error: Option<RequestError>,
    ) -> Self {
        let since = |later: Instant| later.saturating_duration_since(t.sent).as_secs_f64();
        let ttft_s = t.chunks.first().map(|&c| since(c));
        let itl_s: Vec<f64> = t
            .chunks
            .windows(2)
            .map(|w| w[1].saturating_duration_since(w[0]).as_secs_f64())
            .collect();
        let e2e_s = t.end.map(since);
        let output_tokens = t.output_tokens.unwrap_or(t.chunks.len());
        let tpot_s = match (ttft_s, e2e_s) {
            (Some(ttft), Some(e2e)) if output_tokens > 1 && error.is_none() => {
                Some((e2e - ttft).max(0.0) / (output_tokens - 1) as f64)
            }
            _ => None,
        };
        // A response that ended without any output chunk is a protocol failure.
        let error = error.or_else(|| {
            (ttft_s.is_none()).then(|| RequestError::new("protocol", "no output was streamed"))
        });
        RequestRecord {
            index,
            scheduled_s,
            arrival_s: t.sent.saturating_duration_since(run_start).as_secs_f64(),
            prompt_tokens: t.prompt_tokens.unwrap_or(sent_prompt_tokens),
            output_tokens,
            requested_output_tokens,
            ttft_s,
            tpot_s,
            itl_s,
            e2e_s,
            placement: t.placement,
            cached_tokens: t.cached_tokens,
            conversation: None,
            turn: None,
            error,
        }
    }

    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn timeline(chunk_ms: &[u64], end_ms: u64, usage: Option<usize>) -> (Instant, Timeline) {
        let run_start = Instant::now();
        let sent = run_start + Duration::from_millis(100);
        let t = Timeline {
            sent,
            chunks: chunk_ms
                .iter()
                .map(|&ms| sent + Duration::from_millis(ms))
                .collect(),
            end: Some(sent + Duration::from_millis(end_ms)),
            prompt_tokens: None,
            output_tokens: usage,
            placement: None,
            cached_tokens: None,
        };
        (run_start, t)
    }

    #[test]
    fn latencies_follow_the_chunk_times() {
        let chunks = [50, 70, 100, 130];
        let end = 140;
        let (run_start, t) = timeline(&chunks, end, None);
        let r = RequestRecord::new(0, run_start, 0.1, 12, 4, t, None);
        assert!(r.ok());
        let s = |ms: u64| ms as f64 / 1000.0;
        assert!((r.ttft_s.unwrap() - s(chunks[0])).abs() < 1e-9);
        assert!((r.e2e_s.unwrap() - s(end)).abs() < 1e-9);
        assert!((r.arrival_s - 0.1).abs() < 1e-9);
        assert_eq!(r.itl_s.len(), chunks.len() - 1);
        for (i, gap) in r.itl_s.iter().enumerate() {
            assert!((gap - s(chunks[i + 1] - chunks[i])).abs() < 1e-9);
        }
        assert_eq!(r.output_tokens, chunks.len());
        let tpot = (s(end) - s(chunks[0])) / (chunks.len() - 1) as f64;
        assert!((r.tpot_s.unwrap() - tpot).abs() < 1e-9);
        assert_eq!(r.prompt_tokens, 12);
    }

    #[test]
    fn usage_overrides_the_chunk_count_for_tokens() {
        // Two chunks carrying eight tokens between them.
        let (run_start, t) = timeline(&[10, 50], 60, Some(8));
        let r = RequestRecord::new(0, run_start, 0.0, 5, 8, t, None);
        assert_eq!(r.output_tokens, 8);
        assert_eq!(r.itl_s.len(), 1);
        let tpot = (0.060 - 0.010) / 7.0;
        assert!((r.tpot_s.unwrap() - tpot).abs() < 1e-9);
    }

    #[test]
    fn no_output_is_a_failure_and_errors_keep_partial_timings() {
        let (run_start, t) = timeline(&[], 60, None);
        let r = RequestRecord::new(0, run_start, 0.0, 5, 8, t, None);
        assert!(!r.ok());
        assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("protocol"));

        let (run_start, t) = timeline(&[10, 20], 30, None);
        let err = RequestError::new("grpc:UNAVAILABLE", "worker went away");
        let r = RequestRecord::new(0, run_start, 0.0, 5, 8, t, Some(err.clone()));
        assert_eq!(r.error, Some(err));
        assert!(r.ttft_s.is_some());
        assert_eq!(r.tpot_s, None);
    }
}
