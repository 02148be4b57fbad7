//! W3C trace context (`traceparent`) carried in gRPC metadata, so that one request's spans
//! in the router, the prefill worker and the decode worker share a trace id.
//!
//! The router takes the client's `traceparent` when it sends one (gRPC metadata or HTTP
//! header) or starts a new trace; every call it makes to a worker carries a child context
//! (same trace id, new span id); the workers record `trace_id` and `parent_span_id` on
//! their request spans. With JSON logs, filtering on `trace_id` follows a request across
//! processes. The format is `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.

use std::fmt;

/// The metadata / header key.
pub const TRACEPARENT: &str = "traceparent";

/// A trace id and the id of the span that made the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    pub span_id: u64,
    /// The caller's trace flags (bit 0: sampled), passed on unchanged.
    pub flags: u8,
}

fn nonzero_u64() -> u64 {
    rand::random::<u64>().max(1)
}

impl TraceContext {
    /// A new trace.
    pub fn new_root() -> Self {
        TraceContext {
            trace_id: rand::random::<u128>().max(1),
            span_id: nonzero_u64(),
            flags: 1,
        }
    }

    /// The same trace, a new span.
    pub fn child(&self) -> Self {
        TraceContext {
            trace_id: self.trace_id,
            span_id: nonzero_u64(),
            flags: self.flags,
        }
    }

    /// Parses a `traceparent` value. Version `00` has exactly four fields; later versions
    /// may append fields, which are ignored (W3C forward compatibility); `ff` and all-zero
    /// ids are invalid.
    pub fn parse(v: &str) -> Option<Self> {
        let mut parts = v.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let version = u8::from_str_radix(version, 16)
            .ok()
            .filter(|&v| v != 0xff)?;
        if (version == 0 && parts.next().is_some())
            || trace.len() != 32
            || span.len() != 16
            || flags.len() != 2
        {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|&s| s != 0)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the caller sampled this trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace id as 32 hex digits (what logs show).
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The span id as 16 hex digits.
    pub fn span_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }

    /// From incoming gRPC metadata, if the caller sent a valid one.
    pub fn extract(meta: &tonic::metadata::MetadataMap) -> Option<Self> {
        meta.get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(Self::parse)
    }

    /// Puts this context on an outgoing request.
    pub fn inject<T>(&self, req: &mut tonic::Request<T>) {
        if let Ok(v) = self.to_string().parse() {
            req.metadata_mut().insert(TRACEPARENT, v);
        }
    }
}

/// Puts a worker's request span in its caller's trace: records `trace_id` and
/// `parent_span_id` (fields the span declares empty) and, with OTLP export, makes it the
/// caller's child.
pub fn join_caller_trace(span: &tracing::Span, caller: Option<TraceContext>) {
    if let Some(t) = caller {
        span.record("trace_id", t.trace_hex());
        span.record("parent_span_id", t.span_hex());
        duet_telemetry::link_remote_parent(span, t.trace_id, t.span_id, t.sampled());
    }
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed_values() {
        let c = TraceContext::new_root();
        assert_eq!(TraceContext::parse(&c.to_string()), Some(c));
        let child = c.child();
        assert_eq!(child.trace_id, c.trace_id);
        assert_ne!(child.span_id, c.span_id);
        // The example from the W3C recommendation.
        let w3c = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("valid");
        assert_eq!(w3c.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(w3c.span_hex(), "00f067aa0ba902b7");
        assert!(w3c.sampled());
        // A later version with an extra field parses; an unsampled flag is kept.
        let v1 = TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-x")
            .expect("forward compatible");
        assert!(!v1.sampled());
        assert!(v1.to_string().ends_with("-00"));
        for bad in [
            "",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-xyz92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn travels_in_grpc_metadata() {
        let c = TraceContext::new_root();
        let mut req = tonic::Request::new(());
        c.inject(&mut req);
        assert_eq!(TraceContext::extract(req.metadata()), Some(c));
    }
}
