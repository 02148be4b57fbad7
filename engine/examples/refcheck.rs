//! Counts reference prompts on which greedy decoding follows llama.cpp up to
//! the first near-tie (the rule of tests/greedy.rs), for one configuration.
use duet_engine::*;
fn main() {
    let w: WeightMode = std::env::var("W")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(WeightMode::Hybrid);
    let dtype: KvDtype = std::env::var("KV")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(KvDtype::F32);
    let chunk: usize = std::env::var("CHUNK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let m = Model::load(
        "models/SmolLM2-135M-Instruct.Q4_1.gguf",
        LoadOptions {
            threads: 2,
            weight_mode: w,
        },
    )
    .unwrap();
    let text = std::fs::read_to_string("tests/data/smollm2-q4_1-greedy.jsonl").unwrap();
    let mut pass = 0;
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let ids = |k: &str| {
            v[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect::<Vec<_>>()
        };
        let (prompt, want) = (ids("prompt_ids"), ids("greedy_ids"));
        let margins: Vec<f64> = v["top2_margin"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let k = margins.iter().position(|&x| x < 0.05).unwrap_or(want.len());
        let mut cache = KvCache::new(m.kv_layout(16, dtype), 128);
        let out = generate(
            &m,
            &mut cache,
            1,
            &prompt,
            GenerationParams {
                max_tokens: k.max(1),
                ..Default::default()
            },
            chunk,
            &mut |_| {},
        )
        .unwrap();
        let div = out.ids.iter().zip(&want).position(|(a, b)| a != b);
        let ok = div.map_or(true, |d| d >= k);
        pass += ok as usize;
        println!(
            "{} checked {k} diverges at {div:?} (margin there {:?}) {}",
            v["id"],
            div.map(|d| margins[d]),
            if ok { "ok" } else { "FAIL" }
        );
    }
    println!("{w:?} {dtype:?} chunk {chunk}: {pass}/10");
}
