//! Drives a target: warm-up, then one run per offered rate, each with the same requests.
//!
//! A run sends request k at its planned time (the sum of the first k arrival gaps, the
//! first at 0) or, when `max_concurrency` requests are already in flight, as soon as one
//! finishes (a closed loop when there is no rate). It stops sending after `num_prompts`
//! requests or once `duration` has passed, whichever comes first, then waits for every
//! request in flight (each bounded by the request timeout).
//!
//! Multi-turn workloads: the arrivals (and the concurrency cap) apply to conversations; a
//! conversation sends its turns one after another, each when the one before has ended (a
//! failed turn ends the conversation), and holds its slot until its last turn. Every turn
//! counts as a request towards `num_prompts`.
//!
//! Invariants: every sent request yields exactly one record; records are ordered by index;
//! warm-up requests (sent one at a time, or `max_concurrency` at a time, before the first
//! run) are never recorded; every run of a sweep draws the same workload (same seed) and,
//! for a given rate, the same arrival gaps.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use duet_engine::TextFrontend;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::arrival::Arrival;
use crate::backend::{BackendKind, PromptFormat, Target};
use crate::config::ServeConfig;
use crate::corpus::Corpus;
use crate::error::{BenchError, Result};
use crate::progress::Progress;
use crate::record::RequestRecord;
use crate::report::{Report, RunReport, Summary, SweepSummary, SCHEMA};
use crate::schedule::Schedule;
use crate::workload::{RequestSpec, Workload};

/// What is fixed across the runs of one invocation.
struct Prepared {
    target: Arc<Target>,
    corpus: Arc<Corpus>,
    text: Option<Arc<duet_engine::Tokenizer>>,
}

impl Prepared {
    fn workload(&self, cfg: &ServeConfig, seed: u64) -> Workload {
        cfg.workload(self.corpus.clone(), seed, self.text.clone())
    }
}

/// Runs every configured rate; `progress`: draw a progress bar (when stderr is a terminal).
pub async fn run(cfg: &ServeConfig, progress: bool) -> Result<Report> {
    cfg.validate()?;
    let front = TextFrontend::load(&cfg.tokenizer)?;
    let tokenizer = Arc::new(front.tokenizer);
    let corpus = Arc::new(Corpus::load(&tokenizer, cfg.corpus.as_deref())?);
    let text = (cfg.send.prompt_format == PromptFormat::Text).then(|| tokenizer.clone());
    let target = Target::connect(
        cfg.backend,
        &cfg.url,
        &cfg.endpoint,
        cfg.model_name.as_deref(),
        cfg.send.clone(),
    )
    .await?;
    let prepared = Prepared {
        target: Arc::new(target),
        corpus,
        text,
    };
    let started_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());

    if cfg.warmup > 0 {
        // A different seed: warm-up prompts are not the measured ones.
        let conc = cfg.max_concurrency.unwrap_or(1);
        let w = prepared.workload(cfg, cfg.seed.wrapping_add(1));
        let schedule = Schedule::new(w, Arrival::Immediate, cfg.seed, Some(cfg.warmup), None);
        let (records, _) = run_one(
            &prepared.target,
            schedule,
            Some(conc),
            None,
            &Progress::hidden(),
        )
        .await;
        let failed = records.iter().filter(|r| !r.ok()).count();
        if failed == records.len() {
            let why = records
                .iter()
                .find_map(|r| r.error.as_ref())
                .map_or_else(String::new, |e| format!("{}: {}", e.kind, e.message));
            return Err(BenchError::Target {
                url: cfg.url.clone(),
                reason: format!("every warm-up request failed ({why})"),
            });
        }
    }

    let mut runs = Vec::new();
    for (i, rate) in cfg.rates.iter().enumerate() {
        let arrival = Arrival::new(*rate, cfg.burstiness)?;
        let offered = arrival.rate();
        let w = prepared.workload(cfg, cfg.seed);
        let title = match rate {
            Some(r) => format!("{} rate {r} ({}/{})", cfg.label, i + 1, cfg.rates.len()),
            None => cfg.label.clone(),
        };
        let bar = if progress {
            Progress::new(cfg.num_prompts.map(|n| n as u64), &title)
        } else {
            Progress::hidden()
        };
        let schedule = Schedule::new(w, arrival, cfg.seed, cfg.num_prompts, cfg.duration);
        let (records, wall) = run_one(
            &prepared.target,
            schedule,
            cfg.max_concurrency,
            cfg.duration,
            &bar,
        )
        .await;
        bar.done();
        let summary = Summary::of(
            &records,
            wall.as_secs_f64(),
            offered,
            cfg.max_concurrency,
            cfg.slo.as_ref(),
        );
        runs.push(RunReport {
            summary,
            requests: records,
        });
    }
    let sweep = SweepSummary::of(&runs, cfg.slo.as_ref(), cfg.attainment_target);
    Ok(Report {
        schema: SCHEMA.to_string(),
        label: cfg.label.clone(),
        backend: match cfg.backend {
            BackendKind::Duet => "duet",
            BackendKind::Openai => "openai",
        }
        .to_string(),
        url: cfg.url.clone(),
        model: prepared.target.model_name().to_string(),
        started_unix_s,
        config: serde_json::to_value(cfg)?,
        runs,
        sweep,
    })
}

