//! The two ends of a same-host link: [`ShmReceiver`] (socket, ring file, negotiation of the
//! payload mode and the send arena) and [`ShmSender`]. The SETUP / READY / OFFER / MODE /
//! ARENA exchange they run is described in the module docs of `shm`.

use super::*;

/// Accepts same-host connections on a unix socket (decode side).
#[derive(Debug)]
pub struct ShmReceiver {
    listener: UnixListener,
    path: PathBuf,
    cfg: TransferConfig,
    opts: ShmOptions,
}

impl ShmReceiver {
    /// Binds the doorbell socket at `path` (which must not exist). The path names a
    /// listening socket from the moment it exists (see the `files` module).
    pub fn bind(path: impl AsRef<Path>, cfg: TransferConfig, opts: ShmOptions) -> Result<Self> {
        opts.validate()?;
        let path = path.as_ref().to_path_buf();
        let listener = files::bind_atomically(&path)?;
        Ok(ShmReceiver {
            listener,
            path,
            cfg,
            opts,
        })
    }

    /// A decode worker's receiver: first removes what dead receivers left in `opts.dir`
    /// ([`remove_stale`]), then binds a fresh socket `duet-sock-<tag>-<random>.sock` there.
    pub async fn bind_in(tag: &str, cfg: TransferConfig, opts: ShmOptions) -> Result<Self> {
        remove_stale(&opts.dir).await;
        let path = files::socket_path(&opts.dir, tag);
        ShmReceiver::bind(path, cfg, opts)
    }

    /// The socket path senders connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for one connection (bounded by the idle timeout); [`ShmSetup::run`] then
    /// authenticates it and sets up its ring, so a slow peer never holds up the accept loop.
    pub async fn accept_stream(&self) -> Result<UnixStream> {
        let (sock, _) = bounded(
            self.cfg.timeouts.idle,
            "waiting for a connection",
            self.listener.accept(),
        )
        .await?;
        Ok(sock)
    }

    /// What [`ShmSetup::run`] needs, detached from the listener (for a spawned task).
    pub fn setup(&self) -> ShmSetup {
        ShmSetup {
            cfg: self.cfg.clone(),
            opts: self.opts.clone(),
        }
    }

    /// Accepts one connection, authenticates it and sets up its ring.
    pub async fn accept(&self) -> Result<ShmInbound> {
        let sock = self.accept_stream().await?;
        self.setup().run(sock).await
    }
}

/// The receiver's side of a connection's set-up: handshake, ring, mode negotiation.
#[derive(Debug, Clone)]
pub struct ShmSetup {
    cfg: TransferConfig,
    opts: ShmOptions,
}

impl ShmSetup {
    /// Authenticates the peer on `sock` and sets up its ring (and pull mode when possible).
    pub async fn run(self, mut sock: UnixStream) -> Result<ShmInbound> {
        let t = self.cfg.timeouts;
        let key =
            handshake::server(&mut sock, &self.cfg.layout, &self.cfg.secret, t.handshake).await?;
        let (mut map, name) = ShmMapping::create(&self.opts.dir, self.opts.ring_len()?)?;
        if !self.opts.pull {
            // Ring for sure: back it before the sender can write a slot.
            map.reserve()?;
        }
        let mut setup = [0u8; SETUP_LEN];
        setup[0..4].copy_from_slice(&self.opts.slots.to_le_bytes());
        setup[8..16].copy_from_slice(&(self.opts.slot_bytes as u64).to_le_bytes());
        setup[16] = name.len() as u8;
        setup[17..17 + name.len()].copy_from_slice(name.as_bytes());
        setup[SETUP_PULL_AT] = u8::from(self.opts.pull);
        bounded(t.handshake, "sending shm setup", sock.write_all(&setup)).await?;
        let r = negotiate(&mut sock, t.handshake, self.opts.pull, &map).await;
        map.unlink();
        let (mode, pid, arena) = r?;
        let mut io = ShmTransport::new(sock, t, map, &self.opts, mode, pid);
        io.arena = arena;
        Ok(ShmInbound {
            core: ReceiverCore::new(
                io,
                self.cfg.layout,
                FrameAuth::new(&key),
                self.cfg.integrity.on(),
            ),
        })
    }
}

