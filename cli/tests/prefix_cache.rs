//! Reusing KV across requests, as a user sees it: a shared system prompt is prefilled once
//! (the second request computes only its own suffix, with the tokens of a run without the
//! cache); blocks evicted to the host and disk tiers come back on a hit with identical
//! tokens; and the router sends a conversation's turns to the prefill worker holding its
//! prefix, and elsewhere, still correct, when that worker dies.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::time::Duration;

use duet_proto::v1 as pb;
use support::{client, generate, greedy, http_get, run_reference, scrape_sum, text, up, Cluster};

/// A prompt prefix shared by every request of the tests (about 110 tokens).
const SYSTEM: &str = "You are the help desk of the Northfield public library. Answer in one \
    or two sentences. The library opens at nine and closes at five on weekdays, opens at ten \
    and closes at two on Saturdays, and stays closed on Sundays and public holidays. Members \
    may borrow up to eight books for three weeks and renew them twice online. The reading \
    room on the first floor is quiet; the children's corner is on the ground floor.\n";

fn ask(question: &str) -> String {
    format!("{SYSTEM}Question: {question}\nAnswer:")
}

async fn token_ids(c: &mut support::GenClient, t: &str) -> Vec<u32> {
    c.tokenize(pb::TokenizeRequest {
        model: String::new(),
        input: Some(pb::tokenize_request::Input::Text(t.into())),
    })
    .await
    .expect("tokenize")
    .into_inner()
    .ids
}

fn usage(c: &support::Completion) -> pb::Usage {
    c.fin.clone().and_then(|f| f.usage).unwrap_or_default()
}

fn scrape(url: &str) -> String {
    let (code, body) = http_get(url);
    assert_eq!(code, 200, "GET {url}");
    body
}

/// Whole 16-token blocks a cached prefix of `shared` tokens covers in a `len`-token prompt
/// (a hit leaves at least two tokens to compute).
fn reusable(shared: usize, len: usize) -> usize {
    (shared / 16 * 16).min(duet_engine::reusable_tokens(len, 16))
}

#[test]
fn a_shared_system_prompt_is_prefilled_once_with_the_tokens_of_an_uncached_run() {
    let a = ask("When does the library open on Saturday?");
    // Long enough that, after the shared prefix, more than the local prefill limit (32
    // tokens) is left: prefilled remotely.
    let b = ask(
        "My grandmother, who has been a member for forty years, would like to know how many \
         books she may borrow at once, and for how long, because she reads a lot in winter.",
    );
    // Short after the shared prefix: the decode worker, which holds that prefix, prefills it.
    let c_prompt = ask("Is there a quiet room?");
    let want_b = run_reference(&b, false, 16);
    let want_c = run_reference(&c_prompt, false, 16);
    let (p, url) = up(&[]);
    let metrics = p.wait_for("metrics on", support::START);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&url).await;
        let (ids_a, ids_b) = (token_ids(&mut c, &a).await, token_ids(&mut c, &b).await);
        let shared = ids_a.iter().zip(&ids_b).take_while(|(x, y)| x == y).count();
        assert!(shared >= 80, "the prompts share {shared} tokens");

        let first = generate(&mut c, greedy(text(&a), 16)).await.expect("first");
        assert_eq!(usage(&first).cached_tokens, 0, "nothing cached yet");
        // The router learns what the workers cache from their KV event streams: it may lag
        // them by a moment (docs of `router::kv_index`). Once both workers' blocks of the
        // first prompt reached it, its expectation must be exact.
        let index = |m: &str, name: &str| scrape_sum(m, name, &[]);
        let want_blocks = (2 * (ids_a.len() / 16)) as f64;
        let t0 = std::time::Instant::now();
        let mut before = scrape(&metrics);
        while index(&before, "duet_router_kv_index_blocks") < want_blocks {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the router's KV index holds {} blocks after 10 s, want {want_blocks} \
                 (resyncs: {})",
                index(&before, "duet_router_kv_index_blocks"),
                index(&before, "duet_router_kv_index_resyncs_total"),
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
            before = scrape(&metrics);
        }
        let waited = t0.elapsed();
        let second = generate(&mut c, greedy(text(&b), 16))
            .await
            .expect("second");
        let after = scrape(&metrics);

        let t = second.timings();
        assert_eq!(t.placement, pb::PrefillPlacement::Remote as i32, "{t:?}");
        let cached = usage(&second).cached_tokens as usize;
        assert_eq!(cached, reusable(shared, ids_b.len()), "{t:?}");
        assert_eq!(
            t.prefix_match_tokens as usize,
            cached,
            "the router expected it (index caught up in {waited:?}; before/after: {} / {} \
             blocks, resyncs {} / {})",
            index(&before, "duet_router_kv_index_blocks"),
            index(&after, "duet_router_kv_index_blocks"),
            index(&before, "duet_router_kv_index_resyncs_total"),
            index(&after, "duet_router_kv_index_resyncs_total"),
        );
        // The prefill worker computed only the suffix...
        let computed = |m: &str| scrape_sum(m, "duet_prefill_prompt_tokens_total", &[]);
        assert_eq!(
            computed(&after) - computed(&before),
            (ids_b.len() - cached) as f64
        );
        let hits = |m: &str| {
            scrape_sum(
                m,
                "duet_prefix_cache_hits_total",
                &["role=\"prefill\"", "tier=\"device\""],
            )
        };
        assert_eq!(hits(&after) - hits(&before), cached as f64);
        // ...and the decode worker, which kept the first prompt's blocks, received only
        // the KV it lacked.
        assert_eq!(t.kv_reused_tokens as usize, cached);
        let blocks = ids_b.len().div_ceil(16) - cached / 16;
        // Blocks x tokens x layers x K and V x KV heads x dims x 2 bytes (f16 cache).
        assert_eq!(t.kv_bytes, (blocks * 16 * 30 * 2 * 3 * 64 * 2) as u64);
        assert_eq!(second.ids, want_b, "tokens with the cache equal duet run's");

        // Conditional disaggregation counts the decode worker's own cached prefix: what is
        // left of this prompt is short enough to prefill there.
        let ids_c = token_ids(&mut c, &c_prompt).await;
        let shared_c = ids_a.iter().zip(&ids_c).take_while(|(x, y)| x == y).count();
        let third = generate(&mut c, greedy(text(&c_prompt), 16))
            .await
            .expect("third");
        let t = third.timings();
        assert_eq!(t.placement, pb::PrefillPlacement::Local as i32, "{t:?}");
        assert!(
            t.routing_reason.contains("cached on the decode worker"),
            "{t:?}"
        );
        assert_eq!(
            usage(&third).cached_tokens as usize,
            reusable(shared_c, ids_c.len())
        );
        assert_eq!(
            third.ids, want_c,
            "local prefill after a cached prefix equals duet run"
        );
        // OpenAI's usage field says the same.
        let http = p.wait_for("http listening on", support::START);
        let body = serde_json::json!({"prompt": b, "max_tokens": 4, "temperature": 0});
        let (code, reply) = support::http(
            "POST",
            &format!("{http}/v1/completions"),
            Some(("application/json", &body.to_string())),
        );
        assert_eq!(code, 200, "{reply}");
        let v: serde_json::Value = serde_json::from_str(&reply).expect("json");
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some(reusable(ids_b.len(), ids_b.len()) as u64),
            "{v}"
        );
    });
}

