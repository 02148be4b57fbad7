//! One forward of the prefill engine: the chunks [`policy::plan_chunks`] picks, the hook
//! that hands each layer's new KV to the transfers while the next layer computes, and what
//! a finished prompt becomes (its first token, its blocks freed and cached).

use std::ops::ControlFlow;
use std::time::Instant;

use duet_engine::{AttentionPolicy, KvCache, Observation, Sampler, SeqChunk};
use duet_kv_transfer::TransferDesc;
use tokio::sync::{mpsc, oneshot};

use super::{Engine, Running};
use crate::error::PrefillError;
use crate::handle::PrefillResult;
use crate::policy;
use crate::send_pool::sequence_regions;
use crate::transfer::Msg;

impl Engine {
    /// Compresses a computed SnapKV prompt's KV (nothing for other policies).
    fn compress(&mut self, r: &mut Running) -> Result<(), duet_engine::EngineError> {
        match (r.job.attention.snapkv(), r.observation.take()) {
            (Some(p), Some(obs)) => self.model.compress_snapkv(&mut self.cache, &obs, p),
            (Some(p), None) => Err(duet_engine::EngineError::invalid(
                "observation",
                format!("{p}: the prompt's observed queries were lost"),
            )),
            (None, _) => Ok(()),
        }
    }

