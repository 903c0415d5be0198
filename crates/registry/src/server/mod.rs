//! `ferry registry serve`: the OCI distribution v1.1 HTTP API over a [`Storage`] backend,
//! optionally as a read-only pull-through cache of an upstream registry.
//!
//! Requests are routed by [`routes::Route::parse`] rather than axum path patterns because
//! repository names contain slashes and must be validated on the raw path. Every request
//! is authorized through [`Authenticator::check`] with the scope its route needs, and
//! every failure is a spec error body ([`errors::ApiError`]).
//!
//! The hot path (a fleet pulling the same manifests and layers) is served from bounded
//! in-process caches ([`hot_cache`]) of repository links, tags, manifests and small blobs;
//! the big blobs stream straight from storage.

mod blobs;
pub mod body;
pub mod config;
pub mod conn_guard;
mod discovery;
pub mod errors;
pub mod hot_cache;
pub mod listener;
pub(crate) mod manifests;
pub mod metrics;
pub mod range;
pub mod routes;
pub mod traces;
mod uploads;

#[cfg(test)]
mod tests;

/// The pull-through cache stores sha256 content only (its disk layout and keys are the
/// 64 hex digits): other digests are refused rather than proxied unverified.
fn pull_through_digest(digest: &ferry_oci::Digest) -> Result<(), errors::ApiError> {
    if ferry_oci::digest::is_sha256(digest) {
        return Ok(());
    }
    Err(errors::ApiError::digest_invalid(
        digest.as_ref(),
        "the pull-through cache serves sha256 content only",
    ))
}
#[cfg(test)]
mod suite_tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use ferry_oci::{Digest, RepositoryName, Tag};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, StatusCode, header};

use crate::auth::{Access, Actions, Authenticator, Denied, Scope};
use crate::cache::{CacheError, PullThrough};
use crate::storage::{Storage, StorageError, StoredManifest};

pub use config::{Config, ConfigError, Limits, MemoryCacheConfig, TlsConfig};
pub use errors::{ApiError, ErrorCode};
pub use listener::{ServeError, Server, serve};
pub use metrics::{Metrics, RouteKind};
use routes::Route;

pub(crate) const DOCKER_CONTENT_DIGEST: HeaderName =
    HeaderName::from_static("docker-content-digest");
pub(crate) const DOCKER_UPLOAD_UUID: HeaderName = HeaderName::from_static("docker-upload-uuid");
pub(crate) const API_VERSION: HeaderName =
    HeaderName::from_static("docker-distribution-api-version");
pub(crate) const OCI_SUBJECT: HeaderName = HeaderName::from_static("oci-subject");
/// The tags a manifest PUT's `?tag=` parameters set.
pub(crate) const OCI_TAG: HeaderName = HeaderName::from_static("oci-tag");
pub(crate) const OCI_FILTERS_APPLIED: HeaderName = HeaderName::from_static("oci-filters-applied");

/// Everything a request handler needs; cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    inner: Arc<StateInner>,
}

#[derive(Debug)]
struct StateInner {
    storage: Arc<dyn Storage>,
    auth: Arc<Authenticator>,
    upstream: Option<Arc<PullThrough>>,
    metrics: Metrics,
    limits: Limits,
    /// (repo, blob digest) → size, for blobs the repo links.
    links: hot_cache::HotCache<u64>,
    /// (repo, manifest digest) → manifest linked in that repo.
    manifests: hot_cache::HotCache<Arc<StoredManifest>>,
    /// (repo, tag) → manifest digest.
    tags: hot_cache::HotCache<Arc<str>>,
    /// ("", digest) → whole content of a small blob.
    small_blobs: hot_cache::HotCache<Bytes>,
    small_blob_max: u64,
}

impl AppState {
    /// State over `storage` with authenticator `auth`, optionally in pull-through mode.
    pub fn new(
        storage: Arc<dyn Storage>,
        auth: Arc<Authenticator>,
        upstream: Option<Arc<PullThrough>>,
        metrics: Metrics,
        limits: Limits,
        cache: &MemoryCacheConfig,
    ) -> AppState {
        let ttl = cache.ttl;
        AppState {
            inner: Arc::new(StateInner {
                storage,
                auth,
                upstream,
                metrics,
                limits,
                links: hot_cache::HotCache::new(cache.entries, u64::MAX, ttl),
                manifests: hot_cache::HotCache::new(cache.entries, cache.manifest_bytes, ttl),
                tags: hot_cache::HotCache::new(cache.entries, u64::MAX, ttl),
                small_blobs: hot_cache::HotCache::new(
                    cache.entries,
                    cache.small_blob_total_bytes,
                    ttl,
                ),
                small_blob_max: cache.small_blob_bytes,
            }),
        }
    }

