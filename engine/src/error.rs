//! The engine's one error type, and its classification into the small set of
//! classes every duet component maps to a gRPC status, an HTTP status and a
//! bounded metric label.

use std::path::PathBuf;

pub use duet_error_class::ErrorClass;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("model file is not a valid GGUF: {0}")]
    Format(String),
    #[error("GGUF could not be read: {0}")]
    Candle(#[source] candle_core::Error),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A request's attention policy this model or engine cannot run (never run as another).
    #[error("attention policy not supported here: {0}")]
    PolicyUnsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(#[source] minijinja::Error),
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    #[error("KV cache exhausted: need {needed} blocks, {free} free")]
    KvExhausted { needed: usize, free: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    /// The device or engine asked for cannot run here (no CUDA in this build, no driver,
    /// no such GPU, native on a GPU): a start-up refusal, exit code 2 in the CLI.
    #[error("{0}")]
    Device(String),
    /// The caller's per-layer hook stopped the forward (nobody waits for its sequences).
    #[error("forward stopped after layer {layer}: nobody waits for its sequences")]
    Stopped { layer: usize },
}

impl EngineError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        EngineError::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            EngineError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ErrorClass::NotFound
            }
            EngineError::InvalidArgument { .. }
            | EngineError::LayoutMismatch(_)
            | EngineError::Device(_) => ErrorClass::InvalidArgument,
            EngineError::KvExhausted { .. } => ErrorClass::ResourceExhausted,
            EngineError::PolicyUnsupported(_) => ErrorClass::FailedPrecondition,
            EngineError::UnknownSequence(_) => ErrorClass::NotFound,
            EngineError::Stopped { .. } => ErrorClass::Cancelled,
            EngineError::Io { .. }
            | EngineError::Format(_)
            | EngineError::Candle(_)
            | EngineError::Unsupported(_)
            | EngineError::Tokenizer(_)
            | EngineError::Template(_) => ErrorClass::Internal,
        }
    }
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Candle(e)
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
