//! Load tester tests: settings validation, and short runs against an in-process fake
//! registry that counts what it is asked, so request counts, auth flows and error
//! counting are checked against the server's view. No timing thresholds: every
//! assertion holds however slow the machine is.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use base64::Engine as _;
use bytes::Bytes;
use sha2::{Digest as _, Sha256};

use super::engine::test_support::host_allowed;
use super::*;

const REPO: &str = "fleet/app";
const USER: &str = "node";
const PASS: &str = "s3cret:with:colons";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AuthMode {
    Bearer,
    Basic,
}

#[derive(Debug, Default)]
struct Counts {
    ping: AtomicU64,
    token: AtomicU64,
    manifest: AtomicU64,
    config: AtomicU64,
    layer_head: AtomicU64,
    layer_get: AtomicU64,
    redirected: AtomicU64,
}

#[derive(Debug)]
struct Fake {
    addr: SocketAddr,
    auth: AuthMode,
    manifest: Bytes,
    config: (String, Bytes),
    layers: Vec<(String, Bytes)>,
    failing_layer: Option<usize>,
    redirect: bool,
    /// A token stops working after this many uses (forces refreshes).
    token_uses_limit: u64,
    next_token: AtomicU64,
    token_uses: Mutex<HashMap<String, u64>>,
    counts: Counts,
}

fn digest_of(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

fn basic_value() -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASS}"))
    )
}

impl Fake {
    fn challenge(&self) -> Response {
        let value = match self.auth {
            AuthMode::Bearer => format!(
                "Bearer realm=\"http://{}/token\",service=\"fake\"",
                self.addr
            ),
            AuthMode::Basic => "Basic realm=\"fake\"".to_string(),
        };
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, value)],
            r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#,
        )
            .into_response()
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(v) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        match self.auth {
            AuthMode::Basic => v == basic_value(),
            AuthMode::Bearer => {
                let Some(token) = v.strip_prefix("Bearer ") else {
                    return false;
                };
                let mut uses = self.token_uses.lock().unwrap();
                let Some(n) = uses.get_mut(token) else {
                    return false;
                };
                *n += 1;
                *n <= self.token_uses_limit
            }
        }
    }
}

fn serve_bytes(data: &Bytes, headers: &HeaderMap) -> Response {
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes=0-"))
        .and_then(|end| end.parse::<usize>().ok());
    match range {
        Some(end) => {
            let last = end.min(data.len() - 1);
            (
                StatusCode::PARTIAL_CONTENT,
                [(
                    header::CONTENT_RANGE,
                    format!("bytes 0-{last}/{}", data.len()),
                )],
                data.slice(0..=last),
            )
                .into_response()
        }
        None => (StatusCode::OK, data.clone()).into_response(),
    }
}

async fn ping(State(f): State<Arc<Fake>>, headers: HeaderMap) -> Response {
    f.counts.ping.fetch_add(1, Ordering::Relaxed);
    if f.authorized(&headers) {
        StatusCode::OK.into_response()
    } else {
        f.challenge()
    }
}

