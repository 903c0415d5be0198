//! [`Daemon::run`]: one process per node that opens the chunk store once and serves the
//! control API, the metrics endpoint and (when enabled) containerd's snapshotter with
//! lazy layers, until told to stop. It wires the parts together; it must not implement
//! any of them (they live in the sibling modules and crates).

use std::future::Future;
use std::sync::Arc;

use ferry_snapshotter::Snapshotter;
use ferry_store::{Store, StoreOptions};
use tokio::sync::watch;

use crate::config::DaemonConfig;
use crate::control::{self, DaemonInfo};
use crate::error::{Error, Result};
use crate::fdstore::FdHolderClient;
use crate::metrics;
use crate::mounts::{MountBackend, MountManager};
use crate::remote::LazyLayers;

/// See the module doc.
#[derive(Debug)]
pub struct Daemon;

/// Resolves on SIGTERM or SIGINT (poll it inside a tokio runtime). If the handlers
/// cannot be installed it never resolves (the daemon then stops only when killed).
pub async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

/// Connects to the fd holder, starting it (`config.holder_program` with `daemon
/// --fd-holder SOCKET`, in its own session so it outlives this process) when none
/// listens. `None` (logged) when there is none: mounts then work but do not survive a
/// restart.
fn connect_fd_holder(config: &DaemonConfig) -> Option<FdHolderClient> {
    let socket = config.holder_socket();
    let spawn = || -> std::io::Result<()> {
        let Some(program) = &config.holder_program else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no fd holder listens and no program to start one",
            ));
        };
        let mut cmd = std::process::Command::new(program);
        cmd.arg("daemon")
            .arg("--fd-holder")
            .arg(&socket)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        ferry_fs::fuse::detach_on_spawn(&mut cmd);
        let mut child = cmd.spawn()?;
        tracing::info!(pid = child.id(), socket = %socket.display(), "started the fd holder");
        // Reaped if it exits while this daemon runs (it does once it holds nothing).
        std::thread::Builder::new()
            .name("ferry-holder-reaper".into())
            .spawn(move || {
                let _ = child.wait();
            })?;
        Ok(())
    };
    match FdHolderClient::connect_or_spawn(&socket, spawn) {
        Ok(client) => Some(client),
        Err(e) => {
            tracing::warn!(error = %e, socket = %socket.display(), "no fd holder: running containers will lose uncached reads when this daemon restarts");
            None
        }
    }
}

/// The peer server, its listener, and what lazy layers need to use peers.
struct PeerParts {
    listener: tokio::net::TcpListener,
    /// TLS for the server's connections; `None`: plain HTTP.
    tls: Option<crate::p2p::tls::PeerTls>,
    server: Arc<crate::p2p::server::PeerServer>,
    wiring: crate::mounts::PeerWiring,
    /// The DNS membership, resolved once already, to refresh while serving.
    dns: Option<crate::p2p::dns::DnsMembership>,
    /// Every membership source's part, handed to the fetcher on each change.
    sources: Arc<crate::p2p::gossip::MemberSources>,
    /// The gossip node and its socket, bound already.
    gossip: Option<(
        crate::p2p::gossip::GossipNode,
        tokio::net::UdpSocket,
        Arc<dyn crate::p2p::gossip::Clock>,
    )>,
}

/// The name peers dial this daemon by, when it is known before DNS says: the host of
/// an explicit `self_name`, or of `listen` unless it is a wildcard.
fn own_tls_name(p: &crate::config::P2pSection) -> Option<String> {
    let name = match &p.self_name {
        Some(n) => n.clone(),
        None if p.listen.ip().is_unspecified() => return None,
        None => p.listen.to_string(),
    };
    let (host, _) = name.rsplit_once(':')?;
    Some(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
    )
}

/// Most layer blobs the peer server remembers (each a span table: ~48 bytes per 256 KiB
/// span of the layer).
const PEER_CATALOG_ENTRIES: usize = 4096;

