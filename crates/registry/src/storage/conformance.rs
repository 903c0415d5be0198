//! One test suite every [`Storage`] backend must pass, so the memory backend the other
//! modules test against means something for the real ones.
//!
//! Compiled into the library's unit tests (run against memory and filesystem backends)
//! and, through `#[path]`, into `tests/s3.rs` (run against a real S3 server); it therefore
//! names the storage module only as `super::` and uses only its public API. Every run
//! expects an empty store.

#![allow(clippy::unwrap_used, dead_code)]

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use sha2::{Digest as _, Sha256};

use ferry_oci::{Digest, RepositoryName, Tag};

use super::{BlobRead, ByteStream, Storage, StorageError, StoredManifest};

/// Test names, tags and digests, parsed by ferry-oci's validators (as the HTTP layer
/// parses what clients send) so the checks below can spell them as text.
pub fn tr(s: &str) -> RepositoryName {
    RepositoryName::parse(s).unwrap()
}
pub fn tt(s: &str) -> Tag {
    Tag::parse(s).unwrap()
}
pub fn td(s: &str) -> Digest {
    ferry_oci::digest::parse(s).unwrap()
}

pub const LIMIT: u64 = 64 << 20;

/// `sha256:<hex>` of `data`.
pub fn digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// A body made of `chunks`.
pub fn body(chunks: &[&[u8]]) -> ByteStream {
    let chunks: Vec<Result<Bytes, std::io::Error>> = chunks
        .iter()
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    Box::pin(futures_util::stream::iter(chunks))
}

/// A body that yields `first` and then fails, like a client that hung up.
pub fn failing_body(first: &[u8]) -> ByteStream {
    let items: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::copy_from_slice(first)),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "client went away",
        )),
    ];
    Box::pin(futures_util::stream::iter(items))
}

pub async fn read_all(read: BlobRead) -> Vec<u8> {
    let mut body = read.body;
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk.unwrap());
    }
    out
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

pub fn manifest_json(config: &str, layers: &[&str], subject: Option<&str>) -> Vec<u8> {
    let desc = |d: &str| serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": 1});
    let mut doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": desc(config),
        "layers": layers.iter().map(|d| desc(d)).collect::<Vec<_>>(),
    });
    if let Some(s) = subject {
        doc["subject"] = desc(s);
    }
    serde_json::to_vec(&doc).unwrap()
}

pub fn stored(bytes: Vec<u8>) -> StoredManifest {
    StoredManifest {
        digest: digest(&bytes),
        media_type: "application/vnd.oci.image.manifest.v1+json".to_string(),
        bytes: bytes.into(),
    }
}

/// Runs every check against `s`, which must start empty.
pub async fn run(s: &dyn Storage) {
    blobs(s).await;
    uploads(s).await;
    links(s).await;
    manifests_and_tags(s).await;
    referrers(s).await;
    listing(s).await;
    invalid_names(s).await;
    gc_records(s).await;
}

