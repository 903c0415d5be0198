//! # ferry-registry-client: how ferry talks to OCI registries
//!
//! `ferry copy`, `ferry pull`, the lazy filesystem, the node daemon and the pull-through
//! cache of ferry's registry all talk to registries through this crate, and the load
//! tester reads challenges and asks for manifests the way it does. It owns:
//!
//! - [`Client`]: reference resolution, manifests, blobs, tags, referrers, pushes;
//!   bearer/basic auth challenges ([`auth`]), credentials from `~/.docker/config.json`
//!   and credential helpers, token refresh, pull mirrors with fallback, retries with
//!   backoff ([`retry`]), HTTP Range reads and parallel chunked downloads ([`download`]);
//! - image copy between registries and OCI layouts ([`copy`]);
//! - [`RangeRuntime`], a tokio runtime on its own thread for synchronous callers (FUSE
//!   threads) that drive the client;
//! - [`ByteStream`], the body type blobs are streamed as, here and in ferry's registry;
//! - [`cache`]: ferry's one single flight (ferry-fs's span fetches use it too) and a
//!   byte-bounded document LRU, for callers that must not fetch the same thing twice
//!   at once.
//!
//! It must not know layer formats, filesystems or containerd: it moves bytes and
//! documents, verified by digest, and nothing else (reading a layer lazily through it is
//! `ferry-fs`'s `HttpRangeSource`). It must not contain server code: ferry's registry
//! (`ferry-registry`) depends on it, never the other way round, so what uses only the
//! client compiles no HTTP server, object store or password hashing. Input from the
//! network is bounded and validated before it is trusted; nothing here panics on what a
//! peer sends.
//!
//! It is written on `reqwest` rather than on an existing OCI client crate because the
//! lazy filesystem needs things those crates keep private: token state shared between
//! async pulls and *synchronous* range reads from FUSE threads, bearer tokens refreshed
//! in the middle of a long pull (and re-fetched once when the registry refuses one
//! anyway), pull mirrors with fallback, and HTTP Range reads with parallel chunked
//! downloads. One `reqwest::Client` (keep-alive pool, HTTP/2 where offered) serves every
//! request of a `Client` and its clones.
//!
//! What it guarantees:
//! - Manifests are digest-verified (against the requested digest or the registry's
//!   `Docker-Content-Digest`) and bounded to [`ferry_oci::MAX_MANIFEST_BYTES`].
//! - Credentials go only to the host they belong to: redirects (blob GETs to S3/CDN) are
//!   followed by hand, and the `Authorization` header is dropped when the host changes.
//! - Transient failures (connect errors, 429, 5xx) are retried with exponential backoff
//!   and jitter, honouring `Retry-After`; other 4xx are not.
//! - Registries on loopback are tried over HTTPS first and, when they do not speak TLS,
//!   over plain HTTP (remembered), as docker and containerd do; `plain_http` in the
//!   registry's config uses HTTP directly anywhere.

pub mod auth;
pub mod byteranges;
pub mod cache;
pub mod config;
pub mod copy;
pub(crate) mod credentials;
pub mod credprovider;
pub mod download;
#[doc(hidden)]
pub mod fuzz_api;
pub mod hosts;
pub mod pullsecrets;
pub mod retry;
mod runtime;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use parking_lot::Mutex;
use reqwest::Method;
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};

pub use config::{ClientConfig, Credentials, RegistryConfig};
pub use copy::{CopyOptions, CopyProgress, CopyReport, ImageLocation, NoProgress, copy_image};
pub use download::DownloadOptions;
pub use runtime::RangeRuntime;

use auth::{AuthState, HostSecret};
use ferry_oci::{Reference, RepositoryName, media};

/// A stream of body bytes, as received from a peer or sent to one.
pub type ByteStream = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, std::io::Error>> + Send>>;

/// A repository in a registry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Repo {
    /// `host[:port]` as the user names it (`docker.io` is reached at `registry-1.docker.io`).
    pub registry: String,
    /// Repository path, e.g. `library/debian` (validated where it was parsed).
    pub repository: RepositoryName,
}

impl Repo {
    /// A repository of a registry.
    pub fn new(registry: impl Into<String>, repository: RepositoryName) -> Self {
        Repo {
            registry: registry.into(),
            repository,
        }
    }

    /// A repository of a registry, its name parsed from text.
    pub fn parse(registry: impl Into<String>, repository: &str) -> Result<Self, ClientError> {
        Ok(Repo::new(registry, RepositoryName::parse(repository)?))
    }
}

impl std::fmt::Display for Repo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)
    }
}

/// A manifest (or index) document as fetched, digest-verified.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// `sha256:<hex>` of `bytes`.
    pub digest: String,
    /// The media type (the document's `mediaType`, else Content-Type).
    pub media_type: String,
    pub bytes: Bytes,
}

/// What a HEAD of a manifest says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestHead {
    pub digest: String,
    pub media_type: String,
    pub size: u64,
}

/// A blob (or a byte range of it) being received.
pub struct BlobStream {
    /// Total size of the blob, when the server said.
    pub size: Option<u64>,
    /// The requested bytes (exactly the range asked for; a short body is an error item).
    pub body: ByteStream,
}

impl std::fmt::Debug for BlobStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobStream")
            .field("size", &self.size)
            .finish()
    }
}

impl BlobStream {
    /// The whole body in memory, refusing more than `max` bytes (`what` names the blob in
    /// the error): for small documents such as index and trace blobs.
    pub async fn collect_body(self, what: &str, max: u64) -> Result<Vec<u8>, ClientError> {
        let mut body = self.body;
        let mut out = Vec::new();
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| ClientError::Invalid {
                what: what.into(),
                reason: e.to_string(),
            })?;
            if (out.len() + piece.len()) as u64 > max {
                return Err(ClientError::Invalid {
                    what: what.into(),
                    reason: format!("larger than {max} bytes"),
                });
            }
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }
}

/// Errors talking to a registry. Messages say what to do next where there is something.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{what} not found")]
    NotFound { what: String },
    #[error("unauthorized at {registry}: {message}")]
    Unauthorized { registry: String, message: String },
    #[error("access denied at {registry}: {message}")]
    Denied { registry: String, message: String },
    #[error("{registry} answered {status} to {method} {path}: {message}")]
    Status {
        registry: String,
        method: String,
        path: String,
        status: u16,
        message: String,
    },
    #[error("cannot reach {registry}: {message}")]
    Transport { registry: String, message: String },
    #[error("content of {expected} hashes to {actual}")]
    DigestMismatch { expected: String, actual: String },
    #[error("{what} is larger than the {limit} bytes allowed")]
    TooLarge { what: String, limit: u64 },
    #[error("invalid {what}: {reason}")]
    Invalid { what: String, reason: String },
    #[error("{0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// An OCI layout could not be read or written.
    #[error(transparent)]
    Layout(#[from] ferry_oci::Error),
}

impl ClientError {
    /// Whether trying again might succeed (transport failures, 429, 5xx).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Transport { .. } => true,
            ClientError::Status { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        }
    }

    /// The HTTP status behind this error, when there was one.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::NotFound { .. } => Some(404),
            ClientError::Unauthorized { .. } => Some(401),
            ClientError::Denied { .. } => Some(403),
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Every manifest type ferry understands, for `Accept`.
pub const MANIFEST_TYPES: [&str; 4] = [
    media::OCI_MANIFEST,
    media::OCI_INDEX,
    media::DOCKER_MANIFEST,
    media::DOCKER_MANIFEST_LIST,
];

const MAX_ERROR_BODY: u64 = 64 << 10;
const MAX_REDIRECTS: usize = 10;
const MAX_PAGES: usize = 10_000;

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = inner.source();
    }
    s
}

/// Reads a response body of at most `limit` bytes.
pub(crate) async fn read_body_bounded(
    mut resp: reqwest::Response,
    limit: u64,
    registry: &str,
    what: &str,
) -> Result<Bytes, ClientError> {
    if resp.content_length().is_some_and(|n| n > limit) {
        return Err(ClientError::TooLarge {
            what: what.to_string(),
            limit,
        });
    }
    let mut buf = bytes::BytesMut::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if (buf.len() + chunk.len()) as u64 > limit {
                    return Err(ClientError::TooLarge {
                        what: what.to_string(),
                        limit,
                    });
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(buf.freeze()),
            Err(e) => {
                return Err(ClientError::Transport {
                    registry: registry.to_string(),
                    message: format!("reading {what}: {}", error_chain(&e)),
                });
            }
        }
    }
}