/// One run: its records (by index) and its wall time (first send until every response ended).
async fn run_one(
    target: &Arc<Target>,
    schedule: Schedule,
    max_concurrency: Option<usize>,
    duration: Option<Duration>,
    progress: &Progress,
) -> (Vec<RequestRecord>, Duration) {
    let permits = Arc::new(Semaphore::new(
        max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let mut sent = 0usize;
    for (due_s, unit) in schedule {
        tokio::time::sleep_until((start + Duration::from_secs_f64(due_s)).into()).await;
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        if duration.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
        let target = target.clone();
        let progress = progress.clone();
        let first_index = sent;
        let conversation = (unit.len() > 1).then_some(first_index);
        let scheduled_s = due_s;
        sent += unit.len();
        tasks.spawn(async move {
            let records = send_unit(
                &target,
                unit,
                first_index,
                conversation,
                start,
                scheduled_s,
                &progress,
            )
            .await;
            drop(permit);
            records
        });
    }
    let mut records = Vec::with_capacity(sent);
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(r) => records.extend(r),
            // A request task cannot panic short of a bug; keep the count honest anyway.
            Err(e) => records.push(RequestRecord::new(
                records.len(),
                start,
                0.0,
                0,
                0,
                crate::record::Timeline::start(),
                Some(crate::record::RequestError::new("internal", e.to_string())),
            )),
        }
    }
    let wall = start.elapsed();
    records.sort_by_key(|r| r.index);
    (records, wall)
}

/// Sends one unit of work (a request, or a conversation's turns in order) and records it.
/// Turns after a failed one are recorded as not sent (they never reach the server).
async fn send_unit(
    target: &Target,
    unit: Vec<RequestSpec>,
    first_index: usize,
    conversation: Option<usize>,
    start: Instant,
    scheduled_s: f64,
    progress: &Progress,
) -> Vec<RequestRecord> {
    let mut records = Vec::with_capacity(unit.len());
    let mut failed = false;
    for (turn, spec) in unit.iter().enumerate() {
        progress.started();
        let (timeline, error) = match failed {
            false => target.send(spec).await,
            true => (
                crate::record::Timeline::start(),
                Some(crate::record::RequestError::new(
                    "not_sent",
                    "an earlier turn of the conversation failed",
                )),
            ),
        };
        let mut r = RequestRecord::new(
            first_index + turn,
            start,
            scheduled_s,
            spec.prompt_ids.len(),
            spec.output_len,
            timeline,
            error,
        );
        if conversation.is_some() {
            r.conversation = conversation;
            r.turn = Some(turn);
        }
        failed |= !r.ok();
        progress.finished(r.ok());
        records.push(r);
    }
    records
}
