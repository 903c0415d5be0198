//! Pull-through cache: `ferry registry serve` in front of an upstream registry (Harbor,
//! distribution, Docker Hub, another ferry), read-only for clients.
//!
//! Why it exists: when a node pool scales out, every node asks for the same manifests and
//! layers at once. Each object must cost upstream one request, however many nodes ask, and
//! nodes must not wait for the whole object to land before their bytes start flowing.
//!
//! - Manifests and small documents live in a byte-bounded memory cache ([`memory`]). Digest
//!   references are immutable and never revalidated; tags are served for `manifest_ttl`,
//!   then revalidated with a HEAD (re-fetched only if the digest moved). Tag lists and
//!   referrers are kept for `list_ttl`.
//! - Blobs live on disk ([`disk`]), content-addressed, LRU-evicted under `max_bytes`. A
//!   miss starts one download ([`fetch`]) into a temp file that every concurrent reader
//!   of the same repository follows as it grows; the blob enters the cache only once its
//!   digest is verified. Downloads are keyed by (repository, digest), after the server's
//!   access check for that repository: a request never joins a download started through
//!   another repository (upstream vouched for that one, not for this), and a waiter whose
//!   joined download fails retries once on its own rather than inherit the failure.
//! - Concurrent misses of the same document share one upstream call ([`flight`]); the call
//!   runs in its own task, so one client going away cancels nothing for the others.
//! - When upstream answers 429/5xx or cannot be reached, an expired copy is served for up to
//!   `stale_limit` past its TTL; after that, the error is returned.
//! - Upstream credentials are used only on requests to upstream; nothing here returns
//!   upstream headers, so they cannot reach clients.
//! - A blob is served through a repository only after upstream confirmed that repository
//!   holds it (it served the blob, a manifest of the repository references it, or a HEAD
//!   said so), so the shared disk cache does not widen access across repositories.

pub mod config;
pub mod disk;
pub mod fetch;
pub use ferry_registry_client::cache::{flight, memory};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

pub use config::UpstreamConfig;

use crate::server::metrics::Metrics;
use crate::storage::{BlobRead, StoredManifest};
use disk::DiskCache;
use ferry_oci::digest::is_digest_reference;
use ferry_registry_client::{Client, ClientConfig, ClientError, Credentials, RegistryConfig, Repo};
use fetch::{FetchJob, FetchState, Inflight, Progress};
use flight::SingleFlight;
use memory::MemoryCache;

/// Manifest media types asked of upstream (everything a registry may hold as a manifest):
/// the client's list.
const MANIFEST_ACCEPT: &[&str] = &ferry_registry_client::MANIFEST_TYPES;

/// Upper bound on remembered (repository, blob) pairs; past it the set is cleared and
/// re-learned from upstream (a HEAD per pair).
const MAX_LINKS: usize = 1 << 20;

/// Errors of the pull-through cache. `http_status` and `error_code` say how the server
/// should answer a client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CacheError {
    /// Upstream does not have it. The public methods return `Ok(None)` instead; this only
    /// appears inside the cache.
    #[error("{0} not found upstream")]
    NotFound(String),
    /// Upstream answered 429.
    #[error("upstream rate limit: {0}")]
    RateLimited(String),
    /// Upstream answered 5xx, timed out, or could not be reached.
    #[error("upstream unavailable: {0}")]
    Unavailable(String),
    /// Upstream refused the configured credentials (401/403).
    #[error("upstream refused access: {0}")]
    UpstreamDenied(String),
    /// Upstream answered something else that cannot be served (other 4xx, bad documents).
    #[error("upstream error: {0}")]
    Upstream(String),
    /// Upstream content does not hash to its digest; nothing was cached.
    #[error("upstream content of {expected} hashes to {actual}")]
    DigestMismatch { expected: String, actual: String },
    /// The object exceeds `max_blob_bytes` (or a client limit).
    #[error("{what} is larger than the {limit} bytes allowed")]
    TooLarge { what: String, limit: u64 },
    /// The requested range does not fit the blob.
    #[error("range not satisfiable for a blob of {size} bytes")]
    RangeNotSatisfiable { size: u64 },
    /// A digest or name the cache cannot use.
    #[error("invalid {0}")]
    Invalid(String),
    /// Local disk trouble.
    #[error("cache I/O at {path}: {message}")]
    Io { path: String, message: String },
    /// The `[upstream]` section is unusable.
    #[error("invalid [upstream] config: {0}")]
    Config(String),
    #[error("internal cache error: {0}")]
    Internal(String),
}