async fn p2p_parts(
    config: &DaemonConfig,
    store: &Arc<Store>,
    client: &ferry_registry_client::Client,
) -> Result<PeerParts> {
    use crate::p2p::{auth, fetch, server};
    let p = &config.p2p;
    let token_file = p
        .token_file
        .as_ref()
        .ok_or_else(|| Error::Config("p2p.token_file is required".into()))?;
    let token =
        auth::ClusterToken::load(token_file).map_err(|e| Error::Config(format!("p2p: {e}")))?;
    let gossip_key = token.gossip_key();
    let stats = Arc::new(crate::p2p::P2pStats::default());
    let catalog = Arc::new(crate::p2p::BlobCatalog::new(PEER_CATALOG_ENTRIES));
    let tls = match p.tls_files() {
        Some(files) => Some(
            crate::p2p::tls::PeerTls::load(&files, own_tls_name(p).as_deref())
                .map_err(|e| Error::Config(e.to_string()))?,
        ),
        None => None,
    };
    if let Some(t) = &tls {
        let _ = stats.tls.set(t.counters());
    }
    let transport = fetch::HttpPeers::new(
        token.clone(),
        p.peer_timeout,
        tls.as_ref().map(|t| t.client.clone()),
    )
    .map_err(|e| Error::Config(format!("p2p: HTTP client: {e}")))?;
    let fetcher = fetch::PeerFetcher::new(
        fetch::FetcherConfig {
            self_name: p.self_name(),
            peers: p.peers.clone(),
            roots: p.roots,
            fan_out: p.fan_out,
            fallbacks: p.fallbacks,
            piece_size: p.piece_size,
            peer_timeout: p.peer_timeout,
            penalty: p.penalty,
        },
        Arc::new(transport),
        Arc::new(client.clone()),
        stats.clone(),
        tokio::runtime::Handle::current(),
    )
    .map_err(|e| Error::Config(format!("p2p: {e}")))?;
    let gate = auth::PullGate::new(
        Arc::new(auth::RegistryPullRights {
            client: client.clone(),
        }),
        p.pull_check_ttl,
    );
    let server = server::PeerServer::new(
        catalog.clone(),
        store.clone(),
        token,
        gate,
        server::ServerLimits {
            max_concurrent: p.max_concurrent,
            request_timeout: p.request_timeout,
            max_range: p.max_range,
            // The caller's deadline covers the parent and `fallbacks` more: a quarter
            // of it leaves room for two such waits and an answer.
            arrival_wait: p.peer_timeout / 4,
        },
        stats,
    );
    let listener = tokio::net::TcpListener::bind(p.listen)
        .await
        .map_err(|e| Error::io(format!("p2p: listening on {}", p.listen), e))?;
    let fetcher = Arc::new(fetcher);
    let sources = Arc::new(crate::p2p::gossip::MemberSources::new(
        fetcher.clone(),
        &p.peers,
    ));
    let dns = match &p.peers_dns {
        Some(target) => {
            use crate::p2p::dns;
            let mut members = dns::DnsMembership::new(
                Arc::new(dns::SystemResolver),
                target,
                p.self_name.clone(),
                p.listen,
                dns::local_addresses(),
            )
            .map_err(|e| Error::Config(e.to_string()))?;
            // Once before serving, so the first reads already have peers; a failure is
            // a warning (DNS may come up after the daemon), retried on the refresh.
            if members.refresh().await == dns::Refresh::Changed {
                dns::apply(&sources, &members);
            }
            Some(members)
        }
        None => None,
    };
    let gossip = if p.gossip {
        use crate::p2p::gossip;
        let advertise = p
            .gossip_advertise()
            .ok_or_else(|| Error::Config("p2p.gossip_advertise is required".into()))?;
        let socket = tokio::net::UdpSocket::bind(p.gossip_listen)
            .await
            .map_err(|e| Error::io(format!("p2p: gossip on {}", p.gossip_listen), e))?;
        let clock: Arc<dyn gossip::Clock> = Arc::new(gossip::SystemClock::default());
        let me = gossip::GossipId {
            // The name the scheduling ranks this daemon by (DNS's, when it named it).
            peer: fetcher.me().0,
            gossip: advertise,
            // A restart comes back as a newer generation of the same member.
            generation: clock.unix_ms(),
        };
        if !gossip::wire::valid_peer_name(&me.peer) {
            return Err(Error::Config(format!(
                "p2p.gossip: this daemon's name {:?} is not host:port",
                me.peer
            )));
        }
        let node = gossip::GossipNode::new(
            gossip::GossipConfig {
                me,
                probe_period: p.gossip_probe_period,
                probe_rtt: p.gossip_probe_period / 3,
                suspect_after: p.gossip_suspect_after,
                gossip_interval: p.gossip_interval,
                max_members: p.gossip_max_members,
                max_skew: p.gossip_max_skew,
            },
            gossip_key,
            clock.clone(),
            rand_seed(),
            fetcher.stats().clone(),
        );
        tracing::info!(listen = %p.gossip_listen, %advertise, seeds = ?p.gossip_seeds, "p2p gossip");
        Some((node, socket, clock))
    } else {
        None
    };
    Ok(PeerParts {
        listener,
        tls,
        server: Arc::new(server),
        wiring: crate::mounts::PeerWiring { catalog, fetcher },
        dns,
        sources,
        gossip,
    })
}

