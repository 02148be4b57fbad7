//! duet-plan: how many prefill and decode workers a workload needs, answered from
//! measurements.
//!
//! - [`profile`]: what one worker costs (prefill and decode-step times, KV size, links,
//!   router overhead), measured by `duet profile` ([`measure`], its rounds checked against
//!   each other by [`agreement`]) or written by hand;
//! - [`sim`]: a discrete-event simulator of a cluster that runs the live router's placement
//!   and the live workers' scheduling rules (not copies of them) over simulated time;
//! - [`simulate`]: `duet plan simulate`, `duet bench serve`'s workload through the
//!   simulator, reported as `duet bench serve` reports;
//! - [`search`]: `duet plan`, the cheapest layout for a rate within an SLO.

#![forbid(unsafe_code)]

pub mod agreement;
pub mod error;
pub mod measure;
pub mod planner;
pub mod profile;
pub mod search;
pub mod sim;
pub mod simulate;
pub mod trace;

pub use error::{PlanError, Result};
pub use profile::Profile;
