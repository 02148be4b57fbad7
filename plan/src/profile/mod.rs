//! A profile: what one worker of a given engine, model and machine costs, as the simulator
//! needs it. Written by `duet profile` from measurements ([`crate::measure`]), or by hand
//! for hardware that is not at hand (with its sources in `source.notes`).
//!
//! The JSON (`schema: "duet-profile/1"`):
//! - `prefill`: seconds of one prefill forward of `tokens` new prompt tokens after
//!   `cached` tokens already in the KV cache (`seconds[j][i]` at `cached[j]`, `tokens[i]`);
//! - `decode_step`: seconds of one decode step of `batch` sequences each with `context`
//!   tokens of KV (`seconds[j][i]` at `context[j]`, `batch[i]`);
//! - `kv_bytes_per_token`, `block_size`, `kv_pool_blocks`: one worker's KV pool;
//! - `links`: KV transfer per backend, a rate and a one-way latency;
//! - `router_overhead_s`: what the router and its gRPC hops add to every request;
//! - `threads`: the engine threads the costs were measured with (the simulator's host
//!   sharing divides them).
//!
//! Cost model (the simulator's, stated here once): one forward made of parts (the decoding
//! rows as one part, each prompt chunk as one) costs the sum of what each part costs alone,
//! `decode_step(b, L)` and `prefill(n, c)`, minus `fixed = decode_step(1, first context)`
//! for every part but one: the parts share one pass over the weights, and each prompt
//! attends only to its own tokens (so a batch of prompts is not priced as one long prompt).
//!
//! Invariants after [`Profile::from_json`]: the schema is known, every table is valid
//! ([`Table`]), sizes are positive and at least one link is given.

mod table;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};
pub use table::Table;

pub const SCHEMA: &str = "duet-profile/1";

/// Where a profile comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Source {
    /// `measured` (by `duet profile`) or `hand` (written from published figures).
    pub kind: String,
    pub model: String,
    /// Engine and device, e.g. `native cpu`.
    pub engine: String,
    /// The machine, e.g. the CPU model or the GPU.
    pub machine: String,
    /// Seconds since the Unix epoch when it was made.
    #[serde(default)]
    pub created_unix_s: f64,
    /// Where hand-written figures come from, and anything a reader must know.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// KV transfer over one backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// `local`, `shm`, `tcp`, `rdma`, `nccl`, ...
    pub backend: String,
    pub bytes_per_s: f64,
    pub latency_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillTable {
    pub tokens: Vec<f64>,
    pub cached: Vec<f64>,
    pub seconds: Vec<Vec<f64>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeTable {
    pub batch: Vec<f64>,
    pub context: Vec<f64>,
    pub seconds: Vec<Vec<f64>>,
}

/// The profile as written in JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileFile {
    pub schema: String,
    pub source: Source,
    pub threads: usize,
    pub n_layers: usize,
    pub block_size: usize,
    pub kv_bytes_per_token: u64,
    pub kv_pool_blocks: u64,
    pub prefill: PrefillTable,
    pub decode_step: DecodeTable,
    pub links: Vec<Link>,
    pub router_overhead_s: f64,
}

/// A validated profile and its cost functions.
#[derive(Debug, Clone)]
pub struct Profile {
    pub file: ProfileFile,
    prefill: Table,
    decode: Table,
    fixed: f64,
}

impl Profile {
    /// Reads and validates `path`.
    pub fn read(path: &Path) -> Result<Profile> {
        let text = std::fs::read_to_string(path).map_err(|e| PlanError::file(path, e))?;
        Profile::from_json(&path.display().to_string(), &text)
    }

