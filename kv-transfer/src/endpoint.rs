//! Endpoints as workers advertise them, pooled outbound connections, and the inbound
//! accept loop, for whichever backend a pair of workers uses.
//!
//! - [`Endpoint`]: `(transport, address)`, the form a decode worker publishes. An `shm`
//!   address is `<host identity>:<socket path>` (see [`host_identity`]); the ring files live
//!   in the socket's directory.
//! - [`LocalHub`]: same-process receivers by name (the all-in-one `duet up`); connecting
//!   creates a [`local::pair`] and hands the receiving half to the named listener.
//! - [`Connector`]: the prefill side's choice among a decode worker's endpoints (made by
//!   [`select_backend`] from what the offer reveals: a listener of this very process, an
//!   `shm` socket on this host, rdma when both sides enable it, tcp) and its pool of idle
//!   senders per endpoint. A sender goes back
//!   to the pool only after a transfer finished cleanly; any error drops it, so a pooled
//!   connection is never in an unknown protocol state.
//! - [`serve_inbound`]: the decode side's accept loop over TCP, shm, the local hub and (feature
//!   `rdma`) UCX's control connections; each
//!   authenticated connection is handed to a callback (which receives transfers until the
//!   peer closes or stays idle). The loop ends when its cancellation token fires.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use std::path::Path;
use std::time::{Duration, Instant};

use crate::backend::local;
#[cfg(feature = "rdma")]
use crate::backend::rdma::{RdmaOptions, RdmaReceiver, RdmaSender};
#[cfg(unix)]
use crate::backend::shm::{host_identity, SendArena, ShmReceiver, ShmSender};
use crate::backend::tcp::{TcpInbound, TcpReceiver, TcpSender};
use crate::backend::{
    select_backend, AnyReceiver, AnySender, BackendCaps, BackendKind, EndpointInfo,
};
use crate::config::TransferConfig;
use crate::error::{Error, Result};

/// Where a decode worker receives KV.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Backend.
    pub kind: BackendKind,
    /// `host:port` for tcp and rdma (its control connection), a hub name for local,
    /// `<host identity>:<socket path>` for shm.
    pub address: String,
}

impl Endpoint {
    /// Parses the advertised form (`transport` is `tcp`, `shm`, `local`, and `rdma` in a build
    /// with that feature).
    pub fn parse(transport: &str, address: &str) -> Result<Endpoint> {
        let kind = match transport {
            "tcp" => BackendKind::Tcp,
            "local" => BackendKind::Local,
            "shm" if cfg!(unix) => BackendKind::Shm,
            "rdma" if cfg!(feature = "rdma") => BackendKind::Rdma,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "KV transport `{other}` is not served by this build (tcp, shm, local{})",
                    if cfg!(feature = "rdma") { ", rdma" } else { "" }
                )))
            }
        };
        if address.is_empty() {
            return Err(Error::InvalidArgument("empty KV endpoint address".into()));
        }
        let e = Endpoint {
            kind,
            address: address.to_string(),
        };
        if kind == BackendKind::Shm && e.shm_parts().is_none() {
            return Err(Error::InvalidArgument(format!(
                "shm KV endpoint `{address}` is not `<host identity>:<absolute socket path>`"
            )));
        }
        Ok(e)
    }

    /// The `shm` endpoint of a socket at `path` on the host `host` ([`host_identity`]),
    /// checked as a prefill worker will parse it (`path` absolute, `host` not empty).
    pub fn shm(host: &str, path: &Path) -> Result<Endpoint> {
        Endpoint::parse("shm", &format!("{host}:{}", path.display()))
    }

    /// Host identity and socket path of an `shm` endpoint.
    pub fn shm_parts(&self) -> Option<(&str, &Path)> {
        if self.kind != BackendKind::Shm {
            return None;
        }
        let (host, path) = self.address.split_once(':')?;
        let path = Path::new(path);
        (!host.is_empty() && path.is_absolute() && path.parent().is_some()).then_some((host, path))
    }
}

/// Named same-process KV listeners.
#[derive(Debug, Clone, Default)]
pub struct LocalHub {
    listeners: Arc<Mutex<HashMap<String, mpsc::Sender<AnyReceiver>>>>,
}

