//! Request traces as simulator input, instead of the generated workload:
//!
//! - **Azure LLM inference trace** (CSV, `TIMESTAMP,ContextTokens,GeneratedTokens`, the
//!   timestamp as `2023-11-16 18:15:46.6805900`): prompts share nothing;
//! - **Mooncake trace** (JSON lines, `{"timestamp": ms, "input_length": n,
//!   "output_length": m, "hash_ids": [...]}`, one hash id per 512-token block): requests
//!   with equal leading hash ids share those prompt blocks, as in Mooncake's release.
//!
//! Arrival times are the trace's, relative to its first request (`speedup` divides them).
//! Invariants: timestamps never decrease (a trace that goes back is refused), lengths are
//! at least 1; every error names the file, the line and the field.

use std::path::Path;

use crate::error::{PlanError, Result};
use crate::sim::{SimRequest, Unit};

/// Tokens per Mooncake hash id.
const MOONCAKE_BLOCK: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    Azure,
    Mooncake,
}

impl TraceFormat {
    /// By extension: `.csv` Azure, `.jsonl` Mooncake.
    pub fn of(path: &Path) -> Option<TraceFormat> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("csv") => Some(TraceFormat::Azure),
            Some("jsonl") => Some(TraceFormat::Mooncake),
            _ => None,
        }
    }
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the epoch of `2023-11-16 18:15:46.6805900`.
fn azure_time(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    let sec = t.next()?.parse::<f64>().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    Some(days_from_civil(y, m, day) as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + sec)
}

fn count(at: &str, field: &str, v: Option<i64>) -> Result<usize> {
    match v {
        Some(n) if n >= 1 => Ok(n as usize),
        Some(n) => Err(PlanError::input(
            at,
            field,
            format!("{n} must be at least 1"),
        )),
        None => Err(PlanError::input(at, field, "missing or not an integer")),
    }
}

/// Hashes of the 16-token (`block_size`) blocks of a prompt whose 512-token blocks carry
/// `ids`: equal leading ids give equal leading hashes.
fn mooncake_hashes(ids: &[u64], input: usize, block_size: usize) -> Vec<u64> {
    let per = MOONCAKE_BLOCK / block_size.max(1);
    let full = input / block_size.max(1);
    let mut out = Vec::with_capacity(full);
    let mut h: u64 = 0x6d6f_6f6e_6361_6b65;
    for i in 0..full {
        let id = ids
            .get(i / per.max(1))
            .copied()
            .unwrap_or(u64::MAX - i as u64);
        h = (h ^ id).wrapping_mul(0x0100_0000_01b3).rotate_left(23) ^ (i % per.max(1)) as u64;
        out.push(h);
    }
    out
}

