//! Faults injected into real connections (tcp and shm, frame MACs on as by default): 10,000
//! corruptions in all (bit flips anywhere in a frame, frames cut short, sent twice or
//! swapped), each on a fresh connection, plus delays that must do no harm. Every corruption
//! must be detected: the transfer fails (or, for a duplicated END, the next read on the
//! connection does), and no layer the receiver accepted holds a wrong byte.
//!
//! The faults come from a seeded generator: set `DUET_FAULT_SEED` to replay a run; a failure
//! prints the seed, the backend and the fault.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod common;

#[cfg(not(feature = "fault-injection"))]
#[test]
fn fault_injection_feature_is_on() {
    panic!(
        "these tests need the sender's fault injection: \
         cargo test --features duet-kv-transfer/fault-injection (make test turns it on)"
    );
}

#[cfg(feature = "fault-injection")]
mod injected {
    use std::time::Duration;

    use duet_kv_transfer::backend::shm::{ShmOptions, ShmReceiver, ShmSender};
    use duet_kv_transfer::backend::tcp::{TcpReceiver, TcpSender};
    use duet_kv_transfer::protocol::faults::{Fault, FaultKind, FaultPlan};
    use duet_kv_transfer::{
        Compression, Error, KvKind, KvLayout, KvReceiver, MemorySink, TransferConfig, TransferDesc,
    };
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::common;

    /// Corruptions per backend (two backends: 10,000 in all).
    const CORRUPTIONS: usize = 5_000;

    fn desc(i: u64) -> TransferDesc {
        TransferDesc {
            request_id: 100 + i,
            token_start: 0,
            token_count: 10,
            dst_blocks: vec![2, 0, 5],
        }
    }

    fn random_fault(rng: &mut StdRng, layers: u32) -> Fault {
        let frames = layers + 2; // BEGIN, layers, END
        let kind = match rng.random_range(0..20) {
            0..=7 => FaultKind::FlipBit,
            8..=11 => FaultKind::Truncate,
            12..=14 => FaultKind::Duplicate,
            15..=18 => FaultKind::Reorder,
            _ => FaultKind::Delay(Duration::from_millis(rng.random_range(0..3))),
        };
        let frame = match kind {
            FaultKind::Reorder => rng.random_range(1..=layers),
            _ => rng.random_range(0..frames),
        };
        Fault {
            kind,
            frame,
            at: rng.random(),
        }
    }

    /// Every layer the sink marked done for `d` holds exactly what was sent.
    fn accepted_layers_are_exact(sink: &MemorySink, layout: &KvLayout, d: &TransferDesc) -> bool {
        sink.layers_done.iter().all(|&(_, layer)| {
            KvKind::ORDER.iter().all(|&kind| {
                d.dst_blocks.iter().all(|&b| {
                    sink.region(layer, kind, b)
                        == Some(common::region(layout, d.request_id, layer, kind, b).as_slice())
                })
            })
        })
    }

    enum Backend {
        Tcp(TcpReceiver),
        Shm(ShmReceiver, std::path::PathBuf, std::path::PathBuf),
    }

    async fn run(backend: &str, seed: u64) {
        let layout = common::small_layout();
        let mut cfg: TransferConfig = common::config(layout);
        cfg.timeouts.io = Duration::from_secs(2);
        let rx = match backend {
            "tcp" => {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                Backend::Tcp(TcpReceiver::new(l, cfg.clone()))
            }
            _ => {
                let path = std::env::temp_dir()
                    .join(format!("duet-kv-faults-{}.sock", std::process::id()));
                let opts = ShmOptions::default();
                let dir = opts.dir.clone();
                Backend::Shm(
                    ShmReceiver::bind(&path, cfg.clone(), opts).unwrap(),
                    path,
                    dir,
                )
            }
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut corruptions, mut detected, mut delays) = (0usize, 0usize, 0usize);
        let mut i = 0u64;
        while corruptions < CORRUPTIONS {
            i += 1;
            let fault = random_fault(&mut rng, layout.layers());
            let d = desc(i);
            let mut tx_cfg = cfg.clone();
            tx_cfg.faults = Some(FaultPlan::new([Some(fault)]));
            let (first, second, sink) = match &rx {
                Backend::Tcp(rx) => {
                    let addr = rx.local_addr().unwrap();
                    let send = tokio::spawn({
                        let d = d.clone();
                        async move {
                            let mut tx = TcpSender::connect(addr, &tx_cfg).await?;
                            common::send_transfer(&mut tx, &layout, &d, Compression::None).await
                        }
                    });
                    let mut conn = rx.accept().await.unwrap();
                    let out = receive_twice(&mut conn, &layout, &d).await;
                    let _ = send.await;
                    out
                }
                Backend::Shm(rx, path, dir) => {
                    let (path, dir) = (path.clone(), dir.clone());
                    let send = tokio::spawn({
                        let d = d.clone();
                        async move {
                            let mut tx = ShmSender::connect(&path, &tx_cfg, &dir).await?;
                            common::send_transfer(&mut tx, &layout, &d, Compression::None).await
                        }
                    });
                    let mut conn = rx.accept().await.unwrap();
                    let out = receive_twice(&mut conn, &layout, &d).await;
                    let _ = send.await;
                    out
                }
            };
            let why = format!("seed {seed}, {backend}, transfer {i}: {fault:?}");
            assert!(
                accepted_layers_are_exact(&sink, &layout, &d),
                "wrong bytes accepted: {why}"
            );
            if fault.kind.corrupts() {
                corruptions += 1;
                let caught = match (&first, &second) {
                    (Err(e), _) => !e.is_clean_close(),
                    (Ok(()), Err(e)) => !e.is_clean_close(),
                    (Ok(()), Ok(())) => false,
                };
                assert!(caught, "undetected: {why} ({first:?}, {second:?})");
                detected += 1;
                if let Err(e) = &first {
                    let released = e.blocks_to_release();
                    assert!(
                        released.is_empty() || released.len() == d.dst_blocks.len(),
                        "blocks to release {released:?}: {why}"
                    );
                }
            } else {
                delays += 1;
                assert!(
                    first.is_ok(),
                    "a delay failed the transfer: {why}: {first:?}"
                );
                common::assert_landed(&sink, &layout, d.request_id, &d.dst_blocks);
            }
        }
        assert_eq!(detected, corruptions);
        eprintln!(
            "{backend}: {corruptions} corruptions injected, {detected} detected; {delays} delays harmless (seed {seed})"
        );
    }

    /// Receives the transfer, then (on success) once more: a duplicated END must fail the next
    /// read instead of passing as a clean close.
    async fn receive_twice<C: KvReceiver>(
        conn: &mut C,
        layout: &KvLayout,
        d: &TransferDesc,
    ) -> (Result<(), Error>, Result<(), Error>, MemorySink) {
        let mut sink = MemorySink::new(*layout, 6);
        sink.reserve(d.request_id, &d.dst_blocks).unwrap();
        let first = conn.receive(&mut sink).await.map(|_| ());
        let second = match &first {
            Ok(()) => {
                let mut spare = MemorySink::new(*layout, 6);
                conn.receive(&mut spare).await.map(|_| ())
            }
            Err(_) => Ok(()),
        };
        (first, second, sink)
    }

    fn seed() -> u64 {
        std::env::var("DUET_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed_f00d)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_corruption_over_tcp_is_detected() {
        run("tcp", seed()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_corruption_over_shm_is_detected() {
        run("shm", seed() ^ 1).await;
    }
}
