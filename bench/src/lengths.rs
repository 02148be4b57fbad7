//! How long each request's prompt and output are (in tokens).
//!
//! A [`LengthDist`] draws one length; a [`Lengths`] pairs an input and an output
//! distribution with caps. Lognormal distributions are given by their mean and median (the
//! numbers trace papers report): median = e^μ, mean = e^(μ+σ²/2), so μ = ln(median) and
//! σ = √(2·ln(mean/median)); mean >= median is required.
//!
//! `azure-conv` is the shape of the Azure LLM inference trace 2023, conversation set
//! (input mean 1155 / median 1020 tokens, output mean 211 / median 129), optionally scaled
//! (every length multiplied by `scale`, so the shape is kept) and then capped.
//!
//! Invariants: every drawn length is >= 1; a capped length is <= its cap; the same RNG
//! state gives the same lengths.

use rand::Rng;
use rand_distr::{Distribution, LogNormal};
use serde::Serialize;

use crate::error::{BenchError, Result};

/// Azure LLM inference trace 2023, conversation: (mean, median) of input and output tokens.
pub const AZURE_CONV_INPUT: (f64, f64) = (1155.0, 1020.0);
pub const AZURE_CONV_OUTPUT: (f64, f64) = (211.0, 129.0);

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum LengthDist {
    Fixed {
        len: usize,
    },
    /// Uniform over `min..=max`.
    Uniform {
        min: usize,
        max: usize,
    },
    LogNormal {
        mean: f64,
        median: f64,
        #[serde(skip)]
        dist: LogNormal<f64>,
    },
}

impl LengthDist {
    pub fn fixed(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(BenchError::config("lengths must be at least 1"));
        }
        Ok(LengthDist::Fixed { len })
    }

    pub fn uniform(min: usize, max: usize) -> Result<Self> {
        if min == 0 || max < min {
            return Err(BenchError::config(format!(
                "uniform length range {min}..={max}: need 1 <= min <= max"
            )));
        }
        Ok(LengthDist::Uniform { min, max })
    }

    pub fn lognormal(mean: f64, median: f64) -> Result<Self> {
        if !(median.is_finite() && median > 0.0 && mean.is_finite() && mean >= median) {
            return Err(BenchError::config(format!(
                "lognormal lengths: need 0 < median <= mean, got mean {mean}, median {median}"
            )));
        }
        let mu = median.ln();
        let sigma = (2.0 * (mean / median).ln()).sqrt();
        let dist = LogNormal::new(mu, sigma).map_err(|e| BenchError::config(e.to_string()))?;
        Ok(LengthDist::LogNormal { mean, median, dist })
    }

    /// One length, before any cap (>= 1).
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        match self {
            LengthDist::Fixed { len } => *len,
            LengthDist::Uniform { min, max } => rng.random_range(*min..=*max),
            LengthDist::LogNormal { dist, .. } => {
                let x = dist.sample(rng).round();
                if x.is_finite() && x >= 1.0 {
                    // Lengths beyond usize are capped by the caller anyway.
                    x.min(usize::MAX as f64 / 2.0) as usize
                } else {
                    1
                }
            }
        }
    }
}

/// Input and output length distributions with caps.
#[derive(Debug, Clone, Serialize)]
pub struct Lengths {
    pub input: LengthDist,
    pub output: LengthDist,
    pub max_input: usize,
    pub max_output: usize,
}

impl Lengths {
    pub fn new(
        input: LengthDist,
        output: LengthDist,
        max_input: usize,
        max_output: usize,
    ) -> Result<Self> {
        if max_input == 0 || max_output == 0 {
            return Err(BenchError::config(
                "--max-input-len and --max-output-len must be at least 1",
            ));
        }
        Ok(Lengths {
            input,
            output,
            max_input,
            max_output,
        })
    }

