//! A decode worker killed mid-stream: the router migrates the stream to the other decode
//! worker, which recomputes the prompt and replays the tokens already sent, one per step, so
//! the client reads the text of an undisturbed run; with full attention over shared memory
//! (the default) and tcp, and under a local window and SnapKV (issue 26), whose policy the
//! new decode worker applies again.

use super::*;

const STORY: &str = "Write a short story about a lighthouse keeper.";

#[test]
fn decode_worker_killed_mid_stream_the_stream_continues_elsewhere() {
    decode_worker_killed_mid_stream(Kv::Shm, None, STORY);
}

#[test]
fn decode_worker_killed_mid_stream_over_tcp_the_stream_continues_elsewhere() {
    decode_worker_killed_mid_stream(Kv::Tcp, None, STORY);
}

/// A windowed stream (issue 26) migrates as any other: the new decode worker recomputes the
/// prompt and replays the sent tokens under the same window, and the text goes on
/// unchanged. Narrow enough to drop a block before the kill: after about 40 prompt tokens
/// and 8 generated, the next query sees from position 41 on, so block 1 (16..32) is gone.
#[test]
fn decode_worker_killed_mid_stream_under_a_window_the_stream_continues_elsewhere() {
    decode_worker_killed_mid_stream(Kv::Shm, Some("window=8,sinks=4"), &long_prompt(40));
}

/// A SnapKV stream migrates too: the new decode worker recomputes the prompt, compresses it
/// as the prefill worker did, and replays the sent tokens.
#[test]
fn decode_worker_killed_mid_stream_under_snapkv_the_stream_continues_elsewhere() {
    decode_worker_killed_mid_stream(Kv::Shm, Some("snapkv=40,observe=16"), &long_prompt(60));
}

fn decode_worker_killed_mid_stream(kv: Kv, attention: Option<&str>, prompt: &str) {
    let (mut cl, http) = cluster_over(kv, 1, 2, &["--local-prefill-max-tokens", "0"]);
    let decode_addrs: Vec<String> = cl.decode.iter().map(Proc::workers_addr).collect();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(1, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        let policy = attention.map(|a| {
            duet_serving::convert::attention_to_proto(a.parse().expect("attention policy"))
        });
        let req = || pb::GenerateRequest {
            ignore_eos: true,
            attention: policy,
            ..greedy(text(prompt), 48)
        };
        let reference = generate(&mut c, req()).await.expect("undisturbed run");
        assert_eq!(reference.ids.len(), 48);
        let (got, killed) =
            stream_disturbing_decode(&mut c, req(), &decode_addrs, 8, |i| cl.decode[i].kill9())
                .await;
        assert_eq!(got.ids, reference.ids, "no repeated or missing token");
        assert_eq!(
            got.text, reference.text,
            "the same text as an undisturbed run"
        );
        let fin = got.fin.expect("final message");
        let usage = fin.usage.expect("usage");
        assert_eq!(usage.completion_tokens, 48, "{usage:?}");
        assert_eq!(
            usage.prompt_tokens,
            reference
                .fin
                .as_ref()
                .and_then(|f| f.usage)
                .map_or(0, |u| u.prompt_tokens)
        );
        let survivor = 1 - killed;
        assert_eq!(
            fin.timings.expect("timings").decode_worker,
            format!("decode-{survivor}"),
            "finished on the surviving decode worker"
        );
        support::assert_pool_empty(&decode_addrs[survivor], Duration::from_secs(10)).await;
        let m = scrape_async(&http).await;
        assert_eq!(
            support::scrape_sum(&m, "duet_router_migrations_total", &[]),
            1.0,
            "the migration is counted"
        );
        // The first run and the disturbed stream were prefilled remotely (the migration
        // replays its tokens on the new decode worker).
        assert!(
            sent_over(&cl.prefill[0], kv) >= 2.0,
            "the KV went over {kv:?}"
        );
        router_idle(&http, Duration::from_secs(10)).await;
    });
}
