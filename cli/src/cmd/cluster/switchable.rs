//! `duet worker --role R`: a worker a planner may move between prefill and decode while it
//! serves.
//!
//! The process loads the model and binds its ports once, then serves one role at a time,
//! exactly as `duet prefill` or `duet decode` would (same crates, same flags), and follows
//! its role request in the registry (`/duet/<cluster>/roles/<id>`,
//! `duet_discovery::control`). When the request names the other role, the running role
//! stops the way SIGTERM stops a worker:
//! 1. its registry key goes first, so routers place no new work of the old role on it;
//! 2. its server drains in-flight calls for up to `--drain`; decode streams still running
//!    then are cut and the router resumes them on another decode worker by token replay
//!    (the same path as a worker that stops), prefill calls finish or fail over;
//! 3. its engine thread stops and drops its KV pool (no block outlives the role; the
//!    role's load and pool gauges read 0, as the engine sets them when it stops);
//!
//! then the other role starts on the same ports under the same id and registers under its
//! new role. Invariants: at most one role serves at a time; the ports stay bound
//! throughout (connections in between wait in the backlog); a role request present at
//! start wins over `--role`, so a planner's decision survives a restart.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use duet_discovery::{control, Registry, Role};
use duet_telemetry::names::*;
use tokio_util::sync::CancellationToken;

use super::processes::{DecodeKvArgs, PrefillKvArgs, WorkerProcessArgs};
use super::up::{DecodeArgs, PrefillArgs};

/// A role, as a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Prefill,
    Decode,
}

impl From<RoleArg> for Role {
    fn from(r: RoleArg) -> Role {
        match r {
            RoleArg::Prefill => Role::Prefill,
            RoleArg::Decode => Role::Decode,
        }
    }
}

#[derive(Args, Debug)]
pub struct WorkerCmd {
    /// The role served first, unless the registry already holds a role request for this
    /// worker's id (a planner's earlier decision).
    #[arg(long, env = "DUET_ROLE", value_enum)]
    pub role: RoleArg,
    #[command(flatten)]
    pub worker: WorkerProcessArgs,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub decode_kv: DecodeKvArgs,
    #[command(flatten)]
    pub prefill: PrefillArgs,
    #[command(flatten)]
    pub prefill_kv: PrefillKvArgs,
}

type Serving<'a> = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send + 'a>>;

pub fn worker(a: WorkerCmd) -> anyhow::Result<()> {
    a.decode.config()?;
    a.prefill.config()?;
    let id = a.worker.process.id("worker");
    let cluster = a.worker.process.registry.cluster.clone();
    a.worker
        .run(Some(&a.decode_kv), async |loaded, ports, shutdown| {
            let registry = loaded.registry.clone();
            let mut role = match control::role_request(registry.as_ref(), &cluster, &id).await? {
                Some(r) => {
                    tracing::info!(worker = %id, role = %r.role, "taking the requested role");
                    r.role
                }
                None => a.role.into(),
            };
            let mut requested = control::follow_role_request(
                registry.clone(),
                &cluster,
                &id,
                shutdown.child_token(),
            );
            let serve = |role: Role, stop: CancellationToken| -> Serving<'_> {
                match role {
                    Role::Decode => Box::pin(a.worker.serve_decode(
                        loaded,
                        ports,
                        (&a.decode, &a.decode_kv),
                        id.clone(),
                        true,
                        stop,
                    )),
                    Role::Prefill => Box::pin(a.worker.serve_prefill(
                        loaded,
                        ports,
                        (&a.prefill, &a.prefill_kv),
                        id.clone(),
                        true,
                        stop,
                    )),
                }
            };
            let mut following = true;
            loop {
                set_role_gauge(&id, role);
                let stop = shutdown.child_token();
                let mut serving = serve(role, stop.clone());
                let next = loop {
                    tokio::select! {
                        r = &mut serving => return r,
                        changed = requested.changed(), if following => {
                            if changed.is_err() {
                                following = false;
                                continue;
                            }
                            match *requested.borrow_and_update() {
                                Some(want) if want != role => break want,
                                _ => {}
                            }
                        }
                    }
                };
                println!("duet worker: {id}: switching from {role} to {next}");
                let t = Instant::now();
                stop.cancel();
                serving.await?;
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                metrics::counter!(
                    WORKER_ROLE_SWITCHES_TOTAL,
                    "from" => role.as_str(), "to" => next.as_str(), "worker" => id.clone()
                )
                .increment(1);
                tokio::spawn(time_the_switch(
                    registry.clone(),
                    duet_discovery::worker_key(&cluster, next, &id),
                    id.clone(),
                    t,
                    shutdown.clone(),
                ));
                role = next;
            }
        })
}

/// Records how long the switch begun at `started` took, once the new role's record `key`
/// is in the registry (given up after two minutes or at shutdown).
async fn time_the_switch(
    registry: Arc<dyn Registry>,
    key: String,
    id: String,
    started: Instant,
    stop: CancellationToken,
) {
    let give_up = started + Duration::from_secs(120);
    while Instant::now() < give_up && !stop.is_cancelled() {
        let listed = registry.list(&key).await;
        if listed.is_ok_and(|l| l.kvs.iter().any(|kv| kv.key == key)) {
            let secs = started.elapsed().as_secs_f64();
            metrics::histogram!(WORKER_ROLE_SWITCH_SECONDS, "worker" => id.clone()).record(secs);
            println!("duet worker: {id}: registered in its new role {secs:.2} s after the request");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn set_role_gauge(id: &str, role: Role) {
    for r in Role::ALL {
        metrics::gauge!(WORKER_ROLE, "role" => r.as_str(), "worker" => id.to_string())
            .set(if r == role { 1.0 } else { 0.0 });
    }
}