/// Garbage collection's coordination records: written, seen, listed with a time that a
/// rewrite refreshes, removed; nothing outside the three directories or with a name that
/// could be a path.
async fn gc_records(s: &dyn Storage) {
    let id = "0123456789abcdef0123456789abcdef";
    let pin = format!("{id}-{}", "ab".repeat(32));
    for dir in super::gc::RECORD_DIRS {
        assert!(s.gc_record_list(dir).await.unwrap().is_empty(), "{dir}");
    }
    assert!(!s.gc_record_exists("pins", &pin).await.unwrap());
    s.gc_record_put("running", id).await.unwrap();
    s.gc_record_put("pins", &pin).await.unwrap();
    assert!(s.gc_record_exists("pins", &pin).await.unwrap());
    assert!(
        !s.gc_record_exists("deleting", &pin).await.unwrap(),
        "dirs are apart"
    );
    let listed = s.gc_record_list("running").await.unwrap();
    assert_eq!(
        listed.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        [id]
    );
    let first = listed[0].1;
    let age = std::time::SystemTime::now()
        .duration_since(first)
        .unwrap_or_default();
    assert!(
        age < Duration::from_secs(300),
        "a fresh record's time: {age:?}"
    );
    // A rewrite refreshes the time (S3 stamps to the second).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    s.gc_record_put("running", id).await.unwrap();
    let again = s.gc_record_list("running").await.unwrap();
    assert_eq!(again.len(), 1);
    assert!(again[0].1 > first, "{:?} then {:?}", first, again[0].1);
    // Sorted by name.
    s.gc_record_put("pins", "0-a").await.unwrap();
    let pins: Vec<String> = s
        .gc_record_list("pins")
        .await
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(pins, ["0-a".to_string(), pin.clone()]);
    assert!(s.gc_record_delete("pins", &pin).await.unwrap());
    assert!(!s.gc_record_delete("pins", &pin).await.unwrap());
    assert!(!s.gc_record_exists("pins", &pin).await.unwrap());
    assert!(s.gc_record_delete("pins", "0-a").await.unwrap());
    assert!(s.gc_record_delete("running", id).await.unwrap());
    for dir in super::gc::RECORD_DIRS {
        assert!(s.gc_record_list(dir).await.unwrap().is_empty(), "{dir}");
    }
    for (dir, name) in [
        ("other", "x"),
        ("../running", "x"),
        ("pins", ""),
        ("pins", "../x"),
        ("pins", "a/b"),
        ("pins", "UPPER"),
        ("pins", &"a".repeat(201)),
    ] {
        let err = s.gc_record_put(dir, name).await.unwrap_err();
        assert!(
            matches!(err, StorageError::Invalid(_)),
            "{dir}/{name}: {err:?}"
        );
        assert!(s.gc_record_exists(dir, name).await.is_err(), "{dir}/{name}");
        assert!(s.gc_record_delete(dir, name).await.is_err(), "{dir}/{name}");
    }
    assert!(s.gc_record_list("../pins").await.is_err());
    // Records are not repositories.
    assert!(
        !s.repo_list()
            .await
            .unwrap()
            .iter()
            .any(|r| r.starts_with("gc")),
    );
}