    /// After a forward over `plan` failed with `e`: ends the requests whose chunk is
    /// `blamed` with their own error, and leaves the others running (their KV is untouched:
    /// the forward refused before computing). With none to blame (this worker's fault, not
    /// a request's), every request of the forward ends as unavailable here, and is retried
    /// elsewhere.
    pub(super) fn fail_step(
        &mut self,
        plan: &[(usize, usize, usize)],
        blamed: Vec<(usize, duet_engine::EngineError)>,
        e: &duet_engine::EngineError,
    ) {
        let mut ended: Vec<(usize, PrefillError)> = if blamed.is_empty() {
            plan.iter()
                .map(|p| (p.0, PrefillError::StepFailed(e.to_string())))
                .collect()
        } else {
            blamed.into_iter().map(|(i, b)| (i, b.into())).collect()
        };
        tracing::warn!(error = %e, ended = ended.len(), forward = plan.len(), "prefill forward failed");
        ended.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, err) in ended {
            let r = self.running.swap_remove(i);
            self.end(&r);
            let _ = r.tx.send(Msg::Fail(err));
        }
    }

    pub(super) fn step(&mut self) {
        self.start_queued();
        if self.running.is_empty() {
            return;
        }
        // Live status while the forward runs: what it computes shows as running.
        self.publish();
        let bs = self.cache.block_size();
        let left: Vec<usize> = self
            .running
            .iter()
            .map(|r| r.job.prompt.len() - r.done)
            .collect();
        // (running index, start, len)
        let plan: Vec<(usize, usize, usize)> =
            policy::plan_chunks(&left, self.cfg.max_batch_tokens, bs)
                .into_iter()
                .map(|(i, n)| (i, self.running[i].done, n))
                .collect();
        // Each chunk sends the part of its KV the decode worker does not hold yet (from
        // `dst_start` on), as whole destination blocks: `(plan index, first token)`.
        let mut sends = Vec::new();
        for (k, &(i, start, n)) in plan.iter().enumerate() {
            let r = &self.running[i];
            // A windowed prompt's chunks drop blocks as they go, a SnapKV prompt is compacted
            // once computed: their kept blocks travel then (`send_kept`), not chunk by chunk.
            if r.job.attention != AttentionPolicy::Full {
                continue;
            }
            let from = start.max(r.job.dst_start);
            if from >= start + n {
                continue;
            }
            let dst0 = r.job.dst_start / bs;
            let desc = TransferDesc {
                request_id: r.job.request_id,
                token_start: from as u32,
                token_count: (start + n - from) as u32,
                dst_blocks: r.job.dst_blocks[from / bs - dst0..(start + n).div_ceil(bs) - dst0]
                    .to_vec(),
            };
            let _ = r.tx.send(Msg::Begin(desc));
            sends.push((k, from));
        }
        // SnapKV prompts in the forward gather their last positions' queries.
        let observed_at: Vec<usize> = plan
            .iter()
            .map(|p| p.0)
            .filter(|&i| self.running[i].observation.is_some())
            .collect();
        let mut observed: Vec<Observation> = observed_at
            .iter()
            .filter_map(|&i| self.running[i].observation.take())
            .collect();
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, start, n)| {
                let r = &self.running[i];
                SeqChunk::prompt(
                    r.job.request_id,
                    &r.job.prompt[start..start + n],
                    start + n == r.job.prompt.len(),
                    r.job.prompt.len(),
                )
            })
            .collect();
        // What the per-layer hook needs: for each chunk, its sender and block index range.
        type Out = (mpsc::UnboundedSender<Msg>, u64, usize, usize);
        let outs: Vec<Out> = sends
            .iter()
            .map(|&(k, from)| {
                let (i, start, n) = plan[k];
                let r = &self.running[i];
                (
                    r.tx.clone(),
                    r.job.request_id,
                    from / bs,
                    (start + n).div_ceil(bs),
                )
            })
            .collect();
        // Who waits for each chunk: when nobody waits for any of them (callers gone,
        // transfers failed), the forward stops after the layer it is in instead of computing
        // the rest for nobody, and the next tick frees them.
        let waiters: Vec<(&oneshot::Sender<()>, &mpsc::UnboundedSender<Msg>)> = plan
            .iter()
            .map(|&(i, _, _)| (&self.running[i].watch, &self.running[i].tx))
            .collect();
        let t0 = Instant::now();
        let mut hook = |layer: usize, cache: &KvCache| {
            for (tx, seq, first, last) in &outs {
                // The chunk's logical blocks in this layer's group (all held during the
                // forward: a local group drops only after it), read in place.
                let Some((k, v)) = sequence_regions(cache, *seq, *first..*last, layer) else {
                    continue;
                };
                let _ = tx.send(Msg::Layer {
                    layer: layer as u32,
                    k,
                    v,
                });
            }
            if policy::nobody_waits(waiters.iter().map(|(w, t)| w.is_closed() || t.is_closed())) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let result =
            self.model
                .forward_with_observing(&mut self.cache, &chunks, &mut hook, &mut observed);
        drop(waiters);
        if let Err(duet_engine::EngineError::Stopped { layer }) = &result {
            tracing::debug!(
                layer,
                forward = plan.len(),
                "prefill forward stopped: nobody waits"
            );
            self.metrics.stopped.increment(1);
            return;
        }
        // On failure, the chunks to blame (the forward checks them all before it changes
        // anything): their requests end, the others go on.
        let blamed: Vec<(usize, duet_engine::EngineError)> = match &result {
            Ok(_) => Vec::new(),
            Err(_) => plan
                .iter()
                .zip(&chunks)
                .filter_map(|(p, ch)| {
                    self.model
                        .check_chunk(&self.cache, ch)
                        .err()
                        .map(|e| (p.0, e))
                })
                .collect(),
        };
        drop(chunks);
        for (&i, o) in observed_at.iter().zip(observed) {
            self.running[i].observation = Some(o);
        }
        let elapsed = t0.elapsed();
        let dt = elapsed.as_secs_f64();
        let tokens: usize = plan.iter().map(|p| p.2).sum();
        if dt > 0.0 {
            self.tokens_per_second = 0.8 * self.tokens_per_second + 0.2 * tokens as f64 / dt;
        }
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                self.fail_step(&plan, blamed, &e);
                return;
            }
        };
        self.metrics.forward(tokens, elapsed);
        let compute_done = Instant::now();
        let mut finished = Vec::new();
        for (k, &(i, start, n)) in plan.iter().enumerate() {
            let r = &mut self.running[i];
            if sends.iter().any(|&(s, _)| s == k) {
                let _ = r.tx.send(Msg::Finish);
            }
            r.done = start + n;
            if self.book.is_some() && r.job.attention == AttentionPolicy::Full {
                // Indexed chunk by chunk: a local layer group gives back the blocks out of
                // its window once they are, before the next chunk.
                let _ = self
                    .cache
                    .register_blocks(r.job.request_id, &r.job.prompt[..r.done]);
            }
            if r.done < r.job.prompt.len() {
                continue;
            }
            let first_token = Sampler::new(r.job.sampling.clone())
                .map(|mut s| s.sample(&mut logits[k], &r.job.prompt));
            finished.push((i, first_token));
        }
        finished.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        for (i, first) in finished {
            let mut r = self.running.swap_remove(i);
            if r.job.attention != AttentionPolicy::Full && first.is_ok() {
                if let Err(e) = self.compress(&mut r) {
                    self.end(&r);
                    let _ = r.tx.send(Msg::Fail(e.into()));
                    continue;
                }
                if !self.send_kept(&r) {
                    self.end(&r);
                    let _ = r.tx.send(Msg::Fail(PrefillError::StepFailed(
                        "a windowed or compressed prompt does not hold exactly its kept blocks"
                            .into(),
                    )));
                    continue;
                }
            }
            self.end(&r);
            let msg = match first {
                Ok(first_token) => Msg::Complete(
                    PrefillResult {
                        first_token,
                        queue_seconds: r.started.duration_since(r.enqueued).as_secs_f64(),
                        prefill_seconds: r.started.elapsed().as_secs_f64(),
                        kv_transfer_seconds: 0.0,
                        kv_stream_seconds: 0.0,
                        kv_bytes: 0,
                        cached_tokens: r.cached,
                    },
                    compute_done,
                ),
                Err(e) => Msg::Fail(e.into()),
            };
            let _ = r.tx.send(msg);
        }
    }
}
