//! Everything one `duet bench serve` invocation needs, validated once and stored verbatim in
//! the JSON report (so a report says how it was made).
//!
//! Invariants after [`ServeConfig::validate`]: at least one rate (None = unbounded) and, when
//! several, all finite; a stopping rule (request count or duration), and never an unbounded
//! flood (a run bounded by time only has a rate or a concurrency cap); concurrency >= 1 when
//! set; 0 < attainment target <= 1.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::backend::{BackendKind, SendOptions};
use crate::corpus::Corpus;
use crate::error::{BenchError, Result};
use crate::lengths::{LengthDist, Lengths};
use crate::slo::Slo;
use crate::workload::{PrefixShape, Workload};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetKind {
    /// Every prompt `input_len` tokens, every output `output_len`.
    Fixed,
    /// Uniform in `len·(1−range_ratio) ..= len·(1+range_ratio)` (vLLM's random dataset).
    Uniform,
    /// Lognormal: `input_len` / `output_len` are the means, with the given medians.
    Lognormal,
    /// Lognormal shaped like the Azure LLM inference trace 2023, conversation set.
    AzureConv,
}

/// Length flags as given on the command line.
#[derive(Debug, Clone, Serialize)]
pub struct LengthParams {
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    pub input_median: Option<f64>,
    pub output_median: Option<f64>,
    pub length_scale: f64,
    pub max_input_len: usize,
    pub max_output_len: usize,
}

fn range(len: usize, ratio: f64) -> Result<LengthDist> {
    if !(0.0..1.0).contains(&ratio) {
        return Err(BenchError::config(format!(
            "--range-ratio must be in [0, 1), got {ratio}"
        )));
    }
    let lo = ((len as f64) * (1.0 - ratio)).round().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).round().max(lo as f64) as usize;
    LengthDist::uniform(lo, hi)
}