async fn blobs(s: &dyn Storage) {
    let data = b"hello blob".to_vec();
    let d = digest(&data);
    assert_eq!(s.blob_size(&td(&d)).await.unwrap(), None);
    assert!(s.blob_read(&td(&d), None).await.unwrap().is_none());

    assert_eq!(
        s.blob_put(&td(&d), body(&[b"hello ", b"blob"]), LIMIT)
            .await
            .unwrap(),
        10
    );
    assert_eq!(s.blob_size(&td(&d)).await.unwrap(), Some(10));
    let read = s.blob_read(&td(&d), None).await.unwrap().unwrap();
    assert_eq!(read.size, 10);
    assert_eq!(read_all(read).await, data);
    let read = s.blob_read(&td(&d), Some(2..7)).await.unwrap().unwrap();
    assert_eq!(read.size, 10, "size is the whole blob's, not the range's");
    assert_eq!(read_all(read).await, b"llo b");
    let read = s.blob_read(&td(&d), Some(9..10)).await.unwrap().unwrap();
    assert_eq!(read_all(read).await, b"b");
    // Idempotent.
    assert_eq!(
        s.blob_put(&td(&d), body(&[&data]), LIMIT).await.unwrap(),
        10
    );
    // A stored blob's digest with other bytes, or none, is still refused: a push proves
    // possession of the bytes (issue 11: linking any blob by naming its digest).
    for wrong in [&[][..], &b"not the blob"[..]] {
        let err = s
            .blob_put(&td(&d), body(&[wrong]), LIMIT)
            .await
            .unwrap_err();
        assert!(
            matches!(err, StorageError::DigestMismatch { .. }),
            "{err:?}"
        );
    }
    let read = s.blob_read(&td(&d), None).await.unwrap().unwrap();
    assert_eq!(read_all(read).await, data, "the stored blob is untouched");

    // Wrong content: nothing committed under either digest.
    let claimed = digest(b"something else");
    let err = s
        .blob_put(&td(&claimed), body(&[b"not it"]), LIMIT)
        .await
        .unwrap_err();
    match err {
        StorageError::DigestMismatch { expected, actual } => {
            assert_eq!(expected, claimed);
            assert_eq!(actual, digest(b"not it"));
        }
        other => panic!("expected DigestMismatch, got {other:?}"),
    }
    assert_eq!(s.blob_size(&td(&claimed)).await.unwrap(), None);
    assert_eq!(s.blob_size(&td(&digest(b"not it"))).await.unwrap(), None);

    // Over the limit.
    let big = pattern(100, 1);
    let err = s
        .blob_put(&td(&digest(&big)), body(&[&big[..60], &big[60..]]), 99)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StorageError::TooLarge { limit: 99 }),
        "{err:?}"
    );
    assert_eq!(s.blob_size(&td(&digest(&big))).await.unwrap(), None);
    assert_eq!(
        s.blob_put(&td(&digest(&big)), body(&[&big]), 100)
            .await
            .unwrap(),
        100
    );

    // Client hung up.
    let partial = b"partial".to_vec();
    let err = s
        .blob_put(&td(&digest(&partial)), failing_body(&partial), LIMIT)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Body(_)), "{err:?}");
    assert_eq!(s.blob_size(&td(&digest(&partial))).await.unwrap(), None);

    // Empty blob.
    let empty = digest(b"");
    assert_eq!(s.blob_put(&td(&empty), body(&[]), LIMIT).await.unwrap(), 0);
    let read = s.blob_read(&td(&empty), None).await.unwrap().unwrap();
    assert_eq!((read.size, read_all(read).await), (0, vec![]));

    let list = s.blob_list().await.unwrap();
    let digests: Vec<&str> = list.iter().map(|b| b.digest.as_str()).collect();
    let mut expected = vec![d.as_str(), empty.as_str()];
    let big_digest = digest(&big);
    expected.push(&big_digest);
    expected.sort();
    assert_eq!(digests, expected);
    assert_eq!(
        list.iter().find(|b| b.digest == big_digest).unwrap().size,
        100
    );

    assert!(s.blob_delete(&td(&big_digest)).await.unwrap());
    assert!(!s.blob_delete(&td(&big_digest)).await.unwrap());
    assert_eq!(s.blob_size(&td(&big_digest)).await.unwrap(), None);
    assert!(s.blob_delete(&td(&empty)).await.unwrap());
}