/// The distribution error body (`{"errors":[{"code","message"}]}`) as one line.
async fn error_message(resp: reqwest::Response) -> String {
    let status = resp.status();
    let Ok(body) = read_body_bounded(resp, MAX_ERROR_BODY, "", "error body").await else {
        return status.to_string();
    };
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<ErrorEntry>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorEntry {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    if let Ok(e) = serde_json::from_slice::<Errors>(&body)
        && !e.errors.is_empty()
    {
        return e
            .errors
            .iter()
            .map(|e| format!("{} {}", e.code, e.message).trim().to_string())
            .collect::<Vec<_>>()
            .join("; ");
    }
    let text = String::from_utf8_lossy(&body);
    let text: String = text.trim().chars().take(200).collect();
    if text.is_empty() {
        status.to_string()
    } else {
        text
    }
}

fn sha256_hex_digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// Checks that `d` is a well-formed `sha256:<hex>` digest (what the client asks for
/// blobs by; ferry-oci's one digest rule), as an [`ClientError::Invalid`] otherwise.
pub fn check_digest(d: &str) -> Result<(), ClientError> {
    ferry_oci::digest::parse_sha256(d)
        .map(|_| ())
        .map_err(|e| ClientError::Invalid {
            what: "digest".into(),
            reason: e.to_string(),
        })
}

/// A manifest reference (tag, or sha256 digest) before it goes into a URL path.
fn check_reference(reference: &str) -> Result<(), ClientError> {
    match Reference::parse(reference) {
        Ok(Reference::Tag(_)) => Ok(()),
        Ok(Reference::Digest(_)) => check_digest(reference),
        Err(e) => Err(ClientError::Invalid {
            what: "manifest reference".into(),
            reason: e.to_string(),
        }),
    }
}

/// The registry half of a [`Repo`] (the repository name is typed, so already valid).
fn check_repo(r: &Repo) -> Result<(), ClientError> {
    if r.registry.is_empty()
        || r.registry
            .bytes()
            .any(|b| b == b'/' || b == b'@' || b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(ClientError::Invalid {
            what: "registry".into(),
            reason: format!("{:?} is not host[:port]", r.registry),
        });
    }
    Ok(())
}

/// Whether `host[:port]` names this machine (reached over plain HTTP when it has no TLS).
pub fn is_loopback(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            .map(|(h, _)| h)
            .unwrap_or(host)
    };
    name == "localhost"
        || name == "::1"
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `host:port` of a URL (port made explicit), for same-host checks.
fn origin_of(url: &url::Url) -> String {
    format!(
        "{}:{}",
        url.host_str().unwrap_or(""),
        url.port_or_known_default().unwrap_or(0)
    )
}

/// Where a request may go: a pull mirror or the registry itself.
#[derive(Debug, Clone)]
struct Endpoint {
    /// `host[:port]` on the wire.
    host: String,
    /// Scheme fixed by config (`http://` mirror, `plain_http`); `None` = https, with the
    /// loopback fallback.
    scheme: Option<&'static str>,
    skip_tls_verify: bool,
    mirror: bool,
    /// What replaces `/v2` in request paths (a hosts.toml URL path or `override_path`);
    /// `None`: `/v2`.
    root: Option<Arc<str>>,
    /// CA files, client certificates, dial timeout from hosts.toml: requests go through a
    /// client built for them. `None`: the shared clients.
    tls: Option<Arc<TlsKey>>,
    /// Headers hosts.toml adds to every request to this endpoint.
    headers: Arc<[(HeaderName, HeaderValue)]>,
}

/// The TLS (and dial) settings a dedicated HTTP client is built for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct TlsKey {
    files: hosts::TlsFiles,
    skip_verify: bool,
    dial_timeout: Option<std::time::Duration>,
}

/// Which hosts of a hosts.toml a call may use (containerd's capabilities).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Content by digest.
    Pull,
    /// A tag (manifest by tag, tag list).
    Resolve,
    /// The registry itself only (writes, and what must not come from a mirror).
    Origin,
}

impl Want {
    fn allowed(self, c: &hosts::Capabilities) -> bool {
        match self {
            Want::Pull => c.pull,
            Want::Resolve => c.resolve,
            Want::Origin => true,
        }
    }
}

/// Whether a read of `path` resolves a tag (else it is content by digest).
fn resolves_a_tag(path: &str) -> bool {
    let path = path.split('?').next().unwrap_or(path);
    if path.ends_with("/tags/list") {
        return true;
    }
    match path.rsplit_once("/manifests/") {
        Some((_, reference)) => !reference.contains(':'),
        None => false,
    }
}

impl Endpoint {
    /// Whether credentials for this endpoint may go to `url` (a registry-supplied `Link` or
    /// upload `Location`): the same host and port, and no downgrade to plain HTTP that the
    /// endpoint was never allowed (only `plain_http` endpoints and loopback may use http).
    fn owns(&self, url: &url::Url) -> bool {
        let Some(h) = url.host_str() else {
            return false;
        };
        let host_port = match url.port() {
            Some(p) => format!("{h}:{p}"),
            None => h.to_string(),
        };
        host_port == self.host
            && (url.scheme() == "https" || self.scheme == Some("http") || is_loopback(h))
    }
}

/// Why a request was not sent or not answered.
#[derive(Debug)]
enum Sent {
    /// The endpoint's HTTP client could not be built (hosts.toml TLS files).
    Config(ClientError),
    Http(reqwest::Error),
}

/// Where a request goes.
#[derive(Debug, Clone)]
enum Target {
    /// A path (with query) under the endpoint, e.g. `/v2/a/b/manifests/x`.
    Path(String),
    /// An absolute URL the registry handed out (upload Location, Link next).
    Url(url::Url),
}

/// One logical request, replayable (retries, re-auth, redirects).
#[derive(Debug, Clone)]
struct Call {
    method: Method,
    target: Target,
    headers: HeaderMap,
    body: Option<Bytes>,
    /// Needs push access (else pull).
    push: bool,
    /// Another repository this call needs pull access to (cross-repository mount).
    mount_from: Option<String>,
    /// Which hosts may serve it (mirrors for reads, by capability).
    want: Want,
    /// For NotFound messages.
    what: String,
}

impl Call {
    fn new(method: Method, path: String, what: String) -> Self {
        let read = method == Method::GET || method == Method::HEAD;
        let want = if !read {
            Want::Origin
        } else if resolves_a_tag(&path) {
            Want::Resolve
        } else {
            Want::Pull
        };
        Call {
            method,
            target: Target::Path(path),
            headers: HeaderMap::new(),
            body: None,
            push: !read,
            mount_from: None,
            want,
            what,
        }
    }

    fn header(mut self, name: HeaderName, value: &str) -> Result<Self, ClientError> {
        let v = HeaderValue::from_str(value).map_err(|e| ClientError::Invalid {
            what: format!("header {name}"),
            reason: e.to_string(),
        })?;
        self.headers.insert(name, v);
        Ok(self)
    }

    fn scope(&self, repo: &Repo) -> String {
        let actions = if self.push { "pull,push" } else { "pull" };
        let mut s = format!("repository:{}:{actions}", repo.repository);
        if let Some(from) = &self.mount_from {
            s.push_str(&format!(" repository:{from}:pull"));
        }
        s
    }
}

#[derive(Debug)]
struct Inner {
    cfg: ClientConfig,
    http: reqwest::Client,
    http_insecure: reqwest::Client,
    auth: AuthState,
    /// Scheme learned per host (`http` after a loopback registry refused TLS).
    schemes: Mutex<HashMap<String, &'static str>>,
    /// Credentials resolved per (host, repository).
    secrets: tokio::sync::Mutex<HashMap<(String, RepositoryName), HostSecret>>,
    /// Registries that answered a request for several ranges with the whole blob: asked
    /// one range per request from then on (see [`Client::blob_ranges`]).
    single_range: Mutex<HashSet<String>>,
    /// hosts.toml per registry, read on the registry's first use (`None`: no host
    /// directory applies).
    hosts: Mutex<HashMap<String, Option<Arc<hosts::HostsFile>>>>,
    /// HTTP clients built for hosts.toml TLS settings (CA files, client certificates).
    tls_clients: Mutex<HashMap<Arc<TlsKey>, reqwest::Client>>,
    /// Kubelet credential provider plugins (they cache their own answers, with expiry).
    providers: Option<credprovider::CredentialProviders>,
    /// Credentials callers handed to pulls (CRI `PullImage`), per repository.
    pull_secrets: Arc<pullsecrets::PullSecrets>,
}

/// Most registries whose hosts.toml a client keeps parsed (more are read each time).
const MAX_HOSTS_CACHED: usize = 1024;
/// Most distinct TLS settings a client keeps a dedicated HTTP client for.
const MAX_TLS_CLIENTS: usize = 256;
/// Largest CA or client certificate file read.
const MAX_PEM_BYTES: u64 = 1 << 20;

fn read_pem(path: &std::path::Path) -> Result<Vec<u8>, ClientError> {
    use std::io::Read;
    let io = |source| ClientError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut out = Vec::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(io)?;
    if out.len() as u64 > MAX_PEM_BYTES {
        return Err(ClientError::Config(format!(
            "{} is larger than {MAX_PEM_BYTES} bytes",
            path.display()
        )));
    }
    Ok(out)
}

/// One HTTP client (pool) with the given TLS settings.
fn build_http(
    cfg: &ClientConfig,
    insecure: bool,
    tls: Option<&TlsKey>,
) -> Result<reqwest::Client, ClientError> {
    let mut b = reqwest::Client::builder()
        .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(cfg.connect_timeout)
        .read_timeout(cfg.idle_timeout)
        .pool_idle_timeout(std::time::Duration::from_secs(90))
        .redirect(reqwest::redirect::Policy::none())
        .danger_accept_invalid_certs(insecure);
    if let Some(tls) = tls {
        if let Some(d) = tls.dial_timeout {
            b = b.connect_timeout(d);
        }
        for ca in &tls.files.ca {
            let pem = read_pem(ca)?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                ClientError::Config(format!("CA file {}: {}", ca.display(), error_chain(&e)))
            })?;
            if certs.is_empty() {
                return Err(ClientError::Config(format!(
                    "CA file {} holds no PEM certificate",
                    ca.display()
                )));
            }
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        if tls.files.client.len() > 1 {
            tracing::warn!(
                "hosts.toml names {} client certificates for one host; ferry presents the first",
                tls.files.client.len()
            );
        }
        if let Some((cert, key)) = tls.files.client.first() {
            // One PEM buffer holding the certificate chain and the key, as rustls wants.
            let mut pem = read_pem(cert)?;
            if let Some(key) = key {
                pem.push(b'\n');
                pem.extend(read_pem(key)?);
            }
            let id = reqwest::Identity::from_pem(&pem).map_err(|e| {
                ClientError::Config(format!(
                    "client certificate {}{}: {}",
                    cert.display(),
                    key.as_ref()
                        .map(|k| format!(" with key {}", k.display()))
                        .unwrap_or_default(),
                    error_chain(&e)
                ))
            })?;
            b = b.identity(id);
        }
    }
    b.build()
        .map_err(|e| ClientError::Config(format!("HTTP client: {}", error_chain(&e))))
}

