//! Summaries of a sample of latencies: mean, standard deviation, min, max and percentiles.
//!
//! Percentiles interpolate linearly between the closest ranks (numpy's default, which vLLM's
//! `bench serve` uses): the p-th percentile of n sorted values is at rank p/100·(n−1).
//!
//! Invariants: min <= p50 <= p90 <= p99 <= max; an empty sample has no summary; NaN values
//! are dropped before summarising.

use serde::{Deserialize, Serialize};

/// The p-th percentile (0..=100) of `sorted` (ascending, no NaN); None when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let (first, last) = (sorted.first()?, sorted.last()?);
    let p = p.clamp(0.0, 100.0);
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let (a, b) = (
        sorted.get(lo).unwrap_or(first),
        sorted.get(hi).unwrap_or(last),
    );
    Some(a + (b - a) * (rank - lo as f64))
}

/// The median of `values` (the mean of the middle two of an even count; NaN dropped); None
/// when there is none.
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub count: usize,
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Dist {
    /// Summary of `values` (any order); None when there is no finite value.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Dist> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        Some(Dist {
            count: n,
            mean,
            std: var.sqrt(),
            min: *v.first()?,
            p50: percentile(&v, 50.0)?,
            p90: percentile(&v, 90.0)?,
            p99: percentile(&v, 99.0)?,
            max: *v.last()?,
        })
    }

    /// The same summary with every value multiplied by `k` (e.g. seconds to milliseconds).
    pub fn scaled(&self, k: f64) -> Dist {
        Dist {
            count: self.count,
            mean: self.mean * k,
            std: self.std * k,
            min: self.min * k,
            p50: self.p50 * k,
            p90: self.p90 * k,
            p99: self.p99 * k,
            max: self.max * k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_0_to_100_are_the_ranks_themselves() {
        let v: Vec<f64> = (0..=100).map(f64::from).collect();
        for p in [0.0, 1.0, 50.0, 90.0, 99.0, 100.0, 37.5] {
            assert_eq!(percentile(&v, p), Some(p));
        }
    }

    #[test]
    fn percentiles_interpolate_between_neighbours() {
        let v = [10.0, 20.0];
        let mid = (v[0] + v[1]) / 2.0;
        assert_eq!(percentile(&v, 50.0), Some(mid));
        assert_eq!(percentile(&v, 0.0), Some(v[0]));
        assert_eq!(percentile(&v, 100.0), Some(v[1]));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn dist_is_ordered_and_order_independent() {
        let xs: Vec<f64> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f64 * 0.5)
            .collect();
        let d = Dist::of(xs.iter().copied()).unwrap();
        let mut rev = xs.clone();
        rev.reverse();
        assert_eq!(Dist::of(rev), Some(d.clone()));
        assert_eq!(d.count, xs.len());
        assert!(d.min <= d.p50 && d.p50 <= d.p90 && d.p90 <= d.p99 && d.p99 <= d.max);
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((d.mean - mean).abs() < 1e-9);
    }

    #[test]
    fn empty_or_nan_only_has_no_summary_and_nan_is_dropped() {
        assert_eq!(Dist::of(Vec::new()), None);
        assert_eq!(Dist::of([f64::NAN]), None);
        let d = Dist::of([1.0, f64::NAN, 3.0]).unwrap();
        assert_eq!(d.count, 2);
        assert_eq!(d.mean, 2.0);
    }

    #[test]
    fn scaling_scales_every_statistic() {
        let d = Dist::of([1.0, 2.0, 4.0]).unwrap();
        let s = d.scaled(1000.0);
        assert_eq!(s.count, d.count);
        for (a, b) in [
            (s.mean, d.mean),
            (s.std, d.std),
            (s.min, d.min),
            (s.p50, d.p50),
            (s.p99, d.p99),
            (s.max, d.max),
        ] {
            assert!((a - b * 1000.0).abs() < 1e-9);
        }
    }
}