async fn token(State(f): State<Arc<Fake>>, headers: HeaderMap) -> Response {
    f.counts.token.fetch_add(1, Ordering::Relaxed);
    let ok = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        == Some(basic_value().as_str());
    if !ok {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let t = format!("tok-{}", f.next_token.fetch_add(1, Ordering::Relaxed));
    f.token_uses.lock().unwrap().insert(t.clone(), 0);
    axum::Json(serde_json::json!({ "token": t, "expires_in": 300 })).into_response()
}

async fn v2(
    State(f): State<Arc<Fake>>,
    method: Method,
    headers: HeaderMap,
    Path(rest): Path<String>,
) -> Response {
    let Some(rest) = rest.strip_prefix(&format!("{REPO}/")) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if rest.starts_with("manifests/") {
        f.counts.manifest.fetch_add(1, Ordering::Relaxed);
    }
    if !f.authorized(&headers) {
        return f.challenge();
    }
    if let Some(reference) = rest.strip_prefix("manifests/") {
        assert!(
            headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|a| a.contains("application/vnd.oci.image.manifest.v1+json")),
            "manifest requests carry the Accept list"
        );
        if reference != "v1" {
            return StatusCode::NOT_FOUND.into_response();
        }
        return (
            [(
                header::CONTENT_TYPE,
                "application/vnd.oci.image.manifest.v1+json",
            )],
            f.manifest.clone(),
        )
            .into_response();
    }
    let Some(digest) = rest.strip_prefix("blobs/") else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let data = if digest == f.config.0 {
        f.counts.config.fetch_add(1, Ordering::Relaxed);
        f.config.1.clone()
    } else if let Some(i) = f.layers.iter().position(|l| l.0 == digest) {
        if method == Method::HEAD {
            f.counts.layer_head.fetch_add(1, Ordering::Relaxed);
        } else {
            f.counts.layer_get.fetch_add(1, Ordering::Relaxed);
        }
        if f.failing_layer == Some(i) {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        f.layers[i].1.clone()
    } else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if f.redirect && method == Method::GET {
        return (
            StatusCode::TEMPORARY_REDIRECT,
            [(header::LOCATION, format!("/redirected/{digest}"))],
        )
            .into_response();
    }
    if method == Method::HEAD {
        return (
            StatusCode::OK,
            [(header::CONTENT_LENGTH, data.len().to_string())],
        )
            .into_response();
    }
    serve_bytes(&data, &headers)
}

async fn redirected(
    State(f): State<Arc<Fake>>,
    headers: HeaderMap,
    Path(digest): Path<String>,
) -> Response {
    f.counts.redirected.fetch_add(1, Ordering::Relaxed);
    let data = if digest == f.config.0 {
        f.config.1.clone()
    } else if let Some(l) = f.layers.iter().find(|l| l.0 == digest) {
        l.1.clone()
    } else {
        return Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Body::empty())
            .unwrap();
    };
    serve_bytes(&data, &headers)
}

struct Setup {
    auth: AuthMode,
    failing_layer: Option<usize>,
    redirect: bool,
    token_uses_limit: u64,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            auth: AuthMode::Bearer,
            failing_layer: None,
            redirect: false,
            token_uses_limit: u64::MAX,
        }
    }
}

/// Starts a fake registry with a 3-layer image `fleet/app:v1`.
async fn start_fake(setup: Setup) -> Arc<Fake> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = Bytes::from_static(br#"{"architecture":"amd64","os":"linux"}"#);
    let layers: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i; 10_000])).collect();
    let layers: Vec<(String, Bytes)> = layers.into_iter().map(|b| (digest_of(&b), b)).collect();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest_of(&config), "size": config.len()},
        "layers": layers.iter().map(|(d, b)| serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": b.len()
        })).collect::<Vec<_>>(),
    });
    let fake = Arc::new(Fake {
        addr,
        auth: setup.auth,
        manifest: Bytes::from(manifest.to_string()),
        config: (digest_of(&config), config),
        layers,
        failing_layer: setup.failing_layer,
        redirect: setup.redirect,
        token_uses_limit: setup.token_uses_limit,
        next_token: AtomicU64::new(0),
        token_uses: Mutex::new(HashMap::new()),
        counts: Counts::default(),
    });
    let app = Router::new()
        .route("/v2/", get(ping))
        .route("/token", get(token))
        .route("/v2/{*rest}", any(v2))
        .route("/redirected/{digest}", get(redirected))
        .with_state(fake.clone());
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    fake
}

fn config_for(fake: &Fake) -> LoadTestConfig {
    LoadTestConfig {
        registry: fake.addr.to_string(),
        repository: REPO.to_string(),
        reference: "v1".to_string(),
        connections: 4,
        duration: Duration::from_secs(1),
        warmup: Duration::ZERO,
        range_bytes: Some(16),
        credentials: Some(Credentials {
            username: USER.into(),
            password: PASS.into(),
        }),
        ..LoadTestConfig::default()
    }
}

fn kind<'a>(r: &'a Report, name: &str) -> &'a KindReport {
    r.kinds
        .iter()
        .find(|k| k.kind == name)
        .unwrap_or_else(|| panic!("no {name} in {r}"))
}