    /// The Azure 2023 conversation shape, every length multiplied by `scale`.
    pub fn azure_conv(scale: f64, max_input: usize, max_output: usize) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(BenchError::config(format!(
                "--length-scale must be positive, got {scale}"
            )));
        }
        let (im, imed) = AZURE_CONV_INPUT;
        let (om, omed) = AZURE_CONV_OUTPUT;
        Lengths::new(
            LengthDist::lognormal(im * scale, imed * scale)?,
            LengthDist::lognormal(om * scale, omed * scale)?,
            max_input,
            max_output,
        )
    }

    /// (prompt tokens, output tokens) of one request, capped.
    pub fn sample(&self, rng: &mut impl Rng) -> (usize, usize) {
        let i = self.input.sample(rng).min(self.max_input);
        let o = self.output.sample(rng).min(self.max_output);
        (i, o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn mean_median(xs: &mut [usize]) -> (f64, f64) {
        xs.sort_unstable();
        let mean = xs.iter().sum::<usize>() as f64 / xs.len() as f64;
        (mean, xs[xs.len() / 2] as f64)
    }

    fn within(x: f64, target: f64, tol: f64) -> bool {
        (x - target).abs() / target < tol
    }

    #[test]
    fn azure_conv_matches_the_trace_before_capping() {
        let l = Lengths::azure_conv(1.0, usize::MAX, usize::MAX).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        let n = 50_000;
        let (mut ins, mut outs): (Vec<usize>, Vec<usize>) =
            (0..n).map(|_| l.sample(&mut rng)).unzip();
        let (im, imed) = mean_median(&mut ins);
        let (om, omed) = mean_median(&mut outs);
        assert!(within(im, AZURE_CONV_INPUT.0, 0.03), "input mean {im}");
        assert!(
            within(imed, AZURE_CONV_INPUT.1, 0.03),
            "input median {imed}"
        );
        assert!(within(om, AZURE_CONV_OUTPUT.0, 0.05), "output mean {om}");
        assert!(
            within(omed, AZURE_CONV_OUTPUT.1, 0.03),
            "output median {omed}"
        );
    }

    #[test]
    fn scaling_keeps_the_shape() {
        let scale = 0.25;
        let l = Lengths::azure_conv(scale, usize::MAX, usize::MAX).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (mut ins, _): (Vec<usize>, Vec<usize>) =
            (0..50_000).map(|_| l.sample(&mut rng)).unzip();
        let (im, imed) = mean_median(&mut ins);
        assert!(within(im, AZURE_CONV_INPUT.0 * scale, 0.03), "{im}");
        assert!(within(imed, AZURE_CONV_INPUT.1 * scale, 0.03), "{imed}");
    }

    #[test]
    fn caps_bound_every_sample_and_bite_when_below_the_tail() {
        let (max_in, max_out) = (512, 64);
        let l = Lengths::azure_conv(1.0, max_in, max_out).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let s: Vec<(usize, usize)> = (0..5000).map(|_| l.sample(&mut rng)).collect();
        assert!(s
            .iter()
            .all(|&(i, o)| (1..=max_in).contains(&i) && (1..=max_out).contains(&o)));
        // The trace's median is above both caps: most samples sit at the cap.
        assert!(s.iter().filter(|&&(i, _)| i == max_in).count() > s.len() / 2);
        assert!(s.iter().filter(|&&(_, o)| o == max_out).count() > s.len() / 2);
    }

    #[test]
    fn uniform_covers_its_range_and_nothing_else() {
        let d = LengthDist::uniform(3, 7).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut seen = [0usize; 10];
        for _ in 0..2000 {
            seen[d.sample(&mut rng)] += 1;
        }
        assert!(seen[..3].iter().chain(&seen[8..]).all(|&c| c == 0));
        assert!(seen[3..=7].iter().all(|&c| c > 0));
    }

    #[test]
    fn lognormal_from_mean_and_median() {
        let (mean, median) = (300.0, 200.0);
        let d = LengthDist::lognormal(mean, median).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut xs: Vec<usize> = (0..50_000).map(|_| d.sample(&mut rng)).collect();
        assert!(xs.iter().all(|&x| x >= 1));
        let (m, med) = mean_median(&mut xs);
        assert!(
            within(m, mean, 0.03) && within(med, median, 0.03),
            "{m} {med}"
        );
    }

    #[test]
    fn rejects_impossible_parameters() {
        assert!(LengthDist::fixed(0).is_err());
        assert!(LengthDist::uniform(0, 4).is_err());
        assert!(LengthDist::uniform(5, 4).is_err());
        assert!(LengthDist::lognormal(10.0, 20.0).is_err());
        assert!(Lengths::azure_conv(0.0, 10, 10).is_err());
    }
}
