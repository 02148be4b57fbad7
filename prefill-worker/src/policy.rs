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
//! - **Jobs the pool can take**: a prompt needing more blocks than the whole scratch pool
//!   is refused (it could never run); its destination must start at a block boundary below
//!   its end and list exactly one block per block it sends: every remaining block of the
//!   prompt, or under a local window the blocks the prompt keeps (sinks, then the window).
//! - **Stopping**: a forward stops between layers only when nobody waits for any of its
//!   chunks (every caller gone or transfer failed): its work would be thrown away.
//! - **Room**: a queued prompt starts only if its blocks fit next to the blocks the running
//!   prompts will still allocate (a started prompt never waits for memory mid-way).

use crate::error::PrefillError;
use duet_engine::EngineError;

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

/// The blocks a job takes: at most `peak` of this worker's pool at once, and `sent`
/// blocks of the prompt on the decode worker (from its first token on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobBlocks {
    pub peak: usize,
    pub sent: usize,
}

impl JobBlocks {
    /// Under full attention: every block of the prompt, held and sent.
    pub fn full(tokens: usize, block_size: usize) -> Self {
        let n = tokens.div_ceil(block_size.max(1));
        JobBlocks { peak: n, sent: n }
    }
}

/// Whether a job of `tokens` prompt tokens whose decode worker holds the first `dst_start`
/// and lists `dst_blocks` blocks for the rest can run on a pool of `total_blocks` blocks.
pub fn check_job(
    tokens: usize,
    dst_start: usize,
    dst_blocks: usize,
    block_size: usize,
    total_blocks: usize,
    need: JobBlocks,
) -> Result<(), PrefillError> {
    let bs = block_size.max(1);
    if need.peak > total_blocks {
        return Err(PrefillError::TooLong {
            tokens,
            blocks: need.peak,
            total: total_blocks,
        });
    }
    if dst_start % bs != 0 || dst_start >= tokens {
        return Err(EngineError::invalid(
            "dst_start_tokens",
            format!("{dst_start} (must be a multiple of {bs} below the prompt's {tokens} tokens)"),
        )
        .into());
    }
    let need = need.sent.saturating_sub(dst_start / bs);
    if dst_blocks != need {
        return Err(EngineError::invalid(
            "dst_blocks",
            format!(
                "{dst_blocks} destination blocks for {tokens} tokens after {dst_start} held (need {need})"
            ),
        )
        .into());
    }
    Ok(())
}

/// Whether a prompt needing `need` more blocks starts now, with `free` blocks free and the
/// running prompts still to allocate `pending`.
pub fn has_room(need: usize, pending: usize, free: usize) -> bool {
    need + pending <= free
}

/// Whether a forward whose chunks are each `abandoned` or not (caller gone, transfer failed)
/// computes for nobody: then it stops after the layer it is in. A forward with any chunk
/// still awaited runs to the end (its layers already streamed cannot be taken back), and an
/// empty one is never stopped.
pub fn nobody_waits(abandoned: impl IntoIterator<Item = bool>) -> bool {
    let mut any = false;
    for a in abandoned {
        if !a {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_must_fit_the_pool_and_name_one_destination_block_per_block_it_sends() {
        let full = |t| JobBlocks::full(t, 16);
        assert!(check_job(40, 0, 3, 16, 8, full(40)).is_ok());
        assert!(check_job(40, 16, 2, 16, 8, full(40)).is_ok());
        assert!(matches!(
            check_job(200, 0, 13, 16, 8, full(200)),
            Err(PrefillError::TooLong {
                tokens: 200,
                blocks: 13,
                total: 8
            })
        ));
        for (start, blocks) in [(8, 3), (48, 0), (0, 2), (16, 3)] {
            let e = check_job(40, start, blocks, 16, 8, full(40)).unwrap_err();
            assert_eq!(
                e.class(),
                duet_engine::ErrorClass::InvalidArgument,
                "{start} {blocks}"
            );
        }
        // Under a window: a long prompt fits a small pool, and names only its kept blocks.
        let windowed = JobBlocks { peak: 6, sent: 3 };
        assert!(check_job(2000, 0, 3, 16, 8, windowed).is_ok());
        assert!(check_job(2000, 0, 125, 16, 8, windowed).is_err());
    }

    #[test]
    fn a_prompt_starts_only_beside_what_running_prompts_will_still_take() {
        assert!(has_room(3, 2, 5));
        assert!(!has_room(3, 3, 5));
        assert!(has_room(0, 0, 0));
    }

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

    #[test]
    fn a_forward_stops_only_when_every_chunk_is_abandoned() {
        assert!(nobody_waits([true, true, true]));
        assert!(!nobody_waits([true, false, true]));
        assert!(!nobody_waits([false]));
        assert!(!nobody_waits(std::iter::empty()));
    }
}
