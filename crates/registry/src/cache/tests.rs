//! Tests of the pull-through cache against an in-process upstream registry (a small axum
//! app on 127.0.0.1:0 that can trickle, corrupt, fail with a status, and require basic
//! auth), through ferry's real registry client.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, Method, StatusCode, header};
use tokio::sync::watch;

use super::*;
use crate::storage::ByteStream;

/// Generous bound so a broken implementation fails instead of hanging; never a threshold.
const PATIENCE: Duration = Duration::from_secs(60);

/// Holds a blob body after its first `split` bytes until opened.
struct Gate {
    split: usize,
    open: watch::Receiver<bool>,
}

#[derive(Default)]
struct Upstream {
    blobs: Mutex<HashMap<String, Bytes>>,
    repo_blobs: Mutex<HashSet<(String, String)>>,
    /// (repo, digest) -> (media type, bytes)
    manifests: Mutex<HashMap<(String, String), (String, Bytes)>>,
    /// (repo, tag) -> digest
    tags: Mutex<HashMap<(String, String), String>>,
    fail_status: AtomicU16,
    corrupt: AtomicBool,
    gate: Mutex<Option<Gate>>,
    credentials: Option<(String, String)>,
    saw_authorization: AtomicBool,
    log: Mutex<Vec<String>>,
}

impl Upstream {
    fn count(&self, method: &str, path_part: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(&format!("{method} ")) && l.contains(path_part))
            .count()
    }

    fn add_blob(&self, repo: &str, content: &[u8]) -> String {
        let digest = ferry_oci::digest::sha256_digest(content).to_string();
        self.blobs
            .lock()
            .unwrap()
            .insert(digest.clone(), Bytes::copy_from_slice(content));
        self.repo_blobs
            .lock()
            .unwrap()
            .insert((repo.to_owned(), digest.clone()));
        digest
    }

    fn add_manifest(&self, repo: &str, tag: &str, config_digest: &str, layers: &[&str]) -> String {
        let layers: Vec<serde_json::Value> = layers
            .iter()
            .map(|d| {
                serde_json::json!({
                    "mediaType": ferry_oci::media::LAYER_TAR_GZIP, "digest": d, "size": 1
                })
            })
            .collect();
        let doc = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": ferry_oci::media::OCI_MANIFEST,
            "config": { "mediaType": ferry_oci::media::OCI_CONFIG, "digest": config_digest, "size": 2 },
            "layers": layers,
        });
        let bytes = Bytes::from(serde_json::to_vec(&doc).unwrap());
        let digest = ferry_oci::digest::sha256_digest(&bytes).to_string();
        self.manifests.lock().unwrap().insert(
            (repo.to_owned(), digest.clone()),
            (ferry_oci::media::OCI_MANIFEST.to_owned(), bytes),
        );
        self.tags
            .lock()
            .unwrap()
            .insert((repo.to_owned(), tag.to_owned()), digest.clone());
        digest
    }

    /// Holds blob bodies after `split` bytes; returns the opener.
    fn hold_after(&self, split: usize) -> watch::Sender<bool> {
        let (open_tx, open_rx) = watch::channel(false);
        *self.gate.lock().unwrap() = Some(Gate {
            split,
            open: open_rx,
        });
        open_tx
    }
}

