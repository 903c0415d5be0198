//! The peer server: a registry's blob reads (`HEAD`/`GET /v2/<name>/blobs/<digest>`,
//! one `Range` per request) answered from the verified spans in the node's chunk store:
//! a layer blob's compressed spans, or a windows blob's inflate windows (stored under
//! their SHA-256 like spans), under the same rules.
//!
//! The registry a blob is read for is named by the `ns` query parameter, as containerd
//! names it to a mirror. Answers, in the order they are decided:
//!
//! | status | when |
//! |---|---|
//! | 503 | [`ServerLimits::max_concurrent`] requests are being served already |
//! | 401 | no cluster token, or not ours |
//! | 400 | the name, digest or `ns` does not parse |
//! | 404 | this node does not serve that blob |
//! | 403 | the blob was not resolved from that registry here, or the registry said the forwarded credential may not read it in that repository |
//! | 416 | the range starts past the end, or is longer than [`ServerLimits::max_range`] |
//! | 404 | some span of the range is not in the store (not arrived within [`ServerLimits::arrival_wait`], not verified, evicted) |
//! | 206/200 | the bytes, every span of them verified by the store |

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use ferry_oci::{Digest, RepositoryName};
use ferry_registry_client::{RangeRequest, Repo, parse_range};
use ferry_store::Store;
use tokio::sync::Semaphore;

use super::auth::{ClusterToken, PullGate};
use super::catalog::{BlobCatalog, Lookup, SpanTable};
use super::{MAX_CREDENTIAL_LEN, P2pStats, REGISTRY_AUTHORIZATION};
use crate::error::{Error, Result};

/// Longest request path accepted (a repository name is at most 255 bytes).
const MAX_PATH_LEN: usize = 512;

/// The server's bounds.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// Requests served at once; more are answered 503.
    pub max_concurrent: usize,
    /// Longest one request may take (the pull check and reading the store).
    pub request_timeout: Duration,
    /// Longest range served in one request.
    pub max_range: u64,
    /// How long a request for spans not stored yet waits for them to arrive before it
    /// is answered 404 (zero: not at all). A fleet starting one image at once asks a
    /// parent for a piece while the parent's own read of it is still in flight; a 404
    /// then sends the child to the registry, and the registry serves the piece once per
    /// node instead of `roots` times. Kept well under the callers' `peer_timeout`,
    /// which covers the parent and every fallback together.
    pub arrival_wait: Duration,
}

/// How often a request waiting for spans to arrive looks again.
const ARRIVAL_POLL: Duration = Duration::from_millis(5);

/// Everything the server needs.
#[derive(Debug)]
pub struct PeerServer {
    catalog: Arc<BlobCatalog>,
    store: Arc<Store>,
    token: ClusterToken,
    gate: PullGate,
    limits: ServerLimits,
    permits: Arc<Semaphore>,
    stats: Arc<P2pStats>,
}

impl PeerServer {
    /// A server of `catalog`'s blobs out of `store`.
    pub fn new(
        catalog: Arc<BlobCatalog>,
        store: Arc<Store>,
        token: ClusterToken,
        gate: PullGate,
        limits: ServerLimits,
        stats: Arc<P2pStats>,
    ) -> PeerServer {
        PeerServer {
            catalog,
            store,
            token,
            gate,
            permits: Arc::new(Semaphore::new(limits.max_concurrent.max(1))),
            limits,
            stats,
        }
    }
}

#[derive(Debug, serde::Deserialize)]
struct Params {
    ns: Option<String>,
}

/// The server's routes.
pub fn router(server: Arc<PeerServer>) -> Router {
    Router::new()
        .route("/v2/", any(ping))
        .route("/v2/{*path}", any(blob))
        .with_state(server)
}

/// Serves `router` on `listener` (a `TcpListener` for plain HTTP, a
/// [`super::tls::TlsListener`] for TLS) until `shutdown` resolves.
pub async fn serve<L>(
    listener: L,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| Error::io("serving peers", e))
}

fn status(code: StatusCode) -> Response {
    code.into_response()
}

fn unauthorized(s: &PeerServer) -> Response {
    P2pStats::add(&s.stats.refused_unauthenticated, 1);
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer realm=\"ferry-p2p\"")],
    )
        .into_response()
}

fn forbidden(s: &PeerServer) -> Response {
    P2pStats::add(&s.stats.refused_forbidden, 1);
    status(StatusCode::FORBIDDEN)
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn ping(State(s): State<Arc<PeerServer>>, headers: HeaderMap) -> Response {
    if !s.token.admits(header_str(&headers, "authorization")) {
        return unauthorized(&s);
    }
    status(StatusCode::OK)
}

async fn blob(
    State(s): State<Arc<PeerServer>>,
    method: Method,
    uri: Uri,
    Query(params): Query<Params>,
    headers: HeaderMap,
) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return status(StatusCode::METHOD_NOT_ALLOWED);
    }
    let Ok(_permit) = s.permits.clone().try_acquire_owned() else {
        P2pStats::add(&s.stats.refused_busy, 1);
        return status(StatusCode::SERVICE_UNAVAILABLE);
    };
    if !s.token.admits(header_str(&headers, "authorization")) {
        return unauthorized(&s);
    }
    match tokio::time::timeout(
        s.limits.request_timeout,
        answer(&s, method == Method::HEAD, uri.path(), params, &headers),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => status(StatusCode::SERVICE_UNAVAILABLE),
    }
}

