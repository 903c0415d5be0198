//! The load tester's engine: virtual nodes, their connections, and the node-start flow.
//!
//! One task per virtual node, each with its own hyper HTTP/1.1 connection to the registry
//! (and, only when a token realm or a redirect names another host, one more per such
//! host). Raw `client::conn` connections rather than a pooled client: a node is one
//! connection, as a containerd on a fresh node would be, and nothing is shared between
//! nodes except the lock-free counters. The image is resolved once before the run
//! ([`discover`]) so the measured loop only sends requests and drains bodies.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use super::challenge::{Challenge, parse_challenge};
use super::report::{ErrorClass, RequestKind, Stats};
use super::{LayerMode, LoadTestConfig, LoadTestError, Report, split_authority};

/// Largest manifest read during discovery (the spec's recommended limit).
const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// Largest token response read.
const MAX_TOKEN_BYTES: usize = 1 << 20;
/// Redirect hops followed per blob GET.
const MAX_REDIRECTS: usize = 3;
/// Layers per image the tester will replay.
const MAX_LAYERS: usize = 1000;
/// Connections per node beyond the registry's (token realm, redirect targets).
const MAX_CONNS_PER_NODE: usize = 4;
/// Pause after a start that failed on connect or auth, so a down registry is not spun on.
const FAILURE_BACKOFF: Duration = Duration::from_millis(20);

/// Everything a node start requests, resolved once before the run.
#[derive(Debug, Clone)]
struct Plan {
    /// The tag, then (when the tag names an index) the platform manifest's digest.
    manifest_paths: Vec<Uri>,
    config_path: Uri,
    layer_paths: Vec<Uri>,
}

/// What every node of one run shares.
#[derive(Debug)]
struct Shared {
    cfg: LoadTestConfig,
    registry_host: String,
    registry_addr: String,
    registry_host_header: HeaderValue,
    accept: HeaderValue,
    range: Option<HeaderValue>,
    basic: Option<HeaderValue>,
    stats: Stats,
    measure_from: Instant,
    stop_at: Instant,
}

impl Shared {
    fn new(
        cfg: &LoadTestConfig,
        measure_from: Instant,
        stop_at: Instant,
    ) -> Result<Self, LoadTestError> {
        let invalid = |m: String| LoadTestError::InvalidConfig(m);
        let (host, port) = split_authority(&cfg.registry).map_err(invalid)?;
        let registry_addr = join_host_port(&host, port);
        let range = match (cfg.layer_mode, cfg.range_bytes) {
            (LayerMode::Head, _) | (_, None) => None,
            (_, Some(n)) => Some(
                HeaderValue::try_from(format!("bytes=0-{}", n.saturating_sub(1)))
                    .map_err(|e| invalid(e.to_string()))?,
            ),
        };
        let basic = match &cfg.credentials {
            None => None,
            Some(c) => {
                let raw = format!("{}:{}", c.username, c.password);
                let v = format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(raw)
                );
                Some(HeaderValue::try_from(v).map_err(|_| {
                    invalid("credentials contain characters not allowed in a header".into())
                })?)
            }
        };
        let registry_host_header = HeaderValue::try_from(cfg.registry.as_str())
            .map_err(|_| invalid(format!("registry {:?} is not a valid Host", cfg.registry)))?;
        // The manifest types a node accepts, most preferred first: the client's list.
        let accept = HeaderValue::try_from(ferry_registry_client::MANIFEST_TYPES.join(", "))
            .map_err(|e| invalid(e.to_string()))?;
        Ok(Shared {
            cfg: cfg.clone(),
            registry_host: host,
            registry_addr,
            registry_host_header,
            accept,
            range,
            basic,
            stats: Stats::default(),
            measure_from,
            stop_at,
        })
    }

    fn in_window(&self, at: Instant) -> bool {
        at >= self.measure_from && at <= self.stop_at
    }

    fn host_allowed(&self, host: &str) -> bool {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        bare.eq_ignore_ascii_case(&self.registry_host)
            || bare.eq_ignore_ascii_case("localhost")
            || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
            || self
                .cfg
                .allowed_hosts
                .iter()
                .any(|h| h.eq_ignore_ascii_case(bare))
    }
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// One keep-alive connection of a node.
#[derive(Debug)]
struct Conn {
    /// `host:port` it connects to (also its `Host` header).
    addr: String,
    host_header: HeaderValue,
    sender: Option<SendRequest<Empty<Bytes>>>,
}

