//! Log output: human text (colour only on a terminal) or one JSON object per line.
//!
//! The level filter comes from `DUET_LOG` (tracing `EnvFilter` syntax, default `warn`).
//! Prompt text never appears in logs: request spans carry ids, token counts and placement,
//! not content.

use crate::Error;
use tracing_subscriber::EnvFilter;

/// Log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (with the current span's fields), for log collectors.
    Json,
}

/// Installs the global log subscriber writing to stderr.
pub fn init_logs(format: LogFormat) -> Result<(), Error> {
    let filter = EnvFilter::try_from_env("DUET_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let res = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
    res.map_err(Error::Logs)
}
