//! Flags shared by the serving commands, and their validation.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use duet_discovery::{EtcdOptions, EtcdRegistry, RegistrationOptions, Registry};
use duet_engine::{EngineModel, KvCacheConfig, KvDtype, PrefixCacheConfig};
use duet_kv_transfer::protocol::Integrity;
use duet_kv_transfer::{Compression, SharedSecret, TransferConfig};
use duet_serving::cluster_auth::ClusterToken;

use super::tls_args::EtcdTlsArgs;

/// Registry flags.
#[derive(Args, Debug, Clone)]
pub struct RegistryArgs {
    /// etcd endpoints, comma separated (e.g. http://127.0.0.1:2379).
    #[arg(long, env = "DUET_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: the registry prefix `/duet/<cluster>/`.
    #[arg(long, env = "DUET_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Worker lease TTL (e.g. 5s).
    #[arg(long, env = "DUET_LEASE_TTL", default_value = "5s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    #[command(flatten)]
    pub etcd_auth: EtcdTlsArgs,
}

impl RegistryArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.etcd.is_empty() {
            bail!("--etcd: at least one endpoint is needed (or use `duet up` for one process)");
        }
        if self.cluster.is_empty() || self.cluster.contains('/') {
            bail!("--cluster: must be non-empty and without '/'");
        }
        if self.lease_ttl < Duration::from_secs(1) {
            bail!("--lease-ttl: at least 1s");
        }
        Ok(())
    }

    pub async fn connect(&self) -> anyhow::Result<Arc<dyn Registry>> {
        self.validate()?;
        let mut opts = EtcdOptions::new(self.etcd.clone());
        opts.tls = self.etcd_auth.tls()?.map(|t| t.tonic());
        opts.credentials = self.etcd_auth.credentials(&self.etcd)?;
        let r = EtcdRegistry::connect(opts)
            .await
            .context("connecting to etcd")?;
        Ok(Arc::new(r))
    }

    pub fn registration(&self) -> RegistrationOptions {
        RegistrationOptions::with_ttl(self.lease_ttl)
    }
}

/// The cluster secret: every process of a cluster holds it. Workers prove it at the KV
/// handshake, and every internal call carries a token derived from it (workers answer no
/// one else). There is no default: `duet up` makes a random one for its own process;
/// separate processes refuse to start without one.
#[derive(Args, Debug, Clone, Default)]
pub struct SecretArgs {
    /// File holding the cluster secret (16 to 1024 bytes; one trailing newline is ignored).
    /// Make one with `head -c 32 /dev/urandom | base64 > duet.secret`.
    #[arg(long, env = "DUET_KV_SECRET_FILE")]
    pub kv_secret_file: Option<std::path::PathBuf>,
    /// The cluster secret itself (16 to 1024 bytes); prefer --kv-secret-file, which keeps
    /// it out of process listings. Never printed.
    #[arg(long, env = "DUET_KV_SECRET", hide_env_values = true)]
    pub kv_secret: Option<String>,
}

/// The token internal calls carry: the key every member derives from the cluster secret
/// (never the secret itself).
pub fn cluster_token(secret: &SharedSecret) -> anyhow::Result<ClusterToken> {
    let key = secret.derive(duet_serving::cluster_auth::TOKEN_LABEL)?;
    Ok(ClusterToken::from_key(key)?)
}

/// What a separate process says when it has no secret.
const NO_SECRET: &str = "the cluster secret is required: give every process of the cluster \
    the same --kv-secret-file (or DUET_KV_SECRET), at least 16 bytes; make one with \
    `head -c 32 /dev/urandom | base64 > duet.secret`";