/// How a step of a node start ended when it did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The run is over; record nothing more.
    Stop,
    /// The step failed (already recorded).
    Fail,
}

/// A response, its body drained (and kept only when asked).
#[derive(Debug)]
struct Resp {
    status: StatusCode,
    latency: Duration,
    bytes: u64,
    body: Option<Bytes>,
    location: Option<HeaderValue>,
    challenge: Option<HeaderValue>,
}

/// How one HTTP exchange ended.
#[derive(Debug)]
enum Outcome {
    Response(Resp),
    Failed(ErrorClass),
    Stopped,
}

/// One request to send.
#[derive(Debug)]
struct Req<'a> {
    method: Method,
    path: &'a Uri,
    authorization: Option<HeaderValue>,
    accept: bool,
    range: bool,
    keep_body: Option<usize>,
}

/// A virtual node.
#[derive(Debug)]
struct Node {
    shared: Arc<Shared>,
    conns: Vec<Conn>,
    authorization: Option<HeaderValue>,
    authenticated: bool,
    backoff: bool,
    /// Whether the last response was counted in the report. A layer request is
    /// counted with its final response, not by a second look at the clock that
    /// could fall just past the window and make the totals disagree by one.
    last_response_counted: bool,
}

impl Node {
    fn new(shared: Arc<Shared>) -> Self {
        let registry = Conn {
            host_header: shared.registry_host_header.clone(),
            addr: shared.registry_addr.clone(),
            sender: None,
        };
        Node {
            shared,
            conns: vec![registry],
            authorization: None,
            authenticated: false,
            backoff: false,
            last_response_counted: false,
        }
    }

    /// Index of the connection to `addr`, adding one (or replacing the newest extra one).
    /// `None` if `addr` cannot be a `Host` header (it came from a parsed URL, so never).
    fn conn_for(&mut self, addr: &str) -> Option<usize> {
        if let Some(i) = self.conns.iter().position(|c| c.addr == addr) {
            return Some(i);
        }
        let conn = Conn {
            addr: addr.to_string(),
            host_header: HeaderValue::try_from(addr).ok()?,
            sender: None,
        };
        if self.conns.len() < MAX_CONNS_PER_NODE {
            self.conns.push(conn);
        } else {
            let last = self.conns.len() - 1;
            self.conns[last] = conn;
        }
        Some(self.conns.len() - 1)
    }

    /// Sends `req` on connection `conn` within the request timeout and the run's end.
    async fn fetch(&mut self, conn: usize, req: Req<'_>) -> Outcome {
        let now = Instant::now();
        let stop_at = self.shared.stop_at;
        if now >= stop_at {
            return Outcome::Stopped;
        }
        let timeout_at = now + self.shared.cfg.request_timeout;
        let (deadline, ends_run) = if timeout_at >= stop_at {
            (stop_at, true)
        } else {
            (timeout_at, false)
        };
        let shared = &self.shared;
        let Some(c) = self.conns.get_mut(conn) else {
            return Outcome::Failed(ErrorClass::Connect);
        };
        match tokio::time::timeout_at(deadline.into(), exchange(shared, c, req)).await {
            Ok(Ok(resp)) => Outcome::Response(resp),
            Ok(Err(class)) => {
                c.sender = None;
                Outcome::Failed(class)
            }
            Err(_elapsed) => {
                // The request is still in flight on this connection: it cannot be reused.
                c.sender = None;
                if ends_run {
                    Outcome::Stopped
                } else {
                    Outcome::Failed(ErrorClass::Timeout)
                }
            }
        }
    }

