//! The requests this router finished recently, as its clients saw them, published in the
//! registry for the planner (`duet_discovery::control::RouterLoad`).
//!
//! Invariants: the window holds at most [`MAX_SAMPLE`] requests, oldest first, each
//! recorded once when it ends (whatever path ends it); [`RecentRequests::load`] counts
//! those that arrived within the window, which may be more than the sample it returns.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_discovery::control::{self, ObservedRequest, RouterLoad, CONTROL_VERSION};
use duet_discovery::Registry;
use tokio_util::sync::CancellationToken;

/// Most requests kept (and published) per router: with about 60 bytes each and a put
/// every [`PUBLISH_EVERY`] only while requests finish, at most ~11 MB an hour of etcd
/// history per busy router (the chart's etcd compacts hourly).
pub const MAX_SAMPLE: usize = 256;

/// How far back the published load looks.
pub const WINDOW: Duration = Duration::from_secs(60);

/// How often the load is published (when requests finished since), and the TTL of its
/// lease.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(5);
const LEASE_TTL: Duration = Duration::from_secs(15);

/// A bounded window of finished requests (cheap to clone: shared).
#[derive(Debug, Clone, Default)]
pub struct RecentRequests {
    inner: Arc<Mutex<Window>>,
}

#[derive(Debug, Default)]
struct Window {
    sample: VecDeque<ObservedRequest>,
    /// Arrival times of every finished request in the window (not only the sample's).
    arrivals: VecDeque<u64>,
    /// Requests recorded so far (tells a publisher whether anything changed).
    recorded: u64,
}

impl RecentRequests {
    /// Records a finished request.
    pub fn record(&self, r: ObservedRequest) {
        let Ok(mut w) = self.inner.lock() else {
            return;
        };
        // Bounded without a reader: arrivals come in nearly in order (out by at most a
        // request's duration), so what is older than two windows at the front goes.
        let stale = duet_discovery::now_ms().saturating_sub(2 * WINDOW.as_millis() as u64);
        while w.arrivals.front().is_some_and(|&t| t < stale) {
            w.arrivals.pop_front();
        }
        w.arrivals.push_back(r.arrival_ms);
        w.sample.push_back(r);
        w.recorded += 1;
        if w.sample.len() > MAX_SAMPLE {
            w.sample.pop_front();
        }
    }

    /// Requests recorded so far.
    pub fn recorded(&self) -> u64 {
        self.inner.lock().map_or(0, |w| w.recorded)
    }

    /// The load as of `now_ms`: requests that arrived within [`WINDOW`] before it.
    pub fn load(&self, router: &str, now_ms: u64) -> RouterLoad {
        let window_ms = WINDOW.as_millis() as u64;
        let since = now_ms.saturating_sub(window_ms);
        let (finished, sample) = match self.inner.lock() {
            Ok(mut w) => {
                while w.arrivals.front().is_some_and(|&t| t < since) {
                    w.arrivals.pop_front();
                }
                while w.sample.front().is_some_and(|r| r.arrival_ms < since) {
                    w.sample.pop_front();
                }
                // Arrivals are recorded when requests end, so they are not in arrival
                // order: count rather than trust the front.
                let finished = w.arrivals.iter().filter(|&&t| t >= since).count() as u64;
                let mut sample: Vec<ObservedRequest> = w
                    .sample
                    .iter()
                    .filter(|r| r.arrival_ms >= since)
                    .cloned()
                    .collect();
                sample.sort_by_key(|r| r.arrival_ms);
                (finished, sample)
            }
            Err(_) => (0, Vec::new()),
        };
        RouterLoad {
            version: CONTROL_VERSION,
            router: router.to_string(),
            published_at_ms: now_ms,
            window_ms,
            finished,
            sample,
        }
    }
}

/// Publishes this router's load under `/duet/<cluster>/load/<router>` every
/// [`PUBLISH_EVERY`] in which requests finished, until `stop` (then deletes it).
pub async fn publish(
    registry: Arc<dyn Registry>,
    cluster: String,
    router: String,
    recent: RecentRequests,
    stop: CancellationToken,
) {
    let key = control::load_key(&cluster, &router);
    let mut published = None;
    control::publish_leased(
        registry,
        key,
        LEASE_TTL,
        PUBLISH_EVERY,
        move || {
            let recorded = recent.recorded();
            if published == Some(recorded) {
                return None;
            }
            published = Some(recorded);
            let load = recent.load(&router, duet_discovery::now_ms());
            control::to_json(&load).ok()
        },
        stop,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(arrival_ms: u64) -> ObservedRequest {
        ObservedRequest {
            arrival_ms,
            prompt_tokens: 10,
            output_tokens: 5,
            ttft_ms: Some(100.0),
            tpot_ms: Some(20.0),
            ok: true,
        }
    }

    #[test]
    fn the_load_counts_the_window_and_bounds_the_sample() {
        let r = RecentRequests::default();
        let now = duet_discovery::now_ms();
        let window = WINDOW.as_millis() as u64;
        // Out of the window, then MAX_SAMPLE + 10 within it, recorded out of order.
        r.record(req(now - window - 1));
        for i in 0..(MAX_SAMPLE as u64 + 10) {
            r.record(req(now - 1 - (i % 7)));
        }
        let load = r.load("r1", now);
        assert_eq!(load.finished, MAX_SAMPLE as u64 + 10);
        assert_eq!(load.sample.len(), MAX_SAMPLE);
        assert!(load
            .sample
            .windows(2)
            .all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        assert_eq!(load.window_ms, window);
        // Later, everything has left the window.
        let load = r.load("r1", now + window + 10);
        assert_eq!((load.finished, load.sample.len()), (0, 0));
    }
}
