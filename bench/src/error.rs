//! The crate's one error type. A failed *request* is not an error of the benchmark: it is
//! data (`record::ErrorKind` in its record); these are failures of the benchmark itself
//! (bad configuration, unreadable files, a target that cannot be reached at all).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] duet_engine::EngineError),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{path}: not a `duet bench serve` report: {reason}")]
    Report { path: PathBuf, reason: String },
    #[error("target {url}: {reason}")]
    Target { url: String, reason: String },
    #[error("plot {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl BenchError {
    pub(crate) fn config(msg: impl Into<String>) -> Self {
        BenchError::Config(msg.into())
    }

    pub(crate) fn file(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::File {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, BenchError>;
