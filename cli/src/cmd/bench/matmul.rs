//! `duet bench matmul`: one weight matrix of a GGUF file multiplied by `rows`
//! activation rows, as the engine keeps it (its own blocks and integer
//! kernels where they exist, e.g. K-quants) beside the same matrix expanded to
//! f32 (what the engine did with formats it had no kernel for). The two run
//! alternately, `--repeat` rounds; the report gives the medians, their ratio
//! and the resident bytes of each form.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use duet_bench::stats::median;
use duet_engine::linear::{KernelRows, Linear, WeightMode};
use serde::Serialize;

#[derive(Args, Debug)]
pub struct MatmulBenchArgs {
    /// GGUF file.
    #[arg(long, env = "DUET_MODEL")]
    pub model: PathBuf,
    /// Tensor name, e.g. `blk.0.ffn_down.weight`.
    #[arg(long)]
    pub tensor: String,
    /// Activation rows per matmul (1 is a decode step, more a prompt).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,128")]
    pub rows: Vec<usize>,
    /// Compute threads.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Alternating rounds per row count (the first is a warm-up, not timed).
    #[arg(long, default_value_t = 9)]
    pub repeat: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Point {
    rows: usize,
    native_ms: f64,
    expanded_f32_ms: f64,
    /// `expanded_f32_ms / native_ms`: above 1, the native form is faster.
    speedup: f64,
}

#[derive(Serialize)]
struct Report {
    tensor: String,
    format: &'static str,
    shape: [usize; 2],
    threads: usize,
    native_bytes: usize,
    expanded_f32_bytes: usize,
    points: Vec<Point>,
}

fn time_ms(lin: &Linear, x: &[f32], rows: usize) -> anyhow::Result<f64> {
    let t = Instant::now();
    let y = lin.forward_with(x, rows, KernelRows::As { n: rows, first: 0 })?;
    std::hint::black_box(y);
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

pub fn run(a: MatmulBenchArgs) -> anyhow::Result<()> {
    if a.threads == 0 || a.repeat < 2 {
        anyhow::bail!("--threads must be at least 1 and --repeat at least 2");
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build()
        .context("compute threads")?;
    let q = duet_engine::model::read_weight(&a.model, &a.tensor)
        .with_context(|| format!("{}: {}", a.model.display(), a.tensor))?;
    let (format, out_dim, in_dim) = (q.format, q.rows, q.cols);
    let expanded = q.expanded()?;
    let native = Linear::new(q, WeightMode::Quantized)?;
    let wide = Linear::new(expanded, WeightMode::Quantized)?;
    let mut points = Vec::new();
    for &rows in &a.rows {
        let x: Vec<f32> = (0..rows * in_dim)
            .map(|i| ((i * 7919 % 2003) as f32 / 2003.0 - 0.5) * 2.0)
            .collect();
        let (mut n_ms, mut w_ms) = (Vec::new(), Vec::new());
        for round in 0..a.repeat {
            let (n, w) = pool.install(|| -> anyhow::Result<(f64, f64)> {
                Ok((time_ms(&native, &x, rows)?, time_ms(&wide, &x, rows)?))
            })?;
            if round > 0 {
                n_ms.push(n);
                w_ms.push(w);
            }
        }
        let (n, w) = (median(n_ms).unwrap_or(0.0), median(w_ms).unwrap_or(0.0));
        eprintln!(
            "{} {rows:4} rows: native {n:8.3} ms, expanded f32 {w:8.3} ms, speedup {:.2}x",
            format.name(),
            w / n
        );
        points.push(Point {
            rows,
            native_ms: n,
            expanded_f32_ms: w,
            speedup: w / n,
        });
    }
    let report = Report {
        tensor: a.tensor,
        format: format.name(),
        shape: [out_dim, in_dim],
        threads: a.threads,
        native_bytes: native.resident_bytes(),
        expanded_f32_bytes: wide.resident_bytes(),
        points,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(p) = &a.json {
        super::write_json(p, &report)?;
    }
    Ok(())
}
