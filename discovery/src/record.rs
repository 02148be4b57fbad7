//! The worker record: what a worker publishes about itself, and where it lives in the registry.
//!
//! Invariants:
//! - A record is stored at `/duet/<cluster>/workers/<role>/<id>` ([`worker_key`]); `cluster`
//!   and `id` are non-empty and contain no `/`, so a key always parses back to the same triple.
//! - The value is JSON with `"version": 1` ([`RECORD_VERSION`]). Readers ignore unknown fields
//!   (so a newer writer may add fields without a version bump) and reject any other version
//!   with [`Error::UnsupportedVersion`] rather than guessing.

use std::fmt;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The record schema version this build writes and reads.
pub const RECORD_VERSION: u32 = 1;

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs prompt prefill and ships KV blocks to a decode worker.
    Prefill,
    /// Holds KV blocks and generates tokens.
    Decode,
}

impl Role {
    /// All roles, in key order.
    pub const ALL: [Role; 2] = [Role::Prefill, Role::Decode];

    /// Lower-case name, as used in keys, JSON and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(Error::invalid(format!(
                "unknown role {other:?} (expected \"prefill\" or \"decode\")"
            ))),
        }
    }
}

/// One way to reach a worker's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEndpoint {
    /// `"tcp"`, `"shm"` or `"local"` (kept as a string so new transports need no schema change).
    pub transport: String,
    /// Transport-specific address (`host:port`, a shared-memory name, ...).
    pub address: String,
}

/// Load and capacity figures a worker publishes; the router routes on these.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// KV blocks in the worker's cache.
    pub kv_blocks_total: u64,
    /// KV blocks neither in use nor reserved (cached ones included: they are reused on a
    /// hit and evicted when room is needed).
    pub kv_blocks_free: u64,
    /// Of the free blocks, those holding cached prefixes.
    #[serde(default)]
    pub kv_blocks_cached: u64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Sequences currently in the running batch.
    pub running: u32,
    /// Sequences waiting for admission.
    pub waiting: u32,
    /// Prompt tokens queued for prefill (prefill workers; 0 elsewhere).
    pub queued_prefill_tokens: u64,
    /// Largest batch the worker runs.
    pub max_batch: u32,
    /// Recent throughput estimate.
    pub tokens_per_second: f64,
    /// How the KV blocks hold tokens when the model mixes global and local layers (`None`:
    /// a block holds `block_size` tokens of every layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_groups: Option<KvGroupShape>,
}

/// A KV cache with layer groups (the engine's `KvGroups`): each group has its own blocks,
/// and a local group holds only its window plus a chunk being computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGroupShape {
    /// Groups of layers that see every position.
    pub global: u32,
    /// Groups of local (sliding-window) layers.
    pub local: u32,
    /// The local layers' window, in tokens.
    pub window: u32,
    /// Most prompt tokens the worker computes in one forward of a sequence.
    pub chunk: u32,
}

impl KvGroupShape {
    /// Each group's window, `None` for a global one: the global groups first, as the
    /// engine orders them (`duet_engine::KvGroups`).
    pub fn windows(&self) -> Vec<Option<usize>> {
        let mut w = vec![None; self.global as usize];
        w.extend(std::iter::repeat_n(
            Some(self.window as usize),
            self.local as usize,
        ));
        w
    }
}

impl Capacity {
    /// The most blocks a sequence of `tokens` tokens takes in this worker's cache: one per
    /// `block_size` tokens, in every layer group; a local group's bounded by its window and
    /// a chunk (the engine's `KvGroups::peak_blocks`, the same formula).
    pub fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        let bs = u64::from(self.block_size.max(1));
        let all = tokens.div_ceil(bs);
        match self.kv_groups {
            None => all,
            Some(g) => {
                let span = u64::from(g.window.max(1)) - 1 + u64::from(g.chunk.max(1));
                let local = (span.div_ceil(bs) + 1).min(all);
                u64::from(g.global.max(1)) * all + u64::from(g.local) * local
            }
        }
    }

    /// The longest sequence `blocks` blocks hold ([`Self::blocks_for_tokens`] inverted).
    pub fn tokens_in_blocks(&self, blocks: u64) -> u64 {
        let bs = u64::from(self.block_size.max(1));
        let (mut lo, mut hi) = (0u64, blocks.saturating_mul(bs));
        if self.kv_groups.is_none() {
            return hi;
        }
        // The largest `t` with `blocks_for_tokens(t) <= blocks` (monotone in `t`).
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            match self.blocks_for_tokens(mid) <= blocks {
                true => lo = mid,
                false => hi = mid - 1,
            }
        }
        lo
    }
}