/// A registry client: cheap to clone; clones share the connection pool and token cache.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
    /// Skip pull mirrors: ask the registry itself (see [`Client::origin_only`]).
    origin_only: bool,
}

/// Result of a manifest PUT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutManifest {
    pub digest: String,
    /// The registry said it indexed the manifest's `subject` (`OCI-Subject` header), so
    /// the referrers tag fallback need not be maintained.
    pub subject_indexed: bool,
}

impl Client {
    /// Builds a client (no network traffic yet).
    pub fn new(cfg: ClientConfig) -> Result<Client, ClientError> {
        let providers = match (
            &cfg.credential_provider_config,
            &cfg.credential_provider_bin_dir,
        ) {
            (None, _) => None,
            (Some(config), Some(bin_dir)) => Some(
                credprovider::CredentialProviders::load(config, bin_dir)
                    .map_err(|e| ClientError::Config(e.to_string()))?,
            ),
            (Some(config), None) => {
                return Err(ClientError::Config(format!(
                    "credential provider config {} needs a plugin directory \
                     (credential_provider_bin_dir)",
                    config.display()
                )));
            }
        };
        Self::with_credential_providers(cfg, providers)
    }

    /// Builds a client that asks `providers` for credentials no other source has
    /// (whatever `cfg` says about provider files).
    pub fn with_credential_providers(
        cfg: ClientConfig,
        providers: Option<credprovider::CredentialProviders>,
    ) -> Result<Client, ClientError> {
        let build = |insecure: bool| build_http(&cfg, insecure, None);
        if cfg.max_attempts == 0 || cfg.chunk_size == 0 || cfg.max_concurrent_downloads == 0 {
            return Err(ClientError::Config(
                "client config: max_attempts, chunk_size and max_concurrent_downloads must be at least 1"
                    .into(),
            ));
        }
        Ok(Client {
            inner: Arc::new(Inner {
                http: build(false)?,
                http_insecure: build(true)?,
                cfg,
                auth: AuthState::default(),
                schemes: Mutex::new(HashMap::new()),
                secrets: tokio::sync::Mutex::new(HashMap::new()),
                single_range: Mutex::new(HashSet::new()),
                hosts: Mutex::new(HashMap::new()),
                tls_clients: Mutex::new(HashMap::new()),
                providers,
                pull_secrets: Arc::default(),
            }),
            origin_only: false,
        })
    }

    /// A clone that never uses pull mirrors, for refetching from the registry itself
    /// what a mirror served wrong (a digest mismatch). Shares the pool and tokens.
    pub fn origin_only(&self) -> Client {
        Client {
            inner: self.inner.clone(),
            origin_only: true,
        }
    }

    /// True when reads from `registry` may be served by a pull mirror.
    pub fn has_mirrors(&self, registry: &str) -> bool {
        !self.origin_only
            && self
                .endpoints(registry, Want::Pull)
                .is_ok_and(|eps| eps.iter().any(|ep| ep.mirror))
    }

