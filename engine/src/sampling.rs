//! Sampling parameters, their validation, and the sampler.
//!
//! Order of operations (as in llama.cpp and vLLM): repetition penalty over
//! the sequence so far, then greedy if `temperature == 0`, else temperature,
//! top-k, softmax, min-p, top-p, and a draw from a per-request RNG. The same
//! seed gives the same tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// Upper bounds that keep one request's work and memory bounded.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: i64,
    /// 1 means off; must be in (0, 1].
    pub top_p: f32,
    /// 0 means off; must be in [0, 1].
    pub min_p: f32,
    /// 1 means off; must be > 0.
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Reject what cannot be sampled, naming the field.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(EngineError::invalid(
                "temperature",
                format!("{t} (must be a finite number >= 0)"),
            ));
        }
        if self.top_k < 0 {
            return Err(EngineError::invalid(
                "top_k",
                format!("{} (must be >= 0; 0 disables it)", self.top_k),
            ));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(EngineError::invalid(
                "top_p",
                format!("{p} (must be in (0, 1])"),
            ));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(EngineError::invalid(
                "min_p",
                format!("{m} (must be in [0, 1])"),
            ));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(EngineError::invalid(
                "repetition_penalty",
                format!("{r} (must be a finite number > 0)"),
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Consume the random draw one [`Self::sample`] call makes (none when
    /// greedy), as if a token had been sampled here.
    pub fn skip_draw(&mut self) {
        if self.params.temperature != 0.0 {
            let _ = self.rng.random::<f32>();
        }
    }

    /// Pick the next token from `logits` (modified in place); `history` is
    /// the sequence so far (prompt and generated tokens).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in history {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k as usize);
        }
        let max = cand.first().map_or(0.0, |c| c.1);
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut k = 0;
            for &q in &probs[..keep] {
                cum += q;
                k += 1;
                if cum >= p.top_p {
                    break;
                }
            }
            keep = k.max(1);
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut u = self.rng.random::<f32>() * total;
        for (i, &q) in probs[..keep].iter().enumerate() {
            if u < q {
                return cand[i].0;
            }
            u -= q;
        }
        cand[keep - 1].0
    }
}

/// Index of the largest logit (the lowest id on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_parameters_name_their_field() {
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_k: -1,
                    ..Default::default()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    min_p: 2.0,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
        ];
        for (p, field) in cases {
            let err = p.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err} should name {field}");
        }
    }

    #[test]
    fn same_seed_same_draws_and_filters_apply() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 17) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..50)
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        // top_k = 5 keeps only the five largest logits (value 16 * 0.3, ids 16, 33, 50, 67, 84).
        assert!(a.iter().all(|t| t % 17 == 16), "{a:?}");
        let greedy = Sampler::new(SamplingParams::greedy())
            .unwrap()
            .sample(&mut logits.clone(), &[]);
        assert_eq!(greedy, 16);
        // A strong repetition penalty moves greedy off the repeated token.
        let pen = SamplingParams {
            repetition_penalty: 100.0,
            ..Default::default()
        };
        let t = Sampler::new(pen)
            .unwrap()
            .sample(&mut logits.clone(), &[16]);
        assert_eq!(t, 33);
    }
}