/// What a worker publishes about itself (schema version 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Schema version; always [`RECORD_VERSION`] when written by this build.
    pub version: u32,
    /// Worker id, unique within (cluster, role).
    pub id: String,
    /// Cluster name.
    pub cluster: String,
    /// Prefill or decode.
    pub role: Role,
    /// gRPC address of the worker's service, e.g. `http://127.0.0.1:5000`.
    pub grpc_addr: String,
    /// KV transfer endpoints, one per transport the worker accepts.
    pub kv_endpoints: Vec<KvEndpoint>,
    /// Served model name.
    pub model: String,
    /// Model fingerprint (hex); only workers with equal fingerprints may exchange KV.
    pub fingerprint: String,
    /// Current capacity and load.
    pub capacity: Capacity,
    /// When the worker started (ms since the Unix epoch).
    pub started_at_ms: u64,
    /// When this record was last published (ms since the Unix epoch).
    pub updated_at_ms: u64,
    /// The worker accepts no new work and is finishing what it has.
    pub draining: bool,
    /// The worker follows role requests (`duet worker`): a planner may move it to the other
    /// role ([`crate::control`]). Absent in records of older writers: not switchable.
    #[serde(default)]
    pub switchable: bool,
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

impl WorkerRecord {
    /// A record with the current version, empty endpoints, default capacity, and both
    /// timestamps set to now.
    pub fn new(
        cluster: impl Into<String>,
        role: Role,
        id: impl Into<String>,
        grpc_addr: impl Into<String>,
    ) -> Self {
        let now = now_ms();
        WorkerRecord {
            version: RECORD_VERSION,
            id: id.into(),
            cluster: cluster.into(),
            role,
            grpc_addr: grpc_addr.into(),
            kv_endpoints: Vec::new(),
            model: String::new(),
            fingerprint: String::new(),
            capacity: Capacity::default(),
            started_at_ms: now,
            updated_at_ms: now,
            draining: false,
            switchable: false,
        }
    }

    /// The registry key of this record.
    pub fn key(&self) -> String {
        worker_key(&self.cluster, self.role, &self.id)
    }

    /// Checks the invariants a record must hold before it is published.
    pub fn validate(&self) -> Result<()> {
        if self.version != RECORD_VERSION {
            return Err(Error::UnsupportedVersion {
                found: self.version,
                expected: RECORD_VERSION,
            });
        }
        validate_segment("cluster", &self.cluster)?;
        validate_segment("id", &self.id)?;
        if self.grpc_addr.is_empty() {
            return Err(Error::invalid("grpc_addr is empty"));
        }
        if self.capacity.kv_blocks_free > self.capacity.kv_blocks_total {
            return Err(Error::invalid(format!(
                "kv_blocks_free {} exceeds kv_blocks_total {}",
                self.capacity.kv_blocks_free, self.capacity.kv_blocks_total
            )));
        }
        Ok(())
    }

    /// JSON encoding (the registry value).
    pub fn to_json(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|source| Error::Encode { source })
    }

    /// Decodes a registry value: checks the version first, then the schema; unknown fields are
    /// ignored.
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        let probe: VersionOnly =
            serde_json::from_slice(bytes).map_err(|source| Error::Decode { source })?;
        if probe.version != RECORD_VERSION {
            return Err(Error::UnsupportedVersion {
                found: probe.version,
                expected: RECORD_VERSION,
            });
        }
        serde_json::from_slice(bytes).map_err(|source| Error::Decode { source })
    }

    /// The KV endpoint for `transport`, if the worker offers one.
    pub fn kv_endpoint(&self, transport: &str) -> Option<&KvEndpoint> {
        self.kv_endpoints.iter().find(|e| e.transport == transport)
    }
}

fn validate_segment(what: &str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(format!("{what} is empty")));
    }
    if value.contains('/') {
        return Err(Error::invalid(format!("{what} {value:?} contains '/'")));
    }
    Ok(())
}

/// `/duet/<cluster>/workers/` : the prefix under which all workers of a cluster live.
pub fn workers_prefix(cluster: &str) -> String {
    format!("/duet/{cluster}/workers/")
}

/// `/duet/<cluster>/workers/<role>/` : the prefix of one role.
pub fn role_prefix(cluster: &str, role: Role) -> String {
    format!("/duet/{cluster}/workers/{role}/")
}

/// `/duet/<cluster>/workers/<role>/<id>` : the key of one worker.
pub fn worker_key(cluster: &str, role: Role, id: &str) -> String {
    format!("/duet/{cluster}/workers/{role}/{id}")
}

