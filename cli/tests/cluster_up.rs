//! `duet up` as a user runs it: one process, router + prefill + decode workers, KV handed
//! over in process. Its greedy tokens must equal `duet run`'s for the same prompt, in each
//! placement (remote prefill, local prefill on the decode worker, colocated).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use duet_proto::v1 as pb;
use support::{client, generate, greedy, run_reference, text, up};

const PROMPTS: &[(&str, bool)] = &[
    ("The capital of France is", false),
    ("Write a haiku about the sea, then explain each line of it in one short sentence, please.", true),
    ("List three prime numbers and explain briefly why each of them is prime, in plain words for a child.", true),
];

fn chat(t: &str) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Chat(pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: t.into(),
        }],
    })
}

fn placement(c: &support::Completion) -> pb::PrefillPlacement {
    pb::PrefillPlacement::try_from(c.timings().placement).unwrap_or_default()
}

/// Sends every prompt (one at a time) and checks tokens and the placement used.
fn check_mode(extra: &[&str], expect_long: pb::PrefillPlacement, reference: &[Vec<u32>]) {
    let (_p, url) = up(extra);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&url).await;
        for ((prompt, is_chat), want) in PROMPTS.iter().zip(reference) {
            let p = if *is_chat { chat(prompt) } else { text(prompt) };
            let got = generate(&mut c, greedy(p, 24)).await.expect("generate");
            assert_eq!(
                &got.ids, want,
                "{extra:?}: tokens for {prompt:?} differ from duet run"
            );
            let fin = got.fin.clone().expect("final");
            assert_eq!(fin.usage.unwrap().completion_tokens as usize, got.ids.len());
            let t = got.timings();
            assert!(
                t.time_to_first_token_seconds > 0.0
                    && t.total_seconds >= t.time_to_first_token_seconds
            );
            let prompt_tokens = fin.usage.unwrap().prompt_tokens;
            // Short prompts are prefilled on the decode worker in disaggregated mode.
            let want_placement =
                if expect_long == pb::PrefillPlacement::Remote && prompt_tokens <= 32 {
                    pb::PrefillPlacement::Local
                } else {
                    expect_long
                };
            assert_eq!(placement(&got), want_placement, "{prompt:?}: {t:?}");
            if want_placement == pb::PrefillPlacement::Remote {
                // The prompt's KV moved but for the blocks the decode worker already held
                // (the chat prompts share the template's system line, one full block):
                // whole 16-token blocks x 30 layers x K and V x 3 KV heads x 64 dims x 2
                // bytes (f16, the default cache).
                let blocks = u64::from(prompt_tokens).div_ceil(16);
                let held = u64::from(t.kv_reused_tokens) / 16;
                assert_eq!(
                    t.kv_bytes,
                    (blocks - held) * 16 * 30 * 2 * 3 * 64 * 2,
                    "{t:?}"
                );
                assert!(
                    !t.prefill_worker.is_empty() && t.kv_transfer_seconds > 0.0,
                    "{t:?}"
                );
            }
        }
    });
}

fn references() -> Vec<Vec<u32>> {
    PROMPTS
        .iter()
        .map(|(p, chat)| run_reference(p, *chat, 24))
        .collect()
}

#[test]
fn up_equals_duet_run_in_every_placement() {
    let reference = references();
    check_mode(&[], pb::PrefillPlacement::Remote, &reference);
    check_mode(
        &["--mode", "colocated", "--prefill-workers", "0"],
        pb::PrefillPlacement::Colocated,
        &reference,
    );
    // Conditional disaggregation with a high limit: everything prefilled locally.
    check_mode(
        &["--local-prefill-max-tokens", "100000"],
        pb::PrefillPlacement::Local,
        &reference,
    );
}

/// `case`'s prompt ids through the router, greedy for as many tokens as llama.cpp's run.
async fn reference_run(
    c: &mut support::GenClient,
    case: &support::reference::ReferenceCase,
) -> support::Completion {
    let n = case.greedy_ids.len() as u32;
    generate(c, greedy(support::tokens(&case.prompt_ids), n))
        .await
        .expect("generate")
}

