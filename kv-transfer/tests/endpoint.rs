//! Endpoints as a decode worker offers them, the prefill side's choice among them, and the
//! decode side's accept loop: a prefill connector reaches a decode worker on the same host
//! over shm, through `serve_inbound`, and the bytes land in the reserved blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

use std::path::Path;
use std::time::Duration;

use duet_kv_transfer::backend::shm::{host_identity, ShmOptions, ShmReceiver};
use duet_kv_transfer::backend::tcp::TcpReceiver;
use duet_kv_transfer::{
    serve_inbound, AnyReceiver, BackendKind, Compression, Connector, Endpoint, Inbound, KvReceiver,
    LocalHub, MemorySink,
};
use tokio_util::sync::CancellationToken;

fn tcp() -> Endpoint {
    Endpoint::parse("tcp", "10.0.0.7:5000").unwrap()
}

fn shm_on(host: &str) -> Endpoint {
    Endpoint::shm(host, Path::new("/dev/shm/duet-sock-decode-0.sock")).unwrap()
}

fn connector(shm: bool, hub: Option<LocalHub>) -> Connector {
    Connector::new(common::config(common::small_layout()), hub).with_shm(shm)
}

#[test]
fn shm_addresses_round_trip_and_malformed_ones_are_refused() {
    let e = shm_on("abc-123");
    let back = Endpoint::parse("shm", &e.address).unwrap();
    assert_eq!(back, e);
    assert_eq!(
        back.shm_parts(),
        Some(("abc-123", Path::new("/dev/shm/duet-sock-decode-0.sock")))
    );
    for bad in [
        "no-colon",
        ":/dev/shm/x.sock",
        "host:relative/x.sock",
        "host:/",
    ] {
        let err = Endpoint::parse("shm", bad).unwrap_err().to_string();
        assert!(err.contains("host identity"), "{bad}: {err}");
    }
    let err = Endpoint::parse("carrier-pigeon", "x")
        .unwrap_err()
        .to_string();
    assert!(err.contains("carrier-pigeon"), "{err}");
}

/// Which endpoint a prefill worker picks, for what the decode worker offers and what this
/// side allows. Expected values come from the rule (same process, same host, elsewhere),
/// not from the implementation.
#[test]
fn the_connector_picks_local_then_same_host_shm_then_tcp() {
    let me = host_identity().expect("a Linux host identity");
    let hub = LocalHub::default();
    let _listener = hub.listen("proc/decode-0");
    let local = Endpoint::parse("local", "proc/decode-0").unwrap();
    let foreign_local = Endpoint::parse("local", "other-proc/decode-0").unwrap();
    let cases: Vec<(&str, Connector, Vec<Endpoint>, Option<BackendKind>)> = vec![
        (
            "same process beats everything",
            connector(true, Some(hub.clone())),
            vec![tcp(), shm_on(&me), local.clone()],
            Some(BackendKind::Local),
        ),
        (
            "a local name of another process is not this process",
            connector(false, Some(hub.clone())),
            vec![foreign_local.clone(), tcp()],
            Some(BackendKind::Tcp),
        ),
        (
            "same host: shm over tcp",
            connector(true, None),
            vec![tcp(), shm_on(&me)],
            Some(BackendKind::Shm),
        ),
        (
            "same host, shm only",
            connector(true, None),
            vec![shm_on(&me)],
            Some(BackendKind::Shm),
        ),
        (
            "another host: tcp",
            connector(true, None),
            vec![shm_on("some-other-host-1"), tcp()],
            Some(BackendKind::Tcp),
        ),
        (
            "shm switched off here: tcp",
            connector(false, None),
            vec![shm_on(&me), tcp()],
            Some(BackendKind::Tcp),
        ),
        (
            "another host's shm only: unreachable",
            connector(true, None),
            vec![shm_on("some-other-host-1")],
            None,
        ),
        (
            "shm off and nothing else: unreachable",
            connector(false, None),
            vec![shm_on(&me)],
            None,
        ),
        ("nothing offered", connector(true, None), vec![], None),
    ];
    #[cfg(feature = "rdma")]
    let cases = {
        use duet_kv_transfer::backend::rdma::RdmaOptions;
        let rdma = Endpoint::parse("rdma", "10.0.0.7:5001").unwrap();
        let with_rdma = |shm: bool| connector(shm, None).with_rdma(Some(RdmaOptions::default()));
        let mut cases = cases;
        cases.extend([
            (
                "another host: rdma over tcp",
                with_rdma(true),
                vec![tcp(), rdma.clone()],
                Some(BackendKind::Rdma),
            ),
            (
                "same host: shm over rdma",
                with_rdma(true),
                vec![rdma.clone(), shm_on(&me), tcp()],
                Some(BackendKind::Shm),
            ),
            (
                "rdma off here: tcp",
                connector(true, None),
                vec![rdma.clone(), tcp()],
                Some(BackendKind::Tcp),
            ),
            (
                "rdma offered, but off here, and nothing else: unreachable",
                connector(true, None),
                vec![rdma.clone()],
                None,
            ),
            (
                "rdma on here, not offered: tcp",
                with_rdma(false),
                vec![tcp()],
                Some(BackendKind::Tcp),
            ),
        ]);
        cases
    };
    for (case, c, offered, want) in cases {
        let got = c.choose(&offered);
        match want {
            Some(kind) => {
                let e = got.unwrap_or_else(|e| panic!("{case}: {e}"));
                assert_eq!(e.kind, kind, "{case}");
                assert!(offered.contains(&e), "{case}: {e:?} was not offered");
            }
            None => {
                let err = got.expect_err(case).to_string();
                assert!(err.contains("no usable KV endpoint"), "{case}: {err}");
            }
        }
    }
}

