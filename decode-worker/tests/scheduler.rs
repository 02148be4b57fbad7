//! The decode scheduler with the real model: continuous batching gives every sequence the
//! tokens it gets alone (with quantized weights, whose kernels do not depend on the batch); when the KV pool runs out the newest sequence is preempted,
//! recomputed later, and still produces the same tokens; every block is free at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::sync::Arc;
use std::time::Duration;

use duet_decode_worker::{
    handle::Done, DecodeConfig, DecodeHandle, Event, GenerateJob, PrefillSource, Priority,
};
use duet_engine::{
    generate_in, AttentionPolicy, EngineModel, GenerationParams, KvCache, KvCacheConfig, KvDtype,
    LoadOptions, Model, NativeSession, WeightMode, Window,
};
use tokio_util::sync::CancellationToken;

fn model() -> Arc<EngineModel> {
    model_with(WeightMode::Quantized)
}

fn model_with(weight_mode: WeightMode) -> Arc<EngineModel> {
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run make test", p.display());
    // Quantized weights: every row takes the same kernels whatever else shares the batch
    // (hybrid switches to dense GEMM for large batches, which moves the last bits).
    let m = Model::load(
        &p,
        LoadOptions {
            threads: 1,
            weight_mode,
        },
    )
    .expect("load model");
    Arc::new(EngineModel::from(m))
}

fn start(
    m: &Arc<EngineModel>,
    blocks: usize,
    watermark: usize,
) -> (DecodeHandle, CancellationToken) {
    let cancel = CancellationToken::new();
    let h = DecodeHandle::start(
        m.clone(),
        KvCacheConfig {
            block_size: 16,
            num_blocks: blocks,
            dtype: KvDtype::F32,
        },
        DecodeConfig {
            admit_watermark_blocks: watermark,
            ..DecodeConfig::default()
        },
        cancel.clone(),
    )
    .expect("start");
    (h, cancel)
}

async fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Done) {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Done(d) => return (ids, d),
            Event::Error(e) => panic!("sequence failed: {e}"),
        }
    }
    panic!("event stream ended without Done");
}

/// Like [`collect`], with the text the client would have received.
async fn collect_text(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, Vec<String>, Done) {
    let (mut ids, mut texts) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { id, text } => {
                ids.push(id);
                texts.push(text);
            }
            Event::Done(d) => return (ids, texts, d),
            Event::Error(e) => panic!("sequence failed: {e}"),
        }
    }
    panic!("event stream ended without Done");
}

fn job(
    m: &EngineModel,
    id: u64,
    prompt: &str,
    max_tokens: usize,
    priority: Priority,
) -> GenerateJob {
    GenerateJob {
        request_id: id,
        prompt: m.tokenizer().encode(prompt, false).expect("encode"),
        params: GenerationParams {
            max_tokens,
            ..GenerationParams::default()
        },
        priority,
        prefill: PrefillSource::Local { replay: 0 },
        attention: AttentionPolicy::Full,
        span: tracing::Span::none(),
    }
}

/// A job whose prompt ends with `replay` tokens generated before (a migrated stream).
fn job_ids(id: u64, prompt: Vec<u32>, max_tokens: usize, replay: usize) -> GenerateJob {
    GenerateJob {
        request_id: id,
        prompt,
        params: GenerationParams {
            max_tokens,
            ..GenerationParams::default()
        },
        priority: Priority::Interactive,
        prefill: PrefillSource::Local { replay },
        attention: AttentionPolicy::Full,
        span: tracing::Span::none(),
    }
}

