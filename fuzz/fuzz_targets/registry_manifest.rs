//! Fuzzes the manifest validation the registry runs on `PUT /v2/<name>/manifests/<ref>`,
//! and the two other readers of the same documents: the client's `mediaType` sniffing and
//! the pull-through cache's list of referenced blobs. Whatever the server accepts must be
//! a JSON object with a well-formed media type (never Docker schema 1), name only valid
//! sha256 digests with sizes that fit, and agree with the other readers: the cache must
//! see every blob the server links, and the client the same media type.
#![no_main]

use ferry_registry::fuzz_api::{cache_referenced_blobs, validate_manifest};
use ferry_registry_client::fuzz_api::document_media_type;
use ferry_registry::server::routes::parse_digest;
use libfuzzer_sys::fuzz_target;

const CONTENT_TYPES: &[&str] = &[
    "",
    "application/json",
    "application/octet-stream",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
    "application/vnd.oci.artifact.manifest.v1+json; charset=utf-8",
    "Application/VND.OCI.Image.Manifest.v1+JSON",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let content_type = CONTENT_TYPES[usize::from(selector) % CONTENT_TYPES.len()];
    let referenced = cache_referenced_blobs(body);
    for hex in &referenced {
        assert!(parse_digest(&format!("sha256:{hex}")).is_ok(), "cache took {hex:?}");
    }
    let client_media_type = document_media_type(body);

    let Ok(v) = validate_manifest(body, content_type) else {
        return;
    };
    let value: serde_json::Value =
        serde_json::from_slice(body).expect("an accepted manifest is JSON");
    assert!(value.is_object(), "accepted a manifest that is not a JSON object");
    assert!(v.media_type.len() <= 255 && v.media_type.contains('/'));
    assert!(!v.media_type.starts_with("application/vnd.docker.distribution.manifest.v1"));
    let declared = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let generic = ["", "application/json", "application/octet-stream"].contains(&declared.as_str());
    if !generic {
        assert_eq!(v.media_type, declared, "stored type differs from Content-Type");
    }
    if let Some(doc_type) = value.get("mediaType").and_then(|m| m.as_str()) {
        assert_eq!(v.media_type, doc_type);
        if !doc_type.is_empty() {
            assert_eq!(client_media_type.as_deref(), Some(doc_type));
        }
    }
    for (digest, size) in v.blobs.iter().chain(&v.children) {
        assert!(parse_digest(digest).is_ok(), "accepted digest {digest:?}");
        assert!(*size <= i64::MAX as u64);
    }
    if let Some(subject) = &v.subject {
        assert!(parse_digest(subject).is_ok(), "accepted subject {subject:?}");
    }
    for (digest, _) in &v.blobs {
        let hex = &digest["sha256:".len()..];
        assert!(
            referenced.iter().any(|r| r == hex),
            "server links {digest} but the cache would not"
        );
    }
});
