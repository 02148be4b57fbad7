use duet_engine::*;
use std::time::Instant;
fn main() {
    let threads: usize = std::env::var("T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mode: WeightMode = std::env::var("W")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(WeightMode::Quantized);
    let m = Model::load(
        "models/SmolLM2-135M-Instruct.Q4_1.gguf",
        LoadOptions {
            threads,
            weight_mode: mode,
        },
    )
    .unwrap();
    let mut c = KvCache::new(m.kv_layout(16, KvDtype::F32), 256);
    c.add_sequence(0).unwrap();
    let ids: Vec<u32> = (0..64).map(|i| 100 + i).collect();
    let t = Instant::now();
    m.forward(&mut c, &[SeqChunk::new(0, &ids)]).unwrap();
    println!("prefill 64: {:?}", t.elapsed());
    let t = Instant::now();
    for i in 0..20 {
        m.forward(&mut c, &[SeqChunk::new(0, &[200 + i])]).unwrap();
    }
    println!("decode: {:?}/token", t.elapsed() / 20);
}
