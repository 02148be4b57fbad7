//! Optional OTLP export of the request spans (cargo feature `otlp`, flag
//! `--otlp-endpoint`): the same spans the logs show, sent over OTLP/gRPC to a collector
//! (Jaeger, Tempo, the OpenTelemetry Collector).
//!
//! Spans join the W3C trace the router carries in gRPC metadata: [`link_remote_parent`]
//! makes a request span the child of the caller's `traceparent`, and [`span_ids`] gives
//! the ids to put on outgoing calls, so one request is one trace across processes.
//!
//! The exporter's gRPC channel lives on a small runtime of its own, so export works
//! whatever the caller's runtime is (or before it exists); [`OtlpGuard`] flushes the
//! pending spans when dropped.

use std::time::Duration;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::KeyValue;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::Error;

/// Keeps the exporter alive; flushes and stops it on drop.
pub struct OtlpGuard {
    provider: SdkTracerProvider,
    _rt: tokio::runtime::Runtime,
}

impl Drop for OtlpGuard {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("duet: flushing OTLP spans: {e}");
        }
    }
}

/// The tracing layer exporting spans to `endpoint` as service `service`.
pub fn layer<S>(
    endpoint: &str,
    service: &str,
) -> Result<
    (
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>,
        OtlpGuard,
    ),
    Error,
>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(|e| Error::Logs(Box::new(e)))?;
    let exporter = {
        let _in_rt = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| Error::Logs(Box::new(e)))?
    };
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(500))
                .build(),
        )
        .build();
    // Follow the caller's sampling decision; sample new traces.
    let sampler = opentelemetry_sdk::trace::Sampler::ParentBased(Box::new(
        opentelemetry_sdk::trace::Sampler::AlwaysOn,
    ));
    let provider = SdkTracerProvider::builder()
        .with_sampler(sampler)
        .with_span_processor(processor)
        .with_resource(
            Resource::builder()
                .with_attributes([KeyValue::new("service.name", service.to_string())])
                .build(),
        )
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "duet");
    let layer = tracing_opentelemetry::layer().with_tracer(tracer);
    Ok((layer, OtlpGuard { provider, _rt: rt }))
}

/// Makes `span` a child of the remote span (`trace_id`, `span_id`) that called this
/// process. Without an OTLP layer installed this does nothing.
pub fn link_remote_parent(span: &tracing::Span, trace_id: u128, span_id: u64, sampled: bool) {
    let flags = match sampled {
        true => TraceFlags::SAMPLED,
        false => TraceFlags::default(),
    };
    let cx = SpanContext::new(
        TraceId::from_bytes(trace_id.to_be_bytes()),
        SpanId::from_bytes(span_id.to_be_bytes()),
        flags,
        true,
        TraceState::default(),
    );
    let parent = opentelemetry::Context::new().with_remote_span_context(cx);
    let _ = span.set_parent(parent);
}

/// The exported (trace id, span id) of `span`, when an OTLP layer records it.
pub fn span_ids(span: &tracing::Span) -> Option<(u128, u64)> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        (
            u128::from_be_bytes(sc.trace_id().to_bytes()),
            u64::from_be_bytes(sc.span_id().to_bytes()),
        )
    })
}
