//! The crate's one error type: failures of a planning command itself (a malformed profile
//! or trace, a bad setting). A request the simulated cluster fails is data (its record's
//! error), not an error. Messages name the file, the line where there is one, and the
//! field, so that a hand-written profile or a trace can be fixed from the message alone.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A profile or trace that cannot be used: `at` is `file` or `file:line`.
    #[error("{at}: {field}: {reason}")]
    Input {
        at: String,
        field: String,
        reason: String,
    },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid setting {field}: {reason}")]
    Setting { field: String, reason: String },
    #[error(transparent)]
    Bench(#[from] duet_bench::BenchError),
    #[error("engine: {0}")]
    Engine(#[from] duet_engine::EngineError),
}

impl PlanError {
    pub fn input(
        at: impl Into<String>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        PlanError::Input {
            at: at.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn setting(field: impl Into<String>, reason: impl Into<String>) -> Self {
        PlanError::Setting {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn file(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        PlanError::File {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, PlanError>;
