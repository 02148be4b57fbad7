//! The simulator against hand-computed timelines on the example profile (prefill 1 ms per
//! token from 100 tokens, decode steps 10 ms + 1 ms per sequence, 1 GB/s links with 1 ms
//! latency, 1 ms router overhead, 1000 KV bytes per token, 10 layers, 16-token blocks).

use duet_router::config::Mode;
use proptest::prelude::*;

use super::*;
use crate::profile::tests::{example, example_file};

pub(crate) fn spec(mode: Mode, p: usize, d: usize) -> ClusterSpec {
    ClusterSpec {
        mode,
        prefill_workers: p,
        decode_workers: d,
        local_prefill_max_tokens: 32,
        decode_headroom_tokens: 64,
        decode_seq_cost_tokens: 256,
        kv_routing: true,
        prefix_cache: true,
        max_batch: 64,
        prefill_chunk_tokens: 256,
        max_batch_tokens: 2048,
        admit_watermark_blocks: 4,
        max_waiting: 256,
        max_queue_wait_s: 30.0,
        workers_per_host: 1,
        link: example().file.links[0].clone(),
    }
}

fn req(prompt: usize, output: usize, salt: u32) -> SimRequest {
    let ids: Vec<u32> = (0..prompt as u32).map(|i| i * 7 + salt * 100_003).collect();
    SimRequest {
        prompt_len: prompt,
        output_len: output,
        hashes: cache::block_hashes(&ids, 16),
    }
}

fn unit(due_s: f64, r: SimRequest) -> Unit {
    Unit {
        due_s,
        turns: vec![r],
    }
}