/// A migrated stream arrives as prompt + the tokens already sent, with `replay` naming the
/// latter: the worker feeds them one per step and continues exactly where an undisturbed
/// run would have. With hybrid weights (the processes' default) a multi-row chunk takes the
/// dense GEMM while decode rows took the quantized kernel; fed as one chunk, this case
/// diverges at token 45 (the sums round differently and a near-tie flips).
#[test]
fn replayed_tokens_continue_a_stream_exactly() {
    let m = model_with(WeightMode::Hybrid);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (h, stop) = start(&m, 64, 4);
        let prompt = m
            .tokenizer()
            .encode("Write a short story about a lighthouse keeper.", false)
            .expect("encode");
        let mut params = job_ids(1, prompt.clone(), 48, 0);
        params.params.ignore_eos = true;
        let (alone, texts, _) = collect_text(h.generate(params)).await;
        assert_eq!(alone.len(), 48);
        let sent = 8;
        let mut resumed = prompt.clone();
        resumed.extend_from_slice(&alone[..sent]);
        let mut job = job_ids(2, resumed, 48 - sent, sent);
        job.params.ignore_eos = true;
        let (cont, cont_texts, done) = collect_text(h.generate(job)).await;
        assert_eq!(
            cont[..],
            alone[sent..],
            "the continuation of an undisturbed run"
        );
        // What a client of the migrated stream reads: what it got before, then the rest,
        // with nothing repeated or lost.
        assert_eq!(
            format!("{}{}", texts[..sent].concat(), cont_texts.concat()),
            texts.concat(),
            "the text of an undisturbed run"
        );
        assert_eq!(done.completion_tokens as usize, 48 - sent);
        stop.cancel();
    });
}

#[test]
fn preemption_recomputes_and_keeps_tokens_and_frees_every_block() {
    let m = model();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let prompts = [
            "The capital of France is",
            "Water boils at a temperature of",
        ];
        // Alone, with plenty of blocks.
        let (h, stop) = start(&m, 64, 4);
        let mut alone = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            alone.push(
                collect(h.generate(job(&m, i as u64, p, 40, Priority::Interactive)))
                    .await
                    .0,
            );
        }
        assert_eq!(h.status().kv_blocks_free, 64);
        stop.cancel();

        // Both together in a pool that holds one grown sequence but not two: each needs
        // ceil((~7 + 40) / 16) = 3 blocks; 5 blocks and no admission watermark admit both
        // and force a preemption as they grow.
        let (h, stop) = start(&m, 5, 0);
        let a = h.generate(job(&m, 10, prompts[0], 40, Priority::Interactive));
        let b = h.generate(job(&m, 11, prompts[1], 40, Priority::Batch));
        let ((ids_a, done_a), (ids_b, done_b)) = tokio::join!(collect(a), collect(b));
        assert_eq!(ids_a, alone[0], "interactive sequence tokens");
        // The preempted sequence: its KV was recomputed (the prompt as one chunk, the
        // generated tokens one per step, as decoding fed them), so its greedy tokens are
        // exactly those of an undisturbed run, before and after the preemption.
        assert!(done_b.first_preempted_at.is_some(), "preempted: {done_b:?}");
        assert_eq!(
            ids_b, alone[1],
            "preemption leaves the greedy tokens unchanged"
        );
        assert_eq!(ids_b.len(), 40);
        assert_eq!(
            done_a.preemptions, 0,
            "the interactive sequence is never the victim"
        );
        assert!(
            done_b.preemptions >= 1,
            "the batch sequence was preempted: {done_b:?}"
        );
        // Everything is free again.
        let end = std::time::Instant::now() + Duration::from_secs(1);
        while h.status().kv_blocks_free != 5 {
            assert!(std::time::Instant::now() < end, "{:?}", h.status());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
    });
}

