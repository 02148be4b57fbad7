//! `duet bench transfer`: KV transfer throughput and latency per payload
//! size beside the reference measured in the same run (iperf3 over loopback
//! for tcp, memcpy for shm and local), plus the pipelined end-to-end figure
//! for a 1024-token prompt of the default model. `--end-to-end` measures the workers' own
//! path instead: a prefill worker's KV pool to a decode worker's, through their code.

use std::path::PathBuf;

use clap::Args;
use duet_bench::transfer::{self as bench, BenchOptions, E2eOptions, WorkerPathOptions};
use duet_kv_transfer::BackendKind;
use serde::Serialize;

use crate::cmd::cluster::args::{CompressionArg, Switch};

#[derive(Args, Debug)]
pub struct TransferBenchArgs {
    /// tcp, shm or local.
    #[arg(long, default_value = "tcp")]
    pub backend: BackendKind,
    /// Largest payload in bytes (sizes grow x4 from 64 KiB).
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: u64,
    /// Parallel connections (tcp).
    #[arg(long, default_value_t = 1)]
    pub streams: usize,
    /// Frame MACs (`on`, as workers run by default) or `off` (`--kv-integrity off`).
    #[arg(long, value_enum, default_value = "on")]
    pub integrity: Switch,
    /// Encoding of the KV on the wire (tcp, shm); GB/s count the KV as stored.
    #[arg(long, value_enum, default_value = "none")]
    pub compression: CompressionArg,
    /// shm: move payload through the shared ring even where pull mode (one copy with
    /// process_vm_readv) works, to compare the two.
    #[arg(long)]
    pub shm_ring: bool,
    /// Put the sender's payload and the memcpy reference's buffers on transparent huge
    /// pages (the kernel then pins 2 MiB pages for pull mode instead of 4 KiB ones).
    #[arg(long)]
    pub huge_pages: bool,
    /// shm pull mode: leave the sender's payload in ordinary memory (read with
    /// process_vm_readv) instead of its send arena (mapped by the receiver, copied with a
    /// memcpy), to compare the two.
    #[arg(long)]
    pub shm_no_arena: bool,
    /// Measure the workers' path instead (the prefill worker's pool, read in place, over
    /// shm or a socket straight into the decode worker's pool; the model's f16 layout) at
    /// 16, 64 and 256 MiB (or up to --bytes), beside memcpy in the same run.
    #[arg(long)]
    pub end_to_end: bool,
    /// The model whose layout and decode engine `--end-to-end` uses.
    #[arg(long, env = "DUET_MODEL", default_value = crate::cmd::model_args::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Measured runs per size of `--end-to-end` (median reported).
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the report here (JSON).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    sizes: bench::BenchReport,
    end_to_end: bench::E2eReport,
}

pub fn run(a: TransferBenchArgs) -> anyhow::Result<()> {
    if a.streams == 0 {
        anyhow::bail!("--streams must be at least 1");
    }
    let rt = tokio::runtime::Runtime::new()?;
    if a.end_to_end {
        return worker_path(&rt, &a);
    }
    let sizes = rt.block_on(bench::run(BenchOptions {
        backend: a.backend,
        max_bytes: a.bytes,
        streams: a.streams,
        integrity: a.integrity == Switch::On,
        compression: a.compression.into(),
        shm_ring: a.shm_ring,
        huge_pages: a.huge_pages,
        shm_arena: !a.shm_no_arena,
        ..Default::default()
    }))?;
    let end_to_end = rt.block_on(bench::end_to_end(E2eOptions {
        backend: a.backend,
        integrity: a.integrity == Switch::On,
        compression: a.compression.into(),
        shm_ring: a.shm_ring,
        shm_arena: !a.shm_no_arena,
        ..Default::default()
    }))?;
    let report = Report { sizes, end_to_end };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let s = &report.sizes;
        println!(
            "backend {:?}{}{}, {} stream(s), integrity {}, compression {}, reference {}",
            s.backend,
            s.shm_mode
                .as_ref()
                .map_or(String::new(), |m| format!(" ({m} mode)")),
            if s.huge_pages { ", huge pages" } else { "" },
            s.streams,
            if s.integrity { "on" } else { "off" },
            s.compression,
            s.reference_kind
        );
        println!(
            "{:>12} {:>10} {:>12} {:>12} {:>8}",
            "bytes", "GB/s", "latency us", "ref GB/s", "ratio"
        );
        for p in &s.points {
            println!(
                "{:>12} {:>10.2} {:>12.0} {:>12} {:>8}",
                p.bytes,
                p.throughput_gbps,
                p.latency_us_median,
                p.reference_gbps.map_or("-".into(), |r| format!("{r:.2}")),
                p.ratio_to_reference
                    .map_or("-".into(), |r| format!("{r:.2}"))
            );
        }
        for note in [&s.reference_note, &s.zero_copy_note].into_iter().flatten() {
            println!("note: {note}");
        }
        let e = &report.end_to_end;
        println!(
            "end to end, {} tokens x {} layers ({} bytes): last layer handed over -> last byte placed: median {:.0} us (whole transfer back to back: {:.0} us)",
            e.tokens, e.layers, e.total_bytes, e.tail_us_median, e.whole_transfer_us_median
        );
    }
    if let Some(p) = &a.out {
        super::write_json(p, &report)?;
    }
    Ok(())
}

/// `--end-to-end`: the workers' own KV path.
fn worker_path(rt: &tokio::runtime::Runtime, a: &TransferBenchArgs) -> anyhow::Result<()> {
    let sizes: Vec<u64> = [16u64 << 20, 64 << 20, 256 << 20]
        .into_iter()
        .filter(|&s| s <= a.bytes.max(16 << 20))
        .collect();
    let r = rt.block_on(bench::worker_path(WorkerPathOptions {
        backend: a.backend,
        model: a.model.clone(),
        sizes,
        runs: a.runs,
        integrity: a.integrity == Switch::On,
    }))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "workers' KV path, backend {:?}, integrity {}, f16 layout {} bytes/token \
             (copies: counted by the workers' code, per payload byte)",
            r.backend,
            if r.integrity { "on" } else { "off" },
            r.bytes_per_token,
        );
        println!(
            "{:>12} {:>9} {:>10} {:>12} {:>8} {:>7}",
            "bytes", "requests", "GB/s", "memcpy GB/s", "ratio", "copies"
        );
        for p in &r.points {
            println!(
                "{:>12} {:>9} {:>10.2} {:>12.2} {:>8.2} {:>7.2}",
                p.bytes, p.requests, p.gbps, p.memcpy_gbps, p.ratio_to_memcpy, p.copies_per_byte
            );
        }
    }
    if let Some(p) = &a.out {
        super::write_json(p, &r)?;
    }
    Ok(())
}