fn error_response(status: StatusCode, code: &str) -> Response {
    let body = format!(r#"{{"errors":[{{"code":"{code}","message":"test upstream"}}]}}"#);
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

async fn handle(State(up): State<Arc<Upstream>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    up.log.lock().unwrap().push(format!("{method} {path}"));
    if let Some((user, pass)) = &up.credentials {
        let expected = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
        );
        let given = req.headers().get(header::AUTHORIZATION);
        if given.is_some() {
            up.saw_authorization.store(true, Ordering::SeqCst);
        }
        if given.and_then(|v| v.to_str().ok()) != Some(expected.as_str()) {
            let mut resp = error_response(StatusCode::UNAUTHORIZED, "UNAUTHORIZED");
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(r#"Basic realm="test upstream""#),
            );
            return resp;
        }
    }
    let fail = up.fail_status.load(Ordering::SeqCst);
    if fail != 0 {
        let status = StatusCode::from_u16(fail).unwrap();
        return error_response(status, "UNAVAILABLE");
    }
    if path == "/v2/" || path == "/v2" {
        return Response::new(Body::from("{}"));
    }
    let Some(rest) = path.strip_prefix("/v2/") else {
        return error_response(StatusCode::NOT_FOUND, "NAME_UNKNOWN");
    };
    if let Some((repo, digest)) = rest.rsplit_once("/blobs/") {
        let range = req
            .headers()
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("bytes="))
            .and_then(|v| v.split_once('-'))
            .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
        return blob(&up, &method, repo, digest, range);
    }
    if let Some((repo, reference)) = rest.rsplit_once("/manifests/") {
        return manifest(&up, &method, repo, reference);
    }
    if let Some(repo) = rest.strip_suffix("/tags/list") {
        let mut tags: Vec<String> = up
            .tags
            .lock()
            .unwrap()
            .keys()
            .filter(|(r, _)| r == repo)
            .map(|(_, t)| t.clone())
            .collect();
        if tags.is_empty() {
            return error_response(StatusCode::NOT_FOUND, "NAME_UNKNOWN");
        }
        tags.sort();
        let body = serde_json::json!({ "name": repo, "tags": tags }).to_string();
        return Response::new(Body::from(body));
    }
    if let Some((_repo, _subject)) = rest.rsplit_once("/referrers/") {
        let body = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": ferry_oci::media::OCI_INDEX,
            "manifests": [],
        })
        .to_string();
        let mut resp = Response::new(Body::from(body));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(ferry_oci::media::OCI_INDEX),
        );
        return resp;
    }
    error_response(StatusCode::NOT_FOUND, "NAME_UNKNOWN")
}

fn blob(
    up: &Upstream,
    method: &Method,
    repo: &str,
    digest: &str,
    range: Option<(usize, usize)>,
) -> Response {
    let held = up
        .repo_blobs
        .lock()
        .unwrap()
        .contains(&(repo.to_owned(), digest.to_owned()));
    let content = up.blobs.lock().unwrap().get(digest).cloned();
    let (true, Some(content)) = (held, content) else {
        return error_response(StatusCode::NOT_FOUND, "BLOB_UNKNOWN");
    };
    let length = content.len();
    if let Some((first, last)) = range.filter(|(a, b)| a <= b && *b < length)
        && *method == Method::GET
    {
        // Ranges are served at once, never held by the gate.
        let mut resp = Response::new(Body::from(content.slice(first..=last)));
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(last + 1 - first));
        headers.insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&format!("bytes {first}-{last}/{length}")).unwrap(),
        );
        return resp;
    }
    let body = if *method == Method::HEAD {
        Body::empty()
    } else {
        let content = if up.corrupt.load(Ordering::SeqCst) {
            let mut bad = content.to_vec();
            let middle = bad.len() / 2;
            bad[middle] ^= 0xff;
            Bytes::from(bad)
        } else {
            content
        };
        match up
            .gate
            .lock()
            .unwrap()
            .as_ref()
            .map(|g| (g.split, g.open.clone()))
        {
            None => Body::from(content),
            Some((split, mut open)) => {
                let split = split.min(content.len());
                let head = content.slice(..split);
                let tail = content.slice(split..);
                let first = futures_util::stream::once(async move { Ok::<_, io::Error>(head) });
                let rest = futures_util::stream::once(async move {
                    let _ = open.wait_for(|o| *o).await;
                    Ok::<_, io::Error>(tail)
                });
                Body::from_stream(first.chain(rest))
            }
        }
    };
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(
        "docker-content-digest",
        HeaderValue::from_str(digest).unwrap(),
    );
    resp
}

fn manifest(up: &Upstream, method: &Method, repo: &str, reference: &str) -> Response {
    let digest = if reference.starts_with("sha256:") {
        reference.to_owned()
    } else {
        match up
            .tags
            .lock()
            .unwrap()
            .get(&(repo.to_owned(), reference.to_owned()))
        {
            Some(d) => d.clone(),
            None => return error_response(StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN"),
        }
    };
    let Some((media_type, bytes)) = up
        .manifests
        .lock()
        .unwrap()
        .get(&(repo.to_owned(), digest.clone()))
        .cloned()
    else {
        return error_response(StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN");
    };
    let length = bytes.len();
    let body = if *method == Method::HEAD {
        Body::empty()
    } else {
        Body::from(bytes)
    };
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(&media_type).unwrap(),
    );
    headers.insert(
        "docker-content-digest",
        HeaderValue::from_str(&digest).unwrap(),
    );
    resp
}

async fn start_upstream(up: Arc<Upstream>) -> SocketAddr {
    let app = axum::Router::new().fallback(handle).with_state(up);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

struct Fixture {
    up: Arc<Upstream>,
    cfg: UpstreamConfig,
    metrics: Metrics,
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn new(up: Upstream) -> Fixture {
        let up = Arc::new(up);
        let addr = start_upstream(Arc::clone(&up)).await;
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = UpstreamConfig::new(format!("http://{addr}"));
        cfg.cache_dir = Some(dir.path().join("cache"));
        cfg.username = up.credentials.as_ref().map(|c| c.0.clone());
        cfg.password = up.credentials.as_ref().map(|c| c.1.clone());
        Fixture {
            up,
            cfg,
            metrics: Metrics::new(),
            _dir: dir,
        }
    }

    async fn cache(&self) -> PullThrough {
        PullThrough::new(&self.cfg, self.metrics.clone())
            .await
            .unwrap()
    }
}

async fn collect(body: ByteStream) -> io::Result<Vec<u8>> {
    let mut body = body;
    let mut out = Vec::new();
    while let Some(chunk) = tokio::time::timeout(PATIENCE, body.next())
        .await
        .map_err(|_| io::Error::other("stream stalled"))?
    {
        out.extend_from_slice(&chunk?);
    }
    Ok(out)
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u8
        })
        .collect()
}

