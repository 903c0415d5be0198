//! The control API: HTTP/1.1 + JSON on a unix socket, for `ferry mount`, `ferry umount`
//! and `ferry status`. The server only translates requests into [`MountBackend`] calls
//! (run on blocking threads: mounting blocks) and errors into `{"error": …}` bodies; the
//! client ([`ControlClient`]) is what the commands use. Access control is the socket's
//! mode (0660) and directory, nothing more: it must not grow an authentication scheme.
//!
//! Routes: `GET /v1/health`, `GET /v1/status`, `POST /v1/mounts` ([`MountRequest`]),
//! `DELETE /v1/mounts` ([`UnmountRequest`]), `POST /v1/prewarm` ([`PrewarmRequest`];
//! answered with JSON lines, [`PrewarmEvent`], while it runs; closing the connection
//! stops it).

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::net::{UnixListener, UnixStream};

use crate::error::{Error, Result};
use crate::mounts::{
    MountBackend, MountInfo, MountOrigin, MountRequest, MountStatus, PrewarmEvent, PrewarmOutcome,
    PrewarmRequest, StoreStatus,
};

/// Most bytes of a response body the client accepts.
const MAX_RESPONSE_BYTES: usize = 16 << 20;
/// Most bytes of a request body the server accepts.
const MAX_REQUEST_BYTES: usize = 64 << 10;

/// Body of `DELETE /v1/mounts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnmountRequest {
    /// The mount point (absolute).
    pub mountpoint: PathBuf,
}

/// Where the daemon serves what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonInfo {
    /// Process id.
    pub pid: u32,
    /// ferry version.
    pub version: String,
    /// The control socket.
    pub control_socket: PathBuf,
    /// The metrics endpoint, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// The snapshotter socket, if the snapshotter runs.
    pub snapshotter_socket: Option<PathBuf>,
    /// Dead ferry mounts (connection ended) found and detached at start.
    #[serde(default)]
    pub dead_mounts: Vec<crate::mounts::DeadMount>,
    /// The peer server's address, when `[p2p]` is on.
    #[serde(default)]
    pub p2p_addr: Option<SocketAddr>,
    /// The CRI image-service proxy's socket, when `[cri]` is on.
    #[serde(default)]
    pub cri_socket: Option<PathBuf>,
}

/// Body of `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The daemon.
    pub daemon: DaemonInfo,
    /// The chunk store.
    pub store: Option<StoreStatus>,
    /// Every live mount.
    pub mounts: Vec<MountStatus>,
    /// The file cache (fully local files served by passthrough), if there is one.
    #[serde(default)]
    pub file_cache: Option<ferry_fs::FileCacheSnapshot>,
    /// The process's inflated-span cache.
    #[serde(default)]
    pub inflated_cache: Option<ferry_index::inflated::InflatedStats>,
    /// Peer counters, when `[p2p]` is on.
    #[serde(default)]
    pub p2p: Option<crate::p2p::P2pSnapshot>,
    /// Images whose layers the snapshotter did not serve lazily, and why.
    #[serde(default)]
    pub not_lazy: Option<crate::fallback::NotLazyStatus>,
    /// The CRI proxy's counters, when `[cri]` is on.
    #[serde(default)]
    pub cri: Option<crate::cri::CriStatus>,
}

/// Body of `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// `"ok"`.
    pub status: String,
    /// The daemon's process id.
    pub pid: u32,
}

/// Body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a human.
    pub error: String,
}

/// What the handlers share.
#[derive(Clone)]
struct ControlState {
    backend: Arc<dyn MountBackend>,
    info: Arc<DaemonInfo>,
    cri: Option<Arc<crate::cri::CriProxy>>,
}

struct ApiError(Error);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody {
            error: self.0.to_string(),
        };
        (status, axum::Json(body)).into_response()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError(e)
    }
}

fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError(Error::InvalidRequest(format!("bad request body: {e}"))))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError(Error::Control(format!("request task failed: {e}"))))?
        .map_err(ApiError)
}

async fn health(State(state): State<ControlState>) -> axum::Json<Health> {
    axum::Json(Health {
        status: "ok".into(),
        pid: state.info.pid,
    })
}

async fn status(State(state): State<ControlState>) -> Result<axum::Json<StatusReport>, ApiError> {
    let backend = state.backend.clone();
    let (store, mounts, file_cache) = blocking(move || {
        Ok((
            backend.store_status(),
            backend.list(),
            backend.file_cache_status(),
        ))
    })
    .await?;
    Ok(axum::Json(StatusReport {
        daemon: (*state.info).clone(),
        store,
        mounts,
        file_cache,
        inflated_cache: Some(ferry_fs::inflated_spans().stats()),
        p2p: state.backend.p2p_status(),
        not_lazy: state.backend.fallbacks().map(|f| f.status()),
        cri: state.cri.as_ref().map(|c| c.status()),
    }))
}

