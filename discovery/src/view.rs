//! Router side: a continuously updated view of a cluster's workers.
//!
//! Invariants:
//! - The view is built from a full listing of `/duet/<cluster>/workers/` and then follows a
//!   watch that starts at the listing's revision + 1, so no change between the two is missed.
//!   Whenever the watch breaks, history was compacted, or a probe fails, the view lists again
//!   (never patches over a gap), with a bounded exponential backoff between failed attempts.
//! - While the registry cannot be reached, the last known workers are kept and the snapshot is
//!   marked `stale` (with the instant it became stale); the next successful listing replaces
//!   the workers wholesale and clears `stale`. Before the first listing the view is empty,
//!   `revision == 0` and `stale == true`.
//! - Only well-formed version-1 records whose key matches their content are in the view; a
//!   record that fails to decode removes the key from the view (it cannot be routed to).
//! - Snapshots are immutable (`Arc<Snapshot>`); readers never block the task, and the task
//!   never holds a lock across a registry call. Every registry call has a deadline, and the
//!   task stops when its token is cancelled or the last [`ClusterView`] clone is dropped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::record::{parse_worker_key, workers_prefix, Role, WorkerRecord};
use crate::registry::{with_timeout, Listing, Registry, WatchEvent, WatchStream};
use duet_telemetry::names::{ROUTER_WORKERS, VIEW_STALE, WATCH_RESTARTS_TOTAL};

/// How long [`ClusterView::has_worker`] waits for a worker a caller names to appear. Below
/// the router's 2 s bound on opening a decode stream, so that a worker's refusal of a peer
/// missing from its view reaches the router as that refusal (a failed link: another pair is
/// tried), not as a worker that never answered.
pub const PEER_WAIT: Duration = Duration::from_secs(1);

/// Tuning of a [`ClusterView`].
#[derive(Debug, Clone)]
pub struct ViewOptions {
    /// Deadline of every registry call. Default 2 s.
    pub call_timeout: Duration,
    /// How often the registry is probed while the watch is quiet, to notice an unreachable
    /// registry (a hung connection does not break a watch). Default 1 s.
    pub probe_interval: Duration,
    /// First delay before listing again after a failure. Default 100 ms.
    pub min_backoff: Duration,
    /// Largest delay between attempts. Default 2 s.
    pub max_backoff: Duration,
    /// Whether this view exports the cluster gauges (the router's; a worker that follows
    /// the cluster to check its peers does not). Default true.
    pub export_gauges: bool,
}

impl Default for ViewOptions {
    fn default() -> Self {
        ViewOptions {
            call_timeout: Duration::from_secs(2),
            probe_interval: Duration::from_secs(1),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            export_gauges: true,
        }
    }
}

/// An immutable picture of the cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Workers by registry key.
    pub workers: BTreeMap<String, WorkerRecord>,
    /// Registry revision this snapshot reflects (0: never listed).
    pub revision: i64,
    /// The registry could not be reached recently; this is the last known view.
    pub stale: bool,
    /// Since when the view is stale.
    pub stale_since: Option<Instant>,
    /// When the last worker of a role left the view, for roles that have none now (by
    /// `Role::as_str`): workers that vanished a moment ago are likely to come back (leases
    /// that expired while etcd was frozen, workers registering again), so a caller may wait
    /// a little longer for them than for a role that never had any.
    pub lost_at: BTreeMap<&'static str, Instant>,
}

impl Snapshot {
    fn initial() -> Self {
        Snapshot {
            workers: BTreeMap::new(),
            revision: 0,
            stale: true,
            stale_since: Some(Instant::now()),
            lost_at: BTreeMap::new(),
        }
    }

    /// When the last worker of `role` left the view (`None`: it has some, or never had).
    pub fn lost_at(&self, role: Role) -> Option<Instant> {
        self.lost_at.get(role.as_str()).copied()
    }

    /// Workers of one role, in key order.
    pub fn workers(&self, role: Role) -> impl Iterator<Item = &WorkerRecord> + '_ {
        self.workers.values().filter(move |w| w.role == role)
    }

    /// One worker.
    pub fn get(&self, role: Role, id: &str) -> Option<&WorkerRecord> {
        self.workers.values().find(|w| w.role == role && w.id == id)
    }

    /// The view has been listed at least once.
    pub fn is_synced(&self) -> bool {
        self.revision > 0
    }
}

/// A cluster view (see the module docs). Cheap to clone; the background task stops when the
/// token is cancelled or the last clone is dropped.
#[derive(Clone)]
pub struct ClusterView {
    cluster: Arc<str>,
    rx: watch::Receiver<Arc<Snapshot>>,
    _guard: Arc<DropGuard>,
}

impl std::fmt::Debug for ClusterView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.snapshot();
        f.debug_struct("ClusterView")
            .field("cluster", &self.cluster)
            .field("workers", &s.workers.len())
            .field("revision", &s.revision)
            .field("stale", &s.stale)
            .finish()
    }
}

impl ClusterView {
    /// Starts following `cluster` with default options. Must be called inside a tokio runtime.
    pub fn start(
        registry: Arc<dyn Registry>,
        cluster: impl Into<String>,
        cancel: CancellationToken,
    ) -> ClusterView {
        Self::start_with(registry, cluster, ViewOptions::default(), cancel)
    }