impl CacheError {
    /// The HTTP status a client should get.
    pub fn http_status(&self) -> u16 {
        match self {
            CacheError::NotFound(_) => 404,
            CacheError::RateLimited(_) => 429,
            CacheError::Unavailable(_) => 503,
            CacheError::UpstreamDenied(_) => 403,
            CacheError::Upstream(_)
            | CacheError::DigestMismatch { .. }
            | CacheError::TooLarge { .. } => 502,
            CacheError::RangeNotSatisfiable { .. } => 416,
            CacheError::Invalid(_) => 400,
            CacheError::Io { .. } | CacheError::Config(_) | CacheError::Internal(_) => 500,
        }
    }

    /// The distribution-spec error code for the JSON body.
    pub fn error_code(&self) -> &'static str {
        match self {
            CacheError::NotFound(_) => "BLOB_UNKNOWN",
            CacheError::RateLimited(_) => "TOOMANYREQUESTS",
            CacheError::Unavailable(_) => "UNAVAILABLE",
            CacheError::UpstreamDenied(_) => "DENIED",
            CacheError::Invalid(_) => "DIGEST_INVALID",
            CacheError::RangeNotSatisfiable { .. } => "BLOB_UNKNOWN",
            _ => "UNKNOWN",
        }
    }

    /// Whether this is an upstream outage a stale copy may paper over (429, 5xx,
    /// unreachable).
    pub fn is_upstream_outage(&self) -> bool {
        matches!(
            self,
            CacheError::RateLimited(_) | CacheError::Unavailable(_)
        )
    }

    fn from_client(err: ClientError) -> CacheError {
        match err {
            ClientError::NotFound { what } => CacheError::NotFound(what),
            ClientError::Status { status: 429, .. } => CacheError::RateLimited(err.to_string()),
            ClientError::Status { status, .. } if status >= 500 => {
                CacheError::Unavailable(err.to_string())
            }
            ClientError::Transport { .. } => CacheError::Unavailable(err.to_string()),
            ClientError::Unauthorized { .. } | ClientError::Denied { .. } => {
                CacheError::UpstreamDenied(err.to_string())
            }
            ClientError::DigestMismatch { expected, actual } => {
                CacheError::DigestMismatch { expected, actual }
            }
            ClientError::TooLarge { what, limit } => CacheError::TooLarge { what, limit },
            other => CacheError::Upstream(other.to_string()),
        }
    }
}

/// A document kept in memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum DocKey {
    Manifest { repo: String, reference: String },
    Tags { repo: String },
    Referrers { repo: String, subject: String },
}

impl DocKey {
    fn weight(&self) -> u64 {
        let len = match self {
            DocKey::Manifest { repo, reference } => repo.len() + reference.len(),
            DocKey::Tags { repo } => repo.len(),
            DocKey::Referrers { repo, subject } => repo.len() + subject.len(),
        };
        len as u64
    }
}

#[derive(Debug, Clone)]
enum Doc {
    Manifest(StoredManifest),
    Tags(Arc<Vec<String>>),
    Referrers(Bytes),
}

impl Doc {
    fn weight(&self) -> u64 {
        let len = match self {
            Doc::Manifest(m) => m.bytes.len() + m.digest.len() + m.media_type.len(),
            Doc::Tags(tags) => tags.iter().map(|t| t.len() + 24).sum(),
            Doc::Referrers(bytes) => bytes.len(),
        };
        len as u64
    }
}

type DocOutcome = Result<Option<Doc>, CacheError>;

/// Monotonic time with a test-only offset, so TTL and stale-limit tests need no sleeping.
#[derive(Debug, Default)]
struct Clock {
    skew_millis: AtomicU64,
}

impl Clock {
    fn now(&self) -> Instant {
        Instant::now() + Duration::from_millis(self.skew_millis.load(Ordering::Relaxed))
    }

    #[cfg(test)]
    fn advance(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.skew_millis.fetch_add(millis, Ordering::Relaxed);
    }
}

/// (repository, blob) pairs upstream has confirmed.
#[derive(Debug, Default)]
struct Links {
    by_repo: HashMap<String, HashSet<String>>,
    count: usize,
}

#[derive(Debug)]
struct Shared {
    cfg: UpstreamConfig,
    client: Client,
    /// `host[:port]` of upstream, as the client names registries.
    registry: String,
    metrics: Metrics,
    disk: DiskCache,
    docs: MemoryCache<DocKey, Doc>,
    doc_flight: SingleFlight<DocKey, DocOutcome>,
    head_flight: SingleFlight<(String, String), Result<Option<u64>, CacheError>>,
    /// Downloads in progress, by (repository, blob hex).
    blobs: Mutex<HashMap<FlightKey, Arc<Inflight>>>,
    links: Mutex<Links>,
    clock: Clock,
}

