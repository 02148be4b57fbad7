//! Serving commands: `duet up` (everything in one process), `duet router`,
//! `duet prefill`, `duet decode` (separate processes against etcd), and the clients
//! `duet generate` and `duet status`.

pub mod args;
pub mod client;
pub mod router;
pub mod tls_args;
pub mod up;
pub mod worker;
