//! [`decide`]'s rules, one table row each: the cluster, the request and the policy in, the
//! kind, the reason and the pairs to try out.

use duet_discovery::{Capacity, Role, Snapshot, WorkerRecord};

use super::*;

fn worker(role: Role, id: &str, fingerprint: &str, free: u64, load: u32) -> WorkerRecord {
    let mut w = WorkerRecord::new("c", role, id, format!("http://127.0.0.1:1/{id}"));
    w.model = "m".into();
    w.fingerprint = fingerprint.into();
    w.capacity = Capacity {
        kv_blocks_total: 100,
        kv_blocks_free: free,
        block_size: 16,
        running: load,
        ..Capacity::default()
    };
    w
}

fn decode(id: &str) -> WorkerRecord {
    worker(Role::Decode, id, "f", 100, 0)
}

fn prefill(id: &str) -> WorkerRecord {
    worker(Role::Prefill, id, "f", 100, 0)
}

fn snap(ws: &[WorkerRecord]) -> Snapshot {
    Snapshot {
        workers: ws.iter().map(|w| (w.key(), w.clone())).collect(),
        revision: 1,
        stale: false,
        stale_since: None,
        lost_at: Default::default(),
    }
}

fn policy(mode: Mode) -> Policy {
    Policy {
        mode,
        model: "m".into(),
        local_prefill_max_tokens: 32,
        decode_headroom_tokens: 64,
        decode_seq_cost_tokens: 256,
    }
}

/// A cached prefix per worker id.
struct Cached(&'static [(&'static str, usize)]);

impl CachedTokens for Cached {
    fn cached_tokens(&self, w: &WorkerRecord) -> usize {
        self.0.iter().find(|(id, _)| *id == w.id).map_or(0, |c| c.1)
    }
}

/// One row: what goes in, and the (kind, reason fragment, [(decode, prefill)]) expected.
struct Row {
    name: &'static str,
    workers: Vec<WorkerRecord>,
    load: RouterLoad,
    cached: Cached,
    mode: Mode,
    prompt: usize,
    resumed: usize,
    kind: Kind,
    reason: &'static str,
    pairs: &'static [(&'static str, Option<&'static str>)],
}

impl Default for Row {
    fn default() -> Self {
        Row {
            name: "",
            workers: vec![decode("d1"), prefill("p1")],
            load: RouterLoad::default(),
            cached: Cached(&[]),
            mode: Mode::Disaggregated,
            prompt: 100,
            resumed: 0,
            kind: Kind::Remote,
            reason: "",
            pairs: &[],
        }
    }
}

fn links(pairs: &[(&str, &str)]) -> std::collections::HashSet<(String, String)> {
    pairs
        .iter()
        .map(|(p, d)| (p.to_string(), d.to_string()))
        .collect()
}