/// A sequence under `policy` in the continuous batch: it runs beside a full-attention one
/// in a pool too small for both, is preempted and recomputed under the same policy, and
/// gives the tokens `generate_in` gives it alone; every block is free at the end.
fn batched_preempted_and_recomputed(
    policy: AttentionPolicy,
    prompt: &str,
    pool: fn(usize) -> usize,
    full_tokens: usize,
) {
    let m = model();
    let EngineModel::Native(native) = m.as_ref() else {
        panic!("native engine");
    };
    let prompt = m.tokenizer().encode(prompt, false).expect("encode");
    if let Some(s) = policy.snapkv() {
        assert!(s.compresses(prompt.len()), "{} tokens", prompt.len());
    }
    let blocks = pool(prompt.len());
    let params = GenerationParams {
        max_tokens: 90,
        ignore_eos: true,
        ..GenerationParams::default()
    };
    let mut cache = KvCache::new(native.kv_layout(16, KvDtype::F32), 64);
    let mut session = NativeSession {
        model: native,
        cache: &mut cache,
    };
    let alone = generate_in(
        &mut session,
        1,
        &prompt,
        params.clone(),
        0,
        policy,
        &mut |_| {},
    )
    .expect("alone")
    .ids;
    assert_eq!(alone.len(), 90);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (h, stop) = start(&m, blocks, 0);
        let mut full = job(
            &m,
            20,
            "The capital of France is",
            full_tokens,
            Priority::Interactive,
        );
        full.params.ignore_eos = true;
        let other = GenerateJob {
            request_id: 21,
            prompt: prompt.clone(),
            params,
            priority: Priority::Batch,
            prefill: PrefillSource::Local { replay: 0 },
            attention: policy,
            span: tracing::Span::none(),
        };
        let (a, b) = (h.generate(full), h.generate(other));
        let ((ids_a, _), (ids_b, done_b)) = tokio::join!(collect(a), collect(b));
        assert_eq!(ids_a.len(), full_tokens);
        assert!(done_b.preemptions >= 1, "{policy}: preempted: {done_b:?}");
        assert_eq!(
            ids_b, alone,
            "{policy}: the tokens alone, batched and recomputed"
        );
        let end = std::time::Instant::now() + Duration::from_secs(1);
        while h.status().kv_blocks_free != blocks as u64 {
            assert!(std::time::Instant::now() < end, "{:?}", h.status());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
    });
}

/// A window bounds the blocks: 7 blocks hold the full-attention sequence's 5 (~7 + 60
/// tokens) but not the windowed one's 4 (sinks, window, the block being written) beside it.
#[test]
fn a_windowed_sequence_is_batched_preempted_and_recomputed_under_its_window() {
    let w = AttentionPolicy::Window(Window {
        window: 32,
        sinks: 4,
    });
    batched_preempted_and_recomputed(w, "The history of the lighthouse", |_| 7, 60);
}

/// SnapKV compresses a prompt computed on the decode worker (here 90 tokens to 48 slots),
/// and again when the preempted sequence is recomputed.
#[test]
fn a_snapkv_sequence_is_compressed_batched_preempted_and_recomputed() {
    let p: AttentionPolicy = "snapkv=48,observe=16".parse().unwrap();
    let prompt = "The lighthouse keeper climbed the stairs every evening at dusk, lit the great \
                  lamp, wound the clockwork that turned the lens, and wrote in his log the \
                  ships he saw pass the rocks. In winter the storms came from the west and \
                  the spray reached the gallery; in summer the visitors came from the town \
                  and asked him the same questions about the light, the keeper before him, \
                  and the wreck of the schooner that lay below the cliff.";
    // The prompt's blocks and the 3 it compacts into fit beside the full-attention
    // sequence's first block; grown, the two do not (7 blocks at 107 tokens, and 9 at
    // 48 + 90 slots, against 4 more than the prompt's).
    batched_preempted_and_recomputed(p, prompt, |n| n.div_ceil(16) + 4, 100);
}

#[test]
fn dropped_receiver_and_expired_reservation_free_their_blocks() {
    let m = model();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (h, stop) = start(&m, 32, 4);
        // A reservation nobody claims expires on its own.
        let blocks = h
            .reserve(
                7,
                40,
                Duration::from_millis(100),
                Vec::new(),
                AttentionPolicy::Full,
            )
            .await
            .expect("reserve")
            .blocks;
        assert_eq!(blocks.len(), 3);
        assert_eq!(h.status().kv_blocks_free, 29);
        assert_eq!(h.status().reservations, 1);
        // A generating sequence whose client went away.
        let mut rx = h.generate(job(&m, 8, "Once upon a time", 200, Priority::Interactive));
        assert!(matches!(rx.recv().await, Some(Event::Token { .. })));
        drop(rx);
        let end = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let s = h.status();
            if s.kv_blocks_free == 32 && s.reservations == 0 && s.running == 0 {
                break;
            }
            assert!(std::time::Instant::now() < end, "still held: {s:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Release of an unknown request is a no-op.
        assert!(!h.release(12345).await);
        stop.cancel();
    });
}

