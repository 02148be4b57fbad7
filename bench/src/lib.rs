//! duet-bench: `duet bench serve`, a load generator for LLM servers modelled on
//! `vllm bench serve`, AIPerf and GuideLLM, and the plots that compare configurations.
//!
//! A run sends a seeded workload of prompts with exact token lengths (windows of a
//! tokenized public-domain text, [`corpus`]/[`workload`]) at Poisson or gamma arrivals
//! or in a closed loop ([`arrival`], [`runner`]) to duet's gRPC door or an OpenAI-compatible
//! server ([`backend`]), times every streamed chunk ([`record`]), and summarises TTFT, TPOT,
//! ITL, end-to-end latency, throughput, errors and SLO attainment / goodput ([`report`],
//! [`slo`], [`stats`]); [`plot`] draws latency CDFs and attainment against rate as SVG.
//!
//! [`transfer`] is `duet bench transfer`: kv-transfer's backends measured beside a reference
//! of the same run (iperf3, memcpy). [`fake_workers`] are the registered stand-in workers
//! `duet bench router` measures the router against.
//!
//! The `duet` CLI only parses flags into a [`config::ServeConfig`] and prints results.

#![forbid(unsafe_code)]

pub mod arrival;
pub mod backend;
pub mod config;
pub mod corpus;
pub mod error;
pub mod fake_workers;
pub mod lengths;
pub mod plot;
pub mod progress;
pub mod record;
pub mod report;
pub mod runner;
pub mod schedule;
pub mod slo;
pub mod sse;
pub mod stats;
pub mod transfer;
pub mod workload;

pub use backend::{BackendKind, IgnoreEos, PromptFormat, SendOptions};
pub use config::{DatasetKind, LengthParams, ServeConfig};
pub use error::{BenchError, Result};
pub use report::Report;
pub use runner::run;
pub use slo::Slo;