    fn record_response(&mut self, kind: RequestKind, r: &Resp, error: Option<ErrorClass>) {
        self.last_response_counted = self.shared.in_window(Instant::now());
        if self.last_response_counted {
            self.shared.stats.response(kind, r.latency, r.bytes, error);
        }
        if matches!(error, Some(ErrorClass::Auth)) {
            self.backoff = true;
        }
    }

    fn record_failure(&mut self, kind: RequestKind, error: ErrorClass) {
        if self.shared.in_window(Instant::now()) {
            self.shared.stats.failure(kind, error);
        }
        if matches!(error, ErrorClass::Connect | ErrorClass::Auth) {
            self.backoff = true;
        }
    }

    /// `GET /v2/`, then whatever the challenge asks for.
    async fn authenticate(&mut self) -> Result<(), End> {
        let path = Uri::from_static("/v2/");
        let req = Req {
            method: Method::GET,
            path: &path,
            authorization: None,
            accept: false,
            range: false,
            keep_body: None,
        };
        let r = match self.fetch(0, req).await {
            Outcome::Stopped => return Err(End::Stop),
            Outcome::Failed(e) => {
                self.record_failure(RequestKind::Ping, e);
                return Err(End::Fail);
            }
            Outcome::Response(r) => r,
        };
        match r.status {
            StatusCode::OK => {
                self.record_response(RequestKind::Ping, &r, None);
                self.authorization = None;
            }
            StatusCode::UNAUTHORIZED => {
                self.record_response(RequestKind::Ping, &r, None);
                self.answer_challenge(r.challenge.as_ref()).await?;
            }
            s => {
                self.record_response(RequestKind::Ping, &r, Some(ErrorClass::Status(s.as_u16())));
                return Err(End::Fail);
            }
        }
        self.authenticated = true;
        Ok(())
    }

    /// Sets `authorization` as a 401's `WWW-Authenticate` asks (Basic creds or a token).
    async fn answer_challenge(&mut self, header: Option<&HeaderValue>) -> Result<(), End> {
        let challenge = header
            .and_then(|h| h.to_str().ok())
            .and_then(parse_challenge);
        match challenge {
            Some(Challenge::Basic) if self.shared.basic.is_some() => {
                self.authorization = self.shared.basic.clone();
                Ok(())
            }
            Some(Challenge::Bearer { realm, service, .. }) => {
                self.fetch_token(&realm, service.as_deref()).await
            }
            Some(Challenge::Basic) | None => {
                self.record_failure(RequestKind::Token, ErrorClass::Auth);
                Err(End::Fail)
            }
        }
    }

    /// Gets a pull token for the repository from `realm`.
    async fn fetch_token(&mut self, realm: &str, service: Option<&str>) -> Result<(), End> {
        let fail = |node: &mut Node, e: ErrorClass| {
            node.record_failure(RequestKind::Token, e);
            Err(End::Fail)
        };
        let Ok(mut url) = url::Url::parse(realm) else {
            return fail(self, ErrorClass::Auth);
        };
        let Some((addr, _)) = self.http_target(&url) else {
            return fail(self, ErrorClass::Auth);
        };
        {
            let mut q = url.query_pairs_mut();
            if let Some(s) = service {
                q.append_pair("service", s);
            }
            q.append_pair(
                "scope",
                &format!("repository:{}:pull", self.shared.cfg.repository),
            );
        }
        let Some(path) = origin_form(&url) else {
            return fail(self, ErrorClass::Auth);
        };
        let Some(conn) = self.conn_for(&addr) else {
            return fail(self, ErrorClass::Auth);
        };
        let req = Req {
            method: Method::GET,
            path: &path,
            authorization: self.shared.basic.clone(),
            accept: false,
            range: false,
            keep_body: Some(MAX_TOKEN_BYTES),
        };
        let r = match self.fetch(conn, req).await {
            Outcome::Stopped => return Err(End::Stop),
            Outcome::Failed(e) => return fail(self, e),
            Outcome::Response(r) => r,
        };
        if r.status != StatusCode::OK {
            self.record_response(
                RequestKind::Token,
                &r,
                Some(ErrorClass::Status(r.status.as_u16())),
            );
            self.backoff = true;
            return Err(End::Fail);
        }
        #[derive(serde::Deserialize)]
        struct TokenBody {
            token: Option<String>,
            access_token: Option<String>,
        }
        let token = r
            .body
            .as_deref()
            .and_then(|b| serde_json::from_slice::<TokenBody>(b).ok())
            .and_then(|t| t.token.or(t.access_token))
            .and_then(|t| HeaderValue::try_from(format!("Bearer {t}")).ok());
        match token {
            Some(t) => {
                self.record_response(RequestKind::Token, &r, None);
                self.shared
                    .stats
                    .token_fetches
                    .fetch_add(1, Ordering::Relaxed);
                self.authorization = Some(t);
                Ok(())
            }
            None => {
                self.record_response(RequestKind::Token, &r, Some(ErrorClass::Auth));
                Err(End::Fail)
            }
        }
    }

