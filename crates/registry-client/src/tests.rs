//! Client tests against a small in-process registry (axum on 127.0.0.1:0) that can be
//! told to misbehave: bearer tokens with short lives, Basic auth, flaky 503/429s, Range
//! ignored, blobs redirected to another host, corrupt manifests.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq)]
enum AuthMode {
    None,
    Basic,
    Bearer { lifetime_secs: u64 },
}

#[derive(Debug)]
struct Recorded {
    method: String,
    path: String,
    authorization: Option<String>,
    range: Option<String>,
    /// The `x-ferry-test` header (hosts.toml `header`).
    x_test: Option<String>,
}

#[derive(Debug)]
struct Fake {
    addr: Mutex<Option<SocketAddr>>,
    auth: Mutex<AuthMode>,
    blobs: Mutex<HashMap<String, Bytes>>,
    /// (repo, digest): blobs are served only through repositories that link them.
    links: Mutex<std::collections::HashSet<(String, String)>>,
    /// (repo, reference) -> (media type, bytes)
    manifests: Mutex<HashMap<(String, String), (String, Bytes)>>,
    uploads: Mutex<HashMap<String, Vec<u8>>>,
    tokens: Mutex<HashMap<String, Instant>>,
    token_requests: AtomicU32,
    upload_seq: AtomicU64,
    /// Answer this many requests with `fail_status` first.
    fail_next: AtomicU32,
    fail_status: AtomicU32,
    ignore_range: AtomicBool,
    /// Answer several ranges with one part spanning them all (RFC 9110 lets a server
    /// merge ranges).
    merge_ranges: AtomicBool,
    /// Redirect blob GETs to this base URL (another server).
    redirect_blobs: Mutex<Option<String>>,
    /// Serve manifests with one byte changed.
    corrupt_manifests: AtomicBool,
    /// Answer everything under /v2/ with 404 (a useless mirror).
    all_404: AtomicBool,
    /// Serve the API under this path instead of `/v2` (a mirror behind a prefix).
    api_root: Mutex<Option<String>>,
    log: Mutex<Vec<Recorded>>,
}

impl Default for Fake {
    fn default() -> Self {
        Fake {
            addr: Mutex::new(None),
            auth: Mutex::new(AuthMode::None),
            blobs: Mutex::default(),
            links: Mutex::default(),
            manifests: Mutex::default(),
            uploads: Mutex::default(),
            tokens: Mutex::default(),
            token_requests: AtomicU32::new(0),
            upload_seq: AtomicU64::new(0),
            fail_next: AtomicU32::new(0),
            fail_status: AtomicU32::new(503),
            ignore_range: AtomicBool::new(false),
            merge_ranges: AtomicBool::new(false),
            redirect_blobs: Mutex::new(None),
            corrupt_manifests: AtomicBool::new(false),
            all_404: AtomicBool::new(false),
            api_root: Mutex::new(None),
            log: Mutex::default(),
        }
    }
}

fn resp(status: u16) -> axum::http::response::Builder {
    Response::builder().status(status)
}

fn digest_of(b: &[u8]) -> String {
    sha256_hex_digest(b)
}

impl Fake {
    fn host(&self) -> String {
        self.addr.lock().unwrap().unwrap().to_string()
    }

    fn add_blob(&self, bytes: &[u8]) -> String {
        let d = digest_of(bytes);
        self.blobs
            .lock()
            .unwrap()
            .insert(d.clone(), Bytes::copy_from_slice(bytes));
        self.link("team/app", &d);
        d
    }

    fn link(&self, repo: &str, digest: &str) {
        self.links
            .lock()
            .unwrap()
            .insert((repo.to_string(), digest.to_string()));
    }

    fn add_manifest(&self, repo: &str, tag: &str, media: &str, bytes: &[u8]) -> String {
        let d = digest_of(bytes);
        let mut m = self.manifests.lock().unwrap();
        let v = (media.to_string(), Bytes::copy_from_slice(bytes));
        m.insert((repo.to_string(), d.clone()), v.clone());
        m.insert((repo.to_string(), tag.to_string()), v);
        d
    }

    fn requests(&self, method: &str, path_contains: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.method == method && r.path.contains(path_contains))
            .count()
    }

    fn check_auth(&self, req: &Request, repo: &str) -> Option<Response> {
        let header = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        match *self.auth.lock().unwrap() {
            AuthMode::None => None,
            AuthMode::Basic => {
                let want = auth::basic_header(&Credentials {
                    username: "alice".into(),
                    password: "s3cret".into(),
                });
                (header.as_deref() != Some(want.as_str())).then(|| {
                    resp(401)
                        .header("www-authenticate", "Basic realm=\"fake\"")
                        .body(Body::from(
                            r#"{"errors":[{"code":"UNAUTHORIZED","message":"who are you"}]}"#,
                        ))
                        .unwrap()
                })
            }
            AuthMode::Bearer { .. } => {
                let ok = header
                    .as_deref()
                    .and_then(|h| h.strip_prefix("Bearer "))
                    .and_then(|t| self.tokens.lock().unwrap().get(t).copied())
                    .is_some_and(|exp| Instant::now() < exp);
                (!ok).then(|| {
                    let challenge = format!(
                        "Bearer realm=\"http://{}/token\",service=\"fake\",scope=\"repository:{repo}:pull\"",
                        self.host()
                    );
                    resp(401)
                        .header("www-authenticate", challenge)
                        .body(Body::empty())
                        .unwrap()
                })
            }
        }
    }

    fn token(&self, req: &Request) -> Response {
        self.token_requests.fetch_add(1, Ordering::SeqCst);
        let AuthMode::Bearer { lifetime_secs } = *self.auth.lock().unwrap() else {
            return resp(404).body(Body::empty()).unwrap();
        };
        // Anonymous tokens are fine, but wrong basic creds are refused.
        if let Some(h) = req.headers().get("authorization") {
            let want = auth::basic_header(&Credentials {
                username: "alice".into(),
                password: "s3cret".into(),
            });
            if h.to_str().ok() != Some(want.as_str()) {
                return resp(401).body(Body::empty()).unwrap();
            }
        }
        let n = self.token_requests.load(Ordering::SeqCst);
        let token = format!("tok{n}");
        self.tokens.lock().unwrap().insert(
            token.clone(),
            Instant::now() + Duration::from_secs(lifetime_secs),
        );
        let body = serde_json::json!({"access_token": token, "expires_in": lifetime_secs});
        resp(200).body(Body::from(body.to_string())).unwrap()
    }
}

