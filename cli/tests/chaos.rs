//! Chaos on the default configuration: a router, two prefill and two decode workers as
//! separate processes on etcd, KV over shared memory (same host), prefix cache on, and
//! concurrent clients on both doors (gRPC streams and OpenAI SSE streams). One fault at a
//! time, under load:
//!
//! 1. a decode worker killed (SIGKILL) mid-stream, then restarted;
//! 2. a decode worker hung (SIGSTOP) mid-stream, then thawed;
//! 3. a prefill worker killed mid-prefill, then restarted;
//! 4. a prefill worker hung mid-prefill, then thawed;
//! 5. etcd down for 8 s;
//! 6. a cancel storm: 24 streams dropped at random points beside the clients.
//!
//! Per fault, what a user observes: no request fails, every client's text (and, over gRPC,
//! token ids) equals an undisturbed run of the same prompts, and afterwards every KV block
//! is free on every decode worker and the router holds nothing. The only settings changed
//! are the hang detectors (`--stream-stall-timeout 3s`, `--prefill-timeout 20s`: above the
//! longest queue and prefill here; their defaults, 30 s and 120 s, would only make the test
//! slower) and the workers' lease.
//! The figures it prints are in docs/cluster.md.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use rand::{Rng, SeedableRng};
use support::{client, greedy, text, Cluster, Proc};

/// Tokens each client asks for.
const TOKENS: u32 = 24;
/// Words of the prompts of the prefill faults (about 200 tokens each): long enough to be
/// caught mid-prefill, short enough that all six prompts retried onto one prefill worker,
/// which shares two cores with four other processes, finish well within
/// [`PREFILL_TIMEOUT`] (250-word prompts with a 15 s timeout did not, in two runs of four).
const PREFILL_WORDS: usize = 100;
/// `--prefill-timeout`: how long a hung prefill worker takes to be given up.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(20);
/// gRPC clients, then SSE clients, per phase.
const GRPC_CLIENTS: usize = 4;
const SSE_CLIENTS: usize = 2;

fn rt() -> tokio::runtime::Runtime {
    support::runtime()
}

/// What one client received: token ids (gRPC only) and the text, as the client assembles it.
#[derive(Debug, Clone, PartialEq)]
struct Got {
    ids: Option<Vec<u32>>,
    text: String,
}

/// Prompt `i` of phase `phase`: distinct from every other (no shared cached prefix), and
/// `words` long (above the local-prefill limit, so prefills are remote).
fn prompt(phase: &str, i: usize, words: usize) -> String {
    let vocab = [
        "harbour", "lantern", "granite", "orchard", "meadow", "copper", "violin", "glacier",
        "thistle", "saffron", "beacon", "quarry", "willow", "falcon", "cinder", "marble",
    ];
    let mut r = rand::rngs::StdRng::seed_from_u64(
        phase
            .bytes()
            .fold(i as u64 * 7919, |h, b| h.wrapping_mul(31) ^ u64::from(b)),
    );
    let mut s = format!("Story {phase} {i}:");
    for _ in 0..words {
        s.push(' ');
        s.push_str(vocab[r.random_range(0..vocab.len())]);
    }
    s
}

async fn grpc_request(url: &str, prompt: &str) -> Result<Got, String> {
    let mut c = client(url).await;
    let req = pb::GenerateRequest {
        ignore_eos: true,
        ..greedy(text(prompt), TOKENS)
    };
    let done = support::generate(&mut c, req)
        .await
        .map_err(|s| format!("grpc: {s:?}"))?;
    Ok(Got {
        ids: Some(done.ids),
        text: done.text,
    })
}

/// One OpenAI streaming completion over SSE: the concatenated text deltas.
fn sse_request(http: &str, prompt: &str) -> Result<Got, String> {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": true,
        "temperature": 0, "stream": true,
    })
    .to_string();
    let r = support::http_raw(
        "POST",
        &format!("{http}/v1/completions"),
        &[("content-type", "application/json")],
        Some(body.as_bytes()),
    );
    if r.status != 200 {
        return Err(format!("sse: HTTP {}: {}", r.status, r.body));
    }
    let mut text = String::new();
    let mut done = false;
    for line in r.body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).map_err(|e| format!("sse: {e}: {data}"))?;
        if v.get("error").is_some() {
            return Err(format!("sse: {data}"));
        }
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
    }
    if !done {
        return Err(format!("sse: no [DONE]: {}", r.body));
    }
    Ok(Got { ids: None, text })
}