    /// The credentials callers handed to pulls (CRI `PullImage`), which this client uses
    /// for their repositories before any other source (see [`pullsecrets`]).
    pub fn pull_secrets(&self) -> &Arc<pullsecrets::PullSecrets> {
        &self.inner.pull_secrets
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    /// How many bearer tokens this client has fetched (diagnostics, tests).
    pub fn tokens_fetched(&self) -> u64 {
        self.inner
            .auth
            .fetched
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn registry_config(&self, registry: &str) -> RegistryConfig {
        self.inner
            .cfg
            .registry
            .get(registry)
            .cloned()
            .unwrap_or_default()
    }

    /// The hosts.toml that applies to `registry` (`config_path`), parsed once.
    fn hosts_for(&self, registry: &str) -> Result<Option<Arc<hosts::HostsFile>>, ClientError> {
        let Some(root) = self
            .inner
            .cfg
            .config_path
            .as_ref()
            .filter(|p| !p.as_os_str().is_empty())
        else {
            return Ok(None);
        };
        if let Some(h) = self.inner.hosts.lock().get(registry) {
            return Ok(h.clone());
        }
        let loaded = hosts::load(root, registry)
            .map_err(|e| ClientError::Config(format!("registry host config: {e}")))?
            .map(Arc::new);
        if let Some(h) = &loaded {
            tracing::debug!(registry, source = %h.source.display(), hosts = h.hosts.len(), "registry host config");
            if !h.ignored_keys.is_empty() {
                tracing::warn!(file = %h.source.display(), keys = ?h.ignored_keys, "ignoring keys ferry (and containerd) do not know");
            }
            if !self.registry_config(registry).mirrors.is_empty() {
                tracing::warn!(registry, file = %h.source.display(), "hosts.toml applies to this registry: the client config's mirrors for it are not used");
            }
        }
        let mut cache = self.inner.hosts.lock();
        if cache.len() < MAX_HOSTS_CACHED {
            cache.insert(registry.to_string(), loaded.clone());
        }
        Ok(loaded)
    }

    /// An endpoint for a host of a hosts.toml. `fallback`: ferry's own table for the
    /// host, for what hosts.toml leaves unsaid (plain HTTP, skip verify).
    fn hosts_endpoint(
        loc_host: String,
        scheme: Option<&'static str>,
        root: &str,
        settings: &hosts::HostSettings,
        fallback: &RegistryConfig,
        mirror: bool,
    ) -> Endpoint {
        let skip = settings.tls.skip_verify.unwrap_or(fallback.skip_tls_verify);
        let dedicated = !settings.tls.ca.is_empty()
            || !settings.tls.client.is_empty()
            || settings.dial_timeout.is_some();
        Endpoint {
            host: loc_host,
            scheme: scheme.or(fallback.plain_http.then_some("http")),
            skip_tls_verify: skip,
            mirror,
            root: (root != "/v2").then(|| Arc::from(root)),
            tls: dedicated.then(|| {
                Arc::new(TlsKey {
                    files: settings.tls.clone(),
                    skip_verify: skip,
                    dial_timeout: settings.dial_timeout,
                })
            }),
            headers: settings.headers.clone().into(),
        }
    }

    /// Where a call for `registry` may go, in order: mirrors (hosts.toml hosts with the
    /// capability `want` needs, else the client config's `mirrors` for reads), then the
    /// registry itself (hosts.toml `server`, else the host; docker.io is reached at
    /// registry-1.docker.io).
    fn endpoints(&self, registry: &str, want: Want) -> Result<Vec<Endpoint>, ClientError> {
        let rc = self.registry_config(registry);
        let origin_host = if registry == "docker.io" || registry == "index.docker.io" {
            "registry-1.docker.io".to_string()
        } else {
            registry.to_string()
        };
        let mut out = Vec::new();
        if let Some(h) = self.hosts_for(registry)? {
            if want != Want::Origin {
                for e in &h.hosts {
                    if want.allowed(&e.settings.capabilities) {
                        let mc = self.registry_config(&e.location.host);
                        out.push(Self::hosts_endpoint(
                            e.location.host.clone(),
                            e.location.scheme,
                            &e.location.root,
                            &e.settings,
                            &mc,
                            true,
                        ));
                    }
                }
            }
            if want.allowed(&h.server_settings.capabilities) {
                let (host, scheme, root) = match &h.server {
                    Some(loc) => (
                        if loc.host == "docker.io" {
                            origin_host.clone()
                        } else {
                            loc.host.clone()
                        },
                        loc.scheme,
                        loc.root.as_str(),
                    ),
                    None => (origin_host, None, "/v2"),
                };
                out.push(Self::hosts_endpoint(
                    host,
                    scheme,
                    root,
                    &h.server_settings,
                    &rc,
                    false,
                ));
            }
            if out.is_empty() {
                return Err(ClientError::Config(format!(
                    "{}: no host has the capability to {} for {registry}",
                    h.source.display(),
                    if want == Want::Resolve {
                        "resolve tags"
                    } else {
                        "pull"
                    }
                )));
            }
            return Ok(out);
        }
        if want != Want::Origin {
            for m in &rc.mirrors {
                let (scheme, rest) = if let Some(r) = m.strip_prefix("http://") {
                    (Some("http"), r)
                } else if let Some(r) = m.strip_prefix("https://") {
                    (Some("https"), r)
                } else {
                    (None, m.as_str())
                };
                let host = rest.trim_end_matches('/').to_string();
                if host.is_empty() || host.contains('/') {
                    tracing::warn!(mirror = %m, "ignoring a mirror that is not [scheme://]host[:port]");
                    continue;
                }
                let mc = self.registry_config(&host);
                out.push(Endpoint {
                    scheme: scheme.or(mc.plain_http.then_some("http")),
                    skip_tls_verify: mc.skip_tls_verify,
                    host,
                    mirror: true,
                    root: None,
                    tls: None,
                    headers: Arc::from([]),
                });
            }
        }
        out.push(Endpoint {
            host: origin_host,
            scheme: rc.plain_http.then_some("http"),
            skip_tls_verify: rc.skip_tls_verify,
            mirror: false,
            root: None,
            tls: None,
            headers: Arc::from([]),
        });
        Ok(out)
    }

    /// The registry itself (never a mirror).
    fn origin(&self, registry: &str) -> Result<Endpoint, ClientError> {
        self.endpoints(registry, Want::Origin)?
            .pop()
            .ok_or_else(|| ClientError::Config(format!("no endpoint for {registry}")))
    }

    fn scheme_of(&self, ep: &Endpoint) -> &'static str {
        ep.scheme
            .or_else(|| self.inner.schemes.lock().get(&ep.host).copied())
            .unwrap_or("https")
    }

    /// After a transport error over https to a loopback host that has not been seen to
    /// speak TLS, switch it to http. Returns whether it switched.
    fn fall_back_to_http(&self, ep: &Endpoint) -> bool {
        if ep.scheme.is_some() || !is_loopback(&ep.host) {
            return false;
        }
        let mut schemes = self.inner.schemes.lock();
        if schemes.contains_key(&ep.host) {
            return false;
        }
        tracing::debug!(host = %ep.host, "no TLS on loopback registry; using plain HTTP");
        schemes.insert(ep.host.clone(), "http");
        true
    }

    fn remember_scheme(&self, ep: &Endpoint, scheme: &'static str) {
        if ep.scheme.is_none() {
            self.inner
                .schemes
                .lock()
                .entry(ep.host.clone())
                .or_insert(scheme);
        }
    }

    fn http_for(&self, ep: &Endpoint) -> Result<reqwest::Client, ClientError> {
        let Some(key) = &ep.tls else {
            return Ok(if ep.skip_tls_verify {
                self.inner.http_insecure.clone()
            } else {
                self.inner.http.clone()
            });
        };
        if let Some(c) = self.inner.tls_clients.lock().get(key) {
            return Ok(c.clone());
        }
        // Built outside the lock: it reads certificate files.
        let c = build_http(&self.inner.cfg, key.skip_verify, Some(key)).map_err(|e| {
            ClientError::Config(format!("TLS settings of {} (hosts.toml): {e}", ep.host))
        })?;
        let mut cache = self.inner.tls_clients.lock();
        if cache.len() < MAX_TLS_CLIENTS {
            cache.insert(key.clone(), c.clone());
        }
        Ok(c)
    }

    /// Credentials for a host: those a caller handed to a pull of this very repository
    /// (CRI `PullImage`; the registry itself, not its mirrors), then explicit config,
    /// then docker/podman auth files (both kept for the client's life), then kubelet
    /// credential provider plugins (their answers expire, so they are asked each time and
    /// cache on their own).
    async fn secret_for(&self, ep: &Endpoint, repo: &Repo) -> HostSecret {
        if !ep.mirror
            && let Some(u) = self
                .inner
                .pull_secrets
                .get(&repo.registry, repo.repository.as_str())
        {
            return HostSecret {
                basic: u.basic,
                identity_token: u.identity_token,
                from_provider: false,
            };
        }
        let name = if ep.mirror { &ep.host } else { &repo.registry };
        let key = (name.clone(), repo.repository.clone());
        let fixed = {
            let mut cache = self.inner.secrets.lock().await;
            match cache.get(&key) {
                Some(s) => s.clone(),
                None => {
                    let explicit = self.registry_config(name).credentials;
                    let secret = match explicit {
                        Some(c) => HostSecret {
                            basic: Some(c),
                            ..HostSecret::default()
                        },
                        None if self.inner.cfg.use_auth_files => {
                            credentials::lookup(name, repo.repository.as_str()).await
                        }
                        None => HostSecret::default(),
                    };
                    cache.insert(key, secret.clone());
                    secret
                }
            }
        };
        if !fixed.is_anonymous() {
            return fixed;
        }
        if let Some(providers) = &self.inner.providers {
            match providers.credentials(name, repo.repository.as_str()).await {
                Ok(Some(c)) => {
                    return HostSecret {
                        basic: Some(c),
                        identity_token: None,
                        from_provider: true,
                    };
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    registry = %name,
                    repository = %repo.repository,
                    error = %e,
                    "no credentials from the credential provider; going on without them"
                ),
            }
        }
        fixed
    }

    /// Drops the plugin credentials the registry refused for `ep`/`repo`.
    fn forget_provider_secret(&self, ep: &Endpoint, repo: &Repo) {
        if let Some(providers) = &self.inner.providers {
            let name = if ep.mirror { &ep.host } else { &repo.registry };
            providers.forget(name, repo.repository.as_str());
        }
    }

    fn url_for(&self, ep: &Endpoint, target: &Target) -> Result<url::Url, ClientError> {
        let s = match target {
            Target::Url(u) => return Ok(u.clone()),
            Target::Path(p) => match (&ep.root, p.strip_prefix("/v2")) {
                (Some(root), Some(rest)) => {
                    format!("{}://{}{root}{rest}", self.scheme_of(ep), ep.host)
                }
                _ => format!("{}://{}{}", self.scheme_of(ep), ep.host, p),
            },
        };
        url::Url::parse(&s).map_err(|e| ClientError::Invalid {
            what: format!("URL {s}"),
            reason: e.to_string(),
        })
    }

    /// Sends one request, following redirects by hand: the Authorization header is kept
    /// only while the host stays the same.
    async fn send_following_redirects(
        &self,
        ep: &Endpoint,
        mut url: url::Url,
        call: &Call,
        mut auth: Option<String>,
    ) -> Result<reqwest::Response, Sent> {
        let origin = origin_of(&url);
        let http = self.http_for(ep).map_err(Sent::Config)?;
        let mut method = call.method.clone();
        let mut body = call.body.clone();
        let mut hops = 0;
        loop {
            if origin_of(&url) != origin {
                auth = None;
            }
            let mut req = http.request(method.clone(), url.clone());
            // hosts.toml headers are for that host, like credentials: not across hosts.
            if origin_of(&url) == origin {
                for (name, value) in ep.headers.iter() {
                    req = req.header(name, value);
                }
            }
            req = req.headers(call.headers.clone());
            if let Some(a) = &auth {
                req = req.header(header::AUTHORIZATION, a);
            }
            if let Some(b) = &body {
                req = req.body(b.clone());
            } else if method == Method::PUT || method == Method::POST || method == Method::PATCH {
                req = req.header(header::CONTENT_LENGTH, "0");
            }
            let resp = req.send().await.map_err(Sent::Http)?;
            let status = resp.status().as_u16();
            let location = resp
                .headers()
                .get(header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|l| resp.url().join(l).ok());
            match (status, location) {
                (301 | 302 | 303 | 307 | 308, Some(next)) if hops < MAX_REDIRECTS => {
                    if !matches!(next.scheme(), "http" | "https") {
                        return Ok(resp);
                    }
                    hops += 1;
                    if status == 303 || ((status == 301 || status == 302) && method == Method::POST)
                    {
                        method = Method::GET;
                        body = None;
                    }
                    url = next;
                }
                _ => return Ok(resp),
            }
        }
    }

    /// Runs a call against mirrors (reads) then the registry.
    async fn execute(&self, repo: &Repo, call: &Call) -> Result<reqwest::Response, ClientError> {
        check_repo(repo)?;
        let want = if self.origin_only || !matches!(call.target, Target::Path(_)) {
            Want::Origin
        } else {
            call.want
        };
        let endpoints = self.endpoints(&repo.registry, want)?;
        for ep in &endpoints {
            match self.execute_on(ep, repo, call).await {
                Ok(resp) => return Ok(resp),
                Err(e) if ep.mirror => {
                    tracing::info!(mirror = %ep.host, error = %e, "mirror failed; trying the next");
                }
                Err(e) => return Err(e),
            }
        }
        Err(ClientError::Config(format!(
            "no endpoint for {}",
            repo.registry
        )))
    }

    /// Runs a call against one endpoint: auth challenges, retries, loopback http fallback.
    async fn execute_on(
        &self,
        ep: &Endpoint,
        repo: &Repo,
        call: &Call,
    ) -> Result<reqwest::Response, ClientError> {
        let scope = call.scope(repo);
        let mut secret = self.secret_for(ep, repo).await;
        let max_attempts = self.inner.cfg.max_attempts.max(1);
        let mut attempt = 1u32;
        let mut reauthenticated = false;
        let mut force_token = false;
        // Plugin credentials the registry refused are dropped and asked for again, once
        // (they expired or were rotated early); refused again, they are dropped for good.
        let mut provider_refreshed = false;
        loop {
            let url = self.url_for(ep, &call.target)?;
            let same_host = match &call.target {
                Target::Path(_) => true,
                Target::Url(u) => ep.owns(u),
            };
            let auth = if same_host {
                match self
                    .inner
                    .auth
                    .authorize(&self.http_for(ep)?, &ep.host, &scope, &secret, force_token)
                    .await
                {
                    Ok(a) => a,
                    Err(ClientError::Unauthorized { registry, message })
                        if secret.from_provider =>
                    {
                        self.forget_provider_secret(ep, repo);
                        if provider_refreshed {
                            return Err(ClientError::Unauthorized {
                                registry,
                                message: format!(
                                    "credentials from the kubelet credential provider were \
                                     refused, also after asking it again: {message}"
                                ),
                            });
                        }
                        provider_refreshed = true;
                        secret = self.secret_for(ep, repo).await;
                        force_token = true;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            } else {
                None
            };
            force_token = false;
            let scheme = if url.scheme() == "http" {
                "http"
            } else {
                "https"
            };
            let result = self.send_following_redirects(ep, url, call, auth).await;
            let resp = match result {
                Ok(resp) => {
                    if matches!(call.target, Target::Path(_)) {
                        self.remember_scheme(ep, scheme);
                    }
                    resp
                }
                Err(Sent::Config(e)) => return Err(e),
                Err(Sent::Http(e)) => {
                    // A concurrent first request may have switched the host to http
                    // meanwhile: follow it, rather than count this as a failure (which
                    // cost a retry's backoff, or the call when retries are off).
                    if matches!(call.target, Target::Path(_))
                        && scheme == "https"
                        && (self.fall_back_to_http(ep) || self.scheme_of(ep) == "http")
                    {
                        continue;
                    }
                    let err = ClientError::Transport {
                        registry: ep.host.clone(),
                        message: error_chain(&e),
                    };
                    // A mirror that cannot be reached is not waited for: the next
                    // endpoint (at last the registry itself) serves the call.
                    if attempt < max_attempts && !ep.mirror {
                        retry::sleep(&self.inner.cfg, attempt, None).await;
                        attempt += 1;
                        continue;
                    }
                    return Err(err);
                }
            };
            let status = resp.status().as_u16();
            if resp.status().is_success() {
                return Ok(resp);
            }
            match status {
                401 => {
                    let challenges: Vec<_> = resp
                        .headers()
                        .get_all(header::WWW_AUTHENTICATE)
                        .iter()
                        .filter_map(|v| v.to_str().ok())
                        .flat_map(auth::parse_challenges)
                        .collect();
                    if !reauthenticated
                        && same_host
                        && self
                            .inner
                            .auth
                            .remember_challenge(&ep.host, &challenges)
                            .is_some()
                    {
                        reauthenticated = true;
                        force_token = true;
                        self.inner.auth.invalidate(&ep.host, &scope);
                        continue;
                    }
                    if secret.from_provider && same_host {
                        self.forget_provider_secret(ep, repo);
                        if !provider_refreshed {
                            provider_refreshed = true;
                            secret = self.secret_for(ep, repo).await;
                            force_token = true;
                            self.inner.auth.invalidate(&ep.host, &scope);
                            continue;
                        }
                    }
                    let msg = error_message(resp).await;
                    let why = if secret.is_anonymous() {
                        format!("{msg} (no credentials were found for {})", ep.host)
                    } else if secret.from_provider {
                        format!(
                            "{msg} (credentials from the kubelet credential provider were \
                             refused, also after asking it again)"
                        )
                    } else {
                        format!("{msg} (credentials were refused)")
                    };
                    return Err(auth::unauthorized(&ep.host, &why));
                }
                403 => {
                    let msg = error_message(resp).await;
                    return Err(ClientError::Denied {
                        registry: ep.host.clone(),
                        message: format!(
                            "{msg}; the account has no {} access to {}",
                            if call.push { "push" } else { "pull" },
                            repo.repository
                        ),
                    });
                }
                404 => {
                    return Err(ClientError::NotFound {
                        what: format!("{} at {}", call.what, ep.host),
                    });
                }
                429 | 500..=599 if attempt < max_attempts => {
                    let wait = retry::retry_after(resp.headers());
                    retry::sleep(&self.inner.cfg, attempt, wait).await;
                    attempt += 1;
                    continue;
                }
                _ => {
                    let path = resp.url().path().to_string();
                    let message = error_message(resp).await;
                    return Err(ClientError::Status {
                        registry: ep.host.clone(),
                        method: call.method.to_string(),
                        path,
                        status,
                        message,
                    });
                }
            }
        }
    }

    // ------------------------------------------------------------------ manifests

    /// GETs a manifest by tag or digest; verifies its digest (the requested one, else the
    /// registry's `Docker-Content-Digest`). `accept` empty means every manifest type. A
    /// document a mirror served that does not verify is fetched again from the registry
    /// itself.
    pub async fn get_manifest(
        &self,
        r: &Repo,
        reference: &str,
        accept: &[&str],
    ) -> Result<Manifest, ClientError> {
        match self.get_manifest_once(r, reference, accept).await {
            Err(ClientError::DigestMismatch { expected, actual })
                if self.has_mirrors(&r.registry) =>
            {
                tracing::warn!(%r, %expected, %actual, "a mirror served a manifest that does not verify; asking the registry itself");
                self.origin_only()
                    .get_manifest_once(r, reference, accept)
                    .await
            }
            other => other,
        }
    }

    /// A whole blob of at most `max` bytes (`what` names it in errors), checked against
    /// its digest. Bytes a mirror served that do not verify (or that it failed to
    /// serve) are fetched again from the registry itself; what reaches the caller
    /// always verified.
    pub async fn blob_verified(
        &self,
        r: &Repo,
        digest: &str,
        max: u64,
        what: &str,
    ) -> Result<Vec<u8>, ClientError> {
        check_digest(digest)?;
        let once = |c: Client| {
            let what = what.to_string();
            let (r, digest) = (r.clone(), digest.to_string());
            async move {
                let bytes = c
                    .blob_stream(&r, &digest, None)
                    .await?
                    .collect_body(&what, max)
                    .await?;
                let actual = sha256_hex_digest(&bytes);
                if actual != digest {
                    return Err(ClientError::DigestMismatch {
                        expected: digest,
                        actual,
                    });
                }
                Ok(bytes)
            }
        };
        match once(self.clone()).await {
            Err(e)
                if self.has_mirrors(&r.registry) && !matches!(e, ClientError::TooLarge { .. }) =>
            {
                tracing::warn!(%r, %digest, error = %e, "{what} from a mirror failed or did not verify; asking the registry itself");
                once(self.origin_only()).await
            }
            other => other,
        }
    }

    async fn get_manifest_once(
        &self,
        r: &Repo,
        reference: &str,
        accept: &[&str],
    ) -> Result<Manifest, ClientError> {
        check_reference(reference)?;
        let accept = if accept.is_empty() {
            MANIFEST_TYPES.join(", ")
        } else {
            accept.join(", ")
        };
        let call = Call::new(
            Method::GET,
            format!("/v2/{}/manifests/{reference}", r.repository),
            format!("manifest {r}:{reference}"),
        )
        .header(header::ACCEPT, &accept)?;
        let resp = self.execute(r, &call).await?;
        let header_digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let content_type = content_type(resp.headers());
        let bytes = read_body_bounded(
            resp,
            ferry_oci::MAX_MANIFEST_BYTES,
            &r.registry,
            &format!("manifest {r}:{reference}"),
        )
        .await?;
        let digest = sha256_hex_digest(&bytes);
        let expected = if reference.starts_with("sha256:") {
            Some(reference.to_string())
        } else {
            header_digest.filter(|d| d.starts_with("sha256:"))
        };
        if let Some(expected) = expected
            && expected != digest
        {
            return Err(ClientError::DigestMismatch {
                expected,
                actual: digest,
            });
        }
        let media_type = document_media_type(&bytes).unwrap_or(content_type);
        Ok(Manifest {
            digest,
            media_type,
            bytes,
        })
    }

    /// HEADs a manifest: its digest, media type and size, or `None` if absent.
    pub async fn head_manifest(
        &self,
        r: &Repo,
        reference: &str,
        accept: &[&str],
    ) -> Result<Option<ManifestHead>, ClientError> {
        check_reference(reference)?;
        let accept = if accept.is_empty() {
            MANIFEST_TYPES.join(", ")
        } else {
            accept.join(", ")
        };
        let call = Call::new(
            Method::HEAD,
            format!("/v2/{}/manifests/{reference}", r.repository),
            format!("manifest {r}:{reference}"),
        )
        .header(header::ACCEPT, &accept)?;
        let resp = match self.execute(r, &call).await {
            Ok(resp) => resp,
            Err(ClientError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let header_digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .filter(|d| check_digest(d).is_ok())
            .map(str::to_string);
        let size = resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let media_type = content_type(resp.headers());
        match (header_digest, size) {
            (Some(digest), Some(size)) => Ok(Some(ManifestHead {
                digest,
                media_type,
                size,
            })),
            // The registry did not say: fetch the document to learn it.
            _ => {
                let m = self.get_manifest(r, reference, &[&accept]).await?;
                Ok(Some(ManifestHead {
                    digest: m.digest,
                    media_type: m.media_type,
                    size: m.bytes.len() as u64,
                }))
            }
        }
    }

    /// PUTs a manifest under a tag or its digest; returns its digest.
    pub async fn put_manifest(
        &self,
        r: &Repo,
        reference: &str,
        media_type: &str,
        bytes: Bytes,
    ) -> Result<String, ClientError> {
        Ok(self
            .put_manifest_detailed(r, reference, media_type, bytes)
            .await?
            .digest)
    }

    /// [`Client::put_manifest`], also reporting whether the registry indexed the subject.
    pub async fn put_manifest_detailed(
        &self,
        r: &Repo,
        reference: &str,
        media_type: &str,
        bytes: Bytes,
    ) -> Result<PutManifest, ClientError> {
        check_reference(reference)?;
        if bytes.len() as u64 > ferry_oci::MAX_MANIFEST_BYTES {
            return Err(ClientError::TooLarge {
                what: "manifest".into(),
                limit: ferry_oci::MAX_MANIFEST_BYTES,
            });
        }
        let digest = sha256_hex_digest(&bytes);
        if reference.starts_with("sha256:") && reference != digest {
            return Err(ClientError::DigestMismatch {
                expected: reference.to_string(),
                actual: digest,
            });
        }
        let mut call = Call::new(
            Method::PUT,
            format!("/v2/{}/manifests/{reference}", r.repository),
            format!("repository {r}"),
        )
        .header(header::CONTENT_TYPE, media_type)?;
        call.body = Some(bytes);
        let resp = self.execute(r, &call).await?;
        if let Some(d) = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            && d.starts_with("sha256:")
            && d != digest
        {
            return Err(ClientError::DigestMismatch {
                expected: digest,
                actual: d.to_string(),
            });
        }
        let subject_indexed = resp.headers().contains_key("oci-subject");
        Ok(PutManifest {
            digest,
            subject_indexed,
        })
    }

    // ------------------------------------------------------------------ blobs

    /// Size of a blob (HEAD), or `None` if the repository does not have it.
    pub async fn blob_size(&self, r: &Repo, digest: &str) -> Result<Option<u64>, ClientError> {
        check_digest(digest)?;
        let call = Call::new(
            Method::HEAD,
            format!("/v2/{}/blobs/{digest}", r.repository),
            format!("blob {digest} in {r}"),
        );
        match self.execute(r, &call).await {
            Ok(resp) => Ok(resp
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())),
            Err(ClientError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The `Authorization` value this client sends the registry itself (never a mirror)
    /// for pull access to `r`, fetching a token if the cached one is stale; `None` when
    /// the registry has not asked for credentials yet (anonymous so far). For a daemon
    /// that forwards it to a peer, which proves the pull right by asking the registry
    /// ([`Client::may_pull_with`]); the value is a secret and must not be logged.
    pub async fn pull_authorization(&self, r: &Repo) -> Result<Option<String>, ClientError> {
        check_repo(r)?;
        let ep = self.origin(&r.registry)?;
        let secret = self.secret_for(&ep, r).await;
        let scope = format!("repository:{}:pull", r.repository);
        self.inner
            .auth
            .authorize(&self.http_for(&ep)?, &ep.host, &scope, &secret, false)
            .await
    }

    /// Asks the registry itself (no mirror, none of this client's own credentials)
    /// whether `authorization` — an `Authorization` value a peer forwarded, or `None` for
    /// anonymous — may read blob `digest` of `r`: a `HEAD` of the blob with exactly that
    /// header. `Ok(false)` when the registry refuses (401, 403) or the repository does not
    /// have the blob (404); an error when it cannot say (transport, 5xx). Redirects are
    /// not followed: a registry that redirects an authorized blob read to its storage has
    /// said yes.
    pub async fn may_pull_with(
        &self,
        r: &Repo,
        digest: &str,
        authorization: Option<&str>,
    ) -> Result<bool, ClientError> {
        check_repo(r)?;
        check_digest(digest)?;
        let ep = self.origin(&r.registry)?;
        let target = Target::Path(format!("/v2/{}/blobs/{digest}", r.repository));
        let mut switched = false;
        loop {
            let url = self.url_for(&ep, &target)?;
            let https = url.scheme() == "https";
            let mut req = self.http_for(&ep)?.head(url);
            if let Some(a) = authorization {
                let v = HeaderValue::from_str(a).map_err(|e| ClientError::Invalid {
                    what: "forwarded authorization".into(),
                    reason: e.to_string(),
                })?;
                req = req.header(header::AUTHORIZATION, v);
            }
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    return match status {
                        200..=299 | 301 | 302 | 303 | 307 | 308 => Ok(true),
                        401 | 403 | 404 => Ok(false),
                        _ => Err(ClientError::Status {
                            registry: ep.host.clone(),
                            method: "HEAD".into(),
                            path: format!("/v2/{}/blobs/{digest}", r.repository),
                            status,
                            message: String::new(),
                        }),
                    };
                }
                // The loopback registry that does not speak TLS, as for every other call.
                Err(_) if https && !switched && self.fall_back_to_http(&ep) => switched = true,
                Err(_) if https && !switched && self.scheme_of(&ep) == "http" => switched = true,
                Err(e) => {
                    return Err(ClientError::Transport {
                        registry: ep.host.clone(),
                        message: error_chain(&e),
                    });
                }
            }
        }
    }

    /// Streams a blob, or the byte `range` of it. When a server ignores the Range header
    /// (200 instead of 206) the stream skips to the start itself, so the caller still gets
    /// exactly the range.
    pub async fn blob_stream(
        &self,
        r: &Repo,
        digest: &str,
        range: Option<Range<u64>>,
    ) -> Result<BlobStream, ClientError> {
        Ok(self.open_blob(r, digest, range).await?.0)
    }

    /// [`Client::blob_stream`], also saying whether the server honoured the range (false:
    /// the body is the whole blob from its first byte).
    pub async fn open_blob(
        &self,
        r: &Repo,
        digest: &str,
        range: Option<Range<u64>>,
    ) -> Result<(BlobStream, bool), ClientError> {
        check_digest(digest)?;
        if let Some(rg) = &range {
            if rg.start > rg.end {
                return Err(ClientError::Invalid {
                    what: "range".into(),
                    reason: format!("{}..{} is backwards", rg.start, rg.end),
                });
            }
            if rg.start == rg.end {
                let empty: ByteStream = Box::pin(futures_util::stream::empty());
                return Ok((
                    BlobStream {
                        size: None,
                        body: empty,
                    },
                    true,
                ));
            }
        }
        let range_header = range
            .as_ref()
            .map(|rg| format!("bytes={}-{}", rg.start, rg.end - 1));
        let resp = self.get_blob(r, digest, range_header.as_deref()).await?;
        let status = resp.status().as_u16();
        let content_length = resp.content_length();
        let registry = r.registry.clone();
        match (range, status) {
            (Some(rg), 206) => {
                let (start, end, total) = resp
                    .headers()
                    .get(header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_content_range)
                    .ok_or_else(|| ClientError::Invalid {
                        what: format!("response for blob {digest}"),
                        reason: "206 without a usable Content-Range".into(),
                    })?;
                if start != rg.start || end + 1 > rg.end {
                    return Err(ClientError::Invalid {
                        what: format!("response for blob {digest}"),
                        reason: format!(
                            "asked for bytes {}..{}, got {}..{}",
                            rg.start,
                            rg.end,
                            start,
                            end + 1
                        ),
                    });
                }
                if end + 1 < rg.end {
                    return Err(ClientError::Invalid {
                        what: format!("range of blob {digest}"),
                        reason: format!(
                            "{}..{} reaches past the end of the blob ({} bytes)",
                            rg.start,
                            rg.end,
                            total.map_or("?".into(), |t| t.to_string())
                        ),
                    });
                }
                let body = exact_stream(byte_stream(resp, registry), 0, rg.end - rg.start);
                Ok((BlobStream { size: total, body }, true))
            }
            (Some(rg), _) => {
                tracing::debug!(%digest, "server ignored the Range header; skipping to the offset");
                if let Some(len) = content_length
                    && rg.end > len
                {
                    return Err(ClientError::Invalid {
                        what: format!("range of blob {digest}"),
                        reason: format!(
                            "{}..{} reaches past the end of the blob ({len} bytes)",
                            rg.start, rg.end
                        ),
                    });
                }
                let body = exact_stream(byte_stream(resp, registry), rg.start, rg.end - rg.start);
                Ok((
                    BlobStream {
                        size: content_length,
                        body,
                    },
                    false,
                ))
            }
            (None, _) => {
                let raw = byte_stream(resp, registry);
                let body = match content_length {
                    Some(len) => exact_stream(raw, 0, len),
                    None => raw,
                };
                Ok((
                    BlobStream {
                        size: content_length,
                        body,
                    },
                    true,
                ))
            }
        }
    }

    /// `GET` of blob `digest`, with `range` as its `Range` header; a 416 becomes an
    /// error saying the range lies past the blob's end.
    async fn get_blob(
        &self,
        r: &Repo,
        digest: &str,
        range: Option<&str>,
    ) -> Result<reqwest::Response, ClientError> {
        let mut call = Call::new(
            Method::GET,
            format!("/v2/{}/blobs/{digest}", r.repository),
            format!("blob {digest} in {r}"),
        );
        if let Some(range) = range {
            call = call.header(header::RANGE, range)?;
        }
        match self.execute(r, &call).await {
            Err(ClientError::Status {
                status: 416,
                registry,
                ..
            }) => Err(ClientError::Invalid {
                what: format!("range of blob {digest} at {registry}"),
                reason: "past the end of the blob (416)".into(),
            }),
            other => other,
        }
    }

    /// Bytes `range` of blob `digest`, collected (at most the range's length).
    pub async fn blob_range(
        &self,
        r: &Repo,
        digest: &str,
        range: Range<u64>,
    ) -> Result<Vec<u8>, ClientError> {
        let len = usize::try_from(range.end.saturating_sub(range.start)).map_err(|_| {
            ClientError::TooLarge {
                what: format!("range of blob {digest}"),
                limit: usize::MAX as u64,
            }
        })?;
        let mut body = self.blob_stream(r, digest, Some(range)).await?.body;
        let mut buf = Vec::with_capacity(len);
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| ClientError::Transport {
                registry: r.registry.clone(),
                message: e.to_string(),
            })?;
            buf.extend_from_slice(&piece);
        }
        Ok(buf)
    }

    /// Whether [`Client::blob_ranges`] asks `registry` for several ranges in one request
    /// (until it answers one such request with the whole blob).
    pub fn batches_ranges(&self, registry: &str) -> bool {
        !self.inner.single_range.lock().contains(registry)
    }

    /// Bytes of each of `ranges` of blob `digest` (sorted, not touching, at most
    /// [`byteranges::MAX_RANGES`]; see [`byteranges::check`]), in one request where the
    /// registry answers several ranges at once (`multipart/byteranges`, as Go's
    /// `http.ServeContent` behind Debian's registry and ferry's own do). A registry that
    /// answers with the whole blob instead is asked one range per request, concurrently,
    /// from then on; its answer is dropped unread.
    pub async fn blob_ranges(
        &self,
        r: &Repo,
        digest: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Vec<u8>>, ClientError> {
        check_digest(digest)?;
        byteranges::check(ranges).map_err(|reason| ClientError::Invalid {
            what: "ranges".into(),
            reason,
        })?;
        if ranges.len() == 1 || !self.batches_ranges(&r.registry) {
            return self.blob_ranges_one_by_one(r, digest, ranges).await;
        }
        let resp = self
            .get_blob(r, digest, Some(&byteranges::range_header(ranges)))
            .await?;
        if resp.status().as_u16() != 206 {
            tracing::info!(
                registry = %r.registry,
                status = resp.status().as_u16(),
                "the registry does not answer several ranges at once; one range per request from now on"
            );
            drop(resp);
            self.inner.single_range.lock().insert(r.registry.clone());
            return self.blob_ranges_one_by_one(r, digest, ranges).await;
        }
        let invalid = |reason: String| ClientError::Invalid {
            what: format!("answer for ranges of blob {digest}"),
            reason,
        };
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let single = resp
            .headers()
            .get(header::CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                parse_content_range(v)
                    .ok_or_else(|| invalid(format!("unusable Content-Range {v:?}")))
            })
            .transpose()?;
        // The ranges' bytes and ~150 bytes of headers per part are all a multipart
        // answer holds; no more is read (a stranger's answer never makes this allocate
        // more). A server that merged the ranges into larger ones (RFC 9110 allows it)
        // sends more: asked one range per request from then on, like one that ignores
        // them.
        let asked: u64 = ranges.iter().map(|g| g.end - g.start).sum();
        let limit = asked + 1024 * (ranges.len() as u64 + 1);
        let mut body = byte_stream(resp, r.registry.clone());
        let mut data = Vec::new();
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| ClientError::Transport {
                registry: r.registry.clone(),
                message: e.to_string(),
            })?;
            if (data.len() + piece.len()) as u64 > limit {
                tracing::info!(
                    registry = %r.registry,
                    limit,
                    "the registry answers several ranges with more than their bytes; one range per request from now on"
                );
                drop(body);
                self.inner.single_range.lock().insert(r.registry.clone());
                return self.blob_ranges_one_by_one(r, digest, ranges).await;
            }
            data.extend_from_slice(&piece);
        }
        let parts = match (byteranges::boundary(&content_type), single) {
            (Some(b), _) => byteranges::parse(&data, b).map_err(invalid)?,
            // A server may answer one range covering all those asked.
            (None, Some((first, last, _))) if last - first + 1 == data.len() as u64 => {
                vec![byteranges::Part {
                    start: first,
                    body: 0..data.len(),
                }]
            }
            _ => {
                return Err(invalid(
                    "206 without multipart/byteranges or a matching Content-Range".into(),
                ));
            }
        };
        byteranges::slices(ranges, &parts, &data).map_err(invalid)
    }

    async fn blob_ranges_one_by_one(
        &self,
        r: &Repo,
        digest: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Vec<u8>>, ClientError> {
        let concurrency = self.inner.cfg.max_concurrent_downloads.max(1);
        futures_util::stream::iter(ranges.iter().cloned())
            .map(|rg| self.blob_range(r, digest, rg))
            .buffered(concurrency)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
    }

    /// Starts an upload session; returns its absolute Location.
    async fn start_upload(
        &self,
        r: &Repo,
        query: &str,
        mount_from: Option<&str>,
    ) -> Result<(u16, Option<url::Url>), ClientError> {
        let mut call = Call::new(
            Method::POST,
            format!("/v2/{}/blobs/uploads/{query}", r.repository),
            format!("repository {r}"),
        );
        call.mount_from = mount_from.map(str::to_string);
        let resp = self.execute(r, &call).await?;
        let status = resp.status().as_u16();
        let location = resp
            .headers()
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|l| resp.url().join(l).ok());
        Ok((status, location))
    }

    /// Tries a cross-repository mount of `digest` from `from` (same registry). Returns
    /// whether the registry mounted it; `false` means push it.
    pub async fn mount_blob(
        &self,
        r: &Repo,
        digest: &str,
        from: &RepositoryName,
    ) -> Result<bool, ClientError> {
        check_digest(digest)?;
        let from = from.as_str();
        let query = format!("?mount={digest}&from={from}");
        let (status, location) = self.start_upload(r, &query, Some(from)).await?;
        if status == 201 {
            return Ok(true);
        }
        // 202: the registry opened an ordinary upload instead; cancel it.
        if let Some(loc) = location {
            let mut cancel = Call::new(Method::DELETE, String::new(), format!("upload in {r}"));
            cancel.target = Target::Url(loc);
            cancel.push = true;
            if let Err(e) = self.execute(r, &cancel).await {
                tracing::debug!(error = %e, "could not cancel an unused upload session");
            }
        }
        Ok(false)
    }

    /// Uploads a blob of `size` bytes whose content hashes to `digest`: one streaming PUT
    /// up to `monolithic_push_limit`, chunked PATCHes of `chunk_size` above it.
    pub async fn push_blob(
        &self,
        r: &Repo,
        digest: &str,
        size: u64,
        body: ByteStream,
    ) -> Result<(), ClientError> {
        check_digest(digest)?;
        let (_, location) = self.start_upload(r, "", None).await?;
        let location = location.ok_or_else(|| ClientError::Invalid {
            what: format!("upload response from {}", r.registry),
            reason: "202 without a Location".into(),
        })?;
        if size > self.inner.cfg.monolithic_push_limit {
            return self.push_chunked(r, digest, size, body, location).await;
        }
        let mut url = location;
        url.query_pairs_mut().append_pair("digest", digest);
        let ep = self.origin(&r.registry)?;
        let same_host = ep.owns(&url);
        let http = self.http_for(&ep)?;
        let mut req = http
            .put(url)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, size.to_string())
            .body(reqwest::Body::wrap_stream(exact_stream(body, 0, size)));
        if same_host {
            let secret = self.secret_for(&ep, r).await;
            let scope = format!("repository:{}:pull,push", r.repository);
            if let Some(a) = self
                .inner
                .auth
                .authorize(&http, &ep.host, &scope, &secret, false)
                .await?
            {
                req = req.header(header::AUTHORIZATION, a);
            }
        }
        let resp = req.send().await.map_err(|e| ClientError::Transport {
            registry: r.registry.clone(),
            message: format!("uploading {digest}: {}", error_chain(&e)),
        })?;
        let status = resp.status().as_u16();
        if resp.status().is_success() {
            return Ok(());
        }
        let message = error_message(resp).await;
        if message.contains("DIGEST_INVALID") {
            return Err(ClientError::DigestMismatch {
                expected: digest.to_string(),
                actual: format!("something else (registry: {message})"),
            });
        }
        Err(match status {
            401 => auth::unauthorized(&r.registry, &message),
            403 => ClientError::Denied {
                registry: r.registry.clone(),
                message,
            },
            _ => ClientError::Status {
                registry: r.registry.clone(),
                method: "PUT".into(),
                path: format!("/v2/{}/blobs/uploads/…", r.repository),
                status,
                message,
            },
        })
    }