async fn handle(State(fake): State<Arc<Fake>>, req: Request) -> Response {
    let raw_path = req.uri().path().to_string();
    let mut path = raw_path.clone();
    let root = fake.api_root.lock().unwrap().clone();
    if let Some(root) = root {
        // Only the prefixed API exists; `/v2` itself is not found.
        path = match path.strip_prefix(&root) {
            Some(rest) => format!("/v2{rest}"),
            None => format!("/not-served{path}"),
        };
    }
    let query = req.uri().query().unwrap_or("").to_string();
    let method = req.method().to_string();
    fake.log.lock().unwrap().push(Recorded {
        method: method.clone(),
        path: format!("{raw_path}?{query}"),
        authorization: req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        range: req
            .headers()
            .get("range")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        x_test: req
            .headers()
            .get("x-ferry-test")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
    });
    if path == "/token" {
        return fake.token(&req);
    }
    if let Some(d) = path.strip_prefix("/blobdata/") {
        return match fake.blobs.lock().unwrap().get(d) {
            Some(b) => resp(200).body(Body::from(b.clone())).unwrap(),
            None => resp(404).body(Body::empty()).unwrap(),
        };
    }
    if fake.fail_next.load(Ordering::SeqCst) > 0 {
        fake.fail_next.fetch_sub(1, Ordering::SeqCst);
        let status = fake.fail_status.load(Ordering::SeqCst) as u16;
        return resp(status)
            .header("retry-after", "0")
            .body(Body::empty())
            .unwrap();
    }
    if fake.all_404.load(Ordering::SeqCst) {
        return resp(404).body(Body::empty()).unwrap();
    }
    let Some(rest) = path.strip_prefix("/v2/") else {
        return resp(404).body(Body::empty()).unwrap();
    };
    let split = |marker: &str| {
        rest.find(marker)
            .map(|i| (rest[..i].to_string(), rest[i + marker.len()..].to_string()))
    };
    let repo = ["/blobs/", "/manifests/", "/tags/list", "/referrers/"]
        .iter()
        .find_map(|m| split(m).map(|(r, _)| r))
        .unwrap_or_default();
    if let Some(denied) = fake.check_auth(&req, &repo) {
        return denied;
    }
    if let Some((repo, id)) = split("/blobs/uploads/") {
        return upload(&fake, &repo, &id, &query, req).await;
    }
    if let Some((repo, digest)) = split("/blobs/") {
        let linked = fake.links.lock().unwrap().contains(&(repo, digest.clone()));
        let Some(blob) = fake
            .blobs
            .lock()
            .unwrap()
            .get(&digest)
            .cloned()
            .filter(|_| linked)
        else {
            return resp(404).body(Body::empty()).unwrap();
        };
        if method == "GET"
            && let Some(base) = fake.redirect_blobs.lock().unwrap().clone()
        {
            return resp(307)
                .header("location", format!("{base}/blobdata/{digest}"))
                .body(Body::empty())
                .unwrap();
        }
        let range_header = req
            .headers()
            .get("range")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if method != "HEAD"
            && !fake.ignore_range.load(Ordering::SeqCst)
            && let Some(ranges) =
                crate::byteranges::parse_ranges(range_header.as_deref(), blob.len() as u64)
        {
            if fake.merge_ranges.load(Ordering::SeqCst) {
                let (a, z) = (ranges[0].start, ranges[ranges.len() - 1].end);
                return resp(206)
                    .header(
                        "content-range",
                        format!("bytes {a}-{}/{}", z - 1, blob.len()),
                    )
                    .body(Body::from(blob.slice(a as usize..z as usize)))
                    .unwrap();
            }
            let b = "fakeboundary";
            let mut body = Vec::new();
            for r in &ranges {
                body.extend_from_slice(
                    crate::byteranges::part_head(b, r, blob.len() as u64).as_bytes(),
                );
                body.extend_from_slice(&blob[r.start as usize..r.end as usize]);
            }
            body.extend_from_slice(crate::byteranges::tail(b).as_bytes());
            return resp(206)
                .header("content-type", crate::byteranges::content_type(b))
                .body(Body::from(body))
                .unwrap();
        }
        let range = range_header
            .as_deref()
            .filter(|r| !r.contains(','))
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.split_once('-'))
            .map(|(a, b)| (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap()));
        if method == "HEAD" {
            return resp(200)
                .header("content-length", blob.len())
                .body(Body::empty())
                .unwrap();
        }
        return match range {
            Some((a, b)) if !fake.ignore_range.load(Ordering::SeqCst) => {
                let end = (b + 1).min(blob.len());
                resp(206)
                    .header(
                        "content-range",
                        format!("bytes {a}-{}/{}", end - 1, blob.len()),
                    )
                    .body(Body::from(blob.slice(a..end)))
                    .unwrap()
            }
            _ => resp(200).body(Body::from(blob)).unwrap(),
        };
    }
    if let Some((repo, reference)) = split("/manifests/") {
        if method == "PUT" {
            let media = req
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let body = axum::body::to_bytes(req.into_body(), 8 << 20)
                .await
                .unwrap();
            let d = digest_of(&body);
            let mut m = fake.manifests.lock().unwrap();
            m.insert((repo.clone(), d.clone()), (media.clone(), body.clone()));
            if !reference.starts_with("sha256:") {
                m.insert((repo, reference), (media, body));
            }
            return resp(201)
                .header("docker-content-digest", d)
                .body(Body::empty())
                .unwrap();
        }
        let Some((media, mut bytes)) = fake
            .manifests
            .lock()
            .unwrap()
            .get(&(repo, reference))
            .cloned()
        else {
            return resp(404)
                .body(Body::from(
                    r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"nope"}]}"#,
                ))
                .unwrap();
        };
        let d = digest_of(&bytes);
        if fake.corrupt_manifests.load(Ordering::SeqCst) {
            let mut v = bytes.to_vec();
            v.push(b' ');
            bytes = Bytes::from(v);
        }
        let builder = resp(200)
            .header("content-type", media)
            .header("docker-content-digest", d)
            .header("content-length", bytes.len());
        return if method == "HEAD" {
            builder.body(Body::empty()).unwrap()
        } else {
            builder.body(Body::from(bytes)).unwrap()
        };
    }
    if let Some((_, _)) = split("/tags/list") {
        let all = ["a", "b", "c", "d", "e"];
        let last = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("last="))
            .map(str::to_string);
        let start = last
            .map(|l| all.iter().position(|t| *t == l).unwrap() + 1)
            .unwrap_or(0);
        let page: Vec<&str> = all.iter().skip(start).take(2).copied().collect();
        let mut b = resp(200);
        if start + 2 < all.len() {
            b = b.header(
                "link",
                format!(
                    "</v2/{repo}/tags/list?n=2&last={}>; rel=\"next\"",
                    page[page.len() - 1]
                ),
            );
        }
        let body = serde_json::json!({"name": repo, "tags": page});
        return b.body(Body::from(body.to_string())).unwrap();
    }
    resp(404).body(Body::empty()).unwrap()
}

