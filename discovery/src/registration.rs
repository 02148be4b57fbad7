//! Worker side: keep a [`WorkerRecord`] registered under a lease and publish its changes.
//!
//! Invariants:
//! - While the task runs, the record is present at its key under a live lease, except for at
//!   most one lease TTL after the registry became unreachable or the lease was lost; then the
//!   task grants a new lease and puts the record again (re-registration), retrying with a
//!   bounded backoff until the registry answers.
//! - The lease is renewed every TTL/3. A renewal answered with "lease not found", or renewals
//!   failing for a whole TTL, mean the lease is (presumed) gone: the task re-registers.
//! - Updates are coalesced: a change is published at most once per
//!   [`RegistrationOptions::publish_interval`], or once per
//!   [`RegistrationOptions::min_publish_interval`] for a big change (free KV blocks moved by at
//!   least [`RegistrationOptions::big_change_fraction`] of the total, the draining flag
//!   flipped, or anything besides capacity changed). Two publishes of the record are never
//!   closer than `min_publish_interval` (re-registration excepted), and the latest local state
//!   is always published eventually.
//! - Identity (`version`, `cluster`, `role`, `id`) is fixed at start: updates cannot move the
//!   record to another key.
//! - Cancelling the token (or dropping the [`Registration`]) stops the task *without* deleting
//!   anything: to the cluster this looks like a crash, and the key disappears when the lease
//!   expires. [`Registration::deregister`] is the graceful path: it deletes the key at once and
//!   revokes the lease.
//! - Every registry call is bounded by [`RegistrationOptions::call_timeout`].

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::record::{now_ms, Capacity, WorkerRecord, RECORD_VERSION};
use crate::registry::{with_timeout, Lease, LeaseId, Registry};
use duet_telemetry::names::{LEASE_FAILURES_TOTAL, LEASE_RENEWALS_TOTAL, REGISTRATIONS_TOTAL};

/// Tuning of a [`Registration`].
#[derive(Debug, Clone)]
pub struct RegistrationOptions {
    /// Lease TTL: how long the record outlives its worker. Default 5 s.
    pub ttl: Duration,
    /// Coalescing window for ordinary changes. Default 500 ms.
    pub publish_interval: Duration,
    /// Floor between two publishes, also for big changes. Default 100 ms.
    pub min_publish_interval: Duration,
    /// Fraction of total KV blocks by which free blocks must move to count as a big change.
    /// Default 0.25.
    pub big_change_fraction: f64,
    /// Deadline of every registry call. Default 2 s (renewals use at most TTL/3).
    pub call_timeout: Duration,
    /// Largest delay between re-registration attempts. Default 2 s.
    pub max_backoff: Duration,
}