/// Pending local connections a listener may hold before connecting blocks.
const LOCAL_BACKLOG: usize = 64;

impl LocalHub {
    /// Registers a listener under `name` (replacing an older one).
    pub fn listen(&self, name: &str) -> mpsc::Receiver<AnyReceiver> {
        let (tx, rx) = mpsc::channel(LOCAL_BACKLOG);
        if let Ok(mut m) = self.listeners.lock() {
            m.insert(name.to_string(), tx);
        }
        rx
    }

    /// Whether a listener named `name` exists in this process.
    pub fn has(&self, name: &str) -> bool {
        self.listeners
            .lock()
            .map(|m| m.get(name).is_some_and(|tx| !tx.is_closed()))
            .unwrap_or(false)
    }

    /// Opens a same-process connection to `name`.
    pub async fn connect(&self, name: &str, cfg: &TransferConfig) -> Result<AnySender> {
        let tx = self
            .listeners
            .lock()
            .ok()
            .and_then(|m| m.get(name).cloned())
            .ok_or_else(|| Error::BackendUnavailable {
                backend: "local",
                reason: format!("no local KV listener named `{name}`"),
            })?;
        let (s, r) = local::pair(cfg.layout, cfg.layout, cfg.timeouts)?;
        match tokio::time::timeout(cfg.timeouts.connect, tx.send(AnyReceiver::Local(r))).await {
            Ok(Ok(())) => Ok(AnySender::Local(s)),
            Ok(Err(_)) => Err(Error::PeerClosed {
                during: "connecting to a local listener",
            }),
            Err(_) => Err(Error::Timeout {
                during: "connecting to a local listener",
                after: cfg.timeouts.connect,
            }),
        }
    }
}

/// Idle connections kept per endpoint.
const MAX_IDLE_PER_ENDPOINT: usize = 8;
/// How long an shm endpoint that could not be set up is passed over (then tried again).
pub const SHM_REFUSED_FOR: Duration = Duration::from_secs(60);

/// Where one transfer goes: the chosen endpoint, and the tcp endpoint to fall back on when a
/// same-host shm connection cannot be set up (another user's socket or ring file, a chroot:
/// an equal host identity does not prove access).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The endpoint [`Connector::choose`] picked.
    pub endpoint: Endpoint,
    /// Tried when connecting to `endpoint` fails; only ever set for an shm `endpoint`.
    pub fallback: Option<Endpoint>,
}

/// Outbound connections, pooled per endpoint.
///
/// Invariant: an idle sender is dropped once it has been idle longer than the idle timeout
/// (its receiver closes it by then anyway), so endpoints that vanished (a restarted decode
/// worker binds a new socket name) hold no descriptors or rings for long.
#[derive(Debug)]
pub struct Connector {
    cfg: TransferConfig,
    hub: Option<LocalHub>,
    /// This host's identity when `shm` may be used.
    shm_host: Option<String>,
    idle: Mutex<HashMap<Endpoint, Vec<(Instant, AnySender)>>>,
    /// shm endpoints whose set-up failed, and when.
    refused: Mutex<HashMap<Endpoint, Instant>>,
    /// UCX options when `rdma` may be used.
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaOptions>,
    /// Offered to same-host receivers by shm senders (see `backend::shm::SendArena`).
    #[cfg(unix)]
    send_arena: Option<Arc<SendArena>>,
}

/// Stands for "some other host" when an offer names none of ours.
const ELSEWHERE: &str = "elsewhere";

impl Connector {
    /// `hub`: the process's local listeners, if KV may stay in-process. `shm` stays off
    /// until [`Connector::with_shm`].
    pub fn new(cfg: TransferConfig, hub: Option<LocalHub>) -> Connector {
        Connector {
            cfg,
            hub,
            shm_host: None,
            idle: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            #[cfg(feature = "rdma")]
            rdma: None,
            #[cfg(unix)]
            send_arena: None,
        }
    }

    /// Offers `arena` to the receivers of shm connections: layers whose buffers lie in it
    /// are copied there with a memcpy instead of `process_vm_readv`.
    #[cfg(unix)]
    pub fn with_send_arena(mut self, arena: Option<Arc<SendArena>>) -> Connector {
        self.send_arena = arena;
        self
    }

