//! etcd-backed [`Registry`] (etcd v3 API through `etcd-client`).
//!
//! Invariants:
//! - Every unary call and every stream set-up is bounded by [`EtcdOptions::request_timeout`];
//!   an elapsed deadline is [`Error::Timeout`], never a hang. (Callers may add a tighter
//!   deadline of their own.)
//! - "Lease not found" answers, whatever RPC they come from, become [`Error::LeaseNotFound`];
//!   revoking a lease that no longer exists succeeds.
//! - A watch is established (etcd acknowledged it) before [`Registry::watch`] returns; a
//!   compacted start revision is reported as [`Error::Compacted`], a cancelled or failed stream
//!   as [`Error::WatchBroken`], after which the stream ends.
//! - The client reconnects on its own; this type keeps no per-lease state, so it survives etcd
//!   restarts (one keep-alive stream is opened per renewal, which at TTL/3 is cheap).

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, CompactionOptions, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions,
};
use futures::StreamExt;

use crate::error::{Error, Result};
use crate::registry::{
    with_timeout, KeyValue, Lease, LeaseId, Listing, Registry, WatchEvent, WatchStream,
};

/// How to reach etcd. `Debug` shows neither key material nor the password.
#[derive(Clone)]
pub struct EtcdOptions {
    /// Client URLs (`http://host:port` or `host:port`).
    pub endpoints: Vec<String>,
    /// Deadline for establishing a connection.
    pub connect_timeout: Duration,
    /// Deadline for each call (and for setting up each stream).
    pub request_timeout: Duration,
    /// HTTP/2 keep-alive (interval, timeout) to notice dead connections. etcd rejects pings
    /// more frequent than its `--grpc-keepalive-min-time` (5 s by default).
    pub http2_keep_alive: Option<(Duration, Duration)>,
    /// TLS towards etcd (`https://` endpoints): its CA, and a client certificate when etcd
    /// runs with `--client-cert-auth`.
    pub tls: Option<etcd_client::TlsOptions>,
    /// User and password when etcd has authentication enabled; the token is refreshed
    /// when it expires.
    pub credentials: Option<EtcdCredentials>,
}

impl fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdOptions")
            .field("endpoints", &self.endpoints)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("http2_keep_alive", &self.http2_keep_alive)
            .field("tls", &self.tls.as_ref().map(|_| "<configured>"))
            .field("credentials", &self.credentials)
            .finish()
    }
}

/// An etcd user and password. `Debug` never shows the password.
#[derive(Clone)]
pub struct EtcdCredentials {
    user: String,
    password: String,
}

impl EtcdCredentials {
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        EtcdCredentials {
            user: user.into(),
            password: password.into(),
        }
    }
}

impl fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EtcdCredentials({}, <hidden>)", self.user)
    }
}

impl EtcdOptions {
    /// Options with defaults (connect 2 s, request 3 s, HTTP/2 keep-alive every 10 s).
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        EtcdOptions {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(3),
            http2_keep_alive: Some((Duration::from_secs(10), Duration::from_secs(5))),
            tls: None,
            credentials: None,
        }
    }
}

/// etcd-backed registry. Cheap to clone (shares the connection).
#[derive(Clone)]
pub struct EtcdRegistry {
    client: Client,
    opts: EtcdOptions,
}

impl fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("endpoints", &self.opts.endpoints)
            .finish()
    }
}

fn etcd_err(op: &'static str, e: etcd_client::Error) -> Error {
    let lease_gone = match &e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("lease not found"),
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
    };
    if lease_gone {
        // The id is filled in by the caller when it knows it.
        return Error::LeaseNotFound { lease: 0 };
    }
    Error::Etcd { op, source: e }
}

fn lease_err(op: &'static str, lease: LeaseId, e: etcd_client::Error) -> Error {
    match etcd_err(op, e) {
        Error::LeaseNotFound { .. } => Error::LeaseNotFound { lease: lease.0 },
        other => other,
    }
}

