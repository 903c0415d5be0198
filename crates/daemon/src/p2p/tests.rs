//! The peer server and the fetch side against in-memory peers, rights and origins.
//! Refusals are tested from the attacker's side: what a caller without the token,
//! with the wrong one, or without pull rights gets.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use ferry_index::ferryidx::{Checkpoint, Compression, LayerIndex};
use ferry_index::source::{MemSource, RangeSource};
use ferry_oci::Digest;
use ferry_p2p::PeerId;
use ferry_registry_client::Repo;
use ferry_store::{ChunkKey, Store, StoreOptions};
use parking_lot::Mutex;

use super::auth::{ClusterToken, PullCheckError, PullGate, PullRights};
use super::catalog::{BlobCatalog, BlobKind, SpanTable};
use super::fetch::{
    FetcherConfig, OriginCredentials, PeerError, PeerFetcher, PeerRangeSource, PeerRequest,
    PeerTransport,
};
use super::server::{PeerServer, ServerLimits, read_verified};
use super::{P2pStats, REGISTRY_AUTHORIZATION};

pub(super) const REGISTRY: &str = "reg.example";
pub(super) const TOKEN: &str = "cluster-secret-0123456789";
const SPAN: usize = 1000;

/// A blob of three spans of `SPAN` bytes and its table.
fn blob() -> (Vec<u8>, Digest, SpanTable) {
    seeded_blob(0)
}

/// [`blob`]'s shape with other bytes (so another digest, another ranking).
fn seeded_blob(seed: usize) -> (Vec<u8>, Digest, SpanTable) {
    let bytes: Vec<u8> = (0..3 * SPAN)
        .map(|i| ((i * 7 + seed) % 251) as u8)
        .collect();
    let digest = ferry_oci::sha256_digest(&bytes);
    let spans = (0..3)
        .map(|k| {
            let r = (k * SPAN) as u64..((k + 1) * SPAN) as u64;
            let key = ChunkKey::of(&bytes[k * SPAN..(k + 1) * SPAN]);
            (r, key)
        })
        .collect();
    let table = SpanTable::new(bytes.len() as u64, spans).unwrap();
    (bytes, digest, table)
}

/// A gzip layer's index whose three windows (`SPAN` bytes each, from [`seeded_blob`]'s
/// bytes of `seed`) are split out into a windows blob; and the blob's bytes.
fn index_with_windows(seed: usize) -> (LayerIndex, Vec<u8>) {
    let (bytes, _, _) = seeded_blob(seed);
    let mut checkpoints = vec![Checkpoint {
        member_start: true,
        ..Checkpoint::default()
    }];
    for k in 0..3 {
        checkpoints.push(Checkpoint {
            in_offset: (k as u64 + 1) * 100,
            out_offset: (k as u64 + 1) * 1000,
            window_deflate: bytes[k * SPAN..(k + 1) * SPAN].to_vec(),
            ..Checkpoint::default()
        });
    }
    let mut index = LayerIndex {
        layer_digest: ferry_oci::sha256_digest(b"layer").to_string(),
        compression: Compression::Gzip,
        compressed_size: 400,
        uncompressed_size: 4000,
        span_size: 1000,
        checkpoints,
        span_digests: vec![[0; 32]; 4],
        entries: Vec::new(),
        windows: None,
        libraries: Vec::new(),
    };
    let windows = index.split_windows();
    assert_eq!(windows, bytes);
    (index, windows)
}

pub(super) fn repo(name: &str) -> Repo {
    Repo::parse(REGISTRY, name).unwrap()
}

/// The registry's answers: which credential may read which blob in which repository.
#[derive(Debug, Default)]
pub(super) struct Rights {
    allowed: HashSet<(Option<String>, String, Digest)>,
    pub(super) calls: AtomicUsize,
    /// When set, every check waits for it (to hold a server slot in a test).
    hold: Option<Arc<tokio::sync::Notify>>,
    entered: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl PullRights for Rights {
    async fn may_pull(
        &self,
        repo: &Repo,
        blob: &Digest,
        authorization: Option<&str>,
    ) -> Result<bool, PullCheckError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_one();
        if let Some(h) = &self.hold {
            h.notified().await;
        }
        Ok(self.allowed.contains(&(
            authorization.map(str::to_owned),
            repo.repository.as_str().to_owned(),
            blob.clone(),
        )))
    }
}

pub(super) struct Served {
    pub(super) addr: std::net::SocketAddr,
    pub(super) base: String,
    pub(super) digest: Digest,
    pub(super) bytes: Vec<u8>,
    pub(super) rights: Arc<Rights>,
    pub(super) stats: Arc<P2pStats>,
    pub(super) store: Arc<Store>,
    _dir: tempfile::TempDir,
}

/// A peer server holding spans 0 and 1 of [`blob`] (span 2 has not arrived), which the
/// registry lets `Bearer alice` read in `team/app` and `Bearer eve` read nothing of
/// (eve may pull `eve/own`, which does not have this blob).
async fn serve(limits: ServerLimits, hold: Option<Arc<tokio::sync::Notify>>) -> Served {
    serve_with(limits, hold, None).await
}

/// A peer server holding every window of [`index_with_windows`]'s windows blob (the
/// layer itself not at all), which the registry lets `Bearer alice` read in `team/app`.
async fn serve_windows() -> Served {
    let (index, bytes) = index_with_windows(0);
    let (digest, table) = SpanTable::of_windows(&index).unwrap();
    serve_table(limits(), None, None, (bytes, digest, table), 0..3).await
}

