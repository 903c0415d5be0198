//! The CRI image-service proxy: the kubelet talks to this socket
//! (`--image-service-endpoint`), the daemon forwards every call unchanged to the
//! container runtime's socket (containerd), and keeps the credentials of each
//! `PullImage` (the pod's image pull secrets) for the lazy reads of that image.
//!
//! Credentials never reach a remote snapshotter: containerd pulls with them and keeps
//! them to itself, so without this a private image's lazy layers could not be read.
//! Here they are taken from the request on its way through, scoped to the image's
//! registry and repository ([`ferry_registry_client::pullsecrets`]), held in memory
//! only, replaced by the next pull of the repository, and never logged.
//!
//! What this must not do: change a request or an answer (the bytes go through as they
//! came, any runtime.v1 or v1alpha2 service), or hold a call longer than the runtime
//! does. Only `PullImage`'s body is read whole (bounded) before it is forwarded.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ferry_oci::ImageRef;
use ferry_registry_client::pullsecrets::{PullSecret, PullSecrets};
use http_body_util::{BodyExt, Full, Limited, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{UnixListener, UnixStream};

use crate::error::{Error, Result};

/// The call whose credentials are kept.
const PULL_IMAGE: &[&str] = &[
    "/runtime.v1.ImageService/PullImage",
    "/runtime.v1alpha2.ImageService/PullImage",
];
/// Largest `PullImage` request read (its sandbox config included); larger ones are
/// forwarded unread.
pub const MAX_PULL_REQUEST: usize = 4 << 20;
/// Longest wait to connect to the runtime's socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

type Body = BoxBody<Bytes, BoxError>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// See the module doc.
#[derive(Debug)]
pub struct CriProxy {
    runtime_socket: PathBuf,
    secrets: Arc<PullSecrets>,
    /// Pulls whose credentials were kept.
    captured: AtomicU64,
    /// Calls forwarded.
    forwarded: AtomicU64,
    /// Calls answered `UNAVAILABLE` because the runtime could not be reached.
    unreachable: AtomicU64,
}

/// What `ferry status` and the metrics show of the CRI proxy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CriStatus {
    /// The container runtime's socket calls are forwarded to.
    pub runtime_socket: PathBuf,
    /// Calls forwarded so far.
    pub forwarded: u64,
    /// `PullImage` calls whose credentials were kept for lazy reads.
    pub credentials_kept: u64,
    /// Calls answered `UNAVAILABLE`: the runtime could not be reached.
    pub runtime_unreachable: u64,
    /// Repositories the daemon holds pull credentials for now (in memory only: a
    /// restart forgets them until the kubelet's next pull).
    pub repositories_with_credentials: usize,
}

impl CriProxy {
    /// A proxy to the runtime listening on `runtime_socket`, keeping credentials in
    /// `secrets` (the daemon's registry client's).
    pub fn new(runtime_socket: PathBuf, secrets: Arc<PullSecrets>) -> CriProxy {
        CriProxy {
            runtime_socket,
            secrets,
            captured: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
            unreachable: AtomicU64::new(0),
        }
    }

    /// The proxy's counters now.
    pub fn status(&self) -> CriStatus {
        CriStatus {
            runtime_socket: self.runtime_socket.clone(),
            forwarded: self.forwarded(),
            credentials_kept: self.captured(),
            runtime_unreachable: self.unreachable.load(Ordering::Relaxed),
            repositories_with_credentials: self.secrets.len(),
        }
    }

    /// Pulls whose credentials were kept so far.
    pub fn captured(&self) -> u64 {
        self.captured.load(Ordering::Relaxed)
    }