    /// Starts following `cluster`. Must be called inside a tokio runtime.
    pub fn start_with(
        registry: Arc<dyn Registry>,
        cluster: impl Into<String>,
        opts: ViewOptions,
        cancel: CancellationToken,
    ) -> ClusterView {
        let cluster: String = cluster.into();
        let initial = Snapshot::initial();
        let (tx, rx) = watch::channel(Arc::new(initial.clone()));
        let stop = cancel.child_token();
        let task = ViewTask {
            registry,
            prefix: workers_prefix(&cluster),
            cluster: cluster.clone(),
            opts,
            tx,
            cancel: stop.clone(),
            snap: initial,
        };
        task.export_gauges();
        tokio::spawn(task.run());
        ClusterView {
            cluster: cluster.into(),
            rx,
            _guard: Arc::new(stop.drop_guard()),
        }
    }

    /// The cluster this view follows.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.rx.borrow().clone()
    }

    /// Waits for the next snapshot; [`Error::Stopped`] once the view has stopped.
    pub async fn changed(&mut self) -> Result<Arc<Snapshot>> {
        self.rx.changed().await.map_err(|_| Error::Stopped)?;
        Ok(self.rx.borrow_and_update().clone())
    }

    /// Waits until a snapshot satisfies `pred` (checking the current one first).
    pub async fn wait_for(
        &mut self,
        mut pred: impl FnMut(&Snapshot) -> bool,
    ) -> Result<Arc<Snapshot>> {
        let r = self
            .rx
            .wait_for(|s| pred(s))
            .await
            .map_err(|_| Error::Stopped)?;
        Ok(r.clone())
    }

    /// Whether a worker of `role` that satisfies `pred` is in the view, waiting up to
    /// [`PEER_WAIT`] for one to appear (a worker that just registered may reach a caller's
    /// view before this one's).
    pub async fn has_worker(&self, role: Role, pred: impl Fn(&WorkerRecord) -> bool) -> bool {
        let mut rx = self.rx.clone();
        let found = tokio::time::timeout(PEER_WAIT, async {
            rx.wait_for(|s| s.workers(role).any(&pred)).await.is_ok()
        })
        .await;
        found.unwrap_or(false)
    }

    /// A receiver of snapshots, for callers that select on several things.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.rx.clone()
    }

    /// The current workers of one role.
    pub fn workers(&self, role: Role) -> Vec<WorkerRecord> {
        self.snapshot().workers(role).cloned().collect()
    }
}

/// Why the view stopped following its watch.
enum Interrupt {
    Cancelled,
    /// Relist after the given delay; `unreachable` marks the view stale first.
    Restart {
        error: Error,
        unreachable: bool,
    },
}

struct ViewTask {
    registry: Arc<dyn Registry>,
    prefix: String,
    cluster: String,
    opts: ViewOptions,
    tx: watch::Sender<Arc<Snapshot>>,
    cancel: CancellationToken,
    /// The task's working copy; published as a new `Arc` after each change.
    snap: Snapshot,
}

impl ViewTask {
    fn export_gauges(&self) {
        if !self.opts.export_gauges {
            return;
        }
        metrics::gauge!(VIEW_STALE).set(if self.snap.stale { 1.0 } else { 0.0 });
        for role in Role::ALL {
            let draining = self.snap.workers(role).filter(|w| w.draining).count();
            let ready = self.snap.workers(role).count() - draining;
            for (state, n) in [("ready", ready), ("draining", draining)] {
                metrics::gauge!(ROUTER_WORKERS, "role" => role.as_str(), "state" => state)
                    .set(n as f64);
            }
        }
    }

    fn publish(&mut self) {
        let now = Instant::now();
        let before = self.tx.borrow().clone();
        for role in Role::ALL {
            let has = self.snap.workers(role).next().is_some();
            if has {
                self.snap.lost_at.remove(role.as_str());
            } else if before.workers(role).next().is_some() {
                self.snap.lost_at.insert(role.as_str(), now);
            }
        }
        self.export_gauges();
        self.tx.send_replace(Arc::new(self.snap.clone()));
    }

    /// Marks the view stale (once per outage: `stale_since` keeps the first failure).
    fn mark_stale(&mut self, error: &Error) {
        if self.snap.stale {
            return;
        }
        warn!(cluster = %self.cluster, error = %error,
            "registry unreachable; routing on the last known view");
        self.snap.stale = true;
        self.snap.stale_since = Some(Instant::now());
        self.publish();
    }

    /// Decodes one stored value; `None` (with a log line) if it is not a routable record.
    fn decode(&self, key: &str, value: &[u8]) -> Option<WorkerRecord> {
        match parse_worker_key(key) {
            Some((cluster, _, _)) if cluster == self.cluster => {}
            _ => {
                debug!(
                    key,
                    "ignoring a key that is not a worker key of this cluster"
                );
                return None;
            }
        }
        match WorkerRecord::from_json(value) {
            Ok(rec) if rec.key() == key => Some(rec),
            Ok(rec) => {
                warn!(key, record_key = %rec.key(), "worker record does not match its key; ignored");
                None
            }
            Err(e) => {
                warn!(key, error = %e, "unreadable worker record; ignored");
                None
            }
        }
    }