async fn upload(fake: &Fake, repo: &str, id: &str, query: &str, req: Request) -> Response {
    let method = req.method().clone();
    let param = |name: &str| {
        url::form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.to_string())
    };
    if method == "POST" {
        if let Some(d) = param("mount")
            && let Some(from) = param("from")
            && fake.links.lock().unwrap().contains(&(from, d.clone()))
        {
            fake.link(repo, &d);
            return resp(201).body(Body::empty()).unwrap();
        }
        let id = fake.upload_seq.fetch_add(1, Ordering::SeqCst).to_string();
        fake.uploads.lock().unwrap().insert(id.clone(), Vec::new());
        return resp(202)
            .header("location", format!("/v2/{repo}/blobs/uploads/{id}"))
            .body(Body::empty())
            .unwrap();
    }
    if method == "DELETE" {
        fake.uploads.lock().unwrap().remove(id);
        return resp(204).body(Body::empty()).unwrap();
    }
    let body = axum::body::to_bytes(req.into_body(), 64 << 20)
        .await
        .unwrap();
    let mut uploads = fake.uploads.lock().unwrap();
    let Some(buf) = uploads.get_mut(id) else {
        return resp(404).body(Body::empty()).unwrap();
    };
    buf.extend_from_slice(&body);
    if method == "PATCH" {
        return resp(202)
            .header("location", format!("/v2/{repo}/blobs/uploads/{id}"))
            .header("range", format!("0-{}", buf.len().saturating_sub(1)))
            .body(Body::empty())
            .unwrap();
    }
    let content = std::mem::take(buf);
    uploads.remove(id);
    let want = param("digest").unwrap_or_default();
    if digest_of(&content) != want {
        return resp(400)
            .body(Body::from(
                r#"{"errors":[{"code":"DIGEST_INVALID","message":"bad"}]}"#,
            ))
            .unwrap();
    }
    fake.link(repo, &want);
    fake.blobs
        .lock()
        .unwrap()
        .insert(want, Bytes::from(content));
    resp(201).body(Body::empty()).unwrap()
}

async fn start_fake() -> Arc<Fake> {
    let fake = Arc::new(Fake::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    *fake.addr.lock().unwrap() = Some(listener.local_addr().unwrap());
    let app = axum::Router::new()
        .fallback(handle)
        .with_state(fake.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    fake
}

fn test_config() -> ClientConfig {
    ClientConfig {
        base_backoff: Duration::from_millis(1),
        use_auth_files: false,
        ..ClientConfig::default()
    }
}

fn client_for(fake: &Fake, f: impl FnOnce(&mut ClientConfig)) -> (Client, Repo) {
    let mut cfg = test_config();
    f(&mut cfg);
    (
        Client::new(cfg).unwrap(),
        Repo::parse(fake.host(), "team/app").unwrap(),
    )
}

async fn collect(s: BlobStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut body = s.body;
    while let Some(b) = body.next().await {
        out.extend_from_slice(&b.unwrap());
    }
    out
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[tokio::test]
async fn loopback_falls_back_to_http_and_reads_ranges() {
    let fake = start_fake().await;
    let data = pattern(10_000);
    let d = fake.add_blob(&data);
    let (c, r) = client_for(&fake, |_| {});
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(10_000));
    let part = collect(c.blob_stream(&r, &d, Some(100..2_100)).await.unwrap()).await;
    assert_eq!(part, &data[100..2_100]);
    assert_eq!(
        fake.log.lock().unwrap().last().unwrap().range.as_deref(),
        Some("bytes=100-2099")
    );
    let whole = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(whole, data);
    let missing = format!("sha256:{}", "0".repeat(64));
    assert_eq!(c.blob_size(&r, &missing).await.unwrap(), None);
    assert!(c.blob_stream(&r, &d, Some(9_000..10_001)).await.is_err());
}

#[tokio::test]
async fn concurrent_first_requests_to_a_loopback_registry_all_fall_back_to_http() {
    let fake = start_fake().await;
    let d = fake.add_blob(b"hello");
    // No retries: a request that lost the race to fall back would fail outright.
    let (c, r) = client_for(&fake, |cfg| cfg.max_attempts = 1);
    let (a, b, e) = tokio::join!(
        c.blob_size(&r, &d),
        c.blob_size(&r, &d),
        c.blob_size(&r, &d)
    );
    assert_eq!(
        (a.unwrap(), b.unwrap(), e.unwrap()),
        (Some(5), Some(5), Some(5))
    );
}

#[tokio::test]
async fn bearer_token_is_fetched_cached_and_refreshed() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Bearer { lifetime_secs: 1 };
    let d = fake.add_blob(b"hello");
    let (c, r) = client_for(&fake, |_| {});
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(5));
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(5));
    assert_eq!(
        fake.token_requests.load(Ordering::SeqCst),
        1,
        "token cached"
    );
    // Let it expire: the next request must carry a new token, not fail.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(5));
    assert_eq!(fake.token_requests.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn refused_token_mid_pull_reauthenticates_once() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Bearer { lifetime_secs: 300 };
    let d = fake.add_blob(b"hello");
    let (c, r) = client_for(&fake, |_| {});
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(5));
    // The registry forgets every token (restart, key rotation): the client's cached
    // token still looks fresh, gets a 401, re-authenticates and retries.
    fake.tokens.lock().unwrap().clear();
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"hello");
    assert_eq!(fake.token_requests.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn basic_auth_sent_once_challenged_and_bad_creds_explain() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Basic;
    let d = fake.add_blob(b"x");
    let host = fake.host();
    let (c, r) = client_for(&fake, |cfg| {
        cfg.registry.insert(
            host.clone(),
            RegistryConfig {
                credentials: Some(Credentials {
                    username: "alice".into(),
                    password: "s3cret".into(),
                }),
                ..RegistryConfig::default()
            },
        );
    });
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(1));
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(1));
    {
        let log = fake.log.lock().unwrap();
        let heads: Vec<_> = log.iter().filter(|l| l.method == "HEAD").collect();
        assert_eq!(heads.len(), 3, "one challenge, then credentials every time");
        assert!(heads[0].authorization.is_none());
        assert!(
            heads[1]
                .authorization
                .as_deref()
                .unwrap()
                .starts_with("Basic ")
        );
        assert!(heads[2].authorization.is_some());
    }
    let (anon, r) = client_for(&fake, |_| {});
    let err = anon.blob_size(&r, &d).await.unwrap_err();
    assert_eq!(err.status(), Some(401));
    assert!(err.to_string().contains("--creds"), "{err}");
}

#[tokio::test]
async fn bearer_with_wrong_credentials_is_unauthorized() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Bearer { lifetime_secs: 60 };
    let d = fake.add_blob(b"x");
    let host = fake.host();
    let (c, r) = client_for(&fake, |cfg| {
        cfg.registry.insert(
            host.clone(),
            RegistryConfig {
                credentials: Some(Credentials {
                    username: "alice".into(),
                    password: "wrong".into(),
                }),
                ..RegistryConfig::default()
            },
        );
    });
    let err = c.blob_size(&r, &d).await.unwrap_err();
    assert!(matches!(err, ClientError::Unauthorized { .. }), "{err}");
}

#[tokio::test]
async fn retries_503_and_429_then_succeeds_but_not_404() {
    let fake = start_fake().await;
    let d = fake.add_blob(b"abc");
    let (c, r) = client_for(&fake, |_| {});
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(3)); // learn the scheme first
    fake.fail_next.store(2, Ordering::SeqCst);
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(3));
    assert_eq!(fake.requests("HEAD", "/blobs/"), 4);
    fake.fail_status.store(429, Ordering::SeqCst);
    fake.fail_next.store(1, Ordering::SeqCst);
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(3));
    // Attempts are bounded.
    fake.fail_status.store(500, Ordering::SeqCst);
    fake.fail_next.store(100, Ordering::SeqCst);
    let err = c.blob_size(&r, &d).await.unwrap_err();
    assert_eq!(err.status(), Some(500));
    assert!(err.is_retryable());
    assert_eq!(fake.fail_next.load(Ordering::SeqCst), 100 - 4);
    fake.fail_next.store(0, Ordering::SeqCst);
    let before = fake.requests("GET", "/manifests/");
    let err = c.get_manifest(&r, "nope", &[]).await.unwrap_err();
    assert!(matches!(err, ClientError::NotFound { .. }));
    assert_eq!(
        fake.requests("GET", "/manifests/"),
        before + 1,
        "404 is not retried"
    );
}

