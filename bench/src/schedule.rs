//! The units of work of one run and when each is due: the workload's units (a request, or
//! a conversation's turns) at the arrival process's times, until `num_prompts` requests or
//! `duration`. The load generator ([`crate::runner`]) sends them; the planner's simulator
//! (`duet plan simulate`) plays the same schedule, so both see the same requests at the
//! same planned times for the same seed.
//!
//! Invariants: the first unit is due at 0 and due times never decrease; the units hold at
//! most `num_prompts` requests in all (the last one is cut short); no unit is due at or
//! after `duration`.

use std::time::Duration;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::arrival::Arrival;
use crate::workload::{RequestSpec, Workload};

/// Seed offset of the arrival RNG, so arrivals and the workload are independent streams.
pub const ARRIVAL_STREAM: u64 = 0x9E37_79B9_7F4A_7C15;

pub struct Schedule {
    workload: Workload,
    arrival: Arrival,
    rng: ChaCha8Rng,
    num_prompts: Option<usize>,
    duration_s: Option<f64>,
    due_s: f64,
    sent: usize,
}

impl Schedule {
    /// `seed`: the run's seed (the arrival stream is derived from it).
    pub fn new(
        workload: Workload,
        arrival: Arrival,
        seed: u64,
        num_prompts: Option<usize>,
        duration: Option<Duration>,
    ) -> Self {
        Schedule {
            workload,
            arrival,
            rng: ChaCha8Rng::seed_from_u64(seed ^ ARRIVAL_STREAM),
            num_prompts,
            duration_s: duration.map(|d| d.as_secs_f64()),
            due_s: 0.0,
            sent: 0,
        }
    }

    /// Requests handed out so far.
    pub fn requests(&self) -> usize {
        self.sent
    }
}

impl Iterator for Schedule {
    /// (due, seconds after the run's start; the unit's requests in order).
    type Item = (f64, Vec<RequestSpec>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.num_prompts.is_some_and(|n| self.sent >= n) {
            return None;
        }
        if self.sent > 0 {
            self.due_s += self.arrival.next_gap(&mut self.rng);
        }
        if self.duration_s.is_some_and(|d| self.due_s >= d) {
            return None;
        }
        let mut unit = self.workload.next_unit();
        if let Some(n) = self.num_prompts {
            unit.truncate(n - self.sent);
        }
        self.sent += unit.len();
        Some((self.due_s, unit))
    }
}
