//! Fault: the network link between a prefill worker and a decode worker goes down.
//!
//! Each worker runs in its own network namespace (its own "host"). Both reach etcd and the
//! router (in the root namespace) over a bridge; KV travels on a separate, direct link
//! between the two hosts (the decode worker advertises its KV endpoint on it with
//! `--kv-advertise-host`, as on a dedicated data network). The test takes that link down
//! and checks what a client and an operator see:
//!
//! - the transfer times out (`--kv-timeout`), and the request is retried: with the only
//!   prefill -> decode link down, the decode worker prefills it locally, and the client gets
//!   the same greedy tokens as `duet run` with no error;
//! - the KV blocks of the failed attempt are reclaimed on both sides (worker status);
//! - once the link is back, the pair is used again (after the router's back-off).
//!
//! Needs root and iproute2 (`ip netns`, veth, bridge): CI runs as root. Without them the
//! test fails with a message saying so, never silently passes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use support::etcd::EtcdServer;
use support::{greedy, text, Proc, START};

/// Network namespaces, a bridge and veth pairs; removed on drop.
struct Hosts {
    n: u32,
}

fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip` (iproute2 is needed): {e}"));
    assert!(
        o.status.success(),
        "`ip {}` failed (this test needs root and network namespaces): {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

impl Hosts {
    fn ns(&self, role: char) -> String {
        format!("duet-{role}{}", self.n)
    }
    fn bridge_ip(&self, host: u8) -> String {
        format!("10.213.{}.{host}", self.n % 250)
    }
    fn kv_ip(&self, host: u8) -> String {
        format!("10.214.{}.{host}", self.n % 250)
    }
    fn kv_link(&self) -> String {
        format!("kvd{}", self.n)
    }

    /// root: bridge .1; host p: .2 on the bridge; host d: .3 on the bridge; p <-> d direct.
    fn create() -> Hosts {
        let h = Hosts {
            n: std::process::id() % 10_000,
        };
        h.remove_stale_on_our_subnets();
        h.remove();
        let br = format!("dbr{}", h.n);
        ip(&["link", "add", &br, "type", "bridge"]);
        ip(&["addr", "add", &format!("{}/24", h.bridge_ip(1)), "dev", &br]);
        ip(&["link", "set", &br, "up"]);
        // Host to host across the bridge is forwarded traffic: where Docker runs (every
        // machine of this project) the FORWARD policy is DROP and bridged frames go through
        // iptables, so the decode host could not reach the prefill host's gRPC port.
        h.open_forwarding();
        for (role, host) in [('p', 2u8), ('d', 3u8)] {
            let ns = h.ns(role);
            let veth = format!("dv{role}{}", h.n);
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            ip(&["link", "set", &veth, "master", &br, "up"]);
            let addr = format!("{}/24", h.bridge_ip(host));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        let (kvp, kvd) = (format!("kvp{}", h.n), h.kv_link());
        ip(&[
            "link",
            "add",
            &kvp,
            "netns",
            &h.ns('p'),
            "type",
            "veth",
            "peer",
            "name",
            &kvd,
            "netns",
            &h.ns('d'),
        ]);
        for (role, dev, host) in [('p', &kvp, 2u8), ('d', &kvd, 3u8)] {
            let addr = format!("{}/24", h.kv_ip(host));
            ip(&["-n", &h.ns(role), "addr", "add", &addr, "dev", dev]);
            ip(&["-n", &h.ns(role), "link", "set", dev, "up"]);
        }
        h
    }

    /// Takes the KV link down (`up: false`) or up again, on the decode host's side.
    fn kv_link_set(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.ns('d'), "link", "set", &self.kv_link(), state]);
    }

    /// Lets traffic between the hosts cross the bridge (removed in [`Hosts::remove`]).
    /// Without iptables there is no filter to open.
    fn open_forwarding(&self) {
        let br = format!("dbr{}", self.n);
        let rule = ["-I", "FORWARD", "-i", &br, "-o", &br, "-j", "ACCEPT"];
        if let Ok(o) = Command::new("iptables").args(rule).output() {
            assert!(
                o.status.success(),
                "iptables {}: {}",
                rule.join(" "),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }

    /// A run killed before its `Drop` leaves its bridge, namespaces and rule behind; one of
    /// another process whose subnets are ours (`n % 250`) would take our routes, and the
    /// workers in our namespaces would never reach etcd. Removes those.
    fn remove_stale_on_our_subnets(&self) {
        let Ok(o) = Command::new("ip")
            .args(["-o", "link", "show", "type", "bridge"])
            .output()
        else {
            return;
        };
        let stale = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .filter_map(|name| name.strip_prefix("dbr")?.parse::<u32>().ok())
            .filter(|&n| n != self.n && n % 250 == self.n % 250)
            .collect::<Vec<_>>();
        for n in stale {
            drop(Hosts { n }); // its Drop removes it
        }
    }

    fn remove(&self) {
        while Command::new("iptables")
            .args(["-D", "FORWARD", "-i", &format!("dbr{}", self.n)])
            .args(["-o", &format!("dbr{}", self.n), "-j", "ACCEPT"])
            .output()
            .is_ok_and(|o| o.status.success())
        {}
        for role in ['p', 'd'] {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(role)])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &format!("dbr{}", self.n)])
            .output();
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.remove();
    }
}

async fn complete(url: &str, prompt: &str, max_tokens: u32) -> support::Completion {
    let mut c = support::client(url).await;
    support::generate(&mut c, greedy(text(prompt), max_tokens))
        .await
        .expect("the request completes")
}

#[test]
fn kv_link_cut_times_out_reclaims_blocks_and_the_request_completes() {
    let hosts = Hosts::create();
    let etcd = EtcdServer::start_on(&hosts.bridge_ip(1));
    let ep = etcd.endpoint();
    let cluster = format!("t{:08x}", rand::random::<u32>());
    let common = |id: &str| {
        vec![
            "--etcd".to_string(),
            ep.clone(),
            "--cluster".into(),
            cluster.clone(),
            "--lease-ttl".into(),
            "2s".into(),
            "--id".into(),
            id.into(),
            "--kv-pool".into(),
            "64MiB".into(),
            "--kv-timeout".into(),
            "2s".into(),
        ]
    };
    let (d_ip, p_ip, kv_ip) = (hosts.bridge_ip(3), hosts.bridge_ip(2), hosts.kv_ip(3));
    let mut args = vec!["decode".to_string()];
    args.extend(common("decode-0"));
    args.extend([
        "--listen".into(),
        format!("{d_ip}:0"),
        "--kv-listen".into(),
        format!("{kv_ip}:0"),
        "--kv-advertise-host".into(),
        kv_ip.clone(),
        // The test sends one prompt again and again: with a prefix cache the decode worker
        // would soon hold all but its last block and prefill it locally, and the KV link
        // (what this test cuts) would not be used.
        "--prefix-cache".into(),
        "off".into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let decode = Proc::start_in_netns(&hosts.ns('d'), "decode", &args, &[support::KV_TCP]);
    let decode_addr = decode.wait_for("serving gRPC on", START);
    let mut args = vec!["prefill".to_string()];
    args.extend(common("prefill-0"));
    args.extend([
        "--listen".into(),
        format!("{p_ip}:0"),
        "--metrics-listen".into(),
        format!("{p_ip}:0"),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let prefill = Proc::start_in_netns(&hosts.ns('p'), "prefill", &args, &[support::KV_TCP]);
    let prefill_addr = prefill.wait_for("serving gRPC on", START);
    let router = Proc::start_logged(
        "router",
        &[
            "router",
            "--etcd",
            &ep,
            "--cluster",
            &cluster,
            "--http-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let url = router.wait_for("router listening on", START);
    let http = router.wait_for("http listening on", START);
    assert!(
        decode.found("KV on").iter().any(|kv| kv.contains(&kv_ip)),
        "the decode worker advertises its KV endpoint on the KV link ({kv_ip})"
    );

    // Long enough for remote prefill (above the 32-token local limit).
    let prompt =
        "Tell me about the history of bridges, from rope bridges to suspension bridges. ".repeat(3);
    let want = support::run_reference(&prompt, false, 8);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        // Wait for both workers, then a request over the intact link: prefilled remotely.
        let end = Instant::now() + START;
        let first = loop {
            let mut c = support::client(&url).await;
            match support::generate(&mut c, greedy(text(&prompt), 8)).await {
                Ok(done) if done.timings().placement == pb::PrefillPlacement::Remote as i32 => {
                    break done
                }
                _ if Instant::now() < end => tokio::time::sleep(Duration::from_millis(200)).await,
                r => panic!(
                    "no remote prefill over the intact link: {:?}",
                    r.map(|d| d.fin)
                ),
            }
        };
        assert_eq!(first.ids, want, "tokens over the intact link");

        hosts.kv_link_set(false);
        let t0 = Instant::now();
        let cut = complete(&url, &prompt, 8).await;
        let took = t0.elapsed();
        assert_eq!(cut.ids, want, "tokens after the cut differ from duet run");
        let t = cut.timings();
        assert_eq!(
            t.placement,
            pb::PrefillPlacement::Local as i32,
            "with the only KV link down the decode worker prefills: {t:?}"
        );
        assert!(
            t.routing_reason.contains("KV links"),
            "the routing reason names the failed link: {}",
            t.routing_reason
        );
        assert!(
            took >= Duration::from_secs(2),
            "the first attempt should have waited for the KV timeout (2 s), took {took:?}"
        );
        let scrape = support::http_get(&format!("{http}/metrics")).1;
        assert!(
            support::scrape_sum(&scrape, "duet_router_retries_total", &[]) >= 1.0,
            "the retry is counted"
        );
        // The failed attempt's KV: reclaimed on the decode side (reservation released)...
        support::assert_pool_empty(&decode_addr, Duration::from_secs(10)).await;
        // ... and on the prefill side.
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let s = support::prefill_status(&prefill_addr).await;
            if s.kv_blocks_free == s.kv_blocks_total && s.running == 0 && s.waiting == 0 {
                break;
            }
            assert!(Instant::now() < end, "prefill worker still holds KV: {s:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let scrape = support::http_get(&prefill.wait_for("metrics on", START)).1;
        let failed = support::scrape_sum(&scrape, "duet_prefill_requests_total", &[])
            - support::scrape_sum(&scrape, "duet_prefill_requests_total", &["outcome=\"ok\""]);
        assert!(
            failed >= 1.0,
            "the prefill worker counts the failed transfer"
        );

        // The link comes back: after the back-off the pair is used again.
        hosts.kv_link_set(true);
        let end = Instant::now() + Duration::from_secs(40);
        loop {
            let done = complete(&url, &prompt, 8).await;
            assert_eq!(done.ids, want);
            if done.timings().placement == pb::PrefillPlacement::Remote as i32 {
                break;
            }
            assert!(
                Instant::now() < end,
                "the restored link was not used again within 40 s"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        support::assert_pool_empty(&decode_addr, Duration::from_secs(10)).await;
    });
}