impl EtcdRegistry {
    /// Creates the client. The connection itself is lazy: this succeeds while etcd is down,
    /// and calls fail (within their deadline) until it is up.
    pub async fn connect(opts: EtcdOptions) -> Result<Self> {
        if opts.endpoints.is_empty() {
            return Err(Error::Etcd {
                op: "connect",
                source: etcd_client::Error::InvalidArgs("no etcd endpoints given".into()),
            });
        }
        let mut copts = ConnectOptions::new().with_connect_timeout(opts.connect_timeout);
        if let Some((interval, timeout)) = opts.http2_keep_alive {
            copts = copts.with_keep_alive(interval, timeout);
        }
        if let Some(tls) = &opts.tls {
            copts = copts.with_tls(tls.clone());
        }
        if let Some(c) = &opts.credentials {
            copts = copts
                .with_user(c.user.clone(), c.password.clone())
                .with_auto_token_refresh(true);
        }
        let client = with_timeout("connect", opts.connect_timeout, async {
            Client::connect(&opts.endpoints, Some(copts))
                .await
                .map_err(|e| etcd_err("connect", e))
        })
        .await?;
        Ok(EtcdRegistry { client, opts })
    }

    /// The options this registry was created with.
    pub fn options(&self) -> &EtcdOptions {
        &self.opts
    }

    /// Compacts etcd's history up to `revision` (physically). Watches that start earlier fail
    /// with [`Error::Compacted`]. Maintenance and tests; duet itself never compacts.
    pub async fn compact(&self, revision: i64) -> Result<()> {
        let mut c = self.client.clone();
        self.timed("compact", async move {
            c.compact(revision, Some(CompactionOptions::new().with_physical()))
                .await
                .map(|_| ())
                .map_err(|e| etcd_err("compact", e))
        })
        .await
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        with_timeout(op, self.opts.request_timeout, fut).await
    }
}

fn convert_event(ev: &etcd_client::Event) -> Option<WatchEvent> {
    let kv = ev.kv()?;
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    Some(match ev.event_type() {
        EventType::Put => WatchEvent::Put(KeyValue {
            key,
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        }),
        EventType::Delete => WatchEvent::Delete {
            key,
            revision: kv.mod_revision(),
        },
    })
}

struct WatchState {
    stream: etcd_client::WatchStream,
    pending: VecDeque<WatchEvent>,
    requested: i64,
    done: bool,
}

impl WatchState {
    /// Interprets one watch response: queues its events, or returns the error that ends the
    /// stream.
    fn absorb(&mut self, resp: &etcd_client::WatchResponse) -> Result<()> {
        if resp.compact_revision() > 0 {
            return Err(Error::Compacted {
                requested: self.requested,
                compact_revision: resp.compact_revision(),
            });
        }
        if resp.canceled() {
            return Err(Error::WatchBroken {
                reason: format!("etcd cancelled the watch: {}", resp.cancel_reason()),
                source: None,
            });
        }
        self.pending
            .extend(resp.events().iter().filter_map(convert_event));
        Ok(())
    }

    async fn next(mut self) -> Option<(Result<WatchEvent>, Self)> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Some((Ok(ev), self));
            }
            if self.done {
                return None;
            }
            let failure = match self.stream.message().await {
                Ok(Some(resp)) => match self.absorb(&resp) {
                    Ok(()) => continue,
                    Err(e) => e,
                },
                Ok(None) => Error::WatchBroken {
                    reason: "etcd closed the watch stream".into(),
                    source: None,
                },
                Err(e) => Error::WatchBroken {
                    reason: "etcd watch stream failed".into(),
                    source: Some(Box::new(e)),
                },
            };
            self.done = true;
            self.pending.clear();
            return Some((Err(failure), self));
        }
    }
}

