//! Lazily connected gRPC channels to other duet processes, one per address, shared by
//! every call: the router's calls to the workers, and a decode worker's calls to the prefill
//! workers it hands its prompts to.
//!
//! TLS policy, the same for every caller: an `https://` address needs the caller's TLS (the
//! CA it trusts, and its own certificate for servers that require one); a caller configured
//! for TLS refuses plain-text addresses rather than silently dropping mutual TLS.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::cluster_auth::{AuthChannel, ClusterToken, OutgoingToken};
use crate::error::ServeError;
use crate::tls::ClientTls;

/// The channel table of one process (`Default`: plain text, no token).
#[derive(Debug, Default)]
pub struct Channels {
    tls: Option<ClientTls>,
    /// Every call through these channels carries it (workers refuse calls without it).
    token: OutgoingToken,
    table: Mutex<HashMap<String, Channel>>,
}

impl Channels {
    /// `tls`: for `https://` addresses (`None`: plain text only); `token`: the cluster's
    /// (`None`: calls carry none, and only servers that check nothing answer).
    pub fn new(tls: Option<ClientTls>, token: Option<ClusterToken>) -> Channels {
        Channels {
            tls,
            token: OutgoingToken(token),
            table: Mutex::new(HashMap::new()),
        }
    }

    /// The channel to `addr` (`http://host:port` or `https://host:port`), created on first
    /// use; it connects lazily and reconnects on its own. Its calls carry the cluster token.
    pub fn get(&self, addr: &str) -> Result<AuthChannel, ServeError> {
        self.channel(addr)
            .map(|c| InterceptedService::new(c, self.token.clone()))
    }

    fn channel(&self, addr: &str) -> Result<Channel, ServeError> {
        let bad = |reason: String| ServeError::Address {
            addr: addr.to_string(),
            reason,
        };
        let mut table = self
            .table
            .lock()
            .map_err(|_| bad("channel table poisoned".into()))?;
        if let Some(c) = table.get(addr) {
            return Ok(c.clone());
        }
        let mut e = Endpoint::from_shared(addr.to_string()).map_err(|e| bad(e.to_string()))?;
        match (addr.starts_with("https://"), &self.tls) {
            (true, Some(tls)) => {
                e = e.tls_config(tls.tonic()).map_err(|e| bad(e.to_string()))?;
            }
            (true, None) => {
                return Err(bad(
                    "the worker serves TLS; give this process --tls-ca".into()
                ));
            }
            (false, Some(_)) => {
                tracing::warn!(addr, "refusing a plain-text worker: TLS is required");
                return Err(bad(
                    "the worker serves plain text but this process requires TLS (--tls-ca); \
                     start the worker with --tls-cert/--tls-key"
                        .into(),
                ));
            }
            (false, None) => {}
        }
        let c = e
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .connect_lazy();
        table.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_channel_per_address_and_plain_text_only_without_tls() {
        let c = Channels::new(None, Some(ClusterToken::from_key([7; 32]).unwrap()));
        assert!(c.get("http://127.0.0.1:1").is_ok());
        assert_eq!(c.table.lock().unwrap().len(), 1);
        assert!(c.get("http://127.0.0.1:1").is_ok());
        assert_eq!(c.table.lock().unwrap().len(), 1, "the channel is reused");
        let e = c.get("https://127.0.0.1:1").unwrap_err();
        assert!(e.to_string().contains("--tls-ca"), "{e}");
        assert!(c.get("not a uri").is_err());
    }
}
