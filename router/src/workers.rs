//! gRPC clients of the workers (one lazily connected channel per address) and the router's
//! own in-flight accounting per worker, which placement adds to the published load.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_proto::v1::decode_client::DecodeClient;
use duet_proto::v1::kv_cache_client::KvCacheClient;
use duet_serving::channels::Channels;
use duet_serving::cluster_auth::{AuthChannel, ClusterToken};
use duet_serving::tls::ClientTls;

use crate::error::RouterError;
use crate::placement::{InFlight, RouterLoad};

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

    /// What placement needs of this router's own state, as of now: in-flight counts and
    /// the suspects and failed links that have not expired.
    pub fn load(&self) -> RouterLoad {
        let now = Instant::now();
        RouterLoad {
            decode_inflight: self.inflight.lock().map(|m| m.clone()).unwrap_or_default(),
            prefill_tokens: self
                .prefill_tokens
                .lock()
                .map(|m| m.clone())
                .unwrap_or_default(),
            suspects: unexpired(&self.suspects, now),
            bad_links: unexpired(&self.bad_links, now),
        }
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

/// The keys of `m` whose expiry is after `now`.
fn unexpired<K: Clone + Eq + std::hash::Hash>(
    m: &Mutex<HashMap<K, Instant>>,
    now: Instant,
) -> HashSet<K> {
    m.lock()
        .map(|m| {
            m.iter()
                .filter(|(_, until)| **until > now)
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_default()
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
    fn suspects_and_failed_links_are_remembered_for_their_period_only() {
        let w = Workers::new(None, None);
        w.mark_suspect("p-1", Duration::from_millis(40));
        w.mark_suspect("p-2", Duration::from_secs(60));
        w.mark_bad_link("p-1", "d-1", Duration::from_millis(40));
        w.mark_bad_link("p-2", "d-1", Duration::from_secs(60));
        let load = w.load();
        assert!(load.suspects.contains("p-1"));
        assert!(load.bad_links.contains(&("p-1".into(), "d-1".into())));
        std::thread::sleep(Duration::from_millis(60));
        let load = w.load();
        let now: Vec<String> = load.suspects.into_iter().collect();
        assert_eq!(now, ["p-2"]);
        let links: Vec<(String, String)> = load.bad_links.into_iter().collect();
        assert_eq!(links, [("p-2".to_string(), "d-1".to_string())]);
    }

    #[test]
    fn in_flight_counts_last_as_long_as_their_guards() {
        let w = Workers::new(None, None);
        let d = w.track_decode("d-1");
        let p = w.track_prefill("p-1", 300);
        let load = w.load();
        assert_eq!(load.decode_inflight.get("d-1"), Some(&1));
        assert_eq!(load.prefill_tokens.get("p-1"), Some(&300));
        drop((d, p));
        let load = w.load();
        assert_eq!(load.decode_inflight.get("d-1"), Some(&0));
        assert_eq!(load.prefill_tokens.get("p-1"), Some(&0));
    }
}
