//! The prefill worker's queue of prompts not yet started: model-free state (no model, no
//! channels, no clock), driven by the engine loop and unit-tested here.
//!
//! Invariants: the queue never holds more than its bound (a push past it is refused and
//! hands the entry back); interactive prompts stand before batch ones, first come first
//! served within each class ([`policy::queue_position`]); an entry holds no KV (blocks are
//! taken only when the engine starts it).

use std::collections::VecDeque;
use std::time::Instant;

use crate::policy;

/// A queued prompt and what the engine keeps with it.
#[derive(Debug)]
pub(crate) struct Waiting<T> {
    pub id: u64,
    /// Batch prompts queue behind interactive ones.
    pub batch: bool,
    /// Prompt tokens (what the worker's published load counts).
    pub tokens: usize,
    pub enqueued: Instant,
    pub item: T,
}

/// Prompts waiting for room in the scratch pool, in the order they start.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    items: VecDeque<Waiting<T>>,
    max: usize,
}

impl<T> Queue<T> {
    /// An empty queue of at most `max` prompts.
    pub(crate) fn new(max: usize) -> Self {
        Queue {
            items: VecDeque::new(),
            max,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Queues `w` at its class's place; a full queue hands it back with its length.
    pub(crate) fn push(&mut self, w: Waiting<T>) -> Result<(), (Waiting<T>, usize)> {
        if self.items.len() >= self.max {
            let n = self.items.len();
            return Err((w, n));
        }
        let at = policy::queue_position(self.items.iter().map(|q| q.batch), w.batch);
        self.items.insert(at, w);
        Ok(())
    }

    /// Takes prompt `id` out of the queue.
    pub(crate) fn remove(&mut self, id: u64) -> Option<Waiting<T>> {
        let i = self.items.iter().position(|q| q.id == id)?;
        self.items.remove(i)
    }

    /// Keeps only the entries whose item `keep` accepts (callers that went away leave).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.items.retain(|q| keep(&q.item));
    }

    /// The prompt that starts next.
    pub(crate) fn front(&self) -> Option<&Waiting<T>> {
        self.items.front()
    }

    pub(crate) fn pop_front(&mut self) -> Option<Waiting<T>> {
        self.items.pop_front()
    }

    /// Empties the queue (shutdown).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Waiting<T>> + '_ {
        self.items.drain(..)
    }

    /// Prompt tokens queued.
    pub(crate) fn tokens(&self) -> u64 {
        self.items.iter().map(|q| q.tokens as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64, batch: bool, tokens: usize) -> Waiting<&'static str> {
        Waiting {
            id,
            batch,
            tokens,
            enqueued: Instant::now(),
            item: "job",
        }
    }

    fn order(q: &Queue<&str>) -> Vec<u64> {
        q.items.iter().map(|x| x.id).collect()
    }

    #[test]
    fn interactive_prompts_start_before_batch_ones_first_come_first_served() {
        let mut q = Queue::new(8);
        for (id, batch) in [(1, true), (2, false), (3, true), (4, false)] {
            q.push(w(id, batch, 10)).unwrap();
        }
        assert_eq!(order(&q), [2, 4, 1, 3]);
        assert_eq!(q.pop_front().map(|x| x.id), Some(2));
        assert_eq!(q.front().map(|x| x.id), Some(4));
    }

    #[test]
    fn a_full_queue_refuses_and_hands_the_prompt_back() {
        let mut q = Queue::new(2);
        q.push(w(1, false, 5)).unwrap();
        q.push(w(2, true, 5)).unwrap();
        let (back, len) = q.push(w(3, false, 5)).unwrap_err();
        assert_eq!((back.id, len), (3, 2));
        assert_eq!(
            order(&q),
            [1, 2],
            "an interactive prompt does not push a batch one out"
        );
    }

    #[test]
    fn cancelled_and_abandoned_prompts_leave_and_their_tokens_with_them() {
        let mut q = Queue::new(8);
        q.push(w(1, false, 100)).unwrap();
        q.push(w(2, false, 20)).unwrap();
        q.push(Waiting {
            item: "gone",
            ..w(3, true, 7)
        })
        .unwrap();
        assert_eq!(q.tokens(), 127);
        assert_eq!(q.remove(1).map(|x| x.tokens), Some(100));
        assert!(q.remove(1).is_none());
        q.retain(|item| *item != "gone");
        assert_eq!((order(&q), q.tokens()), (vec![2], 20));
        assert_eq!(q.drain().count(), 1);
        assert!(q.is_empty());
    }
}
