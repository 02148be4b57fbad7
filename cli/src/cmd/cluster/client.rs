//! `duet generate` (stream a completion from a router) and `duet status` (workers and
//! their capacity, from etcd or from a router).

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use duet_discovery::{workers_prefix, WorkerRecord};
use duet_proto::v1 as pb;
use duet_proto::v1::generation_client::GenerationClient;

use super::args::{parse_duration, RegistryArgs};
use super::tls_args::ClientTlsArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Router address.
    #[arg(long, env = "DUET_ROUTER", default_value = "http://127.0.0.1:50051")]
    pub router: String,
    /// Prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as one user chat message (rendered with the model's template).
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub stop: Vec<String>,
    /// Batch priority (preempted first, admitted last).
    #[arg(long)]
    pub batch: bool,
    /// `full`, or `window=W,sinks=S` (local attention with sinks); unset: the router's.
    #[arg(long)]
    pub attention: Option<duet_engine::AttentionPolicy>,
    /// Request deadline (gRPC deadline).
    #[arg(long, value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// Print one JSON object (ids, text, finish reason, usage, timings) instead of text.
    #[arg(long)]
    pub json: bool,
    /// API key for a router started with `--api-key` (sent as `authorization: Bearer`).
    #[arg(long, env = "DUET_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

/// Adds `authorization: Bearer <key>` to `req` when a key is given.
fn with_api_key<T>(req: &mut tonic::Request<T>, key: Option<&str>) -> anyhow::Result<()> {
    if let Some(k) = key {
        let v = format!("Bearer {k}")
            .parse()
            .map_err(|_| anyhow::anyhow!("--api-key: not a valid header value"))?;
        req.metadata_mut().insert("authorization", v);
    }
    Ok(())
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let channel = a
            .tls
            .endpoint(&a.router)?
            .connect()
            .await
            .with_context(|| format!("connecting to {}", a.router))?;
        let mut client = GenerationClient::new(channel);
        let prompt = if a.chat {
            pb::generate_request::Prompt::Chat(pb::ChatMessages {
                messages: vec![pb::ChatMessage {
                    role: "user".into(),
                    content: a.prompt.clone(),
                }],
            })
        } else {
            pb::generate_request::Prompt::Text(a.prompt.clone())
        };
        let mut req = tonic::Request::new(pb::GenerateRequest {
            prompt: Some(prompt),
            sampling: Some(pb::SamplingParams {
                temperature: a.temperature,
                top_k: a.top_k,
                top_p: a.top_p,
                min_p: 0.0,
                repetition_penalty: 1.0,
                seed: a.seed,
            }),
            max_tokens: a.max_tokens,
            stop: a.stop.clone(),
            priority: if a.batch {
                pb::Priority::Batch as i32
            } else {
                pb::Priority::Interactive as i32
            },
            attention: a.attention.map(duet_serving::convert::attention_to_proto),
            ..Default::default()
        });
        if let Some(t) = a.timeout {
            req.set_timeout(t);
        }
        with_api_key(&mut req, a.api_key.as_deref())?;
        let mut stream = client.generate(req).await.map_err(status_err)?.into_inner();
        let mut ids = Vec::new();
        let mut text = String::new();
        let stdout = std::io::stdout();
        while let Some(msg) = stream.message().await.map_err(status_err)? {
            match msg.event {
                Some(pb::generate_response::Event::Token(t)) => {
                    ids.push(t.id);
                    text.push_str(&t.text);
                    if !a.json {
                        let mut o = stdout.lock();
                        write!(o, "{}", t.text)?;
                        o.flush()?;
                    }
                }
                Some(pb::generate_response::Event::Final(f)) => {
                    text.push_str(&f.text);
                    let finish = pb::FinishReason::try_from(f.finish_reason)
                        .map(|r| r.as_str_name().trim_start_matches("FINISH_REASON_").to_lowercase())
                        .unwrap_or_default();
                    if a.json {
                        let u = f.usage.unwrap_or_default();
                        let t = f.timings.unwrap_or_default();
                        let v = serde_json::json!({
                            "request_id": msg.request_id,
                            "ids": ids,
                            "text": text,
                            "finish_reason": finish,
                            "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "truncated_tokens": u.truncated_tokens},
                            "timings": {
                                "queue_seconds": t.queue_seconds,
                                "prefill_seconds": t.prefill_seconds,
                                "kv_transfer_seconds": t.kv_transfer_seconds,
                                "kv_stream_seconds": t.kv_stream_seconds,
                                "kv_bytes": t.kv_bytes,
                                "time_to_first_token_seconds": t.time_to_first_token_seconds,
                                "total_seconds": t.total_seconds,
                                "placement": pb::PrefillPlacement::try_from(t.placement).map(|p| p.as_str_name().trim_start_matches("PREFILL_PLACEMENT_").to_lowercase()).unwrap_or_default(),
                                "prefill_worker": t.prefill_worker,
                                "decode_worker": t.decode_worker,
                                "routing_reason": t.routing_reason,
                            },
                        });
                        println!("{v}");
                    } else {
                        println!("{}", f.text);
                        eprintln!(
                            "[{finish}; {} prompt + {} completion tokens; ttft {:.3}s]",
                            f.usage.map_or(0, |u| u.prompt_tokens),
                            f.usage.map_or(0, |u| u.completion_tokens),
                            f.timings.map_or(0.0, |t| t.time_to_first_token_seconds)
                        );
                    }
                    return Ok(());
                }
                None => {}
            }
        }
        anyhow::bail!("the stream ended without a final message")
    })
}

fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Ask a router for the workers it routes to (instead of reading etcd).
    #[arg(long, env = "DUET_ROUTER", conflicts_with = "etcd")]
    pub router: Option<String>,
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// API key for a router started with `--api-key`.
    #[arg(long, env = "DUET_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

/// Prints one JSON line per worker (its registry record), from etcd or from a router.
pub fn status(a: StatusArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        if let Some(url) = &a.router {
            let channel = a
                .tls
                .endpoint(url)?
                .connect()
                .await
                .with_context(|| format!("connecting to {url}"))?;
            let mut c = duet_proto::v1::cluster_client::ClusterClient::new(channel);
            let mut req = tonic::Request::new(pb::ListWorkersRequest {});
            with_api_key(&mut req, a.api_key.as_deref())?;
            let r = c.list_workers(req).await.map_err(status_err)?.into_inner();
            if r.stale {
                eprintln!(
                    "duet status: the router cannot reach its registry; this is its last view"
                );
            }
            for rec in r.records_json {
                println!("{rec}");
            }
            return Ok(());
        }
        let registry = a.registry.connect().await?;
        let listing = registry
            .list(&workers_prefix(&a.registry.cluster))
            .await
            .context("listing workers")?;
        for kv in listing.kvs {
            match WorkerRecord::from_json(&kv.value) {
                Ok(r) => println!("{}", serde_json::to_string(&r)?),
                Err(e) => eprintln!("{}: unreadable record: {e}", kv.key),
            }
        }
        Ok(())
    })
}