/// Waits (bounded) until no download is in progress.
async fn downloads_settled(pt: &PullThrough) {
    tokio::time::timeout(PATIENCE, async {
        while !pt.shared.blobs.lock().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
}

fn tmp_files(fx: &Fixture) -> usize {
    std::fs::read_dir(fx.cfg.effective_cache_dir().join("tmp"))
        .unwrap()
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_cold_requests_cause_one_upstream_get() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(3 << 20, 1);
    let digest = fx.up.add_blob("team/app", &content);
    // Hold the body after 64 KiB so all 100 requests arrive while the fetch runs.
    let open = fx.up.hold_after(64 << 10);
    let pt = Arc::new(fx.cache().await);
    let mut reads = Vec::new();
    for _ in 0..100 {
        let pt = Arc::clone(&pt);
        let digest = digest.clone();
        reads.push(tokio::spawn(async move {
            pt.blob("team/app", &digest, None).await
        }));
    }
    let mut bodies = Vec::new();
    for read in reads {
        let read = read.await.unwrap().unwrap().unwrap();
        assert_eq!(read.size, content.len() as u64);
        bodies.push(tokio::spawn(collect(read.body)));
    }
    open.send_replace(true);
    for body in bodies {
        assert!(
            body.await.unwrap().unwrap() == content,
            "a waiter got wrong bytes"
        );
    }
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
    assert_eq!(fx.up.count("HEAD", "/blobs/"), 0);
    downloads_settled(&pt).await;
    assert!(pt.disk().contains(&digest["sha256:".len()..]));
    // Later requests are disk hits.
    let again = pt.blob("team/app", &digest, None).await.unwrap().unwrap();
    assert_eq!(collect(again.body).await.unwrap(), content);
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
    let text = fx.metrics.encode();
    assert!(
        text.contains("ferry_registry_upstream_fetches_total 1"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "ferry_registry_upstream_bytes_total {}",
            content.len()
        )),
        "{text}"
    );
    assert_eq!(tmp_files(&fx), 0);
}

#[tokio::test]
async fn waiters_get_bytes_while_upstream_is_still_sending() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(1 << 20, 2);
    let digest = fx.up.add_blob("lib/x", &content);
    let split = 100_000;
    let open = fx.up.hold_after(split);
    let pt = fx.cache().await;

    let first = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    let mut first_body = first.body;
    // Upstream has sent only `split` bytes and waits for the gate: whatever arrives now
    // was streamed before the fetch completed.
    let mut early = Vec::new();
    while early.len() < split {
        let chunk = tokio::time::timeout(PATIENCE, first_body.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        early.extend_from_slice(&chunk);
    }
    assert_eq!(&early[..], &content[..split]);
    assert!(!*open.borrow(), "the gate is still closed");

    // A waiter arriving late, while the fetch still runs, starts from byte 0.
    let late = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    let mut late_body = late.body;
    let chunk = tokio::time::timeout(PATIENCE, late_body.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&chunk[..], &content[..chunk.len()]);

    open.send_replace(true);
    let rest = collect(first_body).await.unwrap();
    early.extend_from_slice(&rest);
    assert!(early == content);
    let mut late_all = chunk.to_vec();
    late_all.extend_from_slice(&collect(late_body).await.unwrap());
    assert!(late_all == content);
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
}

#[tokio::test]
async fn range_is_served_from_the_partial_file() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(512 << 10, 3);
    let digest = fx.up.add_blob("lib/x", &content);
    let split = 200_000;
    let open = fx.up.hold_after(split);
    let pt = fx.cache().await;

    // Starts the fetch; its bytes stay partial until the gate opens.
    let whole = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    let covered = pt
        .blob("lib/x", &digest, Some(1000..150_000))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(covered.size, content.len() as u64);
    // Completes although the gate is closed.
    assert_eq!(
        collect(covered.body).await.unwrap(),
        &content[1000..150_000]
    );
    assert!(!*open.borrow());

    let beyond = pt
        .blob("lib/x", &digest, Some(300_000..400_000))
        .await
        .unwrap()
        .unwrap();
    let beyond = tokio::spawn(collect(beyond.body));
    open.send_replace(true);
    assert_eq!(beyond.await.unwrap().unwrap(), &content[300_000..400_000]);
    assert!(collect(whole.body).await.unwrap() == content);

    // Unsatisfiable ranges are refused with the blob size.
    let err = pt
        .blob("lib/x", &digest, Some(0..content.len() as u64 + 1))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::RangeNotSatisfiable {
            size: content.len() as u64
        }
    );
    assert_eq!(err.http_status(), 416);
    // And from the committed file.
    downloads_settled(&pt).await;
    let tail = pt
        .blob("lib/x", &digest, Some(500_000..content.len() as u64))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(collect(tail.body).await.unwrap(), &content[500_000..]);
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
}