#[test]
fn blocks_evicted_to_host_and_disk_come_back_with_identical_tokens() {
    let dir = std::env::temp_dir().join(format!("duet-kv-tier-test-{}", std::process::id()));
    let prompt = ask("Where is the reading room?");
    let want = run_reference(&prompt, false, 12);
    // A pool of 11 blocks; 5 in host memory, 22 on disk (f16 KV: 360 KiB a block).
    let (p, url) = up(&[
        "--local-prefill-max-tokens",
        "0",
        "--kv-pool",
        "4MiB",
        "--kv-host-pool",
        "2MiB",
        "--kv-disk-dir",
        dir.to_str().expect("utf-8 path"),
        "--kv-disk-pool",
        "8MiB",
    ]);
    let metrics = p.wait_for("metrics on", support::START);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&url).await;
        let len = token_ids(&mut c, &prompt).await.len();
        let first = generate(&mut c, greedy(text(&prompt), 12))
            .await
            .expect("first");
        assert_eq!(first.ids, want);
        assert!(dir.join("prefill-0.kv").exists() && dir.join("decode-0.kv").exists());
        // Other long prompts take the whole pool: the first prompt's blocks move down.
        for topic in [
            "ships of the northern sea",
            "bread and ovens",
            "the history of clocks",
        ] {
            let other = format!(
                "Write a long and careful essay about {topic}, with examples from many \
                 centuries and countries, and a summary for young readers at the end of it. {}",
                "Mention names, dates and places where you can. ".repeat(6)
            );
            generate(&mut c, greedy(text(&other), 4))
                .await
                .expect("other");
        }
        let before = scrape(&metrics);
        let again = generate(&mut c, greedy(text(&prompt), 12))
            .await
            .expect("again");
        let after = scrape(&metrics);
        let hits = |m: &str, role: &str, tier: &str| {
            scrape_sum(
                m,
                "duet_prefix_cache_hits_total",
                &[&format!("role=\"{role}\""), &format!("tier=\"{tier}\"")],
            )
        };
        let delta = |role: &str, tier: &str| hits(&after, role, tier) - hits(&before, role, tier);
        let prefetched = |m: &str| {
            scrape_sum(
                m,
                "duet_prefix_cache_prefetched_blocks_total",
                &["role=\"prefill\""],
            )
        };
        // The prefill worker's blocks came up from the lower tiers: at the hit, or before it
        // when the router's prefetch (it saw them there in the KV events) arrived first.
        let prefill_lower = delta("prefill", "host") + delta("prefill", "disk");
        let moved_up = prefetched(&after) - prefetched(&before);
        assert!(
            prefill_lower + moved_up * 16.0 > 0.0,
            "prefill: host+disk hits {prefill_lower}, prefetched {moved_up} blocks"
        );
        let prefill_all = prefill_lower + delta("prefill", "device");
        assert_eq!(prefill_all as usize, usage(&again).cached_tokens as usize);
        // The decode worker's reservation took them from its own lower tiers.
        let decode_lower = delta("decode", "host") + delta("decode", "disk");
        assert!(decode_lower > 0.0, "decode: host+disk hits {decode_lower}");
        assert_eq!(
            usage(&again).cached_tokens as usize,
            duet_engine::reusable_tokens(len, 16)
        );
        assert_eq!(
            again.ids, want,
            "tokens after the round trip through the lower tiers"
        );
        p.assert_decode_pools_empty(Duration::from_secs(2)).await;
    });
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One conversation: each turn's prompt is the last one, its reply and a new question.
struct Conversation {
    prompt: String,
}