fn run(spec: ClusterSpec, units: Vec<Unit>) -> Outcome {
    let p = example();
    Sim::new(&p, spec).run(units.into_iter(), None, None)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn a_remote_prefill_pays_router_prefill_exposed_transfer_then_one_step_per_token() {
    let out = run(
        spec(Mode::Disaggregated, 1, 1),
        vec![unit(0.0, req(100, 5, 1))],
    );
    let r = &out.records[0];
    assert!(r.ok(), "{:?}", r.error);
    assert_eq!(r.placement.as_deref(), Some("remote"));
    // 1 ms router + 100 ms prefill + 1 ms latency + one layer of 100 kB at 1 GB/s.
    let ttft = 0.001 + 0.1 + 0.001 + 100.0 * 1000.0 / 10.0 / 1e9;
    assert!(close(r.ttft_s.unwrap(), ttft), "{:?}", r.ttft_s);
    assert_eq!(r.output_tokens, 5);
    assert_eq!(r.itl_s.len(), 4);
    assert!(r.itl_s.iter().all(|&g| close(g, 0.011)), "{:?}", r.itl_s);
    assert!(close(r.tpot_s.unwrap(), 0.011));
    assert!(close(r.e2e_s.unwrap(), ttft + 4.0 * 0.011));
}

#[test]
fn short_prompts_are_prefilled_on_the_decode_worker() {
    let out = run(
        spec(Mode::Disaggregated, 1, 1),
        vec![unit(0.0, req(20, 2, 1))],
    );
    let r = &out.records[0];
    assert_eq!(r.placement.as_deref(), Some("local"));
    // The table's smallest cost bounds prefill below its first point (100 ms).
    assert!(close(r.ttft_s.unwrap(), 0.001 + 0.1), "{:?}", r.ttft_s);
    assert!(close(r.itl_s[0], 0.011));
}

#[test]
fn colocated_steps_mix_a_prompt_chunk_into_running_decodes() {
    // The second prompt arrives while the first decodes: its 200 tokens ride in one step
    // with the running sequence (11 ms + 200 ms - 11 ms fixed part = 200 ms).
    let out = run(
        spec(Mode::Colocated, 0, 1),
        vec![unit(0.0, req(100, 30, 1)), unit(0.15, req(200, 3, 2))],
    );
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!(a.placement.as_deref(), Some("colocated"));
    assert!(a.ok() && b.ok());
    assert!(
        a.itl_s.iter().any(|&g| close(g, 0.2)),
        "one of the first request's gaps is the mixed step: {:?}",
        a.itl_s
    );
    // Once both decode: 12 ms steps.
    assert!(b.itl_s.iter().all(|&g| close(g, 0.012)), "{:?}", b.itl_s);
}

#[test]
fn a_remote_prefill_placed_during_a_local_forward_starts_after_it() {
    // The decode worker prefills 200 tokens locally (200 ms from 1 ms); a remote prompt
    // placed meanwhile is reserved (and sent to the prefill worker) only after that
    // forward, as the worker's engine thread takes commands between iterations.
    let mut s = spec(Mode::Disaggregated, 1, 1);
    s.local_prefill_max_tokens = 300;
    let out = run(
        s,
        vec![unit(0.0, req(200, 2, 1)), unit(0.05, req(500, 2, 2))],
    );
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!(a.placement.as_deref(), Some("local"));
    assert_eq!(b.placement.as_deref(), Some("remote"));
    let local_done = 0.001 + 0.2;
    let ttft = local_done + 0.5 + 0.001 + 500.0 * 1000.0 / 10.0 / 1e9 - 0.05;
    assert!(close(b.ttft_s.unwrap(), ttft), "{:?} vs {ttft}", b.ttft_s);
}

#[test]
fn workers_sharing_a_host_slow_each_other() {
    let units = || {
        vec![
            unit(0.0, req(100, 40, 1)),
            // Prefilled while the first one decodes.
            unit(0.2, req(1000, 2, 2)),
        ]
    };
    let alone = run(spec(Mode::Disaggregated, 1, 1), units());
    let mut shared = spec(Mode::Disaggregated, 1, 1);
    shared.workers_per_host = 2;
    let shared = run(shared, units());
    let ttft = |o: &Outcome| o.records[1].ttft_s.unwrap();
    // Alone: about 1 s of prefill; shared with a decoding worker: the overlap runs at half
    // speed.
    assert!(ttft(&alone) < 1.02, "{}", ttft(&alone));
    assert!(
        ttft(&shared) > ttft(&alone) + 0.15,
        "{} vs {}",
        ttft(&shared),
        ttft(&alone)
    );
    assert!(shared.records[0].tpot_s.unwrap() > alone.records[0].tpot_s.unwrap());
}

#[test]
fn a_prompt_larger_than_any_pool_fails_and_a_full_pool_queues() {
    let mut f = example_file();
    f.kv_pool_blocks = 20; // 320 tokens
    let p = Profile::new("small", f).unwrap();
    let s = spec(Mode::Disaggregated, 1, 1);
    let out = Sim::new(&p, s.clone()).run(vec![unit(0.0, req(400, 2, 1))].into_iter(), None, None);
    let e = out.records[0].error.as_ref().unwrap();
    assert_eq!(e.kind, "grpc:RESOURCE_EXHAUSTED");
    // Two 200-token prompts: the second waits for the first's blocks, then completes.
    let out = Sim::new(&p, s).run(
        vec![unit(0.0, req(200, 3, 1)), unit(0.0, req(200, 3, 2))].into_iter(),
        None,
        None,
    );
    assert!(out.records.iter().all(|r| r.ok()));
    let (a, b) = (&out.records[0], &out.records[1]);
    assert!(
        b.ttft_s.unwrap() > a.e2e_s.unwrap(),
        "the second waited for the first"
    );
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache() {
    let out = run(
        spec(Mode::Disaggregated, 1, 1),
        vec![unit(0.0, req(1000, 2, 1)), unit(5.0, req(1000, 2, 1))],
    );
    let (a, b) = (&out.records[0], &out.records[1]);
    assert_eq!(a.cached_tokens, Some(0));
    // Everything but the last (partial) block: 62 blocks of 16.
    assert_eq!(b.cached_tokens, Some(992));
    assert!(b.ttft_s.unwrap() < a.ttft_s.unwrap() / 2.0);
}

#[test]
fn concurrency_caps_and_conversations_follow_the_load_generator() {
    let conv = Unit {
        due_s: 0.0,
        turns: vec![req(100, 3, 1), req(200, 3, 1)],
    };
    let p = example();
    let out = Sim::new(&p, spec(Mode::Disaggregated, 1, 1)).run(
        vec![conv, unit(0.0, req(100, 3, 2))].into_iter(),
        Some(1),
        None,
    );
    let r = &out.records;
    assert_eq!(r.len(), 3);
    // Turn 2 is sent when turn 1 ended; the other unit when the conversation ended.
    assert!(close(r[1].arrival_s, r[0].arrival_s + r[0].e2e_s.unwrap()));
    assert!(close(r[2].arrival_s, r[1].arrival_s + r[1].e2e_s.unwrap()));
    assert_eq!((r[0].conversation, r[1].turn), (Some(0), Some(1)));
    assert_eq!(r[2].conversation, None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the load and the pool, every request ends with its whole output (or a
    /// resource error), and every block is free at the end.
    #[test]
    fn every_request_ends_and_no_block_is_stranded(
        reqs in prop::collection::vec((1usize..600, 1usize..40, 0.0f64..3.0, 0u32..4), 1..30),
        colocated in any::<bool>(),
        pool in 8u64..200,
        shared in 1usize..3,
    ) {
        let mut f = example_file();
        f.kv_pool_blocks = pool;
        let p = Profile::new("t", f).unwrap();
        let mut s = spec(if colocated { Mode::Colocated } else { Mode::Disaggregated }, 1, 2);
        s.workers_per_host = shared;
        s.max_queue_wait_s = 1e9;
        let mut reqs = reqs;
        reqs.sort_by(|a, b| a.2.total_cmp(&b.2));
        let units: Vec<Unit> = reqs
            .iter()
            .map(|&(i, o, t, salt)| unit(t, req(i, o, salt)))
            .collect();
        let mut sim = Sim::new(&p, s);
        sim.schedule = Box::new(units.into_iter());
        sim.pull_unit();
        while let Some(Timed { t, ev, .. }) = sim.events.pop() {
            prop_assert!(t >= sim.now - 1e-12);
            sim.now = sim.now.max(t);
            match ev {
                Ev::UnitDue(u) => sim.unit_due(u),
                Ev::Place(r) => sim.place(r),
                Ev::WorkDone(w, e) => sim.work_done(w, e),
                Ev::KvArrived(r) => sim.kv_arrived(r),
                Ev::RetryPending => sim.retry_pending(),
            }
            for d in &sim.decode {
                prop_assert_eq!(d.accounted(), pool as usize);
            }
        }
        for d in &sim.decode {
            let (free, total) = d.free_blocks();
            prop_assert_eq!(free, total);
        }
        let out = sim.finish();
        prop_assert_eq!(out.records.len(), reqs.len());
        for (r, &(i, o, _, _)) in out.records.iter().zip(&reqs) {
            match &r.error {
                None => prop_assert_eq!(r.output_tokens, o),
                Some(e) => {
                    prop_assert_eq!(e.kind.as_str(), "grpc:RESOURCE_EXHAUSTED");
                    prop_assert!(i + 1 > (pool as usize) * 16 || i + o > (pool as usize) * 16);
                }
            }
        }
    }
}