    /// `host:port` of an `http` URL this tester may contact, with its host.
    fn http_target(&self, url: &url::Url) -> Option<(String, String)> {
        if url.scheme() != "http" {
            return None;
        }
        let host = url.host_str()?;
        if !self.shared.host_allowed(host) {
            return None;
        }
        let port = url.port_or_known_default()?;
        Some((join_host_port(host, port), host.to_string()))
    }

    /// A request to the registry; a 401 is answered once (token refresh) and retried.
    /// `follow` makes a 3xx an expected answer (the caller follows it).
    async fn registry_call(
        &mut self,
        kind: RequestKind,
        method: Method,
        path: &Uri,
        accept: bool,
        range: bool,
        follow: bool,
    ) -> Result<Resp, End> {
        for attempt in 0..2 {
            let req = Req {
                method: method.clone(),
                path,
                authorization: self.authorization.clone(),
                accept,
                range,
                keep_body: None,
            };
            let r = match self.fetch(0, req).await {
                Outcome::Stopped => return Err(End::Stop),
                Outcome::Failed(e) => {
                    self.record_failure(kind, e);
                    return Err(End::Fail);
                }
                Outcome::Response(r) => r,
            };
            let status = r.status;
            if status == StatusCode::UNAUTHORIZED && attempt == 0 {
                // Expired or missing token: get another, as a node would, and retry.
                self.shared
                    .stats
                    .token_refreshes
                    .fetch_add(1, Ordering::Relaxed);
                self.answer_challenge(r.challenge.as_ref()).await?;
                continue;
            }
            let expected = match kind {
                RequestKind::LayerGet => {
                    status == StatusCode::OK || status == StatusCode::PARTIAL_CONTENT
                }
                _ => status == StatusCode::OK,
            } || (follow && is_redirect(status));
            if expected {
                self.record_response(kind, &r, None);
                return Ok(r);
            }
            self.record_response(kind, &r, Some(ErrorClass::Status(status.as_u16())));
            return Err(End::Fail);
        }
        Err(End::Fail)
    }

