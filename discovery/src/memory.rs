//! In-memory [`Registry`] for the all-in-one process and for tests.
//!
//! It follows the same contract as etcd (see [`crate::registry`]): revisions start at 1 and
//! increase by one per mutation; leases expire `ttl` after their last renewal, measured with
//! tokio's clock (so tests may pause and advance time), and their keys are deleted with a
//! watch event; a bounded history serves watches from older revisions until it is trimmed or
//! [`MemoryRegistry::compact`]ed, after which such watches fail with [`Error::Compacted`].
//!
//! Fault injection for tests: [`MemoryRegistry::set_available`] simulates an outage (every
//! call fails with [`Error::Unavailable`], open watches break, leases keep expiring as they
//! would on a server the client cannot reach) and [`MemoryRegistry::break_watches`] breaks open
//! watches only.
//!
//! Cloning is cheap and shares the store. Expiry runs in a background task started by the
//! first [`Registry::grant_lease`] (so construction needs no runtime); the task ends when the
//! last clone is dropped. Expiry is also applied at the start of every call, so results never
//! depend on when that task last ran.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::registry::{KeyValue, Lease, LeaseId, Listing, Registry, WatchEvent, WatchStream};

/// Default number of events kept for watches that start in the past.
pub const DEFAULT_HISTORY_LIMIT: usize = 10_000;

/// In-memory registry (see the module docs).
#[derive(Clone)]
pub struct MemoryRegistry {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Wakes the expiry task when a lease deadline may have moved earlier.
    wake: Arc<Notify>,
    reaper_started: AtomicBool,
}

struct Entry {
    value: Vec<u8>,
    lease: Option<i64>,
    mod_revision: i64,
}

struct LeaseState {
    ttl: Duration,
    deadline: Instant,
}

struct Watcher {
    prefix: String,
    tx: mpsc::UnboundedSender<Result<WatchEvent>>,
}

struct State {
    revision: i64,
    /// Watches must start at or after this revision.
    compact_revision: i64,
    next_lease: i64,
    kvs: BTreeMap<String, Entry>,
    leases: HashMap<i64, LeaseState>,
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    watchers: Vec<Watcher>,
    available: bool,
}

impl Default for MemoryRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("MemoryRegistry")
            .field("revision", &st.revision)
            .field("keys", &st.kvs.len())
            .field("leases", &st.leases.len())
            .field("available", &st.available)
            .finish()
    }
}

impl MemoryRegistry {
    /// An empty store at revision 1.
    pub fn new() -> Self {
        Self::with_history_limit(DEFAULT_HISTORY_LIMIT)
    }

    /// An empty store that keeps at most `limit` events of history (at least 1).
    pub fn with_history_limit(limit: usize) -> Self {
        MemoryRegistry {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    revision: 1,
                    compact_revision: 0,
                    next_lease: 1,
                    kvs: BTreeMap::new(),
                    leases: HashMap::new(),
                    history: VecDeque::new(),
                    history_limit: limit.max(1),
                    watchers: Vec::new(),
                    available: true,
                }),
                wake: Arc::new(Notify::new()),
                reaper_started: AtomicBool::new(false),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the state consistent at the statement level;
        // keep serving rather than poisoning every later caller.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Locks the state after applying expiry; fails if an outage is simulated.
    fn live(&self, op: &'static str) -> Result<MutexGuard<'_, State>> {
        let mut st = self.lock();
        st.expire(Instant::now());
        if !st.available {
            return Err(Error::Unavailable { op, source: None });
        }
        Ok(st)
    }

    /// Simulates an outage (`false`) or ends it (`true`). Going unavailable breaks open watches.
    pub fn set_available(&self, available: bool) {
        let mut st = self.lock();
        st.available = available;
        if !available {
            st.break_watches("registry unavailable (simulated outage)");
        }
    }

    /// Breaks every open watch (each receives [`Error::WatchBroken`]).
    pub fn break_watches(&self) {
        self.lock().break_watches("watch broken (fault injection)");
    }

    /// Drops history before `revision`: later watches must start at `revision` or after.
    pub fn compact(&self, revision: i64) {
        let mut st = self.lock();
        let revision = revision.min(st.revision);
        while st.history.front().is_some_and(|e| e.revision() < revision) {
            st.history.pop_front();
        }
        st.compact_revision = st.compact_revision.max(revision);
    }

    /// The current store revision.
    pub fn revision(&self) -> i64 {
        self.lock().revision
    }

    /// The value at `key`, if any (after applying expiry).
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let mut st = self.lock();
        st.expire(Instant::now());
        st.kvs.get(key).map(|e| e.value.clone())
    }