async fn list_mounts(
    State(state): State<ControlState>,
) -> Result<axum::Json<Vec<MountStatus>>, ApiError> {
    let backend = state.backend.clone();
    Ok(axum::Json(blocking(move || Ok(backend.list())).await?))
}

async fn mount(
    State(state): State<ControlState>,
    body: Bytes,
) -> Result<(StatusCode, axum::Json<MountInfo>), ApiError> {
    let request: MountRequest = parse_body(&body)?;
    if request.image.trim().is_empty() {
        return Err(ApiError(Error::InvalidRequest("no image given".into())));
    }
    let backend = state.backend.clone();
    let info = blocking(move || backend.mount(&request, MountOrigin::Control)).await?;
    Ok((StatusCode::CREATED, axum::Json(info)))
}

async fn unmount(State(state): State<ControlState>, body: Bytes) -> Result<StatusCode, ApiError> {
    let request: UnmountRequest = parse_body(&body)?;
    let backend = state.backend.clone();
    blocking(move || backend.unmount(&request.mountpoint)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Sends a prewarm's progress as [`PrewarmEvent`]s; fetched bytes are coalesced while
/// the connection is slower than the fetches. The prewarm stops once the client is gone.
struct ChannelProgress {
    tx: tokio::sync::mpsc::Sender<PrewarmEvent>,
    pending: std::sync::atomic::AtomicU64,
}

impl ferry_fs::warm::prewarm::PrewarmProgress for ChannelProgress {
    fn planned(&self, planned_bytes: u64, present_bytes: u64) {
        let _ = self.tx.blocking_send(PrewarmEvent::Planned {
            planned_bytes,
            present_bytes,
        });
    }

    fn fetched(&self, bytes: u64) {
        use std::sync::atomic::Ordering;
        let total = self.pending.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if total == 0 {
            return;
        }
        let taken = self.pending.swap(0, Ordering::Relaxed);
        if taken > 0
            && self
                .tx
                .try_send(PrewarmEvent::Fetched { bytes: taken })
                .is_err()
        {
            self.pending.fetch_add(taken, Ordering::Relaxed);
        }
    }

    fn stop_requested(&self) -> bool {
        self.tx.is_closed()
    }
}

async fn prewarm(State(state): State<ControlState>, body: Bytes) -> Result<Response, ApiError> {
    let request: PrewarmRequest = parse_body(&body)?;
    if request.image.trim().is_empty() {
        return Err(ApiError(Error::InvalidRequest("no image given".into())));
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<PrewarmEvent>(64);
    let backend = state.backend.clone();
    tokio::task::spawn_blocking(move || {
        let progress = ChannelProgress {
            tx: tx.clone(),
            pending: std::sync::atomic::AtomicU64::new(0),
        };
        let last = match backend.prewarm(&request, &progress) {
            Ok(outcome) => PrewarmEvent::Done { outcome },
            Err(e) => PrewarmEvent::Error {
                error: e.to_string(),
            },
        };
        let pending = progress.pending.load(std::sync::atomic::Ordering::Relaxed);
        if pending > 0 {
            let _ = tx.blocking_send(PrewarmEvent::Fetched { bytes: pending });
        }
        let _ = tx.blocking_send(last);
    });
    let lines = futures_util::stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        let mut line = serde_json::to_vec(&event).unwrap_or_default();
        line.push(b'\n');
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(line)), rx))
    });
    http::Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(axum::body::Body::from_stream(lines))
        .map_err(|e| ApiError(Error::Control(format!("building the answer: {e}"))))
}

async fn not_found() -> ApiError {
    ApiError(Error::Remote {
        status: 404,
        message: "no such endpoint (try /v1/status)".into(),
    })
}

/// The control API's routes over `backend` (and the CRI proxy's counters, when it runs).
pub fn router(
    backend: Arc<dyn MountBackend>,
    info: DaemonInfo,
    cri: Option<Arc<crate::cri::CriProxy>>,
) -> Router {
    let state = ControlState {
        backend,
        info: Arc::new(info),
        cri,
    };
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/status", get(status))
        .route("/v1/mounts", get(list_mounts).post(mount).delete(unmount))
        .route("/v1/prewarm", axum::routing::post(prewarm))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(state)
}

