//! TLS for duet's servers and clients: rustls with the ring provider (the one tonic's
//! `tls-ring` uses, so the tree holds a single crypto provider), certificates from PEM files
//! (Kubernetes Secrets mounted as files in the chart).
//!
//! - [`ServerTls`]: a server's certificate chain and key, and optionally the CA that client
//!   certificates must chain to. With a client CA, a client without such a certificate is
//!   refused at the handshake (mutual TLS), before it can send a single request.
//! - [`ClientTls`]: the CA a client trusts, optionally its own certificate (for servers that
//!   require mutual TLS), and the name expected in the server's certificate when it differs
//!   from the host dialled (workers advertise IP addresses; one certificate for all of them
//!   names a service instead).
//!
//! Files are read and parsed once, at start-up, so a bad path or an empty PEM file fails the
//! process with the flag's file named, never the first request.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::error::ServeError;

/// One PEM file's bytes, checked to hold what it must.
#[derive(Clone)]
struct Pem {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl std::fmt::Debug for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        write!(f, "{}", self.path.display())
    }
}

impl Pem {
    fn read(path: &Path) -> Result<Pem, ServeError> {
        let bytes = std::fs::read(path).map_err(|source| ServeError::TlsRead {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Pem {
            path: path.to_path_buf(),
            bytes,
        })
    }

    fn certs(&self) -> Result<Vec<CertificateDer<'static>>, ServeError> {
        let certs = CertificateDer::pem_slice_iter(&self.bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.bad(format!("not PEM certificates: {e}")))?;
        if certs.is_empty() {
            return Err(self.bad("no certificate in the file".into()));
        }
        Ok(certs)
    }

    fn key(&self) -> Result<PrivateKeyDer<'static>, ServeError> {
        PrivateKeyDer::from_pem_slice(&self.bytes)
            .map_err(|e| self.bad(format!("no PEM private key: {e}")))
    }

    fn bad(&self, what: String) -> ServeError {
        ServeError::TlsPem {
            path: self.path.clone(),
            what,
        }
    }
}

/// Longest TLS handshake a server waits for: a client that connects and says nothing holds
/// a socket, never a request slot, and not for long.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server's TLS material.
#[derive(Debug, Clone)]
pub struct ServerTls {
    cert: Pem,
    key: Pem,
    client_ca: Option<Pem>,
}

impl ServerTls {
    /// Loads and checks `cert` (chain), `key`, and the CA that client certificates must
    /// chain to (`None`: clients are not asked for a certificate).
    pub fn load(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<ServerTls, ServeError> {
        let tls = ServerTls {
            cert: Pem::read(cert)?,
            key: Pem::read(key)?,
            client_ca: client_ca.map(Pem::read).transpose()?,
        };
        // Parse everything now: a bad file fails start-up, not the first handshake.
        tls.rustls(&[])?;
        Ok(tls)
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_cert(&self) -> bool {
        self.client_ca.is_some()
    }

    /// For tonic's server.
    pub fn tonic(&self) -> ServerTlsConfig {
        let c = ServerTlsConfig::new()
            .identity(Identity::from_pem(
                self.cert.bytes.clone(),
                self.key.bytes.clone(),
            ))
            .timeout(HANDSHAKE_TIMEOUT);
        match &self.client_ca {
            Some(ca) => c.client_ca_root(Certificate::from_pem(ca.bytes.clone())),
            None => c,
        }
    }

    /// A rustls server configuration offering `alpn` (e.g. `http/1.1`), for servers tonic
    /// does not run (the HTTP door).
    pub fn rustls(&self, alpn: &[&[u8]]) -> Result<Arc<rustls::ServerConfig>, ServeError> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(ServeError::TlsConfig)?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in ca.certs()? {
                    roots
                        .add(c)
                        .map_err(|e| ca.bad(format!("not a usable CA: {e}")))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .map_err(|e| ca.bad(format!("client CA: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg = builder
            .with_single_cert(self.cert.certs()?, self.key.key()?)
            .map_err(ServeError::TlsConfig)?;
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(cfg))
    }
}

/// A client's TLS material.
#[derive(Debug, Clone)]
pub struct ClientTls {
    ca: Pem,
    identity: Option<(Pem, Pem)>,
    server_name: Option<String>,
}

impl ClientTls {
    /// Loads the CA to trust, and this client's certificate and key when servers require
    /// one.
    pub fn load(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<ClientTls, ServeError> {
        let ca = Pem::read(ca)?;
        ca.certs()?;
        let identity = match identity {
            Some((cert, key)) => {
                let (cert, key) = (Pem::read(cert)?, Pem::read(key)?);
                cert.certs()?;
                key.key()?;
                Some((cert, key))
            }
            None => None,
        };
        Ok(ClientTls {
            ca,
            identity,
            server_name: None,
        })
    }

    /// Expects `name` in servers' certificates instead of the host dialled.
    pub fn with_server_name(mut self, name: Option<String>) -> ClientTls {
        self.server_name = name;
        self
    }

    /// For tonic's channels (and etcd-client, which takes the same type).
    pub fn tonic(&self) -> ClientTlsConfig {
        let mut c =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(self.ca.bytes.clone()));
        if let Some((cert, key)) = &self.identity {
            c = c.identity(Identity::from_pem(cert.bytes.clone(), key.bytes.clone()));
        }
        if let Some(n) = &self.server_name {
            c = c.domain_name(n.clone());
        }
        c
    }
}

/// The scheme of URLs that reach a server with (`https`) or without (`http`) TLS.
pub fn scheme(tls: bool) -> &'static str {
    if tls {
        "https"
    } else {
        "http"
    }
}