    /// Number of live leases (after applying expiry).
    pub fn lease_count(&self) -> usize {
        let mut st = self.lock();
        st.expire(Instant::now());
        st.leases.len()
    }

    fn ensure_reaper(&self) {
        if self.inner.reaper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let wake = self.inner.wake.clone();
        tokio::spawn(reaper(weak, wake));
    }
}

/// Deletes expired leases' keys close to their deadline, so watchers see them go without
/// anyone calling the registry. Holds only a weak reference: ends with the last clone.
async fn reaper(weak: Weak<Inner>, wake: Arc<Notify>) {
    const IDLE: Duration = Duration::from_secs(1);
    loop {
        let next = {
            let Some(inner) = weak.upgrade() else { return };
            let mut st = inner
                .state
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let now = Instant::now();
            st.expire(now);
            st.leases
                .values()
                .map(|l| l.deadline)
                .min()
                .unwrap_or(now + IDLE)
                .min(now + IDLE)
        };
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = wake.notified() => {}
        }
    }
}

impl State {
    fn expire(&mut self, now: Instant) {
        let expired: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.drop_lease(id);
        }
    }

    fn drop_lease(&mut self, id: i64) {
        if self.leases.remove(&id).is_none() {
            return;
        }
        let keys: Vec<String> = self
            .kvs
            .iter()
            .filter(|(_, e)| e.lease == Some(id))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.remove_key(&key);
        }
    }

    fn remove_key(&mut self, key: &str) {
        if self.kvs.remove(key).is_some() {
            self.revision += 1;
            let revision = self.revision;
            self.emit(WatchEvent::Delete {
                key: key.to_string(),
                revision,
            });
        }
    }

    fn emit(&mut self, event: WatchEvent) {
        self.watchers.retain(|w| {
            !event.key().starts_with(&w.prefix) || w.tx.send(Ok(event.clone())).is_ok()
        });
        self.history.push_back(event);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.compact_revision = self.compact_revision.max(old.revision() + 1);
            }
        }
    }

    fn break_watches(&mut self, reason: &str) {
        for w in self.watchers.drain(..) {
            let _ = w.tx.send(Err(Error::WatchBroken {
                reason: reason.to_string(),
                source: None,
            }));
        }
    }
}

