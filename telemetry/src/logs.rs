//! Log output (human text, colour only on a terminal, or one JSON object per line) and,
//! with the `otlp` feature, span export over OTLP.
//!
//! The log level filter comes from `DUET_LOG` (tracing `EnvFilter` syntax, default `warn`);
//! exported spans have their own filter (`info`), so `--otlp-endpoint` works whatever the
//! log level. Prompt text never appears in logs or spans: request spans carry ids, token
//! counts and placement, not content.

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::Error;

/// Log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (with the current span's fields), for log collectors.
    Json,
}

/// Keeps span export running; flushes it when dropped (hold it until the process ends).
pub struct LogGuard {
    #[cfg(feature = "otlp")]
    _otlp: Option<crate::otlp::OtlpGuard>,
}

/// Installs the global subscriber: logs to stderr in `format`; spans of `service` to the
/// OTLP collector at `otlp_endpoint` when given.
pub fn init_logs(
    format: LogFormat,
    otlp_endpoint: Option<&str>,
    service: &str,
) -> Result<LogGuard, Error> {
    let filter = EnvFilter::try_from_env("DUET_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let base = tracing_subscriber::registry().with(fmt.with_filter(filter));
    match otlp_endpoint {
        None => {
            base.try_init().map_err(|e| Error::Logs(Box::new(e)))?;
            Ok(LogGuard {
                #[cfg(feature = "otlp")]
                _otlp: None,
            })
        }
        #[cfg(feature = "otlp")]
        Some(endpoint) => {
            let (layer, guard) = crate::otlp::layer(endpoint, service)?;
            base.with(layer.with_filter(LevelFilter::INFO))
                .try_init()
                .map_err(|e| Error::Logs(Box::new(e)))?;
            Ok(LogGuard { _otlp: Some(guard) })
        }
        #[cfg(not(feature = "otlp"))]
        Some(_) => {
            let _ = (service, LevelFilter::INFO);
            Err(Error::OtlpNotBuilt)
        }
    }
}

/// Makes `span` the child of the caller's span (`trace_id`, `span_id`) in exported traces;
/// does nothing without OTLP export.
pub fn link_remote_parent(span: &tracing::Span, trace_id: u128, span_id: u64, sampled: bool) {
    #[cfg(feature = "otlp")]
    crate::otlp::link_remote_parent(span, trace_id, span_id, sampled);
    #[cfg(not(feature = "otlp"))]
    let _ = (span, trace_id, span_id, sampled);
}

/// The (trace id, span id) `span` is exported under, when spans are exported.
pub fn span_ids(span: &tracing::Span) -> Option<(u128, u64)> {
    #[cfg(feature = "otlp")]
    return crate::otlp::span_ids(span);
    #[cfg(not(feature = "otlp"))]
    {
        let _ = span;
        None
    }
}