    /// GET a blob (ranged for layers), following redirects in redirect mode.
    async fn blob_get(&mut self, kind: RequestKind, path: &Uri, ranged: bool) -> Result<(), End> {
        let follow = self.shared.cfg.layer_mode == LayerMode::Redirect;
        let r = self
            .registry_call(kind, Method::GET, path, false, ranged, follow)
            .await?;
        if !is_redirect(r.status) {
            return Ok(());
        }
        let registry_base = format!("http://{}", self.shared.registry_addr);
        let mut base = match url::Url::parse(&registry_base).and_then(|b| b.join(&path.to_string()))
        {
            Ok(u) => u,
            Err(_) => {
                self.record_failure(RequestKind::RedirectTarget, ErrorClass::BadRedirect);
                return Err(End::Fail);
            }
        };
        let mut location = r.location;
        for _hop in 0..MAX_REDIRECTS {
            let target = location
                .as_ref()
                .and_then(|l| l.to_str().ok())
                .and_then(|l| base.join(l).ok());
            let Some(target) = target else { break };
            let Some((addr, _host)) = self.http_target(&target) else {
                break;
            };
            let Some(target_path) = origin_form(&target) else {
                break;
            };
            // Credentials go only to the registry itself, never to a presigned URL's host.
            let authorization = if addr == self.shared.registry_addr {
                self.authorization.clone()
            } else {
                None
            };
            let Some(conn) = self.conn_for(&addr) else {
                break;
            };
            let req = Req {
                method: Method::GET,
                path: &target_path,
                authorization,
                accept: false,
                range: ranged,
                keep_body: None,
            };
            let r = match self.fetch(conn, req).await {
                Outcome::Stopped => return Err(End::Stop),
                Outcome::Failed(e) => {
                    self.record_failure(RequestKind::RedirectTarget, e);
                    return Err(End::Fail);
                }
                Outcome::Response(r) => r,
            };
            if r.status == StatusCode::OK || r.status == StatusCode::PARTIAL_CONTENT {
                self.record_response(RequestKind::RedirectTarget, &r, None);
                return Ok(());
            }
            if !is_redirect(r.status) {
                self.record_response(
                    RequestKind::RedirectTarget,
                    &r,
                    Some(ErrorClass::Status(r.status.as_u16())),
                );
                return Err(End::Fail);
            }
            self.record_response(RequestKind::RedirectTarget, &r, None);
            location = r.location;
            base = target;
        }
        self.record_failure(RequestKind::RedirectTarget, ErrorClass::BadRedirect);
        Err(End::Fail)
    }

    /// One node start: manifest(s), config, every layer. A manifest failure ends the start;
    /// a config or layer failure is counted and the rest still requested, so the request
    /// mix stays the same whatever fails.
    async fn start(&mut self, plan: &Plan) -> Result<(), End> {
        for path in &plan.manifest_paths {
            self.registry_call(RequestKind::Manifest, Method::GET, path, true, false, false)
                .await?;
        }
        let mut outcome = Ok(());
        match self
            .blob_get(RequestKind::Config, &plan.config_path, false)
            .await
        {
            Err(End::Stop) => return Err(End::Stop),
            Err(End::Fail) => outcome = Err(End::Fail),
            Ok(()) => {}
        }
        for path in &plan.layer_paths {
            let r = match self.shared.cfg.layer_mode {
                LayerMode::Head => self
                    .registry_call(
                        RequestKind::LayerHead,
                        Method::HEAD,
                        path,
                        false,
                        false,
                        false,
                    )
                    .await
                    .map(|_| ()),
                LayerMode::Get | LayerMode::Redirect => {
                    self.blob_get(RequestKind::LayerGet, path, true).await
                }
            };
            match r {
                Ok(()) => {
                    if self.last_response_counted {
                        self.shared.stats.layers_ok.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(End::Stop) => return Err(End::Stop),
                Err(End::Fail) => outcome = Err(End::Fail),
            }
        }
        outcome
    }
}

fn is_redirect(s: StatusCode) -> bool {
    matches!(s.as_u16(), 301 | 302 | 303 | 307 | 308)
}

/// `/path?query` of a URL.
fn origin_form(url: &url::Url) -> Option<Uri> {
    let s = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    Uri::try_from(s).ok()
}

/// Opens a connection (TCP_NODELAY, HTTP/1.1) and spawns its driver.
async fn connect(addr: &str, stats: &Stats) -> Result<SendRequest<Empty<Bytes>>, ErrorClass> {
    stats.connects.fetch_add(1, Ordering::Relaxed);
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|_| ErrorClass::Connect)?;
    // Best effort: without it small requests wait for Nagle, which only slows us down.
    let _ = stream.set_nodelay(true);
    let (sender, connection) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|_| ErrorClass::Connect)?;
    tokio::spawn(async move {
        // Ends when the node drops its sender or the server closes; either is normal.
        let _ = connection.await;
    });
    Ok(sender)
}

