//! The progress bar on stderr while a run goes on: finished requests out of the planned
//! count (a spinner when the run is bounded by time only), with failures and requests in
//! flight. Hidden when stderr is not a terminal, so logs and CI output stay clean.
//!
//! Invariant: drawing never affects the run (a hidden bar does nothing; every method is
//! cheap and never blocks on the terminal).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Clone)]
pub struct Progress {
    bar: ProgressBar,
    failed: Arc<AtomicU64>,
    in_flight: Arc<AtomicU64>,
}

impl Progress {
    /// `total`: planned requests (None: bounded by time only); `title`: shown before the bar.
    pub fn new(total: Option<u64>, title: &str) -> Self {
        let target = if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = match total {
            Some(n) => ProgressBar::with_draw_target(Some(n), target),
            None => ProgressBar::with_draw_target(None, target),
        };
        let template = match total {
            Some(_) => "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
            None => "{prefix} [{elapsed_precise}] {spinner} {pos} done {msg}",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.set_prefix(title.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress {
            bar,
            failed: Arc::new(AtomicU64::new(0)),
            in_flight: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A progress bar that draws nothing (tests, warm-up).
    pub fn hidden() -> Self {
        Progress {
            bar: ProgressBar::hidden(),
            failed: Arc::new(AtomicU64::new(0)),
            in_flight: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.refresh();
    }

    pub fn finished(&self, ok: bool) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.bar.inc(1);
        self.refresh();
    }

    fn refresh(&self) {
        self.bar.set_message(format!(
            "in flight {}, failed {}",
            self.in_flight.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed)
        ));
    }

    pub fn done(&self) {
        self.bar.finish_and_clear();
    }
}
