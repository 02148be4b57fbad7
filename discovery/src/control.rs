//! What the planner, the routers and switchable workers tell each other through the
//! registry, beside the worker records:
//!
//! - **Role requests** at `/duet/<cluster>/roles/<id>` ([`RoleRequest`]): the role a
//!   switchable worker (`duet worker`) should serve. The planner writes them without a
//!   lease: a decision outlives the planner process, and a worker that restarts takes the
//!   requested role instead of its `--role`. A worker follows its own key
//!   ([`follow_role_request`]).
//! - **Router load** at `/duet/<cluster>/load/<router>` ([`RouterLoad`]): the requests a
//!   router finished recently, as its clients saw them (a bounded sample plus the count),
//!   under the router's own lease, so a router that dies stops counting within one TTL.
//!   The planner reads every router's ([`router_loads`]).
//!
//! Both values are JSON with `"version": 1` ([`CONTROL_VERSION`]); unknown fields are
//! ignored, other versions refused, as for worker records.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::registry::{with_timeout, Registry, WatchEvent};
use crate::Role;

/// The schema version of role requests and router load this build writes and reads.
pub const CONTROL_VERSION: u32 = 1;

/// Deadline of one registry call made here.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The role a switchable worker is asked to serve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleRequest {
    pub version: u32,
    pub role: Role,
    /// When it was asked (ms since the Unix epoch).
    pub requested_at_ms: u64,
    /// Why, in words (logged by the worker).
    #[serde(default)]
    pub reason: String,
}

impl RoleRequest {
    pub fn new(role: Role, reason: impl Into<String>) -> Self {
        RoleRequest {
            version: CONTROL_VERSION,
            role,
            requested_at_ms: crate::now_ms(),
            reason: reason.into(),
        }
    }
}

/// One request a router finished, as its client saw it. Short JSON names: a router
/// publishes a few hundred of these every few seconds, and every put stays in etcd's
/// history until compaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObservedRequest {
    /// When it arrived at the router (ms since the Unix epoch).
    #[serde(rename = "t")]
    pub arrival_ms: u64,
    #[serde(rename = "p")]
    pub prompt_tokens: u32,
    #[serde(rename = "o")]
    pub output_tokens: u32,
    /// Time to first token; `None` when none came.
    #[serde(rename = "f")]
    pub ttft_ms: Option<f64>,
    /// Mean time per output token after the first; `None` with fewer than two tokens.
    #[serde(rename = "s")]
    pub tpot_ms: Option<f64>,
    /// It ended with its tokens (not an error or a cancellation).
    #[serde(rename = "k")]
    pub ok: bool,
}

/// What one router publishes about the requests it finished recently.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterLoad {
    pub version: u32,
    /// The router's id (its key's last segment).
    pub router: String,
    pub published_at_ms: u64,
    /// The window the figures cover, ending at `published_at_ms`.
    pub window_ms: u64,
    /// Requests that arrived in the window and have finished (the sample may hold fewer).
    pub finished: u64,
    /// The most recent of them, oldest first.
    pub sample: Vec<ObservedRequest>,
}

/// `/duet/<cluster>/roles/`.
pub fn roles_prefix(cluster: &str) -> String {
    format!("/duet/{cluster}/roles/")
}

/// `/duet/<cluster>/roles/<id>`: the role request of worker `id`.
pub fn role_request_key(cluster: &str, id: &str) -> String {
    format!("{}{id}", roles_prefix(cluster))
}

/// `/duet/<cluster>/load/`.
pub fn load_prefix(cluster: &str) -> String {
    format!("/duet/{cluster}/load/")
}

/// `/duet/<cluster>/load/<router>`: router `router`'s load.
pub fn load_key(cluster: &str, router: &str) -> String {
    format!("{}{router}", load_prefix(cluster))
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

/// Decodes a control value: the version first, then the schema.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let probe: VersionOnly =
        serde_json::from_slice(bytes).map_err(|source| Error::Decode { source })?;
    if probe.version != CONTROL_VERSION {
        return Err(Error::UnsupportedVersion {
            found: probe.version,
            expected: CONTROL_VERSION,
        });
    }
    serde_json::from_slice(bytes).map_err(|source| Error::Decode { source })
}

/// Encodes a control value.
pub fn to_json<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|source| Error::Encode { source })
}