/// Unique hashes for a prompt that shares nothing (request `n` of the trace).
fn unique_hashes(n: usize, input: usize, block_size: usize) -> Vec<u64> {
    (0..input / block_size.max(1))
        .map(|i| ((n as u64) << 32 | i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xa5a5)
        .collect()
}

/// Reads `path` as `format`: at most `limit` requests, times divided by `speedup`.
pub fn read(
    path: &Path,
    format: TraceFormat,
    block_size: usize,
    limit: Option<usize>,
    speedup: f64,
) -> Result<Vec<Unit>> {
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(PlanError::setting("--trace-speedup", "a positive number"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| PlanError::file(path, e))?;
    let name = path.display().to_string();
    let mut units = Vec::new();
    let mut first: Option<f64> = None;
    let mut last = f64::NEG_INFINITY;
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| units.len() >= n) {
            break;
        }
        let at = format!("{name}:{}", i + 1);
        if line.trim().is_empty() {
            continue;
        }
        let (t, input, output, hashes) = match format {
            TraceFormat::Azure => {
                if i == 0 && line.to_ascii_uppercase().starts_with("TIMESTAMP") {
                    continue;
                }
                let f: Vec<&str> = line.split(',').collect();
                if f.len() < 3 {
                    return Err(PlanError::input(
                        &at,
                        "(row)",
                        "expected TIMESTAMP,ContextTokens,GeneratedTokens",
                    ));
                }
                let t = azure_time(f[0]).ok_or_else(|| {
                    PlanError::input(
                        &at,
                        "TIMESTAMP",
                        format!("{:?} is not YYYY-MM-DD HH:MM:SS.f", f[0]),
                    )
                })?;
                let input = count(&at, "ContextTokens", f[1].trim().parse().ok())?;
                let output = count(&at, "GeneratedTokens", f[2].trim().parse().ok())?;
                (
                    t,
                    input,
                    output,
                    unique_hashes(units.len(), input, block_size),
                )
            }
            TraceFormat::Mooncake => {
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| PlanError::input(&at, "(json)", e.to_string()))?;
                let t = v["timestamp"]
                    .as_f64()
                    .filter(|t| t.is_finite() && *t >= 0.0)
                    .ok_or_else(|| {
                        PlanError::input(
                            &at,
                            "timestamp",
                            "missing, or not a number >= 0 (milliseconds)",
                        )
                    })?
                    / 1e3;
                let input = count(&at, "input_length", v["input_length"].as_i64())?;
                let output = count(&at, "output_length", v["output_length"].as_i64())?;
                let ids: Vec<u64> = match v.get("hash_ids") {
                    None => Vec::new(),
                    Some(a) => a
                        .as_array()
                        .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
                        .ok_or_else(|| {
                            PlanError::input(&at, "hash_ids", "not a list of integers >= 0")
                        })?,
                };
                (t, input, output, mooncake_hashes(&ids, input, block_size))
            }
        };
        if t < last {
            return Err(PlanError::input(
                &at,
                "timestamp",
                format!("{t} s is before the line above ({last} s): timestamps must not decrease"),
            ));
        }
        last = t;
        let t0 = *first.get_or_insert(t);
        units.push(Unit {
            due_s: (t - t0) / speedup,
            turns: vec![SimRequest {
                prompt_len: input,
                output_len: output,
                hashes,
            }],
        });
    }
    if units.is_empty() {
        return Err(PlanError::input(name, "(rows)", "no request in the trace"));
    }
    Ok(units)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("duet-trace-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn azure_rows_become_requests_at_their_offsets() {
        let p = write(
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n\
             2023-11-16 23:59:59.5000000,100,10\n\
             2023-11-17 00:00:01.0000000,40,2\n",
        );
        let u = read(&p, TraceFormat::Azure, 16, None, 1.0).unwrap();
        assert_eq!(u.len(), 2);
        assert!(
            (u[1].due_s - 1.5).abs() < 1e-9,
            "across midnight: {}",
            u[1].due_s
        );
        assert_eq!(
            (u[0].turns[0].prompt_len, u[0].turns[0].output_len),
            (100, 10)
        );
        assert_eq!(u[0].turns[0].hashes.len(), 6);
        let halved = read(&p, TraceFormat::Azure, 16, Some(1), 2.0).unwrap();
        assert_eq!(halved.len(), 1);
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn mooncake_hash_ids_share_prefix_blocks() {
        let p = write(
            "m.jsonl",
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 250, \"input_length\": 700, \"output_length\": 5, \"hash_ids\": [1, 3]}\n",
        );
        let u = read(&p, TraceFormat::Mooncake, 16, None, 1.0).unwrap();
        let (a, b) = (&u[0].turns[0].hashes, &u[1].turns[0].hashes);
        assert_eq!(a[..32], b[..32], "the first 512 tokens are shared");
        assert_ne!(a[32], b[32]);
        assert!((u[1].due_s - 0.25).abs() < 1e-9);
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn bad_rows_name_the_file_line_and_field() {
        let e = |name: &str, text: &str, f| {
            let p = write(name, text);
            let e = read(&p, f, 16, None, 1.0).unwrap_err().to_string();
            let _ = std::fs::remove_file(&p);
            e
        };
        let m = TraceFormat::Mooncake;
        let err = e("b1.jsonl", "{\"timestamp\": 5, \"input_length\": 10}\n", m);
        assert!(err.contains("b1.jsonl:1: output_length"), "{err}");
        let err = e(
            "b2.jsonl",
            "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1}\n{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1}\n",
            m,
        );
        assert!(
            err.contains("b2.jsonl:2: timestamp") && err.contains("must not decrease"),
            "{err}"
        );
        let err = e(
            "b3.jsonl",
            "{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1}\n",
            m,
        );
        assert!(err.contains("b3.jsonl:1: timestamp"), "{err}");
        let err = e(
            "b4.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,-3,2\n",
            TraceFormat::Azure,
        );
        assert!(err.contains("b4.csv:2: ContextTokens"), "{err}");
        let err = e("b5.csv", "2023-13-16 18:15:46.68,3,2\n", TraceFormat::Azure);
        assert!(err.contains("b5.csv:1: TIMESTAMP"), "{err}");
    }
}
