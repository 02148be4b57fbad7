//! A real, throw-away Prometheus (Debian's `prometheus` package) scraping given `/metrics`
//! URLs every 500 ms, with its query API on a free 127.0.0.1 port; and [`PrometheusApi`], the
//! query side alone, for one started elsewhere (the compose cluster's container).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{http_get, urlencode};

pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    api: PrometheusApi,
}

/// Instant queries against a Prometheus's HTTP API.
pub struct PrometheusApi {
    pub url: String,
}

impl std::ops::Deref for Prometheus {
    type Target = PrometheusApi;
    fn deref(&self) -> &PrometheusApi {
        &self.api
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("addr").port()
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`http://host:port/metrics` URLs) and waits until
    /// it is ready.
    pub fn start(targets: &[&str]) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("duet-prom-{:08x}", rand::random::<u32>()));
        std::fs::create_dir_all(&dir).expect("prometheus dir");
        let hosts: Vec<String> = targets
            .iter()
            .map(|t| {
                let t = t.trim_start_matches("http://");
                format!("'{}'", t.split('/').next().unwrap_or(t))
            })
            .collect();
        let config = format!(
            "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n\
             scrape_configs:\n  - job_name: duet\n    metrics_path: /metrics\n    \
             static_configs:\n      - targets: [{}]\n",
            hosts.join(", ")
        );
        let cfg = dir.join("prometheus.yml");
        std::fs::write(&cfg, config).expect("write prometheus.yml");
        let port = free_port();
        let bin = std::env::var("DUET_PROMETHEUS_BIN").unwrap_or_else(|_| "prometheus".into());
        let child = Command::new(&bin)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting {bin}: {e}. These tests need Prometheus: `apt-get install \
                     prometheus` (make test's scripts/install-test-deps.sh does it)"
                )
            });
        let p = Prometheus {
            child,
            dir,
            api: PrometheusApi {
                url: format!("http://127.0.0.1:{port}"),
            },
        };
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && http_get(&format!("{}/-/ready", p.url)).0 == 200
            {
                return p;
            }
            assert!(Instant::now() < end, "prometheus not ready within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl PrometheusApi {
    /// The value of an instant query returning one sample (`None`: no sample).
    pub fn query(&self, promql: &str) -> Option<f64> {
        let (status, body) = http_get(&format!(
            "{}/api/v1/query?query={}",
            self.url,
            urlencode(promql)
        ));
        assert_eq!(status, 200, "query {promql}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("query json");
        let r = v["data"]["result"].as_array()?;
        let sample = r.first()?;
        sample["value"][1].as_str()?.parse().ok()
    }

    /// Waits until `promql` evaluates to `want` (within `tol`); panics with the last value.
    pub fn wait_value(&self, promql: &str, want: f64, tol: f64, within: Duration) -> f64 {
        let end = Instant::now() + within;
        loop {
            let got = self.query(promql);
            if let Some(g) = got {
                if (g - want).abs() <= tol {
                    return g;
                }
            }
            if Instant::now() > end {
                panic!("{promql} = {got:?} through Prometheus, want {want} (±{tol})");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