    /// The send arena shm connections share with their receivers, if any (a prefill
    /// worker's KV pool lives in it).
    #[cfg(unix)]
    pub fn send_arena(&self) -> Option<&Arc<SendArena>> {
        self.send_arena.as_ref()
    }

    /// Allows `rdma` (UCX with `opts`) towards decode workers that offer it; preferred over
    /// tcp, not over a same-host shm or same-process endpoint.
    #[cfg(feature = "rdma")]
    pub fn with_rdma(mut self, opts: Option<RdmaOptions>) -> Connector {
        self.rdma = opts;
        self
    }

    fn rdma_enabled(&self) -> bool {
        #[cfg(feature = "rdma")]
        return self.rdma.is_some();
        #[cfg(not(feature = "rdma"))]
        false
    }

    /// Allows `shm` towards decode workers on this host (when its identity can be read).
    pub fn with_shm(mut self, enabled: bool) -> Connector {
        #[cfg(unix)]
        {
            self.shm_host = if enabled { host_identity() } else { None };
        }
        #[cfg(not(unix))]
        let _ = enabled;
        self
    }

    /// The configuration connections are made with.
    pub fn config(&self) -> &TransferConfig {
        &self.cfg
    }

    /// Picks the endpoint to use among those a decode worker advertises, by
    /// [`select_backend`]: a local listener of this very process, else its `shm` socket when
    /// it is on this host, else rdma when both sides have it, else tcp.
    pub fn choose(&self, offered: &[Endpoint]) -> Result<Endpoint> {
        let local = self.hub.as_ref().and_then(|hub| {
            offered
                .iter()
                .find(|e| e.kind == BackendKind::Local && hub.has(&e.address))
        });
        let shm_endpoint = offered
            .iter()
            .find(|e| e.shm_parts().is_some() && !self.recently_refused(e));
        let shm = shm_endpoint.and_then(|e| e.shm_parts()).map(|(h, _)| h);
        let me = self.shm_host.as_deref().unwrap_or("this host");
        let rdma = self.rdma_enabled();
        let info = |host: &str, process_id: u64, tcp: bool, shm: bool, rdma: bool| EndpointInfo {
            host_id: host.to_string(),
            process_id,
            tcp,
            shm,
            gpu: false,
            nccl: false,
            rdma,
        };
        let src = info(me, 1, true, self.shm_host.is_some(), rdma);
        let dst = info(
            match (local, shm) {
                (Some(_), _) => me,
                (None, Some(h)) => h,
                (None, None) => ELSEWHERE,
            },
            if local.is_some() { 1 } else { 2 },
            offered.iter().any(|e| e.kind == BackendKind::Tcp),
            shm.is_some(),
            offered.iter().any(|e| e.kind == BackendKind::Rdma),
        );
        // What this connector can open (nccl is not pooled here).
        let caps = BackendCaps {
            local: local.is_some(),
            shm: cfg!(unix),
            nccl: false,
            rdma,
            tcp: true,
        };
        let kind = select_backend(&src, &dst, &caps).map_err(|e| {
            Error::InvalidArgument(format!("no usable KV endpoint among {offered:?}: {e}"))
        })?;
        let chosen = match kind {
            BackendKind::Local => local,
            BackendKind::Shm => shm_endpoint,
            k => offered.iter().find(|e| e.kind == k),
        };
        chosen.cloned().ok_or_else(|| {
            Error::InvalidArgument(format!("no {kind} KV endpoint among {offered:?}"))
        })
    }

    /// [`Connector::choose`], with tcp as the fallback of an shm choice.
    pub fn route(&self, offered: &[Endpoint]) -> Result<Route> {
        let endpoint = self.choose(offered)?;
        let fallback = (endpoint.kind == BackendKind::Shm)
            .then(|| offered.iter().find(|e| e.kind == BackendKind::Tcp).cloned())
            .flatten();
        Ok(Route { endpoint, fallback })
    }

