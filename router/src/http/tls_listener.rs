//! The HTTP door's listener: plain TCP, or TLS (rustls) terminated here.
//!
//! TLS handshakes run in their own tasks (at most [`MAX_HANDSHAKES`] at once, each bounded by
//! [`HANDSHAKE_TIMEOUT`]), so a client that connects and stalls never holds up the next
//! one; only connections whose handshake completed reach the HTTP server. A failed handshake
//! (no TLS, untrusted client certificate) is logged at debug level and counted, never
//! answered.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use duet_serving::tls::HANDSHAKE_TIMEOUT;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

/// TLS handshakes in progress at once; more connections wait in the kernel's backlog.
pub const MAX_HANDSHAKES: usize = 256;

/// The door's listener.
pub enum DoorListener {
    Plain(TcpListener),
    Tls {
        local: SocketAddr,
        ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    },
}

/// The client's address, as the per-client limits see it.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

impl Connected<IncomingStream<'_, DoorListener>> for ClientAddr {
    fn connect_info(stream: IncomingStream<'_, DoorListener>) -> Self {
        ClientAddr(*stream.remote_addr())
    }
}

impl DoorListener {
    /// Plain HTTP on `listener`.
    pub fn plain(listener: TcpListener) -> DoorListener {
        DoorListener::Plain(listener)
    }

    /// HTTPS on `listener` with `config`; the accepting task stops with `shutdown`.
    pub fn tls(
        listener: TcpListener,
        config: Arc<tokio_rustls::rustls::ServerConfig>,
        shutdown: CancellationToken,
    ) -> std::io::Result<DoorListener> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(MAX_HANDSHAKES);
        tokio::spawn(accept_loop(
            listener,
            TlsAcceptor::from(config),
            tx,
            shutdown,
        ));
        Ok(DoorListener::Tls { local, ready })
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
    shutdown: CancellationToken,
) {
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            r = listener.accept(), if handshakes.len() < MAX_HANDSHAKES => match r {
                Ok((tcp, peer)) => {
                    let _ = tcp.set_nodelay(true);
                    let acceptor = acceptor.clone();
                    let ready = ready.clone();
                    handshakes.spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(tls)) => {
                                let _ = ready.send((tls, peer)).await;
                            }
                            Ok(Err(e)) => {
                                metrics::counter!(duet_telemetry::names::ROUTER_TLS_HANDSHAKE_FAILURES_TOTAL)
                                    .increment(1);
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            }
                            Err(_) => {
                                metrics::counter!(duet_telemetry::names::ROUTER_TLS_HANDSHAKE_FAILURES_TOTAL)
                                    .increment(1);
                                tracing::debug!(%peer, "TLS handshake timed out");
                            }
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off as axum does.
                    tracing::warn!(error = %e, "accepting an HTTPS connection");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
        }
    }
}

impl Listener for DoorListener {
    type Io = Either<TcpStream, TlsStream<TcpStream>>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self {
            DoorListener::Plain(l) => loop {
                match TcpListener::accept(l).await {
                    Ok((s, peer)) => {
                        let _ = s.set_nodelay(true);
                        return (Either::Left(s), peer);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting an HTTP connection");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            },
            DoorListener::Tls { ready, .. } => match ready.recv().await {
                Some((s, peer)) => (Either::Right(s), peer),
                // The accepting task stopped (shutdown): nothing more will come.
                None => std::future::pending().await,
            },
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            DoorListener::Plain(l) => l.local_addr(),
            DoorListener::Tls { local, .. } => Ok(*local),
        }
    }
}
