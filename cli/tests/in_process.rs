//! A whole cluster in this test's process: a router, a prefill worker and a decode worker
//! started from their crates (`duet_router::server`, `duet_prefill_worker::server`,
//! `duet_decode_worker::server`) on `127.0.0.1:0` listeners, registered in an in-memory
//! registry, KV handed over in memory as `duet up` does by default. No process is spawned
//! but `duet run` for the reference tokens; the real-process tests (kills, stops, cuts)
//! stay in their own files.
//!
//! The same cluster runs on either engine: the native CPU engine (the default) and the
//! candle engine on candle's CPU device, the GPU engine's code (`docs/gpu.md`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::sync::Arc;
use std::time::Duration;

use duet_decode_worker::server::{DecodeWorker, KvReceivers};
use duet_decode_worker::DecodeConfig;
use duet_discovery::{MemoryRegistry, RegistrationOptions, Registry, Role};
use duet_engine::{
    CandleModel, DeviceSpec, EngineKind, EngineModel, KvCacheConfig, KvDtype, LoadOptions, Model,
    TextFrontend, WeightMode,
};
use duet_kv_transfer::{LocalHub, SharedSecret, TransferConfig};
use duet_prefill_worker::server::{KvSenders, PrefillWorker};
use duet_prefill_worker::PrefillConfig;
use duet_proto::v1 as pb;
use duet_router::server::RouterListeners;
use duet_router::RouterConfig;
use duet_serving::cluster_auth::{ClusterToken, TOKEN_LABEL};
use duet_worker_common::WorkerServer;
use support::{generate, greedy};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

const CLUSTER: &str = "in-process";
const BLOCK_SIZE: usize = 16;

/// A cluster of this process: the router's gRPC URL, the registry, what stops it, and
/// the servers' tasks.
struct Cluster {
    url: String,
    registry: Arc<dyn Registry>,
    shutdown: CancellationToken,
    tasks: JoinSet<(&'static str, Result<(), String>)>,
    decode_addr: String,
}

fn load(engine: EngineKind) -> Arc<EngineModel> {
    let opts = LoadOptions {
        threads: 1,
        weight_mode: WeightMode::Quantized,
    };
    Arc::new(match engine {
        EngineKind::Native => Model::load(support::model(), opts).expect("model").into(),
        EngineKind::Candle => CandleModel::load(support::model(), DeviceSpec::Cpu)
            .expect("model")
            .into(),
    })
}

fn cache(model: &EngineModel) -> KvCacheConfig {
    let c = model.config();
    KvCacheConfig::from_budget(
        64 << 20,
        BLOCK_SIZE,
        KvDtype::F16,
        (c.layers_per_kv_block(), c.n_kv_heads, c.head_dim),
    )
}

async fn server(registry: &Arc<dyn Registry>, token: &ClusterToken) -> (WorkerServer, String) {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("127.0.0.1:{}", grpc.local_addr().unwrap().port());
    let s = WorkerServer {
        registry: registry.clone(),
        cluster: CLUSTER.into(),
        registration: RegistrationOptions::default(),
        model_name: "smollm2".into(),
        grpc,
        advertise_host: "127.0.0.1".into(),
        drain: Duration::from_secs(5),
        tls: None,
        client_tls: None,
        token: token.clone(),
        switchable: false,
    };
    (s, addr)
}

async fn start(engine: EngineKind) -> Cluster {
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    // The suite's secret: its status calls carry the token derived from it.
    let secret = SharedSecret::new(support::TEST_SECRET).unwrap();
    let token = ClusterToken::from_key(secret.derive(TOKEN_LABEL).unwrap()).unwrap();
    let hub = LocalHub::default();
    let tag = "test".to_string();
    let shutdown = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let transfer = |m: &EngineModel| {
        let layout = m.kv_layout(BLOCK_SIZE, KvDtype::F16).unwrap();
        let layout = duet_worker_common::transfer_layout(&layout).unwrap();
        TransferConfig::new(layout, secret.clone())
    };

    let model = load(engine);
    let (srv, decode_addr) = server(&registry, &token).await;
    let decode_addr = format!("http://{decode_addr}");
    let decode = DecodeWorker {
        id: "decode-0".into(),
        cache: cache(&model),
        config: DecodeConfig::default(),
        transfer: transfer(&model),
        model,
    };
    let kv = KvReceivers {
        local: Some((hub.clone(), tag.clone())),
        ..KvReceivers::default()
    };
    let stop = shutdown.clone();
    tasks.spawn(async move {
        let r = decode.serve(srv, kv, stop).await;
        ("decode", r.map_err(|e| e.to_string()))
    });

    let model = load(engine);
    let (srv, _) = server(&registry, &token).await;
    let prefill = PrefillWorker {
        id: "prefill-0".into(),
        cache: cache(&model),
        config: PrefillConfig::default(),
        transfer: transfer(&model),
        model,
    };
    let kv = KvSenders {
        local: Some((hub, tag)),
        ..KvSenders::default()
    };
    let stop = shutdown.clone();
    tasks.spawn(async move {
        let r = prefill.serve(srv, kv, stop).await;
        ("prefill", r.map_err(|e| e.to_string()))
    });

    let front = Arc::new(TextFrontend::load(support::model()).unwrap());
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", grpc.local_addr().unwrap());
    let cfg = RouterConfig {
        cluster_token: Some(token.clone()),
        model_name: "smollm2".into(),
        ..RouterConfig::default()
    };
    let (reg, stop) = (registry.clone(), shutdown.clone());
    tasks.spawn(async move {
        let listeners = RouterListeners {
            grpc,
            http,
            tls: None,
        };
        let r = duet_router::server::serve(
            front,
            cfg,
            reg,
            CLUSTER.into(),
            listeners,
            stop,
            Duration::from_secs(5),
        )
        .await;
        ("router", r.map_err(|e| e.to_string()))
    });
    Cluster {
        url,
        registry,
        shutdown,
        tasks,
        decode_addr,
    }
}

/// A chat prompt long enough for the router to prefill it remotely, and one it prefills on
/// the decode worker.
const LONG: &str = "The history of the printing press begins in the fifteenth century, when \
                    Johannes Gutenberg combined movable type, an oil-based ink and a screw \
                    press into a system that could produce books quickly. Explain how it \
                    changed Europe.";
const SHORT: &str = "Hi";

/// `text` as one user message.
fn chat(text: &str) -> pb::generate_request::Prompt {
    pb::generate_request::Prompt::Chat(pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: text.into(),
        }],
    })
}

