//! TLS on every link a cluster has, as its clients and an intruder see it:
//!
//! - etcd over TLS with client certificates *and* user/password authentication: a process
//!   without the password (or with a wrong one) cannot read the registry;
//! - the router's public gRPC and HTTP doors over TLS: a client that trusts the CA completes
//!   a generation (`duet generate`, a tonic client, `curl`); a plain-text client gets no
//!   answer;
//! - the workers' internal gRPC with mutual TLS: the router (with its certificate) reaches
//!   them; a client without a certificate, or with one from another CA, is refused at the
//!   handshake.
//!
//! Certificates are made for the test with rcgen (a CA, a node certificate for
//! `localhost`/127.0.0.1 good for server and client use, and a foreign CA's certificate).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use duet_proto::v1 as pb;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use support::etcd::{EtcdServer, EtcdTls};
use support::{greedy, text, Proc, START};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const PASSWORD: &str = "s3cret-etcd-pass";
/// The only name in the workers' certificate.
const WORKER_NAME: &str = "duet-worker.cluster.internal";

/// PEM files of one test PKI.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
    /// `--tls-cert <who>.pem --tls-key <who>.key --tls-ca ca.pem`.
    fn tls_flags(&self, who: &str) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.arg(&format!("{who}.pem")),
            "--tls-key".into(),
            self.arg(&format!("{who}.key")),
            "--tls-ca".into(),
            self.arg("ca.pem"),
        ]
    }
}

fn new_ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().expect("CA key");
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.distinguished_name.push(DnType::CommonName, name);
    (p.self_signed(&key).expect("self-sign CA"), key)
}

fn leaf(cn: &str, issuer: &(rcgen::Certificate, KeyPair)) -> (String, String) {
    leaf_for(cn, &["localhost", "127.0.0.1"], issuer)
}

/// A certificate for `names` (DNS names or IPs), good for server and client use.
fn leaf_for(cn: &str, names: &[&str], issuer: &(rcgen::Certificate, KeyPair)) -> (String, String) {
    let key = KeyPair::generate().expect("leaf key");
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut p = CertificateParams::new(names).expect("leaf params");
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.distinguished_name.push(DnType::CommonName, cn);
    let cert = p.signed_by(&key, &issuer.0, &issuer.1).expect("sign leaf");
    (cert.pem(), key.serialize_pem())
}

fn make_pki() -> Pki {
    let dir = std::env::temp_dir().join(format!(
        "duet-tls-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("pki dir");
    let write = |name: &str, pem: &str| std::fs::write(dir.join(name), pem).expect("write pem");
    let ca = new_ca("duet test CA");
    write("ca.pem", &ca.0.pem());
    let (cert, key) = leaf("duet-node", &ca);
    write("node.pem", &cert);
    write("node.key", &key);
    // The workers' certificate names a service, not the address they advertise (as in
    // Kubernetes, where they advertise pod IPs): the router needs --tls-server-name.
    let (cert, key) = leaf_for("duet-worker", &[WORKER_NAME], &ca);
    write("worker.pem", &cert);
    write("worker.key", &key);
    let rogue_ca = new_ca("somebody else's CA");
    let (cert, key) = leaf("intruder", &rogue_ca);
    write("rogue.pem", &cert);
    write("rogue.key", &key);
    Pki { dir }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).expect("read pem")
}

/// Creates user `root` with [`PASSWORD`] and turns etcd's authentication on.
async fn enable_etcd_auth(etcd: &EtcdServer, pki: &Pki) {
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(Certificate::from_pem(read(&pki.path("ca.pem"))))
        .identity(Identity::from_pem(
            read(&pki.path("node.pem")),
            read(&pki.path("node.key")),
        ));
    let mut c = etcd_client::Client::connect(
        [etcd.endpoint()],
        Some(etcd_client::ConnectOptions::new().with_tls(tls)),
    )
    .await
    .expect("connect to etcd over TLS");
    c.user_add("root", PASSWORD, None).await.expect("user add");
    c.user_grant_role("root", "root").await.expect("grant root");
    c.auth_enable().await.expect("auth enable");
}

/// `duet status` against the TLS etcd with `extra` flags: (success, stdout, stderr).
fn status(etcd: &EtcdServer, cluster: &str, pki: &Pki, extra: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args([
            "status",
            "--etcd",
            &etcd.endpoint(),
            "--cluster",
            cluster,
            "--etcd-ca",
            &pki.arg("ca.pem"),
            "--etcd-cert",
            &pki.arg("node.pem"),
            "--etcd-key",
            &pki.arg("node.key"),
        ])
        .args(extra)
        .env_remove("DUET_ETCD_PASSWORD")
        .output()
        .expect("run duet status");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A TLS channel to `url` trusting the test CA, presenting `identity` (cert, key files).
async fn tls_channel(
    url: &str,
    pki: &Pki,
    identity: Option<(&str, &str)>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tls_channel_named(url, pki, identity, None).await
}

/// [`tls_channel`] expecting `name` in the server's certificate.
async fn tls_channel_named(
    url: &str,
    pki: &Pki,
    identity: Option<(&str, &str)>,
    name: Option<&str>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let mut tls =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&pki.path("ca.pem"))));
    if let Some(n) = name {
        tls = tls.domain_name(n);
    }
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(read(&pki.path(c)), read(&pki.path(k))));
    }
    Endpoint::from_shared(url.to_string())?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

