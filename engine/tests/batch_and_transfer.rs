//! Batched decode equals decoding alone; exported KV imported into a fresh
//! cache continues exactly like an uninterrupted run.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use duet_engine::{sampling::argmax, KvCache, KvDtype, Model, SeqChunk};

/// 16 prompts of different lengths: more rows than a hybrid model's dense
/// crossover (8), so the batch invariance below covers the kernel choice too.
const PROMPTS: [&str; 16] = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "1, 2, 3, 5, 8, 13,",
    "The quick brown fox jumps over the lazy dog because",
    "Water boils at",
    "Rust is a programming language that",
    "A haiku about autumn:",
    "The largest planet in the solar system is",
    "SELECT name FROM users WHERE",
    "My favourite colour is",
    "In 1969, the first person to walk on the moon was",
    "Dear diary, today",
    "The recipe needs two eggs, flour and",
    "Photosynthesis converts",
    "Q: What is 7 times 8? A:",
];

fn prefill(m: &Model, cache: &mut KvCache, seq: u64, prompt: &[u32]) -> u32 {
    cache.add_sequence(seq).expect("add");
    let l = m
        .forward(cache, &[SeqChunk::new(seq, prompt)])
        .expect("prefill");
    argmax(&l[0])
}

/// Greedy tokens, and each decode step's logits, of several sequences
/// decoded together in one batch.
type Decoded = (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>);

fn decode_together(m: &Model, prompts: &[Vec<u32>], steps: usize) -> Decoded {
    let mut cache = KvCache::new(m.kv_layout(16, KvDtype::F32), 512);
    let mut next: Vec<u32> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| prefill(m, &mut cache, i as u64, p))
        .collect();
    let mut out: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let mut step_logits = vec![Vec::new(); prompts.len()];
    for _ in 1..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch: Vec<SeqChunk> = toks
            .iter()
            .enumerate()
            .map(|(i, t)| SeqChunk::new(i as u64, t))
            .collect();
        let logits = m.forward(&mut cache, &batch).expect("decode");
        for (i, l) in logits.into_iter().enumerate() {
            next[i] = argmax(&l);
            out[i].push(next[i]);
            step_logits[i].push(l);
        }
    }
    (out, step_logits)
}

#[test]
fn sixteen_sequences_decoded_together_equal_each_decoded_alone_bit_for_bit() {
    let m = common::model(2);
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| m.tokenizer.encode(p, false).expect("encode"))
        .collect();
    let lens: std::collections::HashSet<usize> = prompts.iter().map(|p| p.len()).collect();
    assert!(lens.len() >= 8, "prompts should differ in length");
    let steps = 12;
    let (together, together_logits) = decode_together(m, &prompts, steps);
    for (i, p) in prompts.iter().enumerate() {
        let (alone, alone_logits) = decode_together(m, std::slice::from_ref(p), steps);
        assert_eq!(together[i], alone[0], "sequence {i} ({:?})", PROMPTS[i]);
        // Not only the argmax: every logit of every step has the same bits.
        for (step, (a, b)) in together_logits[i].iter().zip(&alone_logits[0]).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "sequence {i} step {step}: logits differ in a batch of 16"
            );
        }
    }
}

/// Prefill + `before` decode steps in one cache, export, import into a fresh
/// cache (different block ids), decode `after` more steps there.
fn continue_elsewhere(
    m: &Model,
    prompt: &[u32],
    src: KvDtype,
    dst: KvDtype,
    before: usize,
    after: usize,
) -> Vec<u32> {
    let mut a = KvCache::new(m.kv_layout(16, src), 64);
    let mut toks = vec![prefill(m, &mut a, 7, prompt)];
    for _ in 0..before {
        let l = m
            .forward(&mut a, &[SeqChunk::new(7, &[*toks.last().expect("tok")])])
            .expect("decode");
        toks.push(argmax(&l[0]));
    }
    let exported = a.export(7).expect("export");
    a.free_sequence(7);
    assert_eq!(a.free_blocks(), a.total_blocks());
    let mut b = KvCache::new(m.kv_layout(16, dst), 64);
    // Occupy some blocks so the imported sequence lands on other ids.
    b.add_sequence(99).expect("add");
    b.prepare_append(99, 40).expect("reserve");
    b.import(8, &exported).expect("import");
    assert_ne!(b.sequence_blocks(8).expect("blocks")[0], 0);
    for _ in 0..after {
        let l = m
            .forward(&mut b, &[SeqChunk::new(8, &[*toks.last().expect("tok")])])
            .expect("decode");
        toks.push(argmax(&l[0]));
    }
    b.free_sequence(8);
    b.free_sequence(99);
    assert_eq!(b.free_blocks(), b.total_blocks(), "import leaked blocks");
    toks
}

#[test]
fn exported_kv_continues_exactly_in_a_fresh_cache() {
    let m = common::model(1);
    let prompt = m
        .tokenizer
        .encode("The history of the printing press begins", false)
        .expect("encode");
    // Uninterrupted: everything in one cache (export after 0 steps is still
    // a real hand-over: the whole decode happens in the second cache).
    let whole = continue_elsewhere(m, &prompt, KvDtype::F32, KvDtype::F32, 20, 0);
    let moved = continue_elsewhere(m, &prompt, KvDtype::F32, KvDtype::F32, 0, 20);
    assert_eq!(
        whole, moved,
        "f32 KV moved after prefill must continue identically"
    );
    let f16_whole = continue_elsewhere(m, &prompt, KvDtype::F16, KvDtype::F16, 20, 0);
    let f16_moved = continue_elsewhere(m, &prompt, KvDtype::F16, KvDtype::F16, 0, 20);
    assert_eq!(
        f16_whole, f16_moved,
        "f16 KV moved after prefill must continue identically"
    );
    // f32 computed, stored as f16 on the receiving side: report agreement.
    let converted = continue_elsewhere(m, &prompt, KvDtype::F32, KvDtype::F16, 0, 20);
    let agree = whole
        .iter()
        .zip(&converted)
        .take_while(|(a, b)| a == b)
        .count();
    println!(
        "f32 -> f16 import: {agree}/{} greedy tokens agree before the first difference",
        whole.len()
    );
}