#[tokio::test]
async fn failing_mirrors_fall_back_to_the_registry() {
    let fake = start_fake().await;
    let useless = start_fake().await;
    useless.all_404.store(true, Ordering::SeqCst);
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let d = fake.add_blob(b"mirrored");
    let host = fake.host();
    let mirrors = vec![
        format!("http://{dead}"),
        format!("http://{}", useless.host()),
    ];
    let (c, r) = client_for(&fake, |cfg| {
        cfg.max_attempts = 2;
        cfg.registry.insert(
            host.clone(),
            RegistryConfig {
                mirrors,
                ..RegistryConfig::default()
            },
        );
    });
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"mirrored");
    assert_eq!(useless.requests("GET", "/blobs/"), 1);
    // A working mirror serves the pull; the registry is not asked.
    let good = start_fake().await;
    good.add_blob(b"mirrored");
    let (c, r) = client_for(&fake, |cfg| {
        cfg.registry.insert(
            host.clone(),
            RegistryConfig {
                mirrors: vec![format!("http://{}", good.host())],
                ..RegistryConfig::default()
            },
        );
    });
    let before = fake.requests("GET", "/blobs/");
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"mirrored");
    assert_eq!(fake.requests("GET", "/blobs/"), before);
    assert_eq!(good.requests("GET", "/blobs/"), 1);
}

#[tokio::test]
async fn origin_only_skips_a_mirror_that_serves_wrong_bytes() {
    let fake = start_fake().await;
    let bad = start_fake().await;
    let d = fake.add_blob(b"the real bytes");
    // The mirror answers for the same digest with other bytes (a poisoned cache).
    bad.blobs
        .lock()
        .unwrap()
        .insert(d.clone(), Bytes::from_static(b"corrupt bytes!"));
    bad.link("team/app", &d);
    let host = fake.host();
    let (c, r) = client_for(&fake, |cfg| {
        cfg.registry.insert(
            host.clone(),
            RegistryConfig {
                mirrors: vec![format!("http://{}", bad.host())],
                ..RegistryConfig::default()
            },
        );
    });
    assert!(c.has_mirrors(&host));
    let got = collect(c.blob_stream(&r, &d, Some(0..14)).await.unwrap()).await;
    assert_eq!(got, b"corrupt bytes!");
    let origin = c.origin_only();
    assert!(!origin.has_mirrors(&host));
    let mirror_gets = bad.requests("GET", "/blobs/");
    let got = collect(origin.blob_stream(&r, &d, Some(0..14)).await.unwrap()).await;
    assert_eq!(got, b"the real bytes");
    assert_eq!(
        bad.requests("GET", "/blobs/"),
        mirror_gets,
        "the mirror was asked again"
    );
}

#[tokio::test]
async fn server_ignoring_range_still_gives_the_range() {
    let fake = start_fake().await;
    fake.ignore_range.store(true, Ordering::SeqCst);
    let data = pattern(50_000);
    let d = fake.add_blob(&data);
    let (c, r) = client_for(&fake, |_| {});
    let part = collect(c.blob_stream(&r, &d, Some(40_000..45_000)).await.unwrap()).await;
    assert_eq!(part, &data[40_000..45_000]);
    // A parallel download notices and falls back to one stream.
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("blob");
    let opts = DownloadOptions {
        concurrency: 4,
        chunk_size: 4096,
        progress: None,
    };
    let before = fake.requests("GET", "/blobs/");
    c.download_blob(&r, &d, 50_000, &dest, &opts).await.unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    assert_eq!(
        fake.requests("GET", "/blobs/"),
        before + 2,
        "probe + one stream"
    );
}

#[tokio::test]
async fn several_ranges_in_one_request_and_one_by_one_where_refused() {
    let fake = start_fake().await;
    let data = pattern(100_000);
    let d = fake.add_blob(&data);
    let (c, r) = client_for(&fake, |_| {});
    let ranges = vec![10..20, 5_000..9_000, 99_000..100_000];
    let want: Vec<Vec<u8>> = ranges
        .iter()
        .map(|g| data[g.start as usize..g.end as usize].to_vec())
        .collect();
    let before = fake.requests("GET", "/blobs/");
    assert_eq!(c.blob_ranges(&r, &d, &ranges).await.unwrap(), want);
    assert_eq!(fake.requests("GET", "/blobs/"), before + 1, "one request");
    assert!(c.batches_ranges(&r.registry));
    // Ranges that overlap, touch or are out of order are refused before any request.
    for bad in [
        vec![10..20, 15..30],
        vec![10..20, 20..30],
        vec![50..60, 10..20],
    ] {
        assert!(matches!(
            c.blob_ranges(&r, &d, &bad).await,
            Err(ClientError::Invalid { .. })
        ));
    }
    // A server merging the ranges into one part sends more than their bytes: not
    // read past them, the bytes are still right, one range per request from then on.
    {
        let (c, r) = client_for(&fake, |_| {});
        fake.merge_ranges.store(true, Ordering::SeqCst);
        assert_eq!(c.blob_ranges(&r, &d, &ranges).await.unwrap(), want);
        assert!(!c.batches_ranges(&r.registry));
        fake.merge_ranges.store(false, Ordering::SeqCst);
    }
    // A server answering with the whole blob: the bytes are still right, the answer
    // is not read, and the registry is asked one range per request from then on.
    fake.ignore_range.store(true, Ordering::SeqCst);
    assert_eq!(c.blob_ranges(&r, &d, &ranges).await.unwrap(), want);
    assert!(!c.batches_ranges(&r.registry));
    let before = fake.requests("GET", "/blobs/");
    assert_eq!(c.blob_ranges(&r, &d, &ranges).await.unwrap(), want);
    assert_eq!(
        fake.requests("GET", "/blobs/"),
        before + 3,
        "one request per range"
    );
}

#[tokio::test]
async fn redirected_blob_get_drops_the_authorization_header() {
    let fake = start_fake().await;
    let cdn = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Bearer { lifetime_secs: 60 };
    let d = fake.add_blob(b"from the cdn");
    cdn.add_blob(b"from the cdn");
    *fake.redirect_blobs.lock().unwrap() = Some(format!("http://{}", cdn.host()));
    let (c, r) = client_for(&fake, |_| {});
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"from the cdn");
    let cdn_log = cdn.log.lock().unwrap();
    assert_eq!(cdn_log.len(), 1);
    assert!(
        cdn_log[0].authorization.is_none(),
        "credentials leaked to another host"
    );
    let log = fake.log.lock().unwrap();
    assert!(
        log.iter()
            .any(|l| l.path.contains("/blobs/") && l.authorization.is_some())
    );
}