/// (repository, blob hex): what a blob download is shared by.
type FlightKey = (String, String);

fn flight_key(repo: &str, hex: &str) -> FlightKey {
    (repo.to_owned(), hex.to_owned())
}

/// The pull-through cache. Cheap to share (`Arc` it); all methods take `&self`.
#[derive(Debug)]
pub struct PullThrough {
    shared: Arc<Shared>,
}

/// Validates `sha256:<64 lowercase hex>` and returns the hex.
fn sha256_hex(digest: &str) -> Result<&str, CacheError> {
    ferry_oci::digest::parse_sha256(digest)
        .map_err(|_| CacheError::Invalid(format!("digest {digest:?} (only sha256 is cached)")))?;
    Ok(&digest["sha256:".len()..])
}

/// The upstream `host[:port]` of a URL, and whether it is plain HTTP.
pub(crate) fn parse_upstream_url(url: &str) -> Result<(String, bool), CacheError> {
    let parsed =
        url::Url::parse(url).map_err(|e| CacheError::Config(format!("url {url:?}: {e}")))?;
    let plain = match parsed.scheme() {
        "http" => true,
        "https" => false,
        other => {
            return Err(CacheError::Config(format!(
                "url {url:?}: scheme {other:?} is not http or https"
            )));
        }
    };
    let host = parsed
        .host_str()
        .ok_or_else(|| CacheError::Config(format!("url {url:?} has no host")))?;
    let registry = match parsed.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    };
    Ok((registry, plain))
}

/// Blob digests a manifest references (config, layers, blobs, subject), by hex.
pub(crate) fn referenced_blobs(bytes: &[u8]) -> Vec<String> {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut take = |descriptor: &serde_json::Value| {
        if let Some(hex) = descriptor
            .get("digest")
            .and_then(|d| d.as_str())
            .and_then(|d| sha256_hex(d).ok())
        {
            found.push(hex.to_owned());
        }
    };
    for single in ["config", "subject"] {
        if let Some(descriptor) = doc.get(single) {
            take(descriptor);
        }
    }
    for list in ["layers", "blobs"] {
        if let Some(items) = doc.get(list).and_then(|l| l.as_array()) {
            items.iter().for_each(&mut take);
        }
    }
    found
}

impl PullThrough {
    /// Opens the cache directory (rebuilding its index), builds the upstream client, and
    /// records into `metrics`.
    pub async fn new(cfg: &UpstreamConfig, metrics: Metrics) -> Result<PullThrough, CacheError> {
        let (registry, url_is_plain) = parse_upstream_url(&cfg.url)?;
        let credentials = match (&cfg.username, &cfg.password) {
            (Some(username), password) => Some(Credentials {
                username: username.clone(),
                password: password.clone().unwrap_or_default(),
            }),
            (None, Some(_)) => {
                return Err(CacheError::Config("password given without username".into()));
            }
            (None, None) => None,
        };
        let mut client_cfg = ClientConfig {
            connect_timeout: cfg.connect_timeout,
            idle_timeout: cfg.idle_timeout,
            // One retry: clients are waiting, and a stale copy may answer instead.
            max_attempts: 2,
            use_auth_files: false,
            ..ClientConfig::default()
        };
        client_cfg.registry.insert(
            registry.clone(),
            RegistryConfig {
                plain_http: cfg.plain_http || url_is_plain,
                credentials,
                ..RegistryConfig::default()
            },
        );
        let client = Client::new(client_cfg).map_err(|e| CacheError::Config(e.to_string()))?;
        let disk = DiskCache::open(&cfg.effective_cache_dir(), cfg.max_bytes).await?;
        tracing::info!(
            upstream = %registry,
            cached_blobs = disk.len(),
            cached_bytes = disk.total_bytes(),
            "pull-through cache ready"
        );
        Ok(PullThrough {
            shared: Arc::new(Shared {
                cfg: cfg.clone(),
                client,
                registry,
                metrics,
                disk,
                docs: MemoryCache::new(cfg.memory_bytes),
                doc_flight: SingleFlight::new(),
                head_flight: SingleFlight::new(),
                blobs: Mutex::new(HashMap::new()),
                links: Mutex::new(Links::default()),
                clock: Clock::default(),
            }),
        })
    }