async fn uploads(s: &dyn Storage) {
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    assert!(
        id.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "id {id:?} is not URL-safe"
    );
    assert_ne!(
        s.upload_start(&tr("conformance/repo")).await.unwrap(),
        id,
        "ids are unique"
    );
    assert_eq!(s.upload_size(&id).await.unwrap(), Some(0));

    let data = pattern(3 * 1024 * 1024 + 17, 7);
    let (a, rest) = data.split_at(1000);
    let (b, c) = rest.split_at(2 * 1024 * 1024);
    assert_eq!(
        s.upload_append(&id, 0, body(&[a]), LIMIT).await.unwrap(),
        1000
    );
    assert_eq!(s.upload_size(&id).await.unwrap(), Some(1000));

    // Out of order: nothing changes.
    match s
        .upload_append(&id, 999, body(&[b"x"]), LIMIT)
        .await
        .unwrap_err()
    {
        StorageError::OutOfOrder { have, got } => assert_eq!((have, got), (1000, 999)),
        other => panic!("expected OutOfOrder, got {other:?}"),
    }
    match s
        .upload_append(&id, 1001, body(&[b"x"]), LIMIT)
        .await
        .unwrap_err()
    {
        StorageError::OutOfOrder { have, got } => assert_eq!((have, got), (1000, 1001)),
        other => panic!("expected OutOfOrder, got {other:?}"),
    }
    // Over the session limit: the chunk is not kept.
    let err = s
        .upload_append(&id, 1000, body(&[&b[..10], &b[10..20]]), 1015)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StorageError::TooLarge { limit: 1015 }),
        "{err:?}"
    );
    assert_eq!(s.upload_size(&id).await.unwrap(), Some(1000));
    // Client hung up mid-chunk: the chunk is not kept.
    let err = s
        .upload_append(&id, 1000, failing_body(&b[..5]), LIMIT)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Body(_)), "{err:?}");
    assert_eq!(s.upload_size(&id).await.unwrap(), Some(1000));

    let chunks: Vec<&[u8]> = b.chunks(100_000).collect();
    assert_eq!(
        s.upload_append(&id, 1000, body(&chunks), LIMIT)
            .await
            .unwrap(),
        1000 + b.len() as u64
    );
    assert_eq!(
        s.upload_append(&id, 1000 + b.len() as u64, body(&[c]), LIMIT)
            .await
            .unwrap(),
        data.len() as u64
    );
    let d = digest(&data);
    assert_eq!(
        s.blob_size(&td(&d)).await.unwrap(),
        None,
        "not visible before finish"
    );
    assert_eq!(
        s.upload_finish(&id, &td(&d)).await.unwrap(),
        data.len() as u64
    );
    assert_eq!(s.upload_size(&id).await.unwrap(), None, "session dropped");
    assert_eq!(s.blob_size(&td(&d)).await.unwrap(), Some(data.len() as u64));
    let read = s
        .blob_read(&td(&d), Some(999..1_500_000))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read_all(read).await, &data[999..1_500_000]);
    let read = s.blob_read(&td(&d), None).await.unwrap().unwrap();
    assert!(read_all(read).await == data);

    // Digest mismatch: nothing committed, session dropped.
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    s.upload_append(&id, 0, body(&[b"abc"]), LIMIT)
        .await
        .unwrap();
    let wrong = digest(b"abd");
    match s.upload_finish(&id, &td(&wrong)).await.unwrap_err() {
        StorageError::DigestMismatch { expected, actual } => {
            assert_eq!(expected, wrong);
            assert_eq!(actual, digest(b"abc"));
        }
        other => panic!("expected DigestMismatch, got {other:?}"),
    }
    assert_eq!(s.blob_size(&td(&wrong)).await.unwrap(), None);
    assert_eq!(s.blob_size(&td(&digest(b"abc"))).await.unwrap(), None);
    assert_eq!(s.upload_size(&id).await.unwrap(), None);

    // A session with no appends is the empty blob; finishing an existing blob is fine.
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    assert_eq!(s.upload_finish(&id, &td(&digest(b""))).await.unwrap(), 0);
    assert_eq!(s.blob_size(&td(&digest(b""))).await.unwrap(), Some(0));
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    s.upload_append(&id, 0, body(&[&data]), LIMIT)
        .await
        .unwrap();
    assert_eq!(
        s.upload_finish(&id, &td(&d)).await.unwrap(),
        data.len() as u64
    );

    // Unknown sessions, including garbage ids.
    for bad in ["0123456789abcdef0123456789abcdef", "nope", "../../etc", ""] {
        assert_eq!(s.upload_size(bad).await.unwrap(), None, "{bad}");
        let err = s
            .upload_append(bad, 0, body(&[b"x"]), LIMIT)
            .await
            .unwrap_err();
        assert!(
            matches!(err, StorageError::UploadUnknown(_)),
            "{bad}: {err:?}"
        );
        let err = s.upload_finish(bad, &td(&digest(b"x"))).await.unwrap_err();
        assert!(
            matches!(err, StorageError::UploadUnknown(_)),
            "{bad}: {err:?}"
        );
        assert!(!s.upload_cancel(bad).await.unwrap(), "{bad}");
    }

    // Cancel; stale listing.
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    s.upload_append(&id, 0, body(&[b"xyz"]), LIMIT)
        .await
        .unwrap();
    assert!(
        s.upload_list_stale(Duration::ZERO)
            .await
            .unwrap()
            .contains(&id)
    );
    assert!(
        !s.upload_list_stale(Duration::from_secs(3600))
            .await
            .unwrap()
            .contains(&id)
    );
    assert!(s.upload_cancel(&id).await.unwrap());
    assert!(!s.upload_cancel(&id).await.unwrap());
    assert_eq!(s.upload_size(&id).await.unwrap(), None);
    assert!(matches!(
        s.upload_append(&id, 3, body(&[b"x"]), LIMIT)
            .await
            .unwrap_err(),
        StorageError::UploadUnknown(_)
    ));
    assert_eq!(s.blob_size(&td(&digest(b"xyz"))).await.unwrap(), None);
    // Leave nothing behind for the later checks.
    for id in s.upload_list_stale(Duration::ZERO).await.unwrap() {
        s.upload_cancel(&id).await.unwrap();
    }
}

