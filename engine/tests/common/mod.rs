//! Shared by the engine's integration tests: the real default model, loaded
//! once per test binary and thread count, and the llama.cpp reference data.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use duet_engine::{LoadOptions, Model, WeightMode};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("DUET_MODEL") {
        return PathBuf::from(p);
    }
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn load(threads: usize) -> Model {
    let p = model_path();
    assert!(
        p.exists(),
        "{} is missing: run ./scripts/fetch-model.sh (make test does)",
        p.display()
    );
    Model::load(
        &p,
        LoadOptions {
            threads,
            weight_mode: WeightMode::Hybrid,
        },
    )
    .unwrap_or_else(|e| panic!("loading {}: {e}", p.display()))
}

pub fn model(threads: usize) -> &'static Model {
    static ONE: OnceLock<Model> = OnceLock::new();
    static TWO: OnceLock<Model> = OnceLock::new();
    match threads {
        1 => ONE.get_or_init(|| load(1)),
        _ => TWO.get_or_init(|| load(2)),
    }
}

pub fn reference(name: &str) -> Vec<serde_json::Value> {
    let p = root().join("tests/data").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("reference line is JSON"))
        .collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}
