//! The test doubles of `duet bench router`: a decode worker that answers every request
//! with one token at once (and, for a remote prefill, calls the prefill worker itself, as a
//! real one does) and a prefill worker that answers at once, registered in their own
//! in-memory registry. They measure the router's own work, never a model's.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use duet_discovery::{
    Capacity, KvEndpoint, MemoryRegistry, Registration, RegistrationOptions, Registry, Role,
    WorkerRecord,
};
use duet_proto::v1 as pb;
use futures::Stream;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::error::BenchError;

/// A decode worker that answers at once; for a `ViaPrefill` request it calls the prefill
/// worker first, as a real one does (that call is the decode worker's work, not the
/// router's, and runs on the fake workers' runtime).
#[derive(Clone, Default)]
pub struct FakeDecode {
    prefill: Arc<duet_serving::channels::Channels>,
}

pub type Events = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for FakeDecode {
    type GenerateStream = Events;
    async fn generate(&self, r: Request<pb::DecodeRequest>) -> Result<Response<Events>, Status> {
        if let Some(pb::decode_request::Prefill::Via(v)) = r.into_inner().prefill {
            let channel = self
                .prefill
                .get(&v.prefill_address)
                .map_err(|e| Status::unavailable(e.to_string()))?;
            pb::prefill_client::PrefillClient::new(channel)
                .prefill(pb::PrefillRequest::default())
                .await?;
        }
        let events = vec![
            Ok(pb::DecodeEvent {
                event: Some(pb::decode_event::Event::Token(pb::TokenChunk {
                    id: 42,
                    text: "x".into(),
                })),
            }),
            Ok(pb::DecodeEvent {
                event: Some(pb::decode_event::Event::Done(pb::DecodeDone {
                    finish_reason: pb::FinishReason::Length as i32,
                    completion_tokens: 1,
                    ..Default::default()
                })),
            }),
        ];
        Ok(Response::new(Box::pin(futures::stream::iter(events))))
    }
    async fn release(
        &self,
        _: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        Ok(Response::new(pb::ReleaseResponse { released: true }))
    }
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::WorkerStatus>, Status> {
        Ok(Response::new(pb::WorkerStatus::default()))
    }
}

#[derive(Clone)]
struct FakePrefill;

#[tonic::async_trait]
impl pb::prefill_server::Prefill for FakePrefill {
    async fn prefill(
        &self,
        _: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        Ok(Response::new(pb::PrefillResponse {
            first_token: 42,
            ..Default::default()
        }))
    }
    async fn cancel(
        &self,
        _: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        Ok(Response::new(pb::ReleaseResponse { released: true }))
    }
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::WorkerStatus>, Status> {
        Ok(Response::new(pb::WorkerStatus::default()))
    }
}

/// Serves `routes` on a fresh `127.0.0.1:0` listener until `cancel` fires; its address.
pub async fn serve_fake(
    routes: tonic::service::Routes,
    cancel: CancellationToken,
) -> crate::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(
                duet_serving::server::nodelay_incoming(l),
                cancel.cancelled_owned(),
            )
            .await;
    });
    Ok(addr)
}

/// Starts the fake workers on the load runtime, registered in their own in-memory registry.
pub async fn fake_workers(
    cancel: &CancellationToken,
) -> crate::Result<(Arc<dyn Registry>, SocketAddr, Vec<Registration>)> {
    let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
    let d = serve_fake(
        tonic::service::Routes::new(pb::decode_server::DecodeServer::new(FakeDecode::default())),
        cancel.clone(),
    )
    .await?;
    let p = serve_fake(
        tonic::service::Routes::new(pb::prefill_server::PrefillServer::new(FakePrefill)),
        cancel.clone(),
    )
    .await?;
    let mut regs = Vec::new();
    for (role, addr) in [(Role::Decode, d), (Role::Prefill, p)] {
        let mut r = WorkerRecord::new(
            "bench",
            role,
            format!("fake-{}", role.as_str()),
            format!("http://{addr}"),
        );
        r.model = "bench".into();
        r.fingerprint = "f".into();
        r.kv_endpoints = vec![KvEndpoint {
            transport: "tcp".into(),
            address: "127.0.0.1:9".into(),
        }];
        r.capacity = Capacity {
            kv_blocks_total: 1 << 30,
            kv_blocks_free: 1 << 30,
            block_size: 16,
            ..Capacity::default()
        };
        regs.push(
            Registration::start(
                registry.clone(),
                r,
                RegistrationOptions::default(),
                cancel.clone(),
            )
            .await
            .map_err(|e| BenchError::Target {
                url: format!("http://{addr}"),
                reason: format!("registering the fake {} worker: {e}", role.as_str()),
            })?,
        );
    }
    Ok((registry, d, regs))
}