    fn replace_all(&mut self, listing: Listing) {
        let workers = listing
            .kvs
            .iter()
            .filter_map(|kv| self.decode(&kv.key, &kv.value).map(|r| (kv.key.clone(), r)))
            .collect();
        let was_stale = self.snap.stale && self.snap.is_synced();
        self.snap.workers = workers;
        self.snap.revision = listing.revision;
        self.snap.stale = false;
        self.snap.stale_since = None;
        if was_stale {
            info!(cluster = %self.cluster, workers = self.snap.workers.len(),
                "registry reachable again; view refreshed");
        }
        self.publish();
    }

    fn apply(&mut self, event: WatchEvent) {
        self.snap.revision = self.snap.revision.max(event.revision());
        match event {
            WatchEvent::Put(kv) => match self.decode(&kv.key, &kv.value) {
                Some(rec) => {
                    self.snap.workers.insert(kv.key, rec);
                }
                None => {
                    self.snap.workers.remove(&kv.key);
                }
            },
            WatchEvent::Delete { key, .. } => {
                self.snap.workers.remove(&key);
            }
        }
    }

    async fn sleep_or_cancel(&self, d: Duration) -> bool {
        tokio::select! {
            _ = self.cancel.cancelled() => false,
            _ = tokio::time::sleep(d) => true,
        }
    }

    async fn run(mut self) {
        let t = self.opts.call_timeout;
        let mut backoff = self.opts.min_backoff;
        loop {
            if self.cancel.is_cancelled() {
                break;
            }
            let listed = tokio::select! {
                _ = self.cancel.cancelled() => break,
                r = with_timeout("list", t, self.registry.list(&self.prefix)) => r,
            };
            match listed {
                Ok(listing) => self.replace_all(listing),
                Err(e) => {
                    debug!(cluster = %self.cluster, error = %e, retry_in = ?backoff, "listing failed");
                    self.mark_stale(&e);
                    if !self.sleep_or_cancel(backoff).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.opts.max_backoff);
                    continue;
                }
            }
            let from = self.snap.revision + 1;
            let watched = tokio::select! {
                _ = self.cancel.cancelled() => break,
                r = with_timeout("watch", t, self.registry.watch(&self.prefix, from)) => r,
            };
            let started = tokio::time::Instant::now();
            let interrupt = match watched {
                Ok(stream) => self.follow(stream).await,
                Err(error) => Interrupt::Restart {
                    unreachable: !matches!(error, Error::Compacted { .. }),
                    error,
                },
            };
            let (error, unreachable) = match interrupt {
                Interrupt::Cancelled => break,
                Interrupt::Restart { error, unreachable } => (error, unreachable),
            };
            metrics::counter!(WATCH_RESTARTS_TOTAL).increment(1);
            if started.elapsed() >= self.opts.max_backoff {
                // The watch was healthy for a while: this is a fresh incident.
                backoff = self.opts.min_backoff;
            }
            if unreachable {
                self.mark_stale(&error);
            }
            match error {
                Error::Compacted { .. } => {
                    debug!(cluster = %self.cluster, error = %error, "watch history compacted; relisting");
                }
                _ => {
                    debug!(cluster = %self.cluster, error = %error, retry_in = ?backoff, "watch interrupted; relisting");
                    if !self.sleep_or_cancel(backoff).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.opts.max_backoff);
                }
            }
        }
        debug!(cluster = %self.cluster, "cluster view stopped");
    }

    /// Applies watch events until the watch ends, a probe fails, or the task is cancelled.
    async fn follow(&mut self, mut stream: WatchStream) -> Interrupt {
        let t = self.opts.call_timeout;
        let mut next_probe = tokio::time::Instant::now() + self.opts.probe_interval;
        loop {
            let cancel = self.cancel.clone();
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Interrupt::Cancelled,
                item = stream.next() => {
                    let mut item = item;
                    // Apply everything already delivered before publishing once.
                    loop {
                        match item {
                            Some(Ok(ev)) => self.apply(ev),
                            Some(Err(error)) => {
                                self.publish();
                                // A broken stream says nothing about reachability: the
                                // relist that follows decides.
                                return Interrupt::Restart { error, unreachable: false };
                            }
                            None => {
                                self.publish();
                                return Interrupt::Restart {
                                    error: Error::WatchBroken { reason: "watch stream ended".into(), source: None },
                                    unreachable: false,
                                };
                            }
                        }
                        match stream.next().now_or_never() {
                            Some(next) => item = next,
                            None => break,
                        }
                    }
                    self.publish();
                }
                _ = tokio::time::sleep_until(next_probe) => {
                    match with_timeout("probe", t, self.registry.probe()).await {
                        Ok(_) => next_probe = tokio::time::Instant::now() + self.opts.probe_interval,
                        Err(error) => return Interrupt::Restart { error, unreachable: true },
                    }
                }
            }
        }
    }
}
