//! Errors of telemetry set-up.

/// What can go wrong installing telemetry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Prometheus recorder could not be built or installed.
    #[error("installing the Prometheus recorder")]
    Recorder(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The `/metrics` listener failed.
    #[error("serving /metrics")]
    Serve(#[source] std::io::Error),
    /// A log subscriber was already installed or the filter was invalid.
    #[error("setting up logs or span export")]
    Logs(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// `--otlp-endpoint` given to a binary built without the `otlp` feature.
    #[error("--otlp-endpoint: this duet was built without the `otlp` feature")]
    OtlpNotBuilt,
}
