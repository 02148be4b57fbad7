//! Either side of a KV transfer frozen (SIGSTOP) in the middle of it, on the default
//! same-host path (shared memory, the send arena) and over tcp. A frozen process keeps its
//! sockets, its lease and its mapping of the arena: nothing is closed for the other side to
//! notice, so only the timeouts can give it up (`--kv-timeout` on the link, the HTTP/2
//! keepalive on the router's and the decode worker's gRPC channels). The request, which has
//! sent no token yet, completes elsewhere with `duet run`'s tokens, and once the frozen
//! process thaws every block on both sides is free again.

use super::*;

/// `--kv-timeout` of these clusters: the longest a transfer may wait on a silent peer.
const KV_TIMEOUT: &str = "3s";

/// How far into a prompt's prefill (several seconds here) a side is frozen: its first layers
/// have been sent, the rest are still to come.
const INTO_PREFILL: Duration = Duration::from_millis(400);

#[test]
fn transfer_frozen_on_either_side_over_shm_is_given_up_and_requests_complete() {
    frozen_mid_transfer(Kv::Shm);
}

#[test]
fn transfer_frozen_on_either_side_over_tcp_is_given_up_and_requests_complete() {
    frozen_mid_transfer(Kv::Tcp);
}

fn frozen_mid_transfer(kv: Kv) {
    let mut env = kv.env();
    env.push(("DUET_KV_TIMEOUT", KV_TIMEOUT));
    let args = [
        "--http-listen",
        "127.0.0.1:0",
        "--local-prefill-max-tokens",
        "0",
    ];
    let cl = Cluster::start_logged(2, 2, &args, &env);
    let http = cl.router.wait_for("http listening on", support::START);
    let decode_addrs: Vec<String> = cl.decode.iter().map(Proc::workers_addr).collect();
    let prefill_addrs: Vec<String> = cl.prefill.iter().map(Proc::workers_addr).collect();
    let rt = rt();
    rt.block_on(async {
        cl.wait_workers(2, 2, Duration::from_secs(20)).await;
        let mut c = client(&cl.url).await;
        // A first prompt as long (another one: the measured prompts must reach the prefill
        // workers uncached) warms the workers up and shows how long such a prefill takes.
        let warm = generate(&mut c, greedy(text(&long_prompt_from(7, 700)), 4))
            .await
            .expect("undisturbed run");
        let prefill_time = warm.timings().prefill_seconds;
        // How long a prefill worker may still compute a prompt nobody waits for any more
        // (its forward pass is not interrupted) before it finds the KV link gone.
        let settle = Duration::from_secs_f64(3.0 * prefill_time) + Duration::from_secs(15);
        // 1. The decode worker receiving the KV freezes early in the prefill, its first layers sent.
        let prompt = long_prompt(700);
        let mut c2 = c.clone();
        let req = greedy(text(&prompt), 8);
        let t0 = Instant::now();
        let task = tokio::spawn(async move { generate(&mut c2, req).await });
        let victim = holder(&decode_addrs, |a| async move {
            support::decode_status(&a).await.reservations > 0
        })
        .await;
        holder(&prefill_addrs, |a| async move {
            support::prefill_status(&a).await.running > 0
        })
        .await;
        tokio::time::sleep(INTO_PREFILL).await;
        assert!(
            support::decode_status(&decode_addrs[victim])
                .await
                .reservations
                > 0,
            "the transfer ended before the freeze"
        );
        cl.decode[victim].signal("-STOP");
        let frozen_at = Instant::now();
        let done = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("the request ends while the decode worker is frozen")
            .expect("join")
            .expect("the request survives the frozen decode worker");
        eprintln!(
            "{kv:?}, decode frozen: completed {:?} after it was sent, {:?} after the freeze, \
             the retry's prefill {:.2} s (an undisturbed prefill: {prefill_time:.2} s)",
            t0.elapsed(),
            frozen_at.elapsed(),
            done.timings().prefill_seconds
        );
        assert_eq!(done.ids, support::run_reference(&prompt, false, 8));
        assert_eq!(
            done.timings().decode_worker,
            format!("decode-{}", 1 - victim)
        );
        // The prefill worker gave the frozen receiver up (--kv-timeout) and freed its blocks.
        for a in &prefill_addrs {
            prefill_idle(a, settle).await;
        }
        cl.decode[victim].signal("-CONT");
        // Thawed, the receiver finds its transfer failed and frees the reservation.
        for a in &decode_addrs {
            support::assert_pool_empty(a, Duration::from_secs(15)).await;
        }
        router_idle(&http, Duration::from_secs(10)).await;

        // 2. The prefill worker sending the KV freezes early in the prefill, its first layers sent.
        let prompt = long_prompt_from(5, 700);
        let reference = support::run_reference(&prompt, false, 8);
        support::router_sees_prefill_idle(&cl.url, Duration::from_secs(20)).await;
        let mut c2 = c.clone();
        let req = greedy(text(&prompt), 8);
        let t0 = Instant::now();
        let task = tokio::spawn(async move { generate(&mut c2, req).await });
        let victim = holder(&prefill_addrs, |a| async move {
            support::prefill_status(&a).await.running > 0
        })
        .await;
        tokio::time::sleep(INTO_PREFILL).await;
        assert!(
            support::prefill_status(&prefill_addrs[victim])
                .await
                .running
                > 0,
            "the prefill ended before the freeze"
        );
        cl.prefill[victim].signal("-STOP");
        let frozen_at = Instant::now();
        let done = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("the request ends while the prefill worker is frozen")
            .expect("join")
            .expect("the request survives the frozen prefill worker");
        eprintln!(
            "{kv:?}, prefill frozen: completed {:?} after it was sent, {:?} after the freeze, \
             the retry's prefill {:.2} s",
            t0.elapsed(),
            frozen_at.elapsed(),
            done.timings().prefill_seconds
        );
        assert_eq!(done.ids, reference, "same greedy tokens as duet run");
        assert_eq!(
            done.timings().prefill_worker,
            format!("prefill-{}", 1 - victim)
        );
        // The decode workers gave the frozen sender up: nothing is reserved for it.
        for a in &decode_addrs {
            support::assert_pool_empty(a, Duration::from_secs(15)).await;
        }
        cl.prefill[victim].signal("-CONT");
        // Thawed, the prefill worker finishes the forward pass it was frozen in (the cancel
        // sent while it was frozen waits in its socket), finds its KV link closed, and frees
        // everything: within one prefill of that prompt plus --kv-timeout.
        for a in &prefill_addrs {
            prefill_idle(a, settle).await;
        }
        for a in &decode_addrs {
            support::assert_pool_empty(a, Duration::from_secs(10)).await;
        }
        assert!(
            sent_over(&cl.prefill[1 - victim], kv) >= 1.0,
            "the KV went over {kv:?}"
        );
        let m = scrape_async(&http).await;
        assert!(
            support::scrape_sum(&m, "duet_router_retries_total", &[]) >= 2.0,
            "both retries are counted"
        );
        router_idle(&http, Duration::from_secs(10)).await;
    });
}