    /// The metrics this state records into.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The storage backend.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.inner.storage
    }

    /// Forget everything cached in memory (after garbage collection).
    pub fn clear_caches(&self) {
        let s = &self.inner;
        s.links.remove_where(|_, _, _| true);
        s.manifests.remove_where(|_, _, _| true);
        s.tags.remove_where(|_, _, _| true);
        s.small_blobs.remove_where(|_, _, _| true);
    }
}

/// The registry's HTTP routes: `/v2/...`, `/metrics`, and the token endpoint.
pub fn router(state: AppState) -> Router {
    let metrics_state = state.clone();
    let token = crate::auth::token_router(state.inner.auth.clone());
    let token_metrics = state.inner.metrics.clone();
    let token = token.layer(axum::middleware::from_fn(
        move |req: Request, next: axum::middleware::Next| {
            let metrics = token_metrics.clone();
            async move {
                let start = Instant::now();
                let resp = next.run(req).await;
                metrics.request(
                    RouteKind::Token,
                    resp.status().as_u16(),
                    start.elapsed().as_secs_f64(),
                );
                resp
            }
        },
    ));
    Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let state = metrics_state.clone();
                async move {
                    let start = Instant::now();
                    let text = state.inner.metrics.encode();
                    let resp = (
                        [(
                            header::CONTENT_TYPE,
                            HeaderValue::from_static(
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            ),
                        )],
                        text,
                    )
                        .into_response();
                    state.inner.metrics.request(
                        RouteKind::Metrics,
                        200,
                        start.elapsed().as_secs_f64(),
                    );
                    resp
                }
            }),
        )
        .merge(token)
        .fallback(move |req: Request| {
            let state = state.clone();
            async move { dispatch(state, req).await }
        })
}

/// A handler's refusal: a spec error or an auth challenge.
#[derive(Debug)]
pub(crate) enum Refusal {
    Api(ApiError),
    Denied(Denied),
}

impl From<ApiError> for Refusal {
    fn from(e: ApiError) -> Self {
        Refusal::Api(e)
    }
}

impl From<Denied> for Refusal {
    fn from(d: Denied) -> Self {
        Refusal::Denied(d)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Api(e) => e.into_response(),
            Refusal::Denied(d) => d.into_response(),
        }
    }
}

pub(crate) type Handled = Result<Response, Refusal>;

async fn dispatch(state: AppState, req: Request) -> Response {
    let start = Instant::now();
    let (parts, body) = req.into_parts();
    let route = Route::parse(parts.uri.path());
    let kind = route_kind(route, &parts.method);
    let result = match route {
        Some(route) => handle(&state.inner, &parts, body, route).await,
        None => Err(ApiError::new(ErrorCode::Unsupported, "no such endpoint")
            .with_status(StatusCode::NOT_FOUND)
            .into()),
    };
    let mut resp = result.unwrap_or_else(IntoResponse::into_response);
    resp.headers_mut()
        .insert(API_VERSION, HeaderValue::from_static("registry/2.0"));
    let m = &state.inner.metrics;
    m.request(kind, resp.status().as_u16(), start.elapsed().as_secs_f64());
    if parts.method != Method::HEAD
        && let Some(len) = body::content_length(resp.headers())
    {
        m.bytes_sent(kind, len);
    }
    resp
}

fn route_kind(route: Option<Route<'_>>, method: &Method) -> RouteKind {
    let Some(route) = route else {
        return RouteKind::Other;
    };
    let read = method == Method::GET || method == Method::HEAD;
    match route {
        Route::Base => RouteKind::Base,
        Route::Catalog => RouteKind::Catalog,
        Route::Tags { .. } => RouteKind::Tags,
        Route::Referrers { .. } => RouteKind::Referrers,
        Route::Manifest { .. } if read => RouteKind::ManifestPull,
        Route::Manifest { .. } if method == Method::PUT => RouteKind::ManifestPush,
        Route::Manifest { .. } if method == Method::DELETE => RouteKind::ManifestDelete,
        Route::Blob { .. } if read => RouteKind::BlobPull,
        Route::Blob { .. } if method == Method::DELETE => RouteKind::BlobDelete,
        Route::UploadStart { .. } | Route::Upload { .. } => RouteKind::Upload,
        _ => RouteKind::Other,
    }
}