/// Receiver: reads READY and, when both sides offered pull, probes the sender's memory and
/// answers MODE; in pull mode, takes the sender's send arena when it offered one. Returns
/// the mode, the sender's pid and the arena's view. A ring that will be used is backed
/// with memory ([`ShmMapping::reserve`]) before MODE lets the sender write it (a sender that
/// declined pull may already be writing: only a full directory makes that matter).
async fn negotiate(
    sock: &mut UnixStream,
    t: Duration,
    offered: bool,
    map: &ShmMapping,
) -> Result<(ShmMode, i32, Option<memfd::ArenaView>)> {
    let mut ready = [0u8; READY_LEN];
    bounded(t, "waiting for shm ready", sock.read_exact(&mut ready)).await?;
    if ready[0] != 0 {
        return Err(Error::BackendUnavailable {
            backend: "shm",
            reason: "the sender could not map the shared ring".into(),
        });
    }
    if !(offered && ready[1] == 1) {
        if offered {
            map.reserve()?;
        }
        return Ok((ShmMode::Ring, 0, None));
    }
    let mut offer = [0u8; pull::OFFER_LEN];
    bounded(t, "reading the pull offer", sock.read_exact(&mut offer)).await?;
    let pid = sock.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
    let ok = pid > 0 && pull::probe(pid, &offer);
    if !ok {
        map.reserve()?;
    }
    // Only a sender that offered its arena (so knows this byte) is asked for it.
    let take_arena = ok && ready[READY_ARENA_AT] == 1;
    let mut mode = [0u8; pull::MODE_LEN];
    mode[0] = u8::from(ok);
    mode[1] = u8::from(take_arena);
    bounded(t, "sending the shm mode", sock.write_all(&mode)).await?;
    if !ok {
        return Ok((ShmMode::Ring, 0, None));
    }
    let arena = if take_arena {
        receive_arena(sock, t).await?
    } else {
        None
    };
    Ok((ShmMode::Pull, pid, arena))
}

/// Receiver: reads ARENA and maps the memfd that came with it. An unusable arena (no fd,
/// size not sealed, wrong size, refused mapping) is logged and left: every PULL is then
/// served with `process_vm_readv`, which needs nothing from the arena.
async fn receive_arena(sock: &mut UnixStream, t: Duration) -> Result<Option<memfd::ArenaView>> {
    let mut body = [0u8; ARENA_LEN];
    let fd = bounded(
        t,
        "reading the send arena",
        memfd::recv_with_fd(sock, &mut body),
    )
    .await?;
    let span = pull::decode_span(&body)
        .and_then(|(base, len)| Some((usize::try_from(base).ok()?, usize::try_from(len).ok()?)));
    let view = match (fd, span) {
        (Some(fd), Some((base, len))) => memfd::ArenaView::open(fd, base, len),
        _ => Err(Error::malformed(
            "shm arena",
            "no fd or an address beyond this host",
        )),
    };
    Ok(view
        .inspect_err(|e| tracing::warn!(error = %e, "peer's send arena unusable, pulling with process_vm_readv"))
        .ok())
}

impl Drop for ShmReceiver {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// An authenticated same-host inbound connection.
#[derive(Debug)]
pub struct ShmInbound {
    core: ReceiverCore<ShmTransport>,
}

impl ShmInbound {
    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }

    /// How this connection moves layer payload.
    pub fn mode(&self) -> ShmMode {
        self.core.transport().mode
    }

    /// The peer for logs: `shm pid N` in pull mode (the sender's process), else `shm`.
    pub fn peer(&self) -> String {
        match self.core.transport().peer_pid {
            0 => "shm".to_string(),
            pid => format!("shm pid {pid}"),
        }
    }

    /// The sender's send arena is mapped here: PULLs inside it are copied with a memcpy.
    pub fn arena_mapped(&self) -> bool {
        self.core.transport().arena.is_some()
    }

    /// Layer PULLs this connection has served, from the sender's arena (every region
    /// inside it) or with `process_vm_readv`.
    pub fn pulls(&self) -> ShmPulls {
        self.core.transport().pull_counts
    }
}

via_core!(receiver ShmInbound);

/// Same-host outbound connection (prefill side).
#[derive(Debug)]
pub struct ShmSender {
    core: SenderCore<ShmTransport>,
}

impl ShmSender {
    /// Connects to the receiver's socket, authenticates and maps its ring (found in `dir`).
    pub async fn connect(path: impl AsRef<Path>, cfg: &TransferConfig, dir: &Path) -> Result<Self> {
        Self::connect_with_arena(path, cfg, dir, None).await
    }