#[tokio::test]
async fn a_range_far_ahead_of_the_download_is_passed_through() {
    let mut fx = Fixture::new(Upstream::default()).await;
    fx.cfg.range_passthrough_bytes = 50_000;
    let content = pseudo_random(400_000, 13);
    let digest = fx.up.add_blob("lib/x", &content);
    let open = fx.up.hold_after(10_000);
    let pt = fx.cache().await;
    let whole = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    // Far ahead of the 10 000 bytes received: answered while the download is held.
    let far = pt
        .blob("lib/x", &digest, Some(300_000..350_000))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(far.size, content.len() as u64);
    assert_eq!(collect(far.body).await.unwrap(), &content[300_000..350_000]);
    assert!(!*open.borrow());
    // Near: waits for the download (no extra upstream request).
    let near = pt
        .blob("lib/x", &digest, Some(20_000..30_000))
        .await
        .unwrap()
        .unwrap();
    let near = tokio::spawn(collect(near.body));
    open.send_replace(true);
    assert_eq!(near.await.unwrap().unwrap(), &content[20_000..30_000]);
    assert!(collect(whole.body).await.unwrap() == content);
    assert_eq!(fx.up.count("GET", "/blobs/"), 2);
    downloads_settled(&pt).await;
    assert_eq!(pt.disk().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_upstream_content_fails_every_waiter_and_caches_nothing() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(700_000, 4);
    let digest = fx.up.add_blob("lib/x", &content);
    fx.up.corrupt.store(true, Ordering::SeqCst);
    let open = fx.up.hold_after(10_000);
    let pt = Arc::new(fx.cache().await);
    let mut waiters = Vec::new();
    for _ in 0..10 {
        let read = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
        waiters.push(tokio::spawn(collect(read.body)));
    }
    open.send_replace(true);
    for waiter in waiters {
        let err = waiter.await.unwrap().unwrap_err();
        assert!(err.to_string().contains("hashes to"), "{err}");
    }
    downloads_settled(&pt).await;
    assert!(pt.disk().is_empty());
    assert_eq!(tmp_files(&fx), 0);
    assert!(
        !fx.cfg
            .effective_cache_dir()
            .join("blobs/sha256")
            .join(&digest["sha256:".len()..])
            .exists()
    );

    // Once upstream is healthy again the blob is fetched anew and kept.
    fx.up.corrupt.store(false, Ordering::SeqCst);
    let read = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    assert!(collect(read.body).await.unwrap() == content);
    downloads_settled(&pt).await;
    assert_eq!(pt.disk().len(), 1);
    assert_eq!(fx.up.count("GET", "/blobs/"), 2);
}

#[tokio::test]
async fn a_waiter_that_disconnects_does_not_cancel_the_fetch() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(300_000, 5);
    let digest = fx.up.add_blob("lib/x", &content);
    let open = fx.up.hold_after(50_000);
    let pt = fx.cache().await;
    let first = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    let mut body = first.body;
    tokio::time::timeout(PATIENCE, body.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(body);
    let second = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    open.send_replace(true);
    assert!(collect(second.body).await.unwrap() == content);
    downloads_settled(&pt).await;
    assert_eq!(pt.disk().len(), 1);
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
}

#[tokio::test]
async fn upstream_failure_reaches_waiters_and_missing_blobs_are_none() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(1000, 6);
    let digest = fx.up.add_blob("lib/x", &content);
    let pt = fx.cache().await;
    let absent = format!("sha256:{}", "0".repeat(64));
    assert!(pt.blob("lib/x", &absent, None).await.unwrap().is_none());
    assert!(pt.blob_size("lib/x", &absent).await.unwrap().is_none());
    assert!(matches!(
        pt.blob("lib/x", "sha256:nothex", None).await,
        Err(CacheError::Invalid(_))
    ));
    fx.up.fail_status.store(503, Ordering::SeqCst);
    let err = pt.blob("lib/x", &digest, None).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    fx.up.fail_status.store(429, Ordering::SeqCst);
    let err = pt.blob("lib/x", &digest, None).await.unwrap_err();
    assert_eq!(
        err,
        CacheError::RateLimited(err.to_string().replace("upstream rate limit: ", ""))
    );
    assert_eq!(err.error_code(), "TOOMANYREQUESTS");
    downloads_settled(&pt).await;
    assert!(pt.disk().is_empty());
    assert_eq!(tmp_files(&fx), 0);
}