/// A finished sequence's blocks stay cached: the same prompt again is prefilled from its
/// cached prefix (and gives the same tokens), and a reservation for it receives only the
/// KV after that prefix.
#[test]
fn a_repeated_prompt_reuses_the_cached_prefix_locally_and_in_reservations() {
    let m = model();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (h, stop) = start(&m, 64, 4);
        let prompt = "The history of the lighthouse on the northern cape begins with a storm \
                      that wrecked three fishing boats in one night, and the village decided to build a \
                      tower of stone on the rocks above the harbour, with a fire on its top";
        let first = job(&m, 1, prompt, 12, Priority::Interactive);
        let len = first.prompt.len();
        let prompt_ids = first.prompt.clone();
        assert!(len > 40, "{len} tokens");
        let (ids_1, done_1) = collect(h.generate(first)).await;
        assert_eq!(done_1.cached_tokens, 0, "nothing cached before");
        let (ids_2, done_2) = collect(h.generate(job(&m, 2, prompt, 12, Priority::Interactive))).await;
        assert_eq!(done_2.cached_tokens, (len - 2) / 16 * 16, "whole blocks, two tokens computed");
        assert_eq!(ids_2, ids_1, "tokens with the cached prefix");
        let s = h.status();
        assert_eq!(s.kv_blocks_free, 64, "cached blocks count as free: {s:?}");
        assert!(s.kv_blocks_cached >= (len / 16) as u64, "{s:?}");

        let hashes = duet_engine::PrefixHasher::new(m.fingerprint(), 16).hashes(&prompt_ids);
        let r = h
            .reserve(3, len, Duration::from_secs(5), hashes, AttentionPolicy::Full)
            .await
            .expect("reserve");
        assert_eq!(r.cached_tokens, (len - 2) / 16 * 16);
        assert_eq!(r.blocks.len(), len.div_ceil(16) - r.cached_tokens / 16);
        assert!(h.release(3).await);
        stop.cancel();
    });
}

/// A sequence whose chunk the forward refuses (a token outside the vocabulary, sent past
/// every door) ends alone with its own error; the 7 others sharing its batch go on and give
/// exactly the tokens they give alone, and every block comes back.
#[test]
fn a_poisoned_sequence_ends_alone_and_its_batch_goes_on() {
    let m = model();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (h, stop) = start(&m, 128, 4);
        let prompts: Vec<String> = (0..7)
            .map(|i| format!("Tell me fact number {i} about the sea."))
            .collect();
        let mut alone = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            alone.push(
                collect(h.generate(job(&m, 100 + i as u64, p, 24, Priority::Interactive)))
                    .await
                    .0,
            );
        }
        let mut streams: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| h.generate(job(&m, i as u64, p, 24, Priority::Interactive)))
            .collect();
        // Every stream is decoding (its first token arrived) before the poison joins.
        let mut first = Vec::new();
        for rx in &mut streams {
            match rx.recv().await {
                Some(Event::Token { id, .. }) => first.push(id),
                other => panic!("expected a first token, got {other:?}"),
            }
        }
        let vocab = m.config().vocab_size as u32;
        let poisoned = job_ids(99, vec![1, 2, vocab + 5], 12, 0);
        let mut poison = h.generate(poisoned);
        match poison.recv().await {
            Some(Event::Error(e)) => {
                let msg = e.to_string();
                assert!(msg.contains("outside the vocabulary"), "{msg}");
            }
            other => panic!("the poisoned sequence must fail alone, got {other:?}"),
        }
        for (i, rx) in streams.into_iter().enumerate() {
            let (rest, done) = collect(rx).await;
            let mut ids = vec![first[i]];
            ids.extend(rest);
            assert_eq!(
                ids, alone[i],
                "sequence {i} is untouched by its poisoned neighbour"
            );
            assert_eq!(done.completion_tokens as usize, alone[i].len());
        }
        let end = std::time::Instant::now() + Duration::from_secs(2);
        while h.status().kv_blocks_free != 128 {
            assert!(
                std::time::Instant::now() < end,
                "blocks still held: {:?}",
                h.status()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
    });
}