#[tokio::test]
async fn manifest_digests_are_verified() {
    let fake = start_fake().await;
    let doc = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"a","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":1},"layers":[]}"#;
    let d = fake.add_manifest("team/app", "v1", media::OCI_MANIFEST, doc);
    let (c, r) = client_for(&fake, |_| {});
    let m = c.get_manifest(&r, "v1", &[]).await.unwrap();
    assert_eq!(m.digest, d);
    assert_eq!(m.media_type, media::OCI_MANIFEST);
    assert_eq!(&m.bytes[..], doc);
    let head = c.head_manifest(&r, "v1", &[]).await.unwrap().unwrap();
    assert_eq!(
        (head.digest.as_str(), head.size),
        (d.as_str(), doc.len() as u64)
    );
    assert!(c.head_manifest(&r, "v2", &[]).await.unwrap().is_none());
    fake.corrupt_manifests.store(true, Ordering::SeqCst);
    assert!(matches!(
        c.get_manifest(&r, &d, &[]).await.unwrap_err(),
        ClientError::DigestMismatch { .. }
    ));
    assert!(matches!(
        c.get_manifest(&r, "v1", &[]).await.unwrap_err(),
        ClientError::DigestMismatch { .. }
    ));
    assert!(c.get_manifest(&r, "../../etc", &[]).await.is_err());
}

#[tokio::test]
async fn parallel_download_writes_every_chunk_and_verifies() {
    let fake = start_fake().await;
    let data = pattern(1_000_003);
    let d = fake.add_blob(&data);
    let (c, r) = client_for(&fake, |_| {});
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("blob");
    let seen = Arc::new(AtomicU64::new(0));
    let s2 = seen.clone();
    let opts = DownloadOptions {
        concurrency: 4,
        chunk_size: 65_536,
        progress: Some(Arc::new(move |n| {
            s2.fetch_add(n, Ordering::SeqCst);
        })),
    };
    c.download_blob(&r, &d, data.len() as u64, &dest, &opts)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    assert_eq!(seen.load(Ordering::SeqCst), data.len() as u64);
    assert_eq!(
        fake.requests("GET", "/blobs/"),
        1_000_003usize.div_ceil(65_536)
    );
    // A flaky chunk is retried.
    fake.fail_next.store(1, Ordering::SeqCst);
    c.download_blob(&r, &d, data.len() as u64, &dest, &opts)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    // The wrong digest is caught at the end.
    let other = format!("sha256:{}", "1".repeat(64));
    fake.blobs
        .lock()
        .unwrap()
        .insert(other.clone(), Bytes::from(data.clone()));
    fake.link("team/app", &other);
    let err = c
        .download_blob(&r, &other, data.len() as u64, &dest, &opts)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::DigestMismatch { .. }), "{err}");
}

#[tokio::test]
async fn push_monolithic_chunked_and_mount() {
    let fake = start_fake().await;
    let (c, r) = client_for(&fake, |cfg| {
        cfg.monolithic_push_limit = 1000;
        cfg.chunk_size = 300;
    });
    let small = pattern(500);
    let ds = digest_of(&small);
    let body: ByteStream = Box::pin(futures_util::stream::iter(vec![Ok(Bytes::from(
        small.clone(),
    ))]));
    c.push_blob(&r, &ds, 500, body).await.unwrap();
    assert_eq!(fake.blobs.lock().unwrap()[&ds], small);
    let big = pattern(2_000);
    let db = digest_of(&big);
    let pieces: Vec<Result<Bytes, std::io::Error>> = big
        .chunks(333)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    c.push_blob(&r, &db, 2_000, Box::pin(futures_util::stream::iter(pieces)))
        .await
        .unwrap();
    assert_eq!(fake.blobs.lock().unwrap()[&db], big);
    assert_eq!(fake.requests("PATCH", "/blobs/uploads/"), 7);
    // Wrong content for the digest is refused by the registry and reported as such.
    let body: ByteStream = Box::pin(futures_util::stream::iter(vec![Ok(Bytes::from_static(
        b"zzz",
    ))]));
    let err = c
        .push_blob(&r, &digest_of(b"yyy"), 3, body)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::DigestMismatch { .. }), "{err}");
    let other = Repo::parse(fake.host(), "team/other").unwrap();
    assert!(c.mount_blob(&other, &ds, &name("team/app")).await.unwrap());
    assert!(
        !c.mount_blob(&other, &digest_of(b"absent"), &name("team/app"))
            .await
            .unwrap()
    );
    assert_eq!(fake.requests("DELETE", "/blobs/uploads/"), 1);
}

#[tokio::test]
async fn tags_follow_pagination_and_referrers_fall_back_to_tag() {
    let fake = start_fake().await;
    let (c, r) = client_for(&fake, |_| {});
    assert_eq!(c.tags(&r).await.unwrap(), vec!["a", "b", "c", "d", "e"]);
    let subject = digest_of(b"subject");
    assert!(
        c.referrers(&r, &subject, None)
            .await
            .unwrap()
            .manifests()
            .is_empty()
    );
    let art = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","artifactType":"application/vnd.ferry.index.v1","config":{"mediaType":"application/vnd.oci.empty.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[]}"#;
    let mut desc = ferry_oci::layout::descriptor(
        media::OCI_MANIFEST,
        ferry_oci::sha256_digest(art),
        art.len() as u64,
        &[],
    );
    desc.set_artifact_type(Some(ferry_oci::layout::media_type(
        media::FERRY_INDEX_ARTIFACT,
    )));
    c.push_referrer(&r, &subject, &desc, Bytes::from_static(art))
        .await
        .unwrap();
    c.push_referrer(&r, &subject, &desc, Bytes::from_static(art))
        .await
        .unwrap();
    let all = c.referrers(&r, &subject, None).await.unwrap();
    assert_eq!(all.manifests().len(), 1);
    assert_eq!(all.manifests()[0].digest(), desc.digest());
    let ferry = c
        .referrers(&r, &subject, Some(media::FERRY_INDEX_ARTIFACT))
        .await
        .unwrap();
    assert_eq!(ferry.manifests().len(), 1);
    let other = c
        .referrers(&r, &subject, Some("application/x-other"))
        .await
        .unwrap();
    assert!(other.manifests().is_empty());
}

struct Recorder(Mutex<Vec<(String, copy::BlobOutcome)>>);
impl CopyProgress for Recorder {
    fn blob_finished(&self, digest: &str, outcome: copy::BlobOutcome) {
        self.0.lock().unwrap().push((digest.to_string(), outcome));
    }
}