    /// A sender along `route`: [`Connector::checkout`] of its endpoint, else, when that shm
    /// endpoint cannot be set up (or already could not), of its fallback (the shm endpoint
    /// is then passed over for [`SHM_REFUSED_FOR`]). Returns the endpoint actually used (for
    /// checkin).
    pub async fn connect(&self, route: &Route, fresh: bool) -> Result<(Endpoint, AnySender)> {
        if let Some(fb) = &route.fallback {
            // A retry on the same route (the pooled sender was stale) skips what just failed.
            if self.recently_refused(&route.endpoint) {
                return Ok((fb.clone(), self.checkout(fb, fresh).await?));
            }
        }
        match self.checkout(&route.endpoint, fresh).await {
            Ok(s) => Ok((route.endpoint.clone(), s)),
            Err(e) => match &route.fallback {
                Some(fb) => {
                    tracing::warn!(
                        endpoint = %route.endpoint.address,
                        error = %e,
                        "shm KV endpoint unusable from here; falling back to tcp"
                    );
                    if let Ok(mut r) = self.refused.lock() {
                        r.insert(route.endpoint.clone(), Instant::now());
                    }
                    let s = self.checkout(fb, fresh).await?;
                    Ok((fb.clone(), s))
                }
                _ => Err(e),
            },
        }
    }

    fn recently_refused(&self, ep: &Endpoint) -> bool {
        self.refused.lock().is_ok_and(|mut r| {
            r.retain(|_, at| at.elapsed() < SHM_REFUSED_FOR);
            r.contains_key(ep)
        })
    }

    /// Drops senders idle past the idle timeout, and endpoints left without any.
    fn sweep(&self, m: &mut HashMap<Endpoint, Vec<(Instant, AnySender)>>) {
        let limit = self.cfg.timeouts.idle;
        m.retain(|_, v| {
            v.retain(|(at, _)| at.elapsed() < limit);
            !v.is_empty()
        });
    }

    /// Idle senders held, over every endpoint.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().map_or(0, |mut m| {
            self.sweep(&mut m);
            m.values().map(Vec::len).sum()
        })
    }

    /// An idle pooled sender for `ep`, or a new connection. `fresh` skips the pool (retry
    /// after a pooled connection turned out to be closed by the peer).
    pub async fn checkout(&self, ep: &Endpoint, fresh: bool) -> Result<AnySender> {
        if !fresh {
            let pooled = self.idle.lock().ok().and_then(|mut m| {
                self.sweep(&mut m);
                m.get_mut(ep).and_then(Vec::pop)
            });
            if let Some((_, s)) = pooled {
                return Ok(s);
            }
        }
        match ep.kind {
            BackendKind::Tcp => Ok(AnySender::Tcp(
                TcpSender::connect(ep.address.as_str(), &self.cfg).await?,
            )),
            #[cfg(unix)]
            BackendKind::Shm => {
                let (_, path) = ep.shm_parts().ok_or_else(|| {
                    Error::InvalidArgument(format!("bad shm KV endpoint `{}`", ep.address))
                })?;
                // The receiver creates its ring files beside its socket.
                let dir = path.parent().unwrap_or(Path::new("/"));
                Ok(AnySender::from(
                    ShmSender::connect_with_arena(path, &self.cfg, dir, self.send_arena.as_ref())
                        .await?,
                ))
            }
            #[cfg(feature = "rdma")]
            BackendKind::Rdma => match &self.rdma {
                Some(opts) => Ok(AnySender::Rdma(
                    RdmaSender::connect(ep.address.as_str(), &self.cfg, opts).await?,
                )),
                None => Err(Error::InvalidArgument(
                    "rdma KV endpoint chosen with rdma disabled".into(),
                )),
            },
            BackendKind::Local => match &self.hub {
                Some(hub) => hub.connect(&ep.address, &self.cfg).await,
                None => Err(Error::InvalidArgument(
                    "local KV endpoint outside the all-in-one process".into(),
                )),
            },
            other => Err(Error::InvalidArgument(format!(
                "KV backend {} is not pooled by the connector",
                other.as_str()
            ))),
        }
    }

    /// Returns a sender whose last transfer finished cleanly.
    pub fn checkin(&self, ep: &Endpoint, s: AnySender) {
        if let Ok(mut m) = self.idle.lock() {
            self.sweep(&mut m);
            let v = m.entry(ep.clone()).or_default();
            if v.len() < MAX_IDLE_PER_ENDPOINT {
                v.push((Instant::now(), s));
            }
        }
    }
}