/// A decode side serving shm through `serve_inbound`, a prefill side whose connector chose
/// the shm endpoint: two transfers land exactly in their reserved blocks, and a peer that
/// connects and says nothing does not hold up the next connection's set-up.
#[tokio::test]
async fn a_connector_reaches_serve_inbound_over_shm() {
    let layout = common::model_layout();
    let cfg = common::config(layout);
    let dir = std::env::temp_dir().join(format!("duet-endpoint-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("duet-sock-decode-0.sock");
    let opts = ShmOptions {
        dir: dir.clone(),
        ..ShmOptions::default()
    };
    let rx = ShmReceiver::bind(&path, cfg.clone(), opts).unwrap();
    let cancel = CancellationToken::new();
    let (conns, mut accepted) = tokio::sync::mpsc::unbounded_channel::<AnyReceiver>();
    let server = tokio::spawn(serve_inbound(
        Inbound {
            shm: Some(rx),
            ..Inbound::default()
        },
        cancel.clone(),
        move |conn| {
            let _ = conns.send(conn);
        },
    ));

    // A silent peer: connected, never speaks (its handshake waits out its own timeout).
    let _silent = tokio::net::UnixStream::connect(&path).await.unwrap();

    let me = host_identity().unwrap();
    let offered = vec![tcp(), Endpoint::shm(&me, &path).unwrap()];
    let c = Connector::new(cfg, None).with_shm(true);
    let ep = c.choose(&offered).unwrap();
    assert_eq!(ep.kind, BackendKind::Shm);
    let mut tx = tokio::time::timeout(Duration::from_secs(3), c.checkout(&ep, false))
        .await
        .expect("set-up not held up by the silent peer")
        .unwrap();
    assert_eq!(tx.kind(), BackendKind::Shm);
    let [d1, d2] = common::two_transfers();
    let mut conn = tokio::time::timeout(Duration::from_secs(3), accepted.recv())
        .await
        .expect("the connection is handed over")
        .unwrap();
    assert_eq!(conn.kind(), BackendKind::Shm);
    let mut sink = MemorySink::new(layout, 8);
    sink.reserve(1, &[4, 1, 6]).unwrap();
    sink.reserve(2, &[0]).unwrap();
    let receiving = async {
        let a = conn.receive(&mut sink).await.unwrap();
        let b = conn.receive(&mut sink).await.unwrap();
        [a.desc.request_id, b.desc.request_id]
    };
    let sending = async {
        for d in [&d1, &d2] {
            common::send_transfer(&mut tx, &layout, d, Compression::None)
                .await
                .unwrap();
        }
    };
    let (ids, ()) = tokio::join!(receiving, sending);
    assert_eq!(ids, [1, 2]);
    c.checkin(&ep, tx);
    for d in [&d1, &d2] {
        common::assert_landed_through(&sink, &layout, d, Compression::None);
    }
    for b in [2, 3, 5, 7] {
        common::assert_untouched(&sink, &layout, b);
    }
    cancel.cancel();
    server.await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// An shm endpoint on this host that cannot be set up from here (its socket is gone): the
/// transfer goes over the tcp fallback, and the shm endpoint is passed over afterwards.
#[tokio::test]
async fn an_unusable_shm_endpoint_falls_back_to_tcp_and_is_passed_over() {
    let layout = common::model_layout();
    let cfg = common::config(layout);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rx = TcpReceiver::new(listener, cfg.clone());
    let tcp_ep = Endpoint::parse("tcp", &rx.local_addr().unwrap().to_string()).unwrap();
    let server = tokio::spawn(async move {
        let mut sink = MemorySink::new(layout, 8);
        sink.reserve(1, &[4, 1, 6]).unwrap();
        let mut conn = rx.accept().await.unwrap();
        conn.receive(&mut sink).await.unwrap();
        sink
    });
    let me = host_identity().unwrap();
    let gone = std::env::temp_dir().join(format!("duet-sock-gone-{}.sock", std::process::id()));
    let offered = vec![Endpoint::shm(&me, &gone).unwrap(), tcp_ep.clone()];
    let c = Connector::new(cfg, None).with_shm(true);
    let route = c.route(&offered).unwrap();
    assert_eq!(route.endpoint.kind, BackendKind::Shm);
    assert_eq!(route.fallback.as_ref(), Some(&tcp_ep));
    let (used, mut tx) = c.connect(&route, false).await.unwrap();
    assert_eq!(used, tcp_ep);
    assert_eq!(tx.kind(), BackendKind::Tcp);
    let [d1, _] = common::two_transfers();
    common::send_transfer(&mut tx, &layout, &d1, Compression::None)
        .await
        .unwrap();
    let sink = server.await.unwrap();
    common::assert_landed_through(&sink, &layout, &d1, Compression::None);
    // Next requests go straight to tcp for a while.
    assert_eq!(c.choose(&offered).unwrap(), tcp_ep);
    // Offered alone, a passed-over shm endpoint leaves nothing usable.
    let alone = c.route(&[Endpoint::shm(&me, &gone).unwrap()]);
    assert!(alone.is_err(), "{alone:?}");
}

/// Pooled senders are dropped once idle past the idle timeout (their receivers close them by
/// then), so a vanished endpoint holds nothing for long.
#[tokio::test]
async fn idle_pooled_senders_expire() {
    let layout = common::small_layout();
    let mut cfg = common::config(layout);
    cfg.timeouts.idle = Duration::from_millis(200);
    let hub = LocalHub::default();
    let mut listener = hub.listen("p/decode-0");
    let c = Connector::new(cfg, Some(hub.clone()));
    let ep = c
        .choose(&[Endpoint::parse("local", "p/decode-0").unwrap()])
        .unwrap();
    let tx = c.checkout(&ep, false).await.unwrap();
    let _rx = listener.recv().await.unwrap();
    c.checkin(&ep, tx);
    assert_eq!(c.idle_count(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.idle_count(), 0);
}
