//! The workers' internal doors, as someone who can reach their ports but is not a member of
//! the cluster meets them (default settings: separate processes on etcd, no TLS):
//! every internal service, reflection and `KvCache` included, refuses a call without the
//! cluster token; health answers probes; members' calls go through; a worker never connects
//! to an address a caller names unless a registered worker of its cluster advertises it; a
//! malformed request is refused at the door; a process given no secret does not start.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::time::{Duration, Instant};

use duet_proto::v1 as pb;
use support::{internal, Cluster};
use tonic::Code;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().expect("tokio runtime")
}

async fn channel(addr: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(addr.to_string())
        .expect("url")
        .connect()
        .await
        .expect("connect")
}

fn decode_request(prompt: Vec<u32>, prefill: pb::decode_request::Prefill) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: rand::random(),
        prompt,
        max_tokens: 4,
        prefill: Some(prefill),
        ..Default::default()
    }
}

fn local() -> pb::decode_request::Prefill {
    pb::decode_request::Prefill::Local(pb::LocalPrefill { replay_tokens: 0 })
}

/// The first event of a `Decode.Generate` stream (or the call's refusal).
async fn first_event(
    c: &mut pb::decode_client::DecodeClient<tonic::transport::Channel>,
    r: tonic::Request<pb::DecodeRequest>,
) -> Result<pb::DecodeEvent, tonic::Status> {
    let mut s = c.generate(r).await?.into_inner();
    s.message()
        .await?
        .ok_or_else(|| tonic::Status::internal("empty stream"))
}

#[test]
fn workers_answer_only_members_of_their_cluster() {
    let cl = Cluster::start(1, 1, &[]);
    let decode = cl.decode[0].workers_addr();
    let prefill = cl.prefill[0].workers_addr();
    rt().block_on(async {
        cl.wait_workers(1, 1, Duration::from_secs(20)).await;
        let mut d = pb::decode_client::DecodeClient::new(channel(&decode).await);
        let mut p = pb::prefill_client::PrefillClient::new(channel(&prefill).await);

        // Strangers: every internal call is UNAUTHENTICATED.
        let e = first_event(
            &mut d,
            tonic::Request::new(decode_request(vec![1, 2, 3], local())),
        )
        .await
        .expect_err("generation without the token");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        let e = d.status(pb::StatusRequest {}).await.expect_err("status");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        let e = p
            .prefill(pb::PrefillRequest {
                request_id: 1,
                prompt: vec![1, 2, 3],
                ..Default::default()
            })
            .await
            .expect_err("prefill without the token");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        for addr in [&decode, &prefill] {
            let mut kv = pb::kv_cache_client::KvCacheClient::new(channel(addr).await);
            let e = kv
                .subscribe(pb::KvSubscribeRequest::default())
                .await
                .expect_err("the cached prefix hashes are internal");
            assert_eq!(e.code(), Code::Unauthenticated, "{addr}: {e:?}");
            use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
            use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
            let mut refl = ServerReflectionClient::new(channel(addr).await);
            let ask = pb_reflection_request(MessageRequest::ListServices(String::new()));
            let listed = match refl.server_reflection_info(ask).await {
                Err(e) => Err(e),
                Ok(s) => s.into_inner().message().await.map(|_| ()),
            };
            let e = listed.expect_err("reflection is internal");
            assert_eq!(e.code(), Code::Unauthenticated, "{addr}: {e:?}");
            // Health answers probes without credentials.
            let mut h = tonic_health::pb::health_client::HealthClient::new(channel(addr).await);
            let r = h
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await
                .expect("health is open")
                .into_inner();
            assert_eq!(
                r.status(),
                tonic_health::pb::health_check_response::ServingStatus::Serving
            );
        }
        // A token from another cluster's secret is a stranger's too.
        let other = duet_kv_transfer::SharedSecret::new("another-cluster-secret-0123").unwrap();
        let token = duet_serving::cluster_auth::ClusterToken::from_key(
            other
                .derive(duet_serving::cluster_auth::TOKEN_LABEL)
                .unwrap(),
        )
        .unwrap();
        let mut req = tonic::Request::new(pb::StatusRequest {});
        token.attach(&mut req);
        assert_eq!(
            d.status(req).await.unwrap_err().code(),
            Code::Unauthenticated
        );

        // Members: the same calls go through.
        let s = d
            .status(internal(pb::StatusRequest {}))
            .await
            .expect("member");
        assert_eq!(s.into_inner().role, "decode");
        let ev = first_event(&mut d, internal(decode_request(vec![1, 2, 3], local())))
            .await
            .expect("a member's generation");
        assert!(ev.event.is_some());

        // Even a member cannot make a worker connect where no registered worker listens.
        let t0 = Instant::now();
        let via = pb::decode_request::Prefill::Via(pb::ViaPrefill {
            prefill_worker_id: "prefill-0".into(),
            prefill_address: "http://127.0.0.1:9".into(),
            ttl_ms: 1000,
            prefill_timeout_ms: 1000,
            ..Default::default()
        });
        let e = first_event(&mut d, internal(decode_request(vec![1; 40], via)))
            .await
            .expect_err("an unregistered prefill address");
        // Refused as a peer missing from this worker's view of the registry: to the router,
        // a failed link between the pair (views lag; another pair is tried).
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        assert!(duet_serving::status::is_prefill_failure(&e), "{e:?}");
        assert!(duet_serving::status::is_kv_link_failure(&e), "{e:?}");
        assert!(
            e.message().contains("not a registered prefill worker"),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(5));
        let e = p
            .prefill(internal(pb::PrefillRequest {
                request_id: 2,
                prompt: vec![1; 40],
                kv_endpoints: vec![pb::KvEndpoint {
                    transport: "tcp".into(),
                    address: "127.0.0.1:9".into(),
                }],
                dst_blocks: vec![0, 1, 2],
                ..Default::default()
            }))
            .await
            .expect_err("an unregistered KV endpoint");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        assert!(duet_serving::status::is_kv_link_failure(&e), "{e:?}");
        assert!(
            e.message().contains("not a registered decode worker"),
            "{e:?}"
        );

        // Malformed requests are refused at the door, before any batch.
        let e = first_event(
            &mut d,
            internal(decode_request(vec![1, 2, 1_000_000], local())),
        )
        .await
        .expect_err("a token outside the vocabulary");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("outside the vocabulary"), "{e:?}");
        let e = p
            .prefill(internal(pb::PrefillRequest {
                request_id: 3,
                prompt: vec![1, 2, 1_000_000],
                kv_endpoints: Vec::new(),
                ..Default::default()
            }))
            .await
            .expect_err("a malformed prefill");
        assert!(matches!(e.code(), Code::InvalidArgument), "{e:?}");
        support::assert_pool_empty(&decode, Duration::from_secs(10)).await;

        // The cluster itself works: the router is a member.
        let mut c = support::client(&cl.url).await;
        let done = support::generate(&mut c, support::greedy(support::text("Hello"), 4))
            .await
            .expect("through the router");
        assert_eq!(done.ids.len(), 4);
    });
}