async fn handle(st: &StateInner, parts: &Parts, body: Body, route: Route<'_>) -> Handled {
    let m = &parts.method;
    let read = *m == Method::GET || *m == Method::HEAD;
    // The repository name is parsed here, once; handlers receive it typed.
    let name = match route.name() {
        Some(name) => routes::parse_name(name)?,
        None => {
            return match route {
                Route::Base if read => {
                    st.authorize(parts, Scope::base())?;
                    Ok(json_response(StatusCode::OK, Bytes::from_static(b"{}"), m))
                }
                Route::Catalog if read => discovery::catalog(st, parts).await,
                _ => Err(method_not_allowed("GET, HEAD")),
            };
        }
    };
    let name = &name;
    match route {
        Route::Base | Route::Catalog => Err(method_not_allowed("GET, HEAD")),
        Route::Tags { .. } if read => discovery::tags(st, parts, name).await,
        Route::Tags { .. } => Err(method_not_allowed("GET, HEAD")),
        Route::Referrers { digest, .. } if read => {
            discovery::referrers(st, parts, name, digest).await
        }
        Route::Referrers { .. } => Err(method_not_allowed("GET, HEAD")),
        Route::Traces { subject, .. } if *m == Method::PUT => {
            traces::accept(st, parts, body, name, subject).await
        }
        Route::Traces { .. } => Err(method_not_allowed("PUT")),
        Route::Manifest { reference, .. } => match *m {
            Method::GET | Method::HEAD => manifests::pull(st, parts, name, reference).await,
            Method::PUT => manifests::push(st, parts, body, name, reference).await,
            Method::DELETE => manifests::delete(st, parts, name, reference).await,
            _ => Err(method_not_allowed("GET, HEAD, PUT, DELETE")),
        },
        Route::Blob { digest, .. } => match *m {
            Method::GET | Method::HEAD => blobs::pull(st, parts, name, digest).await,
            Method::DELETE => blobs::delete(st, parts, name, digest).await,
            _ => Err(method_not_allowed("GET, HEAD, DELETE")),
        },
        Route::UploadStart { .. } => match *m {
            Method::POST => uploads::start(st, parts, body, name).await,
            _ => Err(method_not_allowed("POST")),
        },
        Route::Upload { id, .. } => match *m {
            Method::GET => uploads::status(st, parts, name, id).await,
            Method::PATCH => uploads::patch(st, parts, body, name, id).await,
            Method::PUT => uploads::finish(st, parts, body, name, id).await,
            Method::DELETE => uploads::cancel(st, parts, name, id).await,
            _ => Err(method_not_allowed("GET, PATCH, PUT, DELETE")),
        },
    }
}

fn method_not_allowed(allow: &'static str) -> Refusal {
    ApiError::unsupported("method not allowed on this endpoint")
        .with_header(header::ALLOW, HeaderValue::from_static(allow))
        .into()
}

/// Pull-through mode is read-only.
fn read_only() -> Refusal {
    ApiError::unsupported("this registry is a read-only pull-through cache").into()
}

impl StateInner {
    /// Authorizes with the request URI too: HTTP/2 requests carry the host in the URI's
    /// authority, not a Host header, and the challenge's default realm is built from it.
    /// The client's address (set per connection by the listener) keys login throttling.
    fn authorize(&self, parts: &http::request::Parts, scope: Scope) -> Result<Access, Denied> {
        let client = parts
            .extensions
            .get::<crate::auth::ClientAddr>()
            .map(|c| c.0);
        self.auth
            .check_request_from(client, Some(&parts.uri), &parts.headers, &scope)
    }

    /// Every repository-scoped check goes through here (one place for exceptions).
    fn authorize_repo(
        &self,
        parts: &http::request::Parts,
        name: &str,
        actions: Actions,
    ) -> Result<(), Denied> {
        self.authorize(parts, Scope::repository(name, actions))
            .map(|_| ())
    }