#[tokio::test]
async fn copy_layout_to_registry_and_back_with_referrers() {
    use ferry_oci::layout::{canonical_json, descriptor, media_type};
    let fake = start_fake().await;
    let (c, r) = client_for(&fake, |_| {});
    let dir = tempfile::tempdir().unwrap();
    let src = ferry_oci::OciLayout::open_or_create(dir.path().join("src")).unwrap();
    let config = src
        .write_blob(br#"{"architecture":"amd64","os":"linux"}"#)
        .unwrap();
    let layer_bytes = pattern(70_000);
    let layer = src.write_blob(&layer_bytes).unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media::OCI_MANIFEST,
        "config": descriptor(media::OCI_CONFIG, config.clone(), 37, &[]),
        "layers": [descriptor(media::LAYER_TAR_GZIP, layer.clone(), 70_000, &[])],
    });
    let mbytes = canonical_json(&manifest).unwrap();
    let md = src.write_blob(&mbytes).unwrap();
    let mdesc = descriptor(media::OCI_MANIFEST, md.clone(), mbytes.len() as u64, &[]);
    src.set_tag("v1", &mdesc).unwrap();
    // A ferry index artifact referring to it.
    let empty = src.write_blob(b"{}").unwrap();
    let idx = src.write_blob(b"index bytes").unwrap();
    let art = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media::OCI_MANIFEST,
        "artifactType": media::FERRY_INDEX_ARTIFACT,
        "config": descriptor(media::OCI_EMPTY, empty, 2, &[]),
        "layers": [descriptor(media::FERRY_LAYER_INDEX, idx.clone(), 11, &[])],
        "subject": mdesc,
    });
    let abytes = canonical_json(&art).unwrap();
    let ad = src.write_blob(&abytes).unwrap();
    let mut adesc = descriptor(media::OCI_MANIFEST, ad.clone(), abytes.len() as u64, &[]);
    adesc.set_artifact_type(Some(media_type(media::FERRY_INDEX_ARTIFACT)));
    src.add_referrer(&md, &adesc).unwrap();

    let from = ImageLocation::Layout {
        layout: src.clone(),
        reference: "v1".into(),
    };
    let to = ImageLocation::Registry {
        client: c.clone(),
        repo: r.clone(),
        reference: "v1".into(),
    };
    let report = copy_image(&from, &to, &CopyOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(report.digest, md.to_string());
    assert_eq!(
        (report.blobs_copied, report.referrers, report.manifests),
        (4, 1, 2)
    );
    assert_eq!(
        c.get_manifest(&r, "v1", &[]).await.unwrap().digest,
        md.to_string()
    );
    let refs = c
        .referrers(&r, md.as_ref(), Some(media::FERRY_INDEX_ARTIFACT))
        .await
        .unwrap();
    assert_eq!(refs.manifests()[0].digest(), &ad);

    // Again: everything is already there.
    let rec = Arc::new(Recorder(Mutex::new(Vec::new())));
    let again = copy_image(&from, &to, &CopyOptions::default(), rec.clone())
        .await
        .unwrap();
    assert_eq!(again.blobs_copied, 0);
    assert_eq!(again.blobs_skipped, 4);
    assert!(
        rec.0
            .lock()
            .unwrap()
            .iter()
            .all(|(_, o)| *o == copy::BlobOutcome::Existed)
    );

    // Registry -> another repository of the same registry: mounted, not copied.
    let r2 = Repo::parse(fake.host(), "team/copy").unwrap();
    let to2 = ImageLocation::Registry {
        client: c.clone(),
        repo: r2.clone(),
        reference: "v1".into(),
    };
    let mounted = copy_image(&to, &to2, &CopyOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(mounted.blobs_mounted, 4);
    assert_eq!(mounted.bytes_copied, 0);

    // Registry -> a new layout: same digests, referrer included.
    let back = ferry_oci::OciLayout::open_or_create(dir.path().join("back")).unwrap();
    let to3 = ImageLocation::Layout {
        layout: back.clone(),
        reference: "copied".into(),
    };
    let report = copy_image(&to2, &to3, &CopyOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(report.digest, md.to_string());
    assert_eq!(back.resolve("copied").unwrap().digest(), &md);
    assert_eq!(
        std::fs::read(back.blob_path(&layer).unwrap()).unwrap(),
        layer_bytes
    );
    let refs = back.referrers(&md).unwrap();
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].digest(), &ad);
    assert!(back.has_blob(&idx));

    // With a small chunk size, big blobs come down as parallel Range requests.
    let (small_chunks, _) = client_for(&fake, |cfg| cfg.chunk_size = 16 << 10);
    let from4 = ImageLocation::Registry {
        client: small_chunks,
        repo: r2.clone(),
        reference: "v1".into(),
    };
    let ranged = dir.path().join("ranged");
    let to4 = ImageLocation::Layout {
        layout: ferry_oci::OciLayout::open_or_create(&ranged).unwrap(),
        reference: "v1".into(),
    };
    let before = fake.requests("GET", layer.as_ref());
    copy_image(&from4, &to4, &CopyOptions::default(), Arc::new(NoProgress))
        .await
        .unwrap();
    assert_eq!(
        fake.requests("GET", layer.as_ref()) - before,
        70_000usize.div_ceil(16 << 10)
    );
    let got = ferry_oci::OciLayout::open(&ranged).unwrap();
    assert_eq!(
        std::fs::read(got.blob_path(&layer).unwrap()).unwrap(),
        layer_bytes
    );
}

/// Found by fuzzing: a `206` answer claiming its last byte is `u64::MAX` overflowed the
/// `end + 1` the range check computes; a range outside its own total is refused too.
#[test]
fn content_range_answers_are_bounded() {
    assert_eq!(
        parse_content_range("bytes 0-99/1000"),
        Some((0, 99, Some(1000)))
    );
    assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
    assert_eq!(parse_content_range("bytes 0-18446744073709551615/*"), None);
    assert_eq!(parse_content_range("bytes 0-99/99"), None);
    assert_eq!(parse_content_range("bytes 9-5/10"), None);
    // The bare form of a chunk upload, as the registry reads it.
    assert_eq!(parse_content_range("0-99"), Some((0, 99, None)));
    assert_eq!(parse_content_range(" 100 - 199 "), Some((100, 199, None)));
    assert_eq!(parse_content_range("5-4"), None);
    assert_eq!(parse_content_range("abc"), None);
    assert_eq!(parse_content_range("-4"), None);
    assert_eq!(
        parse_content_range("0-18446744073709551614"),
        Some((0, u64::MAX - 1, None))
    );
}

#[test]
fn credentials_never_follow_a_downgrade_to_plain_http() {
    let tls = Endpoint {
        host: "registry.example:5000".into(),
        scheme: None,
        skip_tls_verify: false,
        mirror: false,
        root: None,
        tls: None,
        headers: Arc::from([]),
    };
    let url = |s: &str| url::Url::parse(s).unwrap();
    assert!(tls.owns(&url("https://registry.example:5000/v2/x/tags/list?last=a")));
    assert!(!tls.owns(&url("http://registry.example:5000/v2/x/tags/list?last=a")));
    assert!(!tls.owns(&url("https://registry.example:5001/v2/")));
    assert!(!tls.owns(&url("https://cdn.example/blob")));
    let plain = Endpoint {
        scheme: Some("http"),
        ..tls.clone()
    };
    assert!(plain.owns(&url("http://registry.example:5000/v2/")));
    let loopback = Endpoint {
        host: "127.0.0.1:5000".into(),
        ..tls
    };
    assert!(loopback.owns(&url("http://127.0.0.1:5000/v2/")));
}

