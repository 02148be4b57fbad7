//! gRPC clients of the workers (one lazily connected channel per address) and the router's
//! own in-flight accounting per worker, which placement adds to the published load.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_proto::v1::decode_client::DecodeClient;
use duet_proto::v1::kv_cache_client::KvCacheClient;
use duet_proto::v1::prefill_client::PrefillClient;
use duet_serving::channels::Channels;
use duet_serving::cluster_auth::{AuthChannel, ClusterToken};
use duet_serving::tls::ClientTls;

use crate::error::RouterError;
use crate::placement::InFlight;

/// Channels and counters shared by every request.
#[derive(Debug, Default)]
pub struct Workers {
    /// One channel per worker address (TLS for `https://` workers).
    channels: Channels,
    inflight: Mutex<InFlight>,
    prefill_tokens: Mutex<HashMap<String, u64>>,
    /// Workers that recently failed to answer, until when.
    suspects: Mutex<HashMap<String, Instant>>,
    /// (prefill id, decode id) pairs whose KV link recently failed, until when.
    bad_links: Mutex<HashMap<(String, String), Instant>>,
}

impl Workers {
    /// `tls` and `token`: what calls to the workers carry (see [`Channels`]).
    pub fn new(tls: Option<ClientTls>, token: Option<ClusterToken>) -> Arc<Workers> {
        Arc::new(Workers {
            channels: Channels::new(tls, token),
            ..Workers::default()
        })
    }

    fn channel(&self, addr: &str) -> Result<AuthChannel, RouterError> {
        self.channels.get(addr).map_err(|e| RouterError::NoWorker {
            role: "any",
            reason: e.to_string(),
        })
    }

    pub fn decode(&self, addr: &str) -> Result<DecodeClient<AuthChannel>, RouterError> {
        Ok(DecodeClient::new(self.channel(addr)?))
    }

    pub fn prefill(&self, addr: &str) -> Result<PrefillClient<AuthChannel>, RouterError> {
        Ok(PrefillClient::new(self.channel(addr)?))
    }

    pub fn kv_cache(&self, addr: &str) -> Result<KvCacheClient<AuthChannel>, RouterError> {
        Ok(KvCacheClient::new(self.channel(addr)?))
    }

    /// Places worker `id` last for `period` (it could not be reached or timed out).
    pub fn mark_suspect(&self, id: &str, period: Duration) {
        if let Ok(mut m) = self.suspects.lock() {
            let now = Instant::now();
            m.retain(|_, until| *until > now);
            m.insert(id.to_string(), now + period);
        }
    }

    /// Avoids sending KV from `prefill` to `decode` for `period` (their link failed).
    pub fn mark_bad_link(&self, prefill: &str, decode: &str, period: Duration) {
        if let Ok(mut m) = self.bad_links.lock() {
            let now = Instant::now();
            m.retain(|_, until| *until > now);
            m.insert((prefill.to_string(), decode.to_string()), now + period);
        }
    }

    /// Whether the KV link from `prefill` to `decode` failed recently.
    pub fn is_bad_link(&self, prefill: &str, decode: &str) -> bool {
        let now = Instant::now();
        self.bad_links
            .lock()
            .map(|m| {
                m.get(&(prefill.to_string(), decode.to_string()))
                    .is_some_and(|until| *until > now)
            })
            .unwrap_or(false)
    }

    /// The workers currently suspect.
    pub fn suspects(&self) -> HashSet<String> {
        let now = Instant::now();
        self.suspects
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, until)| **until > now)
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Snapshot of in-flight requests per decode worker.
    pub fn inflight(&self) -> InFlight {
        self.inflight.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Snapshot of prompt tokens in flight per prefill worker.
    pub fn prefill_tokens(&self) -> HashMap<String, u64> {
        self.prefill_tokens
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    /// Counts a request on decode worker `id` until the guard drops.
    pub fn track_decode(self: &Arc<Self>, id: &str) -> Tracked {
        if let Ok(mut m) = self.inflight.lock() {
            *m.entry(id.to_string()).or_default() += 1;
        }
        Tracked {
            workers: self.clone(),
            id: id.to_string(),
            prefill_tokens: 0,
        }
    }

    /// Counts `tokens` on prefill worker `id` until the guard drops.
    pub fn track_prefill(self: &Arc<Self>, id: &str, tokens: u64) -> Tracked {
        if let Ok(mut m) = self.prefill_tokens.lock() {
            *m.entry(id.to_string()).or_default() += tokens;
        }
        Tracked {
            workers: self.clone(),
            id: id.to_string(),
            prefill_tokens: tokens,
        }
    }
}

/// Undoes a `track_*` on drop.
#[derive(Debug)]
pub struct Tracked {
    workers: Arc<Workers>,
    id: String,
    prefill_tokens: u64,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.prefill_tokens > 0 {
            if let Ok(mut m) = self.workers.prefill_tokens.lock() {
                if let Some(v) = m.get_mut(&self.id) {
                    *v = v.saturating_sub(self.prefill_tokens);
                }
            }
        } else if let Ok(mut m) = self.workers.inflight.lock() {
            if let Some(v) = m.get_mut(&self.id) {
                *v = v.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suspect_is_remembered_for_its_period_only() {
        let w = Workers::new(None, None);
        w.mark_suspect("p-1", Duration::from_millis(40));
        w.mark_suspect("p-2", Duration::from_secs(60));
        assert!(w.suspects().contains("p-1"));
        std::thread::sleep(Duration::from_millis(60));
        let now: Vec<String> = w.suspects().into_iter().collect();
        assert_eq!(now, ["p-2"]);
    }
}