#[tokio::test]
async fn lru_eviction_keeps_the_disk_under_max_bytes() {
    let mut fx = Fixture::new(Upstream::default()).await;
    let size = 100_000;
    fx.cfg.max_bytes = 250_000;
    let digests: Vec<String> = (0..3)
        .map(|i| fx.up.add_blob("lib/x", &pseudo_random(size, 10 + i)))
        .collect();
    let pt = fx.cache().await;
    for digest in &digests {
        let read = pt.blob("lib/x", digest, None).await.unwrap().unwrap();
        collect(read.body).await.unwrap();
        downloads_settled(&pt).await;
        assert!(pt.disk().total_bytes() <= 250_000);
    }
    let hex = |d: &String| d["sha256:".len()..].to_owned();
    assert!(!pt.disk().contains(&hex(&digests[0])), "oldest evicted");
    assert!(pt.disk().contains(&hex(&digests[1])));
    assert!(pt.disk().contains(&hex(&digests[2])));
    let on_disk = std::fs::read_dir(fx.cfg.effective_cache_dir().join("blobs/sha256"))
        .unwrap()
        .count();
    assert_eq!(on_disk, 2);
    // Touch [1]; fetching [0] again must evict [2], the least recently used.
    let read = pt.blob("lib/x", &digests[1], None).await.unwrap().unwrap();
    collect(read.body).await.unwrap();
    let read = pt.blob("lib/x", &digests[0], None).await.unwrap().unwrap();
    collect(read.body).await.unwrap();
    downloads_settled(&pt).await;
    assert!(pt.disk().contains(&hex(&digests[0])));
    assert!(pt.disk().contains(&hex(&digests[1])));
    assert!(!pt.disk().contains(&hex(&digests[2])));
    assert_eq!(fx.up.count("GET", "/blobs/"), 4);
}

#[tokio::test]
async fn a_restart_rebuilds_the_index_from_the_directory() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(200_000, 7);
    let digest = fx.up.add_blob("lib/x", &content);
    {
        let pt = fx.cache().await;
        let read = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
        collect(read.body).await.unwrap();
        downloads_settled(&pt).await;
    }
    // A leftover temp file from a "crash".
    std::fs::write(
        fx.cfg.effective_cache_dir().join("tmp/leftover.part"),
        b"partial",
    )
    .unwrap();
    let pt = fx.cache().await;
    assert_eq!(tmp_files(&fx), 0);
    assert_eq!(pt.disk().len(), 1);
    assert_eq!(pt.disk().total_bytes(), content.len() as u64);
    let read = pt.blob("lib/x", &digest, None).await.unwrap().unwrap();
    assert!(collect(read.body).await.unwrap() == content);
    // Served from disk: upstream was only asked whether the repository holds it.
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
    assert_eq!(fx.up.count("HEAD", "/blobs/"), 1);
    assert_eq!(
        pt.blob_size("lib/x", &digest).await.unwrap(),
        Some(content.len() as u64)
    );
    assert_eq!(fx.up.count("HEAD", "/blobs/"), 1);
}