    async fn push_chunked(
        &self,
        r: &Repo,
        digest: &str,
        size: u64,
        body: ByteStream,
        mut location: url::Url,
    ) -> Result<(), ClientError> {
        let chunk = usize::try_from(self.inner.cfg.chunk_size.min(256 << 20)).unwrap_or(16 << 20);
        let mut body = exact_stream(body, 0, size);
        let mut offset = 0u64;
        let mut buf = bytes::BytesMut::with_capacity(chunk);
        loop {
            let item = body.next().await;
            let done = item.is_none();
            if let Some(item) = item {
                let bytes = item.map_err(|e| ClientError::Io {
                    path: format!("blob {digest}"),
                    source: e,
                })?;
                buf.extend_from_slice(&bytes);
            }
            while buf.len() >= chunk || (done && !buf.is_empty()) {
                let n = buf.len().min(chunk);
                let piece = buf.split_to(n).freeze();
                let end = offset + piece.len() as u64;
                let mut call = Call::new(Method::PATCH, String::new(), format!("upload in {r}"))
                    .header(header::CONTENT_TYPE, "application/octet-stream")?
                    .header(header::CONTENT_RANGE, &format!("{offset}-{}", end - 1))?;
                call.target = Target::Url(location.clone());
                call.body = Some(piece);
                let resp = self.execute(r, &call).await?;
                location = resp
                    .headers()
                    .get(header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|l| resp.url().join(l).ok())
                    .unwrap_or(location);
                offset = end;
            }
            if done {
                break;
            }
        }
        let mut url = location;
        url.query_pairs_mut().append_pair("digest", digest);
        let mut call = Call::new(Method::PUT, String::new(), format!("upload in {r}"));
        call.target = Target::Url(url);
        self.execute(r, &call).await?;
        Ok(())
    }

