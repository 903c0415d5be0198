//! End-to-end tests of the HTTP API, driven in process (`tower::ServiceExt::oneshot`) over
//! [`MemoryStorage`], plus real-listener tests over HTTP/1.1, h2c and the filesystem
//! backend.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use sha2::{Digest as _, Sha256};
use tower::ServiceExt;

use super::*;
use crate::auth::{AuthConfig, Authenticator};
use crate::storage::conformance::{td, tr};
use crate::storage::memory::MemoryStorage;
use ferry_oci::media;

/// An answer of the in-process router (also the conformance cases', `suite_tests`).
pub(super) struct Resp {
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
}

impl Resp {
    pub(super) fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    pub(super) fn error_code(&self) -> String {
        self.json()["errors"][0]["code"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

fn digest_of(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// The registry's router over fresh in-memory storage.
pub(super) struct TestApp {
    router: Router,
    state: AppState,
}

pub(super) fn app_with(limits: Limits, cache: MemoryCacheConfig) -> TestApp {
    let storage: Arc<dyn Storage> = Arc::new(MemoryStorage::default());
    let auth = Arc::new(Authenticator::new(&AuthConfig::default()).unwrap());
    let state = AppState::new(storage, auth, None, Metrics::new(), limits, &cache);
    TestApp {
        router: router(state.clone()),
        state,
    }
}

pub(super) fn app() -> TestApp {
    app_with(Limits::default(), MemoryCacheConfig::default())
}

/// Sparse manifests refused: every reference must be in the repository.
pub(super) fn strict_app() -> TestApp {
    app_with(
        Limits {
            sparse_manifests: false,
            ..Limits::default()
        },
        MemoryCacheConfig::default(),
    )
}

/// No in-memory caching at all: every read goes to storage (the streaming paths).
fn uncached_app() -> TestApp {
    app_with(
        Limits::default(),
        MemoryCacheConfig {
            entries: 0,
            small_blob_bytes: 0,
            ..MemoryCacheConfig::default()
        },
    )
}

impl TestApp {
    pub(super) async fn send(
        &self,
        method: Method,
        uri: &str,
        headers: &[(&str, &str)],
        body: impl Into<Body>,
    ) -> Resp {
        let mut req = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = self
            .router
            .clone()
            .oneshot(req.body(body.into()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Resp {
            status,
            headers,
            body,
        }
    }

    pub(super) async fn get(&self, uri: &str) -> Resp {
        self.send(Method::GET, uri, &[], Body::empty()).await
    }

    pub(super) async fn head(&self, uri: &str) -> Resp {
        self.send(Method::HEAD, uri, &[], Body::empty()).await
    }

    async fn push_blob(&self, repo: &str, data: &[u8]) -> String {
        let digest = digest_of(data);
        let r = self
            .send(
                Method::POST,
                &format!("/v2/{repo}/blobs/uploads/?digest={digest}"),
                &[("content-length", &data.len().to_string())],
                data.to_vec(),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
        digest
    }

    async fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        doc: &[u8],
    ) -> Resp {
        self.send(
            Method::PUT,
            &format!("/v2/{repo}/manifests/{reference}"),
            &[("content-type", media_type)],
            doc.to_vec(),
        )
        .await
    }

    /// Pushes a config and one layer and an image manifest tagged `tag`; returns the
    /// manifest digest and bytes.
    async fn push_image(&self, repo: &str, tag: &str, layer: &[u8]) -> (String, Vec<u8>) {
        let config = br#"{"architecture":"amd64","os":"linux"}"#;
        let cd = self.push_blob(repo, config).await;
        let ld = self.push_blob(repo, layer).await;
        let doc = image_manifest(
            media::OCI_CONFIG,
            &cd,
            config.len(),
            &[(ld.as_str(), layer.len())],
            None,
            None,
        );
        let r = self
            .put_manifest(repo, tag, media::OCI_MANIFEST, &doc)
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
        (digest_of(&doc), doc)
    }
    /// Pushes an image's config and `layer` to `repo` as `who` (an `authorization`
    /// value) and returns its manifest, not pushed.
    async fn push_blobs_as(&self, who: &str, repo: &str, layer: &[u8]) -> Vec<u8> {
        let config = br#"{"architecture":"amd64","os":"linux"}"#;
        let mut digests = Vec::new();
        for data in [&config[..], layer] {
            let d = digest_of(data);
            let r = self
                .send(
                    Method::POST,
                    &format!("/v2/{repo}/blobs/uploads/?digest={d}"),
                    &[("authorization", who)],
                    data.to_vec(),
                )
                .await;
            assert_eq!(r.status, StatusCode::CREATED);
            digests.push(d);
        }
        image_manifest(
            media::OCI_CONFIG,
            &digests[0],
            config.len(),
            &[(&digests[1], layer.len())],
            None,
            None,
        )
    }
}

fn image_manifest(
    config_type: &str,
    config_digest: &str,
    config_size: usize,
    layers: &[(&str, usize)],
    subject: Option<(&str, usize)>,
    artifact_type: Option<&str>,
) -> Vec<u8> {
    let layers: Vec<_> = layers
        .iter()
        .map(|(d, s)| serde_json::json!({"mediaType": media::LAYER_TAR_GZIP, "digest": d, "size": s}))
        .collect();
    let mut doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media::OCI_MANIFEST,
        "config": {"mediaType": config_type, "digest": config_digest, "size": config_size},
        "layers": layers,
    });
    if let Some((d, s)) = subject {
        doc["subject"] =
            serde_json::json!({"mediaType": media::OCI_MANIFEST, "digest": d, "size": s});
    }
    if let Some(at) = artifact_type {
        doc["artifactType"] = serde_json::json!(at);
        doc["annotations"] = serde_json::json!({"org.example.kind": at});
    }
    serde_json::to_vec(&doc).unwrap()
}

// ---------------------------------------------------------------- base, routing, names

#[tokio::test]
async fn base_endpoint() {
    let t = app();
    let r = t.get("/v2/").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"{}");
    assert_eq!(r.header("docker-distribution-api-version"), "registry/2.0");
    let r = t.send(Method::HEAD, "/v2/", &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.is_empty());
    let r = t.send(Method::POST, "/v2/", &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.error_code(), "UNSUPPORTED");
    assert_eq!(r.header("allow"), "GET, HEAD");
}

#[tokio::test]
async fn unknown_routes_are_json_404() {
    let t = app();
    for uri in ["/nope", "/v2/x/whatever/y", "/v3/", "/v2/x"] {
        let r = t.get(uri).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{uri}");
        assert_eq!(r.header("content-type"), "application/json");
        assert!(!r.error_code().is_empty());
    }
    let r = t
        .send(Method::PATCH, "/v2/x/manifests/latest", &[], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.error_code(), "UNSUPPORTED");
}

#[tokio::test]
async fn path_tricks_are_name_invalid() {
    let t = app();
    for uri in [
        "/v2/../etc/manifests/latest",
        "/v2/a/../b/manifests/latest",
        "/v2/a/%2e%2e/b/manifests/latest",
        "/v2/%2e%2e/blobs/uploads/",
        "/v2/a//b/tags/list",
        "/v2/Upper/tags/list",
        "/v2/a..b/tags/list",
        "/v2/./tags/list",
        "/v2//manifests/latest",
    ] {
        let r = t.get(uri).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(r.error_code(), "NAME_INVALID", "{uri}");
    }
    let r = t
        .send(
            Method::POST,
            "/v2/a/%2e%2e/blobs/uploads/",
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.error_code(), "NAME_INVALID");
    // Nothing was created.
    let r = t.get("/v2/_catalog").await;
    assert_eq!(r.json()["repositories"], serde_json::json!([]));
}

#[tokio::test]
async fn bad_digests() {
    let t = app();
    // sha384 is a valid digest of an algorithm content is not stored under.
    let sha384 = format!("sha384:{}", "a".repeat(96));
    for d in ["sha256:zz", "nope", sha384.as_str(), "sha256:ABC"] {
        let r = t.get(&format!("/v2/r/blobs/{d}")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{d}");
        assert_eq!(r.error_code(), "DIGEST_INVALID", "{d}");
    }
    let r = t
        .send(
            Method::POST,
            "/v2/r/blobs/uploads/?digest=sha256:1234",
            &[],
            "x",
        )
        .await;
    assert_eq!(r.error_code(), "DIGEST_INVALID");
}

// ---------------------------------------------------------------- blobs

#[tokio::test]
async fn monolithic_push_and_pull() {
    for t in [app(), uncached_app()] {
        let data = b"hello layer";
        let digest = t.push_blob("lib/app", data).await;
        let r = t.get(&format!("/v2/lib/app/blobs/{digest}")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], data);
        assert_eq!(r.header("docker-content-digest"), digest);
        assert_eq!(r.header("content-length"), data.len().to_string());
        assert_eq!(r.header("accept-ranges"), "bytes");
        let r = t
            .send(
                Method::HEAD,
                &format!("/v2/lib/app/blobs/{digest}"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.body.is_empty());
        assert_eq!(r.header("content-length"), data.len().to_string());
        // Another repository does not link it: not served there.
        let r = t.get(&format!("/v2/other/blobs/{digest}")).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.error_code(), "BLOB_UNKNOWN");
        // Unknown blob.
        let r = t
            .get(&format!("/v2/lib/app/blobs/{}", digest_of(b"nope")))
            .await;
        assert_eq!(r.error_code(), "BLOB_UNKNOWN");
    }
}

#[tokio::test]
async fn monolithic_push_with_wrong_digest_stores_nothing() {
    let t = app();
    let wrong = digest_of(b"something else");
    let r = t
        .send(
            Method::POST,
            &format!("/v2/r/blobs/uploads/?digest={wrong}"),
            &[],
            "actual content",
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error_code(), "DIGEST_INVALID");
    assert_eq!(
        t.state.storage().blob_size(&td(&wrong)).await.unwrap(),
        None
    );
    let actual = digest_of(b"actual content");
    assert_eq!(
        t.state.storage().blob_size(&td(&actual)).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn ranges() {
    for t in [app(), uncached_app()] {
        let data: Vec<u8> = (0..100u8).collect();
        let digest = t.push_blob("r", &data).await;
        let uri = format!("/v2/r/blobs/{digest}");
        let get = |range: &'static str| {
            let t = &t;
            let uri = uri.clone();
            async move {
                t.send(Method::GET, &uri, &[("range", range)], Body::empty())
                    .await
            }
        };
        let r = get("bytes=0-3").await;
        assert_eq!(r.status, StatusCode::PARTIAL_CONTENT);
        assert_eq!(&r.body[..], &data[0..4]);
        assert_eq!(r.header("content-range"), "bytes 0-3/100");
        assert_eq!(r.header("content-length"), "4");
        let r = get("bytes=90-").await;
        assert_eq!(r.status, StatusCode::PARTIAL_CONTENT);
        assert_eq!(&r.body[..], &data[90..]);
        assert_eq!(r.header("content-range"), "bytes 90-99/100");
        let r = get("bytes=-5").await;
        assert_eq!(&r.body[..], &data[95..]);
        assert_eq!(r.header("content-range"), "bytes 95-99/100");
        let r = get("bytes=50-1000").await;
        assert_eq!(&r.body[..], &data[50..]);
        let r = get("bytes=100-").await;
        assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(r.header("content-range"), "bytes */100");
        // Several ranges in order and apart: one multipart answer, both cached and not.
        let r = get("bytes=0-1,5-6,-3").await;
        assert_eq!(r.status, StatusCode::PARTIAL_CONTENT);
        let boundary = ferry_registry_client::byteranges::boundary(r.header("content-type"))
            .expect("multipart/byteranges")
            .to_string();
        assert_eq!(r.header("content-length"), r.body.len().to_string());
        let parts = ferry_registry_client::byteranges::parse(&r.body, &boundary).unwrap();
        let asked = [0..2, 5..7, 97..100];
        let got = ferry_registry_client::byteranges::slices(&asked, &parts, &r.body).unwrap();
        for (a, g) in asked.iter().zip(got) {
            assert_eq!(g, &data[a.start as usize..a.end as usize]);
        }
        assert_eq!(parts.len(), 3, "one part per range");
        // Overlapping, out of order, or touching: the whole blob.
        for several in ["bytes=0-5,3-8", "bytes=5-6,0-1", "bytes=0-49,50-99"] {
            let r = get(several).await;
            assert_eq!(r.status, StatusCode::OK, "{several}");
            assert_eq!(&r.body[..], &data[..]);
        }
        let r = t
            .send(
                Method::HEAD,
                &uri,
                &[("range", "bytes=10-19")],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::PARTIAL_CONTENT);
        assert_eq!(r.header("content-length"), "10");
        assert!(r.body.is_empty());
    }
}

#[tokio::test]
async fn chunked_upload_in_order_and_out_of_order() {
    let t = app();
    let r = t
        .send(Method::POST, "/v2/c/blobs/uploads/", &[], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    assert_eq!(r.header("range"), "0-0");
    let location = r.header("location").to_string();
    let id = r.header("docker-upload-uuid").to_string();
    assert_eq!(location, format!("/v2/c/blobs/uploads/{id}"));

    let r = t
        .send(
            Method::PATCH,
            &location,
            &[("content-range", "0-4"), ("content-length", "5")],
            "01234",
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    assert_eq!(r.header("range"), "0-4");
    assert_eq!(r.header("location"), location);

    // A chunk that skips ahead is refused with the current range.
    let r = t
        .send(
            Method::PATCH,
            &location,
            &[("content-range", "10-14")],
            "abcde",
        )
        .await;
    assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(r.header("range"), "0-4");
    assert_eq!(r.error_code(), "BLOB_UPLOAD_INVALID");
    // So is one that repeats.
    let r = t
        .send(
            Method::PATCH,
            &location,
            &[("content-range", "0-4")],
            "01234",
        )
        .await;
    assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE);
    // Content-Length disagreeing with Content-Range.
    let r = t
        .send(
            Method::PATCH,
            &location,
            &[("content-range", "5-9"), ("content-length", "3")],
            "567",
        )
        .await;
    assert_eq!(r.error_code(), "SIZE_INVALID");

    let r = t
        .send(
            Method::PATCH,
            &location,
            &[("content-range", "5-9")],
            "56789",
        )
        .await;
    assert_eq!(r.header("range"), "0-9");

    let r = t.get(&location).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(r.header("range"), "0-9");

    // Final chunk with the PUT.
    let digest = digest_of(b"0123456789XYZ");
    let r = t
        .send(
            Method::PUT,
            &format!("{location}?digest={digest}"),
            &[("content-range", "10-12")],
            "XYZ",
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    assert_eq!(r.header("docker-content-digest"), digest);
    assert_eq!(r.header("location"), format!("/v2/c/blobs/{digest}"));
    let r = t.get(&format!("/v2/c/blobs/{digest}")).await;
    assert_eq!(&r.body[..], b"0123456789XYZ");
    // The session is gone.
    let r = t.get(&location).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN");
}

#[tokio::test]
async fn streamed_upload_then_empty_put() {
    let t = app();
    let r = t
        .send(Method::POST, "/v2/s/blobs/uploads/", &[], Body::empty())
        .await;
    let location = r.header("location").to_string();
    let r = t.send(Method::PATCH, &location, &[], "streamed ").await;
    assert_eq!(r.header("range"), "0-8");
    let r = t.send(Method::PATCH, &location, &[], "body").await;
    assert_eq!(r.header("range"), "0-12");
    let digest = digest_of(b"streamed body");
    let r = t
        .send(
            Method::PUT,
            &format!("{location}?digest={digest}"),
            &[("content-length", "0")],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = t.get(&format!("/v2/s/blobs/{digest}")).await;
    assert_eq!(&r.body[..], b"streamed body");
}

#[tokio::test]
async fn put_with_wrong_digest_fails_and_drops_session() {
    let t = app();
    let r = t
        .send(Method::POST, "/v2/w/blobs/uploads/", &[], Body::empty())
        .await;
    let location = r.header("location").to_string();
    t.send(Method::PATCH, &location, &[], "data").await;
    let wrong = digest_of(b"other");
    let r = t
        .send(
            Method::PUT,
            &format!("{location}?digest={wrong}"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error_code(), "DIGEST_INVALID");
    let r = t.get(&format!("/v2/w/blobs/{wrong}")).await;
    assert_eq!(r.error_code(), "BLOB_UNKNOWN");
    // Missing digest parameter.
    let r = t
        .send(Method::POST, "/v2/w/blobs/uploads/", &[], Body::empty())
        .await;
    let location = r.header("location").to_string();
    let r = t.send(Method::PUT, &location, &[], Body::empty()).await;
    assert_eq!(r.error_code(), "DIGEST_INVALID");
}

#[tokio::test]
async fn cancel_and_unknown_uploads() {
    let t = app();
    let r = t
        .send(Method::POST, "/v2/x/blobs/uploads/", &[], Body::empty())
        .await;
    let location = r.header("location").to_string();
    let r = t.send(Method::DELETE, &location, &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = t.send(Method::DELETE, &location, &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN");
    for id in ["0123456789abcdef0123456789abcdef", "not-an-id"] {
        let r = t
            .send(
                Method::PATCH,
                &format!("/v2/x/blobs/uploads/{id}"),
                &[],
                "z",
            )
            .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{id}");
        assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN");
    }
}

#[tokio::test]
async fn upload_sessions_belong_to_their_repository() {
    let t = app();
    let r = t
        .send(
            Method::POST,
            "/v2/team/a/blobs/uploads/",
            &[],
            Body::empty(),
        )
        .await;
    let location = r.header("location").to_string();
    let id = location.rsplit('/').next().unwrap().to_string();
    let elsewhere = format!("/v2/team/b/blobs/uploads/{id}");
    for method in [Method::GET, Method::PATCH, Method::PUT, Method::DELETE] {
        let r = t.send(method.clone(), &elsewhere, &[], "z").await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{method}");
        assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN", "{method}");
    }
    // The owner's session is untouched by those attempts.
    let r = t.send(Method::GET, &location, &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(r.header("range"), "0-0");
}

#[tokio::test]
async fn cross_repository_mount() {
    let t = app();
    let digest = t.push_blob("src", b"shared layer").await;
    let r = t
        .send(
            Method::POST,
            &format!("/v2/dst/blobs/uploads/?mount={digest}&from=src"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.header("location"), format!("/v2/dst/blobs/{digest}"));
    assert_eq!(r.header("docker-content-digest"), digest);
    let r = t.get(&format!("/v2/dst/blobs/{digest}")).await;
    assert_eq!(&r.body[..], b"shared layer");

    // Source does not link it: fall back to an upload session.
    let unknown = digest_of(b"never pushed");
    for uri in [
        format!("/v2/dst2/blobs/uploads/?mount={digest}&from=elsewhere"),
        format!("/v2/dst2/blobs/uploads/?mount={unknown}&from=src"),
        format!("/v2/dst2/blobs/uploads/?mount={digest}"),
        format!("/v2/dst2/blobs/uploads/?mount={digest}&from=BAD..name"),
    ] {
        let r = t.send(Method::POST, &uri, &[], Body::empty()).await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{uri}");
        assert!(r.header("location").starts_with("/v2/dst2/blobs/uploads/"));
    }
    let r = t.get(&format!("/v2/dst2/blobs/{digest}")).await;
    assert_eq!(r.error_code(), "BLOB_UNKNOWN");
}

#[tokio::test]
async fn oversized_bodies_are_refused() {
    let limits = Limits {
        max_blob_bytes: 16,
        max_manifest_bytes: 64,
        ..Limits::default()
    };
    let t = app_with(limits, MemoryCacheConfig::default());
    let big = vec![7u8; 17];
    let digest = digest_of(&big);
    // Declared too large: refused before reading.
    let r = t
        .send(
            Method::POST,
            &format!("/v2/o/blobs/uploads/?digest={digest}"),
            &[("content-length", "17")],
            big.clone(),
        )
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.error_code(), "SIZE_INVALID");
    // Streamed without a length: refused by the storage bound.
    let stream =
        futures_util::stream::iter(vec![Ok::<_, std::io::Error>(Bytes::from(big.clone()))]);
    let r = t
        .send(
            Method::POST,
            &format!("/v2/o/blobs/uploads/?digest={digest}"),
            &[],
            Body::from_stream(stream),
        )
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    // Chunked: the session may not grow past the limit, and is cleaned up.
    let r = t
        .send(Method::POST, "/v2/o/blobs/uploads/", &[], Body::empty())
        .await;
    let location = r.header("location").to_string();
    let r = t.send(Method::PATCH, &location, &[], vec![1u8; 10]).await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    let r = t.send(Method::PATCH, &location, &[], vec![1u8; 10]).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    let r = t.get(&location).await;
    assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN");
    // Manifests over their own limit.
    let doc = vec![b' '; 65];
    let r = t
        .put_manifest("o", "latest", media::OCI_MANIFEST, &doc)
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.error_code(), "MANIFEST_INVALID");
    assert_eq!(t.state.storage().tag_list(&tr("o")).await.unwrap(), None);
}

#[tokio::test]
async fn stalled_upload_body_times_out_and_is_cancelled() {
    let limits = Limits {
        body_idle_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let t = app_with(limits, MemoryCacheConfig::default());
    let r = t
        .send(Method::POST, "/v2/slow/blobs/uploads/", &[], Body::empty())
        .await;
    let location = r.header("location").to_string();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tx.send(Ok(Bytes::from_static(b"first bytes")))
        .await
        .unwrap();
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    // The sender stays alive but sends nothing more: the body stalls.
    let r = t
        .send(Method::PATCH, &location, &[], Body::from_stream(stream))
        .await;
    assert_eq!(r.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(r.error_code(), "BLOB_UPLOAD_INVALID");
    let r = t.get(&location).await;
    assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN");
    drop(tx);
}

// ---------------------------------------------------------------- manifests

#[tokio::test]
async fn manifest_push_pull_by_tag_and_digest() {
    for t in [app(), uncached_app()] {
        let (digest, doc) = t.push_image("lib/img", "v1", b"layer-bytes").await;
        for reference in ["v1", digest.as_str()] {
            let r = t.get(&format!("/v2/lib/img/manifests/{reference}")).await;
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(&r.body[..], &doc[..]);
            assert_eq!(r.header("content-type"), media::OCI_MANIFEST);
            assert_eq!(r.header("docker-content-digest"), digest);
            assert_eq!(r.header("etag"), format!("\"{digest}\""));
            let r = t
                .send(
                    Method::HEAD,
                    &format!("/v2/lib/img/manifests/{reference}"),
                    &[],
                    Body::empty(),
                )
                .await;
            assert_eq!(r.status, StatusCode::OK);
            assert!(r.body.is_empty());
            assert_eq!(r.header("content-length"), doc.len().to_string());
        }
        let etag = format!("\"{digest}\"");
        let r = t
            .send(
                Method::GET,
                "/v2/lib/img/manifests/v1",
                &[("if-none-match", &etag)],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::NOT_MODIFIED);
        let r = t.get("/v2/lib/img/manifests/v2").await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.error_code(), "MANIFEST_UNKNOWN");
        let r = t.get("/v2/lib/img/manifests/.bad").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        // Not pullable through a repository that does not hold it.
        let r = t.get(&format!("/v2/other/manifests/{digest}")).await;
        assert_eq!(r.error_code(), "MANIFEST_UNKNOWN");
    }
}

#[tokio::test]
async fn manifest_put_response_headers() {
    let t = app();
    let config = b"{}";
    let cd = t.push_blob("h", config).await;
    let doc = image_manifest(media::OCI_CONFIG, &cd, 2, &[], None, None);
    let digest = digest_of(&doc);
    let r = t
        .put_manifest("h", &digest, media::OCI_MANIFEST, &doc)
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.header("location"), format!("/v2/h/manifests/{digest}"));
    assert_eq!(r.header("docker-content-digest"), digest);
    assert_eq!(r.header("oci-subject"), "");
}

#[tokio::test]
async fn manifest_validation() {
    let t = strict_app();
    let config = br#"{"os":"linux"}"#;
    let cd = t.push_blob("v", config).await;
    let missing = digest_of(b"missing layer");
    // Layer not in the repository.
    let doc = image_manifest(
        media::OCI_CONFIG,
        &cd,
        config.len(),
        &[(&missing, 13)],
        None,
        None,
    );
    let r = t.put_manifest("v", "t", media::OCI_MANIFEST, &doc).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "MANIFEST_BLOB_UNKNOWN");
    // Config pushed to another repository only.
    let other_cfg = t.push_blob("elsewhere", b"{\"x\":1}").await;
    let doc = image_manifest(media::OCI_CONFIG, &other_cfg, 7, &[], None, None);
    let r = t.put_manifest("v", "t", media::OCI_MANIFEST, &doc).await;
    assert_eq!(r.error_code(), "MANIFEST_BLOB_UNKNOWN");
    // Wrong size for a known blob.
    let doc = image_manifest(media::OCI_CONFIG, &cd, config.len() + 1, &[], None, None);
    let r = t.put_manifest("v", "t", media::OCI_MANIFEST, &doc).await;
    assert_eq!(r.error_code(), "MANIFEST_INVALID");
    // Content-Type disagreeing with mediaType.
    let doc = image_manifest(media::OCI_CONFIG, &cd, config.len(), &[], None, None);
    let r = t.put_manifest("v", "t", media::OCI_INDEX, &doc).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error_code(), "MANIFEST_INVALID");
    // Not JSON.
    let r = t
        .put_manifest("v", "t", media::OCI_MANIFEST, b"{not json")
        .await;
    assert_eq!(r.error_code(), "MANIFEST_INVALID");
    // PUT by a digest that is not the content's.
    let r = t
        .put_manifest("v", &digest_of(b"other"), media::OCI_MANIFEST, &doc)
        .await;
    assert_eq!(r.error_code(), "DIGEST_INVALID");
    // Invalid tag.
    let r = t.put_manifest("v", "-bad", media::OCI_MANIFEST, &doc).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Nothing above was stored.
    assert!(
        t.state
            .storage()
            .manifest_list(&tr("v"))
            .await
            .unwrap()
            .is_empty()
    );
    // Non-distributable layers need not be present.
    let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    v["layers"] = serde_json::json!([{
        "mediaType": "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "digest": missing, "size": 13, "urls": ["https://example.com/layer"]
    }]);
    let doc2 = serde_json::to_vec(&v).unwrap();
    let r = t
        .put_manifest("v", "foreign", media::OCI_MANIFEST, &doc2)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    // The well-known empty config is created on demand.
    let empty = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";
    let doc3 = image_manifest(
        media::OCI_EMPTY,
        empty,
        2,
        &[],
        None,
        Some("application/vnd.example"),
    );
    let r = t
        .put_manifest("v", "artifact", media::OCI_MANIFEST, &doc3)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let r = t.get(&format!("/v2/v/blobs/{empty}")).await;
    assert_eq!(&r.body[..], b"{}");
}

#[tokio::test]
async fn image_index_children_must_exist() {
    let t = strict_app();
    let (child, doc) = t.push_image("idx", "amd64", b"l1").await;
    let index = |d: &str, size: usize| {
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": media::OCI_INDEX,
            "manifests": [{"mediaType": media::OCI_MANIFEST, "digest": d, "size": size,
                           "platform": {"architecture": "amd64", "os": "linux"}}],
        }))
        .unwrap()
    };
    let unknown = digest_of(b"no such manifest");
    let r = t
        .put_manifest("idx", "multi", media::OCI_INDEX, &index(&unknown, 10))
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "MANIFEST_UNKNOWN");
    let good = index(&child, doc.len());
    let r = t
        .put_manifest("idx", "multi", media::OCI_INDEX, &good)
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = t.get("/v2/idx/manifests/multi").await;
    assert_eq!(r.header("content-type"), media::OCI_INDEX);
    assert_eq!(&r.body[..], &good[..]);
    // A child in another repository does not count.
    let r = t
        .put_manifest("idx2", "multi", media::OCI_INDEX, &good)
        .await;
    assert_eq!(r.error_code(), "MANIFEST_UNKNOWN");
}

#[tokio::test]
async fn deletes() {
    let t = app();
    let (digest, _) = t.push_image("d", "v1", b"layer").await;
    let r = t
        .send(
            Method::PUT,
            "/v2/d/manifests/v2",
            &[("content-type", media::OCI_MANIFEST)],
            t.get("/v2/d/manifests/v1").await.body,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    // Delete a tag: the other tag and the manifest stay.
    let r = t
        .send(Method::DELETE, "/v2/d/manifests/v1", &[], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    assert_eq!(
        t.get("/v2/d/manifests/v1").await.error_code(),
        "MANIFEST_UNKNOWN"
    );
    assert_eq!(t.get("/v2/d/manifests/v2").await.status, StatusCode::OK);
    let r = t
        .send(Method::DELETE, "/v2/d/manifests/v1", &[], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // Delete by digest: the manifest and its remaining tag go.
    let r = t
        .send(
            Method::DELETE,
            &format!("/v2/d/manifests/{digest}"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    assert_eq!(
        t.get(&format!("/v2/d/manifests/{digest}")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        t.get("/v2/d/manifests/v2").await.status,
        StatusCode::NOT_FOUND
    );
    // Delete a blob link.
    let layer = digest_of(b"layer");
    assert_eq!(
        t.get(&format!("/v2/d/blobs/{layer}")).await.status,
        StatusCode::OK
    );
    let r = t
        .send(
            Method::DELETE,
            &format!("/v2/d/blobs/{layer}"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    assert_eq!(
        t.get(&format!("/v2/d/blobs/{layer}")).await.error_code(),
        "BLOB_UNKNOWN"
    );
    let r = t
        .send(
            Method::DELETE,
            &format!("/v2/d/blobs/{layer}"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

// ---------------------------------------------------------------- discovery

#[tokio::test]
async fn tag_list_pagination() {
    let t = app();
    let (_, doc) = t.push_image("p", "t0", b"x").await;
    for tag in ["t1", "t2", "t3", "t4"] {
        let r = t.put_manifest("p", tag, media::OCI_MANIFEST, &doc).await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let r = t.get("/v2/p/tags/list").await;
    assert_eq!(r.json()["name"], "p");
    assert_eq!(
        r.json()["tags"],
        serde_json::json!(["t0", "t1", "t2", "t3", "t4"])
    );
    assert_eq!(r.header("link"), "");
    let r = t.get("/v2/p/tags/list?n=2").await;
    assert_eq!(r.json()["tags"], serde_json::json!(["t0", "t1"]));
    assert_eq!(
        r.header("link"),
        "</v2/p/tags/list?n=2&last=t1>; rel=\"next\""
    );
    let r = t.get("/v2/p/tags/list?n=2&last=t1").await;
    assert_eq!(r.json()["tags"], serde_json::json!(["t2", "t3"]));
    let r = t.get("/v2/p/tags/list?n=2&last=t3").await;
    assert_eq!(r.json()["tags"], serde_json::json!(["t4"]));
    assert_eq!(r.header("link"), "");
    let r = t.get("/v2/p/tags/list?n=0").await;
    assert_eq!(r.json()["tags"], serde_json::json!([]));
    let r = t.get("/v2/p/tags/list?n=abc").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = t.get("/v2/nope/tags/list").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "NAME_UNKNOWN");
}

#[tokio::test]
async fn catalog_pagination() {
    let t = app();
    for repo in ["a", "b/c", "d"] {
        t.push_blob(repo, repo.as_bytes()).await;
    }
    let r = t.get("/v2/_catalog").await;
    assert_eq!(
        r.json()["repositories"],
        serde_json::json!(["a", "b/c", "d"])
    );
    let r = t.get("/v2/_catalog?n=2").await;
    assert_eq!(r.json()["repositories"], serde_json::json!(["a", "b/c"]));
    assert_eq!(
        r.header("link"),
        "</v2/_catalog?n=2&last=b%2Fc>; rel=\"next\""
    );
    let r = t.get("/v2/_catalog?n=2&last=b%2Fc").await;
    assert_eq!(r.json()["repositories"], serde_json::json!(["d"]));
    assert_eq!(r.header("link"), "");
}

#[tokio::test]
async fn referrers_api() {
    let t = app();
    let (subject, subject_doc) = t.push_image("ref", "v1", b"base layer").await;
    let empty = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";
    // An artifact with an explicit artifactType.
    let sig = image_manifest(
        media::OCI_EMPTY,
        empty,
        2,
        &[],
        Some((&subject, subject_doc.len())),
        Some("application/vnd.example.signature"),
    );
    let sig_digest = digest_of(&sig);
    let r = t
        .put_manifest("ref", &sig_digest, media::OCI_MANIFEST, &sig)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    assert_eq!(r.header("oci-subject"), subject);
    // One whose type comes from its config media type.
    let cfg = t.push_blob("ref", b"{\"sbom\":1}").await;
    let sbom = image_manifest(
        "application/vnd.example.sbom",
        &cfg,
        10,
        &[],
        Some((&subject, subject_doc.len())),
        None,
    );
    let r = t
        .put_manifest("ref", "sbom", media::OCI_MANIFEST, &sbom)
        .await;
    assert_eq!(r.status, StatusCode::CREATED);

    let r = t.get(&format!("/v2/ref/referrers/{subject}")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), media::OCI_INDEX);
    let v = r.json();
    assert_eq!(v["schemaVersion"], 2);
    assert_eq!(v["mediaType"], media::OCI_INDEX);
    let mut types: Vec<String> = v["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["artifactType"].as_str().unwrap().to_string())
        .collect();
    types.sort();
    assert_eq!(
        types,
        [
            "application/vnd.example.sbom",
            "application/vnd.example.signature"
        ]
    );
    let entry = v["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["digest"] == sig_digest.as_str())
        .unwrap()
        .clone();
    assert_eq!(entry["size"], sig.len());
    assert_eq!(entry["mediaType"], media::OCI_MANIFEST);
    assert_eq!(
        entry["annotations"]["org.example.kind"],
        "application/vnd.example.signature"
    );

    let r = t
        .get(&format!(
            "/v2/ref/referrers/{subject}?artifactType=application%2Fvnd.example.sbom"
        ))
        .await;
    assert_eq!(r.header("oci-filters-applied"), "artifactType");
    let m = r.json()["manifests"].as_array().unwrap().clone();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0]["artifactType"], "application/vnd.example.sbom");

    // No referrers: an empty index, not a 404.
    let r = t
        .get(&format!("/v2/ref/referrers/{}", digest_of(b"x")))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["manifests"], serde_json::json!([]));
    let r = t.get("/v2/ref/referrers/sha256:nothex").await;
    assert_eq!(r.error_code(), "DIGEST_INVALID");

    // A deleted referrer disappears from the list.
    let r = t
        .send(
            Method::DELETE,
            &format!("/v2/ref/manifests/{sig_digest}"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    let r = t.get(&format!("/v2/ref/referrers/{subject}")).await;
    assert_eq!(r.json()["manifests"].as_array().unwrap().len(), 1);
}

// ---------------------------------------------------------------- metrics, pull-through

#[tokio::test]
async fn metrics_endpoint_counts_layer_requests() {
    let t = app();
    let digest = t.push_blob("m", b"abc").await;
    for _ in 0..3 {
        t.get(&format!("/v2/m/blobs/{digest}")).await;
    }
    t.get("/v2/m/manifests/nope").await;
    let r = t.get("/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    let text = std::str::from_utf8(&r.body).unwrap();
    assert!(
        text.contains("ferry_registry_layer_requests_total 3"),
        "{text}"
    );
    assert!(
        text.contains("route=\"manifest_pull\",status=\"404\""),
        "{text}"
    );
    assert!(text.contains("ferry_registry_response_bytes_total{route=\"blob_pull\"} 9"));
    assert!(text.contains("ferry_registry_cache_hits_total{kind=\"memory_link\"}"));
    assert_eq!(t.state.metrics().layer_requests(), 3);
}

#[tokio::test]
async fn pull_through_mode_is_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Metrics::new();
    let up =
        crate::cache::UpstreamConfig::new("http://127.0.0.1:9").with_default_cache_dir(dir.path());
    let pt = crate::cache::PullThrough::new(&up, metrics.clone())
        .await
        .unwrap();
    let state = AppState::new(
        Arc::new(MemoryStorage::default()),
        Arc::new(Authenticator::new(&AuthConfig::default()).unwrap()),
        Some(Arc::new(pt)),
        metrics,
        Limits::default(),
        &MemoryCacheConfig::default(),
    );
    let t = TestApp {
        router: router(state.clone()),
        state,
    };
    let d = digest_of(b"x");
    for (method, uri) in [
        (Method::POST, "/v2/r/blobs/uploads/".to_string()),
        (Method::PUT, "/v2/r/manifests/latest".to_string()),
        (Method::DELETE, "/v2/r/manifests/latest".to_string()),
        (Method::DELETE, format!("/v2/r/blobs/{d}")),
        (Method::GET, "/v2/_catalog".to_string()),
    ] {
        let r = t.send(method.clone(), &uri, &[], Body::empty()).await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
        assert_eq!(r.error_code(), "UNSUPPORTED");
    }
}

/// The whole pull-through path through the HTTP layer: a front registry in upstream mode
/// serves an image held by a real upstream listener, keeps serving what it cached after the
/// upstream is gone, and answers an uncached blob with the upstream outage, not a 404.
#[tokio::test]
async fn pull_through_serves_from_upstream_and_survives_its_outage() {
    let upstream_config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        storage: crate::storage::StorageConfig::Memory,
        ..Config::default()
    };
    let (up_addr, up_stop, up_task) = start_server(upstream_config).await;
    let http = reqwest::Client::new();
    let layer = vec![7u8; 300_000];
    let config_blob = br#"{"architecture":"amd64","os":"linux"}"#.to_vec();
    let missing = b"never pushed".to_vec();
    for blob in [&layer, &config_blob] {
        let d = digest_of(blob);
        let r = http
            .post(format!(
                "http://{up_addr}/v2/lib/app/blobs/uploads/?digest={d}"
            ))
            .body(blob.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    let manifest = image_manifest(
        media::OCI_CONFIG,
        &digest_of(&config_blob),
        config_blob.len(),
        &[(&digest_of(&layer), layer.len())],
        None,
        None,
    );
    let r = http
        .put(format!("http://{up_addr}/v2/lib/app/manifests/v1"))
        .header("content-type", media::OCI_MANIFEST)
        .body(manifest.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);

    let dir = tempfile::tempdir().unwrap();
    let metrics = Metrics::new();
    let up = crate::cache::UpstreamConfig::new(format!("http://{up_addr}"))
        .with_default_cache_dir(dir.path());
    let pt = crate::cache::PullThrough::new(&up, metrics.clone())
        .await
        .unwrap();
    let state = AppState::new(
        Arc::new(MemoryStorage::default()),
        Arc::new(Authenticator::new(&AuthConfig::default()).unwrap()),
        Some(Arc::new(pt)),
        metrics,
        Limits::default(),
        &MemoryCacheConfig::default(),
    );
    let t = TestApp {
        router: router(state.clone()),
        state,
    };

    let r = t
        .send(Method::GET, "/v2/lib/app/manifests/v1", &[], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], &manifest[..]);
    assert_eq!(r.header("docker-content-digest"), digest_of(&manifest));
    let layer_uri = format!("/v2/lib/app/blobs/{}", digest_of(&layer));
    let r = t.send(Method::GET, &layer_uri, &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], &layer[..]);
    let r = t
        .send(
            Method::GET,
            &layer_uri,
            &[("range", "bytes=1000-1999")],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(&r.body[..], &layer[1000..2000]);

    // Upstream gone: what was cached is still served; what was not is an outage.
    up_stop.send(()).unwrap();
    up_task.await.unwrap();
    let r = t.send(Method::GET, &layer_uri, &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], &layer[..]);
    let r = t
        .send(Method::GET, "/v2/lib/app/manifests/v1", &[], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = t
        .send(
            Method::GET,
            &format!("/v2/lib/app/blobs/{}", digest_of(&missing)),
            &[],
            Body::empty(),
        )
        .await;
    assert!(
        r.status == StatusCode::SERVICE_UNAVAILABLE || r.status == StatusCode::BAD_GATEWAY,
        "{}",
        r.status
    );
    assert_eq!(r.error_code(), "UNAVAILABLE");
}

// ---------------------------------------------------------------- real listeners

async fn start_server(
    config: Config,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let server = Server::bind(&config).await.unwrap();
    let addr = server.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    (addr, tx, task)
}

use std::net::SocketAddr;

#[tokio::test]
async fn filesystem_backend_over_a_real_listener() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    config.set_root(dir.path().join("data"));
    let (addr, stop, task) = start_server(config).await;
    let base = format!("http://{addr}");
    let http = reqwest::Client::builder().build().unwrap();

    let r = http.get(format!("{base}/v2/")).send().await.unwrap();
    assert_eq!(r.status(), 200);

    // Chunked push of a layer bigger than the small-blob cache.
    let layer: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
    let ld = digest_of(&layer);
    let r = http
        .post(format!("{base}/v2/fs/img/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let r = http
        .patch(format!("{base}{location}"))
        .header("content-range", format!("0-{}", 300_000 - 1))
        .body(layer[..300_000].to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.headers()["range"], "0-299999");
    let r = http
        .put(format!("{base}{location}?digest={ld}"))
        .body(layer[300_000..].to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    let config_blob = br#"{"os":"linux"}"#.to_vec();
    let cd = digest_of(&config_blob);
    let r = http
        .post(format!("{base}/v2/fs/img/blobs/uploads/?digest={cd}"))
        .body(config_blob.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let doc = image_manifest(
        media::OCI_CONFIG,
        &cd,
        config_blob.len(),
        &[(&ld, layer.len())],
        None,
        None,
    );
    let r = http
        .put(format!("{base}/v2/fs/img/manifests/latest"))
        .header("content-type", media::OCI_MANIFEST)
        .body(doc.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    let r = http
        .get(format!("{base}/v2/fs/img/manifests/latest"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers()["docker-content-digest"],
        digest_of(&doc).as_str()
    );
    assert_eq!(&r.bytes().await.unwrap()[..], &doc[..]);

    let r = http
        .get(format!("{base}/v2/fs/img/blobs/{ld}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(&r.bytes().await.unwrap()[..], &layer[..]);
    let r = http
        .head(format!("{base}/v2/fs/img/blobs/{ld}"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers()["content-length"],
        layer.len().to_string().as_str()
    );
    let r = http
        .get(format!("{base}/v2/fs/img/blobs/{ld}"))
        .header("range", "bytes=-10")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(&r.bytes().await.unwrap()[..], &layer[layer.len() - 10..]);

    // HTTP/2 without TLS (prior knowledge) on the same port.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .get(format!("{base}/v2/fs/img/blobs/{cd}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(&r.bytes().await.unwrap()[..], &config_blob[..]);

    stop.send(()).unwrap();
    task.await.unwrap();
    // Shut down: the port no longer answers.
    assert!(http.get(format!("{base}/v2/")).send().await.is_err());

    // Everything is still there for the next process.
    let mut config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    config.set_root(dir.path().join("data"));
    let (addr, stop, task) = start_server(config).await;
    let r = http
        .get(format!("http://{addr}/v2/fs/img/blobs/{ld}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.bytes().await.unwrap().len(), layer.len());
    stop.send(()).unwrap();
    task.await.unwrap();
}

#[tokio::test]
async fn slow_headers_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        storage: crate::storage::StorageConfig::Memory,
        ..Config::default()
    };
    config.limits.header_read_timeout = Duration::from_millis(200);
    let (addr, stop, task) = start_server(config).await;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /v2/ HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Never finish the headers: the server must close the connection.
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "connection was not closed");
    stop.send(()).unwrap();
    task.await.unwrap();
}

// ---------------------------------------------------------------- auth

fn auth_app(dir: &std::path::Path, mode: crate::auth::AuthMode) -> TestApp {
    let htpasswd = dir.join("htpasswd");
    let lines = [
        crate::auth::htpasswd_line("alice", "wonderland", 4).unwrap(),
        crate::auth::htpasswd_line("bob", "builder", 4).unwrap(),
    ];
    std::fs::write(&htpasswd, lines.join("\n") + "\n").unwrap();
    let cfg = AuthConfig {
        enabled: Some(true),
        htpasswd: Some(htpasswd),
        secret: Some("0123456789abcdef0123456789abcdef".into()),
        mode,
        rules: vec![
            crate::auth::AccessRule {
                repository: "team/**".into(),
                users: vec!["alice".into()],
                actions: vec!["*".into()],
            },
            crate::auth::AccessRule {
                repository: "team/**".into(),
                users: vec!["bob".into()],
                actions: vec!["pull".into()],
            },
        ],
        ..AuthConfig::default()
    };
    let auth = Arc::new(Authenticator::new(&cfg).unwrap());
    let state = AppState::new(
        Arc::new(MemoryStorage::default()),
        auth,
        None,
        Metrics::new(),
        Limits::default(),
        &MemoryCacheConfig::default(),
    );
    TestApp {
        router: router(state.clone()),
        state,
    }
}

fn basic(user: &str, password: &str) -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

#[tokio::test]
async fn basic_auth_scopes_every_route() {
    let dir = tempfile::tempdir().unwrap();
    let t = auth_app(dir.path(), crate::auth::AuthMode::Basic);
    let alice = basic("alice", "wonderland");
    let bob = basic("bob", "builder");

    let r = t.get("/v2/").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(r.header("www-authenticate").starts_with("Basic"));
    assert_eq!(r.error_code(), "UNAUTHORIZED");
    let r = t
        .send(
            Method::GET,
            "/v2/",
            &[("authorization", &basic("alice", "nope"))],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = t
        .send(
            Method::GET,
            "/v2/",
            &[("authorization", &alice)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);

    // Push: alice may, bob may not.
    let data = b"secret layer";
    let digest = digest_of(data);
    let uri = format!("/v2/team/app/blobs/uploads/?digest={digest}");
    let r = t
        .send(
            Method::POST,
            &uri,
            &[("authorization", &bob)],
            data.to_vec(),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.error_code(), "DENIED");
    let r = t
        .send(
            Method::POST,
            &uri,
            &[("authorization", &alice)],
            data.to_vec(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    // Pull: both; anonymous not.
    let blob = format!("/v2/team/app/blobs/{digest}");
    for who in [&alice, &bob] {
        let r = t
            .send(Method::GET, &blob, &[("authorization", who)], Body::empty())
            .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    assert_eq!(t.get(&blob).await.status, StatusCode::UNAUTHORIZED);
    // Delete: bob may not.
    let r = t
        .send(
            Method::DELETE,
            &blob,
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // Outside the rules nobody may push.
    let r = t
        .send(
            Method::POST,
            "/v2/other/blobs/uploads/",
            &[("authorization", &alice)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // Mount from a repository the caller cannot read falls back to an upload session.
    let r = t
        .send(
            Method::POST,
            &format!("/v2/team/b/blobs/uploads/?mount={digest}&from=other"),
            &[("authorization", &alice)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
}

#[tokio::test]
async fn token_auth_through_the_merged_token_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let t = auth_app(dir.path(), crate::auth::AuthMode::Token);
    let r = t.get("/v2/team/app/tags/list").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let challenge = r.header("www-authenticate").to_string();
    assert!(challenge.starts_with("Bearer "), "{challenge}");
    assert!(
        challenge.contains("scope=\"repository:team/app:pull\""),
        "{challenge}"
    );
    let r = t
        .send(
            Method::GET,
            "/token?service=ferry-registry&scope=repository:team/app:pull,push",
            &[("authorization", &basic("alice", "wonderland"))],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let token = r.json()["token"].as_str().unwrap().to_string();
    let bearer = format!("Bearer {token}");
    let r = t
        .send(
            Method::POST,
            "/v2/team/app/blobs/uploads/",
            &[("authorization", &bearer)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    // The token does not cover another repository.
    let r = t
        .send(
            Method::GET,
            "/v2/team/other/tags/list",
            &[("authorization", &bearer)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = t.get("/metrics").await;
    assert!(
        std::str::from_utf8(&r.body)
            .unwrap()
            .contains("route=\"token\",status=\"200\"")
    );
}

// ---------------------------------------------------------------- several ranges, attacked

// A `Range` with several ranges is answered as `multipart/byteranges` on three paths
// (storage, the small-blob memory cache, pull-through); the memory cache is keyed by
// digest alone, shared by every repository. Each path must refuse exactly as a single
// range is refused. The tenants: alice owns `priv/**`, mallory owns `mallory/**`,
// nobody may read anonymously.

/// Two ranges of the blob, and the one range a single-range request asks for.
const SEVERAL: &str = "bytes=0-9,100-199";
const ONE: &str = "bytes=0-9";

fn tenants_auth(dir: &std::path::Path, mode: crate::auth::AuthMode) -> Arc<Authenticator> {
    let htpasswd = dir.join("htpasswd");
    let lines = [
        crate::auth::htpasswd_line("alice", "wonderland", 4).unwrap(),
        crate::auth::htpasswd_line("mallory", "malice", 4).unwrap(),
    ];
    std::fs::write(&htpasswd, lines.join("\n") + "\n").unwrap();
    let rule = |repository: &str, user: &str| crate::auth::AccessRule {
        repository: repository.into(),
        users: vec![user.into()],
        actions: vec!["*".into()],
    };
    let cfg = AuthConfig {
        enabled: Some(true),
        htpasswd: Some(htpasswd),
        secret: Some("0123456789abcdef0123456789abcdef".into()),
        mode,
        rules: vec![rule("priv/**", "alice"), rule("mallory/**", "mallory")],
        ..AuthConfig::default()
    };
    Arc::new(Authenticator::new(&cfg).unwrap())
}

fn tenants_app(
    dir: &std::path::Path,
    mode: crate::auth::AuthMode,
    upstream: Option<Arc<crate::cache::PullThrough>>,
    cache: MemoryCacheConfig,
) -> TestApp {
    let state = AppState::new(
        Arc::new(MemoryStorage::default()),
        tenants_auth(dir, mode),
        upstream,
        Metrics::new(),
        Limits::default(),
        &cache,
    );
    TestApp {
        router: router(state.clone()),
        state,
    }
}

/// The `Authorization` value `user` sends in `mode`: Basic credentials, or a token the
/// token endpoint issued for `scope` (its grant may be empty).
async fn login(
    t: &TestApp,
    mode: crate::auth::AuthMode,
    user: &str,
    password: &str,
    scope: &str,
) -> String {
    if mode == crate::auth::AuthMode::Basic {
        return basic(user, password);
    }
    let r = t
        .send(
            Method::GET,
            &format!("/token?service=ferry-registry&scope={scope}"),
            &[("authorization", &basic(user, password))],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    format!("Bearer {}", r.json()["token"].as_str().unwrap())
}

/// 300 bytes, every one ≥ 0x80: an error body (ASCII JSON) carrying any byte of the
/// blob would show it.
fn private_blob() -> Vec<u8> {
    (0..300u32).map(|i| 0x80 | (i * 37 % 128) as u8).collect()
}

async fn get_range(t: &TestApp, uri: &str, range: &str, authorization: Option<&str>) -> Resp {
    let mut headers = vec![("range", range)];
    if let Some(a) = authorization {
        headers.push(("authorization", a));
    }
    t.send(Method::GET, uri, &headers, Body::empty()).await
}

/// The owner's several-range read: 206 `multipart/byteranges`, one part per range with
/// the blob's bytes.
async fn owner_reads_both_ranges(t: &TestApp, uri: &str, alice: &str, data: &[u8]) {
    let r = get_range(t, uri, SEVERAL, Some(alice)).await;
    assert_eq!(r.status, StatusCode::PARTIAL_CONTENT, "{:?}", r.body);
    let boundary = ferry_registry_client::byteranges::boundary(r.header("content-type"))
        .expect("multipart/byteranges")
        .to_string();
    assert_eq!(r.header("content-length"), r.body.len().to_string());
    let parts = ferry_registry_client::byteranges::parse(&r.body, &boundary).unwrap();
    assert_eq!(parts.len(), 2, "one part per range");
    let asked = [0..10, 100..200];
    let got = ferry_registry_client::byteranges::slices(&asked, &parts, &r.body).unwrap();
    for (a, g) in asked.iter().zip(got) {
        assert_eq!(g, &data[a.start as usize..a.end as usize]);
    }
}

/// Mallory (with her own credentials, and any token she can get) and an anonymous client
/// ask for several ranges of `digest`, which only `priv/app` holds, through alice's
/// repository and through mallory's own: each gets the refusal a single range gets
/// (403 DENIED where the repository is not hers, 404 BLOB_UNKNOWN where her repository
/// does not hold the blob, 401 without credentials), and no byte of the blob.
async fn attacker_gets_nothing(t: &TestApp, mode: crate::auth::AuthMode, digest: &str, path: &str) {
    let own = login(t, mode, "mallory", "malice", "repository:mallory/app:pull").await;
    // In token mode: a token asked for alice's repository (its grant is empty).
    let asked_for_priv = login(t, mode, "mallory", "malice", "repository:priv/app:pull").await;
    let victim = format!("/v2/priv/app/blobs/{digest}");
    let hers = format!("/v2/mallory/app/blobs/{digest}");
    let cases = [
        (&victim, Some(&own), StatusCode::FORBIDDEN, "DENIED"),
        (
            &victim,
            Some(&asked_for_priv),
            StatusCode::FORBIDDEN,
            "DENIED",
        ),
        (&hers, Some(&own), StatusCode::NOT_FOUND, "BLOB_UNKNOWN"),
        (&victim, None, StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
        (&hers, None, StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
    ];
    for (uri, authorization, status, code) in cases {
        let who = if authorization.is_some() {
            "mallory"
        } else {
            "anonymous"
        };
        let what = format!("{path}, {mode:?}: {who} asking {uri}");
        let authorization = authorization.map(String::as_str);
        let single = get_range(t, uri, ONE, authorization).await;
        let several = get_range(t, uri, SEVERAL, authorization).await;
        assert_eq!(single.status, status, "{what}, one range");
        assert_eq!(several.status, status, "{what}, several ranges");
        assert_eq!(several.error_code(), code, "{what}");
        assert_eq!(single.error_code(), code, "{what}");
        assert_eq!(
            several.header("www-authenticate"),
            single.header("www-authenticate"),
            "{what}"
        );
        for r in [&single, &several] {
            assert!(
                r.body.iter().all(|b| *b < 0x80),
                "{what}: blob bytes in the answer"
            );
            assert!(r.header("content-range").is_empty(), "{what}");
            assert!(!r.header("content-type").contains("multipart"), "{what}");
        }
    }
}

#[tokio::test]
async fn several_ranges_of_a_stored_blob_need_the_same_access_as_one() {
    for mode in [crate::auth::AuthMode::Basic, crate::auth::AuthMode::Token] {
        let dir = tempfile::tempdir().unwrap();
        // No memory cache: every read streams from storage.
        let cache = MemoryCacheConfig {
            entries: 0,
            small_blob_bytes: 0,
            ..MemoryCacheConfig::default()
        };
        let t = tenants_app(dir.path(), mode, None, cache);
        let scope = "repository:priv/app:pull,push";
        let alice = login(&t, mode, "alice", "wonderland", scope).await;
        let data = private_blob();
        let digest = digest_of(&data);
        let r = t
            .send(
                Method::POST,
                &format!("/v2/priv/app/blobs/uploads/?digest={digest}"),
                &[("authorization", &alice)],
                data.clone(),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
        let uri = format!("/v2/priv/app/blobs/{digest}");
        owner_reads_both_ranges(&t, &uri, &alice, &data).await;
        attacker_gets_nothing(&t, mode, &digest, "storage").await;
        assert!(t.state.inner.small_blobs.is_empty());
    }
}

#[tokio::test]
async fn several_ranges_of_a_blob_in_the_memory_cache_need_the_same_access_as_one() {
    for mode in [crate::auth::AuthMode::Basic, crate::auth::AuthMode::Token] {
        let dir = tempfile::tempdir().unwrap();
        let t = tenants_app(dir.path(), mode, None, MemoryCacheConfig::default());
        let scope = "repository:priv/app:pull,push";
        let alice = login(&t, mode, "alice", "wonderland", scope).await;
        let data = private_blob();
        let digest = digest_of(&data);
        let r = t
            .send(
                Method::POST,
                &format!("/v2/priv/app/blobs/uploads/?digest={digest}"),
                &[("authorization", &alice)],
                data.clone(),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
        // Alice has just read it: the whole blob is in the memory cache every
        // repository's reads go through (keyed by digest only).
        let uri = format!("/v2/priv/app/blobs/{digest}");
        owner_reads_both_ranges(&t, &uri, &alice, &data).await;
        assert_eq!(
            t.state.inner.small_blobs.get("", &digest).as_deref(),
            Some(&data[..])
        );
        attacker_gets_nothing(&t, mode, &digest, "memory cache").await;
        // Still cached: the refusals above were not misses.
        assert!(t.state.inner.small_blobs.get("", &digest).is_some());
        owner_reads_both_ranges(&t, &uri, &alice, &data).await;
    }
}

/// A front registry in pull-through mode over `up`, with the tenants' rules.
async fn pull_through_front(
    dir: &std::path::Path,
    mode: crate::auth::AuthMode,
    up: &crate::cache::UpstreamConfig,
) -> TestApp {
    let pt = crate::cache::PullThrough::new(up, Metrics::new())
        .await
        .unwrap();
    tenants_app(dir, mode, Some(Arc::new(pt)), MemoryCacheConfig::default())
}

/// Pull-through: the upstream (open, another ferry registry) holds the blob in
/// `priv/app` only; the front registry has the tenants' rules. Alice's reads fetch the
/// blob into the front's disk cache, which is shared by every repository: attacked
/// right after her reads, and again once the blob is on disk (a front restarted over
/// the same cache directory, so nothing is known about who may read it).
#[tokio::test]
async fn several_ranges_through_pull_through_need_the_same_access_as_one() {
    let upstream_config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        storage: crate::storage::StorageConfig::Memory,
        ..Config::default()
    };
    let (up_addr, up_stop, up_task) = start_server(upstream_config).await;
    let data = private_blob();
    let digest = digest_of(&data);
    let r = reqwest::Client::new()
        .post(format!(
            "http://{up_addr}/v2/priv/app/blobs/uploads/?digest={digest}"
        ))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let uri = format!("/v2/priv/app/blobs/{digest}");
    for mode in [crate::auth::AuthMode::Basic, crate::auth::AuthMode::Token] {
        let dir = tempfile::tempdir().unwrap();
        let up = crate::cache::UpstreamConfig::new(format!("http://{up_addr}"))
            .with_default_cache_dir(dir.path());
        let t = pull_through_front(dir.path(), mode, &up).await;
        let alice = login(&t, mode, "alice", "wonderland", "repository:priv/app:pull").await;
        let r = t
            .send(
                Method::GET,
                &uri,
                &[("authorization", &alice)],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], &data[..]);
        owner_reads_both_ranges(&t, &uri, &alice, &data).await;
        attacker_gets_nothing(&t, mode, &digest, "pull-through, just fetched").await;

        // The download is committed to disk after its readers are served: wait for it
        // (bounded, so a broken cache fails instead of hanging; never a threshold).
        let on_disk = up
            .effective_cache_dir()
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"));
        tokio::time::timeout(Duration::from_secs(60), async {
            while !on_disk.exists() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the fetched blob reaches the disk cache");
        drop(t);
        let t = pull_through_front(dir.path(), mode, &up).await;
        attacker_gets_nothing(&t, mode, &digest, "pull-through, on disk").await;
        let alice = login(&t, mode, "alice", "wonderland", "repository:priv/app:pull").await;
        owner_reads_both_ranges(&t, &uri, &alice, &data).await;
    }
    up_stop.send(()).unwrap();
    up_task.await.unwrap();
}

// ---------------------------------------------------------------- traces from pull-only nodes

fn trace_json(reads: usize) -> Vec<u8> {
    let reads: Vec<_> = (0..reads)
        .map(|i| serde_json::json!({"path": format!("/usr/lib/f{i}"), "offset": 0, "len": 4096}))
        .collect();
    serde_json::to_vec(&serde_json::json!({"version": 1, "reads": reads})).unwrap()
}

async fn send_trace(
    t: &TestApp,
    who: Option<&str>,
    repo: &str,
    subject: &str,
    ct: &str,
    body: Vec<u8>,
) -> Resp {
    let mut headers = vec![("content-type", ct)];
    if let Some(w) = who {
        headers.push(("authorization", w));
    }
    t.send(
        Method::PUT,
        &format!("/v2/{repo}/ferry-traces/{subject}"),
        &headers,
        body,
    )
    .await
}

/// The referrers of `subject` in team/app, as `who` sees them.
async fn trace_referrers(t: &TestApp, who: &str, subject: &str) -> Vec<serde_json::Value> {
    let uri = format!("/v2/team/app/referrers/{subject}");
    let r = t
        .send(Method::GET, &uri, &[("authorization", who)], Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    r.json()["manifests"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_pull_only_user_adds_one_bounded_trace_per_manifest_and_nothing_else() {
    use crate::server::traces::{REPOSITORY_TRACE_TAG, TRACE_ARTIFACT_TYPE, TRACE_BLOB_MEDIA_TYPE};
    let dir = tempfile::tempdir().unwrap();
    let t = auth_app(dir.path(), crate::auth::AuthMode::Basic);
    let alice = basic("alice", "wonderland");
    let bob = basic("bob", "builder");
    // alice (push) stores the image through the ordinary API.
    let doc = t.push_blobs_as(&alice, "team/app", b"layer bytes").await;
    let subject = digest_of(&doc);
    let r = t
        .send(
            Method::PUT,
            "/v2/team/app/manifests/v1",
            &[
                ("authorization", &alice),
                ("content-type", media::OCI_MANIFEST),
            ],
            doc.clone(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);

    // bob may pull only: an ordinary manifest push is refused...
    let r = t
        .send(
            Method::PUT,
            "/v2/team/app/manifests/evil",
            &[
                ("authorization", &bob),
                ("content-type", media::OCI_MANIFEST),
            ],
            doc.clone(),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // ...but a trace of the image is accepted, as an artifact the registry builds.
    let body = trace_json(3);
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        body.clone(),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let first = r.header("docker-content-digest").to_owned();
    assert_eq!(r.header("oci-subject"), subject);
    let listed = trace_referrers(&t, &bob, &subject).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["digest"], first.as_str());
    assert_eq!(listed[0]["artifactType"], TRACE_ARTIFACT_TYPE);
    assert_eq!(
        listed[0]["annotations"]["dev.ferry.trace.accepted-from"],
        "bob"
    );
    // The repository's trace tag points at it; its layer is the trace as sent.
    let r = t
        .send(
            Method::GET,
            &format!("/v2/team/app/manifests/{REPOSITORY_TRACE_TAG}"),
            &[("authorization", &bob), ("accept", media::OCI_MANIFEST)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(digest_of(&r.body), first);
    let artifact = r.json();
    assert_eq!(artifact["subject"]["digest"], subject.as_str());
    assert_eq!(artifact["layers"][0]["digest"], digest_of(&body).as_str());
    let r = t
        .send(
            Method::GET,
            &format!("/v2/team/app/blobs/{}", digest_of(&body)),
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!((r.status, r.body.to_vec()), (StatusCode::OK, body));

    // Sent again: it replaces bob's earlier trace (one per manifest), never grows.
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(5),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let second = r.header("docker-content-digest").to_owned();
    assert_ne!(first, second);
    let listed = trace_referrers(&t, &bob, &subject).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["digest"], second.as_str());
    // A trace alice pushed herself (no accepted-from annotation) is not replaced.
    let own = image_manifest(
        "application/vnd.oci.empty.v1+json",
        &digest_of(b"{}"),
        2,
        &[],
        Some((&subject, doc.len())),
        Some(TRACE_ARTIFACT_TYPE),
    );
    let r = t
        .send(
            Method::PUT,
            &format!("/v2/team/app/manifests/{}", digest_of(&own)),
            &[
                ("authorization", &alice),
                ("content-type", media::OCI_MANIFEST),
            ],
            own.clone(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(2),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let listed: Vec<String> = trace_referrers(&t, &bob, &subject)
        .await
        .iter()
        .map(|d| d["digest"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&digest_of(&own)));

    // The attacker's side. No credentials (even where anonymous pull were allowed):
    let r = send_trace(
        &t,
        None,
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // Wrong password:
    let r = send_trace(
        &t,
        Some(&basic("bob", "nope")),
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // A repository bob may not pull from:
    let r = send_trace(
        &t,
        Some(&bob),
        "other/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    // A repository bob may pull from, where that manifest does not exist:
    let r = send_trace(
        &t,
        Some(&bob),
        "team/other",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // A subject that is no manifest of the repository, or is no digest:
    let missing = digest_of(b"nothing");
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        &missing,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        "sha256:abc",
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // A subject that is itself an artifact (a trace of a trace):
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        &second,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert!(
        r.status == StatusCode::BAD_REQUEST || r.status == StatusCode::NOT_FOUND,
        "{}",
        r.status
    );
    // Wrong media type:
    for ct in ["application/json", media::OCI_MANIFEST, ""] {
        let r = send_trace(&t, Some(&bob), "team/app", &subject, ct, trace_json(1)).await;
        assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct}");
    }
    // Oversize, declared or not:
    let big = vec![b' '; (crate::server::traces::MAX_ACCEPTED_TRACE_BYTES + 1) as usize];
    let r = send_trace(
        &t,
        Some(&bob),
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        big,
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{:?}", r.body);
    // Not a trace: garbage, another version, unknown fields, relative or NUL paths,
    // empty reads, overflowing offsets, no reads.
    for bad in [
        b"not json".to_vec(),
        br#"{"version":2,"reads":[{"path":"/a","offset":0,"len":1}]}"#.to_vec(),
        br#"{"version":1,"reads":[{"path":"/a","offset":0,"len":1}],"x":1}"#.to_vec(),
        br#"{"version":1,"reads":[{"path":"a","offset":0,"len":1}]}"#.to_vec(),
        br#"{"version":1,"reads":[{"path":"/a\u0000b","offset":0,"len":1}]}"#.to_vec(),
        br#"{"version":1,"reads":[{"path":"/a","offset":0,"len":0}]}"#.to_vec(),
        br#"{"version":1,"reads":[{"path":"/a","offset":18446744073709551615,"len":2}]}"#.to_vec(),
        br#"{"version":1,"reads":[]}"#.to_vec(),
    ] {
        let r = send_trace(
            &t,
            Some(&bob),
            "team/app",
            &subject,
            TRACE_BLOB_MEDIA_TYPE,
            bad.clone(),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{}",
            String::from_utf8_lossy(&bad)
        );
    }
    // Other methods on the endpoint:
    let r = t
        .send(
            Method::GET,
            &format!("/v2/team/app/ferry-traces/{subject}"),
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    // After all that, the repository still has the image, its tag, and two traces.
    assert_eq!(trace_referrers(&t, &bob, &subject).await.len(), 2);
    let r = t
        .send(
            Method::GET,
            "/v2/team/app/tags/list",
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    let mut tags: Vec<String> = r.json()["tags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    tags.sort();
    assert_eq!(tags, vec![REPOSITORY_TRACE_TAG.to_owned(), "v1".to_owned()]);
}

/// Tags set by a manifest push (`?tag=` parameters or `OCI-Tag`) need the push right
/// like the reference in the path: a user who may only pull cannot move or add a tag
/// through them, and a pusher cannot reach a repository outside their rules.
#[tokio::test]
async fn tag_parameters_of_a_manifest_push_need_the_push_right() {
    let dir = tempfile::tempdir().unwrap();
    let t = auth_app(dir.path(), crate::auth::AuthMode::Basic);
    let alice = basic("alice", "wonderland");
    let bob = basic("bob", "builder");
    let put = |who: &str, uri: String, doc: Vec<u8>, oci_tag: Option<&'static str>| {
        let who = who.to_owned();
        let t = &t;
        async move {
            let mut headers = vec![
                ("authorization", who.as_str()),
                ("content-type", media::OCI_MANIFEST),
            ];
            if let Some(tag) = oci_tag {
                headers.push(("oci-tag", tag));
            }
            t.send(Method::PUT, &uri, &headers, doc).await
        }
    };
    // alice pushes two images' blobs and tags the first one v1.
    let docs = [
        t.push_blobs_as(&alice, "team/app", b"first layer").await,
        t.push_blobs_as(&alice, "team/app", b"second layer").await,
    ];
    let (first, second) = (digest_of(&docs[0]), digest_of(&docs[1]));
    let r = put(
        &alice,
        "/v2/team/app/manifests/v1".into(),
        docs[0].clone(),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);

    // bob may only pull: by digest with tag parameters, with OCI-Tag, re-pointing v1 at
    // the second image or adding a tag to the first, every attempt is refused.
    let attempts = [
        (format!("/v2/team/app/manifests/{second}?tag=v1"), 1, None),
        (
            format!("/v2/team/app/manifests/{first}?tag=evil&tag=v1"),
            0,
            None,
        ),
        (format!("/v2/team/app/manifests/{second}"), 1, Some("v1")),
        (format!("/v2/team/app/manifests/{first}"), 0, Some("evil")),
    ];
    for (uri, doc, oci_tag) in attempts {
        let r = put(&bob, uri.clone(), docs[doc].clone(), oci_tag).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{uri} {oci_tag:?}");
        assert!(r.header("oci-tag").is_empty(), "{uri}");
    }
    // alice may push team/**, not other/**: tag parameters do not widen that.
    let r = put(
        &alice,
        format!("/v2/other/app/manifests/{first}?tag=v1"),
        docs[0].clone(),
        None,
    )
    .await;
    assert!(
        matches!(r.status, StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED),
        "{}",
        r.status
    );

    // Nothing moved: v1 is the first image, no `evil` tag, the second manifest unstored.
    let r = t
        .send(
            Method::GET,
            "/v2/team/app/tags/list",
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["tags"], serde_json::json!(["v1"]));
    let r = t
        .send(
            Method::HEAD,
            "/v2/team/app/manifests/v1",
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.header("docker-content-digest"), first);
    let r = t
        .send(
            Method::HEAD,
            &format!("/v2/team/app/manifests/{second}"),
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // The same pushes from alice are taken: the refusals above were about the right.
    let r = put(
        &alice,
        format!("/v2/team/app/manifests/{second}?tag=v1&tag=v2"),
        docs[1].clone(),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let r = t
        .send(
            Method::HEAD,
            "/v2/team/app/manifests/v1",
            &[("authorization", &bob)],
            Body::empty(),
        )
        .await;
    assert_eq!(r.header("docker-content-digest"), second);
}

#[tokio::test]
async fn an_open_registry_takes_traces_as_it_takes_pushes() {
    use crate::server::traces::TRACE_BLOB_MEDIA_TYPE;
    let t = app();
    let (subject, _) = t.push_image("team/app", "v1", b"layer").await;
    // Open registry: anyone may push, so anyone may add a trace.
    let r = send_trace(
        &t,
        None,
        "team/app",
        &subject,
        TRACE_BLOB_MEDIA_TYPE,
        trace_json(1),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
}

// ---------------------------------------------------------------- GC racing manifest pushes
//
// Each test holds a garbage collection (grace 0, so everything unreferenced is garbage)
// or a push at one step on a gated in-memory store and lets the other side run through
// that moment, forcing one interleaving of storage::gc's protocol. Whatever the order, a
// tag must never point at an image that cannot be pulled.

use crate::storage::gated::Gated;
use crate::storage::gc::{self, GcOptions, GcReport};

fn gated_app() -> (TestApp, Arc<Gated>) {
    let gated = Arc::new(Gated::default());
    let storage: Arc<dyn Storage> = gated.clone();
    let auth = Arc::new(Authenticator::new(&AuthConfig::default()).unwrap());
    let cache = MemoryCacheConfig::default();
    let state = AppState::new(
        storage,
        auth,
        None,
        Metrics::new(),
        Limits::default(),
        &cache,
    );
    let app = TestApp {
        router: router(state.clone()),
        state,
    };
    (app, gated)
}

fn collect_now(s: &Arc<Gated>) -> tokio::task::JoinHandle<GcReport> {
    let s = s.clone();
    tokio::spawn(async move {
        let opts = GcOptions {
            grace: Duration::ZERO,
            delete_untagged: true,
            dry_run: false,
        };
        gc::collect(s.as_ref(), &opts).await.unwrap()
    })
}

const RACE_CONFIG: &[u8] = br#"{"architecture":"amd64","os":"linux","race":1}"#;
const RACE_LAYER: &[u8] = b"race layer bytes";

fn race_manifest(cd: &str, ld: &str) -> Vec<u8> {
    image_manifest(
        media::OCI_CONFIG,
        cd,
        RACE_CONFIG.len(),
        &[(ld, RACE_LAYER.len())],
        None,
        None,
    )
}

/// Whether `repo:tag` pulls whole: the manifest and every blob it names.
async fn pulls(app: &TestApp, repo: &str, tag: &str) -> bool {
    let m = app.get(&format!("/v2/{repo}/manifests/{tag}")).await;
    if m.status != StatusCode::OK {
        return false;
    }
    let doc = m.json();
    let mut digests = vec![doc["config"]["digest"].as_str().unwrap().to_string()];
    for l in doc["layers"].as_array().unwrap() {
        digests.push(l["digest"].as_str().unwrap().to_string());
    }
    for d in digests {
        if app.get(&format!("/v2/{repo}/blobs/{d}")).await.status != StatusCode::OK {
            return false;
        }
    }
    true
}

/// Coordination records left behind, but for the `removed` ones, which outlive their
/// collection by design (a later one reaps them).
async fn records_left(s: &Gated) -> usize {
    let mut n = 0;
    for dir in gc::RECORD_DIRS.iter().filter(|d| **d != "removed") {
        n += s.inner.gc_record_list(dir).await.unwrap().len();
    }
    n
}

/// The residual of issue 11: a collection decided to remove the (then unreferenced)
/// config and layer, and only then did the push refresh them and commit its manifest.
/// The collection's removal comes after the commit; it must spare them.
#[tokio::test]
async fn gc_that_decided_before_a_push_spares_what_it_committed() {
    let (app, s) = gated_app();
    let cd = app.push_blob("race/app", RACE_CONFIG).await;
    let ld = app.push_blob("race/app", RACE_LAYER).await;
    // The collection's first step after deciding: its removal record (or, without the
    // protocol, the removal itself).
    let decided = s.arm_any(&["gc_record_put deleting", "unlink_blob", "blob_delete"]);
    let collection = collect_now(&s);
    decided.reached().await;
    let r = app
        .put_manifest(
            "race/app",
            "v1",
            media::OCI_MANIFEST,
            &race_manifest(&cd, &ld),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    decided.release();
    let report = collection.await.unwrap();
    assert!(report.kept_pinned >= 2, "{report:?}");
    assert_eq!(
        report.blob_links_removed + report.blobs_deleted,
        0,
        "{report:?}"
    );
    app.state.clear_caches();
    assert!(
        pulls(&app, "race/app", "v1").await,
        "the tag pulls after the collection"
    );
    // The next collection sees the manifest and keeps everything; no records are left.
    collect_now(&s).await.unwrap();
    app.state.clear_caches();
    assert!(pulls(&app, "race/app", "v1").await);
    assert_eq!(records_left(&s).await, 0);
}

/// A collection already removing the layer when the push commits: the push waits for
/// that removal, sees it, and undoes its commit instead of leaving a tag that cannot be
/// pulled; the tag goes back to its previous image. Two interleavings: the collection
/// held past its pin check before the removal (the push checks and commits meanwhile),
/// and held after the removal before its record goes (the push, held after its checks,
/// commits then).
#[tokio::test]
async fn a_push_that_loses_to_a_removal_in_progress_undoes_its_commit() {
    for held in ["unlink_blob", "gc_record_delete deleting"] {
        let (app, s) = gated_app();
        let cd = app.push_blob("race/app", RACE_CONFIG).await;
        let ld = app.push_blob("race/app", RACE_LAYER).await;
        // The tag's previous image, which the undo must put back.
        let (old, _) = app.push_image("race/app", "v1", b"the old layer").await;
        let push_gate = (held != "unlink_blob").then(|| s.arm("manifest_put"));
        let spawn_push = || {
            let router = app.router.clone();
            let doc = race_manifest(&cd, &ld);
            tokio::spawn(async move {
                let req = Request::builder()
                    .method(Method::PUT)
                    .uri("/v2/race/app/manifests/v1")
                    .header("content-type", media::OCI_MANIFEST)
                    .body(Body::from(doc))
                    .unwrap();
                let resp = router.oneshot(req).await.unwrap();
                let status = resp.status();
                let body = resp.into_body().collect().await.unwrap().to_bytes();
                (status, body)
            })
        };
        let removing = s.arm(held);
        let (collection, push) = match &push_gate {
            None => {
                let collection = collect_now(&s);
                removing.reached().await;
                (collection, spawn_push())
            }
            Some(committing) => {
                let push = spawn_push();
                committing.reached().await;
                let collection = collect_now(&s);
                removing.reached().await;
                committing.release();
                (collection, push)
            }
        };
        // The push has committed and pinned; it now waits for the removal.
        for _ in 0..1000 {
            if !s.inner.gc_record_list("pins").await.unwrap().is_empty() || push.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !push.is_finished(),
            "{held}: the push waits for the removal"
        );
        removing.release();
        let (status, body) = push.await.unwrap();
        let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(
            status.is_client_error() && err["errors"][0]["code"] == "MANIFEST_BLOB_UNKNOWN",
            "{held}: {status} {err}"
        );
        collection.await.unwrap();
        app.state.clear_caches();
        let tagged = app.get("/v2/race/app/manifests/v1").await;
        assert_eq!(
            tagged.header("docker-content-digest"),
            old,
            "{held}: tag put back"
        );
        assert!(pulls(&app, "race/app", "v1").await, "{held}");
        let lost = digest_of(&race_manifest(&cd, &ld));
        let by_digest = app.get(&format!("/v2/race/app/manifests/{lost}")).await;
        assert_eq!(by_digest.status, StatusCode::NOT_FOUND, "{held}: undone");
        // Pushed again, it sticks.
        app.push_blob("race/app", RACE_CONFIG).await;
        app.push_blob("race/app", RACE_LAYER).await;
        let r = app
            .put_manifest(
                "race/app",
                "v2",
                media::OCI_MANIFEST,
                &race_manifest(&cd, &ld),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{held}");
        assert!(pulls(&app, "race/app", "v2").await, "{held}");
        assert_eq!(records_left(&s).await, 0, "{held}");
    }
}

/// The push is held after its checks refreshed the blobs and before it commits; a whole
/// collection runs in between and removes them (grace 0: nothing protects them). The
/// push notices after committing and undoes it.
#[tokio::test]
async fn a_whole_collection_between_refresh_and_commit_is_noticed() {
    let (app, s) = gated_app();
    let cd = app.push_blob("race/app", RACE_CONFIG).await;
    let ld = app.push_blob("race/app", RACE_LAYER).await;
    let committing = s.arm("manifest_put");
    let push = {
        let router = app.router.clone();
        let doc = race_manifest(&cd, &ld);
        tokio::spawn(async move {
            let req = Request::builder()
                .method(Method::PUT)
                .uri("/v2/race/app/manifests/v1")
                .header("content-type", media::OCI_MANIFEST)
                .body(Body::from(doc))
                .unwrap();
            let resp = router.oneshot(req).await.unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, body)
        })
    };
    committing.reached().await;
    let report = collect_now(&s).await.unwrap();
    assert_eq!(report.blobs_deleted, 2, "{report:?}");
    committing.release();
    let (status, body) = push.await.unwrap();
    let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        status.is_client_error() && err["errors"][0]["code"] == "MANIFEST_BLOB_UNKNOWN",
        "{status} {err}"
    );
    app.state.clear_caches();
    assert_eq!(
        app.get("/v2/race/app/manifests/v1").await.status,
        StatusCode::NOT_FOUND
    );
}

/// The blob phase: a collection decided to delete a stored blob no repository linked;
/// then a client pushed that blob again, linked it and committed a manifest naming it.
#[tokio::test]
async fn gc_that_decided_to_delete_an_unlinked_blob_spares_it_once_pushed() {
    let (app, s) = gated_app();
    let ld = digest_of(RACE_LAYER);
    s.inner
        .blob_put(
            &td(&ld),
            Box::pin(futures_util::stream::iter([Ok(Bytes::from_static(
                RACE_LAYER,
            ))])),
            1 << 20,
        )
        .await
        .unwrap();
    let decided = s.arm_any(&["gc_record_put deleting", "blob_delete"]);
    let collection = collect_now(&s);
    decided.reached().await;
    let cd = app.push_blob("race/app", RACE_CONFIG).await;
    app.push_blob("race/app", RACE_LAYER).await;
    let r = app
        .put_manifest(
            "race/app",
            "v1",
            media::OCI_MANIFEST,
            &race_manifest(&cd, &ld),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    decided.release();
    let report = collection.await.unwrap();
    assert_eq!(report.blobs_deleted, 0, "{report:?}");
    app.state.clear_caches();
    assert!(pulls(&app, "race/app", "v1").await);
}

/// Sparse manifests (the default) accept a layer that is not in the repository — but not
/// one the client pushed and a collection removed before the manifest arrived: that is
/// content lost, not a gap, and a tag set on it would not pull. The interleaving of the
/// security test's failure: the collection removes the layer's link, and before it gets
/// to the config the push finds the config present (refreshing it) and the layer absent,
/// commits, and pins the config, which the collection then spares; the push must refuse
/// (MANIFEST_BLOB_UNKNOWN, so the client pushes the layer again) instead of answering 201.
#[tokio::test]
async fn a_layer_a_collection_removed_before_the_manifest_is_not_a_sparse_gap() {
    let (app, s) = gated_app();
    let cd = digest_of(RACE_CONFIG);
    // A layer the collection reaches before the config (links are swept in digest order).
    let layer: Vec<u8> = (0u32..)
        .map(|i| format!("race layer {i}").into_bytes())
        .find(|l| digest_of(l) < cd)
        .unwrap();
    let manifest = image_manifest(
        media::OCI_CONFIG,
        &cd,
        RACE_CONFIG.len(),
        &[(digest_of(&layer).as_str(), layer.len())],
        None,
        None,
    );
    app.push_blob("race/app", RACE_CONFIG).await;
    let ld = app.push_blob("race/app", &layer).await;
    // Hold the collection after it removed the layer's link, before its config removal.
    let unlinking = s.arm("unlink_blob");
    let collection = collect_now(&s);
    unlinking.reached().await;
    let at_config = s.arm("gc_record_put deleting");
    unlinking.release();
    at_config.reached().await;
    assert!(
        !s.inner
            .blob_linked(&tr("race/app"), &td(&ld))
            .await
            .unwrap()
    );
    assert!(
        s.inner
            .blob_linked(&tr("race/app"), &td(&cd))
            .await
            .unwrap()
    );
    let r = app
        .put_manifest("race/app", "v1", media::OCI_MANIFEST, &manifest)
        .await;
    at_config.release();
    collection.await.unwrap();
    app.state.clear_caches();
    assert!(
        r.status.is_client_error() && r.error_code() == "MANIFEST_BLOB_UNKNOWN",
        "a tag on a removed layer: {} {:?}",
        r.status,
        r.body
    );
    assert_eq!(
        app.get("/v2/race/app/manifests/v1").await.status,
        StatusCode::NOT_FOUND
    );
    // Pushed again, it sticks and pulls.
    app.push_blob("race/app", RACE_CONFIG).await;
    app.push_blob("race/app", &layer).await;
    let r = app
        .put_manifest("race/app", "v1", media::OCI_MANIFEST, &manifest)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    assert!(pulls(&app, "race/app", "v1").await);
    // A layer never pushed is still a gap a sparse manifest may leave.
    let never = digest_of(b"never pushed");
    let sparse = image_manifest(
        media::OCI_CONFIG,
        &cd,
        RACE_CONFIG.len(),
        &[(never.as_str(), 12)],
        None,
        None,
    );
    let r = app
        .put_manifest("race/app", "sparse", media::OCI_MANIFEST, &sparse)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
}
