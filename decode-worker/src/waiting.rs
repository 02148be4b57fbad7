//! The decode worker's queue of sequences waiting to be admitted (local prefills, and
//! preempted sequences waiting to be recomputed): model-free state, driven by the scheduler
//! and unit-tested here; the planner's simulator (`duet-plan`) queues its simulated
//! sequences in the same type.
//!
//! Invariants: a waiting sequence holds no KV; higher priority stands first, first come first
//! served within a priority, except that a preempted sequence goes back to the front of its
//! priority ([`policy::waiting_position`]); new sequences are refused past the bound
//! ([`WaitingQueue::is_full`]), preempted ones never are (they were admitted once).

use std::collections::VecDeque;

use crate::handle::Priority;
use crate::policy;

/// What the queue needs to know of a waiting entry.
pub trait Queued {
    fn id(&self) -> u64;
    fn priority(&self) -> Priority;
}

/// Sequences in the order admission takes them.
#[derive(Debug)]
pub struct WaitingQueue<T> {
    items: VecDeque<T>,
    max: usize,
}

impl<T: Queued> WaitingQueue<T> {
    /// An empty queue that takes at most `max` new sequences.
    pub fn new(max: usize) -> Self {
        WaitingQueue {
            items: VecDeque::new(),
            max,
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Whether a new sequence must be refused.
    pub fn is_full(&self) -> bool {
        self.items.len() >= self.max
    }

    pub fn contains(&self, id: u64) -> bool {
        self.items.iter().any(|s| s.id() == id)
    }

    /// Queues `s` at its place: behind its priority's sequences, or in front of them when
    /// it was preempted (`front`).
    pub fn push(&mut self, s: T, front: bool) {
        let at =
            policy::waiting_position(self.items.iter().map(Queued::priority), s.priority(), front);
        self.items.insert(at, s);
    }

    /// Takes sequence `id` out of the queue.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.items.iter().position(|s| s.id() == id)?;
        self.items.remove(i)
    }

    /// Keeps only the sequences `keep` accepts (clients that went away leave).
    pub fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        self.items.retain(keep);
    }

    /// The sequence admission considers next.
    pub fn front(&self) -> Option<&T> {
        self.items.front()
    }

    pub fn pop_front(&mut self) -> Option<T> {
        self.items.pop_front()
    }

    /// Empties the queue (shutdown).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.items.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct S(u64, Priority, bool);

    impl Queued for S {
        fn id(&self) -> u64 {
            self.0
        }
        fn priority(&self) -> Priority {
            self.1
        }
    }

    fn ids(q: &WaitingQueue<S>) -> Vec<u64> {
        q.items.iter().map(|s| s.0).collect()
    }

    #[test]
    fn higher_priority_first_then_arrival_and_preempted_back_to_the_front_of_their_class() {
        let mut q = WaitingQueue::new(8);
        q.push(S(1, Priority::Batch, false), false);
        q.push(S(2, Priority::Interactive, false), false);
        q.push(S(3, Priority::Interactive, false), false);
        q.push(S(4, Priority::Batch, false), false);
        assert_eq!(ids(&q), [2, 3, 1, 4]);
        // A preempted batch sequence goes before the other batch ones, after interactive.
        q.push(S(5, Priority::Batch, false), true);
        assert_eq!(ids(&q), [2, 3, 5, 1, 4]);
        q.push(S(6, Priority::Interactive, false), true);
        assert_eq!(ids(&q), [6, 2, 3, 5, 1, 4]);
        assert_eq!(q.pop_front().map(|s| s.0), Some(6));
    }

    #[test]
    fn the_bound_refuses_new_sequences_only() {
        let mut q = WaitingQueue::new(2);
        q.push(S(1, Priority::Interactive, false), false);
        assert!(!q.is_full());
        q.push(S(2, Priority::Interactive, false), false);
        assert!(q.is_full());
        // The scheduler re-queues a preempted sequence whatever the bound.
        q.push(S(3, Priority::Interactive, false), true);
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn released_and_abandoned_sequences_leave() {
        let mut q = WaitingQueue::new(8);
        for (id, gone) in [(1, false), (2, true), (3, false)] {
            q.push(S(id, Priority::Interactive, gone), false);
        }
        assert!(q.contains(3));
        assert_eq!(q.remove(3).map(|s| s.0), Some(3));
        assert!(!q.contains(3) && q.remove(3).is_none());
        q.retain(|s| !s.2);
        assert_eq!(ids(&q), [1]);
        assert_eq!(q.drain().count(), 1);
        assert!(q.is_empty());
    }
}
