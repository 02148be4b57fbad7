//! Admission and the forward pass: which waiting sequences start, which rows the next
//! forward takes ([`policy::plan_forward`]), who is preempted when the pool runs out, and
//! what each row's logits become (tokens, a finished prefill, a finished sequence).

use std::time::Instant;

use duet_engine::{
    reusable_tokens, AttentionPolicy, EngineError, Observation, SeqChunk, TokenStep,
};

use super::seq::{Phase, Seq};
use super::Scheduler;
use crate::error::DecodeError;
use crate::handle::{secs, Event, Priority};
use crate::policy;

impl Scheduler {
    pub(super) fn can_admit(&self) -> bool {
        self.waiting.front().is_some_and(|s| {
            let pool = policy::Pool {
                free_blocks: self.cache.free_blocks(),
                total_blocks: self.cache.total_blocks(),
                watermark_blocks: self.cfg.admit_watermark_blocks,
            };
            policy::admits(
                self.active.len(),
                self.cfg.max_batch,
                self.blocks_to_start(s),
                pool,
            )
        })
    }

    pub(super) fn blocks_to_start(&self, s: &Seq) -> usize {
        let Phase::Prefill {
            tokens, exact_from, ..
        } = &s.phase
        else {
            return 1;
        };
        match s.attention {
            // Every layer group's (a local group's bounded by its window and a chunk).
            AttentionPolicy::Full => self
                .cache
                .peak_blocks(tokens.len() + 1, self.cfg.prefill_chunk_tokens),
            AttentionPolicy::Window(w) => w.peak_blocks(
                tokens.len() + 1,
                self.cfg.prefill_chunk_tokens,
                self.cache.block_size(),
            ),
            // SnapKV compacts the prompt proper into fresh blocks before it frees the
            // prompt's; the tokens replayed after it go on from the kept slots.
            AttentionPolicy::SnapKv(p) => {
                let kept = p.kept(*exact_from);
                let compacting = self.cache.blocks_for(*exact_from) + self.cache.blocks_for(kept);
                let after = self.cache.blocks_for(kept + tokens.len() - exact_from + 1);
                compacting.max(after)
            }
        }
    }

    pub(super) fn admit(&mut self) {
        while self.can_admit() {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if let Err(e) = self.cache.add_sequence(s.id) {
                let _ = s.events.send(Event::Error(e.into()));
                continue;
            }
            if let Err(e) = self.cache.set_attention(s.id, s.attention) {
                self.cache.free_sequence(s.id);
                let _ = s.events.send(Event::Error(e.into()));
                continue;
            }
            // SnapKV observes the last positions of the prompt proper (before any replay).
            s.observation = match (s.attention.snapkv(), &s.phase) {
                (Some(p), Phase::Prefill { exact_from, .. }) => Some(Observation::new(
                    s.id,
                    *exact_from,
                    p.observe,
                    self.model.config().n_layers,
                )),
                _ => None,
            };
            if let Err(e) = self.attach_cached_prefix(&mut s) {
                self.cache.free_sequence(s.id);
                let _ = s.events.send(Event::Error(e.into()));
                continue;
            }
            s.prefill_started.get_or_insert_with(Instant::now);
            self.active.push(s);
        }
        // A sequence that can never fit (more blocks than the pool) fails instead of waiting.
        if self.active.is_empty() {
            if let Some(s) = self.waiting.front() {
                let need = self.blocks_to_start(s);
                if need > self.cache.total_blocks() {
                    if let Some(s) = self.waiting.pop_front() {
                        let _ = s.events.send(Event::Error(
                            EngineError::KvExhausted {
                                needed: need,
                                free: self.cache.total_blocks(),
                            }
                            .into(),
                        ));
                    }
                }
            }
        }
    }