/// The reference prompts of llama.cpp: the cluster keeps the comparison rule (greedy ids
/// equal llama.cpp's before the first near-tie) on every prompt, as the engine alone does
/// with its default form (quantized weights, f16 KV: llama.cpp's arithmetic).
#[test]
fn up_follows_the_reference_rule() {
    let cases = support::reference::cases();
    let (_p, url) = up(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let kept = rt.block_on(async {
        let mut c = client(&url).await;
        let mut kept = 0;
        for case in &cases {
            let want = &case.greedy_ids;
            let got = reference_run(&mut c, case).await;
            assert_eq!(got.ids.first(), want.first(), "{}: first token", case.id);
            kept += usize::from(case.keeps_rule(&got.ids));
        }
        kept
    });
    assert_eq!(
        kept,
        cases.len(),
        "rule kept on {kept}/{} prompts",
        cases.len()
    );
}

/// The second architecture through the cluster (issue 27): Gemma 3's reference prompts,
/// every one prefilled on the prefill worker (`--local-prefill-max-tokens 0`), its KV
/// moved layer by layer (18 layers x K and V x 1 KV head x 256 dims x 2 bytes per token)
/// and decoded on the decode worker, keep llama.cpp's rule as `duet run` does.
#[test]
fn up_serves_gemma3_by_the_reference_rule_with_remote_prefill() {
    let cases = support::reference::gemma_cases();
    let gemma = support::gemma_model();
    let (p, url) = up(&[
        "--model",
        gemma.to_str().unwrap(),
        "--local-prefill-max-tokens",
        "0",
        "--kv-pool",
        "256MiB",
        "--chat-template",
        GEMMA_CHAT_TEMPLATE,
    ]);
    // The tokenizer that the expected chat prompts are encoded with.
    let front = duet_engine::TextFrontend::load(&gemma).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&url).await;
        for case in &cases {
            let want = &case.greedy_ids;
            let got = reference_run(&mut c, case).await;
            assert!(
                case.keeps_rule(&got.ids),
                "{}: got {:?}, llama.cpp {want:?}",
                case.id,
                got.ids
            );
            let t = got.timings();
            assert_eq!(placement(&got), pb::PrefillPlacement::Remote, "{t:?}");
            let blocks = (case.prompt_ids.len() as u64).div_ceil(16);
            let held = u64::from(t.kv_reused_tokens) / 16;
            assert_eq!(t.kv_bytes, (blocks - held) * 16 * 18 * 2 * 256 * 2, "{t:?}");
        }
        // A prompt sharing the longest reference prompt's first three quarters. The prefill
        // worker registered every block chunk by chunk, so it computes only the rest; the
        // decode worker imported that prompt's local layers only from its last window on
        // (`KvCache::expect_prompt`), so it has no window at this earlier branch point and
        // receives the whole prompt (SGLang's decode side keeps the same window tail). The
        // tokens equal an uncached `duet run`'s.
        let long = cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap();
        let chars = long.prompt.chars().count();
        let (cut, _) = long.prompt.char_indices().nth(chars * 3 / 4).unwrap();
        let b = format!(
            "{} Then the story took a turn nobody expected.",
            &long.prompt[..cut]
        );
        let got = generate(&mut c, greedy(text(&b), 8)).await.unwrap();
        let t = got.timings();
        let usage = got.fin.clone().and_then(|f| f.usage).unwrap_or_default();
        let cached = usage.cached_tokens;
        assert!(cached >= 800, "{cached} cached tokens: {t:?}");
        assert_eq!(t.kv_reused_tokens, 0, "{t:?}");
        let blocks = u64::from(usage.prompt_tokens).div_ceil(16);
        assert_eq!(t.kv_bytes, blocks * 16 * 18 * 2 * 256 * 2, "{t:?}");
        let run = support::run_json(
            "native",
            &[
                "--model",
                gemma.to_str().unwrap(),
                "--prompt",
                &b,
                "--max-tokens",
                "8",
            ],
        );
        assert_eq!(got.ids, support::ids_of(&run, "ids"), "{t:?}");
        // A local window on a model whose own layers attend locally: refused as a failed
        // precondition (issue 26), never served as full attention.
        let mut req = greedy(support::tokens(&cases[0].prompt_ids), 4);
        req.attention = Some(duet_serving::convert::attention_to_proto(
            duet_engine::AttentionPolicy::Window(duet_engine::Window {
                window: 64,
                sinks: 4,
            }),
        ));
        let e = generate(&mut c, req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        // Chat through `--chat-template` (this base model's GGUF has none): the same prompt
        // and tokens as `duet run --chat` with the same file.
        let run = support::run_json(
            "native",
            &[
                "--model",
                gemma.to_str().unwrap(),
                "--chat",
                "--chat-template",
                GEMMA_CHAT_TEMPLATE,
                "--prompt",
                "Name a colour.",
                "--max-tokens",
                "6",
            ],
        );
        let turns = "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n";
        let want_prompt = front.tokenizer.encode(turns, true).unwrap();
        assert_eq!(support::ids_of(&run, "prompt_ids"), want_prompt);
        assert!(
            front.tokenizer.is_control(want_prompt[1]),
            "{want_prompt:?}"
        );
        let got = generate(&mut c, greedy(chat("Name a colour."), 6))
            .await
            .unwrap();
        assert_eq!(got.ids, support::ids_of(&run, "ids"));
    });
    // The OpenAI door reports the model it serves.
    let http = p.wait_for("http listening on", support::START);
    let models = http_get(&http, "/v1/models");
    assert!(
        models.contains(r#""id":"gemma-3-270m-q4_k_m""#)
            && models.contains(r#""max_model_len":32768"#),
        "{models}"
    );
    // The OpenAI chat door with a system message: Gemma has no system turn, so the
    // template puts its text at the head of the first user turn.
    let body = serde_json::json!({
        "model": "gemma-3-270m-q4_k_m",
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a colour."},
        ],
        "max_tokens": 2,
        "temperature": 0.0,
    });
    let (status, reply) = support::http(
        "POST",
        &format!("{http}/v1/chat/completions"),
        Some(("application/json", &body.to_string())),
    );
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let turns = "<start_of_turn>user\nAnswer in one word.\n\nName a colour.<end_of_turn>\n\
                 <start_of_turn>model\n";
    let want = front.tokenizer.encode(turns, true).unwrap().len();
    assert_eq!(reply["usage"]["prompt_tokens"], want, "{reply}");
}

/// A Gemma chat template for `--chat-template` (the Gemma 3 270M GGUF has none).
const GEMMA_CHAT_TEMPLATE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/data/gemma3-chat-template.jinja"
);

/// The body of `GET path` on `base` (`http://host:port`), over a plain socket.
fn http_get(base: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let host = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}
