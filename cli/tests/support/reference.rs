//! llama.cpp's reference runs of the default model (`tests/data/smollm2-q4_1-greedy.jsonl`)
//! and the rule duet's greedy output is compared by: equal ids up to the first position
//! where llama.cpp's own top two logits were within 0.05 (a near-tie either side may break).

/// One reference prompt and llama.cpp's greedy continuation of it.
pub struct ReferenceCase {
    pub id: String,
    /// The text as `duet run --prompt` takes it (for `chat` cases, the rendered prompt's
    /// user message is this text).
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    /// llama.cpp's top-1 minus top-2 logit at each generated position.
    pub margins: Vec<f64>,
    /// The margin below which a step is a near-tie that may break either way.
    pub near_tie: f64,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Every reference case, in file order.
pub fn cases() -> Vec<ReferenceCase> {
    parse(
        include_str!("../../../tests/data/smollm2-q4_1-greedy.jsonl"),
        0.05,
    )
}

/// The second test model's reference cases (Gemma 3 270M Q4_K_M, raw prompts with BOS).
/// Their near-tie margin is 0.1: they were recorded by llama.cpp's AVX2 build, whose sums
/// round unlike the AVX-512 orders duet follows (`engine/tests/gemma3.rs`).
pub fn gemma_cases() -> Vec<ReferenceCase> {
    parse(
        include_str!("../../../tests/data/gemma3-270m-q4_k_m-greedy.jsonl"),
        0.1,
    )
}

fn parse(file: &str, near_tie: f64) -> Vec<ReferenceCase> {
    file.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            ReferenceCase {
                id: v["id"].as_str().expect("id").to_string(),
                prompt: v["prompt"].as_str().expect("prompt").to_string(),
                prompt_ids: ids(&v["prompt_ids"]),
                greedy_ids: ids(&v["greedy_ids"]),
                margins: v["top2_margin"]
                    .as_array()
                    .expect("margins")
                    .iter()
                    .map(|m| m.as_f64().expect("margin"))
                    .collect(),
                near_tie,
            }
        })
        .collect()
}

/// The reference case `id` (e.g. `v08-emoji`).
pub fn case(id: &str) -> ReferenceCase {
    cases()
        .into_iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no reference case {id}"))
}

impl ReferenceCase {
    /// `got` equals llama.cpp's ids up to its first near-tie (or whole, without one).
    pub fn keeps_rule(&self, got: &[u32]) -> bool {
        let cut = self
            .margins
            .iter()
            .position(|&m| m < self.near_tie)
            .unwrap_or(self.greedy_ids.len());
        got.len() >= cut && got[..cut] == self.greedy_ids[..cut]
    }
}