fn load(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_run_counts_requests_by_kind_and_errors_by_status() {
    let fake = start_fake(Setup {
        failing_layer: Some(2),
        ..Setup::default()
    })
    .await;
    let cfg = config_for(&fake);
    let r = run(&cfg).await.unwrap();
    let conns = cfg.connections as u64;

    // Auth: one ping and one token per node (plus discovery's), no refreshes.
    assert_eq!(kind(&r, "ping").requests, conns);
    assert_eq!(kind(&r, "ping").errors, 0, "401 on /v2/ is expected");
    assert_eq!(kind(&r, "token").requests, conns);
    assert_eq!(r.token_fetches, conns);
    assert_eq!(r.token_refreshes, 0);
    assert_eq!(load(&fake.counts.ping), conns + 1);
    assert_eq!(load(&fake.counts.token), conns + 1);

    // The server saw every counted request, plus at most one cut-off one per node
    // (plus discovery's manifest GET).
    let manifest = kind(&r, "manifest");
    let layer = kind(&r, "layer_get");
    let config = kind(&r, "config");
    assert!(manifest.requests > 0);
    let server_manifests = load(&fake.counts.manifest);
    assert!(server_manifests > manifest.requests);
    assert!(server_manifests <= manifest.requests + 1 + conns);
    let server_layers = load(&fake.counts.layer_get);
    assert!(server_layers >= layer.requests && server_layers <= layer.requests + conns);
    assert!(load(&fake.counts.config) >= config.requests);
    assert_eq!(manifest.errors + config.errors, 0);

    // Layer 3 of every start fails with 500; layers 1 and 2 succeed.
    assert!(layer.errors > 0);
    assert_eq!(r.errors.len(), 1, "{r}");
    assert_eq!(r.errors[0].kind, "layer_get");
    assert_eq!(r.errors[0].status, Some(500));
    assert_eq!(r.errors[0].count, layer.errors);
    let excess = layer.ok as i64 - 2 * layer.errors as i64;
    assert!(
        (0..=2 * conns as i64).contains(&excess),
        "ok {} vs failed {}",
        layer.ok,
        layer.errors
    );
    assert_eq!(r.layer_requests_ok, layer.ok);
    assert_eq!(r.node_starts_ok, 0, "every start has a failed layer");
    assert_eq!(r.layers_per_start, 3);
    assert_eq!(r.errors_total, layer.errors);
    // 16-byte ranges were asked and served.
    assert_eq!(layer.bytes, 16 * layer.ok);
    assert_eq!(r.requests, r.kinds.iter().map(|k| k.requests).sum::<u64>());
    assert_eq!(r.overall.requests, r.requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_tokens_are_refreshed_and_redirects_followed() {
    let fake = start_fake(Setup {
        redirect: true,
        token_uses_limit: 25,
        ..Setup::default()
    })
    .await;
    let cfg = LoadTestConfig {
        layer_mode: LayerMode::Redirect,
        ..config_for(&fake)
    };
    let r = run(&cfg).await.unwrap();
    let conns = cfg.connections as u64;
    assert_eq!(r.errors_total, 0, "{r}");
    assert!(r.token_refreshes > 0, "{r}");
    assert!(r.token_fetches <= conns + r.token_refreshes);
    assert!(r.token_fetches + conns >= conns + r.token_refreshes);
    let layer = kind(&r, "layer_get");
    let config = kind(&r, "config");
    let target = kind(&r, "redirect_target");
    let registry_legs = layer.ok + config.ok;
    assert!(registry_legs >= target.ok && registry_legs <= target.ok + conns);
    assert!(load(&fake.counts.redirected) >= target.ok);
    assert!(r.layer_requests_ok <= layer.ok && r.layer_requests_ok > 0);
    assert!(r.node_starts_ok > 0);
    // Layers are 10,000 bytes, the config 37: only ranged layer reads keep every
    // redirected response at or under the config's size.
    assert!(
        target.bytes <= 37 * target.ok,
        "ranges survive the redirect"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_auth_head_mode_with_warmup_counts_only_the_window() {
    let fake = start_fake(Setup {
        auth: AuthMode::Basic,
        ..Setup::default()
    })
    .await;
    let cfg = LoadTestConfig {
        layer_mode: LayerMode::Head,
        warmup: Duration::from_millis(500),
        duration: Duration::from_millis(700),
        ..config_for(&fake)
    };
    let r = run(&cfg).await.unwrap();
    assert_eq!(r.errors_total, 0, "{r}");
    assert_eq!(r.token_fetches, 0, "Basic challenge: no tokens");
    assert_eq!(load(&fake.counts.token), 0);
    assert!(r.kinds.iter().all(|k| k.kind != "layer_get"));
    let head = kind(&r, "layer_head");
    assert!(head.ok > 0);
    assert_eq!(r.layer_requests_ok, head.ok);
    assert_eq!(head.bytes, 0);
    assert_eq!(r.range_bytes, None);
    // Requests made during the warmup reached the server but are not in the report.
    assert!(load(&fake.counts.layer_head) > head.requests);
    assert!(
        r.kinds.iter().all(|k| k.kind != "ping"),
        "pings happen in warmup"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_fail_before_the_run() {
    let fake = start_fake(Setup::default()).await;
    let cfg = LoadTestConfig {
        credentials: Some(Credentials {
            username: USER.into(),
            password: "wrong".into(),
        }),
        ..config_for(&fake)
    };
    let err = run(&cfg).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LoadTestError::Discovery { .. }));
    assert!(msg.contains("token status 401"), "{msg}");
    assert_eq!(load(&fake.counts.manifest), 0);

    let missing = LoadTestConfig {
        reference: "nope".into(),
        ..config_for(&fake)
    };
    let msg = run(&missing).await.unwrap_err().to_string();
    assert!(msg.contains("manifest status 404"), "{msg}");
}

#[test]
fn settings_are_bounded() {
    let ok = LoadTestConfig {
        repository: "a/b".into(),
        ..LoadTestConfig::default()
    };
    ok.validate().unwrap();
    let bad = |f: &dyn Fn(&mut LoadTestConfig)| {
        let mut c = ok.clone();
        f(&mut c);
        assert!(
            matches!(c.validate(), Err(LoadTestError::InvalidConfig(_))),
            "{c:?} accepted"
        );
    };
    bad(&|c| c.connections = 0);
    bad(&|c| c.connections = MAX_CONNECTIONS + 1);
    bad(&|c| c.duration = Duration::ZERO);
    bad(&|c| c.duration = MAX_DURATION + Duration::from_secs(1));
    bad(&|c| c.warmup = MAX_WARMUP + Duration::from_secs(1));
    bad(&|c| c.request_timeout = Duration::ZERO);
    bad(&|c| c.range_bytes = Some(0));
    bad(&|c| c.range_bytes = Some(MAX_RANGE_BYTES + 1));
    bad(&|c| c.registry = "http://127.0.0.1:5000".into());
    bad(&|c| c.registry = "127.0.0.1:5000/v2".into());
    bad(&|c| c.registry = "127.0.0.1:0".into());
    bad(&|c| c.registry = "host:99999".into());
    bad(&|c| c.repository = "../etc".into());
    bad(&|c| c.reference = "bad tag".into());
    bad(&|c| c.reference = "sha256:short".into());
    bad(&|c| c.platform = "linux".into());
    bad(&|c| c.allowed_hosts = vec!["evil.com/path".into()]);
    let mut edge = ok.clone();
    edge.connections = MAX_CONNECTIONS;
    edge.duration = MAX_DURATION;
    edge.registry = "[::1]:5000".into();
    edge.range_bytes = None;
    edge.validate().unwrap();
}

#[test]
fn authority_durations_credentials_and_modes_parse() {
    assert_eq!(
        split_authority("localhost").unwrap(),
        ("localhost".into(), 80)
    );
    assert_eq!(split_authority("[::1]:5000").unwrap(), ("::1".into(), 5000));
    assert!(split_authority("::1").is_err());
    let c: Credentials = "u:p:q".parse().unwrap();
    assert_eq!((c.username.as_str(), c.password.as_str()), ("u", "p:q"));
    assert!(!format!("{c:?}").contains("p:q"), "password redacted");
    assert!("nouser".parse::<Credentials>().is_err());
    assert!(":p".parse::<Credentials>().is_err());
    assert_eq!(
        "redirect".parse::<LayerMode>().unwrap(),
        LayerMode::Redirect
    );
    assert!("GET".parse::<LayerMode>().is_err());
}

#[test]
fn only_the_registry_loopback_and_named_hosts_are_contacted() {
    let cfg = LoadTestConfig {
        registry: "registry.internal:5000".into(),
        repository: "a/b".into(),
        allowed_hosts: vec!["s3.internal".into()],
        ..LoadTestConfig::default()
    };
    assert!(host_allowed(&cfg, "registry.internal"));
    assert!(host_allowed(&cfg, "127.0.0.1"));
    assert!(host_allowed(&cfg, "[::1]"));
    assert!(host_allowed(&cfg, "localhost"));
    assert!(host_allowed(&cfg, "S3.internal"));
    assert!(!host_allowed(&cfg, "example.com"));
    assert!(!host_allowed(&cfg, "10.0.0.1"));
}