#[tokio::test]
async fn a_cached_blob_is_not_served_through_a_repository_upstream_denies() {
    let fx = Fixture::new(Upstream::default()).await;
    let content = pseudo_random(10_000, 8);
    let digest = fx.up.add_blob("team/secret", &content);
    let pt = fx.cache().await;
    let read = pt
        .blob("team/secret", &digest, None)
        .await
        .unwrap()
        .unwrap();
    collect(read.body).await.unwrap();
    downloads_settled(&pt).await;
    assert!(
        pt.blob("other/repo", &digest, None)
            .await
            .unwrap()
            .is_none()
    );
    assert!(pt.blob_size("other/repo", &digest).await.unwrap().is_none());
    // Once upstream has it in that repository too, it is served from disk.
    fx.up
        .repo_blobs
        .lock()
        .unwrap()
        .insert(("other/repo".into(), digest.clone()));
    let read = pt.blob("other/repo", &digest, None).await.unwrap().unwrap();
    assert!(collect(read.body).await.unwrap() == content);
    assert_eq!(fx.up.count("GET", "/blobs/"), 1);
}

#[tokio::test]
async fn manifest_blobs_are_linked_so_blob_heads_need_no_upstream() {
    let fx = Fixture::new(Upstream::default()).await;
    let config = fx.up.add_blob("lib/x", b"{}");
    let layer = fx.up.add_blob("lib/x", &pseudo_random(5000, 9));
    fx.up.add_manifest("lib/x", "v1", &config, &[&layer]);
    let pt = fx.cache().await;
    pt.manifest("lib/x", "v1").await.unwrap().unwrap();
    let read = pt.blob("lib/x", &layer, None).await.unwrap().unwrap();
    collect(read.body).await.unwrap();
    downloads_settled(&pt).await;
    assert_eq!(pt.blob_size("lib/x", &layer).await.unwrap(), Some(5000));
    assert_eq!(fx.up.count("HEAD", "/blobs/"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_manifest_misses_fetch_once_and_digests_are_immutable() {
    let fx = Fixture::new(Upstream::default()).await;
    let config = fx.up.add_blob("lib/x", b"{}");
    let digest = fx.up.add_manifest("lib/x", "v1", &config, &[]);
    let pt = Arc::new(fx.cache().await);
    let mut gets = Vec::new();
    for _ in 0..50 {
        let pt = Arc::clone(&pt);
        gets.push(tokio::spawn(
            async move { pt.manifest("lib/x", "v1").await },
        ));
    }
    for get in gets {
        let m = get.await.unwrap().unwrap().unwrap();
        assert_eq!(m.digest, digest);
        assert_eq!(m.media_type, ferry_oci::media::OCI_MANIFEST);
    }
    assert_eq!(fx.up.count("GET", "/manifests/"), 1);
    // By digest: cached from the tag fetch, immutable, served even when upstream is down
    // long after any TTL.
    fx.up.fail_status.store(503, Ordering::SeqCst);
    pt.advance_clock(Duration::from_secs(365 * 86_400));
    let m = pt.manifest("lib/x", &digest).await.unwrap().unwrap();
    assert_eq!(m.digest, digest);
    assert_eq!(fx.up.count("GET", "/manifests/"), 1);
    assert_eq!(fx.up.count("HEAD", "/manifests/"), 0);
    // A missing manifest is None, not an error.
    fx.up.fail_status.store(0, Ordering::SeqCst);
    assert!(pt.manifest("lib/x", "nope").await.unwrap().is_none());
}

#[tokio::test]
async fn tags_are_revalidated_after_the_ttl_with_a_head() {
    let fx = Fixture::new(Upstream::default()).await;
    let config = fx.up.add_blob("lib/x", b"{}");
    let first = fx.up.add_manifest("lib/x", "latest", &config, &[]);
    let pt = fx.cache().await;
    assert_eq!(
        pt.manifest("lib/x", "latest")
            .await
            .unwrap()
            .unwrap()
            .digest,
        first
    );
    // Within the TTL: no upstream request at all.
    pt.advance_clock(Duration::from_secs(30));
    assert_eq!(
        pt.manifest("lib/x", "latest")
            .await
            .unwrap()
            .unwrap()
            .digest,
        first
    );
    assert_eq!(fx.up.count("GET", "/manifests/"), 1);
    assert_eq!(fx.up.count("HEAD", "/manifests/"), 0);
    // Past it: a HEAD says nothing changed, so no GET.
    pt.advance_clock(Duration::from_secs(31));
    assert_eq!(
        pt.manifest("lib/x", "latest")
            .await
            .unwrap()
            .unwrap()
            .digest,
        first
    );
    assert_eq!(fx.up.count("HEAD", "/manifests/"), 1);
    assert_eq!(fx.up.count("GET", "/manifests/"), 1);
    // The revalidation restarted the TTL.
    assert_eq!(
        pt.manifest("lib/x", "latest")
            .await
            .unwrap()
            .unwrap()
            .digest,
        first
    );
    assert_eq!(fx.up.count("HEAD", "/manifests/"), 1);
    // The tag moves upstream: HEAD sees a new digest, GET fetches it.
    let layer = fx.up.add_blob("lib/x", b"layer");
    let second = fx.up.add_manifest("lib/x", "latest", &config, &[&layer]);
    pt.advance_clock(Duration::from_secs(61));
    let m = pt.manifest("lib/x", "latest").await.unwrap().unwrap();
    assert_eq!(m.digest, second);
    assert_eq!(fx.up.count("GET", "/manifests/"), 2);
    // The tag is deleted upstream.
    fx.up
        .tags
        .lock()
        .unwrap()
        .remove(&("lib/x".to_owned(), "latest".to_owned()));
    pt.advance_clock(Duration::from_secs(61));
    assert!(pt.manifest("lib/x", "latest").await.unwrap().is_none());
}

#[tokio::test]
async fn stale_manifest_served_on_503_and_refused_after_the_stale_limit() {
    let mut fx = Fixture::new(Upstream::default()).await;
    fx.cfg.manifest_ttl = Duration::from_secs(60);
    fx.cfg.stale_limit = Duration::from_secs(600);
    let config = fx.up.add_blob("lib/x", b"{}");
    let digest = fx.up.add_manifest("lib/x", "v1", &config, &[]);
    let pt = fx.cache().await;
    pt.manifest("lib/x", "v1").await.unwrap().unwrap();

    fx.up.fail_status.store(503, Ordering::SeqCst);
    pt.advance_clock(Duration::from_secs(61));
    let stale = pt.manifest("lib/x", "v1").await.unwrap().unwrap();
    assert_eq!(stale.digest, digest);
    // Still within ttl + stale_limit.
    pt.advance_clock(Duration::from_secs(500));
    assert!(pt.manifest("lib/x", "v1").await.unwrap().is_some());
    // Past it: the upstream error is returned.
    pt.advance_clock(Duration::from_secs(100));
    let err = pt.manifest("lib/x", "v1").await.unwrap_err();
    assert!(matches!(err, CacheError::Unavailable(_)), "{err}");
    assert_eq!(err.http_status(), 503);
    // 429 behaves the same (and maps to TOOMANYREQUESTS).
    fx.up.fail_status.store(429, Ordering::SeqCst);
    let err = pt.manifest("lib/x", "v1").await.unwrap_err();
    assert_eq!(err.http_status(), 429);
    // Upstream back: fresh again.
    fx.up.fail_status.store(0, Ordering::SeqCst);
    assert_eq!(
        pt.manifest("lib/x", "v1").await.unwrap().unwrap().digest,
        digest
    );
}

/// A TCP forwarder to `target` that can be killed: it stops listening and drops every
/// connection, so the upstream becomes unreachable.
async fn killable_proxy(target: SocketAddr) -> (SocketAddr, watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (kill_tx, kill_rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut kill = kill_rx.clone();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = kill.wait_for(|k| *k) => return,
            };
            let Ok((mut inbound, _)) = accepted else {
                return;
            };
            let mut kill = kill_rx.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = kill.wait_for(|k| *k) => {}
                }
            });
        }
    });
    (addr, kill_tx)
}