/// [`serve`], over TLS with `tls` (handshakes bounded by `tls`'s timeout).
pub(super) async fn serve_with(
    limits: ServerLimits,
    hold: Option<Arc<tokio::sync::Notify>>,
    tls: Option<(super::tls::PeerTls, Duration)>,
) -> Served {
    serve_table(limits, hold, tls, blob(), 0..2).await
}

/// A peer server of blob `digest` (`bytes`, laid out as `table`) holding its pieces
/// `held`, which the registry lets `Bearer alice` read in `team/app` and `Bearer eve`
/// read nothing of.
async fn serve_table(
    limits: ServerLimits,
    hold: Option<Arc<tokio::sync::Notify>>,
    tls: Option<(super::tls::PeerTls, Duration)>,
    (bytes, digest, table): (Vec<u8>, Digest, SpanTable),
    held: Range<usize>,
) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open_with(dir.path(), StoreOptions::default()).unwrap());
    for k in held {
        let (r, key) = table.span(k);
        store
            .put(key, &bytes[r.start as usize..r.end as usize])
            .unwrap();
    }
    let catalog = Arc::new(BlobCatalog::new(16));
    catalog.register(digest.clone(), REGISTRY, Arc::new(table));
    let mut rights = Rights {
        hold,
        ..Rights::default()
    };
    rights.allowed.insert((
        Some("Bearer alice".into()),
        "team/app".into(),
        digest.clone(),
    ));
    let rights = Arc::new(rights);
    let stats = Arc::new(P2pStats::default());
    let server = PeerServer::new(
        catalog,
        store.clone(),
        ClusterToken::new(TOKEN).unwrap(),
        PullGate::new(rights.clone(), Duration::from_secs(300)),
        limits,
        stats.clone(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = super::server::router(Arc::new(server));
    let scheme = match tls {
        Some((tls, timeout)) => {
            let listener = super::tls::TlsListener::new(listener, &tls, timeout).unwrap();
            tokio::spawn(super::server::serve(
                listener,
                router,
                std::future::pending(),
            ));
            "https"
        }
        None => {
            tokio::spawn(super::server::serve(
                listener,
                router,
                std::future::pending(),
            ));
            "http"
        }
    };
    Served {
        addr,
        base: format!("{scheme}://{addr}"),
        digest,
        bytes,
        rights,
        stats,
        store,
        _dir: dir,
    }
}

pub(super) fn limits() -> ServerLimits {
    ServerLimits {
        max_concurrent: 8,
        request_timeout: Duration::from_secs(30),
        max_range: 1 << 20,
        arrival_wait: Duration::ZERO,
    }
}

struct Ask<'a> {
    token: Option<&'a str>,
    credential: Option<&'a str>,
    name: &'a str,
    ns: &'a str,
    range: Option<&'a str>,
}

impl Default for Ask<'_> {
    fn default() -> Self {
        Ask {
            token: Some(TOKEN),
            credential: Some("Bearer alice"),
            name: "team/app",
            ns: REGISTRY,
            range: Some("bytes=0-1999"),
        }
    }
}

