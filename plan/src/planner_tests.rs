//! The planner's decisions on the example profile (prefill 1 ms per token from 100
//! tokens, decode steps 10 ms + 1 ms per sequence), from observed windows built by hand.

use duet_router::config::Mode;

use super::*;
use crate::profile::tests::example;
use crate::sim::tests::spec;

fn worker(id: &str, role: Role, load: f64) -> WorkerView {
    WorkerView {
        id: id.into(),
        role,
        switchable: true,
        draining: false,
        load,
    }
}

/// `n` requests every `every_ms`, all met by the clients.
fn window(n: usize, every_ms: u64, prompt: u32, output: u32) -> Vec<ObservedRequest> {
    (0..n as u64)
        .map(|i| ObservedRequest {
            arrival_ms: 1_000_000 + i * every_ms,
            prompt_tokens: prompt,
            output_tokens: output,
            ttft_ms: Some(100.0),
            tpot_ms: Some(10.0),
            ok: true,
        })
        .collect()
}

fn config(slo: &str) -> PlannerConfig {
    PlannerConfig {
        slo: Slo::parse(slo).unwrap(),
        dwell: Duration::from_secs(30),
        ..PlannerConfig::default()
    }
}

fn obs(now_s: f64, workers: &[WorkerView], requests: &[ObservedRequest]) -> Observation {
    Observation {
        now_s,
        workers: workers.to_vec(),
        requests: requests.to_vec(),
    }
}

/// Long prompts (2,000 tokens: 2 s of prefill) every 1.2 s: one prefill worker falls
/// behind, two keep up.
fn long_prompts() -> Vec<ObservedRequest> {
    window(50, 1200, 2000, 4)
}

/// Short prompts and 200-token answers at 4 per second: one decode worker runs ~40
/// sequences (50 ms steps), two run ~7 each (17 ms).
fn long_answers() -> Vec<ObservedRequest> {
    window(240, 250, 100, 200)
}

#[test]
fn a_burst_of_long_prompts_moves_the_least_loaded_decode_worker_to_prefill_once_confirmed() {
    let profile = example();
    let mut p = Planner::new(
        &profile,
        spec(Mode::Disaggregated, 1, 2),
        config("ttft=3000"),
    );
    let workers = [
        worker("p0", Role::Prefill, 0.0),
        worker("d0", Role::Decode, 3.0),
        worker("d1", Role::Decode, 1.0),
    ];
    let reqs = long_prompts();
    let first = p.evaluate(&obs(0.0, &workers, &reqs));
    assert_eq!(first.layouts[0].prefill, 1);
    assert!(first.layouts[0].attainment < 0.9, "{:?}", first.layouts);
    let two = first.layouts.iter().find(|l| l.prefill == 2).unwrap();
    assert!(two.attainment >= 0.9, "{:?}", first.layouts);
    // confirm = 2: the first choice waits, the second acts.
    assert!(
        matches!(first.decision, Decision::Wait(_)),
        "{:?}",
        first.decision
    );
    let second = p.evaluate(&obs(5.0, &workers, &reqs));
    assert_eq!(
        second.decision,
        Decision::Switch {
            worker: "d1".into(),
            from: Role::Decode,
            to: Role::Prefill
        }
    );
    // While d1 has not registered as prefill, nothing else is decided.
    let mid = [workers[0].clone(), workers[1].clone()];
    assert!(matches!(
        p.evaluate(&obs(10.0, &mid, &reqs)).decision,
        Decision::Wait(ref why) if why.contains("d1")
    ));
    // Once it has, 2P+1D is the layout and it stays.
    let after = [
        workers[0].clone(),
        workers[1].clone(),
        worker("d1", Role::Prefill, 0.0),
    ];
    let e = p.evaluate(&obs(15.0, &after, &reqs));
    assert_eq!((e.layouts[0].prefill, e.layouts[0].decode), (2, 1));
    assert_eq!(e.decision, Decision::Keep);
}

