//! The S3 backend against a real S3-protocol server: the shared storage conformance suite,
//! multipart commits, replicas sharing upload sessions, and presigned redirects fetched
//! over HTTP.
//!
//! Needs `FERRY_TEST_S3_ENDPOINT`, `FERRY_TEST_S3_BUCKET` and optionally
//! `FERRY_TEST_S3_REGION`, `FERRY_TEST_S3_ACCESS_KEY_ID`, `FERRY_TEST_S3_SECRET_ACCESS_KEY`
//! (`eval "$(bash scripts/s3-server.sh)"` starts one and prints them). Without them each
//! test prints a skip line and passes. Every test works under its own key prefix, so runs
//! never see each other's objects.

#![allow(clippy::unwrap_used)]

// The shared suite names the storage module as `super::`: here, this crate root.
#[path = "../src/storage/conformance.rs"]
mod conformance;
use ferry_registry::storage::{self, BlobRead, ByteStream, StoredManifest};

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use conformance::{LIMIT, body, digest, pattern, read_all, td, tr, tt};
use ferry_registry::storage::gc::{self, GcOptions};
use ferry_registry::storage::s3::{S3Config, S3Storage};
use ferry_registry::storage::{Storage, StorageConfig, StorageError};

fn config(test: &str) -> Option<S3Config> {
    let Ok(endpoint) = std::env::var("FERRY_TEST_S3_ENDPOINT") else {
        println!(
            "SKIP s3::{test}: FERRY_TEST_S3_ENDPOINT is not set \
             (run `eval \"$(bash scripts/s3-server.sh)\"` first)"
        );
        return None;
    };
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some(S3Config {
        bucket: var("FERRY_TEST_S3_BUCKET").unwrap_or_else(|| "ferry-test".into()),
        region: Some(var("FERRY_TEST_S3_REGION").unwrap_or_else(|| "us-east-1".into())),
        allow_http: endpoint.starts_with("http://"),
        endpoint: Some(endpoint),
        access_key_id: Some(var("FERRY_TEST_S3_ACCESS_KEY_ID").unwrap_or_else(|| "test".into())),
        secret_access_key: Some(
            var("FERRY_TEST_S3_SECRET_ACCESS_KEY").unwrap_or_else(|| "test".into()),
        ),
        prefix: format!("ferry-tests/{test}-{}-{nanos}", std::process::id()),
        ..S3Config::default()
    })
}

#[tokio::test]
async fn conformance() {
    let Some(cfg) = config("conformance") else {
        return;
    };
    let s = storage::open(&StorageConfig::S3(cfg)).await.unwrap();
    conformance::run(s.as_ref()).await;
}

#[tokio::test]
async fn large_blobs_commit_through_multipart_only_when_verified() {
    let Some(cfg) = config("multipart") else {
        return;
    };
    let s = S3Storage::open(&cfg).unwrap();
    // Larger than one multipart part, in uneven chunks across two PATCHes.
    let data = pattern(19 * 1024 * 1024 + 3, 5);
    let d = digest(&data);
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    let (a, b) = data.split_at(7 * 1024 * 1024 + 1);
    let chunks: Vec<&[u8]> = a.chunks(1 << 20).collect();
    s.upload_append(&id, 0, body(&chunks), LIMIT).await.unwrap();
    let chunks: Vec<&[u8]> = b.chunks(3 << 20).collect();
    let end = s
        .upload_append(&id, a.len() as u64, body(&chunks), LIMIT)
        .await
        .unwrap();
    assert_eq!(end, data.len() as u64);

    // A wrong digest aborts the multipart write: nothing appears, the session is gone.
    let wrong = digest(b"wrong");
    let err = s.upload_finish(&id, &td(&wrong)).await.unwrap_err();
    assert!(
        matches!(err, StorageError::DigestMismatch { .. }),
        "{err:?}"
    );
    assert_eq!(s.blob_size(&td(&wrong)).await.unwrap(), None);
    assert_eq!(s.blob_size(&td(&d)).await.unwrap(), None);
    assert_eq!(s.upload_size(&id).await.unwrap(), None);

    // blob_put of the same bytes (monolithic) goes through multipart too.
    let chunks: Vec<&[u8]> = data.chunks(2 << 20).collect();
    assert_eq!(
        s.blob_put(&td(&d), body(&chunks), LIMIT).await.unwrap(),
        data.len() as u64
    );
    let read = s
        .blob_read(&td(&d), Some(8_000_000..8_000_100))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read.size, data.len() as u64);
    assert_eq!(read_all(read).await, &data[8_000_000..8_000_100]);
    let read = s.blob_read(&td(&d), None).await.unwrap().unwrap();
    assert!(read_all(read).await == data);
}

