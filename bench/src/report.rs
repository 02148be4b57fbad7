//! The results of one invocation: a summary per run (one run per offered rate), every
//! request's record, the sweep's SLO attainment and goodput, the configuration; written as
//! JSON (`--output-json`) and read back by `duet bench plot`; rendered as a table.
//!
//! Throughputs count completed requests only, over the run's wall time (first send until
//! the last response ended). Latency summaries are in milliseconds over completed requests;
//! ITL pools the gaps of every completed request.
//!
//! Invariants: `completed + failed == requests == records.len()`; the errors by kind add up
//! to `failed`; a report that does not carry [`SCHEMA`] is refused on reading.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};
use crate::record::RequestRecord;
use crate::slo::{goodput_rate, Slo};
use crate::stats::Dist;

pub const SCHEMA: &str = "duet-bench-serve/1";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SloResult {
    /// Requests meeting every bound.
    pub met: usize,
    /// met / requests.
    pub attainment: Option<f64>,
    /// Requests meeting the SLO per second (vLLM's goodput).
    pub goodput_rps: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Offered request rate (None: unbounded).
    pub rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub errors: BTreeMap<String, usize>,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Prompt tokens of completed requests the server served from its prefix cache (0
    /// when it never said).
    #[serde(default)]
    pub cached_tokens: usize,
    /// cached / prompt tokens, over the completed requests that reported it.
    #[serde(default)]
    pub prefix_hit_ratio: Option<f64>,
    pub ttft_ms: Option<Dist>,
    pub tpot_ms: Option<Dist>,
    pub itl_ms: Option<Dist>,
    pub e2e_ms: Option<Dist>,
    pub slo: Option<SloResult>,
}

impl Summary {
    pub fn of(
        records: &[RequestRecord],
        duration_s: f64,
        rate: Option<f64>,
        max_concurrency: Option<usize>,
        slo: Option<&Slo>,
    ) -> Summary {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let mut errors = BTreeMap::new();
        for e in records.iter().filter_map(|r| r.error.as_ref()) {
            *errors.entry(e.kind.clone()).or_insert(0) += 1;
        }
        let prompt_tokens: usize = ok.iter().map(|r| r.prompt_tokens).sum();
        let output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
        let reported: Vec<&&RequestRecord> =
            ok.iter().filter(|r| r.cached_tokens.is_some()).collect();
        let cached_tokens: usize = reported.iter().filter_map(|r| r.cached_tokens).sum();
        let reported_prompt: usize = reported.iter().map(|r| r.prompt_tokens).sum();
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        let ms = |d: Option<Dist>| d.map(|d| d.scaled(1000.0));
        Summary {
            rate,
            max_concurrency,
            requests: records.len(),
            completed: ok.len(),
            failed: records.len() - ok.len(),
            errors,
            duration_s,
            request_throughput: per_s(ok.len() as f64),
            output_throughput: per_s(output_tokens as f64),
            total_token_throughput: per_s((prompt_tokens + output_tokens) as f64),
            prompt_tokens,
            output_tokens,
            cached_tokens,
            prefix_hit_ratio: (reported_prompt > 0)
                .then(|| cached_tokens as f64 / reported_prompt as f64),
            ttft_ms: ms(Dist::of(ok.iter().filter_map(|r| r.ttft_s))),
            tpot_ms: ms(Dist::of(ok.iter().filter_map(|r| r.tpot_s))),
            itl_ms: ms(Dist::of(ok.iter().flat_map(|r| r.itl_s.iter().copied()))),
            e2e_ms: ms(Dist::of(ok.iter().filter_map(|r| r.e2e_s))),
            slo: slo.map(|s| {
                let (met, attainment) = s.attainment(records);
                SloResult {
                    met,
                    attainment,
                    goodput_rps: per_s(met as f64),
                }
            }),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunReport {
    pub summary: Summary,
    pub requests: Vec<RequestRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepPoint {
    pub rate: f64,
    pub attainment: f64,
    pub request_throughput: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepSummary {
    pub slo: Slo,
    pub attainment_target: f64,
    pub points: Vec<SweepPoint>,
    /// Highest offered rate whose attainment reached the target (DistServe's goodput).
    pub goodput_rate: Option<f64>,
}

impl SweepSummary {
    /// From the runs that had a finite offered rate; None without an SLO or such runs.
    pub fn of(runs: &[RunReport], slo: Option<&Slo>, target: f64) -> Option<SweepSummary> {
        let slo = *slo?;
        let points: Vec<SweepPoint> = runs
            .iter()
            .filter_map(|r| {
                Some(SweepPoint {
                    rate: r.summary.rate.filter(|x| x.is_finite())?,
                    attainment: r.summary.slo.as_ref()?.attainment?,
                    request_throughput: r.summary.request_throughput,
                })
            })
            .collect();
        if points.is_empty() {
            return None;
        }
        let pairs: Vec<(f64, f64)> = points.iter().map(|p| (p.rate, p.attainment)).collect();
        Some(SweepSummary {
            slo,
            attainment_target: target,
            goodput_rate: goodput_rate(&pairs, target),
            points,
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub label: String,
    pub backend: String,
    pub url: String,
    pub model: String,
    /// Seconds since the Unix epoch when the first run started.
    pub started_unix_s: f64,
    /// The configuration (`ServeConfig`), as given.
    pub config: serde_json::Value,
    pub runs: Vec<RunReport>,
    pub sweep: Option<SweepSummary>,
}

impl Report {
    pub fn read(path: &Path) -> Result<Report> {
        let bytes = std::fs::read(path).map_err(|e| BenchError::file(path, e))?;
        let v: serde_json::Value = serde_json::from_slice(&bytes)?;
        if v.get("schema").and_then(|s| s.as_str()) != Some(SCHEMA) {
            return Err(BenchError::Report {
                path: path.to_path_buf(),
                reason: format!("no \"schema\": \"{SCHEMA}\""),
            });
        }
        serde_json::from_value(v).map_err(|e| BenchError::Report {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| BenchError::file(dir, e))?;
        }
        let bytes = serde_json::to_vec_pretty(self)?;
        std::fs::write(path, bytes).map_err(|e| BenchError::file(path, e))
    }

    /// The summary table printed at the end of a run.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "duet bench serve: {} ({} {}, model {})",
            self.label,
            self.backend,
            self.url,
            if self.model.is_empty() {
                "-"
            } else {
                &self.model
            }
        );
        let _ = writeln!(
            s,
            "{:>7} {:>5} {:>5} {:>5} {:>7} {:>8} {:>8} | {:>22} | {:>22} | {:>15} | {:>15} | {:>6}",
            "rate",
            "conc",
            "done",
            "fail",
            "req/s",
            "out t/s",
            "tot t/s",
            "TTFT ms mean p50 p99",
            "TPOT ms mean p50 p99",
            "ITL ms p50 p99",
            "E2E ms p50 p99",
            "SLO"
        );
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
        for r in &self.runs {
            let m = &r.summary;
            let three = |d: &Option<Dist>| {
                format!(
                    "{:>7} {:>7} {:>6}",
                    f(d.as_ref().map(|d| d.mean)),
                    f(d.as_ref().map(|d| d.p50)),
                    f(d.as_ref().map(|d| d.p99))
                )
            };
            let two = |d: &Option<Dist>| {
                format!(
                    "{:>7} {:>7}",
                    f(d.as_ref().map(|d| d.p50)),
                    f(d.as_ref().map(|d| d.p99))
                )
            };
            let att = m
                .slo
                .as_ref()
                .and_then(|x| x.attainment)
                .map_or("-".to_string(), |a| format!("{:.0}%", a * 100.0));
            let _ = writeln!(
                s,
                "{:>7} {:>5} {:>5} {:>5} {:>7.2} {:>8.1} {:>8.1} | {:>22} | {:>22} | {:>15} | {:>15} | {:>6}",
                m.rate.map_or("inf".to_string(), |r| format!("{r}")),
                m.max_concurrency.map_or("-".to_string(), |c| c.to_string()),
                m.completed,
                m.failed,
                m.request_throughput,
                m.output_throughput,
                m.total_token_throughput,
                three(&m.ttft_ms),
                three(&m.tpot_ms),
                two(&m.itl_ms),
                two(&m.e2e_ms),
                att
            );
            if let Some(ratio) = m.prefix_hit_ratio {
                let _ = writeln!(
                    s,
                    "        prefix cache: {} of {} prompt tokens cached ({:.1}%), {} computed",
                    m.cached_tokens,
                    m.prompt_tokens,
                    ratio * 100.0,
                    m.prompt_tokens.saturating_sub(m.cached_tokens)
                );
            }
            for (kind, n) in &m.errors {
                let _ = writeln!(s, "        {n} failed: {kind}");
            }
        }
        if let Some(sw) = &self.sweep {
            let bounds: Vec<String> = [
                ("TTFT", sw.slo.ttft_ms),
                ("TPOT", sw.slo.tpot_ms),
                ("E2E", sw.slo.e2e_ms),
            ]
            .iter()
            .filter_map(|(n, b)| b.map(|ms| format!("{n} <= {ms} ms")))
            .collect();
            let _ = writeln!(
                s,
                "SLO {}: goodput (highest rate with attainment >= {:.0}%) = {}",
                bounds.join(", "),
                sw.attainment_target * 100.0,
                sw.goodput_rate
                    .map_or("none of the rates".to_string(), |r| format!("{r} req/s"))
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RequestError;

    fn rec(i: usize, ttft: f64, e2e: f64, out: usize, err: Option<&str>) -> RequestRecord {
        RequestRecord {
            index: i,
            scheduled_s: 0.0,
            arrival_s: 0.0,
            prompt_tokens: 10,
            output_tokens: out,
            requested_output_tokens: out,
            ttft_s: Some(ttft),
            tpot_s: (out > 1).then(|| (e2e - ttft) / (out - 1) as f64),
            itl_s: vec![(e2e - ttft) / (out.max(2) - 1) as f64; out.saturating_sub(1)],
            e2e_s: Some(e2e),
            placement: None,
            cached_tokens: None,
            conversation: None,
            turn: None,
            error: err.map(|k| RequestError::new(k, "x")),
        }
    }

    #[test]
    fn counts_add_up_and_throughput_uses_completed_requests_only() {
        let records = vec![
            rec(0, 0.1, 1.0, 4, None),
            rec(1, 0.2, 1.2, 4, None),
            rec(2, 0.1, 0.5, 4, Some("http:503")),
            rec(3, 0.1, 0.5, 4, Some("http:503")),
            rec(4, 0.1, 0.5, 4, Some("timeout")),
        ];
        let duration = 2.0;
        let slo = Slo::parse("ttft=150").unwrap();
        let s = Summary::of(&records, duration, Some(1.0), None, Some(&slo));
        let ok: Vec<_> = records.iter().filter(|r| r.ok()).collect();
        assert_eq!(s.requests, records.len());
        assert_eq!(s.completed + s.failed, s.requests);
        assert_eq!(s.completed, ok.len());
        assert_eq!(s.errors.values().sum::<usize>(), s.failed);
        assert_eq!(s.errors.len(), 2);
        let out: usize = ok.iter().map(|r| r.output_tokens).sum();
        assert_eq!(s.output_tokens, out);
        assert!((s.output_throughput - out as f64 / duration).abs() < 1e-9);
        assert!((s.request_throughput - ok.len() as f64 / duration).abs() < 1e-9);
        assert_eq!(s.ttft_ms.as_ref().map(|d| d.count), Some(ok.len()));
        // Only the first request meets TTFT <= 150 ms and succeeded.
        let met = s.slo.as_ref().unwrap();
        assert_eq!(met.met, 1);
        assert_eq!(met.attainment, Some(1.0 / records.len() as f64));
    }

    #[test]
    fn sweep_goodput_and_json_round_trip() {
        let slo = Slo::parse("ttft=150").unwrap();
        let fast = vec![rec(0, 0.1, 1.0, 4, None), rec(1, 0.1, 1.0, 4, None)];
        let slow = vec![rec(0, 0.1, 1.0, 4, None), rec(1, 0.3, 1.0, 4, None)];
        let runs: Vec<RunReport> = [(1.0, fast), (2.0, slow)]
            .into_iter()
            .map(|(rate, recs)| RunReport {
                summary: Summary::of(&recs, 1.0, Some(rate), None, Some(&slo)),
                requests: recs,
            })
            .collect();
        let sweep = SweepSummary::of(&runs, Some(&slo), 0.9).unwrap();
        assert_eq!(sweep.points.len(), runs.len());
        assert_eq!(sweep.goodput_rate, runs[0].summary.rate);
        let report = Report {
            schema: SCHEMA.into(),
            label: "t".into(),
            backend: "duet".into(),
            url: "http://x".into(),
            model: String::new(),
            started_unix_s: 0.0,
            config: serde_json::json!({}),
            runs,
            sweep: Some(sweep),
        };
        let dir = std::env::temp_dir().join(format!("duet-bench-report-{}", std::process::id()));
        let path = dir.join("r.json");
        report.write(&path).unwrap();
        let back = Report::read(&path).unwrap();
        assert_eq!(back.runs.len(), report.runs.len());
        assert_eq!(back.runs[1].requests.len(), report.runs[1].requests.len());
        assert_eq!(back.sweep.and_then(|s| s.goodput_rate), Some(1.0));
        let table = report.table();
        assert_eq!(table.lines().count(), 2 + report.runs.len() + 1);
        std::fs::write(&path, b"{\"schema\": \"other\"}").unwrap();
        assert!(Report::read(&path).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