async fn get(s: &Served, ask: Ask<'_>) -> (u16, Vec<u8>, Option<String>) {
    let url = format!(
        "{}/v2/{}/blobs/{}?ns={}",
        s.base, ask.name, s.digest, ask.ns
    );
    let mut r = reqwest::Client::new().get(url);
    if let Some(t) = ask.token {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    if let Some(c) = ask.credential {
        r = r.header(REGISTRY_AUTHORIZATION, c);
    }
    if let Some(range) = ask.range {
        r = r.header("range", range);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let content_range = resp
        .headers()
        .get("content-range")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, resp.bytes().await.unwrap().to_vec(), content_range)
}

#[tokio::test]
async fn a_caller_without_the_cluster_token_gets_401() {
    let s = serve(limits(), None).await;
    let (status, body, _) = get(
        &s,
        Ask {
            token: None,
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 401);
    assert!(body.is_empty());
    let wrong = "cluster-secret-0123456788";
    let (status, _, _) = get(
        &s,
        Ask {
            token: Some(wrong),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 401);
    // The token alone, as the registry credential, is not the cluster token either.
    let url = format!("{}/v2/team/app/blobs/{}?ns={REGISTRY}", s.base, s.digest);
    let resp = reqwest::Client::new()
        .get(url)
        .header(REGISTRY_AUTHORIZATION, format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    assert_eq!(s.stats.snapshot().refused_unauthenticated, 3);
    assert_eq!(s.stats.snapshot().bytes_served, 0);
    // Refused before the registry is asked anything.
    assert_eq!(s.rights.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_cluster_member_without_pull_rights_gets_403() {
    let s = serve(limits(), None).await;
    // Anonymous: the registry does not let anonymous callers read team/app.
    let (status, body, _) = get(
        &s,
        Ask {
            credential: None,
            ..Ask::default()
        },
    )
    .await;
    assert_eq!((status, body.is_empty()), (403, true));
    // Eve's own credential, naming the repository she cannot pull.
    let (status, _, _) = get(
        &s,
        Ask {
            credential: Some("Bearer eve"),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 403);
    // Eve names a repository she may pull, to read another repository's blob by digest:
    // the registry is asked about this blob in that repository, and says no.
    let (status, _, _) = get(
        &s,
        Ask {
            credential: Some("Bearer eve"),
            name: "eve/own",
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 403);
    // Alice's credential for a repository the blob is not in: no.
    let (status, _, _) = get(
        &s,
        Ask {
            name: "team/other",
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 403);
    // A registry the blob was not resolved from here cannot vouch for anyone.
    let (status, _, _) = get(
        &s,
        Ask {
            ns: "evil.example",
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(s.stats.snapshot().refused_forbidden, 5);
    assert_eq!(s.stats.snapshot().bytes_served, 0);
}

#[tokio::test]
async fn a_caller_with_pull_rights_gets_verified_bytes_and_the_yes_is_cached() {
    let s = serve(limits(), None).await;
    let (status, body, content_range) = get(&s, Ask::default()).await;
    assert_eq!(status, 206);
    assert_eq!(body, s.bytes[..2000]);
    assert_eq!(content_range.as_deref(), Some("bytes 0-1999/3000"));
    // A range inside spans, across their boundary.
    let (status, body, _) = get(
        &s,
        Ask {
            range: Some("bytes=500-1499"),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 206);
    assert_eq!(body, s.bytes[500..1500]);
    assert_eq!(
        s.rights.calls.load(Ordering::SeqCst),
        1,
        "the second read used the cached yes"
    );
    assert_eq!(s.stats.snapshot().bytes_served, 3000);
    // HEAD says what a registry says.
    let url = format!("{}/v2/team/app/blobs/{}?ns={REGISTRY}", s.base, s.digest);
    let resp = reqwest::Client::new()
        .head(url)
        .header("authorization", format!("Bearer {TOKEN}"))
        .header(REGISTRY_AUTHORIZATION, "Bearer alice")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["content-length"], "3000");
    assert_eq!(
        resp.headers()["docker-content-digest"],
        s.digest.to_string().as_str()
    );
}

#[tokio::test]
async fn windows_are_served_only_to_a_caller_with_pull_rights_on_their_blob() {
    let s = serve_windows().await;
    // Anonymous, and eve (who may pull nothing here): 403 and not a byte.
    for credential in [None, Some("Bearer eve")] {
        let (status, body, _) = get(
            &s,
            Ask {
                credential,
                ..Ask::default()
            },
        )
        .await;
        assert_eq!((status, body.is_empty()), (403, true), "{credential:?}");
    }
    // Without the cluster token: 401, before any pull check.
    let calls = s.rights.calls.load(Ordering::SeqCst);
    let (status, body, _) = get(
        &s,
        Ask {
            token: None,
            ..Ask::default()
        },
    )
    .await;
    assert_eq!((status, body.is_empty()), (401, true));
    assert_eq!(s.rights.calls.load(Ordering::SeqCst), calls);
    let refused = s.stats.snapshot();
    assert_eq!(refused.windows_bytes_served, 0);
    assert_eq!(refused.refused_forbidden, 2);
    // Alice, who may pull the windows blob in team/app: the stored windows, counted as
    // windows.
    let (status, body, content_range) = get(&s, Ask::default()).await;
    assert_eq!(status, 206);
    assert_eq!(body, s.bytes[..2000]);
    assert_eq!(content_range.as_deref(), Some("bytes 0-1999/3000"));
    let served = s.stats.snapshot();
    assert_eq!(
        (served.windows_bytes_served, served.bytes_served),
        (2000, 0)
    );
}

#[test]
fn a_windows_table_is_the_index_s_windows_in_order() {
    let (index, bytes) = index_with_windows(3);
    let (digest, table) = SpanTable::of_windows(&index).unwrap();
    assert_eq!(digest, ferry_oci::sha256_digest(&bytes));
    assert_eq!((table.kind(), table.size()), (BlobKind::Windows, 3000));
    for k in 0..3 {
        let (r, key) = table.span(k);
        assert_eq!(*r, (k * SPAN) as u64..((k + 1) * SPAN) as u64);
        assert_eq!(*key, ChunkKey::of(&bytes[k * SPAN..(k + 1) * SPAN]));
    }
    assert_eq!(table.exactly(&(1000..3000)), Some(1..3));
    // An index without a windows blob (windows inline, or none) has no table.
    let mut inline = index.clone();
    inline.windows = None;
    assert!(SpanTable::of_windows(&inline).is_none());
    // A windows blob that does not hold its windows (a size too small) has none either.
    let mut short = index;
    short.windows.as_mut().unwrap().size = 2999;
    assert!(SpanTable::of_windows(&short).is_none());
}

#[tokio::test]
async fn a_span_arriving_within_the_wait_is_served() {
    // A fleet starting at once: the child asks while the parent's own read is in flight.
    let s = serve(
        ServerLimits {
            arrival_wait: Duration::from_secs(10),
            ..limits()
        },
        None,
    )
    .await;
    let (store, bytes) = (s.store.clone(), s.bytes.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, _, table) = blob();
        let (r, key) = table.span(2);
        store
            .put(key, &bytes[r.start as usize..r.end as usize])
            .unwrap();
    });
    let (status, body, _) = get(
        &s,
        Ask {
            range: Some("bytes=1500-2999"),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 206);
    assert_eq!(body, s.bytes[1500..3000]);
}

#[tokio::test]
async fn a_span_that_does_not_arrive_within_the_wait_is_a_404() {
    let s = serve(
        ServerLimits {
            arrival_wait: Duration::from_millis(50),
            ..limits()
        },
        None,
    )
    .await;
    let start = std::time::Instant::now();
    let (status, body, _) = get(
        &s,
        Ask {
            range: Some("bytes=2000-2999"),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!((status, body.is_empty()), (404, true));
    assert!(start.elapsed() >= Duration::from_millis(50));
}

#[tokio::test]
async fn bytes_not_in_the_store_are_never_served() {
    let s = serve(limits(), None).await;
    // Span 2 has not arrived (or not verified): 404, so the caller goes elsewhere.
    for range in [
        "bytes=2000-2999",
        "bytes=1500-2499",
        "bytes=0-2999",
        "bytes=2999-",
    ] {
        let (status, body, _) = get(
            &s,
            Ask {
                range: Some(range),
                ..Ask::default()
            },
        )
        .await;
        assert_eq!((status, body.is_empty()), (404, true), "{range}");
    }
    // Past the end: 416 with the size, as a registry answers.
    let (status, _, content_range) = get(
        &s,
        Ask {
            range: Some("bytes=3000-3001"),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 416);
    assert_eq!(content_range.as_deref(), Some("bytes */3000"));
    // A blob this node does not serve.
    let other = ferry_oci::sha256_digest(b"other");
    let url = format!("{}/v2/team/app/blobs/{other}?ns={REGISTRY}", s.base);
    let resp = reqwest::Client::new()
        .get(url)
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    // Names that do not parse.
    let url = format!("{}/v2/Team/../blobs/sha256:zz?ns={REGISTRY}", s.base);
    let resp = reqwest::Client::new()
        .get(url)
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    assert_eq!(s.stats.snapshot().bytes_served, 0);
}

#[tokio::test]
async fn a_longer_range_than_the_bound_is_refused() {
    let s = serve(
        ServerLimits {
            max_range: 1000,
            ..limits()
        },
        None,
    )
    .await;
    let (status, _, _) = get(&s, Ask::default()).await;
    assert_eq!(status, 416);
    let (status, _, _) = get(
        &s,
        Ask {
            range: Some("bytes=0-999"),
            ..Ask::default()
        },
    )
    .await;
    assert_eq!(status, 206);
}

#[tokio::test]
async fn requests_beyond_the_bound_get_503() {
    let hold = Arc::new(tokio::sync::Notify::new());
    let s = serve(
        ServerLimits {
            max_concurrent: 1,
            ..limits()
        },
        Some(hold.clone()),
    )
    .await;
    let entered = s.rights.entered.clone();
    let base = s.base.clone();
    let digest = s.digest.clone();
    let first = tokio::spawn(async move {
        let url = format!("{base}/v2/team/app/blobs/{digest}?ns={REGISTRY}");
        reqwest::Client::new()
            .get(url)
            .header("authorization", format!("Bearer {TOKEN}"))
            .header(REGISTRY_AUTHORIZATION, "Bearer alice")
            .header("range", "bytes=0-999")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    // The first request holds the only slot, waiting on the registry.
    entered.notified().await;
    let (status, _, _) = get(&s, Ask::default()).await;
    assert_eq!(status, 503);
    assert_eq!(s.stats.snapshot().refused_busy, 1);
    hold.notify_one();
    assert_eq!(first.await.unwrap(), 206);
}

#[test]
fn a_damaged_store_entry_is_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, _, table) = blob();
    {
        let store = Store::open_with(dir.path(), StoreOptions::default()).unwrap();
        for k in 0..3 {
            let (r, key) = table.span(k);
            store
                .put(key, &bytes[r.start as usize..r.end as usize])
                .unwrap();
        }
        store.close().unwrap();
    }
    // Flip a byte of span 1 on disk; the next process must not trust the file.
    let hex = table.span(1).1.hex();
    let path = dir.path().join("chunks").join(&hex[..2]).join(&hex);
    let mut raw = std::fs::read(&path).unwrap();
    raw[10] ^= 0xff;
    std::fs::write(&path, raw).unwrap();
    let store = Store::open_with(dir.path(), StoreOptions::default()).unwrap();
    assert_eq!(
        read_verified(&store, &table, 0..1000).unwrap(),
        bytes[..1000]
    );
    assert!(read_verified(&store, &table, 500..1500).is_none());
    assert!(read_verified(&store, &table, 1000..2000).is_none());
    assert_eq!(
        read_verified(&store, &table, 2000..3000).unwrap(),
        bytes[2000..]
    );
}

#[test]
fn cluster_tokens_are_checked_whole_and_kept_out_of_debug() {
    assert!(ClusterToken::new("short").is_err());
    assert!(ClusterToken::new("has a space in it, long enough").is_err());
    let t = ClusterToken::new(&format!("  {TOKEN}\n")).unwrap();
    assert!(t.admits(Some(&format!("Bearer {TOKEN}"))));
    assert!(!t.admits(Some(TOKEN)));
    assert!(!t.admits(Some(&format!("Bearer {TOKEN}x"))));
    assert!(!t.admits(Some("Bearer cluster-secret-01234567")));
    assert!(!t.admits(None));
    assert!(!format!("{t:?}").contains("secret"));
}

#[test]
fn a_cached_yes_ends_with_the_credential() {
    use base64::Engine as _;
    let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp":1700000000}"#);
    let expiry = super::auth::credential_expiry(&format!("Bearer e30.{claims}.sig")).unwrap();
    assert_eq!(
        expiry,
        std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    );
    assert_eq!(super::auth::credential_expiry("Basic YTpi"), None);
    assert_eq!(super::auth::credential_expiry("Bearer opaque"), None);
    // A number past the clock's range (a stranger's token): no expiry, and no panic.
    let far =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp":18446744073709551615}"#);
    assert_eq!(
        super::auth::credential_expiry(&format!("Bearer e30.{far}.sig")),
        None
    );
    // An expired credential's yes is not cached at all.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_, digest, _) = blob();
    let mut rights = Rights::default();
    let cred = format!("Bearer e30.{claims}.sig");
    rights
        .allowed
        .insert((Some(cred.clone()), "team/app".into(), digest.clone()));
    let gate = PullGate::new(Arc::new(rights), Duration::from_secs(300));
    assert!(
        rt.block_on(gate.check(&repo("team/app"), &digest, Some(&cred)))
            .unwrap()
    );
    let key = super::auth::PullKey::new(&repo("team/app"), &digest, Some(&cred));
    assert!(!gate.cache().allowed(&key, std::time::Instant::now()));
}

// ---------------------------------------------------------------- fetch side

#[derive(Debug, Clone)]
enum Peer {
    Serves(Vec<u8>),
    Corrupt(Vec<u8>),
    Dead,
    Lacks,
    /// Refuses our pull right (403).
    Refuses,
}

fn refuses(_: Vec<u8>) -> Peer {
    Peer::Refuses
}

fn dead(_: Vec<u8>) -> Peer {
    Peer::Dead
}

fn lacks(_: Vec<u8>) -> Peer {
    Peer::Lacks
}

#[derive(Debug, Default)]
struct MemPeers {
    peers: HashMap<PeerId, Peer>,
    asked: Mutex<Vec<(PeerId, Option<String>)>>,
    /// The blob of each request, in order.
    blobs: Mutex<Vec<Digest>>,
}

#[async_trait]
impl PeerTransport for MemPeers {
    async fn fetch(&self, peer: &PeerId, req: &PeerRequest<'_>) -> Result<Vec<u8>, PeerError> {
        self.asked
            .lock()
            .push((peer.clone(), req.registry_authorization.map(str::to_owned)));
        self.blobs.lock().push(req.blob.clone());
        let r = req.range.start as usize..req.range.end as usize;
        match self.peers.get(peer) {
            Some(Peer::Serves(b)) => Ok(b[r].to_vec()),
            Some(Peer::Corrupt(b)) => {
                let mut v = b[r].to_vec();
                v[0] ^= 1;
                Ok(v)
            }
            Some(Peer::Dead) => std::future::pending().await,
            Some(Peer::Lacks) | None => Err(PeerError::NotHeld),
            Some(Peer::Refuses) => Err(PeerError::Refused(403)),
        }
    }
}

#[derive(Debug)]
struct Creds;

#[async_trait]
impl OriginCredentials for Creds {
    async fn pull_authorization(&self, _repo: &Repo) -> Result<Option<String>, String> {
        Ok(Some("Bearer mine".into()))
    }
}

/// The origin: the blob, counting reads, and the blob beside it when it has one.
struct Origin {
    bytes: MemSource,
    reads: AtomicUsize,
    sibling: Option<(Digest, Arc<Origin>)>,
}

impl Origin {
    fn new(bytes: Vec<u8>) -> Origin {
        Origin {
            bytes: MemSource(bytes),
            reads: AtomicUsize::new(0),
            sibling: None,
        }
    }
}

impl RangeSource for Origin {
    fn len(&self) -> u64 {
        self.bytes.len()
    }
    fn read_range(&self, range: Range<u64>) -> std::io::Result<Vec<u8>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.bytes.read_range(range)
    }
    /// The sibling by digest alone (whatever size is asked for: so a test sees what the
    /// peer routing does with a size the index does not name).
    fn sibling(&self, digest: &str, _size: u64) -> Option<Arc<dyn RangeSource>> {
        let (d, origin) = self.sibling.as_ref()?;
        (d.as_ref() == digest).then(|| origin.clone() as _)
    }
}

struct Fleet {
    source: PeerRangeSource,
    origin: Arc<Origin>,
    fetcher: Arc<PeerFetcher>,
    peers: Arc<MemPeers>,
    bytes: Vec<u8>,
    digest: Digest,
    table: SpanTable,
    /// The candidates of the piece at 0, in order.
    candidates: Vec<PeerId>,
    _rt: tokio::runtime::Runtime,
}

fn fleet_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// This node ("me:1") with two peers, R = 1, F = 1, a piece per span.
fn fleet_config(peer_timeout: Duration) -> FetcherConfig {
    FetcherConfig {
        self_name: "me:1".into(),
        peers: vec!["a:1".into(), "b:1".into()],
        roots: 1,
        fan_out: 1,
        fallbacks: 2,
        piece_size: SPAN as u64,
        peer_timeout,
        penalty: Duration::from_secs(3600),
    }
}

/// The first of `blob(0)`, `blob(1)`, … whose digest (the second of the pair) makes
/// this node the last rank of the piece at 0 (its parent and one fallback are asked, in
/// that order), and those two: which peers are asked depends on the digest's ranking.
fn ranked_last<T>(
    config: &FetcherConfig,
    rt: &tokio::runtime::Runtime,
    blob: impl Fn(usize) -> (T, Digest),
) -> (T, Digest, Vec<PeerId>) {
    let probe = PeerFetcher::new(
        config.clone(),
        Arc::new(MemPeers::default()),
        Arc::new(Creds),
        Arc::new(P2pStats::default()),
        rt.handle().clone(),
    )
    .unwrap();
    (0..)
        .map(blob)
        .map(|(t, d)| {
            let c = probe.candidates(&d, 0);
            (t, d, c)
        })
        .find(|(_, _, c)| c.len() == 2)
        .unwrap()
}

/// [`fleet_config`]'s node and a blob it is the last rank of (see [`ranked_last`]);
/// `behave` says how each of the two peers asked behaves.
fn fleet(behave: &[fn(Vec<u8>) -> Peer], peer_timeout: Duration) -> Fleet {
    let rt = fleet_runtime();
    let config = fleet_config(peer_timeout);
    let ((bytes, table), digest, candidates) = ranked_last(&config, &rt, |seed| {
        let (b, d, t) = seeded_blob(seed);
        ((b, t), d)
    });
    let mut peers = MemPeers::default();
    for (peer, b) in candidates.iter().zip(behave) {
        peers.peers.insert(peer.clone(), b(bytes.clone()));
    }
    let peers = Arc::new(peers);
    let fetcher = Arc::new(
        PeerFetcher::new(
            config,
            peers.clone(),
            Arc::new(Creds),
            Arc::new(P2pStats::default()),
            rt.handle().clone(),
        )
        .unwrap(),
    );
    let origin = Arc::new(Origin::new(bytes.clone()));
    let source = PeerRangeSource::new(
        origin.clone(),
        fetcher.clone(),
        repo("team/app"),
        digest.clone(),
        Arc::new(table.clone()),
    );
    Fleet {
        source,
        origin,
        fetcher,
        peers,
        bytes,
        digest,
        table,
        candidates,
        _rt: rt,
    }
}

fn non_root(behave: &[fn(Vec<u8>) -> Peer], timeout: Duration) -> Fleet {
    fleet(behave, timeout)
}

#[test]
fn a_range_comes_from_the_parent_with_our_credential() {
    let f = non_root(&[Peer::Serves], Duration::from_secs(30));
    assert_eq!(f.source.read_range(0..1000).unwrap(), f.bytes[..1000]);
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 0);
    let asked = f.peers.asked.lock().clone();
    assert_eq!(
        asked,
        vec![(f.candidates[0].clone(), Some("Bearer mine".into()))]
    );
    let s = f.fetcher.stats().snapshot();
    assert_eq!((s.bytes_from_peers, s.fallbacks_to_origin), (1000, 0));
}

#[test]
fn a_corrupt_peer_is_caught_penalised_and_the_origin_used() {
    // Every candidate corrupts: the origin's bytes are what the read gets.
    let f = non_root(&[Peer::Corrupt, Peer::Corrupt], Duration::from_secs(30));
    assert_eq!(f.source.read_range(0..2000).unwrap(), f.bytes[..2000]);
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 1);
    let s = f.fetcher.stats().snapshot();
    assert_eq!(s.peer_corrupt as usize, f.candidates.len());
    assert_eq!(s.fallbacks_to_origin, 1);
    assert_eq!(s.bytes_from_peers, 0);
    for c in &f.candidates {
        assert!(f.fetcher.is_penalised(c));
    }
    // Penalised peers are not asked again.
    let before = f.peers.asked.lock().len();
    f.source.read_range(0..1000).unwrap();
    assert_eq!(f.peers.asked.lock().len(), before);
}

#[test]
fn after_a_corrupt_parent_the_next_candidate_serves() {
    let f = non_root(&[Peer::Corrupt, Peer::Serves], Duration::from_secs(30));
    assert_eq!(f.source.read_range(0..1000).unwrap(), f.bytes[..1000]);
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 0);
    assert!(f.fetcher.is_penalised(&f.candidates[0]));
    assert!(!f.fetcher.is_penalised(&f.candidates[1]));
}

#[test]
fn a_dead_peer_falls_back_to_the_origin_within_the_peer_timeout() {
    let f = non_root(&[dead, dead], Duration::from_millis(50));
    // The read completes (the dead peer never answers) with the origin's bytes.
    assert_eq!(f.source.read_range(0..1000).unwrap(), f.bytes[..1000]);
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 1);
    assert!(f.fetcher.is_penalised(&f.candidates[0]));
    let s = f.fetcher.stats().snapshot();
    assert_eq!((s.peer_failures, s.fallbacks_to_origin), (1, 1));
}

#[test]
fn peers_without_the_range_send_the_read_to_the_origin_unpenalised() {
    let f = non_root(&[lacks, lacks], Duration::from_secs(30));
    assert_eq!(f.source.read_range(0..1000).unwrap(), f.bytes[..1000]);
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 1);
    for c in &f.candidates {
        assert!(!f.fetcher.is_penalised(c));
    }
    assert_eq!(f.fetcher.stats().snapshot().peer_failures, 0);
}

#[test]
fn ranges_that_are_not_whole_spans_and_pieces_we_root_go_to_the_origin() {
    let f = non_root(&[Peer::Serves, Peer::Serves], Duration::from_secs(30));
    // Not whole spans: nothing to verify a peer's bytes against.
    assert_eq!(f.source.read_range(10..990).unwrap(), f.bytes[10..990]);
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 1);
    assert!(f.peers.asked.lock().is_empty());
    // A piece this node is a root of (here every member is a root) is read from the
    // registry, and is not a fallback.
    let roots = Arc::new(
        PeerFetcher::new(
            FetcherConfig {
                self_name: "me:1".into(),
                peers: vec!["a:1".into(), "b:1".into()],
                roots: 3,
                fan_out: 1,
                fallbacks: 2,
                piece_size: SPAN as u64,
                peer_timeout: Duration::from_secs(30),
                penalty: Duration::from_secs(3600),
            },
            f.peers.clone(),
            Arc::new(Creds),
            Arc::new(P2pStats::default()),
            f._rt.handle().clone(),
        )
        .unwrap(),
    );
    assert!(roots.candidates(&f.digest, 0).is_empty());
    let source = PeerRangeSource::new(
        f.origin.clone(),
        roots.clone(),
        repo("team/app"),
        f.digest.clone(),
        Arc::new(f.table.clone()),
    );
    assert_eq!(source.read_range(0..1000).unwrap(), f.bytes[..1000]);
    assert!(f.peers.asked.lock().is_empty());
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 2);
    let s = roots.stats().snapshot();
    assert_eq!((s.fallbacks_to_origin, s.bytes_from_origin), (0, 1000));
}

#[test]
fn span_tables_and_the_catalog_are_bounded_and_exact() {
    let (_, digest, table) = blob();
    assert_eq!(table.exactly(&(0..2000)), Some(0..2));
    assert_eq!(table.exactly(&(0..1999)), None);
    assert_eq!(table.exactly(&(1..1000)), None);
    assert!(
        SpanTable::new(
            10,
            vec![(0..5, ChunkKey::of(b"")), (3..10, ChunkKey::of(b""))]
        )
        .is_none()
    );
    assert!(SpanTable::new(10, vec![(0..11, ChunkKey::of(b""))]).is_none());
    let catalog = BlobCatalog::new(2);
    let t = Arc::new(table);
    catalog.register(digest.clone(), REGISTRY, t.clone());
    assert_eq!(
        catalog.lookup(&digest, "other"),
        super::catalog::Lookup::OtherRegistry
    );
    for i in 0..5u8 {
        catalog.register(ferry_oci::sha256_digest(&[i]), REGISTRY, t.clone());
    }
    assert_eq!(catalog.len(), 2);
}

#[test]
fn spans_sharing_a_byte_as_gzip_checkpoints_do_make_one_table() {
    // A gzip checkpoint that starts mid-byte starts its span at the previous span's
    // last byte: such a layer's spans are routed, verified and served like any.
    let (bytes, _, _) = blob();
    let ranges = [0..1000u64, 999..2000, 1999..3000];
    let spans = ranges
        .iter()
        .map(|r| {
            let piece = &bytes[r.start as usize..r.end as usize];
            (r.clone(), ChunkKey::of(piece))
        })
        .collect();
    let table = SpanTable::new(3000, spans).unwrap();
    assert_eq!(table.exactly(&(0..3000)), Some(0..3));
    assert_eq!(table.exactly(&(999..2000)), Some(1..2));
    assert_eq!(table.exactly(&(1000..2000)), None);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_with(dir.path(), StoreOptions::default()).unwrap();
    for k in 0..3 {
        let (r, key) = table.span(k);
        store
            .put(key, &bytes[r.start as usize..r.end as usize])
            .unwrap();
    }
    assert_eq!(read_verified(&store, &table, 0..3000).unwrap(), bytes);
    assert_eq!(
        read_verified(&store, &table, 500..2500).unwrap(),
        bytes[500..2500]
    );
    // The fewest spans: a byte two share is not a reason to need both.
    assert_eq!(table.covering(&(999..1500)), 1..2);
    assert_eq!(table.covering(&(500..1000)), 0..1);
    assert_eq!(table.covering(&(500..1001)), 0..2);
    assert_eq!(table.covering(&(3000..3001)), 3..3);
    // More than one byte shared, or a span inside its neighbour: not a table.
    let key = ChunkKey::of(b"");
    for bad in [
        vec![(0..1000, key), (998..2000, key)],
        vec![(0..1000, key), (999..1000, key)],
        vec![(5..6, key), (5..10, key)],
    ] {
        assert!(SpanTable::new(3000, bad).is_none());
    }
}

#[test]
fn a_password_is_never_forwarded_to_peers() {
    #[derive(Debug)]
    struct Basic;
    #[async_trait]
    impl OriginCredentials for Basic {
        async fn pull_authorization(&self, _repo: &Repo) -> Result<Option<String>, String> {
            Ok(Some("Basic YWxpY2U6d29uZGVybGFuZA==".into()))
        }
    }
    let f = non_root(&[Peer::Serves, Peer::Serves], Duration::from_secs(30));
    let (digest, table) = (f.digest.clone(), f.table.clone());
    let fetcher = Arc::new(
        PeerFetcher::new(
            FetcherConfig {
                self_name: "me:1".into(),
                peers: vec!["a:1".into(), "b:1".into()],
                roots: 1,
                fan_out: 1,
                fallbacks: 2,
                piece_size: SPAN as u64,
                peer_timeout: Duration::from_secs(30),
                penalty: Duration::from_secs(3600),
            },
            f.peers.clone(),
            Arc::new(Basic),
            Arc::new(P2pStats::default()),
            f._rt.handle().clone(),
        )
        .unwrap(),
    );
    let source = PeerRangeSource::new(
        f.origin.clone(),
        fetcher,
        repo("team/app"),
        digest,
        Arc::new(table),
    );
    assert_eq!(source.read_range(0..1000).unwrap(), f.bytes[..1000]);
    assert!(f.peers.asked.lock().is_empty());
    assert_eq!(f.origin.reads.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------- windows blobs

struct WindowsFleet {
    /// The layer's source, routed through peers with its windows blob.
    layer: PeerRangeSource,
    layer_origin: Arc<Origin>,
    windows_origin: Arc<Origin>,
    fetcher: Arc<PeerFetcher>,
    peers: Arc<MemPeers>,
    /// The windows blob's bytes and digest.
    windows: Vec<u8>,
    digest: Digest,
    /// The candidates of the windows blob's piece at 0, in order.
    candidates: Vec<PeerId>,
    _rt: tokio::runtime::Runtime,
}

/// A peer-routed layer whose index keeps its windows in a windows blob (beside the
/// layer at the origin) of which this node is the last rank at 0, as in [`fleet`];
/// `behave` says how the two peers asked behave, given the windows blob's bytes.
fn windows_fleet(behave: &[fn(Vec<u8>) -> Peer]) -> WindowsFleet {
    let rt = fleet_runtime();
    let config = fleet_config(Duration::from_secs(30));
    let ((index, windows), digest, candidates) = ranked_last(&config, &rt, |seed| {
        let (index, windows) = index_with_windows(seed);
        let digest = ferry_oci::sha256_digest(&windows);
        ((index, windows), digest)
    });
    let (blob_digest, table) = SpanTable::of_windows(&index).unwrap();
    assert_eq!(blob_digest, digest);
    let mut peers = MemPeers::default();
    for (peer, b) in candidates.iter().zip(behave) {
        peers.peers.insert(peer.clone(), b(windows.clone()));
    }
    let peers = Arc::new(peers);
    let fetcher = Arc::new(
        PeerFetcher::new(
            config,
            peers.clone(),
            Arc::new(Creds),
            Arc::new(P2pStats::default()),
            rt.handle().clone(),
        )
        .unwrap(),
    );
    let windows_origin = Arc::new(Origin::new(windows.clone()));
    // (seeded_blob has 251 distinct blobs; the windows' seed is far below 250.)
    let (layer_bytes, layer_digest, layer_table) = seeded_blob(250);
    assert_ne!(layer_digest, digest);
    let layer_origin = Arc::new(Origin {
        sibling: Some((digest.clone(), windows_origin.clone())),
        ..Origin::new(layer_bytes)
    });
    let layer = PeerRangeSource::new(
        layer_origin.clone(),
        fetcher.clone(),
        repo("team/app"),
        layer_digest,
        Arc::new(layer_table),
    )
    .with_windows(digest.clone(), Arc::new(table));
    WindowsFleet {
        layer,
        layer_origin,
        windows_origin,
        fetcher,
        peers,
        windows,
        digest,
        candidates,
        _rt: rt,
    }
}

#[test]
fn a_layers_windows_come_from_a_peer_through_its_sibling() {
    let f = windows_fleet(&[Peer::Serves, Peer::Serves]);
    let windows = f.layer.sibling(f.digest.as_ref(), 3000).unwrap();
    assert_eq!(windows.len(), 3000);
    assert_eq!(windows.read_range(0..2000).unwrap(), f.windows[..2000]);
    assert_eq!(
        windows
            .read_ranges(std::slice::from_ref(&(0..1000)))
            .unwrap(),
        vec![f.windows[..1000].to_vec()]
    );
    // Neither the registry's windows blob nor the layer was read.
    assert_eq!(f.windows_origin.reads.load(Ordering::SeqCst), 0);
    assert_eq!(f.layer_origin.reads.load(Ordering::SeqCst), 0);
    // The parent was asked, for the windows blob, with our credential.
    assert_eq!(*f.peers.blobs.lock(), vec![f.digest.clone(); 2]);
    assert_eq!(
        f.peers.asked.lock()[0],
        (f.candidates[0].clone(), Some("Bearer mine".into()))
    );
    let s = f.fetcher.stats().snapshot();
    assert_eq!(
        (s.windows_bytes_from_peers, s.windows_bytes_from_origin),
        (3000, 0)
    );
    assert_eq!((s.bytes_from_peers, s.fallbacks_to_origin), (0, 0));
    // A blob beside the layer that is not its windows blob as the index names it (here:
    // another size) is the origin's, not routed through peers.
    let unrouted = f.layer.sibling(f.digest.as_ref(), 2999).unwrap();
    assert_eq!(unrouted.read_range(0..1000).unwrap(), f.windows[..1000]);
    assert_eq!(f.windows_origin.reads.load(Ordering::SeqCst), 1);
    assert_eq!(f.peers.asked.lock().len(), 2);
}

#[test]
fn a_peer_serving_corrupt_windows_is_caught_and_the_registry_read() {
    let f = windows_fleet(&[Peer::Corrupt, Peer::Corrupt]);
    let windows = f.layer.sibling(f.digest.as_ref(), 3000).unwrap();
    assert_eq!(windows.read_range(0..2000).unwrap(), f.windows[..2000]);
    assert_eq!(f.windows_origin.reads.load(Ordering::SeqCst), 1);
    let s = f.fetcher.stats().snapshot();
    assert_eq!(s.peer_corrupt as usize, f.candidates.len());
    assert_eq!(s.fallbacks_to_origin, 1);
    assert_eq!(
        (s.windows_bytes_from_peers, s.windows_bytes_from_origin),
        (0, 2000)
    );
    assert_eq!(s.bytes_from_origin, 0);
    for c in &f.candidates {
        assert!(f.fetcher.is_penalised(c));
    }
}

#[test]
fn windows_a_peer_refuses_us_come_from_the_registry_and_the_peer_is_not_penalised() {
    let f = windows_fleet(&[refuses, refuses]);
    let windows = f.layer.sibling(f.digest.as_ref(), 3000).unwrap();
    assert_eq!(windows.read_range(0..1000).unwrap(), f.windows[..1000]);
    assert_eq!(f.windows_origin.reads.load(Ordering::SeqCst), 1);
    assert_eq!(f.peers.asked.lock().len(), 2);
    for c in &f.candidates {
        assert!(!f.fetcher.is_penalised(c));
    }
    let s = f.fetcher.stats().snapshot();
    assert_eq!(
        (s.windows_bytes_from_origin, s.windows_bytes_from_peers),
        (1000, 0)
    );
}