    /// Size of `digest` if `repo` links it (cached).
    async fn linked_blob_size(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<u64>, ApiError> {
        if let Some(size) = self.links.get(repo, digest.as_ref()) {
            self.metrics.cache_hit("memory_link");
            return Ok(Some(size));
        }
        self.metrics.cache_miss("memory_link");
        let linked = self
            .storage
            .blob_linked(repo, digest)
            .await
            .map_err(|e| storage_failure("checking a blob link", e))?;
        if !linked {
            return Ok(None);
        }
        let size = self
            .storage
            .blob_size(digest)
            .await
            .map_err(|e| storage_failure("reading a blob size", e))?;
        if let Some(size) = size {
            self.links.insert(repo, digest.as_ref(), size, 0);
        }
        Ok(size)
    }

    /// Size of `digest` if `repo` links it, asked of storage (never the cache) and with
    /// the link and blob refreshed, for a manifest about to reference it: a collection
    /// running now (in this process or another) then sees them as young and spares them,
    /// and one that already removed the blob is noticed here.
    async fn linked_blob_size_for_manifest(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<u64>, ApiError> {
        let linked = self
            .storage
            .blob_linked(repo, digest)
            .await
            .map_err(|e| storage_failure("checking a blob link", e))?;
        if !linked {
            self.links.remove(repo, digest.as_ref());
            return Ok(None);
        }
        self.storage
            .link_blob(repo, digest)
            .await
            .map_err(|e| storage_failure("refreshing a blob link", e))?;
        // After the refresh: a collection that removed the blob before it is seen here.
        let size = self
            .storage
            .blob_size(digest)
            .await
            .map_err(|e| storage_failure("reading a blob size", e))?;
        match size {
            Some(size) => self.links.insert(repo, digest.as_ref(), size, 0),
            None => self.links.remove(repo, digest.as_ref()),
        }
        Ok(size)
    }

    /// The digest `tag` of `repo` points at (cached briefly).
    async fn resolve_tag(
        &self,
        repo: &RepositoryName,
        tag: &Tag,
    ) -> Result<Option<Arc<str>>, ApiError> {
        if let Some(d) = self.tags.get(repo, tag.as_ref()) {
            self.metrics.cache_hit("memory_tag");
            return Ok(Some(d));
        }
        self.metrics.cache_miss("memory_tag");
        let found = self
            .storage
            .tag_get(repo, tag)
            .await
            .map_err(|e| storage_failure("reading a tag", e))?;
        Ok(found.map(|d| {
            let d: Arc<str> = d.into();
            self.tags.insert(repo, tag.as_ref(), d.clone(), 0);
            d
        }))
    }

    /// Manifest `digest` of `repo` (cached; content-addressed).
    async fn manifest(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<Arc<StoredManifest>>, ApiError> {
        if let Some(m) = self.manifests.get(repo, digest.as_ref()) {
            self.metrics.cache_hit("memory_manifest");
            return Ok(Some(m));
        }
        self.metrics.cache_miss("memory_manifest");
        let found = self
            .storage
            .manifest_get(repo, digest)
            .await
            .map_err(|e| storage_failure("reading a manifest", e))?;
        Ok(found.map(|m| {
            let weight = m.bytes.len() as u64;
            let m = Arc::new(m);
            self.manifests
                .insert(repo, digest.as_ref(), m.clone(), weight);
            m
        }))
    }

    fn upstream_failure(&self, what: &str, err: CacheError) -> ApiError {
        tracing::warn!(%err, "pull-through: {what}");
        // Pass the upstream's meaning on: a client told 429 backs off, one told 416 fixes
        // its range; only real outages and bad answers become 502/503 UNAVAILABLE.
        let status = StatusCode::from_u16(err.http_status()).unwrap_or(StatusCode::BAD_GATEWAY);
        let code = match status {
            StatusCode::TOO_MANY_REQUESTS => ErrorCode::TooManyRequests,
            StatusCode::FORBIDDEN => ErrorCode::Denied,
            StatusCode::RANGE_NOT_SATISFIABLE => ErrorCode::BlobUnknown,
            StatusCode::INTERNAL_SERVER_ERROR => ErrorCode::Unknown,
            _ => ErrorCode::Unavailable,
        };
        // The details (upstream host, URL, the client library's login hints) go to the
        // log only: they describe ferry's upstream, not anything this client can act on.
        let message = match code {
            ErrorCode::TooManyRequests => "the upstream registry is rate-limiting; retry later",
            ErrorCode::Denied => "the upstream registry refused this registry's credentials",
            ErrorCode::BlobUnknown => "requested range not satisfiable",
            ErrorCode::Unknown => "the pull-through cache failed; see the registry log",
            _ => "the upstream registry is unavailable and nothing usable is cached",
        };
        ApiError::new(code, message).with_status(status)
    }

    fn idle(&self) -> Duration {
        self.limits.body_idle_timeout
    }
}

/// A storage failure outside the blob/upload paths: always a 500.
fn storage_failure(what: &str, err: StorageError) -> ApiError {
    match err {
        StorageError::Invalid(why) => ApiError::new(ErrorCode::NameInvalid, why),
        other => ApiError::internal(what, &other),
    }
}

fn json_response(status: StatusCode, json: Bytes, method: &Method) -> Response {
    let len = json.len();
    let mut resp = if *method == Method::HEAD {
        Response::new(Body::empty())
    } else {
        Response::new(Body::from(json))
    };
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

/// An empty-bodied response with the given status.
fn empty_response(status: StatusCode) -> Response {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = status;
    if status != StatusCode::NO_CONTENT {
        resp.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    }
    resp
}

/// A header value from text we built or validated (names, digests, ids, URLs); invalid
/// bytes cannot occur, but a failure becomes a 500 rather than a panic.
fn header_value(text: &str) -> Result<HeaderValue, ApiError> {
    HeaderValue::from_str(text).map_err(|e| ApiError::internal("building a response header", &e))
}

/// The query parameters of a request, decoded.
fn query_pairs(
    parts: &Parts,
) -> impl Iterator<Item = (std::borrow::Cow<'_, str>, std::borrow::Cow<'_, str>)> {
    url::form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes())
}

/// The first value of query parameter `key`.
fn query_param(parts: &Parts, key: &str) -> Option<String> {
    query_pairs(parts)
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}
