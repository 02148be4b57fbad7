//! A sequence of the decode batch: what it has computed (its phase), where its output
//! goes, and the figures its final message reports.

use std::time::Instant;

use duet_engine::{AttentionPolicy, Generation, Observation};
use tokio::sync::mpsc;

use super::Scheduler;
use crate::error::DecodeError;
use crate::handle::{Event, GenerateJob, PrefillSource, Priority};

pub(super) enum Phase {
    /// Prompt (or, after preemption, prompt + generated) tokens being computed here.
    Prefill {
        tokens: Vec<u32>,
        done: usize,
        /// Token to feed once the prefill is complete (resuming a preempted sequence);
        /// `None`: sample the first token from the prefill's logits.
        resume: Option<u32>,
        /// Tokens from this index on were generated before (preemption, migration): they
        /// are fed one per step, as decoding fed them, so their KV, and the greedy tokens
        /// that follow, are bit-identical to an undisturbed run. A multi-row chunk would
        /// take another attention kernel whose sums round differently.
        exact_from: usize,
    },
    /// KV holds everything but `next`, which is fed at the next step.
    Decode { next: u32 },
}

impl Phase {
    /// Whether `n` more rows complete the prompt proper (reach `exact_from`): where SnapKV
    /// compresses it.
    pub(super) fn completes_prompt(&self, n: usize) -> bool {
        matches!(self, Phase::Prefill { done, exact_from, .. }
            if *done < *exact_from && done + n >= *exact_from)
    }
}

pub(super) struct Seq {
    pub(super) id: u64,
    pub(super) prompt: Vec<u32>,
    pub(super) priority: Priority,
    pub(super) arrival: Instant,
    pub(super) gen: Generation,
    pub(super) events: mpsc::UnboundedSender<Event>,
    pub(super) phase: Phase,
    pub(super) prefill_started: Option<Instant>,
    pub(super) prefill_seconds: f64,
    pub(super) kv_wait_seconds: f64,
    pub(super) preemptions: u32,
    pub(super) first_preempted_at: Option<u32>,
    /// Prompt tokens whose KV came from the prefix cache at the first prefill.
    pub(super) cached_tokens: usize,
    /// Leading prompt tokens whose KV is computed as a prompt (by a prefill worker, or by a
    /// local prefill here); only those are registered in the prefix cache. Tokens computed
    /// one per step (a replay after migration) are not, nor are generated ones: a later
    /// prompt recomputes them as a prompt, so its KV, and its output, never depend on
    /// whether the cache served it.
    pub(super) cacheable: usize,
    /// Under a local window the sequence holds at most its window's blocks and may run past
    /// the model's context; under SnapKV its prompt's KV is compressed once computed;
    /// neither reads or feeds the prefix cache.
    pub(super) attention: AttentionPolicy,
    /// Under SnapKV, while its prompt is computed here: the queries of the prompt's last
    /// positions, gathered over the forwards (the KV is compressed once the prompt is).
    pub(super) observation: Option<Observation>,
    pub(super) span: tracing::Span,
}

impl Seq {
    /// The most tokens this sequence may hold in a model of `context_length`.
    pub(super) fn max_tokens(&self, context_length: usize) -> usize {
        self.attention.max_sequence_tokens(context_length)
    }
}

impl Scheduler {
    pub(super) fn new_seq(
        &self,
        job: GenerateJob,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<Seq, (DecodeError, mpsc::UnboundedSender<Event>)> {
        let limit = job
            .attention
            .max_sequence_tokens(self.model.config().context_length);
        let mut gen = match job
            .params
            .validate(limit)
            .and_then(|_| Generation::new(self.model.tokenizer(), &job.prompt, job.params))
        {
            Ok(g) => g,
            Err(e) => return Err((e.into(), events)),
        };
        // A migrated stream: the replayed tokens were generated (and their text sent) by
        // another worker; the text state continues from them, so nothing is sent twice and
        // nothing held back there is lost.
        if let PrefillSource::Local { replay } = job.prefill {
            let replayed = &job.prompt[job.prompt.len().saturating_sub(replay)..];
            gen.resume(self.model.tokenizer(), replayed);
        }
        let cacheable = match job.prefill {
            PrefillSource::Local { replay } => job.prompt.len().saturating_sub(replay),
            PrefillSource::Remote { .. } => job.prompt.len(),
        };
        Ok(Seq {
            id: job.request_id,
            phase: Phase::Prefill {
                tokens: job.prompt.clone(),
                done: 0,
                resume: None,
                exact_from: match job.prefill {
                    PrefillSource::Local { replay } => job.prompt.len().saturating_sub(replay),
                    PrefillSource::Remote { .. } => job.prompt.len(),
                },
            },
            prompt: job.prompt,
            priority: job.priority,
            arrival: Instant::now(),
            gen,
            events,
            prefill_started: None,
            prefill_seconds: 0.0,
            kv_wait_seconds: 0.0,
            preemptions: 0,
            first_preempted_at: None,
            cached_tokens: 0,
            cacheable,
            attention: job.attention,
            observation: None,
            span: job.span,
        })
    }
}

impl crate::waiting::Queued for Seq {
    fn id(&self) -> u64 {
        self.id
    }

    fn priority(&self) -> Priority {
        self.priority
    }
}