/// The worker's overall health through `channel`, or the error that stopped the call.
async fn health(channel: Result<tonic::transport::Channel, tonic::transport::Error>) -> String {
    let channel = match channel {
        Ok(c) => c,
        Err(e) => return format!("connect error: {e:?}"),
    };
    let mut h = tonic_health::pb::health_client::HealthClient::new(channel);
    match h
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
    {
        Ok(r) => format!("status {}", r.into_inner().status),
        Err(e) => format!("call error: {e}"),
    }
}

#[test]
fn tls_on_every_link_and_etcd_authentication() {
    let pki = make_pki();
    let etcd = EtcdServer::start_tls(EtcdTls {
        cert: pki.path("node.pem"),
        key: pki.path("node.key"),
        ca: pki.path("ca.pem"),
    });
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(enable_etcd_auth(&etcd, &pki));
    let cluster = format!("t{:08x}", rand::random::<u32>());

    // etcd: the certificate alone is not enough once authentication is on.
    let (ok, _, err) = status(&etcd, &cluster, &pki, &[]);
    assert!(!ok, "duet status without the etcd password succeeded");
    assert!(!err.is_empty(), "no error message without the password");
    let (ok, _, err) = status(
        &etcd,
        &cluster,
        &pki,
        &["--etcd-user", "root", "--etcd-password", "wrong-password"],
    );
    assert!(!ok, "duet status with a wrong etcd password succeeded");
    assert!(
        err.contains("authentication failed") || err.contains("invalid"),
        "the error should say authentication failed: {err}"
    );

    let ep = etcd.endpoint();
    let etcd_flags = [
        "--etcd",
        &ep,
        "--cluster",
        &cluster,
        "--lease-ttl",
        "2s",
        "--etcd-ca",
        &pki.arg("ca.pem"),
        "--etcd-cert",
        &pki.arg("node.pem"),
        "--etcd-key",
        &pki.arg("node.key"),
        "--etcd-user",
        "root",
    ];
    let tls_flags = pki.tls_flags("node");
    let worker_tls_flags = pki.tls_flags("worker");
    let env = [("DUET_ETCD_PASSWORD", PASSWORD)];
    let worker = |role: &str| {
        let mut args = vec![role, "--kv-pool", "64MiB", "--tls-client-auth", "required"];
        // A decode worker calls the prefill workers of its remote prompts, whose
        // certificate names the workers' service name, not the address they advertise.
        if role == "decode" {
            args.extend_from_slice(&["--tls-server-name", WORKER_NAME]);
        }
        args.extend_from_slice(&etcd_flags);
        args.extend(worker_tls_flags.iter().map(String::as_str));
        let p = Proc::start_logged(role, &args, &env);
        let addr = p.wait_for("serving gRPC on", START);
        (p, addr)
    };
    let (_decode, decode_addr) = worker("decode");
    let (prefill, prefill_addr) = worker("prefill");
    assert!(
        decode_addr.starts_with("https://") && prefill_addr.starts_with("https://"),
        "TLS workers must advertise https:// addresses: {decode_addr}, {prefill_addr}"
    );
    let mut args = vec![
        "router",
        "--http-listen",
        "127.0.0.1:0",
        "--tls-server-name",
        WORKER_NAME,
    ];
    args.extend_from_slice(&etcd_flags);
    args.extend(tls_flags.iter().map(String::as_str));
    let router = Proc::start_logged("router", &args, &env);
    let url = router.wait_for("router listening on", START);
    let http = router.wait_for("http listening on", START);
    assert!(url.starts_with("https://") && http.starts_with("https://"));

    // The registry is readable with the password, and holds the two TLS workers.
    let (ok, out, err) = status(
        &etcd,
        &cluster,
        &pki,
        &["--etcd-user", "root", "--etcd-password", PASSWORD],
    );
    assert!(ok, "duet status with the etcd password: {err}");
    assert_eq!(out.lines().count(), 2, "two workers registered: {out}");
    assert!(out.contains(&decode_addr) && out.contains(&prefill_addr));

    let prompt = "Name three colours of the rainbow.";
    let want = support::run_reference(prompt, false, 12);
    rt.block_on(async {
        // Public gRPC door over TLS (no client certificate needed there). A long prompt
        // takes the disaggregated path: router -> decode -> prefill (mTLS both), KV from
        // the prefill worker to the decode worker.
        let channel = tls_channel(&url, &pki, None).await.expect("TLS to router");
        let mut c = pb::generation_client::GenerationClient::new(channel);
        let end = std::time::Instant::now() + START;
        let got = loop {
            match support::generate(&mut c, greedy(text(prompt), 12)).await {
                Ok(done) => break done,
                Err(e) if std::time::Instant::now() < end => {
                    // Workers appear in the router's view shortly after they register.
                    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("generation over TLS: {e}"),
            }
        };
        assert_eq!(got.ids, want, "tokens over TLS differ from duet run");

        let long = "The history of the rainbow in art and science. ".repeat(6);
        let got = support::generate(&mut c, greedy(text(&long), 4))
            .await
            .expect("long prompt over TLS (prefill worker)");
        let fin = got.fin.expect("final message");
        assert_eq!(fin.usage.expect("usage").completion_tokens, 4);
        let metrics = support::http_get(&prefill.wait_for("metrics on", START));
        assert!(
            support::scrape_sum(&metrics.1, "duet_prefill_prompt_tokens_total", &[]) > 32.0,
            "the long prompt was prefilled by the prefill worker over mutual TLS"
        );

        // A plain-text client gets nothing from the TLS door.
        let plain = url.replace("https://", "http://");
        let plain_result = match Endpoint::from_shared(plain)
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(3))
            .connect()
            .await
        {
            Err(e) => format!("connect error: {e}"),
            Ok(ch) => match pb::generation_client::GenerationClient::new(ch)
                .list_models(pb::ListModelsRequest {})
                .await
            {
                Ok(_) => "answered".to_string(),
                Err(e) => format!("call error: {e}"),
            },
        };
        assert_ne!(plain_result, "answered", "plain text reached the TLS door");

        // Workers: mutual TLS. The node certificate passes; none, or a foreign CA's, fails.
        // Their certificate names only WORKER_NAME: dialled by address without
        // expecting that name, the handshake fails (what --tls-server-name is for).
        let named = Some(WORKER_NAME);
        for addr in [&decode_addr, &prefill_addr] {
            let node = Some(("node.pem", "node.key"));
            let ok = health(tls_channel_named(addr, &pki, node, named).await).await;
            assert_eq!(ok, "status 1", "{addr} with the cluster's certificate");
            let by_ip = health(tls_channel(addr, &pki, node).await).await;
            assert!(
                by_ip.contains("error"),
                "{addr}: a certificate without the IP was accepted for it: {by_ip}"
            );
            for identity in [None, Some(("rogue.pem", "rogue.key"))] {
                let refused = health(tls_channel_named(addr, &pki, identity, named).await).await;
                assert!(
                    refused.contains("error"),
                    "{addr} answered a client with identity {identity:?}: {refused}"
                );
            }
        }
    });

    // The HTTP door over TLS, with curl (a client nobody here wrote).
    let body = r#"{"prompt":"Name three colours of the rainbow.","max_tokens":12,"temperature":0}"#;
    let o = Command::new("curl")
        .args(["-sS", "--max-time", "120", "--cacert", &pki.arg("ca.pem")])
        .args(["-H", "content-type: application/json", "-d", body])
        .arg(format!("{http}/v1/completions"))
        .output()
        .expect("run curl");
    assert!(
        o.status.success(),
        "curl over TLS: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("completion JSON");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    assert!(!v["choices"][0]["text"].as_str().unwrap_or("").is_empty());
    // curl without the CA refuses the certificate; plain HTTP gets no HTTP answer.
    let o = Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .arg(format!("{http}/health"))
        .output()
        .expect("run curl");
    assert!(
        !o.status.success(),
        "curl trusted a certificate from an unknown CA"
    );
    let o = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg(format!("{}/health", http.replace("https://", "http://")))
        .output()
        .expect("run curl");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "000",
        "plain HTTP got an HTTP answer from the TLS door"
    );

    // `duet generate` over TLS.
    let o = Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["generate", "--router", &url, "--tls-ca", &pki.arg("ca.pem")])
        .args(["--prompt", prompt, "--max-tokens", "12"])
        .output()
        .expect("run duet generate");
    assert!(
        o.status.success(),
        "duet generate over TLS: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!String::from_utf8_lossy(&o.stdout).trim().is_empty());
    let _ = std::fs::remove_dir_all(&pki.dir);
}