#[test]
fn long_answers_move_a_prefill_worker_back_but_not_within_the_dwell_time() {
    let profile = example();
    let mut p = Planner::new(
        &profile,
        spec(Mode::Disaggregated, 2, 1),
        config("ttft=3000,tpot=40"),
    );
    let workers = [
        worker("p0", Role::Prefill, 0.0),
        worker("d1", Role::Prefill, 0.0),
        worker("d0", Role::Decode, 30.0),
    ];
    let reqs = long_answers();
    // A switch just happened (the previous test's): the dwell time holds the next one.
    p.last_switch_s = Some(0.0);
    assert!(matches!(
        p.evaluate(&obs(1.0, &workers, &reqs)).decision,
        Decision::Wait(_)
    ));
    let e = p.evaluate(&obs(2.0, &workers, &reqs));
    assert!(
        matches!(e.decision, Decision::Wait(ref why) if why.contains("dwell")),
        "{:?}",
        e.decision
    );
    assert!(e.layouts[0].attainment < 0.9, "{:?}", e.layouts);
    let e = p.evaluate(&obs(31.0, &workers, &reqs));
    assert_eq!(
        e.decision,
        Decision::Switch {
            worker: "d1".into(),
            from: Role::Prefill,
            to: Role::Decode
        }
    );
}

#[test]
fn no_switch_without_enough_requests_a_switchable_worker_or_a_better_layout() {
    let profile = example();
    let cfg = config("ttft=3000");
    let workers = [
        worker("p0", Role::Prefill, 0.0),
        worker("d0", Role::Decode, 0.0),
        worker("d1", Role::Decode, 0.0),
    ];
    let mut p = Planner::new(&profile, spec(Mode::Disaggregated, 1, 2), cfg.clone());
    let few = &long_prompts()[..5];
    assert_eq!(
        p.evaluate(&obs(0.0, &workers, few)).decision,
        Decision::NoData
    );
    // Decode workers that cannot switch are never moved.
    let fixed: Vec<WorkerView> = workers
        .iter()
        .map(|w| WorkerView {
            switchable: w.role == Role::Prefill,
            ..w.clone()
        })
        .collect();
    for t in 0..3 {
        let e = p.evaluate(&obs(t as f64, &fixed, &long_prompts()));
        assert_eq!(e.decision, Decision::Keep);
        assert_eq!(
            e.layouts.len(),
            1,
            "no candidate: p0 is the last prefill worker"
        );
    }
    // A light load both layouts serve well: the current one stays.
    let light = window(20, 10_000, 200, 4);
    let e = p.evaluate(&obs(100.0, &workers, &light));
    assert!(
        e.layouts.iter().all(|l| l.attainment >= 0.9),
        "{:?}",
        e.layouts
    );
    assert_eq!(e.decision, Decision::Keep, "{:?}", e.layouts);
}

#[test]
fn observed_attainment_counts_failures_and_bounds() {
    let slo = Slo::parse("ttft=200,tpot=20").unwrap();
    let mut reqs = window(4, 100, 10, 10);
    reqs[1].ttft_ms = Some(250.0);
    reqs[2].ok = false;
    reqs[3].tpot_ms = None; // one token: TPOT does not apply
    assert_eq!(observed_attainment(&slo, &reqs), Some(0.5));
    assert_eq!(observed_attainment(&slo, &[]), None);
}

#[test]
fn the_replay_keeps_arrival_gaps_and_a_faster_rate_repeats_it_over_the_same_span() {
    let reqs = window(3, 500, 10, 0);
    let units = replay(&reqs);
    let due: Vec<f64> = units.iter().map(|u| u.due_s).collect();
    assert_eq!(due, vec![0.0, 0.5, 1.0]);
    assert_eq!(units[0].turns[0].output_len, 1);
    assert_eq!(at_rate(&units, 1.0).len(), 3);
    // Twice the rate: a request every 0.25 s over the same second.
    let twice = at_rate(&units, 2.0);
    let due: Vec<f64> = twice.iter().map(|u| u.due_s).collect();
    assert_eq!(due, vec![0.0, 0.25, 0.5, 0.75, 1.0]);
    assert!(due.windows(2).all(|w| w[0] < w[1]), "{due:?}");
    assert!(due.iter().all(|&d| d <= 1.0), "{due:?}");
    assert_eq!(at_rate(&units, 16.0).len(), 33);
}
