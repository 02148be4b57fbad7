//! `duet health`: asks a duet process's gRPC health service (`grpc.health.v1`, which every
//! router and worker serves without a token) whether it serves. Exit code 0 when the answer
//! is SERVING, 1 for any other answer, no answer within `--timeout`, or no connection.
//!
//! The container image's HEALTHCHECK runs it (the image has no curl), and so can any script
//! that waits for a process to come up.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::cluster::args::parse_duration;
use super::cluster::tls_args::ClientTlsArgs;

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// gRPC address of the process to ask (a router, a prefill or a decode worker).
    #[arg(
        long,
        env = "DUET_HEALTH_TARGET",
        default_value = "http://127.0.0.1:50051"
    )]
    pub target: String,
    /// Service to ask about (empty: the process as a whole; e.g. `duet.v1.Generation`).
    #[arg(long, default_value = "")]
    pub service: String,
    /// How long to wait for the connection and the answer together.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

pub fn health(a: HealthArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let ask = async {
            let channel = a
                .tls
                .endpoint(&a.target)?
                .connect()
                .await
                .with_context(|| format!("connecting to {}", a.target))?;
            let reply = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: a.service.clone(),
                })
                .await
                .with_context(|| format!("health check of {}", a.target))?;
            anyhow::Ok(reply.into_inner().status())
        };
        let status = tokio::time::timeout(a.timeout, ask)
            .await
            .with_context(|| format!("{}: no answer within {:?}", a.target, a.timeout))??;
        match status {
            ServingStatus::Serving => {
                println!("SERVING");
                Ok(())
            }
            other => anyhow::bail!("{}: {}", a.target, other.as_str_name()),
        }
    })
}