/// `<name>/blobs/<digest>` of a `/v2/` path, parsed.
fn parse_path(path: &str) -> Option<(RepositoryName, Digest)> {
    if path.len() > MAX_PATH_LEN {
        return None;
    }
    let rest = path.strip_prefix("/v2/")?;
    let (name, digest) = rest.rsplit_once("/blobs/")?;
    Some((
        RepositoryName::parse(name).ok()?,
        ferry_oci::digest::parse_sha256(digest).ok()?,
    ))
}

async fn answer(
    s: &Arc<PeerServer>,
    head: bool,
    path: &str,
    params: Params,
    headers: &HeaderMap,
) -> Response {
    let (Some((name, digest)), Some(registry)) = (parse_path(path), params.ns) else {
        return status(StatusCode::BAD_REQUEST);
    };
    if registry.is_empty() || registry.len() > 255 || registry.contains(['/', '@']) {
        return status(StatusCode::BAD_REQUEST);
    }
    let table = match s.catalog.lookup(&digest, &registry) {
        Lookup::Unknown => return status(StatusCode::NOT_FOUND),
        // Only the registry this node itself resolved the blob from may vouch for a
        // pull right: a registry the caller names freely could say yes to anything.
        Lookup::OtherRegistry => return forbidden(s),
        Lookup::Found(t) => t,
    };
    let credential = match headers.get(REGISTRY_AUTHORIZATION) {
        None => None,
        Some(v) if v.len() <= MAX_CREDENTIAL_LEN => match v.to_str() {
            Ok(v) => Some(v),
            Err(_) => return status(StatusCode::BAD_REQUEST),
        },
        Some(_) => return status(StatusCode::BAD_REQUEST),
    };
    let repo = Repo::new(registry, name);
    match s.gate.check(&repo, &digest, credential).await {
        Ok(true) => {}
        Ok(false) => return forbidden(s),
        Err(e) => {
            tracing::info!(%repo, error = %e, "cannot check a peer's pull right; refusing");
            return status(StatusCode::SERVICE_UNAVAILABLE);
        }
    }
    let size = table.size();
    let common = |mut r: Response| {
        let h = r.headers_mut();
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        if let Ok(v) = HeaderValue::from_str(digest.as_ref()) {
            h.insert("docker-content-digest", v);
        }
        r
    };
    if head {
        return common(
            (StatusCode::OK, [(header::CONTENT_LENGTH, size.to_string())]).into_response(),
        );
    }
    let range_header = header_str(headers, "range");
    let (code, range) = match parse_range(range_header, size) {
        RangeRequest::Full => (StatusCode::OK, 0..size),
        RangeRequest::Partial(r) => (StatusCode::PARTIAL_CONTENT, r),
        RangeRequest::Unsatisfiable => return unsatisfiable(size),
    };
    if range.end - range.start > s.limits.max_range {
        return unsatisfiable(size);
    }
    let waiting_until = tokio::time::Instant::now() + s.limits.arrival_wait;
    while !all_stored(&s.store, &table, &range) && tokio::time::Instant::now() < waiting_until {
        tokio::time::sleep(ARRIVAL_POLL).await;
    }
    let (store, table2, rg) = (s.store.clone(), table.clone(), range.clone());
    let bytes = match tokio::task::spawn_blocking(move || read_verified(&store, &table2, rg)).await
    {
        Ok(Some(b)) => b,
        _ => return status(StatusCode::NOT_FOUND),
    };
    P2pStats::add(s.stats.served(table.kind()), bytes.len() as u64);
    let mut r = (code, bytes).into_response();
    if code == StatusCode::PARTIAL_CONTENT
        && let Ok(v) =
            HeaderValue::from_str(&format!("bytes {}-{}/{size}", range.start, range.end - 1))
    {
        r.headers_mut().insert(header::CONTENT_RANGE, v);
    }
    common(r)
}

fn unsatisfiable(size: u64) -> Response {
    (
        StatusCode::RANGE_NOT_SATISFIABLE,
        [(header::CONTENT_RANGE, format!("bytes */{size}"))],
    )
        .into_response()
}

/// Whether the store holds an entry for every span covering `range` (committed, not yet
/// verified by this read: [`read_verified`] does that).
fn all_stored(store: &Store, table: &SpanTable, range: &std::ops::Range<u64>) -> bool {
    let ks = table.covering(range);
    !ks.is_empty() && ks.into_iter().all(|k| store.contains(table.span(k).1))
}

/// `range` of the blob out of the store's entries for its spans, each verified by the
/// store (hashed on its first read by this process, or written by it after a check);
/// `None` when any span is missing or damaged: never a byte that was not verified.
pub fn read_verified(
    store: &Store,
    table: &SpanTable,
    range: std::ops::Range<u64>,
) -> Option<Vec<u8>> {
    let ks = table.covering(&range);
    if ks.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(usize::try_from(range.end - range.start).ok()?);
    let mut at = range.start;
    for k in ks {
        let (span, key) = table.span(k);
        if span.start > at {
            // A hole between spans (not in the index): nothing verified covers it.
            return None;
        }
        let bytes = store.get(key).ok()??;
        if bytes.len() as u64 != span.end - span.start {
            return None;
        }
        let from = usize::try_from(at - span.start).ok()?;
        let to = usize::try_from(range.end.min(span.end) - span.start).ok()?;
        out.extend_from_slice(&bytes[from..to]);
        at = range.end.min(span.end);
    }
    (at == range.end).then_some(out)
}
