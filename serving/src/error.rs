//! The serving crate's one error type: serving a gRPC server, and the TLS material it and
//! its clients use.

use std::path::PathBuf;

/// What can go wrong while setting up or running a server, or loading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC server: {0}")]
    Transport(#[source] tonic::transport::Error),
    #[error("reflection service: {0}")]
    Reflection(#[source] tonic_reflection::server::Error),
    #[error("reading {path}: {source}")]
    TlsRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    TlsPem { path: PathBuf, what: String },
    #[error("TLS configuration: {0}")]
    TlsConfig(#[source] rustls::Error),
    #[error("worker address {addr}: {reason}")]
    Address { addr: String, reason: String },
    #[error("cluster token: {0}")]
    Auth(String),
    #[error("{during}: {source}")]
    Io {
        during: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics: {0}")]
    Metrics(String),
    #[error("{0} stopped unexpectedly")]
    Task(&'static str),
}
