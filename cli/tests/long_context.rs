//! Local attention with sinks (issue 26) served by `duet up` as a user runs it. A windowed
//! request prefilled on the prefill worker moves only the blocks its prompt keeps (its sink
//! block and the next query's window), decodes under its window on the decode worker, and
//! gives `duet run --attention`'s tokens, through the gRPC door and the OpenAI door
//! (`attention`, which OpenAI clients send in `extra_body`); every block is free after it.
//! A window of 0 or wider than the context is 400 / INVALID_ARGUMENT naming the field; a
//! window on a model that cannot run it is FAILED_PRECONDITION (`cluster_up.rs`, Gemma 3).
//! SnapKV the same way: the prefill worker compacts the prompt and sends only the kept slots.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::time::Duration;

use duet_engine::{AttentionPolicy, Window};
use duet_proto::v1 as pb;
use duet_serving::convert::attention_to_proto;
use support::{client, generate, greedy, http, tokens, up, START};

const WINDOW: Window = Window {
    window: 64,
    sinks: 4,
};

/// KV bytes of one 16-token block of SmolLM2 in the default f16 cache: 30 layers x K and V
/// x 3 KV heads x 64 dims x 2 bytes per token.
const BLOCK_BYTES: u64 = 16 * 30 * 2 * 3 * 64 * 2;

/// About 350 tokens of the bench corpus: several windows long.
fn passage() -> String {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/data/persuasion-vol1.txt");
    let text = std::fs::read_to_string(&path).expect("bench corpus");
    text.chars().skip(3000).take(1600).collect()
}

/// `duet run --attention POLICY --json`: prompt ids, generated ids, text.
fn run_with(
    policy: AttentionPolicy,
    prompt: &str,
    max_tokens: u32,
) -> (Vec<u32>, Vec<u32>, String) {
    let (policy, max) = (policy.to_string(), max_tokens.to_string());
    let args = [
        "--prompt",
        prompt,
        "--attention",
        &policy,
        "--max-tokens",
        &max,
    ];
    let v = support::run_json("native", &args);
    let text = v["text"].as_str().expect("text").to_string();
    (
        support::ids_of(&v, "prompt_ids"),
        support::ids_of(&v, "ids"),
        text,
    )
}

#[test]
fn up_serves_a_windowed_request_moving_only_the_kept_blocks() {
    let prompt = passage();
    let (prompt_ids, want, want_text) = run_with(AttentionPolicy::Window(WINDOW), &prompt, 40);
    let snapkv: AttentionPolicy = "snapkv=128".parse().unwrap();
    let (_, want_snapkv, _) = run_with(snapkv, &prompt, 40);
    let len = prompt_ids.len();
    let all_blocks = len.div_ceil(16) as u64;
    let kept: u64 = WINDOW
        .kept_blocks(len, 16)
        .iter()
        .map(|r| r.len() as u64)
        .sum();
    assert!(
        len > 300 && kept < all_blocks / 3,
        "{len} tokens, {kept} kept blocks"
    );
    // Every prompt is prefilled on the prefill worker, in chunks of 128 tokens: each
    // chunk's commit drops the blocks that fell out of the window there too.
    let (p, url) = up(&[
        "--local-prefill-max-tokens",
        "0",
        "--max-batch-tokens",
        "128",
    ]);
    let rt = support::runtime();
    rt.block_on(async {
        let mut c = client(&url).await;
        let mut req = greedy(tokens(&prompt_ids), 40);
        req.attention = Some(attention_to_proto(AttentionPolicy::Window(WINDOW)));
        let got = generate(&mut c, req).await.expect("windowed generate");
        assert_eq!(got.ids, want, "the tokens of duet run --attention");
        let t = got.timings();
        assert_eq!(
            pb::PrefillPlacement::try_from(t.placement).unwrap(),
            pb::PrefillPlacement::Remote,
            "{t:?}"
        );
        assert_eq!(
            t.kv_bytes,
            kept * BLOCK_BYTES,
            "only the kept blocks: {t:?}"
        );
        p.assert_decode_pools_empty(Duration::from_secs(5)).await;

        // The default is unchanged: full attention moves every block of the same prompt.
        let full = generate(&mut c, greedy(tokens(&prompt_ids), 4))
            .await
            .expect("full generate");
        let t = full.timings();
        let held = u64::from(t.kv_reused_tokens) / 16;
        assert_eq!(t.kv_bytes, (all_blocks - held) * BLOCK_BYTES, "{t:?}");

        // A window of 0: INVALID_ARGUMENT naming the field.
        let mut bad = greedy(tokens(&prompt_ids), 4);
        bad.attention = Some(pb::AttentionPolicy {
            policy: Some(pb::attention_policy::Policy::Window(pb::LocalWindow {
                window: 0,
                sinks: 4,
            })),
        });
        let e = generate(&mut c, bad).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("attention.window"), "{e:?}");

        // SnapKV: the prefill worker compacts the prompt to 128 slots per layer and KV
        // head and sends those 8 blocks; the decode worker goes on in the prompt's frame.
        let mut snap = greedy(tokens(&prompt_ids), 40);
        snap.attention = Some(attention_to_proto(snapkv));
        let got = generate(&mut c, snap).await.expect("snapkv generate");
        assert_eq!(
            got.ids, want_snapkv,
            "the tokens of duet run --attention snapkv=128"
        );
        assert_eq!(
            got.timings().kv_bytes,
            8 * BLOCK_BYTES,
            "{:?}",
            got.timings()
        );
        p.assert_decode_pools_empty(Duration::from_secs(5)).await;
    });

    // The OpenAI door: the same request with `attention` as a client's extra_body sends it.
    let base = p.wait_for("http listening on", START);
    let completions = format!("{base}/v1/completions");
    let body = serde_json::json!({
        "prompt": prompt_ids, "max_tokens": 40, "temperature": 0,
        "attention": "window=64,sinks=4",
    });
    let (status, reply) = http(
        "POST",
        &completions,
        Some(("application/json", &body.to_string())),
    );
    assert_eq!(status, 200, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply).expect("json");
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want_text.as_str()));
    // Bad windows: 400 naming the field (wider than the context of 8192, or malformed).
    for (bad, field) in [
        (serde_json::json!({"window": 9000}), "attention.window"),
        (serde_json::json!("window=0"), "attention"),
    ] {
        let body = serde_json::json!({"prompt": "Hi", "max_tokens": 4, "attention": bad});
        let (status, reply) = http(
            "POST",
            &completions,
            Some(("application/json", &body.to_string())),
        );
        assert_eq!(status, 400, "{bad}: {reply}");
        assert!(reply.contains(field), "{bad}: {reply}");
    }
    let rt = support::runtime();
    rt.block_on(p.assert_decode_pools_empty(Duration::from_secs(5)));
}
