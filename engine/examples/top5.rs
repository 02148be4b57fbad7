use duet_engine::*;
fn main() {
    let m = Model::load(
        "models/SmolLM2-135M-Instruct.Q4_1.gguf",
        LoadOptions::default(),
    )
    .unwrap();
    let ids = m
        .tokenizer
        .encode("The capital of France is", false)
        .unwrap();
    println!("{ids:?}");
    let mut c = KvCache::new(
        m.kv_layout(
            16,
            if std::env::var("F16").is_ok() {
                KvDtype::F16
            } else {
                KvDtype::F32
            },
        ),
        64,
    );
    c.add_sequence(0).unwrap();
    let l = m.forward(&mut c, &[SeqChunk::new(0, &ids)]).unwrap();
    let mut v: Vec<(usize, f32)> = l[0].iter().copied().enumerate().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("{:?}", &v[..5]);
}