fn name(s: &str) -> ferry_oci::RepositoryName {
    ferry_oci::RepositoryName::parse(s).unwrap()
}

// ------------------------------------------------------------------ hosts.toml

/// A `config_path` directory with one `hosts.toml` for `registry`.
fn hosts_dir(registry: &str, text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let host_dir = dir.path().join(registry);
    std::fs::create_dir(&host_dir).unwrap();
    std::fs::write(host_dir.join("hosts.toml"), text).unwrap();
    dir
}

fn with_hosts(dir: &tempfile::TempDir) -> impl FnOnce(&mut ClientConfig) + '_ {
    |cfg: &mut ClientConfig| cfg.config_path = Some(dir.path().to_path_buf())
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test]
async fn hosts_toml_mirror_down_then_good_mirror_then_origin() {
    let fake = start_fake().await;
    let good = start_fake().await;
    let d = fake.add_blob(b"origin bytes");
    good.blobs
        .lock()
        .unwrap()
        .insert(d.clone(), Bytes::from_static(b"origin bytes"));
    good.link("team/app", &d);
    let dir = hosts_dir(
        &fake.host(),
        &format!(
            "[host.\"http://127.0.0.1:{}\"]\ncapabilities = [\"pull\"]\n\
             [host.\"http://{}\"]\ncapabilities = [\"pull\", \"resolve\"]\n\
             [host.\"http://{}\".header]\nx-ferry-test = \"from-hosts\"\n",
            closed_port(),
            good.host(),
            good.host()
        ),
    );
    let (c, r) = client_for(&fake, with_hosts(&dir));
    assert!(c.has_mirrors(&fake.host()));
    let start = Instant::now();
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"origin bytes");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "a refused mirror is not retried"
    );
    assert_eq!(
        good.requests("GET", "/blobs/"),
        1,
        "the second host served it"
    );
    assert_eq!(
        fake.requests("GET", "/blobs/"),
        0,
        "the origin was not needed"
    );
    let seen = good
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|r| r.x_test.as_deref() == Some("from-hosts"));
    assert!(seen, "hosts.toml headers go to their host");
    // Only the origin is left once the good mirror is gone too.
    good.all_404.store(true, Ordering::SeqCst);
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"origin bytes");
    assert_eq!(fake.requests("GET", "/blobs/"), 1);
    assert!(
        fake.log.lock().unwrap().iter().all(|r| r.x_test.is_none()),
        "not to the origin"
    );
}

#[tokio::test]
async fn hosts_toml_capabilities_choose_hosts_per_call() {
    let fake = start_fake().await;
    let mirror = start_fake().await;
    let doc = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[]}"#;
    let d = fake.add_manifest("team/app", "v1", media::OCI_MANIFEST, doc);
    mirror.add_manifest("team/app", "v1", media::OCI_MANIFEST, doc);
    let dir = hosts_dir(
        &fake.host(),
        &format!(
            "[host.\"http://{}\"]\ncapabilities = [\"pull\"]\n",
            mirror.host()
        ),
    );
    let (c, r) = client_for(&fake, with_hosts(&dir));
    // By tag: resolve, which the mirror may not do.
    c.get_manifest(&r, "v1", &[]).await.unwrap();
    assert_eq!(mirror.requests("GET", "/manifests/"), 0);
    assert_eq!(fake.requests("GET", "/manifests/v1"), 1);
    // By digest: pull, the mirror's.
    c.get_manifest(&r, &d, &[]).await.unwrap();
    assert_eq!(mirror.requests("GET", "/manifests/sha256:"), 1);
    assert_eq!(fake.requests("GET", "/manifests/sha256:"), 0);
    // A server that may not resolve leaves nobody to ask: a clear error.
    let dir = hosts_dir(
        &fake.host(),
        &format!(
            "capabilities = [\"pull\"]\n[host.\"http://{}\"]\ncapabilities = [\"pull\"]\n",
            mirror.host()
        ),
    );
    let (c, r) = client_for(&fake, with_hosts(&dir));
    let e = c.get_manifest(&r, "v1", &[]).await.unwrap_err().to_string();
    assert!(e.contains("hosts.toml") && e.contains("resolve"), "{e}");
}

#[tokio::test]
async fn hosts_toml_corrupt_mirror_is_caught_and_the_origin_serves() {
    let fake = start_fake().await;
    let bad = start_fake().await;
    let d = fake.add_blob(b"the real bytes");
    bad.blobs
        .lock()
        .unwrap()
        .insert(d.clone(), Bytes::from_static(b"corrupt bytes!"));
    bad.link("team/app", &d);
    let doc = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#;
    let md = fake.add_manifest("team/app", "v1", media::OCI_INDEX, doc);
    bad.add_manifest("team/app", "v1", media::OCI_INDEX, doc);
    bad.corrupt_manifests.store(true, Ordering::SeqCst);
    let dir = hosts_dir(
        &fake.host(),
        &format!(
            "[host.\"http://{}\"]\ncapabilities = [\"pull\"]\n",
            bad.host()
        ),
    );
    let (c, r) = client_for(&fake, with_hosts(&dir));
    let got = c.blob_verified(&r, &d, 14, "test blob").await.unwrap();
    assert_eq!(got, b"the real bytes");
    assert_eq!(
        bad.requests("GET", "/blobs/"),
        1,
        "the mirror was asked first"
    );
    assert_eq!(fake.requests("GET", "/blobs/"), 1, "then the origin");
    let m = c.get_manifest(&r, &md, &[]).await.unwrap();
    assert_eq!(m.digest, md);
    assert_eq!(bad.requests("GET", "/manifests/"), 1);
    assert_eq!(fake.requests("GET", "/manifests/"), 1);
    // Without mirrors a mismatch is an error, not a loop.
    let (c, r) = client_for(&bad, |_| {});
    let e = c.blob_verified(&r, &d, 14, "test blob").await.unwrap_err();
    assert!(matches!(e, ClientError::DigestMismatch { .. }), "{e}");
}

#[tokio::test]
async fn hosts_toml_override_path_and_server() {
    let fake = start_fake().await;
    let prefixed = start_fake().await;
    *prefixed.api_root.lock().unwrap() = Some("/cache/team-mirror".into());
    let d = prefixed.add_blob(b"behind a prefix");
    // The origin named by `server` is another host than the registry's name.
    let dir = hosts_dir(
        "registry.invalid",
        &format!(
            "server = \"http://{}\"\n\
             [host.\"http://{}/cache/team-mirror\"]\noverride_path = true\ncapabilities = [\"pull\"]\n",
            fake.host(),
            prefixed.host()
        ),
    );
    let mut cfg = test_config();
    cfg.config_path = Some(dir.path().to_path_buf());
    let c = Client::new(cfg).unwrap();
    let r = Repo::parse("registry.invalid", "team/app").unwrap();
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"behind a prefix");
    assert_eq!(
        prefixed.requests("GET", "/cache/team-mirror/team/app/blobs/"),
        1
    );
    // Without override_path the URL's path gets /v2 appended: not served there, so the
    // server (the fake, by `server`) answers.
    let d2 = fake.add_blob(b"from the server");
    let dir = hosts_dir(
        "registry.invalid",
        &format!(
            "server = \"http://{}\"\n[host.\"http://{}/cache/team-mirror\"]\n",
            fake.host(),
            prefixed.host()
        ),
    );
    let mut cfg = test_config();
    cfg.config_path = Some(dir.path().to_path_buf());
    let c = Client::new(cfg).unwrap();
    let got = collect(c.blob_stream(&r, &d2, None).await.unwrap()).await;
    assert_eq!(got, b"from the server");
    assert_eq!(
        prefixed.requests("GET", "/cache/team-mirror/v2/team/app/blobs/"),
        1
    );
    // Pushes go to the server only.
    assert_eq!(c.origin("registry.invalid").unwrap().host, fake.host());
}