#[tokio::test]
async fn replicas_share_upload_sessions() {
    let Some(cfg) = config("replicas") else {
        return;
    };
    let (one, two) = (
        S3Storage::open(&cfg).unwrap(),
        S3Storage::open(&cfg).unwrap(),
    );
    let data = pattern(300_000, 8);
    let id = one.upload_start(&tr("conformance/repo")).await.unwrap();
    one.upload_append(&id, 0, body(&[&data[..1000]]), LIMIT)
        .await
        .unwrap();
    assert_eq!(two.upload_size(&id).await.unwrap(), Some(1000));
    let err = two
        .upload_append(&id, 0, body(&[b"x"]), LIMIT)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StorageError::OutOfOrder { have: 1000, got: 0 }),
        "{err:?}"
    );
    two.upload_append(&id, 1000, body(&[&data[1000..]]), LIMIT)
        .await
        .unwrap();
    assert_eq!(
        one.upload_finish(&id, &td(&digest(&data))).await.unwrap(),
        300_000
    );
    let read = two
        .blob_read(&td(&digest(&data)), None)
        .await
        .unwrap()
        .unwrap();
    assert!(read_all(read).await == data);
}

#[tokio::test]
async fn presigned_redirect_serves_the_blob() {
    let Some(mut cfg) = config("redirect") else {
        return;
    };
    let plain = S3Storage::open(&cfg).unwrap();
    let data = pattern(70_000, 2);
    let d = digest(&data);
    plain
        .blob_put(&td(&d), body(&[&data]), LIMIT)
        .await
        .unwrap();
    assert_eq!(
        plain.blob_redirect(&td(&d)).await.unwrap(),
        None,
        "redirect is off by default"
    );

    cfg.redirect = true;
    cfg.redirect_expiry_secs = 120;
    let s = S3Storage::open(&cfg).unwrap();
    let url = s.blob_redirect(&td(&d)).await.unwrap().unwrap();
    assert!(url.contains("X-Amz-Signature="), "{url}");
    assert!(url.contains("X-Amz-Expires=120"), "{url}");
    // An HTTP client with no credentials fetches the bytes from the URL alone.
    let output = std::process::Command::new("curl")
        .args(["-fsS", "--max-time", "30", &url])
        .output();
    let fetched = match output {
        Ok(out) => {
            assert!(
                out.status.success(),
                "curl failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        }
        Err(_) => {
            // No curl binary: the same GET through reqwest.
            let resp = reqwest::get(&url).await.unwrap();
            assert!(resp.status().is_success(), "{}", resp.status());
            resp.bytes().await.unwrap().to_vec()
        }
    };
    assert!(
        fetched == data,
        "presigned GET returned {} bytes",
        fetched.len()
    );
}

#[tokio::test]
async fn garbage_collection_runs_on_s3() {
    let Some(cfg) = config("gc") else { return };
    let s = S3Storage::open(&cfg).unwrap();
    let keep = b"layer kept".to_vec();
    let drop = b"layer dropped".to_vec();
    for blob in [&keep, &drop] {
        s.blob_put(&td(&digest(blob)), body(&[blob]), LIMIT)
            .await
            .unwrap();
        s.link_blob(&tr("app"), &td(&digest(blob))).await.unwrap();
    }
    let m = conformance::stored(conformance::manifest_json(&digest(&keep), &[], None));
    s.manifest_put(&tr("app"), &m).await.unwrap();
    s.tag_set(&tr("app"), &tt("v1"), &td(&m.digest))
        .await
        .unwrap();
    let report = gc::collect(
        &s,
        &GcOptions {
            grace: Duration::ZERO,
            delete_untagged: false,
            dry_run: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(report.blobs_deleted, 1, "{report:?}");
    assert_eq!(s.blob_size(&td(&digest(&drop))).await.unwrap(), None);
    assert!(s.blob_size(&td(&digest(&keep))).await.unwrap().is_some());
    assert!(
        s.manifest_get(&tr("app"), &td(&m.digest))
            .await
            .unwrap()
            .is_some()
    );
}