async fn links(s: &dyn Storage) {
    let d = digest(b"linked");
    s.blob_put(&td(&d), body(&[b"linked"]), LIMIT)
        .await
        .unwrap();
    assert!(!s.blob_linked(&tr("links/one"), &td(&d)).await.unwrap());
    s.link_blob(&tr("links/one"), &td(&d)).await.unwrap();
    s.link_blob(&tr("links/one"), &td(&d)).await.unwrap(); // idempotent
    assert!(s.blob_linked(&tr("links/one"), &td(&d)).await.unwrap());
    assert!(!s.blob_linked(&tr("links/two"), &td(&d)).await.unwrap());
    assert!(!s.blob_linked(&tr("links"), &td(&d)).await.unwrap());
    assert_eq!(
        s.repo_blobs(&tr("links/one")).await.unwrap(),
        vec![d.clone()]
    );
    let infos = s.repo_blob_links(&tr("links/one")).await.unwrap();
    assert_eq!(infos.len(), 1);
    assert_eq!(infos[0].digest, d);
    assert!(s.repo_blobs(&tr("links/two")).await.unwrap().is_empty());
    // A repository that only linked blobs exists, with no tags.
    assert_eq!(s.tag_list(&tr("links/one")).await.unwrap(), Some(vec![]));
    assert!(s.unlink_blob(&tr("links/one"), &td(&d)).await.unwrap());
    assert!(!s.unlink_blob(&tr("links/one"), &td(&d)).await.unwrap());
    assert!(!s.blob_linked(&tr("links/one"), &td(&d)).await.unwrap());
    assert_eq!(
        s.blob_size(&td(&d)).await.unwrap(),
        Some(6),
        "unlinking keeps the blob"
    );
    s.link_blob(&tr("links/one"), &td(&d)).await.unwrap();
}

