//! The prefill engine's decisions, model-free: the queue's order and how one forward is cut
//! into chunks. Pure functions over plain numbers, unit-tested here; `engine_loop.rs`
//! applies them to its engine.
//!
//! The rules:
//! - **Queue order**: interactive before batch, first come first served within a class.
//! - **Chunks**: running prompts in start order share `max_batch_tokens` (at least one
//!   block) per forward; a prompt that fits what is left is computed whole, a longer one
//!   in whole blocks (its chunk's KV leaves as whole destination blocks), and the forward
//!   stops at the first prompt that gets nothing.

/// Where a new job goes in a queue whose jobs are `batch` or not (front first).
pub fn queue_position(queued_batch: impl IntoIterator<Item = bool>, batch: bool) -> usize {
    let mut n = 0;
    for b in queued_batch {
        if !batch && b {
            return n;
        }
        n += 1;
    }
    n
}

/// One forward's chunks: `(running index, tokens)` for running prompts with `left` tokens
/// each still to compute, in order.
pub fn plan_chunks(
    left: &[usize],
    max_batch_tokens: usize,
    block_size: usize,
) -> Vec<(usize, usize)> {
    let bs = block_size.max(1);
    let mut budget = max_batch_tokens.max(bs);
    let mut plan = Vec::new();
    for (i, &l) in left.iter().enumerate() {
        if budget == 0 {
            break;
        }
        let n = if l <= budget { l } else { budget / bs * bs };
        if n == 0 {
            break;
        }
        budget -= n;
        plan.push((i, n));
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interactive_jobs_queue_before_batch_jobs_in_arrival_order() {
        let q = [false, false, true, true];
        assert_eq!(queue_position(q, false), 2);
        assert_eq!(queue_position(q, true), 4);
        assert_eq!(queue_position([], false), 0);
        assert_eq!(queue_position([true], false), 0);
    }

    #[test]
    fn prompts_share_the_token_budget_in_whole_blocks() {
        // 100 fits; 300 gets what is left of 256 in whole blocks (144); nothing for the third.
        assert_eq!(plan_chunks(&[100, 300, 50], 256, 16), [(0, 100), (1, 144)]);
        // A budget below a block is raised to one block.
        assert_eq!(plan_chunks(&[40], 1, 16), [(0, 16)]);
        // What is left after a whole prompt may be less than a block: the forward stops.
        assert_eq!(plan_chunks(&[250, 100, 10], 256, 16), [(0, 250)]);
        assert!(plan_chunks(&[], 256, 16).is_empty());
    }
}
