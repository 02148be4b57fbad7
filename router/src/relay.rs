//! One request's life after admission: placement, prefill (remote or local), and relaying
//! the decode worker's token stream to the client.
//!
//! Cancellation: the client's stream closing is watched at every await; then the decode
//! worker's reservation or sequence is released and a running remote prefill cancelled.
//! Retries: a failure that another worker pair might not have (unavailable, exhausted,
//! reservation lost) is retried up to `max_attempts` times, only while no token has
//! reached the client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_discovery::{ClusterView, Role};
use duet_proto::v1 as pb;
use duet_serving::convert::{attention_to_proto, sampling_to_proto};
use duet_serving::trace_context::TraceContext;
use tokio::sync::mpsc;
use tonic::Status;

use crate::admission::QueueSlot;
use crate::claims::Claim;
use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::frontend::Prepared;
use crate::kv_index::KvIndex;
use crate::placement::{decide, never_fits, Decision, Placement, Policy, Request, RouterView};
use crate::prompt_prefix::PromptPrefix;
use crate::request_metrics::RequestMetrics;
use crate::worker_calls::{
    no_answer, prefetch, release_decode, stream_err, worker_err, CONTROL_TIMEOUT,
};
use crate::workers::Workers;

/// What every request shares.
pub struct Shared {
    pub cfg: RouterConfig,
    pub view: ClusterView,
    pub workers: Arc<Workers>,
    /// What each worker's prefix cache holds (KV-aware routing).
    pub kv_index: Arc<KvIndex>,
    /// Requests finished recently (published for the planner).
    pub recent: crate::recent::RecentRequests,
}

pub type Out = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

/// One request.
pub struct Job {
    pub request_id: u64,
    pub client_id: String,
    pub prep: Prepared,
    pub slot: QueueSlot,
    /// The request id and client allowance it holds until it ends.
    pub claim: Claim,
    pub arrival: Instant,
    pub deadline: Option<Instant>,
    pub metrics: RequestMetrics,
    /// The request's trace (this router span's ids); worker calls carry it.
    pub trace: TraceContext,
}

/// What reached the client so far, across attempts and migrations.
#[derive(Default)]
struct Progress {
    first_token_at: Option<Instant>,
    /// The tokens sent: after a migration they extend the prompt.
    sent_ids: Vec<u32>,
    /// Attempts started (retries and migrations included).
    attempts: u32,
}

enum Outcome {
    Finished,
    ClientGone,
}

