//! When requests are sent: the gaps between consecutive arrivals.
//!
//! - No rate: every gap is zero (all requests are due at once; `--max-concurrency` turns
//!   that into a closed loop of N clients).
//! - Rate R, burstiness B: gaps are Gamma(shape B, scale 1/(R·B)), as in vLLM's
//!   `bench serve`. The mean gap is 1/R whatever B is; the coefficient of variation of the
//!   gaps is 1/√B, so B = 1 is a Poisson process (exponential gaps), B < 1 burstier and
//!   B > 1 more regular.
//!
//! Invariants: gaps are finite and >= 0; the same seed gives the same gaps.

use rand::Rng;
use rand_distr::{Distribution, Exp, Gamma};

use crate::error::{BenchError, Result};

#[derive(Debug, Clone)]
pub enum Arrival {
    /// Every request is due immediately.
    Immediate,
    /// Poisson process (exponential gaps) of `rate` requests per second.
    Poisson { rate: f64, gaps: Exp<f64> },
    /// Gamma-distributed gaps: `rate` requests per second on average, shape `burstiness`.
    Gamma {
        rate: f64,
        burstiness: f64,
        gaps: Gamma<f64>,
    },
}

impl Arrival {
    /// `rate`: requests per second (None or infinity: all at once); `burstiness`: Gamma shape.
    pub fn new(rate: Option<f64>, burstiness: f64) -> Result<Self> {
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(BenchError::config(format!(
                "--burstiness must be a positive number, got {burstiness}"
            )));
        }
        let rate = match rate {
            None => return Ok(Arrival::Immediate),
            Some(r) if r.is_infinite() && r > 0.0 => return Ok(Arrival::Immediate),
            Some(r) if r.is_finite() && r > 0.0 => r,
            Some(r) => {
                return Err(BenchError::config(format!(
                    "--request-rate must be positive, got {r}"
                )))
            }
        };
        if burstiness == 1.0 {
            let gaps = Exp::new(rate).map_err(|e| BenchError::config(e.to_string()))?;
            return Ok(Arrival::Poisson { rate, gaps });
        }
        let gaps = Gamma::new(burstiness, 1.0 / (rate * burstiness))
            .map_err(|e| BenchError::config(e.to_string()))?;
        Ok(Arrival::Gamma {
            rate,
            burstiness,
            gaps,
        })
    }

    /// Requests per second on average (None: unbounded).
    pub fn rate(&self) -> Option<f64> {
        match self {
            Arrival::Immediate => None,
            Arrival::Poisson { rate, .. } | Arrival::Gamma { rate, .. } => Some(*rate),
        }
    }

    /// Seconds from the previous arrival to the next one.
    pub fn next_gap(&self, rng: &mut impl Rng) -> f64 {
        let g = match self {
            Arrival::Immediate => 0.0,
            Arrival::Poisson { gaps, .. } => gaps.sample(rng),
            Arrival::Gamma { gaps, .. } => gaps.sample(rng),
        };
        if g.is_finite() && g > 0.0 {
            g
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    const N: usize = 40_000;

    /// Mean and coefficient of variation of `N` gaps.
    fn gap_stats(a: &Arrival, seed: u64) -> (f64, f64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let gaps: Vec<f64> = (0..N).map(|_| a.next_gap(&mut rng)).collect();
        let mean = gaps.iter().sum::<f64>() / N as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (N - 1) as f64;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_gaps_have_the_requested_mean_rate_and_cv_one() {
        for rate in [0.5, 4.0, 50.0] {
            let a = Arrival::new(Some(rate), 1.0).unwrap();
            assert!(matches!(a, Arrival::Poisson { .. }));
            let (mean, cv) = gap_stats(&a, 7);
            let measured_rate = 1.0 / mean;
            assert!(
                (measured_rate - rate).abs() / rate < 0.03,
                "rate {rate}: measured {measured_rate}"
            );
            assert!((cv - 1.0).abs() < 0.05, "rate {rate}: cv {cv}");
        }
    }

    #[test]
    fn gamma_keeps_the_rate_and_burstiness_sets_the_cv() {
        let rate = 8.0;
        let mut cvs = Vec::new();
        for b in [0.25, 0.5, 2.0, 4.0] {
            let a = Arrival::new(Some(rate), b).unwrap();
            let (mean, cv) = gap_stats(&a, 11);
            let measured_rate = 1.0 / mean;
            assert!(
                (measured_rate - rate).abs() / rate < 0.04,
                "burstiness {b}: measured rate {measured_rate}"
            );
            let expected_cv = 1.0 / b.sqrt();
            assert!(
                (cv - expected_cv).abs() / expected_cv < 0.06,
                "burstiness {b}: cv {cv}, expected {expected_cv}"
            );
            cvs.push(cv);
        }
        // Burstier (smaller shape) means more variable gaps.
        assert!(cvs.windows(2).all(|w| w[0] > w[1]), "{cvs:?}");
    }

    #[test]
    fn no_rate_means_every_request_is_due_at_once() {
        for rate in [None, Some(f64::INFINITY)] {
            let a = Arrival::new(rate, 1.0).unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            assert!((0..100).all(|_| a.next_gap(&mut rng) == 0.0));
            assert_eq!(a.rate(), None);
        }
    }

    #[test]
    fn same_seed_same_gaps() {
        let a = Arrival::new(Some(3.0), 0.5).unwrap();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..64).map(|_| a.next_gap(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn rejects_nonsense() {
        assert!(Arrival::new(Some(0.0), 1.0).is_err());
        assert!(Arrival::new(Some(-1.0), 1.0).is_err());
        assert!(Arrival::new(Some(f64::NAN), 1.0).is_err());
        assert!(Arrival::new(Some(1.0), 0.0).is_err());
    }
}