/// Binds the control socket: creates its directory, replaces a stale socket file,
/// refuses when a daemon answers there or the path is not a socket; mode 0660.
pub async fn bind(socket: &Path) -> Result<UnixListener> {
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    }
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(socket).await.is_ok() {
                return Err(Error::AlreadyRunning(socket.to_path_buf()));
            }
            std::fs::remove_file(socket)
                .map_err(|e| Error::io(format!("removing stale {}", socket.display()), e))?;
        }
        Ok(_) => {
            return Err(Error::Config(format!(
                "{} exists and is not a socket",
                socket.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("checking {}", socket.display()), e)),
    }
    let listener = UnixListener::bind(socket)
        .map_err(|e| Error::io(format!("listening on {}", socket.display()), e))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| Error::io(format!("chmod {}", socket.display()), e))?;
    Ok(listener)
}

/// Serves `router` on `listener` until `shutdown` resolves (in-flight requests finish),
/// then removes `socket`.
pub async fn serve(
    listener: UnixListener,
    router: Router,
    socket: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await;
    if let Err(e) = std::fs::remove_file(socket)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(socket = %socket.display(), error = %e, "removing the control socket");
    }
    served.map_err(|e| Error::io("serving the control API", e))
}

/// Talks to a daemon's control socket (one connection per request).
#[derive(Debug, Clone)]
pub struct ControlClient {
    socket: PathBuf,
    timeout: Duration,
}

impl ControlClient {
    /// A client of the daemon at `socket`; requests time out after 10 minutes (a mount
    /// may resolve a slow registry), see [`ControlClient::with_timeout`].
    pub fn new(socket: impl Into<PathBuf>) -> ControlClient {
        ControlClient {
            socket: socket.into(),
            timeout: Duration::from_secs(600),
        }
    }

    /// The same client with another per-request timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> ControlClient {
        self.timeout = timeout;
        self
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn request<T: DeserializeOwned>(
        &self,
        method: http::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Option<T>> {
        match tokio::time::timeout(self.timeout, self.request_inner(method, path, body)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Control(format!(
                "no answer from {} within {:?}",
                self.socket.display(),
                self.timeout
            ))),
        }
    }

