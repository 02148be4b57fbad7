//! Service-level objectives, attainment and goodput (as DistServe defines them).
//!
//! - A request meets the SLO when it succeeded, its TTFT is within the TTFT bound and its
//!   TPOT within the TPOT bound (a request with a single output token has no TPOT and
//!   meets that bound trivially; an unset bound always holds).
//! - Attainment of a run: requests meeting the SLO / all measured requests (failures count
//!   as misses).
//! - SLO goodput of a run (vLLM's `--goodput`): requests meeting the SLO per second.
//! - Goodput of a sweep (DistServe): the highest offered request rate of the sweep whose
//!   attainment is at least the target (90% by default); None when no rate reaches it.
//!
//! Invariants: 0 <= attainment <= 1; goodput of a sweep is one of its rates.

use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};
use crate::record::RequestRecord;

#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    #[serde(default)]
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft=MS,tpot=MS[,e2e=MS]` (milliseconds, any subset, at least one).
    pub fn parse(s: &str) -> Result<Slo> {
        let mut slo = Slo::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                BenchError::config(format!("--slo: `{part}` is not NAME=MILLISECONDS"))
            })?;
            let ms: f64 = v
                .trim()
                .trim_end_matches("ms")
                .parse()
                .ok()
                .filter(|x: &f64| x.is_finite() && *x > 0.0)
                .ok_or_else(|| {
                    BenchError::config(format!("--slo: `{v}` is not a positive number"))
                })?;
            match k.trim() {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2e" => slo.e2e_ms = Some(ms),
                other => {
                    return Err(BenchError::config(format!(
                        "--slo: unknown metric `{other}` (ttft, tpot, e2e)"
                    )))
                }
            }
        }
        if slo == Slo::default() {
            return Err(BenchError::config("--slo: give at least one bound"));
        }
        Ok(slo)
    }

    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let ms = |s: Option<f64>| s.map(|s| s * 1000.0);
        self.met(r.ok(), ms(r.ttft_s), ms(r.tpot_s), ms(r.e2e_s))
    }

    /// Whether a request that ended `ok` with these times (milliseconds) meets every
    /// bound; TPOT does not apply to a request without one (a single token).
    pub fn met(
        &self,
        ok: bool,
        ttft_ms: Option<f64>,
        tpot_ms: Option<f64>,
        e2e_ms: Option<f64>,
    ) -> bool {
        let within = |bound: Option<f64>, value_ms: Option<f64>| match (bound, value_ms) {
            (None, _) => true,
            (Some(b), Some(v)) => v <= b,
            (Some(_), None) => false,
        };
        ok && within(self.ttft_ms, ttft_ms)
            && (self.tpot_ms.is_none() || tpot_ms.is_none() || within(self.tpot_ms, tpot_ms))
            && within(self.e2e_ms, e2e_ms)
    }

    /// (requests meeting the SLO, attainment); attainment is None without requests.
    pub fn attainment(&self, records: &[RequestRecord]) -> (usize, Option<f64>) {
        let met = records.iter().filter(|r| self.met_by(r)).count();
        let share = (!records.is_empty()).then(|| met as f64 / records.len() as f64);
        (met, share)
    }
}

/// Highest rate whose attainment is at least `target`.
pub fn goodput_rate(points: &[(f64, f64)], target: f64) -> Option<f64> {
    points
        .iter()
        .filter(|(_, att)| *att >= target)
        .map(|(rate, _)| *rate)
        .max_by(f64::total_cmp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RequestError;

    fn rec(ttft_ms: f64, tpot_ms: Option<f64>, failed: bool) -> RequestRecord {
        RequestRecord {
            index: 0,
            scheduled_s: 0.0,
            arrival_s: 0.0,
            prompt_tokens: 10,
            output_tokens: if tpot_ms.is_some() { 5 } else { 1 },
            requested_output_tokens: 5,
            ttft_s: Some(ttft_ms / 1000.0),
            tpot_s: tpot_ms.map(|t| t / 1000.0),
            itl_s: Vec::new(),
            e2e_s: Some(1.0),
            placement: None,
            cached_tokens: None,
            conversation: None,
            turn: None,
            error: failed.then(|| RequestError::new("http:500", "boom")),
        }
    }

    #[test]
    fn parses_bounds() {
        let s = Slo::parse("ttft=500,tpot=50").unwrap();
        assert_eq!(
            (s.ttft_ms, s.tpot_ms, s.e2e_ms),
            (Some(500.0), Some(50.0), None)
        );
        let s = Slo::parse("tpot=20ms").unwrap();
        assert_eq!((s.ttft_ms, s.tpot_ms), (None, Some(20.0)));
        for bad in ["", "ttft", "ttft=0", "ttft=-3", "speed=4", "ttft=abc"] {
            assert!(Slo::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn attainment_counts_requests_meeting_both_bounds() {
        let slo = Slo::parse("ttft=100,tpot=10").unwrap();
        let ttft_bound = slo.ttft_ms.unwrap();
        let tpot_bound = slo.tpot_ms.unwrap();
        let records = vec![
            rec(ttft_bound * 0.5, Some(tpot_bound * 0.5), false), // meets both
            rec(ttft_bound, Some(tpot_bound), false),             // on the bounds: meets
            rec(ttft_bound * 2.0, Some(tpot_bound * 0.5), false), // TTFT too slow
            rec(ttft_bound * 0.5, Some(tpot_bound * 2.0), false), // TPOT too slow
            rec(ttft_bound * 0.5, None, false),                   // one token: no TPOT
            rec(ttft_bound * 0.5, Some(tpot_bound * 0.5), true),  // failed
        ];
        let meets = [true, true, false, false, true, false];
        for (r, want) in records.iter().zip(meets) {
            assert_eq!(slo.met_by(r), want, "{r:?}");
        }
        let (met, att) = slo.attainment(&records);
        let expected = meets.iter().filter(|&&m| m).count();
        assert_eq!(met, expected);
        assert_eq!(att, Some(expected as f64 / records.len() as f64));
        assert_eq!(slo.attainment(&[]), (0, None));
    }

    #[test]
    fn goodput_is_the_highest_rate_reaching_the_target() {
        let target = 0.9;
        let points = [
            (1.0, 1.0),
            (2.0, 0.97),
            (4.0, 0.91),
            (8.0, 0.6),
            (16.0, 0.1),
        ];
        assert_eq!(goodput_rate(&points, target), Some(4.0));
        // Order of the sweep does not matter.
        let mut shuffled = points;
        shuffled.reverse();
        assert_eq!(goodput_rate(&shuffled, target), Some(4.0));
        // No rate meets it.
        assert_eq!(goodput_rate(&[(1.0, 0.5), (2.0, 0.2)], target), None);
        assert_eq!(goodput_rate(&[], target), None);
    }
}