#[async_trait]
impl Registry for EtcdRegistry {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        // etcd counts whole seconds; round up so a lease never lives shorter than asked.
        let secs = ttl.as_millis().div_ceil(1000).max(1) as i64;
        let mut c = self.client.clone();
        let resp = self
            .timed("grant_lease", async move {
                c.lease_grant(secs, None)
                    .await
                    .map_err(|e| etcd_err("grant_lease", e))
            })
            .await?;
        if !resp.error().is_empty() {
            return Err(Error::Etcd {
                op: "grant_lease",
                source: etcd_client::Error::Internal(resp.error().to_string()),
            });
        }
        Ok(Lease {
            id: LeaseId(resp.id()),
            ttl: Duration::from_secs(resp.ttl().max(0) as u64),
        })
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        let mut c = self.client.clone();
        self.timed("keep_alive", async move {
            // `keep_alive` sends one request and waits for its answer; a TTL <= 0 in the answer
            // is reported as "lease not found". Dropping the keeper closes the stream.
            c.lease_keep_alive(lease.0)
                .await
                .map(|_| ())
                .map_err(|e| lease_err("keep_alive", lease, e))
        })
        .await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let mut c = self.client.clone();
        self.timed("revoke_lease", async move {
            match c.lease_revoke(lease.0).await {
                Ok(_) => Ok(()),
                Err(e) => match lease_err("revoke_lease", lease, e) {
                    Error::LeaseNotFound { .. } => Ok(()),
                    other => Err(other),
                },
            }
        })
        .await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64> {
        let mut c = self.client.clone();
        let key = key.to_string();
        self.timed("put", async move {
            let opts = lease.map(|l| PutOptions::new().with_lease(l.0));
            let resp = c.put(key, value, opts).await.map_err(|e| match lease {
                Some(l) => lease_err("put", l, e),
                None => etcd_err("put", e),
            })?;
            Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let mut c = self.client.clone();
        let key = key.to_string();
        self.timed("delete", async move {
            c.delete(key, None)
                .await
                .map(|_| ())
                .map_err(|e| etcd_err("delete", e))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Listing> {
        let mut c = self.client.clone();
        let prefix = prefix.to_string();
        self.timed("list", async move {
            let mut resp = c
                .get(prefix, Some(GetOptions::new().with_prefix()))
                .await
                .map_err(|e| etcd_err("list", e))?;
            let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
            let kvs = resp
                .take_kvs()
                .into_iter()
                .map(|kv| KeyValue {
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    value: kv.value().to_vec(),
                    mod_revision: kv.mod_revision(),
                })
                .collect();
            Ok(Listing { kvs, revision })
        })
        .await
    }

    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream> {
        let mut c = self.client.clone();
        let prefix = prefix.to_string();
        let state = self
            .timed("watch", async move {
                let mut opts = WatchOptions::new().with_prefix();
                if from_revision > 0 {
                    opts = opts.with_start_revision(from_revision);
                }
                let stream = c
                    .watch(prefix, Some(opts))
                    .await
                    .map_err(|e| etcd_err("watch", e))?;
                let mut state = WatchState {
                    stream,
                    pending: VecDeque::new(),
                    requested: from_revision,
                    done: false,
                };
                // Wait for etcd's acknowledgement (or its refusal) before handing the stream out.
                match state.stream.message().await {
                    Ok(Some(resp)) => state.absorb(&resp)?,
                    Ok(None) => {
                        return Err(Error::WatchBroken {
                            reason: "etcd closed the watch stream before acknowledging it".into(),
                            source: None,
                        })
                    }
                    Err(e) => return Err(etcd_err("watch", e)),
                }
                Ok(state)
            })
            .await?;
        Ok(futures::stream::unfold(state, WatchState::next).boxed())
    }

    async fn probe(&self) -> Result<i64> {
        let mut c = self.client.clone();
        self.timed("probe", async move {
            // A linearizable read: succeeds only if the cluster has a leader and quorum.
            let resp = c
                .get("/duet/", Some(GetOptions::new().with_count_only()))
                .await
                .map_err(|e| etcd_err("probe", e))?;
            Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
        })
        .await
    }
}