/// Runs every client of a phase at once; returns their results in client order.
async fn run_clients(
    url: &str,
    http: &str,
    prompts: &[String],
) -> Vec<tokio::task::JoinHandle<Result<Got, String>>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (url, http, p) = (url.to_string(), http.to_string(), p.clone());
            if i < GRPC_CLIENTS {
                tokio::spawn(async move { grpc_request(&url, &p).await })
            } else {
                tokio::spawn(async move {
                    tokio::task::spawn_blocking(move || sse_request(&http, &p))
                        .await
                        .map_err(|e| e.to_string())?
                })
            }
        })
        .collect()
}

async fn join(
    tasks: Vec<tokio::task::JoinHandle<Result<Got, String>>>,
) -> Vec<Result<Got, String>> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Err(format!("join: {e}"))));
    }
    out
}

/// The router's `/metrics`.
async fn scrape(http: &str) -> String {
    let http = http.to_string();
    tokio::task::spawn_blocking(move || support::http_get(&format!("{http}/metrics")).1)
        .await
        .expect("join")
}

async fn counter(http: &str, name: &str) -> f64 {
    support::scrape_sum(&scrape(http).await, name, &[])
}

/// Waits until `pred` holds for some worker status of `addrs`; returns that worker's index.
async fn busy_worker(addrs: &[String], decode: bool, within: Duration) -> usize {
    let end = Instant::now() + within;
    loop {
        for (i, a) in addrs.iter().enumerate() {
            let s = if decode {
                support::decode_status(a).await
            } else {
                support::prefill_status(a).await
            };
            if s.running > 0 {
                return i;
            }
        }
        assert!(Instant::now() < end, "no worker got busy within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One row of the report.
struct Row {
    fault: &'static str,
    requests: usize,
    failed: usize,
    migrations: f64,
    retries: f64,
    seconds: f64,
}

struct Chaos {
    cl: Cluster,
    http: String,
    env: Vec<(&'static str, &'static str)>,
    rows: Vec<Row>,
}

impl Chaos {
    fn decode_addrs(&self) -> Vec<String> {
        self.cl.decode.iter().map(Proc::workers_addr).collect()
    }

    fn prefill_addrs(&self) -> Vec<String> {
        self.cl.prefill.iter().map(Proc::workers_addr).collect()
    }

    /// A worker started again under its old id (a restart after a crash).
    fn restart(&mut self, role: &str, i: usize) {
        let id = format!("{role}-{i}");
        let p = Cluster::worker_with(&self.cl.etcd, &self.cl.cluster, role, &id, Some(&self.env));
        match role {
            "decode" => self.cl.decode[i] = p,
            _ => self.cl.prefill[i] = p,
        }
    }

    /// Runs the phase's clients with `fault` injected during them, then the same prompts
    /// undisturbed; checks text, ids, failures and freed blocks; records a row.
    async fn phase(
        &mut self,
        fault: &'static str,
        words: usize,
        inject: impl AsyncFnOnce(&mut Chaos),
    ) {
        let prompts: Vec<String> = (0..GRPC_CLIENTS + SSE_CLIENTS)
            .map(|i| prompt(fault, i, words))
            .collect();
        let (m0, r0) = (
            counter(&self.http, "duet_router_migrations_total").await,
            counter(&self.http, "duet_router_retries_total").await,
        );
        let t0 = Instant::now();
        let tasks = run_clients(&self.cl.url, &self.http, &prompts).await;
        inject(self).await;
        let got = join(tasks).await;
        let seconds = t0.elapsed().as_secs_f64();
        let failed: Vec<&String> = got.iter().filter_map(|r| r.as_ref().err()).collect();
        let (m1, r1) = (
            counter(&self.http, "duet_router_migrations_total").await,
            counter(&self.http, "duet_router_retries_total").await,
        );
        self.rows.push(Row {
            fault,
            requests: got.len(),
            failed: failed.len(),
            migrations: m1 - m0,
            retries: r1 - r0,
            seconds,
        });
        if !failed.is_empty() {
            for l in self.cl.router.log_lines() {
                eprintln!("router: {l}");
            }
        }
        assert!(failed.is_empty(), "{fault}: failed requests: {failed:?}");
        self.settle(fault).await;
        // The same prompts, undisturbed: what every client must have seen.
        let reference = join(run_clients(&self.cl.url, &self.http, &prompts).await).await;
        for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
            let (g, r) = (
                g.as_ref().expect("checked"),
                r.as_ref().expect("undisturbed run"),
            );
            assert_eq!(g.ids, r.ids, "{fault}: client {i}: token ids");
            assert_eq!(
                g.text, r.text,
                "{fault}: client {i}: text (nothing repeated or lost)"
            );
            if let Some(ids) = &g.ids {
                assert_eq!(ids.len(), TOKENS as usize, "{fault}: client {i}");
            }
        }
        self.settle(fault).await;
    }

    /// Every decode worker's pool empty and the router idle.
    async fn settle(&self, fault: &str) {
        self.cl.wait_workers(2, 2, Duration::from_secs(30)).await;
        for a in self.decode_addrs() {
            support::assert_pool_empty(&a, Duration::from_secs(20)).await;
        }
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            let m = scrape(&self.http).await;
            let busy = support::scrape_sum(&m, "duet_router_requests_in_flight", &[])
                + support::scrape_sum(&m, "duet_router_requests_queued", &[]);
            if busy == 0.0 {
                break;
            }
            assert!(
                Instant::now() < end,
                "{fault}: the router still holds {busy} requests"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[test]
fn chaos_on_the_default_configuration_fails_no_request_and_changes_no_text() {
    // The default: workers of one host move KV over shared memory.
    let env = vec![("DUET_KV_SHM", "on")];
    let cl = Cluster::start_logged(
        2,
        2,
        &[
            "--http-listen",
            "127.0.0.1:0",
            "--stream-stall-timeout",
            "3s",
            "--prefill-timeout",
            &format!("{}s", PREFILL_TIMEOUT.as_secs()),
        ],
        &env,
    );
    let http = cl.router.wait_for("http listening on", support::START);
    let mut chaos = Chaos {
        cl,
        http,
        env,
        rows: Vec::new(),
    };
    rt().block_on(async move {
        chaos.cl.wait_workers(2, 2, Duration::from_secs(30)).await;

        chaos
            .phase(
                "decode worker killed mid-stream",
                60,
                async |c: &mut Chaos| {
                    let i = busy_worker(&c.decode_addrs(), true, Duration::from_secs(60)).await;
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    c.cl.decode[i].kill9();
                    c.restart("decode", i);
                },
            )
            .await;

        chaos
            .phase(
                "decode worker hung mid-stream",
                60,
                async |c: &mut Chaos| {
                    let i = busy_worker(&c.decode_addrs(), true, Duration::from_secs(60)).await;
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    c.cl.decode[i].signal("-STOP");
                    tokio::time::sleep(Duration::from_secs(6)).await;
                    c.cl.decode[i].signal("-CONT");
                },
            )
            .await;

        chaos
            .phase(
                "prefill worker killed mid-prefill",
                PREFILL_WORDS,
                async |c: &mut Chaos| {
                    let i = busy_worker(&c.prefill_addrs(), false, Duration::from_secs(60)).await;
                    c.cl.prefill[i].kill9();
                    c.restart("prefill", i);
                },
            )
            .await;

        chaos
            .phase(
                "prefill worker hung mid-prefill",
                PREFILL_WORDS,
                async |c: &mut Chaos| {
                    let i = busy_worker(&c.prefill_addrs(), false, Duration::from_secs(60)).await;
                    c.cl.prefill[i].signal("-STOP");
                    // Past --prefill-timeout: the router gives it up and retries elsewhere.
                    tokio::time::sleep(PREFILL_TIMEOUT + Duration::from_secs(2)).await;
                    c.cl.prefill[i].signal("-CONT");
                },
            )
            .await;

        chaos
            .phase("etcd down for 8 s", 60, async |c: &mut Chaos| {
                c.cl.etcd.kill();
                tokio::time::sleep(Duration::from_secs(8)).await;
                c.cl.etcd.restart();
            })
            .await;

        chaos
            .phase(
                "cancel storm (24 streams dropped)",
                60,
                async |c: &mut Chaos| {
                    let url = c.cl.url.clone();
                    let storm: Vec<_> = (0..24)
                        .map(|k| {
                            let url = url.clone();
                            tokio::spawn(async move {
                                let cut = rand::rng().random_range(1..12);
                                let mut cl = client(&url).await;
                                let req = pb::GenerateRequest {
                                    ignore_eos: true,
                                    ..greedy(text(&prompt("storm", k, 40)), TOKENS)
                                };
                                let Ok(s) = cl.generate(req).await else {
                                    return;
                                };
                                let mut s = s.into_inner();
                                let mut n = 0;
                                while let Ok(Some(_)) = s.message().await {
                                    n += 1;
                                    if n >= cut {
                                        break;
                                    }
                                }
                                // Dropping the stream cancels the request.
                            })
                        })
                        .collect();
                    for t in storm {
                        let _ = t.await;
                    }
                },
            )
            .await;

        eprintln!("| fault | requests | failed | migrations | retries | seconds |");
        eprintln!("|---|---|---|---|---|---|");
        for r in &chaos.rows {
            eprintln!(
                "| {} | {} | {} | {} | {} | {:.1} |",
                r.fault, r.requests, r.failed, r.migrations, r.retries, r.seconds
            );
        }
    });
}