    /// Manifest by tag or digest through the cache (fresh, fetched once, or stale on
    /// upstream failure). `None`: upstream does not have it.
    pub async fn manifest(
        &self,
        repo: &str,
        reference: &str,
    ) -> Result<Option<StoredManifest>, CacheError> {
        let key = DocKey::Manifest {
            repo: repo.to_owned(),
            reference: reference.to_owned(),
        };
        let ttl = if is_digest_reference(reference) {
            None
        } else {
            Some(self.shared.cfg.manifest_ttl)
        };
        match self.shared.document(key, ttl, "manifest").await? {
            Some(Doc::Manifest(m)) => Ok(Some(m)),
            Some(_) => Err(CacheError::Internal(
                "manifest key held another document".into(),
            )),
            None => Ok(None),
        }
    }

    /// Blob size (HEAD), through the cache.
    pub async fn blob_size(&self, repo: &str, digest: &str) -> Result<Option<u64>, CacheError> {
        let hex = sha256_hex(digest)?;
        let shared = &self.shared;
        let local = if shared.is_linked(repo, hex) {
            shared
                .disk
                .size_of(hex)
                .or_else(|| shared.inflight_size(hex, None))
        } else {
            shared.inflight_size(hex, Some(repo))
        };
        if let Some(size) = local {
            shared.metrics.cache_hit("blob_size");
            return Ok(Some(size));
        }
        shared.metrics.cache_miss("blob_size");
        shared.upstream_blob_size(repo, hex).await
    }

    /// Blob bytes (optionally a range); a miss is fetched once from upstream and streamed to
    /// all concurrent waiters as it arrives. `None`: upstream does not have it (in `repo`).
    pub async fn blob(
        &self,
        repo: &str,
        digest: &str,
        range: Option<Range<u64>>,
    ) -> Result<Option<BlobRead>, CacheError> {
        let hex = sha256_hex(digest)?;
        let shared = &self.shared;
        // A download may commit between our disk check and joining it (one more round),
        // and a joined download may fail (one retry of our own).
        let mut retried = false;
        for _ in 0..3 {
            if let Some(open) = shared.disk.open_blob(hex).await? {
                // The disk copy may have come through another repository.
                if !shared.may_serve(repo, hex).await? {
                    return Ok(None);
                }
                shared.metrics.cache_hit("blob");
                let range = checked_range(range.clone(), open.size)?;
                return Ok(Some(BlobRead {
                    size: open.size,
                    body: fetch::complete_stream(open.file, range, open.pin),
                }));
            }
            let Some((inflight, started)) = shared.join_or_start(repo, hex).await? else {
                continue;
            };
            if started {
                shared.metrics.cache_miss("blob");
            } else {
                shared.metrics.cache_hit("blob");
            }
            let pin = shared.disk.pin(hex);
            let mut progress = inflight.progress.clone();
            let known = progress
                .wait_for(|p| match (&p.state, p.size) {
                    (FetchState::Running, Some(0)) => false,
                    (FetchState::Running, size) => size.is_some(),
                    _ => true,
                })
                .await
                .map_err(|_| CacheError::Internal("blob download vanished".into()))?
                .clone();
            let still_running = known.state == FetchState::Running;
            let size = match (known.state, known.size) {
                // Somebody else's download failed (their client went away, a transient
                // upstream error): never hand that to this request; try once ourselves.
                (FetchState::Failed(_), _) if !started && !retried => {
                    retried = true;
                    continue;
                }
                (FetchState::Failed(CacheError::NotFound(_)), _) => return Ok(None),
                (FetchState::Failed(e), _) => return Err(e),
                (_, Some(size)) => size,
                (_, None) => return Err(CacheError::Internal("blob size unknown".into())),
            };
            let range = checked_range(range, size)?;
            // A range far beyond what has arrived (a lazy reader jumping ahead) is asked of
            // upstream directly instead of waiting for the whole download to get there.
            let ahead = shared.cfg.range_passthrough_bytes;
            if still_running
                && range.end > range.start
                && range.end < size
                && range.start > known.written.saturating_add(ahead)
                && let Some(body) = shared.range_from_upstream(repo, hex, range.clone()).await
            {
                return Ok(Some(BlobRead { size, body }));
            }
            return Ok(Some(BlobRead {
                size,
                body: fetch::growing_stream(&inflight, range, size, pin),
            }));
        }
        Err(CacheError::Internal(
            "blob neither cached nor downloading after retries".into(),
        ))
    }