/// A seed for the gossip's randomness, different on every start.
fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl Daemon {
    /// Runs the daemon until `shutdown` resolves (e.g. [`stop_signal`]), calling `ready`
    /// once every endpoint listens. Blocks; builds its own async runtime, so call it
    /// from a plain thread (`main`). On the way out: stops serving, unmounts the mounts
    /// made through the control API, leaves the snapshotter's lazy layers for the next
    /// start to restore (see the crate doc), flushes the store.
    pub fn run(
        config: DaemonConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
        ready: impl FnOnce(&DaemonInfo),
    ) -> Result<()> {
        config.validate()?;
        crate::heap::tune_allocator();
        let inflated_cache = usize::try_from(config.fuse.inflated_cache).unwrap_or(usize::MAX);
        if !ferry_fs::configure_inflated_spans(inflated_cache) {
            tracing::warn!("the inflated-span cache was in use before the daemon set its size");
        }
        // Give the cache's memory back once a burst of reads is over.
        ferry_fs::release_idle_inflated_spans();
        // And the heap's free pages, once the burst is over.
        crate::heap::spawn_heap_trimmer();
        let store_path = config.store_path();
        let control_socket = config.control_socket();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("ferry-daemon")
            .build()
            .map_err(|e| Error::io("starting the async runtime", e))?;
        // Bind the control socket first: a second daemon is refused before it touches
        // the store or the snapshotter.
        let control_listener = runtime.block_on(control::bind(&control_socket))?;
        let store = Store::open_with(
            &store_path,
            StoreOptions {
                max_bytes: Some(config.store.max_bytes),
                seed: config.store.seed.clone(),
                ..StoreOptions::default()
            },
        )
        .map_err(|e| match e {
            ferry_store::Error::Seed { .. } => Error::Config(format!("[store] seed: {e}")),
            e => Error::Config(format!(
                "cannot open the chunk store at {} ({e}); another ferry process (a daemon or \
                 `ferry mount --foreground`) may be using it",
                store_path.display()
            )),
        })?;
        let store = Arc::new(store);
        let mut manager = MountManager::new(store.clone(), config.clone())?;
        let peers = if config.p2p.enabled {
            let parts = runtime.block_on(p2p_parts(&config, &store, manager.client()))?;
            manager = manager.with_p2p(parts.wiring.clone());
            Some(parts)
        } else {
            None
        };
        if config.fuse.keep_connections
            && let Some(holder) = connect_fd_holder(&config)
        {
            manager = manager.with_fd_holder(holder);
        }
        // Before the snapshotter restores its layers: those still kept are served again
        // (running containers go on reading) rather than detached and remounted.
        let resumed = manager.resume_kept();
        if !resumed.resumed.is_empty() || !resumed.dropped.is_empty() || !resumed.failed.is_empty()
        {
            tracing::info!(
                resumed = resumed.resumed.len(),
                released = resumed.dropped.len(),
                failed = resumed.failed.len(),
                "kept FUSE connections from the previous daemon"
            );
        }
        // Mounts whose connection ended with a previous daemon and its holder (kill -9
        // of both) answer ENOTCONN forever and block new mounts there: detached here,
        // and reported by `ferry status`.
        let dead_mounts = crate::mounts::clean_dead_mounts();
        let manager = Arc::new(manager);
        let backend: Arc<dyn MountBackend> = manager.clone();

        // Opening the snapshotter restores its lazy layers: blocking mounts, so here on
        // this plain thread rather than inside the runtime.
        let snapshotter = if config.snapshotter.enabled {
            let lazy = Arc::new(LazyLayers::new(backend.clone()));
            let snap = Snapshotter::open(&config.snapshotter.root, lazy).map_err(|e| {
                Error::Snapshotter(format!(
                    "opening {}: {e}",
                    config.snapshotter.root.display()
                ))
            })?;
            let listener = runtime
                .block_on(ferry_snapshotter::server::bind(&config.snapshotter.socket))
                .map_err(|e| {
                    Error::Snapshotter(format!(
                        "listening on {}: {e}",
                        config.snapshotter.socket.display()
                    ))
                })?;
            Some((Arc::new(snap), listener))
        } else {
            None
        };
        let cri = if config.cri.enabled {
            let listener = runtime.block_on(crate::cri::bind(&config.cri.socket))?;
            let proxy = Arc::new(crate::cri::CriProxy::new(
                config.cri.runtime_socket.clone(),
                manager.client().pull_secrets().clone(),
            ));
            tracing::info!(socket = %config.cri.socket.display(), runtime = %config.cri.runtime_socket.display(), "CRI image-service proxy");
            Some((proxy, listener))
        } else {
            None
        };
        let metrics_listener = match config.metrics.addr {
            Some(addr) => Some(
                runtime
                    .block_on(tokio::net::TcpListener::bind(addr))
                    .map_err(|e| Error::io(format!("metrics: listening on {addr}"), e))?,
            ),
            None => None,
        };
        let info = DaemonInfo {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            control_socket: control_socket.clone(),
            metrics_addr: metrics_listener.as_ref().and_then(|l| l.local_addr().ok()),
            snapshotter_socket: snapshotter
                .as_ref()
                .map(|_| config.snapshotter.socket.clone()),
            dead_mounts,
            p2p_addr: peers.as_ref().and_then(|p| p.listener.local_addr().ok()),
            cri_socket: cri.as_ref().map(|_| config.cri.socket.clone()),
        };
        tracing::info!(
            control = %control_socket.display(),
            store = %store_path.display(),
            metrics = ?info.metrics_addr,
            snapshotter = ?info.snapshotter_socket,
            peers = ?info.p2p_addr,
            "daemon serving"
        );
        ready(&info);

        let served = runtime.block_on(async move {
            let (stop_tx, stop_rx) = watch::channel(false);
            let stop_tx = Arc::new(stop_tx);
            let stopped = |mut rx: watch::Receiver<bool>| async move {
                let _ = rx.wait_for(|v| *v).await;
            };
            {
                let tx = stop_tx.clone();
                tokio::spawn(async move {
                    shutdown.await;
                    tx.send_replace(true);
                });
            }
            let mut tasks: Vec<(&'static str, tokio::task::JoinHandle<Result<()>>)> = Vec::new();
            let cri_proxy = cri.as_ref().map(|(proxy, _)| proxy.clone());
            let router = control::router(backend.clone(), info.clone(), cri_proxy.clone());
            let socket = control_socket.clone();
            let rx = stop_rx.clone();
            tasks.push((
                "control API",
                tokio::spawn(async move {
                    control::serve(control_listener, router, &socket, stopped(rx)).await
                }),
            ));
            if let Some(listener) = metrics_listener {
                let rx = stop_rx.clone();
                let backend = backend.clone();
                tasks.push((
                    "metrics",
                    tokio::spawn(async move {
                        metrics::serve(listener, backend, cri_proxy, stopped(rx)).await
                    }),
                ));
            }
            if let Some(parts) = peers {
                if let Some(t) = parts.tls.clone() {
                    let rx = stop_rx.clone();
                    tasks.push((
                        "peer TLS reload",
                        tokio::spawn(async move {
                            let every = crate::p2p::tls::RELOAD_EVERY;
                            crate::p2p::tls::watch(t, every, stopped(rx)).await;
                            Ok(())
                        }),
                    ));
                }
                let rx = stop_rx.clone();
                let router = crate::p2p::server::router(parts.server);
                tasks.push((
                    "peers",
                    tokio::spawn(async move {
                        use crate::p2p::{server, tls};
                        match parts.tls {
                            Some(t) => {
                                let listener = tls::TlsListener::new(
                                    parts.listener,
                                    &t,
                                    tls::HANDSHAKE_TIMEOUT,
                                )
                                .map_err(|e| Error::io("p2p: TLS listener", e))?;
                                server::serve(listener, router, stopped(rx)).await
                            }
                            None => server::serve(parts.listener, router, stopped(rx)).await,
                        }
                    }),
                ));
                if let Some(dns) = parts.dns {
                    let rx = stop_rx.clone();
                    let sources = parts.sources.clone();
                    let every = config.p2p.peers_dns_refresh;
                    tasks.push((
                        "peer DNS",
                        tokio::spawn(async move {
                            crate::p2p::dns::run(dns, sources, every, stopped(rx)).await;
                            Ok(())
                        }),
                    ));
                }
                if let Some((node, socket, clock)) = parts.gossip {
                    use crate::p2p::{dns, gossip};
                    let rx = stop_rx.clone();
                    let driver = gossip::Driver {
                        socket: Arc::new(socket),
                        seeds: config.p2p.gossip_seeds.clone(),
                        resolver: Arc::new(dns::SystemResolver),
                        clock,
                        sources: parts.sources.clone(),
                        announce_every: std::time::Duration::from_secs(2),
                    };
                    tasks.push((
                        "peer gossip",
                        tokio::spawn(async move {
                            gossip::run(node, driver, stopped(rx)).await;
                            Ok(())
                        }),
                    ));
                }
            }
            if let Some((snap, listener)) = snapshotter {
                let rx = stop_rx.clone();
                let socket = config.snapshotter.socket.clone();
                tasks.push((
                    "snapshotter",
                    tokio::spawn(async move {
                        ferry_snapshotter::server::serve(snap, listener, &socket, stopped(rx))
                            .await
                            .map_err(|e| Error::Snapshotter(e.to_string()))
                    }),
                ));
            }
            if let Some((proxy, listener)) = cri {
                let rx = stop_rx.clone();
                let socket = config.cri.socket.clone();
                tasks.push((
                    "CRI proxy",
                    tokio::spawn(async move {
                        crate::cri::serve(listener, proxy, &socket, stopped(rx)).await
                    }),
                ));
            }
            // One endpoint failing stops the others: a half-working daemon is worse.
            let mut first_error = None;
            for (name, task) in tasks {
                let result = match task.await {
                    Ok(r) => r,
                    Err(e) => Err(Error::Control(format!("{name} task: {e}"))),
                };
                if let Err(e) = result {
                    tracing::error!(endpoint = name, error = %e, "endpoint failed; stopping");
                    stop_tx.send_replace(true);
                    first_error.get_or_insert(e);
                }
            }
            first_error.map_or(Ok(()), Err)
        });
        // Outside the runtime: unmounting blocks on FUSE threads.
        manager.shutdown();
        if let Err(e) = store.flush() {
            tracing::warn!(error = %e, "flushing the chunk store");
        }
        drop(runtime);
        tracing::info!("daemon stopped");
        served
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::control::ControlClient;

    /// The daemon run on a thread of its own until the sender is used; returns once it
    /// is ready, with what it reported.
    fn start(
        config: DaemonConfig,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<Result<()>>,
        DaemonInfo,
    ) {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let daemon = std::thread::spawn(move || {
            Daemon::run(
                config,
                async {
                    let _ = stop_rx.await;
                },
                |info| ready_tx.send(info.clone()).unwrap(),
            )
        });
        (stop_tx, daemon, ready_rx.recv().unwrap())
    }

    #[test]
    fn runs_serves_status_and_metrics_and_stops_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/daemon.sock");
        let mut config = DaemonConfig {
            store_path_flag: Some(dir.path().join("store")),
            ..DaemonConfig::default()
        };
        config.control.socket = Some(socket.clone());
        config.snapshotter.enabled = false;
        config.metrics.addr = Some("127.0.0.1:0".parse().unwrap());
        let (stop_tx, daemon, info) = start(config);
        assert_eq!(info.control_socket, socket);
        assert_eq!(info.snapshotter_socket, None);
        let metrics_addr = info.metrics_addr.unwrap();

        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = ControlClient::new(&socket);
        let status = rt.block_on(client.status()).unwrap();
        assert_eq!(status.daemon.pid, std::process::id());
        assert!(status.mounts.is_empty());
        let store = status.store.unwrap();
        assert_eq!(store.path, dir.path().join("store"));
        assert_eq!(store.max_bytes, ferry_store::DEFAULT_MAX_BYTES);
        // Bad requests are refused before anything is mounted.
        let err = rt
            .block_on(client.mount(&crate::MountRequest {
                image: "reg.local/app:v1".into(),
                mountpoint: "relative/dir".into(),
                layer: None,
            }))
            .unwrap_err();
        assert!(matches!(err, Error::Remote { status: 400, .. }), "{err}");

        // The metrics endpoint answers with the store's series.
        let text = rt
            .block_on(async {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut s = tokio::net::TcpStream::connect(metrics_addr).await?;
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .await?;
                let mut out = String::new();
                s.read_to_string(&mut out).await?;
                Ok::<_, std::io::Error>(out)
            })
            .unwrap();
        assert!(text.contains("ferry_store_max_bytes 10737418240"), "{text}");
        assert!(text.contains("ferry_mounts 0"), "{text}");

        stop_tx.send(()).unwrap();
        daemon.join().unwrap().unwrap();
        assert!(!socket.exists(), "the control socket is removed");
    }

    #[test]
    fn the_peer_server_speaks_mtls_when_configured_and_a_readable_key_stops_the_start() {
        use crate::p2p::tls_tests::{ca, member, set_mode};
        let dir = tempfile::tempdir().unwrap();
        let cluster = ca("cluster");
        let ours = member(dir.path(), "a", &cluster);
        let peer = member(dir.path(), "b", &cluster);
        let token = "cluster-secret-0123456789";
        std::fs::write(dir.path().join("token"), token).unwrap();
        let mut config = DaemonConfig {
            store_path_flag: Some(dir.path().join("store")),
            ..DaemonConfig::default()
        };
        config.control.socket = Some(dir.path().join("run/daemon.sock"));
        config.snapshotter.enabled = false;
        config.fuse.keep_connections = false;
        config.p2p.enabled = true;
        config.p2p.listen = "127.0.0.1:0".parse().unwrap();
        config.p2p.token_file = Some(dir.path().join("token"));
        config.p2p.tls_cert = Some(ours.cert.clone());
        config.p2p.tls_key = Some(ours.key.clone());
        config.p2p.tls_ca = Some(ours.ca.clone());
        config.p2p.tls_client_auth = true;

        // A key others can read: the daemon does not start, and says why.
        set_mode(&ours.key, 0o644);
        let err = Daemon::run(config.clone(), async {}, |_| {}).unwrap_err();
        assert!(
            err.to_string().contains("p2p.tls_key") && err.to_string().contains("chmod 600"),
            "{err}"
        );
        set_mode(&ours.key, 0o600);

        let (stop_tx, daemon, info) = start(config);
        let addr = info.p2p_addr.unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let tls = crate::p2p::tls::PeerTls::load(&peer, None).unwrap().client;
        let (with_cert, plain) = rt.block_on(async {
            let https = reqwest::Client::builder()
                .use_preconfigured_tls(tls)
                .build()
                .unwrap();
            let ping = |c: reqwest::Client, url: String| async move {
                c.get(url)
                    .header("authorization", format!("Bearer {token}"))
                    .timeout(std::time::Duration::from_secs(10))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            };
            (
                ping(https, format!("https://{addr}/v2/")).await,
                ping(reqwest::Client::new(), format!("http://{addr}/v2/")).await,
            )
        });
        assert_eq!(with_cert.unwrap(), 200);
        assert!(plain.is_err(), "plain HTTP answered: {plain:?}");
        stop_tx.send(()).unwrap();
        daemon.join().unwrap().unwrap();
    }
}