/// One request/response on `conn` (connecting first if needed), body drained.
async fn exchange(shared: &Shared, conn: &mut Conn, req: Req<'_>) -> Result<Resp, ErrorClass> {
    let reusable = match conn.sender.as_mut() {
        Some(s) if !s.is_closed() => s.ready().await.is_ok(),
        _ => false,
    };
    if !reusable {
        conn.sender = Some(connect(&conn.addr, &shared.stats).await?);
    }
    let sender = conn.sender.as_mut().ok_or(ErrorClass::Connect)?;
    sender.ready().await.map_err(|_| ErrorClass::Connect)?;

    let mut request = Request::new(Empty::<Bytes>::new());
    *request.method_mut() = req.method;
    *request.uri_mut() = req.path.clone();
    let headers = request.headers_mut();
    headers.insert(header::HOST, conn.host_header.clone());
    if let Some(a) = req.authorization {
        headers.insert(header::AUTHORIZATION, a);
    }
    if req.accept {
        headers.insert(header::ACCEPT, shared.accept.clone());
    }
    if req.range
        && let Some(r) = &shared.range
    {
        headers.insert(header::RANGE, r.clone());
    }

    let started = Instant::now();
    let response = sender
        .send_request(request)
        .await
        .map_err(|_| ErrorClass::Io)?;
    let (parts, mut body) = response.into_parts();
    let mut bytes = 0u64;
    let mut kept = req.keep_body.map(|_| BytesMut::new());
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ErrorClass::Io)?;
        if let Ok(data) = frame.into_data() {
            bytes += data.len() as u64;
            if let (Some(buf), Some(limit)) = (kept.as_mut(), req.keep_body) {
                if buf.len() + data.len() > limit {
                    return Err(ErrorClass::BodyTooLarge);
                }
                buf.extend_from_slice(&data);
            }
        }
    }
    let latency = started.elapsed();
    let status = parts.status;
    let location = if is_redirect(status) {
        parts.headers.get(header::LOCATION).cloned()
    } else {
        None
    };
    let challenge = if status == StatusCode::UNAUTHORIZED {
        parts.headers.get(header::WWW_AUTHENTICATE).cloned()
    } else {
        None
    };
    Ok(Resp {
        status,
        latency,
        bytes,
        body: kept.map(BytesMut::freeze),
        location,
        challenge,
    })
}

/// Runs a virtual node until the run ends.
async fn run_node(shared: Arc<Shared>, plan: Arc<Plan>) {
    let mut node = Node::new(shared);
    loop {
        node.backoff = false;
        let was_start = node.authenticated;
        let result = if was_start {
            node.start(&plan).await
        } else {
            node.authenticate().await
        };
        match result {
            Err(End::Stop) => break,
            Ok(()) if was_start && node.shared.in_window(Instant::now()) => {
                node.shared.stats.starts_ok.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        if node.backoff {
            let until = (Instant::now() + FAILURE_BACKOFF).min(node.shared.stop_at);
            tokio::time::sleep_until(until.into()).await;
        }
        if Instant::now() >= node.shared.stop_at {
            break;
        }
    }
}

/// Checks a digest from a manifest before it goes into a URL path (ferry-oci's one
/// digest rule: any registered algorithm, sha256/sha512 of the right length).
fn valid_digest(d: &str) -> bool {
    ferry_oci::digest::parse(d).is_ok()
}

/// What a manifest GET during discovery found.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    /// An image manifest: config and layer digests.
    Image { config: String, layers: Vec<String> },
    /// An index: the digest of the platform's manifest.
    Index { manifest: String },
}

fn parse_manifest(body: &[u8], platform: &str) -> Result<Found, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("manifest is not JSON: {e}"))?;
    let digest_of = |d: &serde_json::Value| -> Result<String, String> {
        match d.get("digest").and_then(|d| d.as_str()) {
            Some(s) if valid_digest(s) => Ok(s.to_string()),
            other => Err(format!("invalid descriptor digest {other:?}")),
        }
    };
    if v.get("manifests").is_some() {
        let index: ferry_oci::ImageIndex =
            serde_json::from_value(v).map_err(|e| format!("image index: {e}"))?;
        let want = ferry_oci::Platform::parse(platform).map_err(|e| e.to_string())?;
        let chosen = ferry_oci::choose_manifest(&index, &want).map_err(|e| e.to_string())?;
        return Ok(Found::Index {
            manifest: chosen.digest().to_string(),
        });
    }
    let config = v
        .get("config")
        .ok_or("manifest has neither config nor manifests")
        .and_then(|c| digest_of(c).map_err(|_| "invalid config digest"))
        .map_err(str::to_string)?;
    let layers = v
        .get("layers")
        .and_then(|l| l.as_array())
        .ok_or("manifest has no layers array")?;
    if layers.is_empty() || layers.len() > MAX_LAYERS {
        return Err(format!(
            "manifest has {} layers (1..={MAX_LAYERS} replayable)",
            layers.len()
        ));
    }
    let layers = layers
        .iter()
        .map(digest_of)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Found::Image { config, layers })
}

