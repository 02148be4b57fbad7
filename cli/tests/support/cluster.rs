//! A cluster of separate `duet` processes (router, prefill and decode workers) registered
//! in a real etcd, for the tests that kill, stop or cut off one of them.

use super::*;

/// A cluster of separate processes registered in a real etcd.
pub struct Cluster {
    pub etcd: etcd::EtcdServer,
    pub cluster: String,
    pub router: Proc,
    pub url: String,
    pub prefill: Vec<Proc>,
    pub decode: Vec<Proc>,
}

/// Lease TTL of the workers in cluster tests.
pub const TTL: &str = "2s";

impl Cluster {
    pub fn worker(etcd: &etcd::EtcdServer, cluster: &str, role: &str, id: &str) -> Proc {
        Cluster::worker_with(etcd, cluster, role, id, None)
    }

    /// A worker; with `Some(env)`, started with those variables and its logs kept.
    pub fn worker_with(
        etcd: &etcd::EtcdServer,
        cluster: &str,
        role: &str,
        id: &str,
        logged: Option<&[(&str, &str)]>,
    ) -> Proc {
        let ep = etcd.endpoint();
        let start = |name: &str, args: &[&str]| match logged {
            Some(env) => Proc::start_logged(name, args, env),
            None => Proc::start(name, args),
        };
        let p = start(
            id,
            &[
                role,
                "--etcd",
                &ep,
                "--cluster",
                cluster,
                "--lease-ttl",
                TTL,
                "--id",
                id,
                "--kv-pool",
                "64MiB",
                "--metrics-listen",
                "127.0.0.1:0",
            ],
        );
        p.wait_for("serving gRPC on", START);
        p
    }

    pub fn start(prefill: usize, decode: usize, router_args: &[&str]) -> Cluster {
        Cluster::start_with(prefill, decode, router_args, None)
    }

    /// Like [`Cluster::start`], every process with `env` and its logs kept.
    pub fn start_logged(
        prefill: usize,
        decode: usize,
        router_args: &[&str],
        env: &[(&str, &str)],
    ) -> Cluster {
        Cluster::start_with(prefill, decode, router_args, Some(env))
    }

    fn start_with(
        prefill: usize,
        decode: usize,
        router_args: &[&str],
        logged: Option<&[(&str, &str)]>,
    ) -> Cluster {
        let etcd = etcd::EtcdServer::start();
        let cluster = format!("t{:08x}", rand::random::<u32>());
        let decode: Vec<Proc> = (0..decode)
            .map(|i| {
                Cluster::worker_with(&etcd, &cluster, "decode", &format!("decode-{i}"), logged)
            })
            .collect();
        let prefill: Vec<Proc> = (0..prefill)
            .map(|i| {
                Cluster::worker_with(&etcd, &cluster, "prefill", &format!("prefill-{i}"), logged)
            })
            .collect();
        let ep = etcd.endpoint();
        let mut args = vec!["router", "--etcd", &ep, "--cluster", &cluster];
        args.extend_from_slice(router_args);
        let router = match logged {
            Some(env) => Proc::start_logged("router", &args, env),
            None => Proc::start("router", &args),
        };
        let url = router.wait_for("router listening on", START);
        Cluster {
            etcd,
            cluster,
            router,
            url,
            prefill,
            decode,
        }
    }

    /// Waits until the router sees exactly this many workers.
    pub async fn wait_workers(&self, prefill: u32, decode: u32, within: Duration) {
        let mut c = client(&self.url).await;
        let end = Instant::now() + within;
        loop {
            let m = c
                .list_models(pb::ListModelsRequest {})
                .await
                .expect("list models")
                .into_inner();
            let m = &m.models[0];
            if m.prefill_workers == prefill && m.decode_workers == decode {
                return;
            }
            if Instant::now() > end {
                panic!(
                    "router sees {} prefill / {} decode workers, want {prefill} / {decode}",
                    m.prefill_workers, m.decode_workers
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Worker ids registered in etcd, read with `duet status`.
    pub fn registered(&self) -> Vec<String> {
        let o = Command::new(env!("CARGO_BIN_EXE_duet"))
            .args([
                "status",
                "--etcd",
                &self.etcd.endpoint(),
                "--cluster",
                &self.cluster,
            ])
            .output()
            .expect("duet status");
        assert!(
            o.status.success(),
            "duet status: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("record json");
                v["id"].as_str().unwrap_or_default().to_string()
            })
            .collect()
    }
}