fn pb_reflection_request(
    m: tonic_reflection::pb::v1::server_reflection_request::MessageRequest,
) -> impl tonic::IntoStreamingRequest<Message = tonic_reflection::pb::v1::ServerReflectionRequest> {
    tokio_stream::iter(vec![tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    }])
}

/// Separate processes have no default secret: without one they refuse to start and say how
/// to make one; one too short is refused by name.
#[test]
fn a_process_without_the_cluster_secret_does_not_start() {
    let etcd = support::etcd::EtcdServer::start();
    for role in ["decode", "prefill", "router"] {
        for (secret, want) in [("", "--kv-secret-file"), ("short-secret", "16")] {
            let mut env = vec![("DUET_KV_SECRET", secret)];
            if secret.is_empty() {
                env.clear();
            }
            let o = std::process::Command::new(env!("CARGO_BIN_EXE_duet"))
                .args([role, "--etcd", &etcd.endpoint(), "--cluster", "nosecret"])
                .env("DUET_MODEL", support::model())
                .env_remove("DUET_KV_SECRET")
                .env_remove("DUET_KV_SECRET_FILE")
                .envs(env)
                .output()
                .expect("run duet");
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                !o.status.success(),
                "{role} started without a usable secret"
            );
            assert!(err.contains(want), "{role} with {secret:?}: {err}");
            assert!(
                !err.contains("short-secret"),
                "the secret is never printed: {err}"
            );
        }
    }
    // The help text names the variable but never shows its value.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["decode", "--help"])
        .env("DUET_KV_SECRET", "visible-if-leaked-0123456789")
        .output()
        .expect("duet decode --help");
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("DUET_KV_SECRET"), "{help}");
    assert!(!help.contains("visible-if-leaked"), "{help}");
}