    /// Starts a local prefill after the longest prefix the cache holds. Tokens that must be
    /// fed one per step (a replay after preemption or migration) are never taken from the
    /// cache.
    pub(super) fn attach_cached_prefix(&mut self, s: &mut Seq) -> Result<(), EngineError> {
        let Some(book) = &self.book else {
            return Ok(());
        };
        if s.attention != AttentionPolicy::Full {
            return Ok(());
        }
        let Phase::Prefill {
            tokens,
            done,
            exact_from,
            ..
        } = &mut s.phase
        else {
            return Ok(());
        };
        let bs = self.cache.block_size();
        // Two rows at least before `exact_from` too: a one-row first chunk would take the
        // per-row kernels, unlike the same row in the prefill that cached the prefix.
        let limit = reusable_tokens(tokens.len(), bs).min(reusable_tokens(*exact_from, bs));
        let hashes = self.hasher.hashes(&tokens[..limit]);
        let hit = self.cache.attach_prefix(s.id, &hashes, limit)?;
        *done = hit.blocks() * bs;
        if s.preemptions == 0 {
            book.lookup(tokens.len(), hit, bs);
            s.cached_tokens = *done;
        }
        Ok(())
    }

    /// The next forward ([`policy::plan_forward`]) and the blocks it needs.
    pub(super) fn plan(&self) -> (Vec<(usize, usize)>, usize) {
        let rows: Vec<policy::Row> = self
            .active
            .iter()
            .map(|s| policy::Row {
                priority: s.priority,
                arrival: s.arrival,
                prefill: match &s.phase {
                    Phase::Decode { .. } => None,
                    Phase::Prefill {
                        tokens,
                        done,
                        exact_from,
                        ..
                    } => Some(policy::PrefillLeft {
                        tokens: tokens.len() - done,
                        before_exact: exact_from.saturating_sub(*done),
                    }),
                },
            })
            .collect();
        let plan = policy::plan_forward(&rows, self.cfg.prefill_chunk_tokens);
        let need = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.active[i];
                let grow = self
                    .cache
                    .blocks_to_append(s.id, n)
                    .unwrap_or_else(|_| self.cache.blocks_for(n));
                grow + self.compaction_blocks(s, n)
            })
            .sum();
        (plan, need)
    }

    /// The fresh blocks SnapKV compacts `s`'s prompt into when the next `n` rows complete it.
    fn compaction_blocks(&self, s: &Seq, n: usize) -> usize {
        match (s.attention.snapkv(), &s.phase) {
            (Some(p), Phase::Prefill { exact_from, .. })
                if s.phase.completes_prompt(n) && p.compresses(*exact_from) =>
            {
                self.cache.blocks_for(p.kept(*exact_from))
            }
            _ => 0,
        }
    }

    /// Compresses the KV of the SnapKV sequences whose prompt proper the forward over `plan`
    /// just completed; returns the ids of those whose compression failed, with why.
    fn compress_completed(&mut self, plan: &[(usize, usize)]) -> Vec<(u64, EngineError)> {
        let mut failed = Vec::new();
        for &(i, n) in plan {
            let s = &mut self.active[i];
            let Some(policy) = s.attention.snapkv() else {
                continue;
            };
            if !s.phase.completes_prompt(n) {
                continue;
            }
            let Some(obs) = s.observation.take() else {
                continue;
            };
            if let Err(e) = self.model.compress_snapkv(&mut self.cache, &obs, policy) {
                failed.push((s.id, e));
            }
        }
        failed
    }

    /// Ends the sequences `failed` names that are still running.
    fn end_failed(&mut self, failed: Vec<(u64, EngineError)>) {
        for (id, e) in failed {
            if let Some(i) = self.active.iter().position(|s| s.id == id) {
                let s = self.active.swap_remove(i);
                self.cache.free_sequence(s.id);
                let _ = s.events.send(Event::Error(e.into()));
            }
        }
    }

    /// Frees the lowest-priority, newest running sequence and queues it for recompute.
    pub(super) fn preempt_one(&mut self) -> bool {
        let running: Vec<(Priority, Instant)> = self
            .active
            .iter()
            .map(|s| (s.priority, s.arrival))
            .collect();
        let Some(i) = policy::preemption_victim(&running) else {
            return false;
        };
        let mut s = self.active.swap_remove(i);
        // Its complete prompt blocks stay cached: the recompute finds them unless evicted.
        self.end_sequence(&s);
        s.phase = match s.phase {
            Phase::Decode { next } => {
                let gen = s.gen.generated();
                let mut tokens = s.prompt.clone();
                tokens.extend_from_slice(&gen[..gen.len().saturating_sub(1)]);
                Phase::Prefill {
                    tokens,
                    done: 0,
                    resume: Some(next),
                    exact_from: s.prompt.len(),
                }
            }
            Phase::Prefill {
                tokens,
                resume,
                exact_from,
                ..
            } => Phase::Prefill {
                tokens,
                done: 0,
                resume,
                exact_from,
            },
        };
        s.preemptions += 1;
        self.metrics.preemptions.increment(1);
        s.first_preempted_at
            .get_or_insert(s.gen.generated().len() as u32);
        tracing::info!(parent: &s.span, request_id = s.id, "preempted: KV pool full");
        self.enqueue(s, true);
        true
    }

    /// After a forward over `plan` failed with `e`: ends the sequences `blamed` for it (each
    /// with its own error); when none is to blame (a fault of this worker, not of a
    /// request), ends the whole batch as unavailable here, which the router migrates.
    pub(super) fn fail_step(
        &mut self,
        plan: &[(usize, usize)],
        blamed: Vec<(usize, EngineError)>,
        e: &EngineError,
    ) {
        let mut ended: Vec<(usize, DecodeError)> = if blamed.is_empty() {
            tracing::error!(error = %e, "forward failed; no request to blame: ending the batch");
            plan.iter()
                .map(|&(i, _)| (i, DecodeError::StepFailed(e.to_string())))
                .collect()
        } else {
            tracing::warn!(
                error = %e,
                blamed = blamed.len(),
                batch = plan.len(),
                "forward refused a chunk; ending only the sequences it belongs to"
            );
            blamed.into_iter().map(|(i, e)| (i, e.into())).collect()
        };
        ended.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, err) in ended {
            let s = self.active.swap_remove(i);
            self.cache.free_sequence(s.id);
            let _ = s.events.send(Event::Error(err));
        }
    }

    pub(super) fn step(&mut self) {
        let (mut plan, mut need) = self.plan();
        while need > self.cache.free_blocks() {
            if !self.preempt_one() {
                // A single sequence that outgrew the pool: it ends here.
                if let Some(s) = self.active.pop() {
                    self.cache.free_sequence(s.id);
                    let _ = s.events.send(Event::Error(
                        EngineError::KvExhausted {
                            needed: need,
                            free: self.cache.free_blocks(),
                        }
                        .into(),
                    ));
                }
                return;
            }
            (plan, need) = self.plan();
        }
        if plan.is_empty() {
            return;
        }
        let feeds: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, n)| match &self.active[i].phase {
                Phase::Decode { next } => vec![*next],
                Phase::Prefill { tokens, done, .. } => tokens[*done..*done + n].to_vec(),
            })
            .collect();
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .zip(&feeds)
            .map(|(&(i, n), toks)| {
                // The prompt proper's length while a chunk of it is fed; replayed generated
                // tokens were decode steps: they keep the decode order (0).
                let prompt_len = match &self.active[i].phase {
                    Phase::Prefill {
                        done, exact_from, ..
                    } if done < exact_from => *exact_from,
                    _ => 0,
                };
                SeqChunk {
                    seq: self.active[i].id,
                    tokens: toks,
                    logits: match &self.active[i].phase {
                        Phase::Decode { .. } => true,
                        Phase::Prefill { tokens, done, .. } => done + n == tokens.len(),
                    },
                    prompt: prompt_len > 0,
                    prompt_len,
                }
            })
            .collect();
        // What this step reads: every weight once, and each sequence's whole KV so far.
        let kv_tokens: usize = plan
            .iter()
            .map(|&(i, n)| self.cache.sequence_len(self.active[i].id).unwrap_or(0) + n)
            .sum();
        let read_bytes =
            self.model.weight_bytes_per_step() + kv_tokens * self.cache.layout().bytes_per_token();
        // SnapKV sequences in the forward gather their prompt's last queries.
        let observed_at: Vec<usize> = plan
            .iter()
            .map(|&(i, _)| i)
            .filter(|&i| self.active[i].observation.is_some())
            .collect();
        let mut obs: Vec<Observation> = observed_at
            .iter()
            .filter_map(|&i| self.active[i].observation.take())
            .collect();
        let t0 = Instant::now();
        let result = self
            .model
            .forward_observing(&mut self.cache, &chunks, &mut obs);
        for (&i, o) in observed_at.iter().zip(obs) {
            self.active[i].observation = Some(o);
        }
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                // One sequence's fault must not end the others: the forward checks every
                // chunk before it changes anything, so the sequences whose chunk fails that
                // check end here and the rest, untouched, run at the next iteration.
                let blamed: Vec<(usize, EngineError)> = plan
                    .iter()
                    .zip(&chunks)
                    .filter_map(|(&(i, _), ch)| {
                        self.model
                            .check_chunk(&self.cache, ch)
                            .err()
                            .map(|e| (i, e))
                    })
                    .collect();
                drop(chunks);
                self.fail_step(&plan, blamed, &e);
                return;
            }
        };
        drop(chunks);
        let compress_failed = self.compress_completed(&plan);
        let dt = t0.elapsed().as_secs_f64();
        self.metrics.batch_size.record(plan.len() as f64);
        self.metrics.step_seconds.record(dt);
        self.metrics.read_bytes.increment(read_bytes as u64);
        if dt > 0.0 {
            self.metrics.bandwidth.set(read_bytes as f64 / dt);
        }
        let mut generated = 0usize;
        let ctx = self.model.config().context_length;
        let mut ended: Vec<(usize, Option<TokenStep>)> = Vec::new();
        for (k, &(i, n)) in plan.iter().enumerate() {
            let row = std::mem::take(&mut logits[k]);
            let limit = self.active[i].max_tokens(ctx);
            let left =
                limit.saturating_sub(self.cache.sequence_len(self.active[i].id).unwrap_or(limit));
            let s = &mut self.active[i];
            match &mut s.phase {
                Phase::Decode { .. } => {
                    let mut row = row;
                    let step = s.gen.step(self.model.tokenizer(), &mut row, left);
                    generated += 1;
                    ended.push((i, Some(step)));
                }
                Phase::Prefill {
                    tokens,
                    done,
                    resume,
                    ..
                } => {
                    *done += n;
                    if self.book.is_some() {
                        // Chunk by chunk: a local layer group gives back the blocks out of
                        // its window once they are indexed, before the next chunk.
                        // (Only the blocks the sequence holds whole so far are indexed.)
                        let _ = self.cache.register_blocks(s.id, &s.prompt[..s.cacheable]);
                    }
                    if *done < tokens.len() {
                        continue;
                    }
                    if let Some(started) = s.prefill_started {
                        s.prefill_seconds += secs(started);
                    }
                    match resume.take() {
                        Some(next) => s.phase = Phase::Decode { next },
                        None => {
                            let mut row = row;
                            let step = s.gen.step(self.model.tokenizer(), &mut row, left);
                            generated += 1;
                            ended.push((i, Some(step)));
                        }
                    }
                }
            }
        }
        // Apply steps; remove finished sequences from the back so indices stay valid.
        ended.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, step) in ended {
            let Some(step) = step else { continue };
            let finished = step.finished;
            let s = &mut self.active[i];
            s.phase = Phase::Decode { next: step.id };
            let _ = s.events.send(Event::Token {
                id: step.id,
                text: step.text,
            });
            if let Some(f) = finished {
                let s = self.active.swap_remove(i);
                self.finish(s, f);
            }
        }
        self.end_failed(compress_failed);
        self.metrics.generated.increment(generated as u64);
        if dt > 0.0 {
            let rate = generated as f64 / dt;
            self.tokens_per_second = 0.9 * self.tokens_per_second + 0.1 * rate;
        }
    }
}