impl SecretArgs {
    /// The secret given, if any (checked: 16 to 1024 bytes).
    pub fn given(&self) -> anyhow::Result<Option<SharedSecret>> {
        let bytes = match (&self.kv_secret_file, &self.kv_secret) {
            (Some(_), Some(_)) => {
                bail!("--kv-secret-file and --kv-secret (DUET_KV_SECRET): give one of them")
            }
            (Some(path), None) => {
                let mut b = std::fs::read(path)
                    .with_context(|| format!("--kv-secret-file: reading {}", path.display()))?;
                if b.last() == Some(&b'\n') {
                    b.pop();
                    if b.last() == Some(&b'\r') {
                        b.pop();
                    }
                }
                b
            }
            (None, Some(s)) => s.as_bytes().to_vec(),
            (None, None) => return Ok(None),
        };
        let which = match self.kv_secret_file {
            Some(_) => "--kv-secret-file",
            None => "--kv-secret (DUET_KV_SECRET)",
        };
        SharedSecret::new(&bytes)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{which}: {e}"))
    }

    /// A separate process's secret: refused when none is given.
    pub fn required(&self) -> anyhow::Result<SharedSecret> {
        self.given()?.ok_or_else(|| anyhow::anyhow!(NO_SECRET))
    }

    /// `duet up`'s: the one given, else a random one for this process alone (its router and
    /// workers share it in memory; nothing outside can join).
    pub fn or_random(&self) -> anyhow::Result<SharedSecret> {
        match self.given()? {
            Some(s) => Ok(s),
            None => Ok(SharedSecret::new(rand::random::<[u8; 32]>())?),
        }
    }
}

/// KV cache and transfer flags.
#[derive(Args, Debug, Clone)]
pub struct KvArgs {
    /// KV pool size (bytes; units accepted: 512MiB, 2GiB).
    #[arg(long, env = "DUET_KV_POOL", default_value = "512MiB", value_parser = parse_bytes)]
    pub kv_pool: u64,
    /// KV element type.
    #[arg(long, env = "DUET_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: KvDtype,
    #[command(flatten)]
    pub secret: SecretArgs,
    /// Longest a KV transfer may make no progress (a write, a read, the wait for the
    /// receiver's verdict) before it fails; the router then avoids that prefill -> decode
    /// link for a while and retries.
    #[arg(long, env = "DUET_KV_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub kv_timeout: Duration,
    /// How a prefill worker encodes KV on the wire (tcp, shm): `none` as stored, `f16`
    /// (half of an f32 cache), `int8` with a scale per block, layer and head (about a
    /// quarter). Decode workers store their own dtype and accept any; lossy (see
    /// kv-transfer/README.md for what it does to greedy tokens). `duet up` refuses it on
    /// its default `--kv-transport local`, which hands KV over without encoding it.
    #[arg(long, env = "DUET_KV_COMPRESSION", value_enum, default_value = "none")]
    pub kv_compression: CompressionArg,
    /// Frame integrity on the KV link (tcp, shm, rdma, nccl): `on` MACs every frame under a
    /// key of its own (NH-Poly1305, keys from the handshake) and a decode worker refuses
    /// frames without one, so KV changed, cut or replayed on the way never reaches a pool;
    /// `off` only for links trusted end to end (docs/security.md).
    #[arg(long, env = "DUET_KV_INTEGRITY", value_enum, default_value = "on")]
    pub kv_integrity: Switch,
    /// Prefix caching: keep the KV blocks of finished requests and reuse them for prompts
    /// that start the same way (whole 16-token blocks); least recently used blocks are
    /// evicted when room is needed.
    #[arg(long, env = "DUET_PREFIX_CACHE", value_enum, default_value = "on")]
    pub prefix_cache: Switch,
    /// Host-memory tier below the KV pool: evicted prefix blocks move there and come back
    /// on a hit instead of being recomputed (bytes, units accepted; 0: no host tier).
    #[arg(long, env = "DUET_KV_HOST_POOL", default_value = "0", value_parser = parse_bytes)]
    pub kv_host_pool: u64,
    /// Directory for a third tier on local disk, below the host tier (each worker keeps one
    /// file there, `<worker id>.kv`, removed when it stops). Unset: no disk tier.
    #[arg(long, env = "DUET_KV_DISK_DIR")]
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Size of each worker's disk tier file (bytes, units accepted).
    #[arg(long, env = "DUET_KV_DISK_POOL", default_value = "1GiB", value_parser = parse_bytes)]
    pub kv_disk_pool: u64,
}

/// `--kv-compression` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompressionArg {
    None,
    F16,
    Int8,
}

