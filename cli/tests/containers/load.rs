//! Steady load on the cluster while containers are stopped and started: a few clients, each
//! sending one greedy request after another until stopped. A request completes when its
//! tokens are `duet run`'s; anything else (an error status, other tokens) is a failure.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::support::{client, generate, greedy, text};

type Client = duet_proto::v1::generation_client::GenerationClient<tonic::transport::Channel>;

/// Requests sent, completed and failed in one scenario.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
}

impl Tally {
    /// One request, completed when `ok`.
    pub fn of(ok: bool) -> Tally {
        let mut t = Tally::default();
        t.count(ok);
        t
    }

    pub fn add(&mut self, o: Tally) {
        self.sent += o.sent;
        self.completed += o.completed;
        self.failed += o.failed;
    }

    /// Counts one request: completed when `ok`.
    pub fn count(&mut self, ok: bool) {
        self.sent += 1;
        if ok {
            self.completed += 1;
        } else {
            self.failed += 1;
        }
    }

    /// Prints `scenario NAME: sent S, completed C, failed F` (what the issue asks to record).
    pub fn print(&self, name: &str) {
        eprintln!(
            "scenario {name}: sent {}, completed {}, failed {}",
            self.sent, self.completed, self.failed
        );
    }
}

/// (prompt, `duet run`'s greedy tokens for [`TOKENS`] tokens).
pub type Case = (String, Vec<u32>);

/// Tokens each load request asks for.
pub const TOKENS: u32 = 8;

pub struct Load {
    stop: Arc<AtomicBool>,
    clients: Vec<tokio::task::JoinHandle<Tally>>,
}

impl Load {
    /// `n` concurrent clients of the router at `url`, interleaved: client `k` sends cases
    /// `k`, `k + n`, `k + 2n`, ... round the list, so the first round sends every prompt once.
    pub fn start(url: &str, cases: Arc<Vec<Case>>, n: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..n)
            .map(|k| {
                let (url, cases, stop) = (url.to_string(), cases.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut c = client(&url).await;
                    let mut t = Tally::default();
                    let mut i = k;
                    while !stop.load(Ordering::Relaxed) {
                        t.count(send(&mut c, &cases[i % cases.len()], "load", i).await);
                        i += n;
                    }
                    t
                })
            })
            .collect();
        Load { stop, clients }
    }

    /// Stops the clients after their current request and sums what they saw.
    pub async fn stop(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Tally::default();
        for c in self.clients {
            all.add(c.await.expect("load client"));
        }
        all
    }
}

/// Sends `case` for [`TOKENS`] greedy tokens: `true` when the answer is `duet run`'s tokens
/// (otherwise what came back is printed, as `{what} request {i}`).
pub async fn send(c: &mut Client, (prompt, want): &Case, what: &str, i: usize) -> bool {
    let got = generate(c, greedy(text(prompt), TOKENS)).await;
    let ok = matches!(&got, Ok(g) if g.ids == *want);
    if !ok {
        eprintln!("{what} request {i}: {:?}", got.map(|g| g.ids));
    }
    ok
}