#[tokio::test]
async fn stale_copies_served_when_upstream_is_unreachable() {
    let mut fx = Fixture::new(Upstream::default()).await;
    let config = fx.up.add_blob("lib/x", b"{}");
    let digest = fx.up.add_manifest("lib/x", "v1", &config, &[]);
    let upstream_addr: SocketAddr = fx.cfg.url.trim_start_matches("http://").parse().unwrap();
    let (proxy, kill) = killable_proxy(upstream_addr).await;
    fx.cfg.url = format!("http://{proxy}");
    fx.cfg.connect_timeout = Duration::from_secs(5);
    let pt = fx.cache().await;
    pt.manifest("lib/x", "v1").await.unwrap().unwrap();
    assert_eq!(pt.tags("lib/x").await.unwrap().unwrap(), vec!["v1"]);

    kill.send_replace(true);
    pt.advance_clock(Duration::from_secs(120));
    assert_eq!(
        pt.manifest("lib/x", "v1").await.unwrap().unwrap().digest,
        digest
    );
    assert_eq!(pt.tags("lib/x").await.unwrap().unwrap(), vec!["v1"]);
    // Something never fetched has no stale copy: the outage is reported.
    let err = pt.manifest("lib/x", "v2").await.unwrap_err();
    assert!(err.is_upstream_outage(), "{err}");
    assert_eq!(err.http_status(), 503);
    // Past the stale limit (default 1 h) the cached tag is refused too.
    pt.advance_clock(Duration::from_secs(3600));
    assert!(
        pt.manifest("lib/x", "v1")
            .await
            .unwrap_err()
            .is_upstream_outage()
    );
}