fn ids(v: &[&str]) -> std::collections::HashSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn every_rule_decides_as_its_row_says() {
    let rows = vec![
        Row {
            name: "a long prompt is prefilled remotely",
            reason: "prompt of 100 tokens prefilled remotely",
            pairs: &[("d1", Some("p1"))],
            ..Row::default()
        },
        Row {
            name: "a short prompt is prefilled on the decode worker",
            prompt: 32,
            kind: Kind::Local,
            reason: "prompt of 32 tokens <= local prefill limit 32",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "a prefix cached on the decode worker leaves a short prompt",
            cached: Cached(&[("d1", 80)]),
            kind: Kind::Local,
            reason: "80 cached on the decode worker: 20 to prefill <= local prefill limit 32",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "colocated mode never disaggregates",
            mode: Mode::Colocated,
            prompt: 1000,
            kind: Kind::Colocated,
            reason: "colocated mode",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "a migrated stream is replayed on its decode worker",
            resumed: 7,
            kind: Kind::Local,
            reason: "migrated stream: 7 sent tokens replayed",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "no prefill worker with the decode worker's model fingerprint",
            workers: vec![decode("d1"), worker(Role::Prefill, "p1", "g", 100, 0)],
            kind: Kind::Local,
            reason: "no prefill worker with the decode worker's model",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "a draining prefill worker is not used",
            workers: vec![decode("d1"), {
                let mut p = prefill("p1");
                p.draining = true;
                p
            }],
            kind: Kind::Local,
            reason: "no prefill worker",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "decode workers by load; prefill workers by queued tokens",
            workers: vec![
                worker(Role::Decode, "d1", "f", 100, 3),
                decode("d2"),
                prefill("p1"),
                {
                    let mut p = prefill("p2");
                    p.capacity.queued_prefill_tokens = 500;
                    p
                },
            ],
            pairs: &[("d2", Some("p1")), ("d1", Some("p1"))],
            reason: "remotely",
            ..Row::default()
        },
        Row {
            name: "the router's own in-flight counts outweigh stale records",
            workers: vec![decode("d1"), decode("d2"), prefill("p1"), prefill("p2")],
            load: RouterLoad {
                decode_inflight: InFlight::from([("d1".to_string(), 2)]),
                prefill_tokens: HashMap::from([("p1".to_string(), 1000)]),
                ..RouterLoad::default()
            },
            pairs: &[("d2", Some("p2")), ("d1", Some("p2"))],
            reason: "remotely",
            ..Row::default()
        },
        Row {
            name: "a full decode worker is skipped",
            workers: vec![
                worker(Role::Decode, "d1", "f", 3, 0),
                decode("d2"),
                prefill("p1"),
            ],
            pairs: &[("d2", Some("p1"))],
            reason: "remotely",
            ..Row::default()
        },
        Row {
            name: "KV-aware: the prefill worker holding the prefix wins",
            workers: vec![decode("d1"), prefill("p1"), prefill("p2")],
            cached: Cached(&[("p2", 64)]),
            pairs: &[("d1", Some("p2"))],
            reason: "remotely",
            ..Row::default()
        },
        Row {
            name: "suspects go last, decode and prefill alike",
            workers: vec![decode("d1"), decode("d2"), prefill("p1"), prefill("p2")],
            load: RouterLoad {
                suspects: ids(&["d1", "p1"]),
                ..RouterLoad::default()
            },
            pairs: &[("d2", Some("p2")), ("d1", Some("p2"))],
            reason: "remotely",
            ..Row::default()
        },
        Row {
            name: "a failed KV link avoids that pair only",
            workers: vec![decode("d1"), decode("d2"), prefill("p1"), prefill("p2")],
            load: RouterLoad {
                bad_links: links(&[("p1", "d1"), ("p2", "d1"), ("p1", "d2")]),
                ..RouterLoad::default()
            },
            pairs: &[("d2", Some("p2"))],
            reason: "remotely",
            ..Row::default()
        },
        Row {
            name: "every link failed: prefilled locally",
            load: RouterLoad {
                bad_links: links(&[("p1", "d1")]),
                ..RouterLoad::default()
            },
            kind: Kind::Local,
            reason: "KV links from the prefill workers to the decode workers failed",
            pairs: &[("d1", None)],
            ..Row::default()
        },
        Row {
            name: "prefill workers pair with their decode worker's fingerprint",
            workers: vec![
                decode("d1"),
                worker(Role::Decode, "d2", "g", 100, 1),
                prefill("p1"),
                worker(Role::Prefill, "p2", "g", 100, 0),
            ],
            pairs: &[("d1", Some("p1")), ("d2", Some("p2"))],
            reason: "remotely",
            ..Row::default()
        },
    ];
    for row in rows {
        let s = snap(&row.workers);
        let view = RouterView {
            snapshot: &s,
            load: &row.load,
            cached: &row.cached,
        };
        let req = Request {
            prompt_tokens: row.prompt,
            resumed_tokens: row.resumed,
        };
        let Decision::Place(p) = decide(&view, &req, &policy(row.mode)) else {
            panic!("{}: not placed", row.name);
        };
        assert_eq!(p.kind, row.kind, "{}", row.name);
        assert!(p.reason.contains(row.reason), "{}: {}", row.name, p.reason);
        let got: Vec<(&str, Option<&str>)> = p
            .candidates
            .iter()
            .map(|c| {
                (
                    c.decode.id.as_str(),
                    c.prefill.as_ref().map(|w| w.id.as_str()),
                )
            })
            .collect();
        assert_eq!(got, row.pairs, "{}", row.name);
        for c in &p.candidates {
            if let Some(pw) = &c.prefill {
                assert_eq!(pw.fingerprint, c.decode.fingerprint, "{}", row.name);
            }
        }
    }
}

