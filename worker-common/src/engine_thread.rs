//! The one run loop of both workers' engine threads. A worker's engine (its model, KV
//! cache and scheduling state) lives on a dedicated OS thread and takes commands from a
//! channel; [`run`] drives it: wait for work, take every queued command, step, repeat.
//!
//! Invariants:
//! - An idle engine ([`Wait::Forever`]) blocks on its channel: no timer wakes it, so an
//!   idle worker costs no CPU. It wakes for a command, for its cancellation (see
//!   [`wake_on_cancel`]), or when every sender is gone.
//! - An engine with timed work that no command announces (a reservation expiring, a
//!   client that went away) says how long it may sleep ([`Wait::At`]); a busy one
//!   ([`Wait::Busy`]) does not wait.
//! - After cancellation or disconnection [`EngineLoop::stop`] runs exactly once, so
//!   every request still held is answered and its KV freed.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How long an engine may sleep before its next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Work to do now.
    Busy,
    /// Nothing to do until a command arrives or this much time passes.
    At(Duration),
    /// Nothing to do until a command arrives.
    Forever,
}

/// What an engine thread does; [`run`] calls it.
pub trait EngineLoop {
    type Cmd;

    /// How long the engine may sleep now.
    fn idle_wait(&self) -> Wait;
    /// One command from the channel.
    fn command(&mut self, cmd: Self::Cmd);
    /// One round of work after the queued commands were handled (admission, expiry, a
    /// forward pass, publishing status). Called after every wake-up.
    fn tick(&mut self);
    /// The thread is ending: answer and free everything still held.
    fn stop(&mut self);
}

/// Drives `engine` until `cancel` fires or every sender of `rx` is dropped.
pub fn run<E: EngineLoop>(mut engine: E, rx: Receiver<E::Cmd>, cancel: &CancellationToken) {
    'outer: while !cancel.is_cancelled() {
        let first = match engine.idle_wait() {
            Wait::Busy => None,
            Wait::At(d) => match rx.recv_timeout(d) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            },
            Wait::Forever => match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            },
        };
        if let Some(c) = first {
            engine.command(c);
        }
        loop {
            match rx.try_recv() {
                Ok(c) => engine.command(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => break 'outer,
            }
        }
        if cancel.is_cancelled() {
            break;
        }
        engine.tick();
    }
    engine.stop();
}

/// Sends `wake` on `tx` once `cancel` fires (a task on `rt`), so that an engine blocked in
/// [`run`] sees its cancellation at once. Without it an idle engine still ends on its next
/// command or when every sender is dropped. The task holds a sender until then: once this
/// is called, the engine is ended by its token (or the runtime's end), not by dropping its
/// handles.
pub fn wake_on_cancel<C: Send + 'static>(
    rt: &tokio::runtime::Handle,
    tx: Sender<C>,
    cancel: CancellationToken,
    wake: C,
) {
    rt.spawn(async move {
        cancel.cancelled().await;
        let _ = tx.send(wake);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    /// Records what the loop did; idle unless it holds work.
    struct Probe {
        log: Arc<Mutex<Vec<String>>>,
        work: usize,
        wait: Wait,
    }

    impl EngineLoop for Probe {
        type Cmd = &'static str;
        fn idle_wait(&self) -> Wait {
            if self.work > 0 {
                Wait::Busy
            } else {
                self.wait
            }
        }
        fn command(&mut self, c: &'static str) {
            if c == "work" {
                self.work += 2;
            }
            self.log.lock().unwrap().push(c.to_string());
        }
        fn tick(&mut self) {
            self.work = self.work.saturating_sub(1);
            self.log.lock().unwrap().push("step".into());
        }
        fn stop(&mut self) {
            self.log.lock().unwrap().push("shutdown".into());
        }
    }

    /// A probe engine on its own thread: its sender, log, token and thread.
    type Started = (
        mpsc::Sender<&'static str>,
        Arc<Mutex<Vec<String>>>,
        CancellationToken,
        std::thread::JoinHandle<()>,
    );

    fn start(wait: Wait) -> Started {
        let (tx, rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let cancel = CancellationToken::new();
        let probe = Probe {
            log: log.clone(),
            work: 0,
            wait,
        };
        let c = cancel.clone();
        let t = std::thread::spawn(move || run(probe, rx, &c));
        (tx, log, cancel, t)
    }

    #[test]
    fn an_idle_engine_sleeps_until_a_command_and_works_until_done() {
        let (tx, log, _cancel, t) = start(Wait::Forever);
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            log.lock().unwrap().is_empty(),
            "no step without work: {log:?}"
        );
        tx.send("work").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(*log.lock().unwrap(), ["work", "step", "step"]);
        drop(tx);
        t.join().unwrap();
        assert_eq!(log.lock().unwrap().last().unwrap(), "shutdown");
    }

    #[test]
    fn timed_work_wakes_the_engine_without_a_command() {
        let (_tx, log, cancel, t) = start(Wait::At(Duration::from_millis(20)));
        std::thread::sleep(Duration::from_millis(150));
        let steps = log.lock().unwrap().len();
        assert!(
            (3..=10).contains(&steps),
            "{steps} steps in 150 ms at 20 ms"
        );
        cancel.cancel();
        t.join().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn cancellation_wakes_a_blocked_engine_at_once() {
        let (tx, log, cancel, t) = start(Wait::Forever);
        wake_on_cancel(
            &tokio::runtime::Handle::current(),
            tx.clone(),
            cancel.clone(),
            "wake",
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t0 = Instant::now();
        cancel.cancel();
        tokio::task::spawn_blocking(move || t.join().unwrap())
            .await
            .unwrap();
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(*log.lock().unwrap(), ["wake", "shutdown"]);
        drop(tx);
    }
}