/// Asks worker `id` of `cluster` to serve `request.role`.
pub async fn request_role(
    registry: &dyn Registry,
    cluster: &str,
    id: &str,
    request: &RoleRequest,
) -> Result<()> {
    let key = role_request_key(cluster, id);
    let value = to_json(request)?;
    with_timeout("put", CALL_TIMEOUT, registry.put(&key, value, None)).await?;
    Ok(())
}

/// Worker `id`'s role request, if there is one.
pub async fn role_request(
    registry: &dyn Registry,
    cluster: &str,
    id: &str,
) -> Result<Option<RoleRequest>> {
    Ok(read_exact(registry, &role_request_key(cluster, id))
        .await?
        .0)
}

/// The role request at exactly `key` (a listing of `key` also holds longer keys), and the
/// revision the read reflects.
async fn read_exact(registry: &dyn Registry, key: &str) -> Result<(Option<RoleRequest>, i64)> {
    let listing = with_timeout("list", CALL_TIMEOUT, registry.list(key)).await?;
    let request = listing
        .kvs
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| decode(&kv.value))
        .transpose()?;
    Ok((request, listing.revision))
}

/// Every value under `prefix` that decodes, with its key's remainder (values that do not
/// decode are skipped with a warning: one bad key must not stop the planner).
async fn list_decoded<T: DeserializeOwned>(
    registry: &dyn Registry,
    prefix: &str,
) -> Result<Vec<(String, T)>> {
    let listing = with_timeout("list", CALL_TIMEOUT, registry.list(prefix)).await?;
    Ok(listing
        .kvs
        .into_iter()
        .filter_map(|kv| {
            let name = kv.key.strip_prefix(prefix)?.to_string();
            decode::<T>(&kv.value)
                .inspect_err(|e| tracing::warn!(key = %kv.key, error = %e, "skipping a value"))
                .ok()
                .map(|v| (name, v))
        })
        .collect())
}

/// Every role request of `cluster`, by worker id.
pub async fn role_requests(
    registry: &dyn Registry,
    cluster: &str,
) -> Result<Vec<(String, RoleRequest)>> {
    list_decoded(registry, &roles_prefix(cluster)).await
}

/// Every router's published load in `cluster`.
pub async fn router_loads(registry: &dyn Registry, cluster: &str) -> Result<Vec<RouterLoad>> {
    let loads = list_decoded(registry, &load_prefix(cluster)).await?;
    Ok(loads.into_iter().map(|(_, l)| l).collect())
}

/// Follows worker `id`'s role request until `stop`: the receiver holds the requested role
/// (`None`: none requested). A broken watch is followed by a fresh read after a pause, so a
/// change is seen late rather than never.
pub fn follow_role_request(
    registry: Arc<dyn Registry>,
    cluster: &str,
    id: &str,
    stop: CancellationToken,
) -> watch::Receiver<Option<Role>> {
    let key = role_request_key(cluster, id);
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        const PAUSE: Duration = Duration::from_secs(1);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = follow_once(registry.as_ref(), &key, &tx) => {
                    if let Err(e) = r {
                        tracing::warn!(key = %key, error = %e, "following the role request; reading it again");
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(PAUSE) => {}
            }
        }
    });
    rx
}

/// Reads `key` and applies its changes to `tx` until the watch breaks.
async fn follow_once(
    registry: &dyn Registry,
    key: &str,
    tx: &watch::Sender<Option<Role>>,
) -> Result<()> {
    let (request, revision) = read_exact(registry, key).await?;
    tx.send_replace(request.map(|r| r.role));
    let mut events = with_timeout("watch", CALL_TIMEOUT, registry.watch(key, revision + 1)).await?;
    while let Some(ev) = events.next().await {
        let ev = ev?;
        if ev.key() != key {
            continue;
        }
        let role = match ev {
            WatchEvent::Put(kv) => Some(decode::<RoleRequest>(&kv.value)?.role),
            WatchEvent::Delete { .. } => None,
        };
        tx.send_replace(role);
    }
    Err(Error::WatchBroken {
        reason: "the watch ended".into(),
        source: None,
    })
}

