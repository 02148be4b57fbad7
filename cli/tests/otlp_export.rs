//! `--otlp-endpoint`: request spans leave every process over OTLP/gRPC and form one trace.
//! The receiving end is the OTLP trace service from the `opentelemetry-proto` crate (the
//! protocol's own generated server), recording what arrives.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use support::*;

/// One received span.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
}

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Got>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.clone())
                .map(|v| match v {
                    AnyValue::StringValue(s) => s,
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Got {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_router_prefill_and_decode_form_one_trace() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let svc = TraceServiceServer::new(collector.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let endpoint = format!("http://{addr}");
    let env = [("DUET_OTLP_ENDPOINT", endpoint.as_str())];
    let c = Cluster::start_logged(1, 1, &["--local-prefill-max-tokens", "0"], &env);
    c.wait_workers(1, 1, START).await;

    let trace = "0af7651916cd43dd8448eb211c80319c";
    let client_span = "b7ad6b7169203331";
    let mut req = tonic::Request::new(greedy(
        text("Explain briefly how a lighthouse warns ships at night."),
        3,
    ));
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace}-{client_span}-01")
            .parse()
            .expect("ascii"),
    );
    let mut g = client(&c.url).await;
    let mut s = g.generate(req).await.expect("generate").into_inner();
    while s.message().await.expect("stream").is_some() {}

    // Spans are exported in batches every 500 ms.
    let end = Instant::now() + Duration::from_secs(30);
    let (router, prefill, transfer, decode) = loop {
        let got = collector.0.lock().unwrap().clone();
        let find = |service: &str, name: &str| {
            got.iter()
                .find(|s| s.service == service && s.name == name && s.trace_id == trace)
                .cloned()
        };
        if let (Some(r), Some(p), Some(t), Some(d)) = (
            find("duet-router", "generate"),
            find("duet-prefill", "prefill"),
            find("duet-prefill", "kv_transfer"),
            find("duet-decode", "decode"),
        ) {
            break (r, p, t, d);
        }
        assert!(
            Instant::now() < end,
            "spans of trace {trace} did not all arrive; got: {got:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The router's span is the client's child; the workers' spans are the router's.
    assert_eq!(router.parent_span_id, client_span);
    assert_eq!(prefill.parent_span_id, router.span_id);
    // The KV transfer is part of the prefill: router -> prefill -> transfer.
    assert_eq!(transfer.parent_span_id, prefill.span_id);
    assert_eq!(decode.parent_span_id, router.span_id);
}
