//! `duet profile`: measures one engine on this machine and writes a [`ProfileFile`].
//!
//! - Prefill: one forward of `tokens` new prompt tokens after `cached` tokens already in
//!   the KV cache (the cached prefix is computed once, exported and imported for every
//!   repetition, as a prefix-cache hit attaches it), median of `reps` after a warm-up, in
//!   a pool whose pages are resident (as a worker's).
//! - Decode: steps of `batch` sequences each holding `context` tokens of KV (one context
//!   computed once and imported into every sequence, distinct copies as in a real batch),
//!   median step of `steps` after a warm-up step.
//! - Rounds: the prefill and decode tables are measured `rounds` times over, whole tables
//!   one round after the other; each point keeps the median of its rounds, and how far the
//!   rounds are apart comes back with the profile ([`crate::agreement`]).
//! - Links: `duet bench transfer` on each backend asked for: the rate at 64 MiB and the
//!   median latency of a 64 KiB transfer, integrity on (the default).
//! - Router overhead: not measured here (it needs a running router); the caller gives it
//!   (`--router-overhead-ms`), and the profile's notes say so.

use std::time::Instant;

use duet_bench::corpus::synthetic_ids as tokens;
use duet_bench::progress::Progress;
use duet_bench::stats::median;
use duet_bench::transfer::{self, BenchOptions};
use duet_engine::{EngineModel, KvCache, KvCacheConfig, KvDtype, SeqChunk};
use duet_kv_transfer::BackendKind;

use crate::agreement::{agreement, median_table, Agreement, Round, TableRounds};
use crate::error::{PlanError, Result};
use crate::profile::{DecodeTable, Link, PrefillTable, ProfileFile, Source, SCHEMA};

const BLOCK_SIZE: usize = 16;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Grid {
    pub prefill_tokens: Vec<usize>,
    pub prefill_cached: Vec<usize>,
    pub decode_batch: Vec<usize>,
    pub decode_context: Vec<usize>,
    pub reps: usize,
    pub steps: usize,
    /// Times the prefill and decode tables are measured (at least 1).
    pub rounds: usize,
    pub links: Vec<BackendKind>,
    pub kv_pool_bytes: usize,
    pub kv_dtype: KvDtype,
    pub router_overhead_s: f64,
}

struct Bench<'a> {
    model: &'a EngineModel,
    dtype: KvDtype,
}

impl Bench<'_> {
    /// A pool for `seqs` sequences of `tokens`, its pages touched (a worker's pool is
    /// resident: page faults are not part of a forward's cost).
    fn cache(&self, tokens: usize, seqs: usize) -> Result<KvCache> {
        let layout = self.model.kv_layout(BLOCK_SIZE, self.dtype)?;
        // Every layer group's blocks of a whole forward over `tokens`.
        let per_seq = layout.groups.peak_blocks(tokens, tokens, BLOCK_SIZE);
        let mut c = KvCache::new(layout, seqs * per_seq + seqs);
        c.prefault();
        Ok(c)
    }

    /// The KV of a `len`-token context, computed once.
    fn context(&self, len: usize, salt: usize) -> Result<Option<duet_engine::KvExport>> {
        if len == 0 {
            return Ok(None);
        }
        let mut c = self.cache(len, 1)?;
        c.add_sequence(0)?;
        self.model
            .forward(&mut c, &[SeqChunk::new(0, &tokens(len, salt))])?;
        Ok(Some(c.export(0)?))
    }

    fn prefill(&self, n: usize, cached: usize, ctx: Option<&duet_engine::KvExport>) -> Result<f64> {
        let mut c = self.cache(cached + n, 1)?;
        match ctx {
            Some(ex) => c.import(0, ex)?, // adds the sequence
            None => c.add_sequence(0)?,
        }
        let t = Instant::now();
        self.model
            .forward(&mut c, &[SeqChunk::new(0, &tokens(n, 7))])?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn decode(
        &self,
        batch: usize,
        ctx: &duet_engine::KvExport,
        len: usize,
        steps: usize,
    ) -> Result<f64> {
        let mut c = self.cache(len + steps + 2, batch)?;
        for i in 0..batch {
            c.import(i as u64, ctx)?; // adds the sequence
        }
        let mut times = Vec::with_capacity(steps);
        for s in 0..=steps {
            let toks: Vec<[u32; 1]> = (0..batch).map(|i| [(1000 + i * 31 + s) as u32]).collect();
            let chunks: Vec<SeqChunk> = toks
                .iter()
                .enumerate()
                .map(|(i, t)| SeqChunk::new(i as u64, t))
                .collect();
            let t = Instant::now();
            self.model.forward(&mut c, &chunks)?;
            if s > 0 {
                times.push(t.elapsed().as_secs_f64()); // the first step warms up
            }
        }
        Ok(median(times).unwrap_or(0.0))
    }
}