impl LengthParams {
    pub fn lengths(&self, kind: DatasetKind) -> Result<Lengths> {
        let (mi, mo) = (self.max_input_len, self.max_output_len);
        match kind {
            DatasetKind::Fixed => {
                if self.input_len > mi || self.output_len > mo {
                    return Err(BenchError::config(format!(
                        "fixed lengths {}/{} exceed the caps {mi}/{mo} (--max-input-len, --max-output-len)",
                        self.input_len, self.output_len
                    )));
                }
                Lengths::new(
                    LengthDist::fixed(self.input_len)?,
                    LengthDist::fixed(self.output_len)?,
                    mi,
                    mo,
                )
            }
            DatasetKind::Uniform => Lengths::new(
                range(self.input_len, self.range_ratio)?,
                range(self.output_len, self.range_ratio)?,
                mi,
                mo,
            ),
            DatasetKind::Lognormal => {
                let need = |m: Option<f64>, flag: &str| {
                    m.ok_or_else(|| BenchError::config(format!("--dataset lognormal needs {flag}")))
                };
                Lengths::new(
                    LengthDist::lognormal(
                        self.input_len as f64,
                        need(self.input_median, "--input-median")?,
                    )?,
                    LengthDist::lognormal(
                        self.output_len as f64,
                        need(self.output_median, "--output-median")?,
                    )?,
                    mi,
                    mo,
                )
            }
            DatasetKind::AzureConv => Lengths::azure_conv(self.length_scale, mi, mo),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ServeConfig {
    /// Name of this configuration in reports and plots.
    pub label: String,
    pub backend: BackendKind,
    pub url: String,
    /// Path of the completions endpoint (OpenAI backend).
    pub endpoint: String,
    /// Model name sent with requests (None: duet's only model / the server's first model).
    pub model_name: Option<String>,
    /// GGUF whose tokenizer builds the prompts.
    pub tokenizer: PathBuf,
    pub dataset: DatasetKind,
    pub length_params: LengthParams,
    pub lengths: Lengths,
    /// Text prompts are cut from (None: the stored public-domain text).
    pub corpus: Option<PathBuf>,
    pub shared_prefix_len: usize,
    /// Distinct shared prefixes (system prompts), one drawn per request.
    pub num_prefixes: usize,
    /// Requests per conversation (multi-turn chat; 1: independent requests).
    pub turns: usize,
    pub seed: u64,
    pub send: SendOptions,
    /// Offered request rates, one run each (None: unbounded).
    pub rates: Vec<Option<f64>>,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub num_prompts: Option<usize>,
    #[serde(rename = "duration_s", serialize_with = "opt_secs")]
    pub duration: Option<Duration>,
    pub warmup: usize,
    pub slo: Option<Slo>,
    pub attainment_target: f64,
}

fn opt_secs<S: serde::Serializer>(
    d: &Option<Duration>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

impl ServeConfig {
    /// The requests of a run drawn with `seed` from `corpus` (`text`: also as text).
    pub fn workload(
        &self,
        corpus: Arc<Corpus>,
        seed: u64,
        text: Option<Arc<duet_engine::Tokenizer>>,
    ) -> Workload {
        let shape = PrefixShape {
            shared_prefix_len: self.shared_prefix_len,
            num_prefixes: self.num_prefixes,
            turns: self.turns,
        };
        Workload::new(self.lengths.clone(), corpus, shape, seed, text)
    }

    pub fn validate(&self) -> Result<()> {
        if self.rates.is_empty() {
            return Err(BenchError::config("no request rate to run"));
        }
        if self.rates.len() > 1 && self.rates.iter().any(|r| r.is_none_or(|x| !x.is_finite())) {
            return Err(BenchError::config(
                "--rate-sweep: every rate must be a finite number",
            ));
        }
        if self.num_prompts.is_none() && self.duration.is_none() {
            return Err(BenchError::config("give --num-prompts or --duration"));
        }
        if self.num_prompts == Some(0) {
            return Err(BenchError::config("--num-prompts must be at least 1"));
        }
        if self.duration.is_some_and(|d| d.is_zero()) {
            return Err(BenchError::config("--duration must be positive"));
        }
        if self.num_prompts.is_none()
            && self.max_concurrency.is_none()
            && self.rates.contains(&None)
        {
            return Err(BenchError::config(
                "--duration without --request-rate sends without pause: give --max-concurrency \
                 (a closed loop) or --num-prompts",
            ));
        }
        if self.num_prefixes == 0 || self.turns == 0 {
            return Err(BenchError::config(
                "--num-prefixes and --turns must be at least 1",
            ));
        }
        if self.num_prefixes > 1 && self.shared_prefix_len == 0 {
            return Err(BenchError::config(
                "--num-prefixes needs --shared-prefix-len (the length of each prefix)",
            ));
        }
        if self.max_concurrency == Some(0) {
            return Err(BenchError::config("--max-concurrency must be at least 1"));
        }
        if !(self.attainment_target > 0.0 && self.attainment_target <= 1.0) {
            return Err(BenchError::config("--slo-attainment must be in (0, 1]"));
        }
        if self.send.timeout.is_zero() {
            return Err(BenchError::config("--timeout must be positive"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> LengthParams {
        LengthParams {
            input_len: 100,
            output_len: 10,
            range_ratio: 0.5,
            input_median: None,
            output_median: None,
            length_scale: 1.0,
            max_input_len: 1000,
            max_output_len: 100,
        }
    }

    #[test]
    fn uniform_range_is_centred_on_the_length() {
        let p = params();
        let l = p.lengths(DatasetKind::Uniform).unwrap();
        let lo = (p.input_len as f64 * (1.0 - p.range_ratio)) as usize;
        let hi = (p.input_len as f64 * (1.0 + p.range_ratio)) as usize;
        assert!(matches!(l.input, LengthDist::Uniform { min, max } if min == lo && max == hi));
    }

    fn serve_config() -> ServeConfig {
        let length_params = params();
        ServeConfig {
            label: "t".into(),
            backend: BackendKind::Duet,
            url: "http://127.0.0.1:1".into(),
            endpoint: "/v1/completions".into(),
            model_name: None,
            tokenizer: PathBuf::new(),
            dataset: DatasetKind::Fixed,
            lengths: length_params.lengths(DatasetKind::Fixed).unwrap(),
            length_params,
            corpus: None,
            shared_prefix_len: 0,
            num_prefixes: 1,
            turns: 1,
            seed: 0,
            send: SendOptions {
                temperature: 0.0,
                seed: None,
                prompt_format: crate::backend::PromptFormat::Tokens,
                ignore_eos: crate::backend::IgnoreEos::IgnoreEos,
                extra_body: Default::default(),
                api_key: None,
                timeout: Duration::from_secs(1),
            },
            rates: vec![None],
            burstiness: 1.0,
            max_concurrency: None,
            num_prompts: Some(1),
            duration: None,
            warmup: 0,
            slo: None,
            attainment_target: 0.9,
        }
    }

    #[test]
    fn validation_refuses_runs_without_an_end_or_with_a_flood() {
        assert!(serve_config().validate().is_ok());
        let mut c = serve_config();
        c.num_prompts = None;
        assert!(c.validate().is_err(), "no stopping rule");
        c.duration = Some(Duration::from_secs(5));
        assert!(
            c.validate().is_err(),
            "time-bounded with neither rate nor cap"
        );
        c.max_concurrency = Some(2);
        assert!(c.validate().is_ok());
        let mut c = serve_config();
        c.rates = vec![Some(1.0), None];
        assert!(c.validate().is_err(), "a sweep of finite rates only");
        let mut c = serve_config();
        c.attainment_target = 0.0;
        assert!(c.validate().is_err());
    }

    #[test]
    fn lognormal_needs_medians_and_fixed_respects_caps() {
        assert!(params().lengths(DatasetKind::Lognormal).is_err());
        let mut p = params();
        p.input_median = Some(80.0);
        p.output_median = Some(8.0);
        assert!(p.lengths(DatasetKind::Lognormal).is_ok());
        let mut p = params();
        p.input_len = p.max_input_len + 1;
        assert!(p.lengths(DatasetKind::Fixed).is_err());
    }
}
