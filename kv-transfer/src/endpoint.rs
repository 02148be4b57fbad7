//! Endpoints as workers advertise them, pooled outbound connections, and the inbound
//! accept loop, for whichever backend a pair of workers uses.
//!
//! - [`Endpoint`]: `(transport, address)`, the form a decode worker publishes.
//! - [`LocalHub`]: same-process receivers by name (the all-in-one `duet up`); connecting
//!   creates a [`local::pair`] and hands the receiving half to the named listener.
//! - [`Connector`]: the prefill side's pool of idle senders per endpoint. A sender goes back
//!   to the pool only after a transfer finished cleanly; any error drops it, so a pooled
//!   connection is never in an unknown protocol state.
//! - [`serve_inbound`]: the decode side's accept loop over TCP and the local hub; each
//!   authenticated connection is handed to a callback (which receives transfers until the
//!   peer closes or stays idle). The loop ends when its cancellation token fires.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::local;
use crate::backend::tcp::{TcpInbound, TcpReceiver, TcpSender};
use crate::backend::{AnyReceiver, AnySender, BackendKind};
use crate::config::TransferConfig;
use crate::error::{Error, Result};

/// Where a decode worker receives KV.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Backend.
    pub kind: BackendKind,
    /// `host:port` for tcp, a hub name for local.
    pub address: String,
}

impl Endpoint {
    /// Parses the advertised form (`transport` is `tcp`, `local`...).
    pub fn parse(transport: &str, address: &str) -> Result<Endpoint> {
        let kind = match transport {
            "tcp" => BackendKind::Tcp,
            "local" => BackendKind::Local,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "KV transport `{other}` is not served by this build (tcp, local)"
                )))
            }
        };
        if address.is_empty() {
            return Err(Error::InvalidArgument("empty KV endpoint address".into()));
        }
        Ok(Endpoint {
            kind,
            address: address.to_string(),
        })
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

/// Outbound connections, pooled per endpoint.
#[derive(Debug)]
pub struct Connector {
    cfg: TransferConfig,
    hub: Option<LocalHub>,
    idle: Mutex<HashMap<Endpoint, Vec<AnySender>>>,
}

impl Connector {
    /// `hub`: the process's local listeners, if KV may stay in-process.
    pub fn new(cfg: TransferConfig, hub: Option<LocalHub>) -> Connector {
        Connector {
            cfg,
            hub,
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// The configuration connections are made with.
    pub fn config(&self) -> &TransferConfig {
        &self.cfg
    }

    /// Picks the endpoint to use among those a decode worker advertises: a local listener
    /// of this very process first, then tcp.
    pub fn choose(&self, offered: &[Endpoint]) -> Result<Endpoint> {
        if let Some(hub) = &self.hub {
            if let Some(e) = offered
                .iter()
                .find(|e| e.kind == BackendKind::Local && hub.has(&e.address))
            {
                return Ok(e.clone());
            }
        }
        offered
            .iter()
            .find(|e| e.kind == BackendKind::Tcp)
            .cloned()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no usable KV endpoint among {offered:?} (this process reaches tcp{})",
                    if self.hub.is_some() { " and local" } else { "" }
                ))
            })
    }

    /// An idle pooled sender for `ep`, or a new connection. `fresh` skips the pool (retry
    /// after a pooled connection turned out to be closed by the peer).
    pub async fn checkout(&self, ep: &Endpoint, fresh: bool) -> Result<AnySender> {
        if !fresh {
            if let Some(s) = self
                .idle
                .lock()
                .ok()
                .and_then(|mut m| m.get_mut(ep).and_then(Vec::pop))
            {
                return Ok(s);
            }
        }
        match ep.kind {
            BackendKind::Tcp => Ok(AnySender::Tcp(
                TcpSender::connect(ep.address.as_str(), &self.cfg).await?,
            )),
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
            let v = m.entry(ep.clone()).or_default();
            if v.len() < MAX_IDLE_PER_ENDPOINT {
                v.push(s);
            }
        }
    }
}

/// Accepts inbound KV connections until `cancel` fires, handing each authenticated one to
/// `on_receiver` (which typically spawns a task receiving transfers on it).
pub async fn serve_inbound(
    tcp: Option<TcpReceiver>,
    mut local: Option<mpsc::Receiver<AnyReceiver>>,
    cancel: CancellationToken,
    on_receiver: impl Fn(AnyReceiver) + Send + Sync + 'static,
) {
    let on_receiver = Arc::new(on_receiver);
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
                    Ok(((stream, peer), cfg)) => {
                        let cb = on_receiver.clone();
                        tokio::spawn(async move {
                            match TcpInbound::handshake(stream, peer, &cfg).await {
                                Ok(inbound) => cb(AnyReceiver::Tcp(inbound)),
                                Err(e) => tracing::warn!(%peer, error = %e, "KV handshake refused"),
                            }
                        });
                    }
                    Err(Error::Timeout { .. }) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a KV connection");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
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