    // ------------------------------------------------------------------ listing

    /// Referrers of `subject` (optionally of one artifact type): the referrers API, else
    /// the `sha256-<hex>` tag fallback; an empty index when there are none. The fallback
    /// tag is asked at the same time as the API's first page, so a registry without the
    /// API (distribution 2.x) costs one round trip, not two; its answer is used only
    /// when the API answers 404.
    pub async fn referrers(
        &self,
        r: &Repo,
        subject: &str,
        artifact_type: Option<&str>,
    ) -> Result<oci_spec::image::ImageIndex, ClientError> {
        check_digest(subject)?;
        let mut path = format!("/v2/{}/referrers/{subject}", r.repository);
        if let Some(t) = artifact_type {
            let q: String = url::form_urlencoded::Serializer::new(String::new())
                .append_pair("artifactType", t)
                .finish();
            path.push('?');
            path.push_str(&q);
        }
        let mut descriptors: Vec<oci_spec::image::Descriptor> = Vec::new();
        let mut call = Call::new(Method::GET, path, format!("referrers of {subject} in {r}"))
            .header(header::ACCEPT, media::OCI_INDEX)?;
        let tag = format!("sha256-{}", subject.trim_start_matches("sha256:"));
        let (first_page, fallback) = tokio::join!(
            self.execute(r, &call),
            self.get_manifest(r, &tag, &[media::OCI_INDEX])
        );
        let mut first_page = Some(first_page);
        let mut api = true;
        for _ in 0..MAX_PAGES {
            let page = match first_page.take() {
                Some(page) => page,
                None => self.execute(r, &call).await,
            };
            let resp = match page {
                Ok(resp) => resp,
                Err(ClientError::NotFound { .. }) if descriptors.is_empty() => {
                    api = false;
                    break;
                }
                Err(e) => return Err(e),
            };
            let next = next_link(resp.headers(), resp.url());
            let body = read_body_bounded(
                resp,
                ferry_oci::MAX_MANIFEST_BYTES,
                &r.registry,
                "referrers index",
            )
            .await?;
            let index: oci_spec::image::ImageIndex =
                serde_json::from_slice(&body).map_err(|e| ClientError::Invalid {
                    what: format!("referrers of {subject} from {}", r.registry),
                    reason: e.to_string(),
                })?;
            descriptors.extend(index.manifests().iter().cloned());
            match next {
                Some(url) => call.target = Target::Url(url),
                None => break,
            }
        }
        if !api {
            match fallback {
                Ok(m) => {
                    let index: oci_spec::image::ImageIndex = serde_json::from_slice(&m.bytes)
                        .map_err(|e| ClientError::Invalid {
                            what: format!("referrers tag {tag} in {r}"),
                            reason: e.to_string(),
                        })?;
                    descriptors = index.manifests().clone();
                }
                Err(ClientError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(t) = artifact_type {
            descriptors.retain(|d| {
                d.artifact_type()
                    .as_ref()
                    .is_some_and(|a| a.to_string() == t)
            });
        }
        Ok(index_of(descriptors))
    }

    /// Pushes a referrer manifest (by digest) and, when the registry does not index
    /// subjects itself, adds it to the `sha256-<subject hex>` fallback tag index.
    pub async fn push_referrer(
        &self,
        r: &Repo,
        subject: &str,
        referrer: &oci_spec::image::Descriptor,
        bytes: Bytes,
    ) -> Result<(), ClientError> {
        check_digest(subject)?;
        let digest = referrer.digest().to_string();
        let put = self
            .put_manifest_detailed(r, &digest, referrer.media_type().as_ref(), bytes)
            .await?;
        if put.subject_indexed {
            return Ok(());
        }
        let tag = format!("sha256-{}", subject.trim_start_matches("sha256:"));
        let mut list = match self.get_manifest(r, &tag, &[media::OCI_INDEX]).await {
            Ok(m) => serde_json::from_slice::<oci_spec::image::ImageIndex>(&m.bytes)
                .map(|i| i.manifests().clone())
                .unwrap_or_default(),
            Err(ClientError::NotFound { .. }) => Vec::new(),
            Err(e) => return Err(e),
        };
        if list.iter().any(|d| d.digest() == referrer.digest()) {
            return Ok(());
        }
        list.push(referrer.clone());
        let doc = ferry_oci::layout::canonical_json(&index_of(list))?;
        self.put_manifest(r, &tag, media::OCI_INDEX, Bytes::from(doc))
            .await?;
        Ok(())
    }

    /// Sends a startup trace (trace JSON) for manifest `subject` to ferry's registry
    /// endpoint for nodes that may only pull (`PUT /v2/<name>/ferry-traces/<subject>`,
    /// see `ferry_registry::server::traces`); returns the digest of the artifact the registry
    /// built. Other registries answer 404 (or 405).
    pub async fn push_trace(
        &self,
        r: &Repo,
        subject: &str,
        trace_json: Bytes,
    ) -> Result<String, ClientError> {
        check_digest(subject)?;
        let mut call = Call::new(
            Method::PUT,
            format!("/v2/{}/ferry-traces/{subject}", r.repository),
            format!("trace endpoint of {r}"),
        )
        .header(header::CONTENT_TYPE, media::FERRY_TRACE)?;
        // Pull access is what this endpoint asks of a node.
        call.push = false;
        call.body = Some(trace_json);
        let resp = self.execute(r, &call).await?;
        Ok(resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned())
    }

    /// Every tag of a repository (following `Link` pagination).
    pub async fn tags(&self, r: &Repo) -> Result<Vec<String>, ClientError> {
        #[derive(serde::Deserialize)]
        struct TagList {
            #[serde(default)]
            tags: Option<Vec<String>>,
        }
        let mut out = Vec::new();
        let mut call = Call::new(
            Method::GET,
            format!("/v2/{}/tags/list?n=1000", r.repository),
            format!("repository {r}"),
        );
        for _ in 0..MAX_PAGES {
            let resp = self.execute(r, &call).await?;
            let next = next_link(resp.headers(), resp.url());
            let body = read_body_bounded(resp, 16 << 20, &r.registry, "tag list").await?;
            let page: TagList =
                serde_json::from_slice(&body).map_err(|e| ClientError::Invalid {
                    what: format!("tag list of {r}"),
                    reason: e.to_string(),
                })?;
            out.extend(page.tags.unwrap_or_default());
            match next {
                Some(url) => call.target = Target::Url(url),
                None => return Ok(out),
            }
        }
        Err(ClientError::TooLarge {
            what: format!("tag list of {r}"),
            limit: MAX_PAGES as u64,
        })
    }
}

fn index_of(manifests: Vec<oci_spec::image::Descriptor>) -> oci_spec::image::ImageIndex {
    let mut index = oci_spec::image::ImageIndex::default();
    index.set_media_type(Some(oci_spec::image::MediaType::ImageIndex));
    index.set_manifests(manifests);
    index
}

fn content_type(h: &HeaderMap) -> String {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim().to_string())
        .unwrap_or_default()
}

/// The `mediaType` field of a manifest document, when it has one.
pub(crate) fn document_media_type(bytes: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Doc {
        #[serde(rename = "mediaType")]
        media_type: Option<String>,
    }
    serde_json::from_slice::<Doc>(bytes)
        .ok()?
        .media_type
        .filter(|m| !m.is_empty())
}

/// The outcome of matching a `Range` header against a blob of known size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeRequest {
    /// No usable range: send the whole blob with 200.
    Full,
    /// Send these bytes with 206.
    Partial(Range<u64>),
    /// Answer 416 with `Content-Range: bytes */size`.
    Unsatisfiable,
}

/// Interprets a `Range` header value for a blob of `size` bytes: the one parser ferry's
/// registry and the daemon's peer server answer reads with.
///
/// Syntactically invalid headers and units other than `bytes` are ignored (full 200), as
/// RFC 9110 requires; a range that starts past the end, or ends before it starts (as
/// the OCI conformance suite wants), is unsatisfiable.
pub fn parse_range(header: Option<&str>, size: u64) -> RangeRequest {
    let Some(value) = header else {
        return RangeRequest::Full;
    };
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return RangeRequest::Full;
    };
    if spec.contains(',') {
        return RangeRequest::Full;
    }
    let Some((first, last)) = spec.trim().split_once('-') else {
        return RangeRequest::Full;
    };
    let (first, last) = (first.trim(), last.trim());
    if first.is_empty() {
        // Suffix range: the last N bytes.
        let Ok(n) = last.parse::<u64>() else {
            return RangeRequest::Full;
        };
        if n == 0 || size == 0 {
            return RangeRequest::Unsatisfiable;
        }
        return RangeRequest::Partial(size.saturating_sub(n)..size);
    }
    let Ok(start) = first.parse::<u64>() else {
        return RangeRequest::Full;
    };
    let end_inclusive = if last.is_empty() {
        None
    } else {
        match last.parse::<u64>() {
            Ok(e) if e >= start => Some(e),
            // Last before first: RFC 9110 calls the header invalid (ignore it), but the
            // OCI distribution-spec conformance suite requires 416 here, and a client
            // asking for it wants no 200 of the whole blob either.
            Ok(_) => return RangeRequest::Unsatisfiable,
            Err(_) => return RangeRequest::Full,
        }
    };
    if start >= size {
        return RangeRequest::Unsatisfiable;
    }
    let end = end_inclusive.map_or(size, |e| e.saturating_add(1).min(size));
    RangeRequest::Partial(start..end)
}