#[tokio::test]
async fn hosts_toml_bad_ca_file_is_a_clear_error_and_mirrors_fall_through() {
    let fake = start_fake().await;
    let d = fake.add_blob(b"origin bytes");
    let dir = hosts_dir(
        &fake.host(),
        &format!(
            "[host.\"https://127.0.0.1:{}\"]\nca = \"missing-ca.pem\"\n",
            closed_port()
        ),
    );
    let (c, r) = client_for(&fake, with_hosts(&dir));
    // The mirror's TLS settings cannot be built: skipped, the origin serves.
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"origin bytes");
    // The same on the server itself is the call's error, naming the file.
    let dir = hosts_dir(&fake.host(), "ca = \"missing-ca.pem\"\n");
    let (c, r) = client_for(&fake, with_hosts(&dir));
    let e = c.blob_stream(&r, &d, None).await.unwrap_err().to_string();
    assert!(e.contains("missing-ca.pem"), "{e}");
}

#[test]
fn tag_reads_resolve_and_digest_reads_pull() {
    assert!(resolves_a_tag("/v2/a/b/manifests/latest"));
    assert!(resolves_a_tag("/v2/a/b/tags/list?n=10"));
    assert!(!resolves_a_tag(
        "/v2/a/b/manifests/sha256:0000000000000000000000000000000000000000000000000000000000000000"
    ));
    assert!(!resolves_a_tag("/v2/a/b/blobs/sha256:00"));
    assert!(!resolves_a_tag("/v2/a/b/referrers/sha256:00"));
}

// ------------------------------------------------------------------ credential providers

/// A plugin directory whose `plugin` answers with password `pw-N` for its N-th run (its
/// runs counted in `runs`), and `alice` as the username.
fn provider_plugin(passwords: &[&str], duration: &str) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mut cases = String::new();
    for (i, p) in passwords.iter().enumerate() {
        cases.push_str(&format!("  {}) pw='{p}' ;;\n", i + 1));
    }
    let script = format!(
        r#"#!/bin/sh
d="$(dirname "$0")"
cat > /dev/null
echo run >> "$d/runs"
n=$(wc -l < "$d/runs")
case $n in
{cases}  *) pw='{last}' ;;
esac
printf '{{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderResponse","cacheKeyType":"Registry","cacheDuration":"{duration}","auth":{{"127.0.0.1":{{"username":"alice","password":"%s"}}}}}}' "$pw"
"#,
        last = passwords.last().unwrap()
    );
    let path = dir.path().join("plugin");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn plugin_runs(dir: &tempfile::TempDir) -> usize {
    std::fs::read_to_string(dir.path().join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn provider_client(
    fake: &Fake,
    dir: &tempfile::TempDir,
    clock: Arc<dyn credprovider::Clock>,
) -> (Client, Repo) {
    let port = fake.host().rsplit_once(':').unwrap().1.to_string();
    let config = credprovider::ProvidersConfig {
        providers: vec![credprovider::Provider {
            name: "plugin".into(),
            match_images: vec![
                credprovider::ImagePattern::parse(&format!("127.0.0.1:{port}")).unwrap(),
            ],
            default_cache_duration: Duration::from_secs(60),
            api_version: "credentialprovider.kubelet.k8s.io/v1".into(),
            args: Vec::new(),
            env: Vec::new(),
        }],
        skipped: Vec::new(),
    };
    // The answer's auth key has no port; the plugin writes the one it was asked for.
    let script = std::fs::read_to_string(dir.path().join("plugin")).unwrap();
    std::fs::write(
        dir.path().join("plugin"),
        script.replace("\"127.0.0.1\"", &format!("\"127.0.0.1:{port}\"")),
    )
    .unwrap();
    let providers = credprovider::CredentialProviders::new(config, dir.path().to_path_buf(), clock);
    (
        Client::with_credential_providers(test_config(), Some(providers)).unwrap(),
        Repo::parse(fake.host(), "team/app").unwrap(),
    )
}

#[tokio::test]
async fn provider_credentials_refused_are_asked_for_again_once() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Basic;
    let d = fake.add_blob(b"x");
    // The first answer is stale (rotated early); the second is good.
    let dir = provider_plugin(&["stale", "s3cret"], "1h");
    let (c, r) = provider_client(&fake, &dir, Arc::new(credprovider::SystemClock));
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(1));
    assert_eq!(plugin_runs(&dir), 2);
    // The good answer is cached: no more runs.
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(1));
    assert_eq!(plugin_runs(&dir), 2);
}

#[tokio::test]
async fn provider_credentials_refused_twice_fail_clearly_and_are_not_kept() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Bearer { lifetime_secs: 60 };
    let d = fake.add_blob(b"x");
    let dir = provider_plugin(&["wrong"], "1h");
    let (c, r) = provider_client(&fake, &dir, Arc::new(credprovider::SystemClock));
    let err = c.blob_size(&r, &d).await.unwrap_err();
    assert!(matches!(err, ClientError::Unauthorized { .. }), "{err}");
    assert!(!err.to_string().contains("wrong"), "{err}");
    assert_eq!(plugin_runs(&dir), 2, "asked once more, not in a loop");
    // Nothing was kept: the next request asks again.
    let _ = c.blob_size(&r, &d).await.unwrap_err();
    assert_eq!(plugin_runs(&dir), 4);
}

#[tokio::test]
async fn expired_provider_credentials_are_fetched_again_mid_run() {
    let fake = start_fake().await;
    *fake.auth.lock().unwrap() = AuthMode::Bearer { lifetime_secs: 1 };
    let d = fake.add_blob(b"hello");
    let clock = Arc::new(credprovider::ManualClock::default());
    let dir = provider_plugin(&["s3cret"], "10m");
    let (c, r) = provider_client(&fake, &dir, clock.clone());
    assert_eq!(c.blob_size(&r, &d).await.unwrap(), Some(5));
    assert_eq!(plugin_runs(&dir), 1);
    // Hours later (a cold file of a long-running container): the plugin's answer and
    // the registry token have both expired; both are fetched again.
    clock.advance(Duration::from_secs(3 * 3600));
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let got = collect(c.blob_stream(&r, &d, None).await.unwrap()).await;
    assert_eq!(got, b"hello");
    assert_eq!(plugin_runs(&dir), 2);
    assert!(fake.token_requests.load(Ordering::SeqCst) >= 2);
}
