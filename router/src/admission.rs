//! Admission: a bounded number of requests may wait for placement per priority class.
//! A request holds a [`QueueSlot`] from arrival until a decode worker accepted it; past
//! the bound, new requests get RESOURCE_EXHAUSTED with a retry hint.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use duet_proto::v1::Priority;

use crate::error::RouterError;
use duet_telemetry::names::ROUTER_QUEUED;

/// Waiting counts per class.
#[derive(Debug)]
pub struct Admission {
    bound: usize,
    waiting: [AtomicUsize; 2],
}

/// A place in the waiting queue; released on drop.
#[derive(Debug)]
pub struct QueueSlot {
    adm: Arc<Admission>,
    class: usize,
    held: bool,
}

impl QueueSlot {
    /// Leave the queue (the request was placed).
    pub fn release(&mut self) {
        if std::mem::take(&mut self.held) {
            self.adm.waiting[self.class].fetch_sub(1, Ordering::SeqCst);
            metrics::gauge!(ROUTER_QUEUED, "priority" => CLASS_NAMES[self.class]).decrement(1.0);
        }
    }
}

impl QueueSlot {
    /// Back into the queue after a placement fell through (the worker had no room after
    /// all). An admitted request keeps its place: the bound applies only on arrival.
    pub fn requeue(&mut self) {
        if !std::mem::replace(&mut self.held, true) {
            self.adm.waiting[self.class].fetch_add(1, Ordering::SeqCst);
            metrics::gauge!(ROUTER_QUEUED, "priority" => CLASS_NAMES[self.class]).increment(1.0);
        }
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.release();
    }
}

const CLASS_NAMES: [&str; 2] = ["interactive", "batch"];

/// The class index and bounded label of a priority.
pub fn class(p: Priority) -> (usize, &'static str) {
    let c = usize::from(p == Priority::Batch);
    (c, CLASS_NAMES[c])
}

impl Admission {
    pub fn new(bound: usize) -> Arc<Admission> {
        Arc::new(Admission {
            bound,
            waiting: [AtomicUsize::new(0), AtomicUsize::new(0)],
        })
    }

    /// Enters the queue of `p`'s class, or refuses when it is full.
    pub fn enter(self: &Arc<Self>, p: Priority) -> Result<QueueSlot, RouterError> {
        let (c, name) = class(p);
        let prev = self.waiting[c].fetch_add(1, Ordering::SeqCst);
        if prev >= self.bound {
            self.waiting[c].fetch_sub(1, Ordering::SeqCst);
            return Err(RouterError::QueueFull {
                priority: name,
                queued: prev,
                retry_after_ms: 500,
            });
        }
        metrics::gauge!(ROUTER_QUEUED, "priority" => name).increment(1.0);
        Ok(QueueSlot {
            adm: self.clone(),
            class: c,
            held: true,
        })
    }

    /// Requests waiting in `p`'s class.
    pub fn waiting(&self, p: Priority) -> usize {
        self.waiting[class(p).0].load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_is_per_class_and_slots_free_on_drop() {
        let a = Admission::new(2);
        let s1 = a.enter(Priority::Interactive).unwrap();
        let _s2 = a.enter(Priority::Interactive).unwrap();
        let e = a.enter(Priority::Interactive).unwrap_err();
        assert_eq!(e.class(), duet_engine::ErrorClass::ResourceExhausted);
        assert!(e.status().metadata().get("retry-after-ms").is_some());
        // The other class has its own bound.
        let _b = a.enter(Priority::Batch).unwrap();
        drop(s1);
        assert_eq!(a.waiting(Priority::Interactive), 1);
        assert!(a.enter(Priority::Interactive).is_ok());
    }

    #[test]
    fn a_requeued_request_is_counted_again_but_never_refused() {
        let a = Admission::new(1);
        let mut s = a.enter(Priority::Interactive).unwrap();
        s.release();
        let _other = a.enter(Priority::Interactive).unwrap();
        // The bound is reached, yet the placed request may come back.
        s.requeue();
        s.requeue();
        assert_eq!(a.waiting(Priority::Interactive), 2);
        drop(s);
        assert_eq!(a.waiting(Priority::Interactive), 1);
    }
}