    /// [`connect`](Self::connect), offering `arena` to the receiver in pull mode: layers
    /// whose regions all lie in it are then copied by the receiver with a plain memcpy from
    /// its own mapping (see the `arena` module).
    pub async fn connect_with_arena(
        path: impl AsRef<Path>,
        cfg: &TransferConfig,
        dir: &Path,
        arena: Option<&Arc<SendArena>>,
    ) -> Result<Self> {
        let t = cfg.timeouts;
        let mut sock = bounded(t.connect, "connecting", UnixStream::connect(path.as_ref())).await?;
        let key = handshake::client(&mut sock, &cfg.layout, &cfg.secret, t.handshake).await?;
        let mut setup = [0u8; SETUP_LEN];
        bounded(
            t.handshake,
            "reading shm setup",
            sock.read_exact(&mut setup),
        )
        .await?;
        let opened = parse_setup(&setup, dir).and_then(|(opts, name)| {
            let map = ShmMapping::open(dir, &name, opts.ring_len()?)?;
            Ok((opts, map))
        });
        let pull = opened.as_ref().is_ok_and(|(opts, _)| opts.pull);
        let offer_arena = pull && arena.is_some();
        let mut status = [0u8; READY_LEN];
        status[0] = u8::from(opened.is_err());
        status[1] = u8::from(pull);
        status[READY_ARENA_AT] = u8::from(offer_arena);
        bounded(t.handshake, "sending shm ready", sock.write_all(&status)).await?;
        let (opts, map) = opened?;
        let mut mode = ShmMode::Ring;
        let mut arena_shared = false;
        if pull {
            // The nonce must stay alive until the receiver has probed it (MODE).
            let probe = pull::Probe::new();
            let offer = probe.offer();
            bounded(
                t.handshake,
                "sending the pull offer",
                sock.write_all(&offer),
            )
            .await?;
            let mut m = [0u8; pull::MODE_LEN];
            bounded(t.handshake, "reading the shm mode", sock.read_exact(&mut m)).await?;
            drop(probe);
            (mode, arena_shared) = match m {
                [0, 0, 0, 0, 0, 0, 0, 0] => (ShmMode::Ring, false),
                [1, 0, 0, 0, 0, 0, 0, 0] => (ShmMode::Pull, false),
                [1, 1, 0, 0, 0, 0, 0, 0] if offer_arena => (ShmMode::Pull, true),
                _ => return Err(Error::malformed("shm mode", "unknown mode")),
            };
            if let (true, Some(arena)) = (arena_shared, arena) {
                let fd = arena.memfd();
                let body = pull::encode_span(fd.base(), fd.len());
                bounded(
                    t.handshake,
                    "sending the send arena",
                    memfd::send_with_fd(&mut sock, &body, fd.fd()),
                )
                .await?;
            }
        }
        let mut io = ShmTransport::new(sock, t, map, &opts, mode, 0);
        io.arena_shared = arena_shared;
        Ok(ShmSender {
            core: SenderCore::new(io, cfg.layout, sender_auth(cfg.integrity, &key)).configured(cfg),
        })
    }

    /// The (shared) layout.
    pub fn layout(&self) -> &KvLayout {
        self.core.layout()
    }

    /// How this connection moves layer payload.
    pub fn mode(&self) -> ShmMode {
        self.core.transport().mode
    }

    /// The receiver has this sender's send arena mapped (pull mode with an arena).
    pub fn arena_shared(&self) -> bool {
        self.core.transport().arena_shared
    }
}

fn parse_setup(b: &[u8; SETUP_LEN], dir: &Path) -> Result<(ShmOptions, String)> {
    let slots = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut sb = [0u8; 8];
    sb.copy_from_slice(&b[8..16]);
    let slot_bytes = usize::try_from(u64::from_le_bytes(sb))
        .map_err(|_| Error::malformed("shm setup", "slot size"))?;
    let name_len = usize::from(b[16]);
    if b[4..8].iter().any(|&x| x != 0) || 17 + name_len > SETUP_PULL_AT || b[SETUP_PULL_AT] > 1 {
        return Err(Error::malformed(
            "shm setup",
            "reserved bytes or name length",
        ));
    }
    let name = std::str::from_utf8(&b[17..17 + name_len])
        .map_err(|_| Error::malformed("shm setup", "name is not UTF-8"))?
        .to_string();
    let opts = ShmOptions {
        dir: dir.to_path_buf(),
        slots,
        slot_bytes,
        pull: b[SETUP_PULL_AT] == 1,
    };
    opts.validate()
        .map_err(|_| Error::malformed("shm setup", "slot count or size out of range"))?;
    Ok((opts, name))
}

via_core!(sender ShmSender);