impl Conversation {
    fn new(topic: &str) -> Self {
        Conversation {
            prompt: format!("{SYSTEM}The member asks about {topic}.\n"),
        }
    }

    async fn turn(
        &mut self,
        c: &mut support::GenClient,
        question: &str,
    ) -> (support::Completion, String) {
        self.prompt
            .push_str(&format!("Question: {question}\nAnswer:"));
        let asked = self.prompt.clone();
        let r = generate(c, greedy(text(&asked), 12)).await.expect("turn");
        self.prompt.push_str(&r.text);
        self.prompt.push('\n');
        (r, asked)
    }
}

#[test]
fn conversation_turns_follow_their_prefix_and_move_when_its_worker_dies() {
    let mut cl = Cluster::start(2, 1, &["--local-prefill-max-tokens", "0"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut references: Vec<(String, Vec<u32>)> = Vec::new();
    rt.block_on(async {
        cl.wait_workers(2, 1, Duration::from_secs(30)).await;
        let mut c = client(&cl.url).await;
        // A long request keeps prefill-0 busy, so the conversation starts on prefill-1;
        // afterwards a router routing on load alone would send every turn to prefill-0
        // (the idle tie-break), one routing on the prefix keeps them on prefill-1.
        let busy = {
            let mut c = c.clone();
            let long = format!(
                "{} Summarise.",
                "The river bends east of the mill. ".repeat(60)
            );
            tokio::spawn(async move { generate(&mut c, greedy(text(&long), 2)).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut conv = Conversation::new("opening hours");
        let (t1, asked) = conv.turn(&mut c, "Is the library open on Sunday?").await;
        references.push((asked, t1.ids.clone()));
        busy.await.unwrap().expect("busy request");
        let home = t1.timings().prefill_worker;
        assert_eq!(home, "prefill-1", "{:?}", t1.timings());
        for q in ["And on Saturday?", "Until what time?"] {
            // Placement weighs load against the cached prefix: with both prefill workers'
            // published records idle (they lag the workers by a few hundred ms), only the
            // prefix decides.
            support::router_sees_prefill_idle(&cl.url, Duration::from_secs(10)).await;
            let (t, asked) = conv.turn(&mut c, q).await;
            let tm = t.timings();
            assert_eq!(tm.prefill_worker, home, "turn {q:?}: {tm:?}");
            assert!(
                tm.prefix_match_tokens > 0 && usage(&t).cached_tokens > 0,
                "{tm:?}"
            );
            references.push((asked, t.ids.clone()));
        }

        // The worker holding the conversation dies: the next turns go elsewhere.
        cl.prefill[1].kill9();
        let (t, asked) = conv.turn(&mut c, "Can I renew books online?").await;
        assert_eq!(t.timings().prefill_worker, "prefill-0", "{:?}", t.timings());
        references.push((asked, t.ids.clone()));
        let (t, asked) = conv.turn(&mut c, "How many times?").await;
        let tm = t.timings();
        assert_eq!(tm.prefill_worker, "prefill-0", "{tm:?}");
        assert!(
            usage(&t).cached_tokens > 0,
            "the new worker holds the prefix now: {tm:?}"
        );
        references.push((asked, t.ids.clone()));
    });
    // Every turn, before and after the move, produced duet run's tokens.
    for (prompt, ids) in references {
        assert_eq!(
            ids,
            run_reference(&prompt, false, 12),
            "turn ending {:?}",
            &prompt[prompt.len() - 40..]
        );
    }
}