/// Splits a worker key into (cluster, role, id); `None` if it is not one.
pub fn parse_worker_key(key: &str) -> Option<(&str, Role, &str)> {
    let rest = key.strip_prefix("/duet/")?;
    let mut parts = rest.split('/');
    let cluster = parts.next()?;
    if parts.next()? != "workers" {
        return None;
    }
    let role = parts.next()?.parse().ok()?;
    let id = parts.next()?;
    if cluster.is_empty() || id.is_empty() || parts.next().is_some() {
        return None;
    }
    Some((cluster, role, id))
}

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WorkerRecord {
        let mut r = WorkerRecord::new("c1", Role::Decode, "d0", "http://127.0.0.1:5000");
        r.kv_endpoints.push(KvEndpoint {
            transport: "tcp".into(),
            address: "127.0.0.1:6000".into(),
        });
        r.model = "smol".into();
        r.fingerprint = "abcd".into();
        r.capacity.kv_blocks_total = 100;
        r.capacity.kv_blocks_free = 40;
        r
    }

    #[test]
    fn json_roundtrip_and_lowercase_role() {
        let r = sample();
        let bytes = r.to_json().unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains("\"role\":\"decode\""), "{text}");
        assert!(text.contains("\"version\":1"), "{text}");
        assert_eq!(WorkerRecord::from_json(&bytes).unwrap(), r);
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let mut v: serde_json::Value = serde_json::to_value(sample()).unwrap();
        v["future_field"] = serde_json::json!({"x": 1});
        v["capacity"]["gpu_temp"] = serde_json::json!(70);
        let bytes = serde_json::to_vec(&v).unwrap();
        assert_eq!(
            WorkerRecord::from_json(&bytes).unwrap(),
            sample_ignoring_time(&bytes)
        );
    }

    fn sample_ignoring_time(bytes: &[u8]) -> WorkerRecord {
        let mut s = sample();
        let parsed = WorkerRecord::from_json(bytes).unwrap();
        s.started_at_ms = parsed.started_at_ms;
        s.updated_at_ms = parsed.updated_at_ms;
        s
    }

    #[test]
    fn other_versions_are_rejected_clearly() {
        let mut v: serde_json::Value = serde_json::to_value(sample()).unwrap();
        v["version"] = serde_json::json!(2);
        let err = WorkerRecord::from_json(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(matches!(
            err,
            Error::UnsupportedVersion {
                found: 2,
                expected: 1
            }
        ));
        assert!(err.to_string().contains("version 2"), "{err}");
        let err = WorkerRecord::from_json(b"{\"id\":\"x\"}").unwrap_err();
        assert!(matches!(err, Error::Decode { .. }));
    }

    #[test]
    fn keys_roundtrip() {
        let r = sample();
        assert_eq!(r.key(), "/duet/c1/workers/decode/d0");
        assert!(r.key().starts_with(&workers_prefix("c1")));
        assert!(r.key().starts_with(&role_prefix("c1", Role::Decode)));
        assert_eq!(parse_worker_key(&r.key()), Some(("c1", Role::Decode, "d0")));
        assert_eq!(parse_worker_key("/duet/c1/workers/other/d0"), None);
        assert_eq!(parse_worker_key("/duet/c1/workers/decode/d0/x"), None);
    }

    #[test]
    fn validation() {
        assert!(sample().validate().is_ok());
        let mut r = sample();
        r.id = "a/b".into();
        assert!(matches!(r.validate(), Err(Error::InvalidRecord { .. })));
        let mut r = sample();
        r.capacity.kv_blocks_free = 101;
        assert!(r.validate().is_err());
    }

    #[test]
    fn grouped_caches_count_a_block_per_group_and_only_a_window_for_local_groups() {
        let mut c = Capacity {
            block_size: 16,
            ..Capacity::default()
        };
        assert_eq!(c.blocks_for_tokens(100), 7);
        assert_eq!(c.tokens_in_blocks(7), 112);
        // Gemma 3 270M: one global group, five local of window 512, chunks of 256.
        c.kv_groups = Some(KvGroupShape {
            global: 1,
            local: 5,
            window: 512,
            chunk: 256,
        });
        assert_eq!(c.blocks_for_tokens(100), 6 * 7);
        // cdiv(511 + 256, 16) + 1 = 49 blocks per local group at most.
        assert_eq!(c.blocks_for_tokens(4096), 256 + 5 * 49);
        for blocks in [0, 5, 6, 42, 300, 501, 5000] {
            let t = c.tokens_in_blocks(blocks);
            assert!(c.blocks_for_tokens(t) <= blocks, "{blocks}");
            assert!(c.blocks_for_tokens(t + 1) > blocks, "{blocks}");
        }
        // A record without the field (an older worker) reads as one group.
        let json = r#"{"kv_blocks_total":8,"kv_blocks_free":8,"block_size":16,"running":0,
            "waiting":0,"queued_prefill_tokens":0,"max_batch":1,"tokens_per_second":0.0}"#;
        let old: Capacity = serde_json::from_str(json).unwrap();
        assert_eq!(old.kv_groups, None);
    }
}