/// Measures `model` over `grid`; `source` says what was measured where. Also returns how
/// far the rounds of the prefill and decode tables are apart.
pub fn measure(
    model: &EngineModel,
    threads: usize,
    grid: &Grid,
    source: Source,
    progress: bool,
) -> Result<(ProfileFile, Agreement)> {
    let g = grid;
    if g.prefill_tokens.is_empty()
        || g.prefill_cached.is_empty()
        || g.decode_batch.is_empty()
        || g.decode_context.is_empty()
    {
        return Err(PlanError::setting(
            "grid",
            "every axis needs at least one value",
        ));
    }
    let b = Bench {
        model,
        dtype: g.kv_dtype,
    };
    let rounds = g.rounds.max(1);
    let total = rounds
        * (g.prefill_cached.len() * g.prefill_tokens.len()
            + g.decode_context.len() * g.decode_batch.len())
        + g.links.len();
    let bar = if progress {
        Progress::new(Some(total as u64), "profile")
    } else {
        Progress::hidden()
    };
    // Warm-up: the first forward pays page faults and thread start-up.
    b.prefill(g.prefill_tokens[0], 0, None)?;
    let prefill_ctx = g
        .prefill_cached
        .iter()
        .map(|&cached| b.context(cached, 3))
        .collect::<Result<Vec<_>>>()?;
    let decode_ctx = g
        .decode_context
        .iter()
        .map(|&len| {
            b.context(len.max(1), 5)?
                .ok_or_else(|| PlanError::setting("decode context", "must be at least 1"))
        })
        .collect::<Result<Vec<_>>>()?;
    let (mut prefill_rounds, mut decode_rounds): (Vec<Round>, Vec<Round>) = (vec![], vec![]);
    for _ in 0..rounds {
        let mut prefill = Vec::new();
        for (&cached, ctx) in g.prefill_cached.iter().zip(&prefill_ctx) {
            let mut row = Vec::new();
            for &n in &g.prefill_tokens {
                bar.started();
                let runs = (0..g.reps.max(1))
                    .map(|_| b.prefill(n, cached, ctx.as_ref()))
                    .collect::<Result<Vec<f64>>>()?;
                row.push(median(runs).unwrap_or(0.0));
                bar.finished(true);
            }
            prefill.push(row);
        }
        prefill_rounds.push(prefill);
        let mut decode = Vec::new();
        for (&len, ctx) in g.decode_context.iter().zip(&decode_ctx) {
            let mut row = Vec::new();
            for &batch in &g.decode_batch {
                bar.started();
                row.push(b.decode(batch, ctx, len.max(1), g.steps.max(1))?);
                bar.finished(true);
            }
            decode.push(row);
        }
        decode_rounds.push(decode);
    }
    let label = |v: &[usize], what: &str| v.iter().map(|x| format!("{x} {what}")).collect();
    let agreed = agreement(&[
        TableRounds {
            name: "prefill",
            rows: label(&g.prefill_cached, "cached"),
            cols: label(&g.prefill_tokens, "tokens after"),
            rounds: &prefill_rounds,
        },
        TableRounds {
            name: "decode step",
            rows: label(&g.decode_context, "context"),
            cols: label(&g.decode_batch, "sequences of"),
            rounds: &decode_rounds,
        },
    ]);
    let (prefill, decode) = (median_table(&prefill_rounds), median_table(&decode_rounds));
    let mut links = Vec::new();
    if !g.links.is_empty() {
        let rt = tokio::runtime::Runtime::new()
            .map_err(|e| PlanError::setting("runtime", e.to_string()))?;
        for &backend in &g.links {
            bar.started();
            links.push(rt.block_on(link(backend))?);
            bar.finished(true);
        }
    }
    bar.done();
    let config = model.config();
    let layout = model.kv_layout(BLOCK_SIZE, g.kv_dtype)?;
    let pool = KvCacheConfig::from_budget(
        g.kv_pool_bytes,
        BLOCK_SIZE,
        g.kv_dtype,
        // Blocks of every layer: the simulator counts one per 16 tokens (it models no
        // layer groups, so a grouped model's pool reads as an ungrouped one's).
        (config.n_layers, config.n_kv_heads, config.head_dim),
    );
    let f = |v: &[usize]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let file = ProfileFile {
        schema: SCHEMA.into(),
        source,
        threads,
        n_layers: config.n_layers,
        block_size: BLOCK_SIZE,
        kv_bytes_per_token: layout.bytes_per_token() as u64,
        kv_pool_blocks: pool.num_blocks as u64,
        prefill: PrefillTable {
            tokens: f(&g.prefill_tokens),
            cached: f(&g.prefill_cached),
            seconds: prefill,
        },
        decode_step: DecodeTable {
            batch: f(&g.decode_batch),
            context: f(&g.decode_context),
            seconds: decode,
        },
        links,
        router_overhead_s: g.router_overhead_s,
    };
    Ok((file, agreed))
}

/// A link's rate (64 MiB) and latency (64 KiB), as `duet bench transfer` measures them.
async fn link(backend: BackendKind) -> Result<Link> {
    let opts = BenchOptions {
        backend,
        min_bytes: 64 << 10,
        max_bytes: 64 << 20,
        step: 1024,
        reference: false,
        ..BenchOptions::default()
    };
    let r = transfer::run(opts)
        .await
        .map_err(|e| PlanError::setting(format!("link {backend}"), e.to_string()))?;
    let (Some(small), Some(large)) = (r.points.first(), r.points.last()) else {
        return Err(PlanError::setting(
            "link",
            format!("{backend:?}: no measurement"),
        ));
    };
    Ok(Link {
        backend: backend.to_string(),
        bytes_per_s: large.throughput_gbps * 1e9,
        latency_s: small.latency_us_median * 1e-6,
    })
}
