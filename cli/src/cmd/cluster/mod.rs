//! Serving commands: `duet up` (everything in one process), `duet router`,
//! `duet prefill`, `duet decode` (separate processes against etcd), `duet worker` (a worker
//! the planner may move between roles), and the clients
//! `duet generate` and `duet status`.

pub mod args;
pub mod client;
pub mod processes;
pub mod router;
pub mod switchable;
pub mod tls_args;
pub mod up;
pub mod worker;