    /// Tags of `repo` (cached for `list_ttl`); `None` if upstream has no such repository.
    pub async fn tags(&self, repo: &str) -> Result<Option<Vec<String>>, CacheError> {
        let key = DocKey::Tags {
            repo: repo.to_owned(),
        };
        match self
            .shared
            .document(key, Some(self.shared.cfg.list_ttl), "tags")
            .await?
        {
            Some(Doc::Tags(tags)) => Ok(Some(tags.as_ref().clone())),
            Some(_) => Err(CacheError::Internal(
                "tags key held another document".into(),
            )),
            None => Ok(None),
        }
    }

    /// Referrers of `subject` in `repo` as an image index JSON (cached for `list_ttl`).
    /// `None` if upstream answers 404.
    pub async fn referrers(&self, repo: &str, subject: &str) -> Result<Option<Bytes>, CacheError> {
        sha256_hex(subject)?;
        let key = DocKey::Referrers {
            repo: repo.to_owned(),
            subject: subject.to_owned(),
        };
        match self
            .shared
            .document(key, Some(self.shared.cfg.list_ttl), "referrers")
            .await?
        {
            Some(Doc::Referrers(bytes)) => Ok(Some(bytes)),
            Some(_) => Err(CacheError::Internal(
                "referrers key held another document".into(),
            )),
            None => Ok(None),
        }
    }

    #[cfg(test)]
    fn advance_clock(&self, by: Duration) {
        self.shared.clock.advance(by);
    }

    #[cfg(test)]
    fn disk(&self) -> &DiskCache {
        &self.shared.disk
    }
}

/// Resolves an optional range against `size`.
fn checked_range(range: Option<Range<u64>>, size: u64) -> Result<Range<u64>, CacheError> {
    match range {
        None => Ok(0..size),
        Some(r) if r.start <= r.end && r.end <= size => Ok(r),
        Some(_) => Err(CacheError::RangeNotSatisfiable { size }),
    }
}

impl Shared {
    /// The upstream repository for `repo`, under the configured namespace. The joined
    /// name is parsed again: a valid namespace and a valid name can still be too long.
    fn upstream_repo(&self, repo: &str) -> Result<Repo, CacheError> {
        let repository = match self.cfg.namespace.as_deref().map(|n| n.trim_matches('/')) {
            Some(ns) if !ns.is_empty() => format!("{ns}/{repo}"),
            _ => repo.to_owned(),
        };
        Repo::parse(self.registry.clone(), &repository)
            .map_err(|e| CacheError::Invalid(format!("upstream repository: {e}")))
    }

    /// Runs an upstream call under the request timeout; 404 becomes `Ok(None)`.
    async fn call<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<Option<T>, CacheError> {
        let outcome = match tokio::time::timeout(self.cfg.request_timeout, call).await {
            Ok(Ok(value)) => Ok(Some(value)),
            Ok(Err(ClientError::NotFound { .. })) => Ok(None),
            Ok(Err(e)) => Err(CacheError::from_client(e)),
            Err(_) => Err(CacheError::Unavailable(format!(
                "{what}: no answer within {:?}",
                self.cfg.request_timeout
            ))),
        };
        if let Err(e) = &outcome
            && e.is_upstream_outage()
        {
            self.metrics.upstream_error();
        }
        outcome
    }

    fn is_linked(&self, repo: &str, hex: &str) -> bool {
        self.links
            .lock()
            .by_repo
            .get(repo)
            .is_some_and(|blobs| blobs.contains(hex))
    }