impl Default for RegistrationOptions {
    fn default() -> Self {
        RegistrationOptions {
            ttl: Duration::from_secs(5),
            publish_interval: Duration::from_millis(500),
            min_publish_interval: Duration::from_millis(100),
            big_change_fraction: 0.25,
            call_timeout: Duration::from_secs(2),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl RegistrationOptions {
    /// Defaults with another TTL.
    pub fn with_ttl(ttl: Duration) -> Self {
        RegistrationOptions {
            ttl,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<()> {
        if self.ttl.is_zero() {
            return Err(Error::invalid("registration ttl must be positive"));
        }
        if self.call_timeout.is_zero() {
            return Err(Error::invalid("registration call_timeout must be positive"));
        }
        if self.min_publish_interval > self.publish_interval {
            return Err(Error::invalid(
                "min_publish_interval must not exceed publish_interval",
            ));
        }
        if !(0.0..=1.0).contains(&self.big_change_fraction) {
            return Err(Error::invalid("big_change_fraction must be within 0..=1"));
        }
        Ok(())
    }
}

/// What a [`Registration`] has achieved so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistrationStatus {
    /// The record is believed present under a live lease.
    pub registered: bool,
    /// The current lease, if any.
    pub lease: Option<LeaseId>,
    /// Successful (re-)registrations, the first one included.
    pub registrations: u64,
    /// Successful publishes of updates (registrations excluded).
    pub publishes: u64,
    /// The most recent error, if the last attempt at something failed.
    pub last_error: Option<String>,
}

struct Desired {
    record: WorkerRecord,
    seq: u64,
}

struct Shared {
    desired: Mutex<Desired>,
    status: Mutex<RegistrationStatus>,
    changed: Notify,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A worker's registration (see the module docs). Dropping it stops the task like cancelling
/// its token does.
pub struct Registration {
    shared: Arc<Shared>,
    registry: Arc<dyn Registry>,
    key: String,
    opts: RegistrationOptions,
    stop: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("key", &self.key)
            .field("status", &self.status())
            .finish()
    }
}

impl Registration {
    /// Validates `record`, registers it once (lease + put; errors are returned, so a worker
    /// learns at start-up that the registry is unreachable), then spawns the task that keeps
    /// it registered until `cancel` fires, the handle is dropped, or
    /// [`Registration::deregister`] is called.
    pub async fn start(
        registry: Arc<dyn Registry>,
        mut record: WorkerRecord,
        opts: RegistrationOptions,
        cancel: CancellationToken,
    ) -> Result<Registration> {
        opts.validate()?;
        sanitize(&mut record);
        record.validate()?;
        let key = record.key();
        let shared = Arc::new(Shared {
            desired: Mutex::new(Desired { record, seq: 0 }),
            status: Mutex::new(RegistrationStatus::default()),
            changed: Notify::new(),
        });
        let stop = cancel.child_token();
        let mut task = Task {
            registry: registry.clone(),
            shared: shared.clone(),
            opts: opts.clone(),
            key: key.clone(),
            cancel: stop.clone(),
            lease: None,
            published_seq: 0,
            published: None,
            last_publish: Instant::now(),
            publish_blocked_until: None,
        };
        task.register_once().await?;
        info!(key = %key, backend = registry.backend(), "worker registered");
        let handle = tokio::spawn(task.run());
        Ok(Registration {
            shared,
            registry,
            key,
            opts,
            stop,
            task: Mutex::new(Some(handle)),
        })
    }

    /// The registry key of this worker.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The local (latest) record, which may not be published yet.
    pub fn record(&self) -> WorkerRecord {
        lock(&self.shared.desired).record.clone()
    }

    /// What the task has achieved so far.
    pub fn status(&self) -> RegistrationStatus {
        lock(&self.shared.status).clone()
    }

    /// Changes the local record; the task publishes it according to the coalescing rules.
    /// Identity fields (`version`, `cluster`, `role`, `id`) are restored if `f` changes them.
    pub fn update(&self, f: impl FnOnce(&mut WorkerRecord)) {
        let mut d = lock(&self.shared.desired);
        let before = d.record.clone();
        f(&mut d.record);
        d.record.version = RECORD_VERSION;
        d.record.cluster.clone_from(&before.cluster);
        d.record.role = before.role;
        d.record.id.clone_from(&before.id);
        sanitize(&mut d.record);
        if d.record != before {
            d.seq += 1;
            drop(d);
            self.shared.changed.notify_one();
        }
    }

    /// Replaces the published capacity.
    pub fn update_capacity(&self, capacity: Capacity) {
        self.update(|r| r.capacity = capacity);
    }

    /// Sets the draining flag (a big change: published within `min_publish_interval`).
    pub fn set_draining(&self, draining: bool) {
        self.update(|r| r.draining = draining);
    }

    /// Graceful shutdown: stops the task, deletes the key at once and revokes the lease.
    /// Idempotent; later updates are ignored. Takes at most two call timeouts; if the registry
    /// is unreachable the error is returned and the key disappears when the lease expires.
    pub async fn deregister(&self) -> Result<()> {
        self.stop.cancel();
        let handle = lock(&self.task).take();
        if let Some(handle) = handle {
            if let Err(e) = handle.await {
                warn!(key = %self.key, error = %e, "registration task ended abnormally");
            }
        }
        let lease = {
            let mut st = lock(&self.shared.status);
            st.registered = false;
            st.lease.take()
        };
        let t = self.opts.call_timeout;
        let deleted = with_timeout("delete", t, self.registry.delete(&self.key)).await;
        let revoked = match lease {
            Some(l) => with_timeout("revoke_lease", t, self.registry.revoke_lease(l)).await,
            None => Ok(()),
        };
        deleted?;
        revoked?;
        info!(key = %self.key, "worker deregistered");
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// JSON cannot carry non-finite floats (serde_json writes `null`, which readers reject).
fn sanitize(record: &mut WorkerRecord) {
    if !record.capacity.tokens_per_second.is_finite() {
        record.capacity.tokens_per_second = 0.0;
    }
}

/// True if going from `old` to `new` should be published quickly.
fn is_big_change(old: &WorkerRecord, new: &WorkerRecord, fraction: f64) -> bool {
    if old.draining != new.draining {
        return true;
    }
    let delta = old
        .capacity
        .kv_blocks_free
        .abs_diff(new.capacity.kv_blocks_free);
    if delta > 0 && delta as f64 >= fraction * new.capacity.kv_blocks_total as f64 {
        return true;
    }
    // Anything besides capacity and the timestamp (addresses, endpoints, model) is rare and
    // matters for routing correctness.
    let mut a = old.clone();
    a.capacity = new.capacity.clone();
    a.updated_at_ms = new.updated_at_ms;
    a != *new
}

enum Wake {
    Cancelled,
    Renew,
    Publish,
    Changed,
}

struct Task {
    registry: Arc<dyn Registry>,
    shared: Arc<Shared>,
    opts: RegistrationOptions,
    key: String,
    cancel: CancellationToken,
    lease: Option<Lease>,
    published_seq: u64,
    published: Option<WorkerRecord>,
    last_publish: Instant,
    publish_blocked_until: Option<Instant>,
}

impl Task {
    fn note_error(&self, e: &Error) {
        lock(&self.shared.status).last_error = Some(e.to_string());
    }

    fn lease_lost(&mut self) {
        let mut st = lock(&self.shared.status);
        st.registered = false;
    }

    fn current(&self) -> (WorkerRecord, u64) {
        let d = lock(&self.shared.desired);
        (d.record.clone(), d.seq)
    }

    /// Grants a new lease and puts the current record under it.
    async fn register_once(&mut self) -> Result<()> {
        let t = self.opts.call_timeout;
        let lease =
            with_timeout("grant_lease", t, self.registry.grant_lease(self.opts.ttl)).await?;
        // Known to the status (hence to deregister) before any key can be attached to it,
        // so a registration stopped mid-way never leaves an unknown lease holding the key.
        let previous = lock(&self.shared.status).lease.replace(lease.id);
        let (mut record, seq) = self.current();
        record.updated_at_ms = now_ms();
        let value = record.to_json()?;
        if let Err(e) = with_timeout(
            "put",
            t,
            self.registry.put(&self.key, value, Some(lease.id)),
        )
        .await
        {
            let _ = with_timeout("revoke_lease", t, self.registry.revoke_lease(lease.id)).await;
            lock(&self.shared.status).lease = previous;
            return Err(e);
        }
        let old = self.lease.replace(lease);
        self.published = Some(record);
        self.published_seq = seq;
        self.last_publish = Instant::now();
        self.publish_blocked_until = None;
        metrics::counter!(REGISTRATIONS_TOTAL).increment(1);
        {
            let mut st = lock(&self.shared.status);
            st.registered = true;
            st.lease = Some(lease.id);
            st.registrations += 1;
            st.last_error = None;
        }
        if let Some(old) = old.filter(|o| o.id != lease.id) {
            // The key now belongs to the new lease; the old one (if etcd kept it across a
            // restart) holds nothing of ours.
            if let Err(e) =
                with_timeout("revoke_lease", t, self.registry.revoke_lease(old.id)).await
            {
                debug!(key = %self.key, lease = %old.id, error = %e, "could not revoke old lease");
            }
        }
        Ok(())
    }

    /// Re-registers until it works or the task is cancelled (then returns false).
    async fn reregister(&mut self) -> bool {
        let mut backoff = Duration::from_millis(100).min(self.opts.max_backoff);
        loop {
            if self.cancel.is_cancelled() {
                return false;
            }
            let cancel = self.cancel.clone();
            let attempt = tokio::select! {
                biased;
                _ = cancel.cancelled() => return false,
                r = self.register_once() => r,
            };
            match attempt {
                Ok(()) => {
                    info!(key = %self.key, "worker re-registered");
                    return true;
                }
                Err(e) => {
                    warn!(key = %self.key, error = %e, retry_in = ?backoff, "re-registration failed");
                    self.note_error(&e);
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return false,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(self.opts.max_backoff);
        }
    }

    /// When the pending change (if any) may be published.
    fn next_publish_at(&self) -> Option<Instant> {
        let record = {
            let d = lock(&self.shared.desired);
            if d.seq == self.published_seq {
                return None;
            }
            d.record.clone()
        };
        let urgent = match &self.published {
            Some(p) => is_big_change(p, &record, self.opts.big_change_fraction),
            None => true,
        };
        let interval = if urgent {
            self.opts.min_publish_interval
        } else {
            self.opts.publish_interval
        };
        let at = self.last_publish + interval;
        Some(match self.publish_blocked_until {
            Some(b) => at.max(b),
            None => at,
        })
    }

    async fn publish(&mut self, lease: Lease) {
        let (mut record, seq) = self.current();
        if seq == self.published_seq {
            return;
        }
        record.updated_at_ms = now_ms();
        let now = Instant::now();
        self.last_publish = now;
        let value = match record.to_json() {
            Ok(v) => v,
            Err(e) => {
                // Cannot happen for sanitized records; do not spin on it.
                warn!(key = %self.key, error = %e, "cannot encode worker record");
                self.published_seq = seq;
                return;
            }
        };
        let put = self.registry.put(&self.key, value, Some(lease.id));
        match with_timeout("put", self.opts.call_timeout, put).await {
            Ok(_) => {
                self.published = Some(record);
                self.published_seq = seq;
                self.publish_blocked_until = None;
                let mut st = lock(&self.shared.status);
                st.publishes += 1;
                st.last_error = None;
            }
            Err(Error::LeaseNotFound { .. }) => {
                warn!(key = %self.key, lease = %lease.id, "lease lost while publishing; re-registering");
                self.lease = None;
                self.lease_lost();
            }
            Err(e) => {
                debug!(key = %self.key, error = %e, "publish failed; will retry");
                self.note_error(&e);
                self.publish_blocked_until = Some(now + self.opts.publish_interval);
            }
        }
    }

    async fn run(mut self) {
        let renew_every = (self.opts.ttl / 3).max(Duration::from_millis(10));
        let renew_timeout = self.opts.call_timeout.min(renew_every);
        let retry_renew = (renew_every / 2).max(Duration::from_millis(10));
        let mut last_renew_ok = Instant::now();
        let mut next_renew = last_renew_ok + renew_every;
        loop {
            let lease = match self.lease {
                Some(l) => l,
                None => {
                    if !self.reregister().await {
                        break;
                    }
                    last_renew_ok = Instant::now();
                    next_renew = last_renew_ok + renew_every;
                    match self.lease {
                        Some(l) => l,
                        None => continue,
                    }
                }
            };
            let publish_at = self.next_publish_at();
            let cancel = self.cancel.clone();
            let shared = self.shared.clone();
            let wake = tokio::select! {
                biased;
                _ = cancel.cancelled() => Wake::Cancelled,
                _ = sleep_until(next_renew) => Wake::Renew,
                _ = async {
                    match publish_at {
                        Some(at) => sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => Wake::Publish,
                _ = shared.changed.notified() => Wake::Changed,
            };
            // Calls below are raced against the token, so stopping never waits for a registry
            // call in flight (deregister revokes whatever lease the status names).
            match wake {
                Wake::Cancelled => break,
                Wake::Changed => {}
                Wake::Publish => {
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => break,
                        _ = self.publish(lease) => {}
                    }
                }
                Wake::Renew => {
                    let ka = with_timeout(
                        "keep_alive",
                        renew_timeout,
                        self.registry.keep_alive(lease.id),
                    );
                    let renewed = tokio::select! {
                        biased;
                        _ = cancel.cancelled() => break,
                        r = ka => r,
                    };
                    match renewed {
                        Ok(()) => {
                            metrics::counter!(LEASE_RENEWALS_TOTAL).increment(1);
                            last_renew_ok = Instant::now();
                            next_renew = last_renew_ok + renew_every;
                        }
                        Err(Error::LeaseNotFound { .. }) => {
                            metrics::counter!(LEASE_FAILURES_TOTAL).increment(1);
                            warn!(key = %self.key, lease = %lease.id, "lease lost; re-registering");
                            self.lease = None;
                            self.lease_lost();
                        }
                        Err(e) => {
                            metrics::counter!(LEASE_FAILURES_TOTAL).increment(1);
                            self.note_error(&e);
                            let now = Instant::now();
                            if now.duration_since(last_renew_ok) >= lease.ttl.max(self.opts.ttl) {
                                warn!(key = %self.key, lease = %lease.id, error = %e,
                                    "no renewal for a whole TTL; lease presumed expired, re-registering");
                                self.lease = None;
                                self.lease_lost();
                            } else {
                                debug!(key = %self.key, error = %e, "lease renewal failed; retrying");
                                next_renew = now + retry_renew;
                            }
                        }
                    }
                }
            }
        }
        debug!(key = %self.key, "registration task stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Role;

    fn rec() -> WorkerRecord {
        let mut r = WorkerRecord::new("c", Role::Decode, "d0", "http://x:1");
        r.capacity.kv_blocks_total = 100;
        r.capacity.kv_blocks_free = 100;
        r
    }

    #[test]
    fn big_change_rules() {
        let a = rec();
        let mut b = a.clone();
        b.capacity.kv_blocks_free = 80;
        b.capacity.running = 3;
        b.updated_at_ms += 5;
        assert!(!is_big_change(&a, &b, 0.25));
        b.capacity.kv_blocks_free = 75;
        assert!(is_big_change(&a, &b, 0.25));
        let mut c = a.clone();
        c.draining = true;
        assert!(is_big_change(&a, &c, 0.25));
        let mut d = a.clone();
        d.grpc_addr = "http://y:2".into();
        assert!(is_big_change(&a, &d, 0.25));
    }
}
