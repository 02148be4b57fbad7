//! Runs the transfer benchmark and prints its JSON report:
//! `cargo run -p duet-bench --example bench_transfer -- tcp 1073741824 1 [e2e]`
//! (arguments: backend, max bytes, streams, then `e2e` for the end-to-end figure or `nomac`
//! to turn frame MACs off, and `huge` to put the payload and the memcpy reference on
//! transparent huge pages).

use duet_bench::transfer::{end_to_end, run, BenchOptions, E2eOptions};
use duet_kv_transfer::BackendKind;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend: BackendKind = args.first().map(String::as_str).unwrap_or("tcp").parse()?;
    let max_bytes = args
        .get(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1u64 << 30);
    let streams = args
        .get(2)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1usize);
    if args.get(3).map(String::as_str) == Some("e2e") {
        let r = end_to_end(E2eOptions {
            backend,
            ..E2eOptions::default()
        })
        .await?;
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let integrity = args.get(3).map(String::as_str) != Some("nomac");
    let r = run(BenchOptions {
        backend,
        max_bytes,
        streams,
        integrity,
        huge_pages: args.iter().any(|a| a == "huge"),
        ..BenchOptions::default()
    })
    .await?;
    println!("{}", serde_json::to_string_pretty(&r)?);
    Ok(())
}