/// Parses a `Content-Range` into `(first, last, total)`: the RFC form
/// `bytes FIRST-LAST/TOTAL` (TOTAL may be `*`) a `206` answer carries, and the bare
/// `FIRST-LAST` the distribution spec has chunk uploads send (the registry's `PATCH`
/// handler reads it here too, so both ends agree on one grammar). Refuses LAST =
/// `u64::MAX` (callers compute LAST + 1), LAST < FIRST, and a range that does not lie
/// inside a stated TOTAL.
pub fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let v = v.trim();
    let v = v.strip_prefix("bytes").map_or(v, str::trim_start);
    let (span, total) = match v.split_once('/') {
        Some((span, total)) => (span, Some(total.trim())),
        None => (v, None),
    };
    let (a, b) = span.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    if b < a || b == u64::MAX {
        return None;
    }
    let total = match total {
        None | Some("*") => None,
        Some(t) => Some(t.parse::<u64>().ok()?),
    };
    if total.is_some_and(|t| b >= t) {
        return None;
    }
    Some((a, b, total))
}

/// The `rel="next"` target of a `Link` header, resolved against the request URL.
pub(crate) fn next_link(h: &HeaderMap, base: &url::Url) -> Option<url::Url> {
    for v in h
        .get_all(header::LINK)
        .iter()
        .filter_map(|v| v.to_str().ok())
    {
        for part in v.split(',') {
            let part = part.trim();
            let (Some(open), Some(close)) = (part.find('<'), part.find('>')) else {
                continue;
            };
            if close <= open {
                continue;
            }
            let params = &part[close + 1..];
            let is_next = params.split(';').any(|p| {
                let p = p.trim().replace(' ', "");
                p == "rel=\"next\"" || p == "rel=next"
            });
            if is_next {
                return base.join(&part[open + 1..close]).ok();
            }
        }
    }
    None
}