    /// Parses and validates a profile; `at` names it in errors.
    pub fn from_json(at: &str, text: &str) -> Result<Profile> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| PlanError::input(format!("{at}:{}", e.line()), "(json)", e.to_string()))?;
        match v.get("schema").and_then(|s| s.as_str()) {
            Some(SCHEMA) => {}
            Some(other) => {
                return Err(PlanError::input(
                    at,
                    "schema",
                    format!("unknown version {other:?} (this build reads {SCHEMA:?})"),
                ))
            }
            None => return Err(PlanError::input(at, "schema", "missing")),
        }
        let file: ProfileFile = serde_json::from_value(v).map_err(|e| {
            // serde names the missing or mistyped field in its message.
            PlanError::input(at, "(fields)", e.to_string())
        })?;
        Profile::new(at, file)
    }

    /// Validates `file`; `at` names it in errors.
    pub fn new(at: &str, file: ProfileFile) -> Result<Profile> {
        let positive = |field: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(PlanError::input(at, field, format!("{v} must be positive")))
            }
        };
        let non_negative = |field: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(PlanError::input(at, field, format!("{v} must be >= 0")))
            }
        };
        positive("threads", file.threads as f64)?;
        positive("n_layers", file.n_layers as f64)?;
        positive("block_size", file.block_size as f64)?;
        positive("kv_bytes_per_token", file.kv_bytes_per_token as f64)?;
        positive("kv_pool_blocks", file.kv_pool_blocks as f64)?;
        non_negative("router_overhead_s", file.router_overhead_s)?;
        if file.links.is_empty() {
            return Err(PlanError::input(at, "links", "at least one link is needed"));
        }
        for (i, l) in file.links.iter().enumerate() {
            positive(&format!("links[{i}].bytes_per_s"), l.bytes_per_s)?;
            non_negative(&format!("links[{i}].latency_s"), l.latency_s)?;
        }
        let p = &file.prefill;
        let prefill = Table::new(
            &format!("{at}: prefill"),
            ["tokens", "cached", "seconds"],
            p.tokens.clone(),
            p.cached.clone(),
            p.seconds.clone(),
        )?;
        let d = &file.decode_step;
        let decode = Table::new(
            &format!("{at}: decode_step"),
            ["batch", "context", "seconds"],
            d.batch.clone(),
            d.context.clone(),
            d.seconds.clone(),
        )?;
        let fixed = decode.at(1.0, decode.y()[0]);
        Ok(Profile {
            file,
            prefill,
            decode,
            fixed,
        })
    }

    /// Seconds of a prefill forward of `tokens` new tokens after `cached` in the cache.
    pub fn prefill_s(&self, tokens: usize, cached: f64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        self.prefill.at(tokens as f64, cached)
    }

    /// Seconds of one forward: `batch` decoding rows at mean `context`, plus prompt chunks
    /// `(new tokens, tokens already cached before them)`. Each part costs what the profile
    /// says it costs alone; the parts share one pass over the weights, so the fixed part
    /// (`decode_step(1, first context)`) is paid once, not once per part.
    pub fn step_s(&self, batch: usize, context: f64, chunks: &[(usize, f64)]) -> f64 {
        let mut parts = 0usize;
        let mut total = 0.0;
        let mut largest: f64 = 0.0;
        if batch > 0 {
            let t = self.decode.at(batch as f64, context);
            total += t;
            largest = largest.max(t);
            parts += 1;
        }
        for &(n, cached) in chunks.iter().filter(|c| c.0 > 0) {
            let t = self.prefill_s(n, cached);
            total += t;
            largest = largest.max(t);
            parts += 1;
        }
        if parts == 0 {
            return 0.0;
        }
        (total - (parts - 1) as f64 * self.fixed).max(largest)
    }

    /// The link of `backend` (the first one when `None`).
    pub fn link(&self, backend: Option<&str>) -> Result<&Link> {
        match backend {
            None => Ok(&self.file.links[0]),
            Some(b) => self
                .file
                .links
                .iter()
                .find(|l| l.backend == b)
                .ok_or_else(|| {
                    let have: Vec<&str> =
                        self.file.links.iter().map(|l| l.backend.as_str()).collect();
                    PlanError::setting(
                        "--kv-link",
                        format!("the profile has no link {b:?} (it has {})", have.join(", ")),
                    )
                }),
        }
    }

    pub fn block_size(&self) -> usize {
        self.file.block_size
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.file)
            .map_err(|e| PlanError::setting("profile", e.to_string()))?;
        std::fs::write(path, text + "\n").map_err(|e| PlanError::file(path, e))
    }
}

#[cfg(test)]
pub(crate) mod tests;