impl From<CompressionArg> for Compression {
    fn from(c: CompressionArg) -> Self {
        match c {
            CompressionArg::None => Compression::None,
            CompressionArg::F16 => Compression::F16,
            CompressionArg::Int8 => Compression::Int8,
        }
    }
}

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// Same-host KV over shared memory (separate worker processes).
#[derive(Args, Debug, Clone)]
pub struct ShmArgs {
    /// Move KV over shared memory between workers on this host (same boot and mount
    /// namespace): decode workers also listen on a unix socket, prefill workers use it for
    /// decode workers on their host; tcp for every other pair.
    #[arg(long, env = "DUET_KV_SHM", value_enum, default_value = "on")]
    pub kv_shm: Switch,
}

/// UCX, for KV over RDMA (build with `--features rdma`).
#[cfg(feature = "rdma")]
#[derive(Args, Debug, Clone)]
pub struct UcxArgs {
    /// UCX transports, in `UCX_TLS` syntax (`rc,ud`, `tcp`, `shm`, ...); empty lets UCX
    /// choose (it also reads the `UCX_*` environment variables).
    #[arg(long, env = "DUET_KV_UCX_TLS", default_value = "")]
    pub kv_ucx_tls: String,
}

#[cfg(feature = "rdma")]
impl UcxArgs {
    pub fn options(&self) -> duet_kv_transfer::backend::rdma::RdmaOptions {
        duet_kv_transfer::backend::rdma::RdmaOptions {
            tls: self.kv_ucx_tls.clone(),
        }
    }
}

/// The directory shm sockets and ring files go in by default: `/dev/shm` (memory-backed)
/// where it exists, else the temp dir.
pub fn default_shm_dir() -> std::path::PathBuf {
    duet_kv_transfer::backend::shm::ShmOptions::default().dir
}

/// Tokens per KV block (fixed: every worker of a cluster must agree).
pub const BLOCK_SIZE: usize = 16;

impl KvArgs {
    pub fn cache_config(&self, model: &EngineModel) -> KvCacheConfig {
        let c = model.config();
        KvCacheConfig::from_budget(
            self.kv_pool as usize,
            BLOCK_SIZE,
            self.kv_dtype,
            (c.layers_per_kv_block(), c.n_kv_heads, c.head_dim),
        )
    }

    /// The prefix cache of worker `id` (`None`: off).
    pub fn prefix_cache_config(
        &self,
        model: &EngineModel,
        id: &str,
    ) -> anyhow::Result<Option<PrefixCacheConfig>> {
        if self.prefix_cache == Switch::Off {
            if self.kv_host_pool > 0 || self.kv_disk_dir.is_some() {
                bail!("--kv-host-pool / --kv-disk-dir: need --prefix-cache on");
            }
            return Ok(None);
        }
        let l = model.kv_layout(BLOCK_SIZE, self.kv_dtype)?;
        let block_bytes = l.block_bytes() as u64;
        let disk = match &self.kv_disk_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("--kv-disk-dir: creating {}", dir.display()))?;
                let blocks = (self.kv_disk_pool / block_bytes) as usize;
                if blocks == 0 {
                    bail!("--kv-disk-pool: smaller than one KV block ({block_bytes} bytes)");
                }
                Some((dir.join(format!("{id}.kv")), blocks))
            }
            None => None,
        };
        Ok(Some(PrefixCacheConfig {
            host_blocks: (self.kv_host_pool / block_bytes) as usize,
            disk,
        }))
    }

    pub fn transfer_config(
        &self,
        model: &EngineModel,
        secret: &SharedSecret,
    ) -> anyhow::Result<TransferConfig> {
        let layout =
            duet_worker_common::transfer_layout(&model.kv_layout(BLOCK_SIZE, self.kv_dtype)?)?;
        if self.kv_timeout < Duration::from_millis(100) {
            bail!("--kv-timeout: at least 100ms");
        }
        let mut cfg = TransferConfig::new(layout, secret.clone());
        cfg.timeouts.io = self.kv_timeout;
        cfg.compression = self.kv_compression.into();
        cfg.integrity = match self.kv_integrity {
            Switch::On => Integrity::Mac,
            Switch::Off => Integrity::Off,
        };
        #[cfg(feature = "fault-injection")]
        if let Ok(spec) = std::env::var("DUET_KV_FAULTS") {
            cfg.faults = Some(duet_kv_transfer::protocol::faults::FaultPlan::parse(&spec)?);
            tracing::warn!(%spec, "test build: injecting faults into this worker's KV transfers");
        }
        Ok(cfg)
    }
}