fn path(s: String) -> Result<Uri, String> {
    Uri::try_from(s.as_str()).map_err(|e| format!("bad path {s:?}: {e}"))
}

/// Authenticates and resolves the image once, before the run: what each start requests.
async fn discover(cfg: &LoadTestConfig) -> Result<Plan, LoadTestError> {
    let now = Instant::now();
    let stop_at = now + cfg.request_timeout * 5;
    let shared = Arc::new(Shared::new(cfg, now, stop_at)?);
    let fail = |reason: String| LoadTestError::Discovery {
        registry: cfg.registry.clone(),
        reason,
    };
    let explain = |shared: &Shared, what: &str| {
        let r = shared.stats.report(cfg, 0, Duration::from_secs(1));
        let errors: Vec<String> = r
            .errors
            .iter()
            .map(|e| format!("{} {}", e.kind, e.error))
            .collect();
        if errors.is_empty() {
            format!("{what}: no answer before the deadline")
        } else {
            format!("{what}: {}", errors.join(", "))
        }
    };
    let mut node = Node::new(shared.clone());
    if node.authenticate().await.is_err() {
        return Err(fail(explain(&shared, "authenticating")));
    }
    let repo = &cfg.repository;
    let first = path(format!("/v2/{repo}/manifests/{}", cfg.reference)).map_err(&fail)?;
    let mut manifest_paths = vec![first.clone()];
    let mut next = first;
    for _ in 0..2 {
        let body = node.manifest_body(&next).await;
        let Some(body) = body else {
            return Err(fail(explain(&shared, "getting the manifest")));
        };
        match parse_manifest(&body, &cfg.platform).map_err(&fail)? {
            Found::Image { config, layers } => {
                return Ok(Plan {
                    manifest_paths,
                    config_path: path(format!("/v2/{repo}/blobs/{config}")).map_err(&fail)?,
                    layer_paths: layers
                        .iter()
                        .map(|l| path(format!("/v2/{repo}/blobs/{l}")))
                        .collect::<Result<_, _>>()
                        .map_err(&fail)?,
                });
            }
            Found::Index { manifest } => {
                next = path(format!("/v2/{repo}/manifests/{manifest}")).map_err(&fail)?;
                manifest_paths.push(next.clone());
            }
        }
    }
    Err(fail("an index pointing at another index".to_string()))
}

