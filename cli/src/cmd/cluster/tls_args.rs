//! TLS flags: for the servers a process runs (the router's public doors, a worker's
//! internal gRPC), for the router's calls to workers, for the clients (`duet generate`,
//! `duet status`), and for etcd.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use duet_serving::tls::{ClientTls, ServerTls};

/// Whether a server asks its clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum ClientAuth {
    /// Any client may connect (API keys guard the public doors).
    #[default]
    None,
    /// Only clients with a certificate signed by --tls-ca (mutual TLS).
    Required,
}

/// TLS of a serving process (`duet up`, `duet router`, `duet prefill`, `duet decode`).
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// PEM certificate chain this process serves with (the router's gRPC and HTTP doors, a
    /// worker's gRPC) and presents to servers that require client certificates. Without
    /// it, servers speak plain text.
    #[arg(long, env = "DUET_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "DUET_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: the router checks workers' certificates against it, and servers with
    /// --tls-client-auth required check client certificates against it.
    #[arg(long, env = "DUET_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Whether this process's servers require client certificates (mutual TLS).
    #[arg(long, env = "DUET_TLS_CLIENT_AUTH", value_enum, default_value = "none")]
    pub tls_client_auth: ClientAuth,
    /// Name the router, and a decode worker calling the prefill workers of its remote
    /// prompts, expect in workers' certificates when it is not the host they advertise (e.g.
    /// one certificate for every worker, issued to a service name).
    #[arg(long, env = "DUET_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
}

impl TlsArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.tls_client_auth == ClientAuth::Required {
            if self.tls_cert.is_none() {
                bail!("--tls-client-auth required: needs --tls-cert and --tls-key (a server)");
            }
            if self.tls_ca.is_none() {
                bail!("--tls-client-auth required: needs --tls-ca to check clients against");
            }
        }
        if self.tls_server_name.is_some() && self.tls_ca.is_none() {
            bail!("--tls-server-name: needs --tls-ca");
        }
        Ok(())
    }

    /// TLS for this process's servers (`None`: plain text).
    pub fn server(&self) -> anyhow::Result<Option<ServerTls>> {
        self.validate()?;
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let client_ca = match self.tls_client_auth {
            ClientAuth::Required => self.tls_ca.as_deref(),
            ClientAuth::None => None,
        };
        Ok(Some(
            ServerTls::load(cert, key, client_ca).context("--tls-cert/--tls-key/--tls-ca")?,
        ))
    }

    /// TLS for this process's calls to servers that speak TLS (`None` without --tls-ca).
    pub fn client(&self) -> anyhow::Result<Option<ClientTls>> {
        self.validate()?;
        client_tls(&self.tls_ca, &self.tls_cert, &self.tls_key)
            .map(|c| c.map(|c| c.with_server_name(self.tls_server_name.clone())))
    }
}

/// TLS of a client command (`duet generate`, `duet status`) towards an `https://` router.
#[derive(Args, Debug, Clone, Default)]
pub struct ClientTlsArgs {
    /// PEM CA bundle the router's certificate is checked against (needed for https://).
    #[arg(long, env = "DUET_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a router that requires one.
    #[arg(long, env = "DUET_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "DUET_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// An endpoint for `url`, with TLS when the URL is `https://`.
    pub fn endpoint(&self, url: &str) -> anyhow::Result<tonic::transport::Endpoint> {
        let e = tonic::transport::Endpoint::from_shared(url.to_string())
            .with_context(|| format!("{url}: not a URL"))?;
        if !url.starts_with("https://") {
            if self.tls_ca.is_some() {
                bail!("--tls-ca given but {url} is plain text: use https://");
            }
            return Ok(e);
        }
        let tls = client_tls(&self.tls_ca, &self.tls_cert, &self.tls_key)?
            .with_context(|| format!("{url}: https needs --tls-ca"))?;
        e.tls_config(tls.tonic())
            .with_context(|| format!("{url}: TLS configuration"))
    }
}

/// TLS towards etcd (its CA, and a client certificate when etcd requires one) and etcd's
/// user/password authentication.
#[derive(Args, Clone, Default)]
pub struct EtcdTlsArgs {
    /// PEM CA bundle etcd's certificate is checked against (endpoints are https://).
    #[arg(long, env = "DUET_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate for etcd (`--client-cert-auth` on etcd's side).
    #[arg(long, env = "DUET_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = "DUET_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (with --etcd-password), when etcd has authentication enabled.
    #[arg(long, env = "DUET_ETCD_USER", requires = "etcd_password")]
    pub etcd_user: Option<String>,
    /// Password of --etcd-user. Never logged.
    #[arg(
        long,
        env = "DUET_ETCD_PASSWORD",
        requires = "etcd_user",
        hide_env_values = true
    )]
    pub etcd_password: Option<String>,
}

impl std::fmt::Debug for EtcdTlsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTlsArgs")
            .field("etcd_ca", &self.etcd_ca)
            .field("etcd_cert", &self.etcd_cert)
            .field("etcd_user", &self.etcd_user)
            .field(
                "etcd_password",
                &self.etcd_password.as_ref().map(|_| "<hidden>"),
            )
            .finish()
    }
}

impl EtcdTlsArgs {
    /// The user and password, when given. Refused towards `http://` endpoints: the
    /// password would cross the network in clear.
    pub fn credentials(
        &self,
        endpoints: &[String],
    ) -> anyhow::Result<Option<duet_discovery::EtcdCredentials>> {
        let (Some(u), Some(p)) = (&self.etcd_user, &self.etcd_password) else {
            return Ok(None);
        };
        if let Some(plain) = endpoints.iter().find(|e| !e.starts_with("https://")) {
            bail!(
                "--etcd-password: etcd endpoint {plain} is not https://, the password would \
                 cross the network in clear (give https:// endpoints and --etcd-ca)"
            );
        }
        Ok(Some(duet_discovery::EtcdCredentials::new(u, p)))
    }

    pub fn tls(&self) -> anyhow::Result<Option<ClientTls>> {
        if self.etcd_cert.is_some() && self.etcd_ca.is_none() {
            bail!("--etcd-cert: needs --etcd-ca");
        }
        client_tls(&self.etcd_ca, &self.etcd_cert, &self.etcd_key).context("etcd TLS")
    }
}

fn client_tls(
    ca: &Option<PathBuf>,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
) -> anyhow::Result<Option<ClientTls>> {
    let Some(ca) = ca else { return Ok(None) };
    let identity = match (cert, key) {
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        _ => None,
    };
    Ok(Some(ClientTls::load(ca, identity)?))
}