async fn manifests_and_tags(s: &dyn Storage) {
    let repo = "app/web";
    let m1 = stored(manifest_json(&digest(b"c1"), &[&digest(b"l1")], None));
    let m2 = stored(manifest_json(&digest(b"c2"), &[], None));
    assert!(
        s.manifest_get(&tr(repo), &td(&m1.digest))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        s.tag_list(&tr(repo)).await.unwrap(),
        None,
        "unknown repository"
    );

    let mut bad = m1.clone();
    bad.digest = m2.digest.clone();
    assert!(matches!(
        s.manifest_put(&tr(repo), &bad).await.unwrap_err(),
        StorageError::DigestMismatch { .. }
    ));
    assert!(
        s.manifest_get(&tr(repo), &td(&m2.digest))
            .await
            .unwrap()
            .is_none()
    );

    s.manifest_put(&tr(repo), &m1).await.unwrap();
    s.manifest_put(&tr(repo), &m1).await.unwrap(); // idempotent
    let mut index = m2.clone();
    index.media_type = "application/vnd.oci.image.index.v1+json".into();
    s.manifest_put(&tr(repo), &index).await.unwrap();
    let got = s
        .manifest_get(&tr(repo), &td(&m1.digest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (got.digest, got.media_type, got.bytes),
        (m1.digest.clone(), m1.media_type.clone(), m1.bytes.clone())
    );
    assert_eq!(
        s.manifest_get(&tr(repo), &td(&m2.digest))
            .await
            .unwrap()
            .unwrap()
            .media_type,
        index.media_type
    );
    assert!(
        s.manifest_get(&tr("app/other"), &td(&m1.digest))
            .await
            .unwrap()
            .is_none(),
        "linked per repository"
    );
    assert_eq!(
        s.blob_size(&td(&m1.digest)).await.unwrap(),
        Some(m1.bytes.len() as u64),
        "stored as a blob"
    );
    let mut expected = vec![m1.digest.clone(), m2.digest.clone()];
    expected.sort();
    assert_eq!(s.manifest_list(&tr(repo)).await.unwrap(), expected);
    assert_eq!(
        s.manifest_links(&tr(repo))
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.digest)
            .collect::<Vec<_>>(),
        expected
    );

    for tag in ["v2", "latest", "V1", "1.0", "_x", "a-b"] {
        s.tag_set(&tr(repo), &tt(tag), &td(&m1.digest))
            .await
            .unwrap();
    }
    assert_eq!(
        s.tag_get(&tr(repo), &tt("v2")).await.unwrap(),
        Some(m1.digest.clone())
    );
    assert_eq!(s.tag_get(&tr(repo), &tt("nope")).await.unwrap(), None);
    s.tag_set(&tr(repo), &tt("v2"), &td(&m2.digest))
        .await
        .unwrap(); // move
    assert_eq!(
        s.tag_get(&tr(repo), &tt("v2")).await.unwrap(),
        Some(m2.digest.clone())
    );
    assert_eq!(
        s.tag_list(&tr(repo)).await.unwrap().unwrap(),
        vec!["1.0", "V1", "_x", "a-b", "latest", "v2"]
    );
    assert!(s.tag_delete(&tr(repo), &tt("a-b")).await.unwrap());
    assert!(!s.tag_delete(&tr(repo), &tt("a-b")).await.unwrap());
    assert_eq!(s.tag_get(&tr(repo), &tt("a-b")).await.unwrap(), None);

    // Deleting a manifest removes the tags pointing at it, and only those.
    assert!(s.manifest_delete(&tr(repo), &td(&m1.digest)).await.unwrap());
    assert!(!s.manifest_delete(&tr(repo), &td(&m1.digest)).await.unwrap());
    assert!(
        s.manifest_get(&tr(repo), &td(&m1.digest))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(s.tag_list(&tr(repo)).await.unwrap().unwrap(), vec!["v2"]);
    assert_eq!(
        s.manifest_list(&tr(repo)).await.unwrap(),
        vec![m2.digest.clone()]
    );
    assert!(
        s.manifest_get(&tr(repo), &td(&m2.digest))
            .await
            .unwrap()
            .is_some()
    );
}

async fn referrers(s: &dyn Storage) {
    let repo = "refs";
    let subject = stored(manifest_json(&digest(b"c"), &[], None));
    let sig = stored(manifest_json(&digest(b"sig"), &[], Some(&subject.digest)));
    let sbom = stored(manifest_json(&digest(b"sbom"), &[], Some(&subject.digest)));
    let never_pushed = digest(b"never pushed");
    s.manifest_put(&tr(repo), &subject).await.unwrap();
    assert!(
        s.referrer_list(&tr(repo), &td(&subject.digest))
            .await
            .unwrap()
            .is_empty()
    );
    for m in [&sig, &sbom] {
        s.manifest_put(&tr(repo), m).await.unwrap();
        s.referrer_add(&tr(repo), &td(&subject.digest), &td(&m.digest))
            .await
            .unwrap();
    }
    s.referrer_add(&tr(repo), &td(&subject.digest), &td(&sig.digest))
        .await
        .unwrap(); // idempotent
    s.referrer_add(&tr(repo), &td(&subject.digest), &td(&never_pushed))
        .await
        .unwrap();
    let mut expected = vec![sig.digest.clone(), sbom.digest.clone()];
    expected.sort();
    let mut got = s
        .referrer_list(&tr(repo), &td(&subject.digest))
        .await
        .unwrap();
    got.sort();
    assert_eq!(got, expected, "referrers without a manifest are skipped");
    assert!(
        s.referrer_list(&tr("refs/other"), &td(&subject.digest))
            .await
            .unwrap()
            .is_empty()
    );
    s.manifest_delete(&tr(repo), &td(&sig.digest))
        .await
        .unwrap();
    assert_eq!(
        s.referrer_list(&tr(repo), &td(&subject.digest))
            .await
            .unwrap(),
        vec![sbom.digest.clone()]
    );
}

async fn listing(s: &dyn Storage) {
    let d = digest(b"listing");
    s.blob_put(&td(&d), body(&[b"listing"]), LIMIT)
        .await
        .unwrap();
    for repo in ["zeta", "a/b/c", "a-b", "a", "a/b"] {
        s.link_blob(&tr(repo), &td(&d)).await.unwrap();
    }
    let repos = s.repo_list().await.unwrap();
    let mut sorted = repos.clone();
    sorted.sort();
    assert_eq!(repos, sorted, "sorted");
    assert_eq!(
        repos,
        vec![
            "a",
            "a-b",
            "a/b",
            "a/b/c",
            "app/web",
            "links/one",
            "refs",
            "zeta"
        ]
    );
}

/// What a backend refuses itself, names and tags being typed: digests of algorithms
/// other than sha256 and sha512 (valid digests, so they reach it) and upload ids it never issued.
async fn invalid_names(s: &dyn Storage) {
    let sha384 = format!("sha384:{}", "ab".repeat(48));
    let name = "a";
    let err = s.blob_size(&td(&sha384)).await.unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err:?}");
    let err = s.blob_linked(&tr(name), &td(&sha384)).await.unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err:?}");
    let err = s.link_blob(&tr(name), &td(&sha384)).await.unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err:?}");
    let err = s.manifest_get(&tr(name), &td(&sha384)).await.unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err:?}");
    for id in ["../x", "", "0123", &"A".repeat(32)] {
        assert!(s.upload_size(id).await.unwrap().is_none(), "{id:?}");
        assert!(s.upload_repo(id).await.unwrap().is_none(), "{id:?}");
    }
}

/// Appends racing for the same offset: exactly one wins, the other is out of order, and
/// the session holds the winner's bytes only.
pub async fn racing_appends(s: &dyn Storage) {
    let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
    let one = pattern(300_000, 1);
    let two = pattern(300_000, 2);
    let (r1, r2) = tokio::join!(
        s.upload_append(&id, 0, body(&[&one]), LIMIT),
        s.upload_append(&id, 0, body(&[&two]), LIMIT)
    );
    let winner = match (r1, r2) {
        (Ok(n), Err(StorageError::OutOfOrder { .. })) => {
            assert_eq!(n, 300_000);
            one
        }
        (Err(StorageError::OutOfOrder { .. }), Ok(n)) => {
            assert_eq!(n, 300_000);
            two
        }
        other => panic!("expected one winner, got {other:?}"),
    };
    assert_eq!(
        s.upload_finish(&id, &td(&digest(&winner))).await.unwrap(),
        300_000
    );
}
