//! Faults in the middle of a KV transfer on the default same-host path: the decode worker
//! receiving a prompt's layers from the prefill worker's send arena (which it has mapped)
//! is killed; a frame is damaged on the way. Over tcp too.

use super::*;

/// The decode worker receiving a remote prefill's KV is killed (SIGKILL) a third of the way
/// into the prefill, with the prefill worker's arena mapped. The prefill worker's transfer
/// fails within `--kv-timeout`, its scratch blocks all come back, and the request, which
/// had sent no token yet, is retried on the other decode worker with `duet run`'s tokens.
#[test]
fn decode_worker_killed_mid_transfer_from_the_arena_request_completes_elsewhere() {
    decode_worker_killed_mid_transfer(Kv::Shm);
}

#[test]
fn decode_worker_killed_mid_transfer_over_tcp_request_completes_elsewhere() {
    decode_worker_killed_mid_transfer(Kv::Tcp);
}

fn decode_worker_killed_mid_transfer(kv: Kv) {
    let (mut cl, http) = cluster_over(kv, 1, 2, &["--local-prefill-max-tokens", "0"]);
    let decode_addrs: Vec<String> = cl.decode.iter().map(Proc::workers_addr).collect();
    let prefill_addr = cl.prefill[0].workers_addr();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(1, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        // How long a prompt as long takes to prefill here (another one: the measured
        // prompt must reach the prefill worker uncached).
        let timing = generate(&mut c, greedy(text(&long_prompt_from(7, 700)), 4))
            .await
            .expect("undisturbed run");
        let prefill_time = timing.timings().prefill_seconds;
        let prompt = long_prompt(700);
        let mut c2 = c.clone();
        let req = greedy(text(&prompt), 8);
        let t0 = Instant::now();
        let task = tokio::spawn(async move { generate(&mut c2, req).await });
        // The receiving decode worker is the one holding the reservation.
        let victim = holder(&decode_addrs, |a| async move {
            support::decode_status(&a).await.reservations > 0
        })
        .await;
        tokio::time::sleep(Duration::from_secs_f64(prefill_time / 3.0)).await;
        cl.decode[victim].kill9();
        let done = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("the request ends")
            .expect("join")
            .expect("the request survives the decode worker's death");
        eprintln!(
            "{kv:?}: completed {:?} after it was sent (an undisturbed prefill: {prefill_time:.2} s)",
            t0.elapsed()
        );
        assert_eq!(
            done.ids,
            support::run_reference(&prompt, false, 8),
            "same greedy tokens as duet run"
        );
        assert_eq!(
            done.timings().decode_worker,
            format!("decode-{}", 1 - victim),
            "completed on the surviving decode worker"
        );
        // The prefill worker holds nothing once the failed transfer is over.
        prefill_idle(&prefill_addr, Duration::from_secs(15)).await;
        support::assert_pool_empty(&decode_addrs[1 - victim], Duration::from_secs(10)).await;
        assert!(
            sent_over(&cl.prefill[0], kv) >= 2.0,
            "the KV went over {kv:?}"
        );
        let m = scrape_async(&http).await;
        assert!(
            support::scrape_sum(&m, "duet_router_retries_total", &[]) >= 1.0,
            "the retry is counted"
        );
        router_idle(&http, Duration::from_secs(10)).await;
    });
}

/// A bit of the first transfer's second layer is flipped on the way (the prefill worker of
/// this test build injects it after computing the frame's MAC, as a damaged link or a man in
/// the middle would). The decode worker refuses the frame (`bad_mac` on its `/metrics`),
/// releases the reservation, and the request is retried: the client gets `duet run`'s tokens
/// and never a token computed from the damaged KV.
#[test]
fn corrupted_kv_over_shm_is_refused_and_the_request_recovers() {
    corrupted_kv_is_refused(Kv::Shm);
}

#[test]
fn corrupted_kv_over_tcp_is_refused_and_the_request_recovers() {
    corrupted_kv_is_refused(Kv::Tcp);
}

fn corrupted_kv_is_refused(kv: Kv) {
    let mut env = kv.env();
    env.push(("DUET_KV_FAULTS", "flip@2"));
    let args = [
        "--http-listen",
        "127.0.0.1:0",
        "--local-prefill-max-tokens",
        "0",
    ];
    let cl = Cluster::start_logged(1, 2, &args, &env);
    let http = cl.router.wait_for("http listening on", support::START);
    let decode_addrs: Vec<String> = cl.decode.iter().map(Proc::workers_addr).collect();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(1, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        let prompt = long_prompt(300);
        let done = generate(&mut c, greedy(text(&prompt), 8))
            .await
            .expect("the request survives the corrupted transfer");
        assert_eq!(
            done.ids,
            support::run_reference(&prompt, false, 8),
            "same greedy tokens as duet run"
        );
        let bad_macs: f64 = cl
            .decode
            .iter()
            .map(|d| {
                let (_, m) = support::http_get(&d.metrics_url());
                support::scrape_sum(
                    &m,
                    "duet_kv_transfer_failures_total",
                    &["direction=\"received\"", "reason=\"bad_mac\""],
                )
            })
            .sum();
        assert_eq!(bad_macs, 1.0, "the damaged frame was refused for its MAC");
        assert!(
            sent_over(&cl.prefill[0], kv) >= 1.0,
            "the retried KV went over {kv:?}"
        );
        for a in &decode_addrs {
            support::assert_pool_empty(a, Duration::from_secs(10)).await;
        }
        let m = scrape_async(&http).await;
        assert!(
            support::scrape_sum(&m, "duet_router_retries_total", &[]) >= 1.0,
            "the retry is counted"
        );
        router_idle(&http, Duration::from_secs(10)).await;
    });
}