    /// One HTTP/1 connection to the daemon's socket, its driver spawned.
    async fn connect(
        &self,
    ) -> Result<(
        hyper::client::conn::http1::SendRequest<Full<Bytes>>,
        tokio::task::JoinHandle<hyper::Result<()>>,
    )> {
        let stream = UnixStream::connect(&self.socket).await.map_err(|e| {
            Error::Control(format!(
                "cannot connect to {} ({e}); is `ferry daemon` running?",
                self.socket.display()
            ))
        })?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Error::Control(format!("HTTP handshake: {e}")))?;
        Ok((sender, tokio::spawn(conn)))
    }

    async fn request_inner<T: DeserializeOwned>(
        &self,
        method: http::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Option<T>> {
        let (mut sender, conn) = self.connect().await?;
        let mut builder = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, "ferry-daemon");
        if body.is_some() {
            builder = builder.header(http::header::CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| Error::Control(format!("building the request: {e}")))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| Error::Control(format!("request to {path}: {e}")))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| Error::Control(format!("reading the answer to {path}: {e}")))?
            .to_bytes();
        conn.abort();
        if !status.is_success() {
            let message = serde_json::from_slice::<ErrorBody>(&bytes)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
            return Err(Error::Remote {
                status: status.as_u16(),
                message,
            });
        }
        if status == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Control(format!("bad answer to {path}: {e}")))
    }

    async fn expect<T: DeserializeOwned>(
        &self,
        method: http::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T> {
        self.request(method, path, body)
            .await?
            .ok_or_else(|| Error::Control(format!("empty answer to {path}")))
    }

    /// `GET /v1/health`.
    pub async fn health(&self) -> Result<Health> {
        self.expect(http::Method::GET, "/v1/health", None).await
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<StatusReport> {
        self.expect(http::Method::GET, "/v1/status", None).await
    }

    /// `POST /v1/mounts`.
    pub async fn mount(&self, request: &MountRequest) -> Result<MountInfo> {
        let body = serde_json::to_vec(request)
            .map_err(|e| Error::Control(format!("encoding the request: {e}")))?;
        self.expect(http::Method::POST, "/v1/mounts", Some(body))
            .await
    }

    /// `POST /v1/prewarm`: runs the prewarm, calling `on_event` with each progress line,
    /// and returns its outcome. Waits as long as it runs (at most the client's timeout
    /// between two lines); dropping the future closes the connection, which stops it.
    pub async fn prewarm(
        &self,
        request: &PrewarmRequest,
        mut on_event: impl FnMut(&PrewarmEvent),
    ) -> Result<PrewarmOutcome> {
        let body = serde_json::to_vec(request)
            .map_err(|e| Error::Control(format!("encoding the request: {e}")))?;
        let (mut sender, conn) = self.connect().await?;
        let req = http::Request::builder()
            .method(http::Method::POST)
            .uri("/v1/prewarm")
            .header(http::header::HOST, "ferry-daemon")
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Error::Control(format!("building the request: {e}")))?;
        let response = tokio::time::timeout(self.timeout, sender.send_request(req))
            .await
            .map_err(|_| Error::Control("no answer to /v1/prewarm".into()))?
            .map_err(|e| Error::Control(format!("request to /v1/prewarm: {e}")))?;
        let status = response.status();
        let mut body = response.into_body();
        let mut buf: Vec<u8> = Vec::new();
        let mut outcome = None;
        loop {
            let frame = tokio::time::timeout(self.timeout, body.frame())
                .await
                .map_err(|_| {
                    Error::Control(format!(
                        "the daemon sent nothing about the prewarm for {:?}",
                        self.timeout
                    ))
                })?;
            let Some(frame) = frame else { break };
            let frame =
                frame.map_err(|e| Error::Control(format!("reading the prewarm answer: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            if !status.is_success() {
                if buf.len() > MAX_RESPONSE_BYTES {
                    break;
                }
                continue;
            }
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let event: PrewarmEvent = serde_json::from_slice(&line)
                    .map_err(|e| Error::Control(format!("bad prewarm progress line: {e}")))?;
                on_event(&event);
                match event {
                    PrewarmEvent::Done { outcome: o } => outcome = Some(o),
                    PrewarmEvent::Error { error } => {
                        conn.abort();
                        return Err(Error::Remote {
                            status: 500,
                            message: error,
                        });
                    }
                    _ => {}
                }
            }
            if buf.len() > MAX_RESPONSE_BYTES {
                return Err(Error::Control("prewarm progress line too long".into()));
            }
        }
        conn.abort();
        if !status.is_success() {
            let message = serde_json::from_slice::<ErrorBody>(&buf)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&buf).into_owned());
            return Err(Error::Remote {
                status: status.as_u16(),
                message,
            });
        }
        outcome.ok_or_else(|| {
            Error::Control("the daemon ended the prewarm answer without an outcome".into())
        })
    }

    /// `DELETE /v1/mounts`.
    pub async fn unmount(&self, mountpoint: &Path) -> Result<()> {
        let body = serde_json::to_vec(&UnmountRequest {
            mountpoint: mountpoint.to_path_buf(),
        })
        .map_err(|e| Error::Control(format!("encoding the request: {e}")))?;
        self.request::<serde_json::Value>(http::Method::DELETE, "/v1/mounts", Some(body))
            .await?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::memory::MemoryBackend;
    use crate::mounts::LayerKind;

    struct Harness {
        _dir: tempfile::TempDir,
        socket: PathBuf,
        backend: Arc<MemoryBackend>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        server: tokio::task::JoinHandle<Result<()>>,
    }

    async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/daemon.sock");
        let backend = Arc::new(MemoryBackend::new());
        backend.add_image(
            "reg.local/app:v1",
            "sha256:m",
            &[("sha256:l1", LayerKind::FerryIndex)],
        );
        let info = DaemonInfo {
            pid: 42,
            version: "test".into(),
            control_socket: socket.clone(),
            metrics_addr: None,
            snapshotter_socket: None,
            dead_mounts: Vec::new(),
            p2p_addr: None,
            cri_socket: None,
        };
        let listener = bind(&socket).await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = router(backend.clone(), info, None);
        let sock = socket.clone();
        let server = tokio::spawn(async move {
            serve(listener, app, &sock, async {
                let _ = rx.await;
            })
            .await
        });
        Harness {
            _dir: dir,
            socket,
            backend,
            stop: Some(tx),
            server,
        }
    }

    impl Harness {
        async fn stop(mut self) {
            self.stop.take().unwrap().send(()).unwrap();
            (&mut self.server).await.unwrap().unwrap();
            assert!(!self.socket.exists(), "the socket is removed on shutdown");
        }
    }

    #[tokio::test]
    async fn mount_status_unmount_round_trip() {
        let h = start().await;
        let client = ControlClient::new(&h.socket);
        assert_eq!(client.health().await.unwrap().pid, 42);
        let mode = std::fs::metadata(&h.socket).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o660);

        let req = MountRequest {
            image: "reg.local/app:v1".into(),
            mountpoint: "/mnt/a".into(),
            layer: None,
        };
        let info = client.mount(&req).await.unwrap();
        assert_eq!(info.manifest_digest, "sha256:m");
        client
            .mount(&MountRequest {
                mountpoint: "/mnt/b".into(),
                layer: Some("sha256:l1".into()),
                ..req.clone()
            })
            .await
            .unwrap();
        h.backend.set_stats(
            Path::new("/mnt/a"),
            ferry_fs::StatsSnapshot {
                bytes_total: 100,
                bytes_fetched: 7,
                ..Default::default()
            },
        );
        let status = client.status().await.unwrap();
        assert_eq!(status.daemon.pid, 42);
        assert_eq!(status.mounts.len(), 2);
        assert_eq!(status.mounts[0].info.mountpoint, Path::new("/mnt/a"));
        assert_eq!(status.mounts[0].stats.bytes_fetched, 7);
        assert_eq!(status.mounts[0].origin, MountOrigin::Control);
        assert_eq!(status.mounts[1].info.layer.as_deref(), Some("sha256:l1"));

        client.unmount(Path::new("/mnt/a")).await.unwrap();
        assert_eq!(h.backend.unmounted(), vec![PathBuf::from("/mnt/a")]);
        assert_eq!(client.status().await.unwrap().mounts.len(), 1);
        h.stop().await;
    }

    #[tokio::test]
    async fn status_names_the_images_not_served_lazily() {
        use ferry_snapshotter::{NotLazy, NotLazyReason};

        let h = start().await;
        let client = ControlClient::new(&h.socket);
        let empty = client.status().await.unwrap().not_lazy.unwrap();
        assert!(empty.images.is_empty());
        h.backend.fallbacks().unwrap().declined(
            Some("reg.local/plain:v1"),
            Some("sha256:m"),
            Some("sha256:l1"),
            &NotLazy::new(NotLazyReason::NoIndex, "no index"),
        );
        let status = client.status().await.unwrap().not_lazy.unwrap();
        assert_eq!(status.images.len(), 1);
        assert_eq!(
            status.images[0].image.as_deref(),
            Some("reg.local/plain:v1")
        );
        assert_eq!(status.images[0].reason, NotLazyReason::NoIndex);
        assert_eq!(status.layers_by_reason[&NotLazyReason::NoIndex], 1);
        h.stop().await;
    }

    #[tokio::test]
    async fn errors_come_back_as_json_with_their_status() {
        let h = start().await;
        let client = ControlClient::new(&h.socket);
        let err = client.unmount(Path::new("/mnt/none")).await.unwrap_err();
        assert!(
            matches!(&err, Error::Remote { status: 404, message } if message.contains("/mnt/none")),
            "{err}"
        );
        let req = MountRequest {
            image: "reg.local/app:v1".into(),
            mountpoint: "/mnt/a".into(),
            layer: None,
        };
        client.mount(&req).await.unwrap();
        let err = client.mount(&req).await.unwrap_err();
        assert!(matches!(err, Error::Remote { status: 409, .. }), "{err}");
        let err = client
            .mount(&MountRequest {
                image: "reg.local/missing:v1".into(),
                mountpoint: "/mnt/c".into(),
                layer: None,
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Remote { status: 400, message } if message.contains("missing")),
            "{err}"
        );
        // A malformed body, straight over the socket.
        let bad = client
            .request::<serde_json::Value>(
                http::Method::POST,
                "/v1/mounts",
                Some(b"{\"image\": 3}".to_vec()),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&bad, Error::Remote { status: 400, message } if message.contains("bad request body")),
            "{bad}"
        );
        let unknown = client
            .request::<serde_json::Value>(http::Method::GET, "/v2/whatever", None)
            .await
            .unwrap_err();
        assert!(matches!(unknown, Error::Remote { status: 404, .. }));
        h.stop().await;
    }

    #[tokio::test]
    async fn a_second_daemon_is_refused_and_a_stale_socket_replaced() {
        let h = start().await;
        let err = bind(&h.socket).await.unwrap_err();
        assert!(matches!(err, Error::AlreadyRunning(_)), "{err}");
        let socket = h.socket.clone();
        let dir_keep = tempfile::tempdir().unwrap();
        h.stop().await;
        // A socket file nobody listens on is replaced.
        let stale = dir_keep.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        assert!(stale.exists());
        drop(bind(&stale).await.unwrap());
        // A regular file is left alone.
        let plain = dir_keep.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        assert!(bind(&plain).await.is_err());
        assert_eq!(std::fs::read(&plain).unwrap(), b"x");
        // No daemon: the client says how to start one.
        let err = ControlClient::new(&socket).health().await.unwrap_err();
        assert!(err.to_string().contains("ferry daemon"), "{err}");
    }
}