    fn link<'a>(&self, repo: &str, hexes: impl IntoIterator<Item = &'a str>) {
        let mut links = self.links.lock();
        for hex in hexes {
            if links.count >= MAX_LINKS {
                links.by_repo.clear();
                links.count = 0;
            }
            if links
                .by_repo
                .entry(repo.to_owned())
                .or_default()
                .insert(hex.to_owned())
            {
                links.count += 1;
            }
        }
    }

    /// Size of a download in progress, if known: with `repo`, only of a download
    /// requested through `repo`; without, of any (the caller knows `repo` holds it).
    fn inflight_size(&self, hex: &str, repo: Option<&str>) -> Option<u64> {
        let blobs = self.blobs.lock();
        let size_of = |inflight: &Arc<Inflight>| {
            let progress = inflight.progress.borrow();
            match progress.state {
                FetchState::Failed(_) => None,
                _ => progress.size,
            }
        };
        match repo {
            Some(repo) => blobs.get(&flight_key(repo, hex)).and_then(size_of),
            None => blobs
                .iter()
                .filter(|((_, h), _)| h == hex)
                .find_map(|(_, inflight)| size_of(inflight)),
        }
    }

    /// HEAD upstream (one call per repository and blob at a time); links on success.
    async fn upstream_blob_size(
        self: &Arc<Self>,
        repo: &str,
        hex: &str,
    ) -> Result<Option<u64>, CacheError> {
        let shared = Arc::clone(self);
        let (repo_owned, hex_owned) = (repo.to_owned(), hex.to_owned());
        self.head_flight
            .run((repo.to_owned(), hex.to_owned()), move || async move {
                let upstream = shared.upstream_repo(&repo_owned)?;
                let digest = format!("sha256:{hex_owned}");
                let size = shared
                    .call("blob HEAD", shared.client.blob_size(&upstream, &digest))
                    .await?
                    .flatten();
                if size.is_some() {
                    shared.link(&repo_owned, [hex_owned.as_str()]);
                }
                Ok(size)
            })
            .await
            .map_err(|e| CacheError::Internal(e.to_string()))?
    }

    /// Streams `range` of a blob straight from upstream (not cached); `None` if upstream
    /// would not, so the caller waits for the download instead.
    async fn range_from_upstream(
        &self,
        repo: &str,
        hex: &str,
        range: Range<u64>,
    ) -> Option<crate::storage::ByteStream> {
        let upstream = self.upstream_repo(repo).ok()?;
        let digest = format!("sha256:{hex}");
        let len = range.end - range.start;
        match self
            .call(
                "blob range GET",
                self.client.blob_stream(&upstream, &digest, Some(range)),
            )
            .await
        {
            Ok(Some(stream)) => {
                self.metrics.upstream_fetch(len);
                Some(stream.body)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(%digest, error = %e, "range pass-through failed; waiting for the download");
                None
            }
        }
    }

    /// Whether `repo` may read the disk copy of blob `hex`: yes if upstream confirmed it
    /// (it served the blob to `repo`, a manifest of `repo` references it, or a HEAD said
    /// so); otherwise ask upstream now.
    async fn may_serve(self: &Arc<Self>, repo: &str, hex: &str) -> Result<bool, CacheError> {
        if self.is_linked(repo, hex) {
            return Ok(true);
        }
        Ok(self.upstream_blob_size(repo, hex).await?.is_some())
    }

    /// Joins the download of `hex`, or starts it. `None` if the blob was committed to disk
    /// meanwhile (read it from there). The bool says whether this call started it.
    async fn join_or_start(
        self: &Arc<Self>,
        repo: &str,
        hex: &str,
    ) -> Result<Option<(Arc<Inflight>, bool)>, CacheError> {
        if let Some(inflight) = self.joinable(repo, hex)? {
            return Ok(inflight.map(|i| (i, false)));
        }
        let temp = self.disk.create_temp().await?;
        let (sender, receiver) = watch::channel(Progress {
            written: 0,
            size: None,
            state: FetchState::Running,
        });
        let inflight = Arc::new(Inflight {
            repo: repo.to_owned(),
            file: Arc::clone(&temp.reader),
            progress: receiver,
        });
        enum Race {
            Won,
            Lost(Arc<Inflight>),
            Committed,
        }
        let race = {
            let mut blobs = self.blobs.lock();
            let key = flight_key(repo, hex);
            if let Some(existing) = blobs.get(&key).filter(|i| !i.failed()) {
                Race::Lost(Arc::clone(existing))
            } else if self.disk.contains(hex) {
                Race::Committed
            } else {
                blobs.insert(key, Arc::clone(&inflight));
                Race::Won
            }
        };
        match race {
            Race::Won => {}
            // Somebody started it while we made our temp file.
            Race::Lost(existing) => {
                self.disk.discard_temp(&temp.path).await;
                return Ok(Some((existing, false)));
            }
            Race::Committed => {
                self.disk.discard_temp(&temp.path).await;
                return Ok(None);
            }
        }
        let pin = self.disk.pin(hex);
        let forget_inflight = Arc::clone(&inflight);
        let shared = Arc::clone(self);
        let (repo, hex) = (repo.to_owned(), hex.to_owned());
        tokio::spawn(async move {
            let _forget = ForgetDownload {
                shared: Arc::clone(&shared),
                key: flight_key(&repo, &hex),
                inflight: forget_inflight,
            };
            shared.download(repo, hex, temp, sender, pin).await;
        });
        Ok(Some((inflight, true)))
    }

    /// `Some(Some(inflight))` to join `repo`'s download, `Some(None)` if already cached,
    /// `None` to start one.
    fn joinable(&self, repo: &str, hex: &str) -> Result<Option<Option<Arc<Inflight>>>, CacheError> {
        let blobs = self.blobs.lock();
        // A failed download may linger until its task ends; never join it.
        if let Some(inflight) = blobs.get(&flight_key(repo, hex)).filter(|i| !i.failed()) {
            return Ok(Some(Some(Arc::clone(inflight))));
        }
        if self.disk.contains(hex) {
            return Ok(Some(None));
        }
        Ok(None)
    }

    /// The download task: one upstream GET, streamed into the temp file.
    async fn download(
        self: &Arc<Self>,
        repo: String,
        hex: String,
        temp: disk::TempBlob,
        progress: watch::Sender<Progress>,
        pin: disk::BlobPin,
    ) {
        let digest = format!("sha256:{hex}");
        let response = match self.upstream_repo(&repo) {
            Ok(upstream) => {
                self.call(
                    "blob GET",
                    self.client.blob_stream(&upstream, &digest, None),
                )
                .await
            }
            Err(e) => Err(e),
        };
        let stream = match response {
            Ok(Some(stream)) => stream,
            Ok(None) => {
                progress
                    .send_modify(|p| p.state = FetchState::Failed(CacheError::NotFound(digest)));
                self.disk.discard_temp(&temp.path).await;
                return;
            }
            Err(e) => {
                tracing::warn!(%digest, error = %e, "pull-through: blob fetch failed");
                progress.send_modify(|p| p.state = FetchState::Failed(e));
                self.disk.discard_temp(&temp.path).await;
                return;
            }
        };
        self.metrics.upstream_fetch(0);
        progress.send_modify(|p| p.size = stream.size);
        let metrics = self.metrics.clone();
        let job = FetchJob {
            hex: hex.clone(),
            temp_path: temp.path,
            writer: temp.writer,
            upstream: stream.body,
            announced: stream.size,
            max_blob_bytes: self.cfg.max_blob_bytes,
            idle_timeout: self.cfg.idle_timeout,
            progress,
            disk: self.disk.clone(),
            pin,
            on_bytes: Arc::new(move |n| metrics.upstream_bytes(n)),
        };
        let outcome = job.run().await;
        match outcome.result {
            Ok(size) => {
                self.link(&repo, [hex.as_str()]);
                tracing::debug!(%digest, size, cached = outcome.cached, "pull-through: blob fetched");
            }
            Err(e) => {
                if e.is_upstream_outage() {
                    self.metrics.upstream_error();
                }
                tracing::warn!(%digest, error = %e, "pull-through: blob download failed; nothing cached");
            }
        }
    }

    /// A document through memory, single-flight, upstream, and the stale fallback.
    /// `ttl = None`: immutable once fetched.
    async fn document(
        self: &Arc<Self>,
        key: DocKey,
        ttl: Option<Duration>,
        kind: &'static str,
    ) -> DocOutcome {
        if let Some((doc, validated_at)) = self.docs.get(&key)
            && self.is_fresh(validated_at, ttl)
        {
            self.metrics.cache_hit(kind);
            return Ok(Some(doc));
        }
        self.metrics.cache_miss(kind);
        let shared = Arc::clone(self);
        let flight_key = key.clone();
        self.doc_flight
            .run(
                flight_key,
                move || async move { shared.load(key, ttl).await },
            )
            .await
            .map_err(|e| CacheError::Internal(e.to_string()))?
    }

    fn is_fresh(&self, validated_at: Instant, ttl: Option<Duration>) -> bool {
        match ttl {
            None => true,
            Some(ttl) => self.clock.now().saturating_duration_since(validated_at) < ttl,
        }
    }

    /// Runs inside the single flight: fetch or revalidate, else fall back to stale.
    async fn load(&self, key: DocKey, ttl: Option<Duration>) -> DocOutcome {
        let cached = self.docs.get(&key);
        if let Some((doc, validated_at)) = &cached {
            // A flight that just ended may have refreshed it.
            if self.is_fresh(*validated_at, ttl) {
                return Ok(Some(doc.clone()));
            }
        }
        let fetched = match &key {
            DocKey::Manifest { repo, reference } => {
                let cached_manifest = match &cached {
                    Some((Doc::Manifest(m), _)) => Some(m),
                    _ => None,
                };
                self.fetch_manifest(&key, repo, reference, cached_manifest)
                    .await
            }
            DocKey::Tags { repo } => {
                let upstream = self.upstream_repo(repo)?;
                let tags = self.call("tags", self.client.tags(&upstream)).await;
                tags.map(|found| found.map(|tags| Doc::Tags(Arc::new(tags))))
            }
            DocKey::Referrers { repo, subject } => {
                let upstream = self.upstream_repo(repo)?;
                let index = self
                    .call("referrers", self.client.referrers(&upstream, subject, None))
                    .await;
                match index {
                    Ok(Some(index)) => serde_json::to_vec(&index)
                        .map(|json| Some(Doc::Referrers(Bytes::from(json))))
                        .map_err(|e| CacheError::Upstream(format!("referrers index: {e}"))),
                    Ok(None) => Ok(None),
                    Err(e) => Err(e),
                }
            }
        };
        let now = self.clock.now();
        match fetched {
            Ok(Some(doc)) => {
                if !matches!(key, DocKey::Manifest { .. }) {
                    self.docs
                        .insert(key.clone(), doc.clone(), key.weight() + doc.weight(), now);
                }
                Ok(Some(doc))
            }
            Ok(None) => {
                self.docs.remove(&key);
                Ok(None)
            }
            Err(e) if e.is_upstream_outage() => match cached {
                Some((doc, validated_at))
                    if now.saturating_duration_since(validated_at)
                        < ttl.unwrap_or(Duration::ZERO) + self.cfg.stale_limit =>
                {
                    tracing::warn!(error = %e, ?key, "pull-through: upstream failing, serving stale copy");
                    Ok(Some(doc))
                }
                _ => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    /// Fetches a manifest, or revalidates a cached tag with a HEAD (GET only if it moved).
    /// Stores what it got under the reference and under its digest.
    async fn fetch_manifest(
        &self,
        key: &DocKey,
        repo: &str,
        reference: &str,
        cached: Option<&StoredManifest>,
    ) -> DocOutcome {
        let upstream = self.upstream_repo(repo)?;
        let mut fetch_by = reference.to_owned();
        if let Some(cached) = cached {
            let head = self
                .call(
                    "manifest HEAD",
                    self.client
                        .head_manifest(&upstream, reference, MANIFEST_ACCEPT),
                )
                .await;
            match head {
                Ok(Some(Some(head))) if head.digest == cached.digest => {
                    self.docs.revalidated(key, self.clock.now());
                    self.metrics.cache_hit("tag");
                    return Ok(Some(Doc::Manifest(cached.clone())));
                }
                Ok(Some(Some(head))) => fetch_by = head.digest,
                Ok(Some(None)) | Ok(None) => return Ok(None),
                Err(e) if e.is_upstream_outage() => return Err(e),
                // Some registries answer HEAD poorly (no digest header); try a GET.
                Err(_) => {}
            }
        }
        let Some(manifest) = self
            .call(
                "manifest GET",
                self.client
                    .get_manifest(&upstream, &fetch_by, MANIFEST_ACCEPT),
            )
            .await?
        else {
            return Ok(None);
        };
        self.metrics.upstream_fetch(manifest.bytes.len() as u64);
        let stored = StoredManifest {
            digest: manifest.digest,
            media_type: manifest.media_type,
            bytes: manifest.bytes,
        };
        if is_digest_reference(reference) && stored.digest != reference {
            return Err(CacheError::DigestMismatch {
                expected: reference.to_owned(),
                actual: stored.digest,
            });
        }
        let blobs = referenced_blobs(&stored.bytes);
        self.link(repo, blobs.iter().map(String::as_str));
        let now = self.clock.now();
        let doc = Doc::Manifest(stored.clone());
        let weight = doc.weight();
        self.docs
            .insert(key.clone(), doc.clone(), key.weight() + weight, now);
        if !is_digest_reference(reference) {
            let by_digest = DocKey::Manifest {
                repo: repo.to_owned(),
                reference: stored.digest.clone(),
            };
            let key_weight = by_digest.weight();
            self.docs
                .insert(by_digest, doc.clone(), key_weight + weight, now);
        }
        Ok(Some(doc))
    }
}

/// Removes a download from the in-progress map when its task ends (also on panic), after
/// the blob was committed, so later requests find it on disk.
struct ForgetDownload {
    shared: Arc<Shared>,
    key: FlightKey,
    inflight: Arc<Inflight>,
}

impl Drop for ForgetDownload {
    fn drop(&mut self) {
        let mut blobs = self.shared.blobs.lock();
        // Only our own entry: a retry may already have replaced a failed one.
        if blobs
            .get(&self.key)
            .is_some_and(|current| Arc::ptr_eq(current, &self.inflight))
        {
            blobs.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests;
