//! Reference measurements taken in the same run as the transfer benchmark: `iperf3` over
//! loopback (for tcp) and a plain `memcpy` of the same size (for shm and local).
//!
//! Invariant: a missing or failing `iperf3` never fails the benchmark; it yields `Err(note)`
//! which the report carries as text. Spawned processes are killed on drop and every wait on
//! them is bounded.

use duet_kv_transfer::buffer::Buffer;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// One reference measurement.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RefPoint {
    pub bytes: u64,
    pub seconds: f64,
}

const IPERF_START: Duration = Duration::from_secs(5);
const IPERF_RUN: Duration = Duration::from_secs(120);

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

/// Runs `iperf3 -c 127.0.0.1 -n BYTES -P K -J` against a one-off local server.
pub(crate) async fn iperf3(bytes: u64, streams: usize) -> Result<RefPoint, String> {
    let port = free_port()?.to_string();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "--forceflush", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                "iperf3 not found on PATH (install the iperf3 package); tcp reference skipped"
                    .to_string()
            } else {
                format!("could not start iperf3: {e}")
            }
        })?;
    let stdout = server
        .stdout
        .take()
        .ok_or_else(|| "iperf3 server has no stdout".to_string())?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(IPERF_START, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("listening") {
                return true;
            }
        }
        false
    })
    .await;
    if ready != Ok(true) {
        return Err("iperf3 server did not start listening".into());
    }
    // Keep draining the server's output so that it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let len = bytes.clamp(1024, 128 * 1024).to_string();
    let client = Command::new("iperf3")
        .args([
            "-c",
            "127.0.0.1",
            "-p",
            &port,
            "-J",
            "-n",
            &bytes.to_string(),
            "-l",
            &len,
            "-P",
            &streams.to_string(),
        ])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(IPERF_RUN, client)
        .await
        .map_err(|_| "iperf3 client timed out".to_string())?
        .map_err(|e| format!("iperf3 client failed to run: {e}"))?;
    let _ = tokio::time::timeout(Duration::from_secs(2), server.wait()).await;
    parse_iperf3(&out.stdout)
}

/// Extracts bytes and seconds received from iperf3's `-J` output.
pub(crate) fn parse_iperf3(json: &[u8]) -> Result<RefPoint, String> {
    let v: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| format!("iperf3 output is not JSON: {e}"))?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        return Err(format!("iperf3 error: {err}"));
    }
    // Very short tests sometimes carry no receiver-side sum; fall back to the sender's.
    for key in ["sum_received", "sum_sent"] {
        let sum = &v["end"][key];
        if let (Some(b), Some(s)) = (sum["bytes"].as_f64(), sum["seconds"].as_f64()) {
            if b > 0.0 && s > 0.0 {
                return Ok(RefPoint {
                    bytes: b as u64,
                    seconds: s,
                });
            }
        }
    }
    Err("iperf3 JSON lacks end.sum_received/sum_sent bytes and seconds".into())
}

/// Median time of `iters` plain copies of `bytes` bytes: between allocator buffers, or with
/// `huge` between mappings on transparent huge pages (as the sender's payload then is).
pub(crate) fn memcpy(bytes: u64, iters: u32, huge: bool) -> RefPoint {
    let n = bytes as usize;
    let mut src = Buffer::payload(n, huge);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut dst = Buffer::payload(n, huge);
    dst.copy_from_slice(&src); // fault the pages in
    let mut times: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    RefPoint {
        bytes,
        seconds: times[times.len() / 2],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_iperf3_json() {
        let j = br#"{"end":{"sum_received":{"bytes":1048576,"seconds":0.5,"bits_per_second":1}}}"#;
        let p = parse_iperf3(j).unwrap();
        assert_eq!(p.bytes, 1 << 20);
        assert!((p.seconds - 0.5).abs() < 1e-9);
        assert!(parse_iperf3(br#"{"error":"unable to connect"}"#).is_err());
        assert!(parse_iperf3(b"not json").is_err());
    }
}