fn byte_stream(resp: reqwest::Response, registry: String) -> ByteStream {
    Box::pin(resp.bytes_stream().map(move |item| {
        item.map_err(|e| {
            std::io::Error::other(format!("reading from {registry}: {}", error_chain(&e)))
        })
    }))
}

/// Skips `skip` bytes, then yields exactly `take` bytes; ending early is an
/// `UnexpectedEof` error item, extra bytes are dropped.
pub(crate) fn exact_stream(body: ByteStream, skip: u64, take: u64) -> ByteStream {
    Box::pin(futures_util::stream::unfold(
        (Some(body), skip, take),
        |(body, mut skip, mut take)| async move {
            let mut body = body?;
            loop {
                if take == 0 {
                    return None;
                }
                match body.next().await {
                    None => {
                        let e = std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!("blob body ended {take} bytes early"),
                        );
                        return Some((Err(e), (None, 0, 0)));
                    }
                    Some(Err(e)) => return Some((Err(e), (None, 0, 0))),
                    Some(Ok(mut b)) => {
                        let len = b.len() as u64;
                        if skip >= len {
                            skip -= len;
                            continue;
                        }
                        let _ = b.split_to(skip as usize);
                        skip = 0;
                        if b.len() as u64 > take {
                            b.truncate(take as usize);
                        }
                        take -= b.len() as u64;
                        if b.is_empty() {
                            continue;
                        }
                        return Some((Ok(b), (Some(body), skip, take)));
                    }
                }
            }
        },
    ))
}