/// The listeners a decode worker receives KV on.
#[derive(Debug, Default)]
pub struct Inbound {
    /// TCP (across hosts).
    pub tcp: Option<TcpReceiver>,
    /// Shared memory (same host).
    #[cfg(unix)]
    pub shm: Option<ShmReceiver>,
    /// Same process.
    pub local: Option<mpsc::Receiver<AnyReceiver>>,
    /// RDMA through UCX (its control connections).
    #[cfg(feature = "rdma")]
    pub rdma: Option<RdmaReceiver>,
}

/// Accepts inbound KV connections until `cancel` fires, handing each authenticated one to
/// `on_receiver` (which typically spawns a task receiving transfers on it). Handshakes run in
/// their own tasks, so a slow or silent peer never holds up the accept loop.
pub async fn serve_inbound(
    inbound: Inbound,
    cancel: CancellationToken,
    on_receiver: impl Fn(AnyReceiver) + Send + Sync + 'static,
) {
    let on_receiver = Arc::new(on_receiver);
    let Inbound {
        tcp,
        #[cfg(unix)]
        shm,
        mut local,
        #[cfg(feature = "rdma")]
        rdma,
    } = inbound;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            accepted = async {
                match &tcp {
                    Some(t) => t.accept_stream().await.map(|s| (s, t.config().clone())),
                    None => std::future::pending().await,
                }
            } => {
                match accepted {
                    Ok(((stream, peer), cfg)) => spawn_handshake(&on_receiver, "tcp", async move {
                        TcpInbound::handshake(stream, peer, &cfg).await.map(AnyReceiver::Tcp)
                    }),
                    Err(e) => accept_failed(e).await,
                }
            }
            accepted = async {
                #[cfg(unix)]
                if let Some(s) = &shm {
                    return s.accept_stream().await.map(|sock| (sock, s.setup()));
                }
                std::future::pending().await
            } => {
                #[cfg(unix)]
                match accepted {
                    Ok((sock, setup)) => spawn_handshake(&on_receiver, "shm", async move {
                        setup.run(sock).await.map(AnyReceiver::from)
                    }),
                    Err(e) => accept_failed(e).await,
                }
                #[cfg(not(unix))]
                let _: Result<()> = accepted;
            }
            accepted = async {
                #[cfg(feature = "rdma")]
                if let Some(r) = &rdma {
                    return r.accept_stream().await.map(|(sock, _)| (sock, r.setup()));
                }
                std::future::pending().await
            } => {
                #[cfg(feature = "rdma")]
                match accepted {
                    Ok((sock, setup)) => spawn_handshake(&on_receiver, "rdma", async move {
                        setup.run(sock).await.map(AnyReceiver::Rdma)
                    }),
                    Err(e) => accept_failed(e).await,
                }
                #[cfg(not(feature = "rdma"))]
                let _: Result<()> = accepted;
            }
            r = async {
                match local.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            } => match r {
                Some(r) => on_receiver(r),
                None => local = None,
            },
        }
    }
}

/// Runs one accepted connection's handshake in a task of its own (a slow or silent peer never
/// holds up the accept loop) and hands the authenticated receiver to `on_receiver`.
fn spawn_handshake<C>(
    on_receiver: &Arc<C>,
    transport: &'static str,
    handshake: impl std::future::Future<Output = Result<AnyReceiver>> + Send + 'static,
) where
    C: Fn(AnyReceiver) + Send + Sync + 'static,
{
    let cb = on_receiver.clone();
    tokio::spawn(async move {
        match handshake.await {
            Ok(rx) => cb(rx),
            Err(e) => handshake_failed(transport, &e),
        }
    });
}

/// A peer that connects and leaves without a word (a liveness probe, a worker checking for
/// stale sockets) is routine; any other failed handshake is worth a warning.
fn handshake_failed(transport: &'static str, e: &Error) {
    if matches!(e, Error::PeerClosed { .. }) {
        tracing::debug!(transport, error = %e, "KV peer left before the handshake");
    } else {
        tracing::warn!(transport, error = %e, "KV handshake refused");
    }
}

/// An accept that timed out is routine (the idle bound); anything else is logged and
/// followed by a short pause, so a persistent error (out of descriptors) cannot spin.
async fn accept_failed(e: Error) {
    if !matches!(e, Error::Timeout { .. }) {
        tracing::warn!(error = %e, "accepting a KV connection");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
