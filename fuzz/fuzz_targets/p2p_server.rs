//! Fuzzes the peer server (`[p2p]`) end to end in-process: arbitrary methods, paths,
//! queries, cluster tokens, forwarded registry credentials and `Range` headers through
//! the real router, over a store holding two of a blob's three spans and a registry
//! that lets one credential read the blob in one repository.
//!
//! Placeholders in the input reach the deep paths: `{D}` becomes the blob's digest,
//! `{T}` the cluster token, `{N}` the repository with the right, `{R}` the registry.
//!
//! Asserted: no panic and no 5xx but 503 (busy or timed out); bytes (200/206) only to
//! the cluster token, for the repository, registry and credential with the right, never
//! from the span that has not arrived, and always exactly the blob's bytes at the range
//! the answer names.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use ferry_daemon::p2p::auth::{ClusterToken, PullCheckError, PullGate, PullRights};
use ferry_daemon::p2p::server::{PeerServer, ServerLimits, router};
use ferry_daemon::p2p::{BlobCatalog, P2pStats, REGISTRY_AUTHORIZATION, SpanTable};
use ferry_oci::Digest;
use ferry_registry_client::Repo;
use ferry_store::{ChunkKey, Store, StoreOptions};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const REGISTRY: &str = "reg.example";
const TOKEN: &str = "fuzz-cluster-token-0123456789";
const NAME: &str = "team/app";
const CREDENTIAL: &str = "Bearer alice";
const SPAN: usize = 1000;

#[derive(Debug)]
struct Rights(Digest);

#[async_trait]
impl PullRights for Rights {
    async fn may_pull(
        &self,
        repo: &Repo,
        blob: &Digest,
        authorization: Option<&str>,
    ) -> Result<bool, PullCheckError> {
        Ok(authorization == Some(CREDENTIAL)
            && repo.repository.as_str() == NAME
            && repo.registry == REGISTRY
            && *blob == self.0)
    }
}

struct Fixture {
    rt: tokio::runtime::Runtime,
    router: axum::Router,
    digest: Digest,
    bytes: Vec<u8>,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let store =
            Arc::new(Store::open_with(dir.path(), StoreOptions::default()).expect("store"));
        let bytes: Vec<u8> = (0..3 * SPAN).map(|i| (i * 7 % 251) as u8).collect();
        let digest = ferry_oci::sha256_digest(&bytes);
        let spans: Vec<_> = (0..3)
            .map(|k| {
                let r = (k * SPAN) as u64..((k + 1) * SPAN) as u64;
                (r, ChunkKey::of(&bytes[k * SPAN..(k + 1) * SPAN]))
            })
            .collect();
        // Spans 0 and 1 have arrived; span 2 has not.
        for (r, key) in &spans[..2] {
            store
                .put(key, &bytes[r.start as usize..r.end as usize])
                .expect("put");
        }
        let table = SpanTable::new(bytes.len() as u64, spans).expect("table");
        let catalog = Arc::new(BlobCatalog::new(16));
        catalog.register(digest.clone(), REGISTRY, Arc::new(table));
        let server = PeerServer::new(
            catalog,
            store,
            ClusterToken::new(TOKEN).expect("token"),
            PullGate::new(Arc::new(Rights(digest.clone())), Duration::from_secs(300)),
            ServerLimits {
                max_concurrent: 4,
                request_timeout: Duration::from_secs(5),
                max_range: 1 << 20,
                arrival_wait: Duration::ZERO,
            },
            Arc::new(P2pStats::default()),
        );
        Fixture {
            rt,
            router: router(Arc::new(server)),
            digest,
            bytes,
            _dir: dir,
        }
    })
}

fn expand(f: &Fixture, text: &str) -> String {
    text.replace("{D}", &f.digest.to_string())
        .replace("{T}", TOKEN)
        .replace("{N}", NAME)
        .replace("{R}", REGISTRY)
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Some((&m, rest)) = data.split_first() else {
        return;
    };
    let method = ["GET", "HEAD", "POST", "DELETE", "PUT"][usize::from(m % 5)];
    let text = String::from_utf8_lossy(rest);
    let mut parts = text.splitn(5, '\n').map(|p| expand(f, p));
    let path = parts.next().unwrap_or_default();
    let query = parts.next().unwrap_or_default();
    let token = parts.next();
    let credential = parts.next();
    let range = parts.next();

    let uri = format!("/v2/{path}?{query}");
    let mut req = http::Request::builder().method(method).uri(uri.as_str());
    if let Some(t) = &token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if let Some(c) = &credential {
        req = req.header(REGISTRY_AUTHORIZATION, c.as_str());
    }
    if let Some(r) = &range {
        req = req.header("range", r.as_str());
    }
    let Ok(req) = req.body(Body::empty()) else {
        return; // not a request a client could send
    };
    // What the server sees (a `#` in the input starts a fragment, `?` the query).
    let seen_path = req.uri().path().to_owned();
    let (status, content_range, body) = f.rt.block_on(async {
        let resp = f.router.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let content_range = resp
            .headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, content_range, body)
    });
    assert!(
        !status.is_server_error() || status == http::StatusCode::SERVICE_UNAVAILABLE,
        "{status} for {method} {uri}"
    );
    if !status.is_success() {
        return;
    }
    if seen_path == "/v2/" {
        assert!(body.is_empty(), "the ping carries no bytes");
        return; // only the token check
    }
    assert_eq!(token.as_deref(), Some(TOKEN), "bytes without the cluster token");
    assert_eq!(
        credential.as_deref(),
        Some(CREDENTIAL),
        "bytes without a credential that may pull"
    );
    assert_eq!(
        seen_path,
        format!("/v2/{NAME}/blobs/{}", f.digest),
        "bytes for another name or blob"
    );
    if method == "HEAD" {
        assert!(body.is_empty());
        return;
    }
    let (start, end) = match content_range {
        Some(cr) => {
            let spec = cr.strip_prefix("bytes ").expect("bytes unit");
            let (r, _total) = spec.split_once('/').expect("a total");
            let (a, b) = r.split_once('-').expect("a range");
            (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap() + 1)
        }
        None => (0, f.bytes.len()),
    };
    assert!(end <= 2 * SPAN, "served bytes of the span that has not arrived");
    assert_eq!(&body[..], &f.bytes[start..end], "bytes other than the blob's");
});