#[test]
fn the_candidate_carries_the_prefix_its_prefilling_worker_holds() {
    let s = snap(&[decode("d1"), prefill("p1")]);
    let load = RouterLoad::default();
    let cached = Cached(&[("d1", 16), ("p1", 48)]);
    let view = RouterView {
        snapshot: &s,
        load: &load,
        cached: &cached,
    };
    let req = Request {
        prompt_tokens: 200,
        resumed_tokens: 0,
    };
    let Decision::Place(p) = decide(&view, &req, &policy(Mode::Disaggregated)) else {
        panic!("not placed");
    };
    assert_eq!(p.candidates[0].cached_tokens, 48, "the prefill worker's");
    let Decision::Place(p) = decide(&view, &req, &policy(Mode::Colocated)) else {
        panic!("not placed");
    };
    assert_eq!(p.candidates[0].cached_tokens, 16, "the decode worker's");
}

#[test]
fn without_room_it_waits_and_names_the_largest_pool() {
    let full = worker(Role::Decode, "d1", "f", 0, 0);
    let mut other_model = decode("d2");
    other_model.model = "other".into();
    let s = snap(&[full, other_model, prefill("p1")]);
    let load = RouterLoad::default();
    let view = RouterView {
        snapshot: &s,
        load: &load,
        cached: &NoCache,
    };
    let req = Request {
        prompt_tokens: 10,
        resumed_tokens: 0,
    };
    assert_eq!(
        decide(&view, &req, &policy(Mode::Disaggregated)),
        Decision::Wait {
            largest_pool_tokens: Some(1600)
        }
    );
    let empty = snap(&[]);
    let view = RouterView {
        snapshot: &empty,
        ..view
    };
    assert_eq!(
        decide(&view, &req, &policy(Mode::Disaggregated)),
        Decision::Wait {
            largest_pool_tokens: None
        }
    );
}

#[test]
fn a_placement_lists_the_cheapest_sixteen_of_a_large_cluster() {
    // 40 decode workers, worker i running i sequences; 3 prefill workers, one of another
    // fingerprint, one loaded.
    let mut ws: Vec<WorkerRecord> = (0..40)
        .map(|i| worker(Role::Decode, &format!("d{i:02}"), "f", 100, i))
        .collect();
    ws.push(prefill("p1"));
    ws.push(worker(Role::Prefill, "p2", "g", 100, 0));
    let mut busy = prefill("p3");
    busy.capacity.queued_prefill_tokens = 10_000;
    ws.push(busy);
    let s = snap(&ws);
    // A 100-token prompt placed on `s` with `load`.
    let place = |load: &RouterLoad| {
        let view = RouterView {
            snapshot: &s,
            load,
            cached: &NoCache,
        };
        let req = Request {
            prompt_tokens: 100,
            resumed_tokens: 0,
        };
        match decide(&view, &req, &policy(Mode::Disaggregated)) {
            Decision::Place(p) => p,
            other => panic!("not placed: {other:?}"),
        }
    };
    let p = place(&RouterLoad::default());
    assert_eq!(p.candidates.len(), MAX_CANDIDATES);
    let decoders: Vec<&str> = p.candidates.iter().map(|c| c.decode.id.as_str()).collect();
    let cheapest: Vec<String> = (0..16).map(|i| format!("d{i:02}")).collect();
    assert_eq!(decoders, cheapest, "the least loaded, in order");
    // One ranking for the fingerprint: the idle prefill worker of the same fingerprint.
    assert!(p
        .candidates
        .iter()
        .all(|c| c.prefill.as_ref().map(|w| w.id.as_str()) == Some("p1")));
    // A bad link skips only that pair's prefill worker.
    let p = place(&RouterLoad {
        bad_links: [("p1".to_string(), "d00".to_string())].into(),
        ..RouterLoad::default()
    });
    let pair = |i: usize| {
        let c = &p.candidates[i];
        (
            c.decode.id.clone(),
            c.prefill.as_ref().map(|w| w.id.clone()),
        )
    };
    assert_eq!(pair(0), ("d00".into(), Some("p3".into())));
    assert_eq!(pair(1), ("d01".into(), Some("p1".into())));
}

#[test]
fn a_prompt_of_exactly_a_pools_size_never_fits_it() {
    // Room for the prompt and its first generated token.
    assert!(never_fits(1600, 1600));
    assert!(!never_fits(1599, 1600));
    assert!(never_fits(5000, 1600));
}