/// Where the router placed a completion's prefill.
fn placement(c: &support::Completion) -> Result<pb::PrefillPlacement, prost::UnknownEnumValue> {
    pb::PrefillPlacement::try_from(c.timings().placement)
}

/// Waits until both workers are in the registry.
async fn registered(registry: &dyn Registry) {
    for _ in 0..600 {
        let l = registry
            .list(&duet_discovery::workers_prefix(CLUSTER))
            .await
            .unwrap();
        if l.kvs.len() >= 2 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the workers did not register");
}

/// A prompt and a short one go through the in-process cluster, the first prefilled by the
/// prefill worker and its KV handed to the decode worker in memory, the second prefilled on
/// the decode worker; each gets `duet run`'s greedy tokens. On shutdown every server
/// drains and returns without error, and the decode worker's pool is free before it.
#[test]
fn a_cluster_started_from_its_crates_serves_duet_runs_tokens_and_drains() {
    let want_long = support::run_reference(LONG, true, 12);
    let want_short = support::run_reference(SHORT, true, 8);
    let rt = support::runtime();
    rt.block_on(async {
        let mut c = start(EngineKind::Native).await;
        registered(c.registry.as_ref()).await;
        let mut client = support::client(&c.url).await;

        let got = generate(&mut client, greedy(chat(LONG), 12)).await.unwrap();
        assert_eq!(got.ids, want_long, "remote prefill: {:?}", got.text);
        assert_eq!(placement(&got), Ok(pb::PrefillPlacement::Remote));
        assert_eq!(got.timings().prefill_worker, "prefill-0");

        let got = generate(&mut client, greedy(chat(SHORT), 8)).await.unwrap();
        assert_eq!(got.ids, want_short, "local prefill: {:?}", got.text);
        assert_eq!(placement(&got), Ok(pb::PrefillPlacement::Local));

        support::assert_pool_empty(&c.decode_addr, Duration::from_secs(5)).await;
        let records = c
            .registry
            .list(&duet_discovery::workers_prefix(CLUSTER))
            .await
            .unwrap();
        let roles: Vec<Role> = records
            .kvs
            .iter()
            .map(|e| {
                duet_discovery::WorkerRecord::from_json(&e.value)
                    .unwrap()
                    .role
            })
            .collect();
        assert!(roles.contains(&Role::Decode) && roles.contains(&Role::Prefill));

        c.shutdown.cancel();
        let mut ended = Vec::new();
        while let Some(r) = tokio::time::timeout(Duration::from_secs(30), c.tasks.join_next())
            .await
            .expect("every server returns within its drain")
        {
            let (who, r) = r.expect("server task");
            assert_eq!(r, Ok(()), "{who}");
            ended.push(who);
        }
        ended.sort();
        assert_eq!(ended, ["decode", "prefill", "router"]);
        // Deregistered on the way out.
        let left = c
            .registry
            .list(&duet_discovery::workers_prefix(CLUSTER))
            .await
            .unwrap();
        assert!(left.kvs.is_empty(), "{:?}", left.kvs.len());
    });
}

/// A client that drops its stream after two tokens: the decode worker's pool is empty again
/// within a second, and the next request is served. (Moved here from the `duet up` tests: it
/// needs no process of its own.)
#[test]
fn cancelled_streams_free_their_blocks() {
    let rt = support::runtime();
    rt.block_on(async {
        let mut c = start(EngineKind::Native).await;
        registered(c.registry.as_ref()).await;
        let mut client = support::client(&c.url).await;
        let long =
            "Tell me a long story about a dragon who learns to cook, with many details. ".repeat(4);
        let mut s = client
            .generate(greedy(support::text(&long), 200))
            .await
            .expect("generate")
            .into_inner();
        for _ in 0..2 {
            s.message().await.expect("token").expect("some");
        }
        drop(s);
        support::assert_pool_empty(&c.decode_addr, Duration::from_secs(1)).await;
        let ok = generate(
            &mut client,
            greedy(support::text("The capital of France is"), 4),
        )
        .await;
        assert!(ok.is_ok(), "a request after the cancellation works: {ok:?}");
        support::assert_pool_empty(&c.decode_addr, Duration::from_secs(1)).await;
        c.shutdown.cancel();
        while let Some(r) = c.tasks.join_next().await {
            let (who, r) = r.expect("server task");
            assert_eq!(r, Ok(()), "{who}");
        }
    });
}

/// The workers on the candle engine (candle's CPU device: the GPU engine's code) serve a
/// remote prefill, its KV handed from the prefill worker's cache to the decode worker's and
/// uploaded to its device copy, and a local prefill on the decode worker: each gets the
/// tokens `duet run --engine candle` gets, and the decode worker's pool is empty after.
///
/// The short prompt goes first: candle's products round by matrix shape (not bit-exact as
/// the native engine is), so a prompt whose chat preamble comes from the prefix cache is
/// computed in other shapes than `duet run`'s one forward, and "Hi" then flips a near tie at
/// its sixth token (seen: "assist" for "help"). `candle_parity.rs` bounds those differences.
#[test]
fn workers_on_the_candle_engine_serve_duet_run_candles_tokens() {
    let want_long = support::run_reference_on("candle", LONG, true, 12);
    let want_short = support::run_reference_on("candle", SHORT, true, 8);
    let rt = support::runtime();
    rt.block_on(async {
        let mut c = start(EngineKind::Candle).await;
        registered(c.registry.as_ref()).await;
        let mut client = support::client(&c.url).await;
        let got = generate(&mut client, greedy(chat(SHORT), 8)).await.unwrap();
        assert_eq!(got.ids, want_short, "local prefill: {:?}", got.text);
        assert_eq!(placement(&got), Ok(pb::PrefillPlacement::Local));
        let got = generate(&mut client, greedy(chat(LONG), 12)).await.unwrap();
        assert_eq!(got.ids, want_long, "remote prefill: {:?}", got.text);
        assert_eq!(placement(&got), Ok(pb::PrefillPlacement::Remote));
        support::assert_pool_empty(&c.decode_addr, Duration::from_secs(5)).await;
        c.shutdown.cancel();
        while let Some(r) = c.tasks.join_next().await {
            let (who, r) = r.expect("server task");
            assert_eq!(r, Ok(()), "{who}");
        }
    });
}
