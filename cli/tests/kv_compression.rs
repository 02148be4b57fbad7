//! Compression in flight: `duet up --kv-transport tcp` with every prompt prefilled remotely,
//! once per `--kv-compression`. The KV really crosses a socket in the chosen encoding (wire
//! bytes counted by both workers are the documented fraction of the payload), the decode
//! worker stores its own f32, and the greedy tokens of llama.cpp's reference prompts are
//! compared with the uncompressed run: what each encoding costs in output is printed (and
//! reported in kv-transfer/README.md), and the bounds measured on this machine are asserted.

mod support;

use std::time::Duration;

use duet_proto::v1 as pb;
use support::reference::ReferenceCase;
use support::{client, generate, greedy, http_get, scrape_sum, up, START};

/// What one `duet up` produced for every reference prompt, and its wire counters.
struct Run {
    tokens: Vec<Vec<u32>>,
    payload_sent: f64,
    wire_sent: f64,
    wire_received: f64,
}

fn run(compression: &str, cases: &[ReferenceCase]) -> Run {
    let (p, url) = up(&[
        "--kv-transport",
        "tcp",
        "--kv-compression",
        compression,
        "--local-prefill-max-tokens",
        "0",
        "--prefix-cache",
        "off",
        "--kv-pool",
        "256MiB",
        // Compression is for f32 caches (f16 on the wire halves them); duet's default f16
        // cache would make `f16` a no-op.
        "--kv-dtype",
        "f32",
    ]);
    let http = p.wait_for("http listening on", START);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let tokens = rt.block_on(async {
        let mut c = client(&url).await;
        let mut out = Vec::new();
        for case in cases {
            let got = generate(
                &mut c,
                greedy(
                    support::tokens(&case.prompt_ids),
                    case.greedy_ids.len() as u32,
                ),
            )
            .await
            .unwrap_or_else(|e| panic!("{compression} {}: {e:?}", case.id));
            let placement = pb::PrefillPlacement::try_from(got.timings().placement);
            assert_eq!(
                placement,
                Ok(pb::PrefillPlacement::Remote),
                "{}: every prompt crosses the wire",
                case.id
            );
            out.push(got.ids);
        }
        p.assert_decode_pools_empty(Duration::from_secs(2)).await;
        out
    });
    let (code, m) = http_get(&format!("{http}/metrics"));
    assert_eq!(code, 200);
    let label = format!("compression=\"{compression}\"");
    Run {
        tokens,
        payload_sent: scrape_sum(&m, "duet_kv_transfer_bytes_total", &["direction=\"sent\""]),
        wire_sent: scrape_sum(
            &m,
            "duet_kv_transfer_wire_bytes_total",
            &["direction=\"sent\"", &label],
        ),
        wire_received: scrape_sum(
            &m,
            "duet_kv_transfer_wire_bytes_total",
            &["direction=\"received\"", &label],
        ),
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How much of the uncompressed run a lossy encoding must reproduce: tokens equal before the
/// first difference, summed over the prompts, as a share of all tokens generated.
///
/// Lossy compression moves logits by about as much as the rounding this model amplifies
/// (docs/engine.md), so it flips near-ties, and where those fall differs between machines
/// (not between runs on one machine). Measured shares (kv-transfer/README.md): f16 0.68 and
/// int8 0.63 on an AMD EPYC; 0.39 and 0.35 in CI's run of 70fc9e9, whose uncompressed run
/// itself kept llama.cpp's rule on 6/10 rather than 7/10. Decoding every head with the first
/// head's int8 scale, a plausible bug, gives 0.10 (and keeps the rule on 0/10).
const MIN_SHARED_TOKENS: f64 = 0.25;

#[test]
fn compressed_kv_keeps_greedy_tokens_within_measured_bounds() {
    let cases = support::reference::cases();
    let base = run("none", &cases);
    assert!(base.payload_sent > 0.0);
    assert_eq!(
        base.wire_sent, base.payload_sent,
        "no compression: wire = payload"
    );
    assert_eq!(base.wire_received, base.payload_sent);
    let base_kept = cases
        .iter()
        .zip(&base.tokens)
        .filter(|(c, t)| c.keeps_rule(t))
        .count();
    eprintln!("none: reference rule kept on {base_kept}/{}", cases.len());

    // f32 region of 16 tokens x 3 heads x 64 dims: f16 halves it; int8 is one byte per
    // element plus a 4-byte scale per head.
    let elems = 16.0 * 3.0 * 64.0;
    for (compression, ratio) in [("f16", 0.5), ("int8", (elems + 12.0) / (elems * 4.0))] {
        let r = run(compression, &cases);
        assert_eq!(
            r.payload_sent, base.payload_sent,
            "{compression}: same KV moved"
        );
        let measured = r.wire_sent / r.payload_sent;
        assert!(
            (measured - ratio).abs() < 1e-9,
            "{compression}: wire/payload {measured}, expected {ratio}"
        );
        assert_eq!(
            r.wire_received, r.wire_sent,
            "{compression}: both sides agree"
        );
        let mut identical = 0;
        let mut kept = 0;
        let mut shared = 0;
        let mut total = 0;
        for ((case, got), want) in cases.iter().zip(&r.tokens).zip(&base.tokens) {
            let same = common_prefix(got, want);
            identical += usize::from(got == want);
            kept += usize::from(case.keeps_rule(got));
            shared += same;
            total += want.len();
            eprintln!(
                "{compression} {}: {same}/{} tokens equal to the uncompressed run",
                case.id,
                want.len()
            );
        }
        let share = shared as f64 / total as f64;
        eprintln!(
            "{compression}: identical on {identical}/{n}, {shared}/{total} tokens ({share:.2}) \
             equal before the first difference, reference rule kept on {kept}/{n} \
             (uncompressed {base_kept}/{n})",
            n = cases.len()
        );
        // The first token is the prefill worker's own; every later one reads the decoded KV.
        assert!(
            share >= MIN_SHARED_TOKENS,
            "{compression}: only {shared}/{total} tokens equal the uncompressed run's"
        );
    }
}