    /// Calls forwarded so far.
    pub fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }

    /// Forwards one call; a runtime that cannot be reached is answered with gRPC
    /// `UNAVAILABLE`, naming the socket.
    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path().to_owned();
        let body: Body = if PULL_IMAGE.contains(&path.as_str()) {
            match Limited::new(body, MAX_PULL_REQUEST).collect().await {
                Ok(collected) => {
                    let bytes = collected.to_bytes();
                    self.keep_credentials(&bytes);
                    Full::new(bytes).map_err(|never| match never {}).boxed()
                }
                Err(e) => return grpc_error(3, &format!("PullImage request: {e}")),
            }
        } else {
            body.map_err(|e| Box::new(e) as BoxError).boxed()
        };
        let uri = match format!(
            "http://runtime{}",
            parts.uri.path_and_query().map_or("/", |p| p.as_str())
        )
        .parse()
        {
            Ok(u) => u,
            Err(_) => return grpc_error(3, "bad request path"),
        };
        let mut upstream = Request::new(body);
        *upstream.method_mut() = parts.method;
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = parts.headers;
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        match self.send(upstream).await {
            Ok(resp) => resp.map(|b| b.map_err(|e| Box::new(e) as BoxError).boxed()),
            Err(e) => {
                self.unreachable.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(runtime = %self.runtime_socket.display(), error = %e, call = %path, "CRI call not forwarded");
                grpc_error(
                    14,
                    &format!(
                        "ferry CRI proxy: the container runtime at {} is unreachable ({e}); is containerd running?",
                        self.runtime_socket.display()
                    ),
                )
            }
        }
    }

    /// One HTTP/2 connection to the runtime per call: the kubelet's image calls are
    /// few, and a connection shared across calls would tie their failures together.
    async fn send(&self, req: Request<Body>) -> std::result::Result<Response<Incoming>, BoxError> {
        let stream =
            tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(&self.runtime_socket))
                .await
                .map_err(|_| "connect timed out")??;
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "CRI runtime connection ended");
            }
        });
        Ok(sender.send_request(req).await?)
    }

    /// Keeps the credentials of a `PullImage` request (one uncompressed gRPC message)
    /// for its image's repository. Anything it cannot read is left alone: the call is
    /// forwarded all the same.
    fn keep_credentials(&self, body: &[u8]) {
        let Some((image, secret)) = parse_pull_request(body) else {
            tracing::debug!(
                "PullImage request not understood; forwarded without keeping credentials"
            );
            return;
        };
        let Ok(ImageRef::Registry {
            registry,
            repository,
            ..
        }) = ImageRef::parse(&image)
        else {
            return;
        };
        let anonymous = secret.is_empty();
        let kept = self
            .secrets
            .remember(&registry, repository.as_str(), &secret);
        if kept {
            self.captured.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%registry, repository = %repository.as_str(), "kept the pull's credentials for its lazy reads");
        } else if !anonymous {
            tracing::warn!(%registry, repository = %repository.as_str(), "the pull's credentials carry nothing ferry can use (a registry token alone); its lazy reads go without them");
        }
    }
}

/// The fields of `runtime.v1.PullImageRequest` the proxy reads (the rest is skipped).
#[derive(Clone, PartialEq, prost::Message)]
struct PullImageRequest {
    #[prost(message, optional, tag = "1")]
    image: Option<ImageSpec>,
    #[prost(message, optional, tag = "2")]
    auth: Option<AuthConfig>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ImageSpec {
    #[prost(string, tag = "1")]
    image: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct AuthConfig {
    #[prost(string, tag = "1")]
    username: String,
    #[prost(string, tag = "2")]
    password: String,
    #[prost(string, tag = "3")]
    auth: String,
    #[prost(string, tag = "4")]
    server_address: String,
    #[prost(string, tag = "5")]
    identity_token: String,
    #[prost(string, tag = "6")]
    registry_token: String,
}

/// The image a `PullImage` request names and the credentials it carries, from its
/// gRPC body (one uncompressed length-prefixed message); `None` for anything else.
pub fn parse_pull_request(body: &[u8]) -> Option<(String, PullSecret)> {
    let req = decode_pull(body)?;
    let auth = req.auth.unwrap_or_default();
    Some((
        req.image.map(|i| i.image).unwrap_or_default(),
        PullSecret {
            username: auth.username,
            password: auth.password,
            auth: auth.auth,
            identity_token: auth.identity_token,
            registry_token: auth.registry_token,
        },
    ))
}

/// One uncompressed length-prefixed gRPC message → the request; `None` otherwise.
fn decode_pull(body: &[u8]) -> Option<PullImageRequest> {
    let (&flag, rest) = body.split_first()?;
    if flag != 0 || rest.len() < 4 {
        return None;
    }
    let len = u32::from_be_bytes(rest[..4].try_into().ok()?) as usize;
    let msg = rest.get(4..4 + len)?;
    <PullImageRequest as prost::Message>::decode(msg).ok()
}

/// A trailers-only gRPC answer with `code` and `message`.
fn grpc_error(code: u32, message: &str) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed(),
    );
    let h = resp.headers_mut();
    h.insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/grpc"),
    );
    h.insert("grpc-status", code.into());
    // grpc-message is percent-encoded; keep it to visible ASCII.
    let text: String = message
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect::<String>()
        .replace('%', "%25");
    if let Ok(v) = hyper::header::HeaderValue::from_str(&text) {
        h.insert("grpc-message", v);
    }
    resp
}

/// Serves the proxy on `listener` until `shutdown` resolves, then removes `socket`.
pub async fn serve(
    listener: UnixListener,
    proxy: Arc<CriProxy>,
    socket: &Path,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "CRI proxy: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(proxy.handle(req).await) }
            });
            let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            // A kubelet that went away is noticed, and its connection dropped.
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .keep_alive_interval(Some(Duration::from_secs(30)))
                .keep_alive_timeout(Duration::from_secs(20));
            if let Err(e) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "CRI proxy connection ended");
            }
        });
    }
    if let Err(e) = std::fs::remove_file(socket)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(socket = %socket.display(), error = %e, "removing the CRI socket");
    }
    Ok(())
}

/// Binds the CRI socket (as the control socket: stale ones replaced, mode 0660).
pub async fn bind(socket: &Path) -> Result<UnixListener> {
    crate::control::bind(socket).await.map_err(|e| match e {
        Error::AlreadyRunning(p) => Error::Config(format!(
            "something already serves CRI on {}; set [cri] socket to another path",
            p.display()
        )),
        e => e,
    })
}

#[cfg(test)]
mod tests;
