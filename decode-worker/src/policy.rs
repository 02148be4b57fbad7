//! The decode scheduler's decisions, model-free: the waiting order, admission, what the
//! next forward computes, and which sequence a full pool preempts. Pure functions over
//! plain numbers (no KV cache, no model, no clock, no channels), so they are unit-tested
//! here and the planner's simulator can run the same rules; `scheduler.rs` applies them to
//! its engine.
//!
//! The rules:
//! - **Waiting order**: interactive before batch; within a class in arrival order, except
//!   that a preempted sequence goes back to the front of its class.
//! - **Admission**: the first waiting sequence starts when the batch has room and the pool
//!   has the blocks it needs to start plus a watermark (never more than the pool minus what
//!   it needs), so a new sequence does not take the blocks running ones are about to grow
//!   into.
//! - **The next forward**: one row per decoding sequence (inter-token latency is made of
//!   them), then prompt chunks by priority and arrival within `chunk_tokens`. Tokens to be
//!   replayed one per step (after a preemption or a migration) go one per forward.
//! - **Preemption**: the lowest-priority, newest running sequence, never the last one.

use std::time::Instant;

use crate::handle::Priority;

/// Where a new waiting sequence goes among `waiting` (their priorities, front first);
/// `front`: a preempted sequence, first within its class.
pub fn waiting_position(
    waiting: impl IntoIterator<Item = Priority>,
    p: Priority,
    front: bool,
) -> usize {
    let mut n = 0;
    for w in waiting {
        if (front && w >= p) || (!front && w > p) {
            return n;
        }
        n += 1;
    }
    n
}

/// The pool as admission sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    pub free_blocks: usize,
    pub total_blocks: usize,
    /// Blocks kept free for running sequences to grow into.
    pub watermark_blocks: usize,
}

/// Whether a sequence needing `need` blocks to start may join a batch of `running`
/// sequences (at most `max_batch`).
pub fn admits(running: usize, max_batch: usize, need: usize, pool: Pool) -> bool {
    running < max_batch
        && pool.free_blocks
            >= need
                + pool
                    .watermark_blocks
                    .min(pool.total_blocks.saturating_sub(need))
}

/// A running sequence as the forward planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub priority: Priority,
    pub arrival: Instant,
    /// `None`: decoding (one token a step).
    pub prefill: Option<PrefillLeft>,
}

/// What a sequence being prefilled here has left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillLeft {
    /// Prompt tokens not computed yet.
    pub tokens: usize,
    /// Of those, the ones before the first token that must be fed alone (a replay); 0:
    /// every token left is fed one per step.
    pub before_exact: usize,
}

/// The next forward: `(row index, tokens it computes)`, decode rows first, then prompt
/// chunks by (priority, arrival) within `chunk_tokens` (at least 1).
pub fn plan_forward(rows: &[Row], chunk_tokens: usize) -> Vec<(usize, usize)> {
    let mut budget = chunk_tokens.max(1);
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| (rows[i].prefill.is_some(), rows[i].priority, rows[i].arrival));
    let mut plan = Vec::with_capacity(rows.len());
    for i in order {
        let n = match rows[i].prefill {
            None => 1,
            Some(_) if budget == 0 => continue,
            Some(p) if p.before_exact == 0 => 1,
            Some(p) => p.tokens.min(budget).min(p.before_exact),
        };
        if rows[i].prefill.is_some() {
            budget -= n;
        }
        plan.push((i, n));
    }
    plan
}

/// The running sequence a full pool preempts: the lowest-priority, newest one; `None`
/// when fewer than two run (the last one is never preempted; it fails if it cannot fit).
pub fn preemption_victim(running: &[(Priority, Instant)]) -> Option<usize> {
    if running.len() <= 1 {
        return None;
    }
    (0..running.len()).max_by_key(|&i| running[i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use Priority::{Batch, Interactive};

    #[test]
    fn interactive_waits_before_batch_and_a_preempted_sequence_leads_its_class() {
        let q = [Interactive, Interactive, Batch, Batch];
        assert_eq!(waiting_position(q, Interactive, false), 2);
        assert_eq!(waiting_position(q, Interactive, true), 0);
        assert_eq!(waiting_position(q, Batch, false), 4);
        assert_eq!(waiting_position(q, Batch, true), 2);
        assert_eq!(waiting_position([], Batch, true), 0);
    }

    #[test]
    fn admission_keeps_the_watermark_but_never_more_than_the_pool_allows() {
        let pool = |free| Pool {
            free_blocks: free,
            total_blocks: 100,
            watermark_blocks: 10,
        };
        assert!(admits(0, 8, 5, pool(15)));
        assert!(!admits(0, 8, 5, pool(14)), "the watermark is kept");
        assert!(!admits(8, 8, 1, pool(100)), "the batch is full");
        // A sequence needing 95 of 100 blocks keeps only the 5 others free.
        assert!(admits(0, 8, 95, pool(100)));
        assert!(!admits(0, 8, 101, pool(100)));
    }

    #[test]
    fn decode_rows_come_first_and_prompt_chunks_share_the_budget() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let prefill = |p, ms, tokens, before_exact| Row {
            priority: p,
            arrival: at(ms),
            prefill: Some(PrefillLeft {
                tokens,
                before_exact,
            }),
        };
        let decode = |p, ms| Row {
            priority: p,
            arrival: at(ms),
            prefill: None,
        };
        let rows = [
            prefill(Batch, 0, 100, 100),
            decode(Batch, 5),
            prefill(Interactive, 9, 30, 30),
            decode(Interactive, 1),
            prefill(Interactive, 3, 10, 0),
        ];
        // Decode rows by priority, then prompts: the replaying one (1 token), the
        // interactive one (30), the batch one with what is left of 48 (17).
        assert_eq!(
            plan_forward(&rows, 48),
            [(3, 1), (1, 1), (4, 1), (2, 30), (0, 17)]
        );
        // A spent budget leaves prompts for the next forward, never decode rows.
        assert_eq!(plan_forward(&rows, 1), [(3, 1), (1, 1), (4, 1)]);
        // A chunk stops at the first token to replay alone.
        assert_eq!(plan_forward(&[prefill(Batch, 0, 100, 7)], 64), [(0, 7)]);
    }

    #[test]
    fn the_lowest_priority_newest_sequence_is_preempted_never_the_last() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(preemption_victim(&[(Interactive, at(0))]), None);
        let running = [
            (Interactive, at(9)),
            (Batch, at(1)),
            (Batch, at(5)),
            (Interactive, at(0)),
        ];
        assert_eq!(preemption_victim(&running), Some(2));
        assert_eq!(
            preemption_victim(&[(Interactive, at(0)), (Interactive, at(3))]),
            Some(1)
        );
    }
}