/// How the router places prefill.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ModeArg {
    /// Prefill workers for long prompts, decode workers for tokens.
    Disaggregated,
    /// One worker does both, mixing prefill chunks into decode batches.
    Colocated,
}

impl From<ModeArg> for duet_router::Mode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Disaggregated => duet_router::Mode::Disaggregated,
            ModeArg::Colocated => duet_router::Mode::Colocated,
        }
    }
}

/// `500ms`, `5s`, `2m`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration"))?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1e3,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(format!("`{s}`: unknown unit (ms, s, m, h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `4096`, `512KiB`, `256MiB`, `2GiB` (also KB/MB/GB as powers of 1000).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: u64 = num.parse().map_err(|_| format!("`{s}` is not a size"))?;
    let mul: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => return Err(format!("`{s}`: unknown unit `{other}` (KiB, MiB, GiB)")),
    };
    v.checked_mul(mul)
        .ok_or_else(|| format!("`{s}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(file: Option<&str>, value: Option<&str>) -> SecretArgs {
        SecretArgs {
            kv_secret_file: file.map(Into::into),
            kv_secret: value.map(Into::into),
        }
    }

    #[test]
    fn members_derive_one_token_and_it_is_not_the_secret() {
        let s = |b: &str| SharedSecret::new(b).unwrap();
        let a = cluster_token(&s("0123456789abcdef-cluster-a")).unwrap();
        let a2 = cluster_token(&s("0123456789abcdef-cluster-a")).unwrap();
        let b = cluster_token(&s("0123456789abcdef-cluster-b")).unwrap();
        let value = |t: &ClusterToken| {
            let mut r = tonic::Request::new(());
            t.attach(&mut r);
            r.metadata()
                .get(duet_serving::cluster_auth::TOKEN_HEADER)
                .unwrap()
                .as_bytes()
                .to_vec()
        };
        assert!(a.accepts(&value(&a2)));
        assert!(!a.accepts(&value(&b)));
        assert!(!a.accepts(b"0123456789abcdef-cluster-a"));
        assert!(!String::from_utf8_lossy(&value(&a)).contains("cluster-a"));
    }

    #[test]
    fn the_secret_is_required_checked_and_never_defaulted() {
        let e = secret(None, None).required().unwrap_err().to_string();
        assert!(
            e.contains("--kv-secret-file") && e.contains("urandom"),
            "{e}"
        );
        let e = secret(None, Some("eight888"))
            .required()
            .unwrap_err()
            .to_string();
        assert!(e.contains("16"), "{e}");
        assert!(secret(None, Some("sixteen-bytes-ok")).required().is_ok());
        let dir = std::env::temp_dir().join(format!("duet-secret-{}", std::process::id()));
        std::fs::write(&dir, "0123456789abcdef\n").unwrap();
        let path = dir.to_string_lossy().into_owned();
        let from_file = secret(Some(&path), None).required().unwrap();
        let direct = SharedSecret::new(b"0123456789abcdef").unwrap();
        assert_eq!(
            from_file.derive(b"x").unwrap(),
            direct.derive(b"x").unwrap(),
            "the trailing newline is not part of the secret"
        );
        assert!(secret(Some(&path), Some("0123456789abcdef"))
            .given()
            .is_err());
        std::fs::remove_file(&dir).unwrap();
        let a = secret(None, None).or_random().unwrap();
        let b = secret(None, None).or_random().unwrap();
        assert_ne!(a.derive(b"x").unwrap(), b.derive(b"x").unwrap());
    }

    #[test]
    fn units() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("3 parsecs").is_err());
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert!(parse_duration("5 weeks").is_err());
    }
}