impl Node {
    /// A manifest's body (discovery only; the run drains bodies without keeping them).
    async fn manifest_body(&mut self, path: &Uri) -> Option<Bytes> {
        for _attempt in 0..2 {
            let req = Req {
                method: Method::GET,
                path,
                authorization: self.authorization.clone(),
                accept: true,
                range: false,
                keep_body: Some(MAX_MANIFEST_BYTES),
            };
            match self.fetch(0, req).await {
                Outcome::Response(r) if r.status == StatusCode::OK => return r.body,
                Outcome::Response(r) if r.status == StatusCode::UNAUTHORIZED => {
                    self.answer_challenge(r.challenge.as_ref()).await.ok()?;
                }
                Outcome::Response(r) => {
                    let status = r.status.as_u16();
                    self.record_response(
                        RequestKind::Manifest,
                        &r,
                        Some(ErrorClass::Status(status)),
                    );
                    return None;
                }
                Outcome::Failed(e) => {
                    self.record_failure(RequestKind::Manifest, e);
                    return None;
                }
                Outcome::Stopped => return None,
            }
        }
        None
    }
}

/// Runs a load test: resolves the image, then `connections` virtual nodes replay node
/// starts for `warmup + duration`; returns what was measured after the warmup.
/// Must run inside a multi-threaded tokio runtime for the numbers to mean anything.
pub async fn run(cfg: &LoadTestConfig) -> Result<Report, LoadTestError> {
    cfg.validate()?;
    let plan = Arc::new(discover(cfg).await?);
    let started = Instant::now();
    let measure_from = started + cfg.warmup;
    let stop_at = measure_from + cfg.duration;
    let shared = Arc::new(Shared::new(cfg, measure_from, stop_at)?);
    let mut nodes = JoinSet::new();
    for _ in 0..cfg.connections {
        nodes.spawn(run_node(shared.clone(), plan.clone()));
    }
    while let Some(joined) = nodes.join_next().await {
        if let Err(e) = joined
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    Ok(shared
        .stats
        .report(cfg, plan.layer_paths.len(), cfg.duration))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_that_could_escape_a_path_are_rejected() {
        assert!(valid_digest(&format!("sha256:{}", "a".repeat(64))));
        assert!(!valid_digest("sha256:../../etc"));
        assert!(!valid_digest("sha256:abc?x=1"));
        assert!(!valid_digest("nodigest"));
        assert!(!valid_digest("sha256:"));
    }

    #[test]
    fn parses_image_manifests_and_picks_the_platform_from_an_index() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let image = serde_json::json!({
            "schemaVersion": 2,
            "config": {"digest": d('c'), "size": 2},
            "layers": [{"digest": d('1'), "size": 3}, {"digest": d('2'), "size": 4}],
        });
        assert_eq!(
            parse_manifest(image.to_string().as_bytes(), "linux/amd64"),
            Ok(Found::Image {
                config: d('c'),
                layers: vec![d('1'), d('2')]
            })
        );
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 9,
                 "digest": d('a'), "platform": {"os": "linux", "architecture": "arm64"}},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 9,
                 "digest": d('b'), "platform": {"os": "linux", "architecture": "amd64"}},
            ],
        });
        assert_eq!(
            parse_manifest(index.to_string().as_bytes(), "linux/amd64"),
            Ok(Found::Index { manifest: d('b') })
        );
        assert!(parse_manifest(index.to_string().as_bytes(), "linux/s390x").is_err());
        assert!(parse_manifest(b"not json", "linux/amd64").is_err());
        let no_layers = serde_json::json!({"config": {"digest": d('c')}, "layers": []});
        assert!(parse_manifest(no_layers.to_string().as_bytes(), "linux/amd64").is_err());
        let evil = serde_json::json!({"config": {"digest": d('c')}, "layers": [{"digest": "sha256:../x"}]});
        assert!(parse_manifest(evil.to_string().as_bytes(), "linux/amd64").is_err());
    }
}

#[cfg(test)]
pub(super) mod test_support {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Whether a run with `cfg` would contact `host` (token realm or redirect target).
    pub fn host_allowed(cfg: &LoadTestConfig, host: &str) -> bool {
        let now = Instant::now();
        Shared::new(cfg, now, now).unwrap().host_allowed(host)
    }
}