/// Publishes `value()` at `key` under a lease of `ttl`, every `every`, until `stop`, then
/// deletes it (revokes the lease). `value()` returns `None` when nothing changed since the
/// last value it returned: then only the lease is kept alive (an idle publisher writes
/// nothing). A lost lease is granted again and the last value put again; failures are
/// logged and retried on the next tick (a publisher never stops the process it reports on).
pub async fn publish_leased(
    registry: Arc<dyn Registry>,
    key: String,
    ttl: Duration,
    every: Duration,
    mut value: impl FnMut() -> Option<Vec<u8>> + Send + 'static,
    stop: CancellationToken,
) {
    let mut last: Option<Vec<u8>> = None;
    let mut lease = None;
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let fresh = value();
        let r: Result<()> = async {
            let (id, granted) = match lease {
                Some(id) => {
                    with_timeout("keep_alive", CALL_TIMEOUT, registry.keep_alive(id)).await?;
                    (id, false)
                }
                None => {
                    let l = with_timeout("grant", CALL_TIMEOUT, registry.grant_lease(ttl)).await?;
                    lease = Some(l.id);
                    (l.id, true)
                }
            };
            if let Some(v) = fresh {
                last = Some(v);
            } else if !granted {
                return Ok(());
            }
            if let Some(v) = &last {
                with_timeout("put", CALL_TIMEOUT, registry.put(&key, v.clone(), Some(id))).await?;
            }
            Ok(())
        }
        .await;
        if let Err(e) = r {
            tracing::warn!(key = %key, error = %e, "publishing; trying again with a new lease");
            lease = None;
        }
    }
    if let Some(id) = lease {
        let _ = with_timeout("revoke", CALL_TIMEOUT, registry.revoke_lease(id)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryRegistry;

    async fn next_role(rx: &mut watch::Receiver<Option<Role>>) -> Option<Role> {
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .expect("a change within 5 s")
            .expect("the follower runs");
        *rx.borrow_and_update()
    }

    #[tokio::test]
    async fn a_worker_follows_its_own_role_request_only() {
        let reg: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
        let stop = CancellationToken::new();
        let ask = |id: &'static str, role| {
            let reg = reg.clone();
            async move {
                request_role(reg.as_ref(), "c", id, &RoleRequest::new(role, "test"))
                    .await
                    .unwrap()
            }
        };
        ask("w1", Role::Prefill).await;
        let mut rx = follow_role_request(reg.clone(), "c", "w1", stop.clone());
        assert_eq!(next_role(&mut rx).await, Some(Role::Prefill));
        // Another worker's request (a longer id with the same start) is not this one's.
        ask("w10", Role::Decode).await;
        ask("w1", Role::Decode).await;
        assert_eq!(next_role(&mut rx).await, Some(Role::Decode));
        reg.delete(&role_request_key("c", "w1")).await.unwrap();
        assert_eq!(next_role(&mut rx).await, None);
        let all = role_requests(reg.as_ref(), "c").await.unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].0, "w10");
        assert_eq!(
            role_request(reg.as_ref(), "c", "w10")
                .await
                .unwrap()
                .map(|r| r.role),
            Some(Role::Decode)
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn published_load_is_leased_and_removed_when_the_publisher_stops() {
        let reg: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
        let stop = CancellationToken::new();
        let load = RouterLoad {
            version: CONTROL_VERSION,
            router: "r1".into(),
            published_at_ms: 1,
            window_ms: 60_000,
            finished: 0,
            sample: Vec::new(),
        };
        let value = to_json(&load).unwrap();
        let task = tokio::spawn(publish_leased(
            reg.clone(),
            load_key("c", "r1"),
            Duration::from_secs(10),
            Duration::from_millis(10),
            move || Some(value.clone()),
            stop.clone(),
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while router_loads(reg.as_ref(), "c").await.unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "never published");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(router_loads(reg.as_ref(), "c").await.unwrap(), vec![load]);
        stop.cancel();
        task.await.unwrap();
        assert!(router_loads(reg.as_ref(), "c").await.unwrap().is_empty());
    }

    #[test]
    fn other_versions_are_refused() {
        let err = decode::<RoleRequest>(br#"{"version":2,"role":"decode","requested_at_ms":0}"#)
            .unwrap_err();
        assert!(matches!(
            err,
            Error::UnsupportedVersion {
                found: 2,
                expected: 1
            }
        ));
    }
}