#[tokio::test]
async fn tags_and_referrers_pass_through_with_a_short_cache() {
    let fx = Fixture::new(Upstream::default()).await;
    let config = fx.up.add_blob("lib/x", b"{}");
    let digest = fx.up.add_manifest("lib/x", "a", &config, &[]);
    fx.up.add_manifest("lib/x", "b", &config, &[]);
    let pt = fx.cache().await;
    assert_eq!(pt.tags("lib/x").await.unwrap().unwrap(), vec!["a", "b"]);
    assert_eq!(pt.tags("lib/x").await.unwrap().unwrap(), vec!["a", "b"]);
    assert_eq!(fx.up.count("GET", "/tags/list"), 1);
    fx.up.add_manifest("lib/x", "c", &config, &[]);
    pt.advance_clock(Duration::from_secs(11));
    assert_eq!(
        pt.tags("lib/x").await.unwrap().unwrap(),
        vec!["a", "b", "c"]
    );
    assert_eq!(fx.up.count("GET", "/tags/list"), 2);
    assert!(pt.tags("no/such").await.unwrap().is_none());

    let index = pt.referrers("lib/x", &digest).await.unwrap().unwrap();
    let parsed: serde_json::Value = serde_json::from_slice(&index).unwrap();
    assert_eq!(parsed["manifests"], serde_json::json!([]));
    pt.referrers("lib/x", &digest).await.unwrap().unwrap();
    assert_eq!(fx.up.count("GET", "/referrers/"), 1);
}

#[tokio::test]
async fn upstream_credentials_are_used_upstream_only() {
    let up = Upstream {
        credentials: Some(("robot".into(), "s3cret-token".into())),
        ..Upstream::default()
    };
    let fx = Fixture::new(up).await;
    let config = fx.up.add_blob("lib/x", b"{}");
    fx.up.add_manifest("lib/x", "v1", &config, &[]);
    let pt = fx.cache().await;
    let m = pt.manifest("lib/x", "v1").await.unwrap().unwrap();
    assert!(fx.up.saw_authorization.load(Ordering::SeqCst));
    // Nothing handed back to the server carries them.
    assert!(!String::from_utf8_lossy(&m.bytes).contains("s3cret-token"));
    assert!(!format!("{pt:?}").contains("s3cret-token"));

    // Wrong credentials: a DENIED-class error, not a crash or a stale answer.
    let mut cfg = fx.cfg.clone();
    cfg.password = Some("wrong".into());
    let denied = PullThrough::new(&cfg, Metrics::new()).await.unwrap();
    let err = denied.manifest("lib/x", "v1").await.unwrap_err();
    assert!(matches!(err, CacheError::UpstreamDenied(_)), "{err}");
    assert!(!err.to_string().contains("wrong"));
}

#[tokio::test]
async fn namespace_prefixes_upstream_repositories() {
    let mut fx = Fixture::new(Upstream::default()).await;
    fx.cfg.namespace = Some("library".into());
    let config = fx.up.add_blob("library/alpine", b"{}");
    fx.up.add_manifest("library/alpine", "3", &config, &[]);
    let pt = fx.cache().await;
    assert!(pt.manifest("alpine", "3").await.unwrap().is_some());
    assert_eq!(fx.up.count("GET", "/v2/library/alpine/manifests/3"), 1);
}

#[tokio::test]
async fn bad_configs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = UpstreamConfig::new("ftp://example.com");
    cfg.cache_dir = Some(dir.path().to_owned());
    assert!(matches!(
        PullThrough::new(&cfg, Metrics::new()).await,
        Err(CacheError::Config(_))
    ));
    cfg.url = "http://127.0.0.1:5001".into();
    cfg.password = Some("x".into());
    assert!(matches!(
        PullThrough::new(&cfg, Metrics::new()).await,
        Err(CacheError::Config(_))
    ));
}
