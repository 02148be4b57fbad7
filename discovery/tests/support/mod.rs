//! A real, throw-away etcd for integration tests.
//!
//! [`EtcdServer::start`] runs the `etcd` binary (`/usr/bin/etcd` from Debian's `etcd-server`,
//! or `$DUET_ETCD_BIN`) as a single-member cluster on free 127.0.0.1 ports with a fresh data
//! directory, and waits until `/health` answers. It can be paused (SIGSTOP), resumed, killed
//! and restarted on the same ports and data directory. Drop kills it and removes the data.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub struct EtcdServer {
    bin: PathBuf,
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP `/health` and `/metrics`, also when clients must speak TLS.
    metrics_port: u16,
    /// The address clients reach etcd at (127.0.0.1 unless started with [`EtcdServer::start_on`]).
    host: String,
    tls: Option<EtcdTls>,
}

/// TLS of the client port: etcd's certificate and key, and the CA client certificates
/// must chain to (`--client-cert-auth`).
#[derive(Clone, Debug)]
pub struct EtcdTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// A free port below the kernel's ephemeral range. A port from `bind(0)` would do for one
/// start, but a restart needs the same port back, and while etcd is down any process that
/// binds port 0 (other tests run beside this one) may be handed it. Ports outside the
/// ephemeral range are never handed out that way.
fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let base = 10_000u16;
    if low > base + 100 {
        // Spread concurrent test processes over the range; bind to check it is free.
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let seed = std::process::id()
            .wrapping_mul(2_654_435_761)
            .wrapping_add(NEXT.fetch_add(7_919, Ordering::SeqCst));
        let span = u32::from(low - base);
        for i in 0..span {
            let port = base + ((seed.wrapping_add(i) % span) as u16);
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
    l.local_addr().expect("local addr").port()
}

fn find_etcd() -> PathBuf {
    if let Some(p) = std::env::var_os("DUET_ETCD_BIN") {
        return PathBuf::from(p);
    }
    let default = Path::new("/usr/bin/etcd");
    if default.exists() {
        return default.to_path_buf();
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("etcd");
            if p.exists() {
                return p;
            }
        }
    }
    panic!(
        "etcd not found: these tests need a real etcd server. Install it with \
         `apt-get install etcd-server` (or run `make test`, whose scripts/install-test-deps.sh \
         does), or point DUET_ETCD_BIN at an etcd binary."
    );
}

impl EtcdServer {
    pub fn start() -> EtcdServer {
        EtcdServer::start_with(None, "127.0.0.1")
    }

    /// An etcd whose client port listens on `host` (e.g. a bridge address other network
    /// namespaces reach); its ports are still picked free on 127.0.0.1.
    pub fn start_on(host: &str) -> EtcdServer {
        EtcdServer::start_with(None, host)
    }

    /// An etcd whose clients must speak TLS and present a certificate signed by `tls.ca`.
    pub fn start_tls(tls: EtcdTls) -> EtcdServer {
        EtcdServer::start_with(Some(tls), "127.0.0.1")
    }

    fn start_with(tls: Option<EtcdTls>, host: &str) -> EtcdServer {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let bin = find_etcd();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "duet-etcd-{}-{}-{nanos}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).expect("create etcd temp dir");
        let mut server = EtcdServer {
            bin,
            child: None,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            host: host.to_string(),
            tls,
        };
        server.spawn();
        server
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.host, self.client_port)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("etcd is not running").id()
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "etcd already running");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("open etcd log");
        let mut cmd = Command::new(&self.bin);
        if let Some(tls) = &self.tls {
            cmd.arg(format!("--cert-file={}", tls.cert.display()))
                .arg(format!("--key-file={}", tls.key.display()))
                .arg(format!("--trusted-ca-file={}", tls.ca.display()))
                .arg("--client-cert-auth");
        }
        let child = cmd
            .arg("--name=duet-test")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=duet-test={peer}"))
            .arg("--initial-cluster-state=new")
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ))
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=300")
            .arg("--logger=zap")
            .arg("--log-outputs=stderr")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        self.wait_ready();
    }

    fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.metrics_port).into(),
            Duration::from_millis(200),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let req = format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.metrics_port
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("etcd exited early ({status}); log:\n{}", self.log_tail());
                }
            }
            if self.healthy() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "etcd did not become healthy within 15 s; log:\n{}",
            self.log_tail()
        );
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{sig} failed");
    }

    /// Freezes etcd (SIGSTOP): connections stay open but nothing answers.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Undoes [`EtcdServer::pause`].
    pub fn resume(&self) {
        self.signal("CONT");
    }

    /// Kills etcd (SIGKILL, also when paused); data and ports are kept for a restart.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports and data directory and waits until it is healthy.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
