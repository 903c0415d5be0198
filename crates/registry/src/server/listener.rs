//! The network side: binding, TLS, HTTP/1.1 + HTTP/2 connections, slow-client limits and
//! graceful shutdown.
//!
//! hyper-util's auto builder serves HTTP/1.1 with keep-alive and HTTP/2 (h2c prior
//! knowledge on plain TCP, ALPN `h2` over TLS) on one port. The first request's headers
//! (TLS handshake included) must arrive within the header read timeout of accept, later
//! ones within it too; an idle connection is closed after the idle timeout
//! ([`super::conn_guard`]); a semaphore bounds open connections and a per-address cap
//! keeps one client from taking them all. On shutdown the listener closes, every connection is asked to finish its
//! in-flight requests, and stragglers are dropped after a drain period.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_rustls::TlsAcceptor;

use super::config::{Config, GcConfig, Limits, TlsConfig};
use super::conn_guard::{self, Activity, ActivityIo, ClientSlots, InFlight};
use super::metrics::Metrics;
use super::{AppState, router};
use crate::auth::Authenticator;
use crate::cache::PullThrough;
use crate::storage::{self, StorageConfig};

/// How long in-flight requests get to finish after a shutdown signal.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("binding {addr}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("opening storage")]
    Storage(#[from] storage::StorageError),
    #[error("auth configuration")]
    Auth(#[from] crate::auth::AuthError),
    #[error("pull-through cache")]
    Upstream(#[from] crate::cache::CacheError),
    #[error("TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    app: Router,
    state: AppState,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    gc: GcConfig,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.listener.local_addr().ok())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// Builds the request-handling state a config describes (storage, auth, upstream).
pub async fn build_state(config: &Config, metrics: Metrics) -> Result<AppState, ServeError> {
    let storage = storage::open(&config.storage).await?;
    let auth = Arc::new(Authenticator::new(&config.auth)?.with_tls(config.tls.is_some()));
    let upstream = match &config.upstream {
        Some(up) => {
            let up = match &config.storage {
                StorageConfig::Filesystem { root } => up.clone().with_default_cache_dir(root),
                _ => up.clone(),
            };
            Some(Arc::new(PullThrough::new(&up, metrics.clone()).await?))
        }
        None => None,
    };
    Ok(AppState::new(
        storage,
        auth,
        upstream,
        metrics,
        config.limits.clone(),
        &config.memory_cache,
    ))
}

impl Server {
    /// Opens storage, builds the app and binds `config.addr` (port 0 picks a free port).
    pub async fn bind(config: &Config) -> Result<Server, ServeError> {
        let state = build_state(config, Metrics::new()).await?;
        Server::bind_with_state(config, state).await
    }

    /// Binds `config.addr` serving `state` (tests and embedders build their own state).
    pub async fn bind_with_state(config: &Config, state: AppState) -> Result<Server, ServeError> {
        let tls = match &config.tls {
            Some(t) => Some(tls_acceptor(t)?),
            None => None,
        };
        let listener = TcpListener::bind(config.addr)
            .await
            .map_err(|source| ServeError::Bind {
                addr: config.addr,
                source,
            })?;
        Ok(Server {
            listener,
            app: router(state.clone()),
            state,
            tls,
            limits: config.limits.clone(),
            gc: config.gc.clone(),
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> Result<SocketAddr, ServeError> {
        Ok(self.listener.local_addr()?)
    }

    /// Whether connections use TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The request-handling state (for background tasks such as garbage collection).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` completes, then drains in-flight requests.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
        let Server {
            listener,
            app,
            state,
            tls,
            limits,
            gc,
        } = self;
        let collector = gc
            .interval
            .map(|every| tokio::spawn(collect_periodically(state, gc.clone(), every)));
        let builder = Arc::new(http_builder(&limits));
        let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        let client_slots = ClientSlots::new(limits.max_connections_per_client);
        let (stop_tx, stop_rx) = watch::channel(false);
        // Every connection task holds a sender; when all are gone, draining is done.
        let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                _ = &mut shutdown => break,
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let (stream, peer) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(err) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(%err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = client_slots.acquire(peer.ip()) else {
                // Closing at once (no response) costs the least; the client may retry
                // once one of its other connections ends.
                tracing::debug!(%peer, "connection refused: too many from this client");
                drop(stream);
                continue;
            };
            let builder = builder.clone();
            let app = app.clone();
            let tls = tls.clone();
            let stop = stop_rx.clone();
            let alive = alive_tx.clone();
            let timeouts = ConnTimeouts {
                first_request: limits.header_read_timeout,
                idle: limits.idle_timeout,
            };
            tokio::spawn(async move {
                serve_connection(stream, peer, builder, app, tls, stop, timeouts).await;
                drop(slot);
                drop(permit);
                drop(alive);
            });
        }
        drop(listener);
        if let Some(c) = collector {
            c.abort();
        }
        let _ = stop_tx.send(true);
        drop(alive_tx);
        if tokio::time::timeout(DRAIN_TIMEOUT, alive_rx.recv())
            .await
            .is_err()
        {
            tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}; closing them");
        }
        Ok(())
    }
}

/// Background garbage collection every `every` while serving.
async fn collect_periodically(state: AppState, gc: GcConfig, every: Duration) {
    let opts = gc.options(false);
    loop {
        tokio::time::sleep(every).await;
        match storage::gc::collect(&**state.storage(), &opts).await {
            Ok(report) => {
                state.clear_caches();
                tracing::info!(
                    manifests = report.manifests_deleted.len(),
                    blob_links = report.blob_links_removed,
                    blobs = report.blobs_deleted,
                    bytes = report.bytes_freed,
                    uploads = report.uploads_removed,
                    problems = report.problems.len(),
                    "garbage collection finished"
                );
                for p in &report.problems {
                    tracing::warn!(problem = %p, "garbage collection");
                }
            }
            Err(err) => tracing::warn!(%err, "garbage collection failed"),
        }
    }
}

fn http_builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(512)
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// The watchdog's limits for one connection.
#[derive(Debug, Clone, Copy)]
struct ConnTimeouts {
    first_request: Duration,
    idle: Duration,
}

type ConnService = TowerToHyperService<InFlight<Router>>;

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    builder: Arc<auto::Builder<TokioExecutor>>,
    app: Router,
    tls: Option<TlsAcceptor>,
    stop: watch::Receiver<bool>,
    timeouts: ConnTimeouts,
) {
    if let Err(err) = stream.set_nodelay(true) {
        tracing::debug!(%err, %peer, "set_nodelay");
    }
    let activity = Activity::new();
    let service = TowerToHyperService::new(InFlight::new(app, Arc::clone(&activity), peer.ip()));
    let watchdog = conn_guard::watch(Arc::clone(&activity), timeouts.first_request, timeouts.idle);
    match tls {
        None => {
            let io = ActivityIo::new(TokioIo::new(stream), activity);
            drive(builder.serve_connection(io, service), stop, watchdog, peer).await
        }
        Some(acceptor) => {
            let tls_stream =
                match tokio::time::timeout(timeouts.first_request, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(err)) => {
                        tracing::debug!(%err, %peer, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let io = ActivityIo::new(TokioIo::new(tls_stream), activity);
            drive(builder.serve_connection(io, service), stop, watchdog, peer).await
        }
    }
}

/// Runs one connection, switching it to graceful shutdown when `stop` fires, and closing
/// it when its watchdog says it is silent, idle or stalled.
async fn drive<I>(
    conn: auto::Connection<'_, I, ConnService, TokioExecutor>,
    mut stop: watch::Receiver<bool>,
    watchdog: impl Future<Output = conn_guard::Expired>,
    peer: SocketAddr,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = async { drop(stop.wait_for(|s| *s).await) } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
        why = watchdog => {
            // Dropping the connection closes the socket; nothing is in flight (or the
            // client is not reading what is).
            tracing::debug!(%peer, ?why, "connection closed by its watchdog");
            return;
        }
    };
    if let Err(err) = result {
        tracing::debug!(%err, %peer, "connection ended with an error");
    }
}

fn tls_acceptor(cfg: &TlsConfig) -> Result<TlsAcceptor, ServeError> {
    let certs = read_certs(&cfg.cert)?;
    let key = read_key(&cfg.key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| ServeError::Tls(format!("certificate/key: {e}")))?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

fn read_certs(path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, ServeError> {
    let pem = std::fs::read(path)
        .map_err(|e| ServeError::Tls(format!("reading {}: {e}", path.display())))?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ServeError::Tls(format!("parsing {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(ServeError::Tls(format!(
            "no certificate in {}",
            path.display()
        )));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<rustls::pki_types::PrivateKeyDer<'static>, ServeError> {
    let pem = std::fs::read(path)
        .map_err(|e| ServeError::Tls(format!("reading {}: {e}", path.display())))?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| ServeError::Tls(format!("parsing {}: {e}", path.display())))?
        .ok_or_else(|| ServeError::Tls(format!("no private key in {}", path.display())))
}

/// Resolves when the process receives SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::warn!(%err, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(err) => {
                tracing::warn!(%err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Binds, prints where it listens, and serves until SIGINT/SIGTERM.
pub async fn serve(config: Config) -> Result<(), ServeError> {
    let server = Server::bind(&config).await?;
    let addr = server.local_addr()?;
    let scheme = if server.is_tls() { "https" } else { "http" };
    println!("ferry registry listening on {scheme}://{addr}");
    server.run(shutdown_signal()).await
}