#[async_trait]
impl Registry for MemoryRegistry {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        self.ensure_reaper();
        let lease = {
            let mut st = self.live("grant_lease")?;
            let id = st.next_lease;
            st.next_lease += 1;
            st.leases.insert(
                id,
                LeaseState {
                    ttl,
                    deadline: Instant::now() + ttl,
                },
            );
            Lease {
                id: LeaseId(id),
                ttl,
            }
        };
        self.inner.wake.notify_one();
        Ok(lease)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        let mut st = self.live("keep_alive")?;
        match st.leases.get_mut(&lease.0) {
            Some(l) => {
                l.deadline = Instant::now() + l.ttl;
                Ok(())
            }
            None => Err(Error::LeaseNotFound { lease: lease.0 }),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let mut st = self.live("revoke_lease")?;
        st.drop_lease(lease.0);
        Ok(())
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64> {
        let mut st = self.live("put")?;
        if let Some(l) = lease {
            if !st.leases.contains_key(&l.0) {
                return Err(Error::LeaseNotFound { lease: l.0 });
            }
        }
        st.revision += 1;
        let revision = st.revision;
        st.kvs.insert(
            key.to_string(),
            Entry {
                value: value.clone(),
                lease: lease.map(|l| l.0),
                mod_revision: revision,
            },
        );
        st.emit(WatchEvent::Put(KeyValue {
            key: key.to_string(),
            value,
            mod_revision: revision,
        }));
        Ok(revision)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let mut st = self.live("delete")?;
        st.remove_key(key);
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Listing> {
        let st = self.live("list")?;
        let kvs = st
            .kvs
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, e)| KeyValue {
                key: k.clone(),
                value: e.value.clone(),
                mod_revision: e.mod_revision,
            })
            .collect();
        Ok(Listing {
            kvs,
            revision: st.revision,
        })
    }

    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream> {
        let mut st = self.live("watch")?;
        let from = if from_revision <= 0 {
            st.revision + 1
        } else {
            from_revision
        };
        if from < st.compact_revision {
            return Err(Error::Compacted {
                requested: from,
                compact_revision: st.compact_revision,
            });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        for event in st
            .history
            .iter()
            .filter(|e| e.revision() >= from && e.key().starts_with(prefix))
        {
            // The receiver is still in our hands: this cannot fail.
            let _ = tx.send(Ok(event.clone()));
        }
        st.watchers.push(Watcher {
            prefix: prefix.to_string(),
            tx,
        });
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(stream.boxed())
    }

    async fn probe(&self) -> Result<i64> {
        Ok(self.live("probe")?.revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn lease_expiry_deletes_keys_and_emits_events() {
        let reg = MemoryRegistry::new();
        let lease = reg.grant_lease(Duration::from_secs(2)).await.unwrap();
        let r1 = reg
            .put("/p/a", b"1".to_vec(), Some(lease.id))
            .await
            .unwrap();
        reg.put("/p/b", b"2".to_vec(), None).await.unwrap();
        let mut w = reg.watch("/p/", r1 + 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1900)).await;
        assert!(reg.get("/p/a").is_some());
        tokio::time::sleep(Duration::from_millis(200)).await;
        // The reaper deleted the key without anyone calling the registry.
        let ev = tokio::time::timeout(Duration::from_millis(10), w.next()).await;
        let ev = ev.unwrap().unwrap().unwrap();
        assert!(matches!(ev, WatchEvent::Put(ref kv) if kv.key == "/p/b"));
        let ev = w.next().await.unwrap().unwrap();
        assert!(matches!(ev, WatchEvent::Delete { ref key, .. } if key == "/p/a"));
        assert!(reg.get("/p/a").is_none());
        assert!(matches!(
            reg.keep_alive(lease.id).await,
            Err(Error::LeaseNotFound { .. })
        ));
        assert!(matches!(
            reg.put("/p/c", vec![], Some(lease.id)).await,
            Err(Error::LeaseNotFound { .. })
        ));
    }

    #[tokio::test]
    async fn watch_replays_history_and_reports_compaction() {
        let reg = MemoryRegistry::with_history_limit(3);
        for i in 0..5 {
            reg.put(&format!("/p/{i}"), vec![i], None).await.unwrap();
        }
        // Revisions 2..=6 were written; only 4..=6 are kept.
        let listing = reg.list("/p/").await.unwrap();
        assert_eq!(listing.revision, 6);
        assert_eq!(listing.kvs.len(), 5);
        assert!(matches!(
            reg.watch("/p/", 3).await,
            Err(Error::Compacted {
                compact_revision: 4,
                ..
            })
        ));
        let mut w = reg.watch("/p/", 5).await.unwrap();
        assert_eq!(w.next().await.unwrap().unwrap().revision(), 5);
        assert_eq!(w.next().await.unwrap().unwrap().revision(), 6);
        reg.compact(6);
        assert!(reg.watch("/p/", 5).await.is_err());
        reg.break_watches();
        assert!(matches!(
            w.next().await,
            Some(Err(Error::WatchBroken { .. }))
        ));
    }

    #[tokio::test]
    async fn outage_fails_calls_and_breaks_watches() {
        let reg = MemoryRegistry::new();
        let mut w = reg.watch("/p/", 0).await.unwrap();
        reg.set_available(false);
        assert!(matches!(
            reg.list("/p/").await,
            Err(Error::Unavailable { .. })
        ));
        assert!(matches!(
            w.next().await,
            Some(Err(Error::WatchBroken { .. }))
        ));
        reg.set_available(true);
        assert!(reg.probe().await.is_ok());
    }
}