/// Drives `job` to completion, sending its events on `out`.
pub async fn run(shared: Arc<Shared>, mut job: Job, out: Out) {
    let mut progress = Progress::default();
    let mut attempt = 0;
    let mut migrations = 0;
    loop {
        attempt += 1;
        let e = match attempt_once(&shared, &mut job, &out, &mut progress).await {
            Ok(Outcome::Finished) => return job.metrics.finish(Ok(())),
            // Dropping the job's metrics counts the request as cancelled.
            Ok(Outcome::ClientGone) => return,
            Err(e) => e,
        };
        if let Some(id) = e.suspect_worker() {
            shared.workers.mark_suspect(id, shared.cfg.suspect_for);
        }
        if let Some((prefill, decode)) = e.failed_link() {
            shared
                .workers
                .mark_bad_link(prefill, decode, shared.cfg.suspect_for);
        }
        let sent = progress.sent_ids.len();
        if e.worker_full() && sent == 0 && within_queue_wait(&shared, &job) {
            // Not an attempt: the request queues again until a worker has room.
            tracing::debug!(error = %e, "no room on the worker after all: queued again");
            attempt -= 1;
            job.slot.requeue();
            tokio::select! {
                _ = out.closed() => return,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        } else if e.failed_link().is_some() && sent == 0 && within_queue_wait(&shared, &job) {
            // Not an attempt either: the pair is avoided from now on, and once every pair's
            // link has failed the decode worker prefills locally. Bounded by the number of
            // pairs and by `max_queue_wait`.
            tracing::warn!(error = %e, "KV link failed: retrying without that pair");
            attempt -= 1;
            metrics::counter!(duet_telemetry::names::ROUTER_RETRIES_TOTAL).increment(1);
        } else if sent > 0
            && e.retryable()
            && migrations < shared.cfg.max_migrations
            && sent < job.prep.params.max_tokens
        {
            // The decode worker failed mid-stream: prefill the prompt plus what was sent on
            // another pair and continue the same stream (greedy output is unchanged).
            migrations += 1;
            tracing::warn!(error = %e, migrations, sent, "decode failed mid-stream: migrating");
            metrics::counter!(duet_telemetry::names::ROUTER_MIGRATIONS_TOTAL).increment(1);
            attempt = 0;
            job.slot.requeue();
        } else {
            let retry = e.retryable() && sent == 0 && attempt < shared.cfg.max_attempts;
            tracing::warn!(error = %e, attempt, retry, "attempt failed");
            if !retry {
                job.metrics.finish(Err(e.class()));
                let _ = out.send(Err(e.status())).await;
                return;
            }
            metrics::counter!(duet_telemetry::names::ROUTER_RETRIES_TOTAL).increment(1);
            // Backed off, so that a worker that refuses connections for a moment (restarting,
            // its record not yet replaced) cannot use up every attempt within milliseconds.
            tokio::select! {
                _ = out.closed() => return,
                _ = tokio::time::sleep(retry_backoff(attempt)) => {}
            }
        }
    }
}

/// The pause before attempt `attempt + 1`: 100 ms, doubling, at most 1 s.
fn retry_backoff(attempt: usize) -> Duration {
    Duration::from_millis(100u64 << attempt.saturating_sub(1).min(4)).min(Duration::from_secs(1))
}

/// Whether `job` may still wait for room (`max_queue_wait` since arrival, and its deadline).
fn within_queue_wait(shared: &Shared, job: &Job) -> bool {
    let now = Instant::now();
    now < job.arrival + shared.cfg.max_queue_wait && job.deadline.is_none_or(|d| now < d)
}

fn response(id: &str, ev: pb::generate_response::Event) -> pb::GenerateResponse {
    pb::GenerateResponse {
        request_id: id.to_string(),
        event: Some(ev),
    }
}

/// How long after the view lost its last decode worker a request still waits for one to
/// come back (two default lease TTLs: enough for a worker whose lease expired to register
/// again once etcd answers).
const WORKERS_RETURN_WINDOW: Duration = Duration::from_secs(10);

/// Waits until [`decide`] places the request (the queue: a decode worker with room),
/// bounded by the deadline and `max_queue_wait`. `None`: the client went away.
async fn wait_for_placement(
    shared: &Shared,
    job: &Job,
    prefix: &PromptPrefix<'_>,
    req: &Request,
    out: &Out,
) -> Result<Option<Placement>, RouterError> {
    let prompt_len = req.prompt_tokens;
    let policy = Policy::of(&shared.cfg);
    let mut view = shared.view.clone();
    let started = Instant::now();
    // The wait is counted from arrival, across re-queues.
    let give_up = job.arrival + shared.cfg.max_queue_wait;
    loop {
        let snap = view.snapshot();
        let load = shared.workers.load();
        let decision = decide(
            &RouterView {
                snapshot: &snap,
                load: &load,
                cached: prefix,
            },
            req,
            &policy,
        );
        let largest = match decision {
            Decision::Place(p) => return Ok(Some(p)),
            Decision::Wait {
                largest_pool_tokens,
            } => largest_pool_tokens,
        };
        // A prompt no decode worker could ever hold fails at once instead of waiting.
        if let Some(largest) = largest {
            if never_fits(prompt_len, largest) {
                return Err(RouterError::PromptExceedsPools {
                    tokens: prompt_len,
                    headroom: 1,
                    largest,
                });
            }
        }
        let now = Instant::now();
        if job.deadline.is_some_and(|d| now >= d) {
            return Err(RouterError::Deadline("waiting for a decode worker"));
        }
        // With no decode worker at all (beyond a short grace for workers that are just
        // registering), waiting cannot help: say so at once (HTTP 503, UNAVAILABLE). Unless
        // the view lost its decode workers a moment ago: leases that expired while etcd was
        // frozen come back within seconds, and the request waits for them (bounded by
        // `max_queue_wait` and its deadline).
        let none_known = largest.is_none();
        let just_lost = snap
            .lost_at(Role::Decode)
            .is_some_and(|t| now.saturating_duration_since(t) < WORKERS_RETURN_WINDOW);
        let grace_over = now >= started + shared.cfg.no_worker_grace && !just_lost;
        if now >= give_up || (none_known && grace_over) {
            let known = snap.workers(Role::Decode).count();
            return Err(RouterError::NoWorker {
                role: "decode",
                reason: format!(
                    "{known} decode workers known, none with room for {} prompt tokens{}",
                    prompt_len,
                    if snap.stale {
                        " (registry unreachable: routing on the last view)"
                    } else {
                        ""
                    }
                ),
            });
        }
        tokio::select! {
            _ = out.closed() => return Ok(None),
            _ = view.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

/// An outgoing call of `job`: its remaining deadline and its trace context (the worker's
/// span becomes a child of the request's span).
fn outgoing<T>(job: &Job, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    job.trace.inject(&mut req);
    if let Some(d) = job.deadline {
        req.set_timeout(
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        );
    }
    req
}

async fn attempt_once(
    shared: &Shared,
    job: &mut Job,
    out: &Out,
    progress: &mut Progress,
) -> Result<Outcome, RouterError> {
    // After a migration the tokens already sent extend the prompt, and only the rest of
    // the budget remains.
    let resumed = progress.sent_ids.len();
    let prompt: Vec<u32> = job
        .prep
        .prompt
        .iter()
        .chain(&progress.sent_ids)
        .copied()
        .collect();
    let max_tokens = job.prep.params.max_tokens.saturating_sub(resumed).max(1);
    // Each attempt has its own id on the workers: whatever an earlier attempt left behind
    // there (a reservation expiring, a late KV failure, a prefill being cancelled) can only
    // ever touch that attempt, never this one. The first attempt uses the request's id.
    progress.attempts += 1;
    let request_id = match progress.attempts {
        1 => job.request_id,
        _ => rand::random(),
    };
    if progress.attempts > 1 {
        tracing::debug!(
            attempt = progress.attempts,
            worker_request_id = request_id,
            "new attempt"
        );
    }
    // A windowed or SnapKV request neither reads nor feeds a prefix cache: routed on load
    // alone, its block hashes not sent.
    let uncached = job.prep.attention != duet_engine::AttentionPolicy::Full;
    let prefix = PromptPrefix::new(
        &prompt,
        &shared.kv_index,
        shared.cfg.kv_routing && !uncached,
    );
    let req = Request {
        prompt_tokens: prompt.len(),
        resumed_tokens: resumed,
    };
    let Some(placed) = wait_for_placement(shared, job, &prefix, &req, out).await? else {
        return Ok(Outcome::ClientGone);
    };
    let Placement {
        kind,
        reason,
        candidates,
    } = placed;
    let prompt_len = prompt.len();
    // Open the token stream on the first decode worker that accepts. For a remote prefill
    // the decode worker reserves blocks for the prompt (its headers say it did; a refusal
    // is the call's status) and then calls the prefill worker picked here itself
    // (`ViaPrefill`), so the router makes one call per request whatever the placement.
    let sampling = Some(sampling_to_proto(&job.prep.params.sampling));
    let decode_request = |prefill: pb::decode_request::Prefill| pb::DecodeRequest {
        request_id,
        prompt: prompt.clone(),
        sampling,
        max_tokens: max_tokens as u32,
        stop: job.prep.params.stop.clone(),
        priority: job.prep.priority as i32,
        prefill: Some(prefill),
        ignore_eos: job.prep.params.ignore_eos,
        attention: Some(attention_to_proto(job.prep.attention)),
    };
    let mut chosen = None;
    let mut last_err = None;
    for c in candidates {
        let d = &c.decode;
        // Counted before any await, so that concurrent requests spread across workers.
        let tracked = shared.workers.track_decode(&d.id);
        let (prefill, prefill_pick) = if let Some(p) = c.prefill {
            // Counted before the await too, so that concurrent requests spread across
            // prefill workers before their records update.
            let prefill_tracked = shared
                .workers
                .track_prefill(&p.id, (prompt_len - c.cached_tokens.min(prompt_len)) as u64);
            // Announced before the reservation: the prefill worker starts bringing the
            // prompt's blocks up from its lower tiers while the decode worker reserves.
            if prefix.matched(&p).lower > 0 {
                prefetch(
                    &shared.workers,
                    &p.grpc_addr,
                    request_id,
                    &prefix.hashes(&p),
                );
            }
            let via = pb::ViaPrefill {
                prefill_worker_id: p.id.clone(),
                prefill_address: p.grpc_addr.clone(),
                ttl_ms: shared.cfg.reservation_ttl.as_millis() as u32,
                block_hashes: match uncached {
                    true => Vec::new(),
                    false => prefix.hashes(d).to_vec(),
                },
                prefill_timeout_ms: shared.cfg.prefill_timeout.as_millis() as u32,
            };
            (
                pb::decode_request::Prefill::Via(via),
                Some((p, prefill_tracked)),
            )
        } else {
            let local = pb::LocalPrefill {
                replay_tokens: resumed as u32,
            };
            (pb::decode_request::Prefill::Local(local), None)
        };
        let mut client = shared.workers.decode(&d.grpc_addr)?;
        let req = outgoing(job, decode_request(prefill));
        let opened = tokio::select! {
            r = tokio::time::timeout(CONTROL_TIMEOUT, client.generate(req)) => {
                r.unwrap_or_else(|_| Err(no_answer("generate", CONTROL_TIMEOUT)))
            }
            _ = out.closed() => {
                release_decode(&shared.workers, &d.grpc_addr, request_id).await;
                return Ok(Outcome::ClientGone);
            }
        };
        match opened {
            Ok(stream) => {
                let (decode, cached) = (c.decode, c.cached_tokens);
                chosen = Some((decode, cached, stream.into_inner(), prefill_pick, tracked));
                break;
            }
            // A decode worker that could not reach the prefill worker, or did not find it in
            // its view of the registry, says so: that prefill worker (or the pair's link,
            // when flagged) is to blame, not this decode worker.
            Err(s) if duet_serving::status::is_prefill_failure(&s) => {
                return Err(stream_err(d, prefill_pick.as_ref().map(|(p, _)| p), s));
            }
            Err(s) => last_err = Some(worker_err(d, s)),
        }
    }
    let Some((decoder, predicted, mut stream, prefill_pick, _decode_tracked)) = chosen else {
        return Err(last_err.unwrap_or(RouterError::NoWorker {
            role: "decode",
            reason: "no decode worker accepted the request".into(),
        }));
    };
    let (prefill_choice, mut prefill_tracked) = match prefill_pick {
        Some((p, t)) => (Some(p), Some(t)),
        None => (None, None),
    };
    job.slot.release();
    let placement = kind.to_proto();
    job.metrics.placed(kind.label());
    let queue_seconds = job.arrival.elapsed().as_secs_f64();
    // Frees whatever the decode worker holds for this request (idempotent there).
    let release = || release_decode(&shared.workers, &decoder.grpc_addr, request_id);

    metrics::counter!(
        duet_telemetry::names::ROUTER_PREFIX_MATCH_TOKENS_TOTAL,
        "placement" => kind.label()
    )
    .increment(predicted as u64);
    let span = tracing::Span::current();
    span.record("prefix_match_tokens", predicted);
    span.record("decode_worker", decoder.id.as_str());
    span.record("placement", placement.as_str_name());
    span.record("routing_reason", reason.as_str());
    if let Some(p) = &prefill_choice {
        span.record("prefill_worker", p.id.as_str());
    }
    let mut timings = pb::Timings {
        queue_seconds,
        placement: placement as i32,
        decode_worker: decoder.id.clone(),
        prefill_worker: prefill_choice
            .as_ref()
            .map(|p| p.id.clone())
            .unwrap_or_default(),
        routing_reason: reason,
        prefix_match_tokens: predicted as u32,
        ..Default::default()
    };
    let deadline = async {
        match job.deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    let stall = shared.cfg.stream_stall_timeout;
    let mut streaming = false;
    loop {
        // Once tokens flow, a silence longer than `stall` means the worker hung or was cut
        // off (before the first token it may legitimately queue or prefill for long).
        let limit = if streaming { stall } else { Duration::MAX };
        let msg = tokio::select! {
            m = tokio::time::timeout(limit, stream.message()) => match m {
                Ok(m) => m,
                Err(_) => Err(no_answer("the token stream", stall)),
            },
            _ = out.closed() => {
                drop(stream);
                release().await;
                return Ok(Outcome::ClientGone);
            }
            _ = &mut deadline => {
                drop(stream);
                release().await;
                return Err(RouterError::Deadline("while generating"));
            }
        };
        let ev = match msg {
            Ok(Some(pb::DecodeEvent { event: Some(ev) })) => ev,
            Ok(Some(pb::DecodeEvent { event: None })) => continue,
            Ok(None) => {
                release().await;
                let status = Status::unavailable("stream ended without a final message");
                return Err(worker_err(&decoder, status));
            }
            Err(s) => {
                release().await;
                return Err(stream_err(&decoder, prefill_choice.as_ref(), s));
            }
        };
        // The prefill (local or remote) is over once the first event arrives.
        drop(prefill_tracked.take());
        match ev {
            pb::decode_event::Event::Token(t) => {
                if progress.first_token_at.is_none() {
                    progress.first_token_at = Some(Instant::now());
                }
                streaming = true;
                progress.sent_ids.push(t.id);
                let r = response(&job.client_id, pb::generate_response::Event::Token(t));
                if out.send(Ok(r)).await.is_err() {
                    drop(stream);
                    release().await;
                    return Ok(Outcome::ClientGone);
                }
                job.metrics.token();
            }
            pb::decode_event::Event::Done(d) => {
                // Prompt tokens whose KV came from a prefix cache (reported by the worker
                // that prefilled).
                let cached_tokens = match &d.remote_prefill {
                    Some(r) => {
                        timings.prefill_seconds = r.prefill_seconds;
                        timings.kv_transfer_seconds = r.kv_transfer_seconds;
                        timings.kv_stream_seconds = r.kv_stream_seconds;
                        timings.kv_bytes = r.kv_bytes;
                        // Reused on the decode worker: not transferred.
                        timings.kv_reused_tokens = d.cached_tokens;
                        r.cached_tokens
                    }
                    None => {
                        timings.prefill_seconds = d.prefill_seconds;
                        d.cached_tokens
                    }
                };
                tracing::Span::current().record("cached_tokens", cached_tokens);
                timings.time_to_first_token_seconds = progress
                    .first_token_at
                    .map_or(0.0, |t| t.duration_since(job.arrival).as_secs_f64());
                timings.total_seconds = job.arrival.elapsed().as_secs_f64();
                let fin = pb::FinalMessage {
                    finish_reason: d.finish_reason,
                    usage: Some(pb::Usage {
                        prompt_tokens: job.prep.prompt.len() as u32,
                        completion_tokens: d.completion_tokens + resumed as u32,
                        truncated_tokens: job.prep.truncated as u32,
                        cached_tokens,
                    }),
                    timings: Some(timings),
                    // Only what the client has not received: the decode worker's held-back
                    // tail (a migrated stream's worker resumed the text state of the tokens
                    // sent before, so the tail is that of an undisturbed run).
                    text: d.text,
                };
                tracing::info!(
                    decode = %decoder.id,
                    prefill = ?prefill_choice.as_ref().map(|p| &p.id),
                    placement = ?placement,
                    completion_tokens = d.completion_tokens,
                    "finished"
                );
                let _ = out
                    .send(Ok(response(
                        &job.client_id,
                        pb::generate_response::Event::Final(fin),
                    )))
                    .await;
                return Ok(Outcome::Finished);
            }
        }
    }
}
