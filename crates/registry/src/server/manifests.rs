//! Manifests: pull by tag or digest, push with validation, delete.
//!
//! A pushed manifest's config must already be in the repository. Its layers and index
//! children must be too unless sparse manifests are accepted (`limits.sparse_manifests`,
//! the default): then absent ones are allowed — a partial copy of a multi-platform image —
//! while present ones must still match their descriptors. An absent one that a garbage
//! collection removed lately (pushed, then collected before its manifest arrived) is no
//! gap: it is refused as if sparse manifests were not accepted, so the client pushes it
//! again. With sparse manifests refused, a tag can never point at an image that cannot
//! be pulled. Foreign/non-distributable layers and layers with `urls` are exempt either
//! way: by definition they live elsewhere.
//!
//! Digests: a manifest PUT by digest is hashed with that digest's algorithm (sha256 or
//! sha512) and stored under it; one PUT by tag is hashed with sha256, the canonical
//! algorithm (the spec's default, and what a client assumes without a digest to go by).
//!
//! Tags in the query: a PUT may name tags as `?tag=a&tag=b` (distribution-spec, "pushing
//! manifests with tags"), by digest or beside its own tag; all of them are set with the
//! manifest, each accepted one listed in an `OCI-Tag` answer header. At most
//! [`MAX_TAGS_PER_PUSH`] (more: `414`); an invalid one refuses the whole push before
//! anything is stored.

use ferry_oci::{Digest, Reference, RepositoryName, Tag};
use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, StatusCode, header};
use serde::{Deserialize, Serialize};

use super::body::{check_declared_length, collect_bounded};
use super::errors::{ApiError, ErrorCode};
use super::routes::{parse_digest, parse_reference};
use super::{
    DOCKER_CONTENT_DIGEST, Handled, OCI_SUBJECT, OCI_TAG, StateInner, header_value, query_pairs,
    read_only,
};
use crate::auth::Actions;
use crate::storage::StoredManifest;
use ferry_oci::media;

/// Most tags one manifest PUT sets (its own and `?tag=` ones together); the spec asks for
/// at least 10.
pub(crate) const MAX_TAGS_PER_PUSH: usize = 64;

/// The tags a manifest PUT sets: the reference's own (if it is a tag) and every `?tag=`,
/// once each, in the order given.
fn tags_of_push(parts: &Parts, parsed: &Reference) -> Result<Vec<Tag>, ApiError> {
    let mut tags: Vec<Tag> = Vec::new();
    if let Reference::Tag(t) = parsed {
        tags.push(t.clone());
    }
    for (k, v) in query_pairs(parts) {
        if k != "tag" {
            continue;
        }
        let tag = super::routes::parse_tag(&v)?;
        if !tags.contains(&tag) {
            if tags.len() == MAX_TAGS_PER_PUSH {
                return Err(ApiError::new(
                    ErrorCode::ManifestInvalid,
                    format!("at most {MAX_TAGS_PER_PUSH} tags per manifest push"),
                )
                .with_status(StatusCode::URI_TOO_LONG));
            }
            tags.push(tag);
        }
    }
    Ok(tags)
}

/// Media types a manifest PUT may declare as Content-Type without naming a format.
const GENERIC_CONTENT_TYPES: &[&str] = &["", "application/json", "application/octet-stream"];

/// The empty JSON blob `{}` OCI artifacts use as config; created on demand (under sha256
/// or sha512) if a client references it without pushing it.
const EMPTY_JSON: &[u8] = b"{}";

/// The fields of a manifest or index the registry looks at. Unknown fields are allowed
/// (they are part of the content, which is stored byte for byte).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ManifestDoc {
    schema_version: Option<i64>,
    media_type: Option<String>,
    artifact_type: Option<String>,
    config: Option<DescriptorDoc>,
    layers: Option<Vec<DescriptorDoc>>,
    manifests: Option<Vec<DescriptorDoc>>,
    /// Deprecated OCI artifact manifests listed blobs here.
    blobs: Option<Vec<DescriptorDoc>>,
    subject: Option<DescriptorDoc>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct DescriptorDoc {
    media_type: String,
    digest: String,
    size: i64,
    #[serde(default)]
    urls: Vec<String>,
}

/// A referrer as listed by the referrers API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(super) struct ReferrerDescriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// The referrers-API descriptor of a stored manifest (`None` if it does not parse).
pub(super) fn referrer_descriptor(m: &StoredManifest) -> Option<ReferrerDescriptor> {
    let doc: ManifestDoc = serde_json::from_slice(&m.bytes).ok()?;
    let artifact_type = doc
        .artifact_type
        .or_else(|| doc.config.map(|c| c.media_type));
    Some(ReferrerDescriptor {
        media_type: m.media_type.clone(),
        digest: m.digest.clone(),
        size: m.bytes.len() as u64,
        artifact_type,
        annotations: doc.annotations.filter(|a| !a.is_empty()),
    })
}

/// `GET`/`HEAD /v2/<name>/manifests/<reference>`.
pub(super) async fn pull(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    reference: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PULL)?;
    let parsed = parse_reference(reference)?;
    let by_digest = matches!(parsed, Reference::Digest(_));
    let manifest: Arc<StoredManifest> = if let Some(pt) = st.upstream.as_deref() {
        if let Reference::Digest(d) = &parsed {
            super::pull_through_digest(d)?;
        }
        let m = pt
            .manifest(name, reference)
            .await
            .map_err(|e| st.upstream_failure("manifest", e))?
            .ok_or_else(|| ApiError::manifest_unknown(reference))?;
        Arc::new(m)
    } else {
        let digest = match parsed {
            Reference::Digest(d) => d,
            Reference::Tag(tag) => {
                let target = st
                    .resolve_tag(name, &tag)
                    .await?
                    .ok_or_else(|| ApiError::manifest_unknown(reference))?;
                // Written by this registry, so it parses; text becomes typed here.
                ferry_oci::digest::parse(&target)
                    .map_err(|e| ApiError::internal("reading a tag", &e))?
            }
        };
        match st.manifest(name, &digest).await? {
            Some(m) => m,
            None => {
                if !by_digest {
                    st.tags.remove(name, reference);
                }
                return Err(ApiError::manifest_unknown(reference).into());
            }
        }
    };
    let etag = format!("\"{}\"", manifest.digest);
    let not_modified = parts
        .headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim() == etag || t.trim() == manifest.digest || t.trim() == "*")
        });
    let head = parts.method == Method::HEAD;
    let mut resp = if head || not_modified {
        Response::new(Body::empty())
    } else {
        Response::new(Body::from(manifest.bytes.clone()))
    };
    if not_modified {
        *resp.status_mut() = StatusCode::NOT_MODIFIED;
    }
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, header_value(&manifest.media_type)?);
    if !not_modified {
        h.insert(
            header::CONTENT_LENGTH,
            HeaderValue::from(manifest.bytes.len()),
        );
    }
    h.insert(DOCKER_CONTENT_DIGEST, header_value(&manifest.digest)?);
    h.insert(header::ETAG, header_value(&etag)?);
    Ok(resp)
}

/// What validation learned about a pushed manifest.
pub(crate) struct Validated {
    pub(crate) media_type: String,
    /// Blobs to (re)link: config (first, if any) and layers.
    pub(crate) blobs: Vec<(Digest, u64)>,
    /// Whether `blobs` starts with the config (which a sparse manifest may not omit).
    pub(crate) has_config: bool,
    /// Index children (must be manifests in the repository).
    pub(crate) children: Vec<(Digest, u64)>,
    pub(crate) subject: Option<Digest>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::ManifestInvalid, message)
}

/// `type/subtype[+suffix]` with token characters only.
fn valid_media_type(mt: &str) -> bool {
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&^_.+-".contains(&b))
    };
    mt.len() <= 255
        && mt
            .split_once('/')
            .is_some_and(|(t, s)| token(t) && token(s))
}

fn is_index_type(mt: &str) -> bool {
    mt == media::OCI_INDEX || mt == media::DOCKER_MANIFEST_LIST
}

fn is_image_manifest_type(mt: &str) -> bool {
    mt == media::OCI_MANIFEST || mt == media::DOCKER_MANIFEST
}

/// Layers that by definition are not stored in this registry.
fn is_foreign_layer(d: &DescriptorDoc) -> bool {
    !d.urls.is_empty()
        || d.media_type.contains(".nondistributable.")
        || d.media_type.contains(".foreign.")
}

/// The descriptor's digest, parsed (the one place a pushed document's digests become
/// typed), and its size.
fn check_descriptor(d: &DescriptorDoc, what: &str) -> Result<(Digest, u64), ApiError> {
    let digest = parse_digest(&d.digest).map_err(|_| {
        invalid(format!("{what} has an invalid or unsupported digest"))
            .with_detail(serde_json::json!({ "digest": d.digest }))
    })?;
    if !valid_media_type(&d.media_type) {
        return Err(invalid(format!("{what} has an invalid mediaType")));
    }
    let size = u64::try_from(d.size).map_err(|_| invalid(format!("{what} has a negative size")))?;
    Ok((digest, size))
}

/// Parses and checks the document's shape and media type (no storage access).
pub(crate) fn validate_document(bytes: &[u8], content_type: &str) -> Result<Validated, ApiError> {
    if bytes.is_empty() {
        return Err(invalid("empty manifest"));
    }
    // JSON is UTF-8 (RFC 8259); serde does not check the strings of fields it ignores, so
    // check the whole document before storing it byte for byte.
    let text = std::str::from_utf8(bytes).map_err(|_| invalid("manifest is not UTF-8"))?;
    let doc: ManifestDoc = serde_json::from_str(text)
        .map_err(|e| invalid(format!("manifest is not valid JSON: {e}")))?;
    let declared_ct = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let generic_ct = GENERIC_CONTENT_TYPES.contains(&declared_ct.as_str());
    if let Some(doc_mt) = doc.media_type.as_deref()
        && !generic_ct
        && doc_mt != declared_ct
    {
        return Err(invalid(format!(
            "mediaType {doc_mt:?} does not match Content-Type {declared_ct:?}"
        )));
    }
    let media_type = match (&doc.media_type, generic_ct) {
        (Some(mt), _) => mt.clone(),
        (None, false) => declared_ct,
        (None, true) if doc.manifests.is_some() => media::OCI_INDEX.to_string(),
        (None, true) if doc.config.is_some() => media::OCI_MANIFEST.to_string(),
        (None, true) => return Err(invalid("cannot tell the manifest's media type")),
    };
    if !valid_media_type(&media_type) {
        return Err(invalid("invalid mediaType"));
    }
    if media_type.starts_with("application/vnd.docker.distribution.manifest.v1") {
        return Err(invalid("Docker schema 1 manifests are not supported"));
    }
    if (is_index_type(&media_type) || is_image_manifest_type(&media_type))
        && doc.schema_version != Some(2)
    {
        return Err(invalid("schemaVersion must be 2"));
    }
    let looks_like_index = doc.manifests.is_some();
    let looks_like_manifest = doc.config.is_some() || doc.layers.is_some() || doc.blobs.is_some();
    if is_index_type(&media_type) && (!looks_like_index || doc.config.is_some()) {
        return Err(invalid("an index needs a manifests list and no config"));
    }
    if is_image_manifest_type(&media_type) && (doc.config.is_none() || looks_like_index) {
        return Err(invalid(
            "an image manifest needs a config and no manifests list",
        ));
    }
    if !looks_like_index && !looks_like_manifest {
        return Err(invalid("neither a manifest nor an index"));
    }
    if let Some(at) = &doc.artifact_type
        && !valid_media_type(at)
    {
        return Err(invalid("invalid artifactType"));
    }

    let mut blobs = Vec::new();
    if let Some(config) = &doc.config {
        blobs.push(check_descriptor(config, "config")?);
    }
    for layer in doc
        .layers
        .iter()
        .flatten()
        .chain(doc.blobs.iter().flatten())
    {
        let checked = check_descriptor(layer, "layer")?;
        if !is_foreign_layer(layer) {
            blobs.push(checked);
        }
    }
    let mut children = Vec::new();
    for child in doc.manifests.iter().flatten() {
        children.push(check_descriptor(child, "index entry")?);
    }
    let subject = match &doc.subject {
        Some(s) => Some(check_descriptor(s, "subject")?.0),
        None => None,
    };
    Ok(Validated {
        media_type,
        has_config: doc.config.is_some(),
        blobs,
        children,
        subject,
    })
}

/// `PUT /v2/<name>/manifests/<reference>`.
pub(super) async fn push(
    st: &StateInner,
    parts: &Parts,
    body: Body,
    name: &RepositoryName,
    reference: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PUSH)?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let parsed = parse_reference(reference)?;
    let by_digest = matches!(parsed, Reference::Digest(_));
    let tags = tags_of_push(parts, &parsed)?;
    let limit = st.limits.max_manifest_bytes;
    check_declared_length(&parts.headers, limit, ErrorCode::ManifestInvalid)?;
    let bytes: Bytes = collect_bounded(
        body,
        limit,
        st.idle(),
        &st.metrics,
        ErrorCode::ManifestInvalid,
    )
    .await?;
    // By digest: hashed with the URL digest's algorithm; by tag: with sha256.
    let digest = match &parsed {
        Reference::Digest(d) => ferry_oci::digest::digest_like(d, &bytes),
        Reference::Tag(_) => ferry_oci::sha256_digest(&bytes),
    };
    if by_digest && reference != digest.as_ref() {
        return Err(ApiError::digest_invalid(
            reference,
            "manifest content does not match the digest in the URL",
        )
        .with_detail(serde_json::json!({ "expected": reference, "actual": digest }))
        .into());
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let v = validate_document(&bytes, content_type)?;

    // Everything referenced must already be in this repository, as storage says now: a
    // collection in another process may have removed a blob the in-memory link cache
    // still lists, and a tag must never point at an image that cannot be pulled.
    let sparse_ok = st.limits.sparse_manifests;
    let mut created_empty: Option<&Digest> = None;
    // References a sparse manifest leaves out; everything else must stay there.
    let mut absent: Vec<Digest> = Vec::new();
    for (i, (blob, declared)) in v.blobs.iter().enumerate() {
        let is_config = i == 0 && v.has_config;
        let size = st.linked_blob_size_for_manifest(name, blob).await?;
        let gap = size.is_none() && sparse_ok && !is_config && !removed_recently(st, blob).await?;
        match size {
            Some(size) if size == *declared => {}
            Some(size) => {
                return Err(invalid("a descriptor's size does not match the blob")
                    .with_detail(serde_json::json!({
                        "digest": blob, "declared": declared, "actual": size
                    }))
                    .into());
            }
            None if *declared == EMPTY_JSON.len() as u64
                && *blob == ferry_oci::digest::digest_like(blob, EMPTY_JSON) =>
            {
                let body: crate::storage::ByteStream =
                    Box::pin(futures_util::stream::once(async {
                        Ok(Bytes::from_static(EMPTY_JSON))
                    }));
                st.storage
                    .blob_put(blob, body, EMPTY_JSON.len() as u64)
                    .await
                    .map_err(|e| ApiError::from_storage(e, "storing the empty blob"))?;
                created_empty = Some(blob);
            }
            // A sparse image: a layer not (yet) pushed. The config never is optional.
            None if gap => absent.push(blob.clone()),
            None => {
                return Err(ApiError::new(
                    ErrorCode::ManifestBlobUnknown,
                    "manifest references a blob unknown to this repository",
                )
                .with_detail(serde_json::json!({ "digest": blob }))
                .into());
            }
        }
    }
    for (child, declared) in &v.children {
        let child_manifest = st
            .storage
            .manifest_get(name, child)
            .await
            .map_err(|e| super::storage_failure("reading a manifest", e))?;
        let gap = child_manifest.is_none() && sparse_ok && !removed_recently(st, child).await?;
        match child_manifest {
            Some(m) if m.bytes.len() as u64 == *declared => {}
            Some(_) => {
                return Err(invalid("an index entry's size does not match the manifest")
                    .with_detail(serde_json::json!({ "digest": child }))
                    .into());
            }
            // A sparse index: a child (a platform, say) not copied.
            None if gap => absent.push(child.clone()),
            None => {
                return Err(ApiError::new(
                    ErrorCode::ManifestUnknown,
                    "index references a manifest unknown to this repository",
                )
                .with_detail(serde_json::json!({ "digest": child }))
                .into());
            }
        }
    }
    if let Some(empty) = created_empty {
        st.storage
            .link_blob(name, empty)
            .await
            .map_err(|e| ApiError::from_storage(e, "linking a blob"))?;
    }

    // What the tags pointed at, to put back if a collection undercuts this push.
    let mut prev_tags = Vec::with_capacity(tags.len());
    for tag in &tags {
        let prev = st
            .storage
            .tag_get(name, tag)
            .await
            .map_err(|e| super::storage_failure("reading a tag", e))?;
        prev_tags.push((tag, prev));
    }
    let stored = StoredManifest {
        digest: digest.to_string(),
        media_type: v.media_type,
        bytes,
    };
    st.storage
        .manifest_put(name, &stored)
        .await
        .map_err(|e| ApiError::from_storage(e, "storing a manifest"))?;
    if let Some(subject) = &v.subject {
        st.storage
            .referrer_add(name, subject, &digest)
            .await
            .map_err(|e| ApiError::from_storage(e, "recording a referrer"))?;
    }
    for tag in &tags {
        st.storage
            .tag_set(name, tag, &digest)
            .await
            .map_err(|e| ApiError::from_storage(e, "setting a tag"))?;
    }
    // Committed. A collection that decided to remove something this manifest reaches
    // before the checks above refreshed it may still be about to: tell it, and check
    // again once it cannot (storage::gc, "Collections and manifest pushes agree").
    if let Some(missing) = settle(st, name, &digest, &absent).await? {
        undo(st, name, prev_tags, &digest).await?;
        return Err(ApiError::new(
            ErrorCode::ManifestBlobUnknown,
            "garbage collection removed content this manifest references while it was pushed; push it again",
        )
        .with_detail(serde_json::json!({ "digest": missing }))
        .into());
    }
    for tag in &tags {
        st.tags.insert(name, tag, digest.as_ref().into(), 0);
    }
    let weight = stored.bytes.len() as u64;
    st.manifests
        .insert(name, digest.as_ref(), Arc::new(stored), weight);

    let mut resp = super::empty_response(StatusCode::CREATED);
    let h = resp.headers_mut();
    h.insert(
        header::LOCATION,
        header_value(&format!("/v2/{name}/manifests/{digest}"))?,
    );
    h.insert(DOCKER_CONTENT_DIGEST, header_value(digest.as_ref())?);
    if let Some(subject) = &v.subject {
        h.insert(OCI_SUBJECT, header_value(subject.as_ref())?);
    }
    // The tags the query asked for (the reference's own is implied by the URL).
    let asked: Vec<&str> = tags
        .iter()
        .filter(|t| !matches!(&parsed, Reference::Tag(own) if own == *t))
        .map(|t| t.as_str())
        .collect();
    if !asked.is_empty() {
        h.insert(OCI_TAG, header_value(&asked.join(", "))?);
    }
    Ok(resp)
}

/// Whether a collection removed `digest` lately: then a reference found absent was
/// pushed and collected (before this manifest arrived, say), not left out, and is no gap
/// a sparse manifest may have (storage::gc, "Collections and manifest pushes agree").
async fn removed_recently(st: &StateInner, digest: &Digest) -> Result<bool, ApiError> {
    crate::storage::gc::removed_recently(&*st.storage, digest.as_ref())
        .await
        .map_err(|e| super::storage_failure("checking what garbage collection removed", e))
}

/// Most manifests [`settle`] follows from one (index children, recursively).
const MAX_SETTLE_MANIFESTS: usize = 4096;

/// Pins everything manifest `digest` of `repo` reaches (itself, index children, their
/// configs and layers) against running collections, waits out removals of them in
/// progress, and then checks in storage that all of it is still there. The first digest
/// that is not, if any. `absent` are the references validation found missing and a
/// sparse manifest may leave out; with sparse manifests accepted, what the children
/// reach and is absent before pinning is likewise a gap they were pushed with (each was
/// checked when it was pushed), not a removal. Everything else — all the manifest itself
/// references and found present — is pinned and checked again.
async fn settle(
    st: &StateInner,
    repo: &RepositoryName,
    digest: &Digest,
    absent: &[Digest],
) -> Result<Option<Digest>, ApiError> {
    let sparse = st.limits.sparse_manifests;
    // What the manifest itself references and validation found present: never a gap.
    let mut own_blobs: Vec<Digest> = Vec::new();
    let mut own_children: Vec<Digest> = Vec::new();
    let failure = |e| super::storage_failure("checking a pushed manifest", e);
    let mut manifests = vec![digest.clone()];
    let mut blobs: Vec<Digest> = Vec::new();
    let mut i = 0;
    while let Some(d) = manifests.get(i).cloned() {
        i += 1;
        let Some(m) = st.storage.manifest_get(repo, &d).await.map_err(failure)? else {
            if d != *digest && (absent.contains(&d) || (sparse && !own_children.contains(&d))) {
                manifests.retain(|m| *m != d);
                i -= 1;
                continue;
            }
            return Ok(Some(d));
        };
        // Stored manifests passed validation when pushed; one that no longer does (older
        // rules) references nothing this can check.
        let Ok(v) = validate_document(&m.bytes, &m.media_type) else {
            continue;
        };
        for (b, _) in v.blobs {
            if d == *digest {
                if absent.contains(&b) {
                    continue;
                }
                own_blobs.push(b.clone());
            }
            if !blobs.contains(&b) {
                blobs.push(b);
            }
        }
        for (c, _) in v.children {
            if d == *digest && !absent.contains(&c) {
                own_children.push(c.clone());
            }
            if manifests.len() < MAX_SETTLE_MANIFESTS && !manifests.contains(&c) {
                manifests.push(c);
            }
        }
    }
    if sparse {
        let mut present = Vec::with_capacity(blobs.len());
        for b in blobs {
            if own_blobs.contains(&b)
                || st.storage.blob_linked(repo, &b).await.map_err(failure)?
                    && st.storage.blob_size(&b).await.map_err(failure)?.is_some()
            {
                present.push(b);
            }
        }
        blobs = present;
    }
    let reached: Vec<String> = manifests
        .iter()
        .chain(&blobs)
        .map(|d| d.to_string())
        .collect();
    if let Some(d) = crate::storage::gc::pin_referenced(&*st.storage, &reached)
        .await
        .map_err(failure)?
    {
        return Ok(Some(parse_digest(&d)?));
    }
    for d in &manifests {
        if st
            .storage
            .manifest_get(repo, d)
            .await
            .map_err(failure)?
            .is_none()
        {
            return Ok(Some(d.clone()));
        }
    }
    for b in &blobs {
        let there = st.storage.blob_linked(repo, b).await.map_err(failure)?
            && st.storage.blob_size(b).await.map_err(failure)?.is_some();
        if !there {
            st.links.remove(repo, b.as_ref());
            return Ok(Some(b.clone()));
        }
    }
    Ok(None)
}

/// Undoes the commit of manifest `digest` whose content a collection removed: each tag
/// goes back to what it pointed at before (if that still settles, else it goes) and the
/// manifest, which references something gone, is unlinked.
async fn undo(
    st: &StateInner,
    repo: &RepositoryName,
    prev_tags: Vec<(&Tag, Option<String>)>,
    digest: &Digest,
) -> Result<(), ApiError> {
    let failure = |e| ApiError::from_storage(e, "undoing a manifest push");
    for (tag, prev) in prev_tags {
        let prev = prev.and_then(|p| ferry_oci::digest::parse(&p).ok());
        st.tags.remove(repo, tag);
        if st
            .storage
            .tag_get(repo, tag)
            .await
            .map_err(failure)?
            .as_deref()
            == Some(digest.as_ref())
        {
            match prev.filter(|p| p != digest) {
                Some(p) => {
                    st.storage.tag_set(repo, tag, &p).await.map_err(failure)?;
                    if Box::pin(settle(st, repo, &p, &[])).await?.is_some()
                        && st
                            .storage
                            .tag_get(repo, tag)
                            .await
                            .map_err(failure)?
                            .as_deref()
                            == Some(p.as_ref())
                    {
                        st.storage.tag_delete(repo, tag).await.map_err(failure)?;
                    }
                }
                None => {
                    st.storage.tag_delete(repo, tag).await.map_err(failure)?;
                }
            }
        }
    }
    st.storage
        .manifest_delete(repo, digest)
        .await
        .map_err(failure)?;
    st.manifests.remove(repo, digest.as_ref());
    st.tags
        .remove_where(|r, _, d| r == repo.as_str() && &**d == digest.as_ref());
    tracing::warn!(%repo, %digest, "manifest push undone: garbage collection removed what it references");
    Ok(())
}

/// `DELETE /v2/<name>/manifests/<reference>`: by digest removes the manifest (and its
/// tags); by tag removes just the tag.
pub(super) async fn delete(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    reference: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::DELETE)?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let existed = match parse_reference(reference)? {
        Reference::Digest(digest) => {
            let existed = st
                .storage
                .manifest_delete(name, &digest)
                .await
                .map_err(|e| ApiError::from_storage(e, "deleting a manifest"))?;
            st.manifests.remove(name, reference);
            st.tags
                .remove_where(|repo, _, d| repo == name.as_str() && &**d == reference);
            existed
        }
        Reference::Tag(tag) => {
            let existed = st
                .storage
                .tag_delete(name, &tag)
                .await
                .map_err(|e| ApiError::from_storage(e, "deleting a tag"))?;
            st.tags.remove(name, reference);
            existed
        }
    };
    if !existed {
        return Err(ApiError::manifest_unknown(reference).into());
    }
    Ok(super::empty_response(StatusCode::ACCEPTED))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(mt: &str, hex: char, size: i64) -> String {
        format!(
            r#"{{"mediaType":"{mt}","digest":"sha256:{}","size":{size}}}"#,
            hex.to_string().repeat(64)
        )
    }

    #[test]
    fn shapes() {
        let m = format!(
            r#"{{"schemaVersion":2,"mediaType":"{}","config":{},"layers":[{}]}}"#,
            media::OCI_MANIFEST,
            d(media::OCI_CONFIG, 'a', 10),
            d(media::LAYER_TAR_GZIP, 'b', 20)
        );
        let v = validate_document(m.as_bytes(), media::OCI_MANIFEST).map_err(|e| e.message);
        assert_eq!(v.as_ref().map(|v| v.blobs.len()), Ok(2));
        // Content-Type disagreeing with mediaType.
        assert!(validate_document(m.as_bytes(), media::OCI_INDEX).is_err());
        // Generic Content-Type: taken from the document.
        assert!(validate_document(m.as_bytes(), "application/json").is_ok());
        // Schema version.
        let bad = m.replace("\"schemaVersion\":2", "\"schemaVersion\":1");
        assert!(validate_document(bad.as_bytes(), media::OCI_MANIFEST).is_err());
        // Negative size and bad digests.
        let bad = m.replace("\"size\":20", "\"size\":-1");
        assert!(validate_document(bad.as_bytes(), media::OCI_MANIFEST).is_err());
        let bad = m.replacen("sha256:", "md5:", 1);
        assert!(validate_document(bad.as_bytes(), media::OCI_MANIFEST).is_err());
        // Not JSON, empty.
        assert!(validate_document(b"{", media::OCI_MANIFEST).is_err());
        assert!(validate_document(b"", media::OCI_MANIFEST).is_err());
        // An index needs manifests.
        let idx = format!(
            r#"{{"schemaVersion":2,"mediaType":"{}","manifests":[{}]}}"#,
            media::OCI_INDEX,
            d(media::OCI_MANIFEST, 'c', 30)
        );
        let v = validate_document(idx.as_bytes(), media::OCI_INDEX).map_err(|e| e.message);
        assert_eq!(v.as_ref().map(|v| v.children.len()), Ok(1));
        assert!(validate_document(idx.as_bytes(), media::OCI_MANIFEST).is_err());
        // Foreign layers are not required locally.
        let foreign = format!(
            r#"{{"schemaVersion":2,"mediaType":"{}","config":{},"layers":[{}]}}"#,
            media::DOCKER_MANIFEST,
            d("application/vnd.docker.container.image.v1+json", 'a', 10),
            d(
                "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                'b',
                20
            )
        );
        let v =
            validate_document(foreign.as_bytes(), media::DOCKER_MANIFEST).map_err(|e| e.message);
        assert_eq!(v.as_ref().map(|v| v.blobs.len()), Ok(1));
        // Schema 1 refused.
        assert!(
            validate_document(
                br#"{"schemaVersion":1,"name":"x"}"#,
                "application/vnd.docker.distribution.manifest.v1+prettyjws"
            )
            .is_err()
        );
    }

    /// Found by fuzzing: serde does not check the UTF-8 of strings in fields it ignores,
    /// so a document that is not JSON (RFC 8259 requires UTF-8) was stored as a manifest.
    #[test]
    fn non_utf8_manifest_refused() {
        // The bad byte sits in a field the registry does not read.
        let mut idx = format!(
            r#"{{"schemaVersion":2,"mediaType":"{}","manifests":[{}],"x-vendor":"vX"}}"#,
            media::OCI_INDEX,
            d(media::OCI_MANIFEST, 'a', 10)
        )
        .into_bytes();
        assert!(validate_document(&idx, media::OCI_INDEX).is_ok());
        let Some(x) = idx.iter().rposition(|&b| b == b'X') else {
            panic!("marker missing");
        };
        idx[x] = 0x8b;
        match validate_document(&idx, media::OCI_INDEX) {
            Ok(_) => panic!("a non-UTF-8 manifest was accepted"),
            Err(e) => assert!(e.message.contains("UTF-8"), "{}", e.message),
        }
    }

    #[test]
    fn referrer_descriptors() {
        let m = StoredManifest {
            digest: "sha256:x".into(),
            media_type: media::OCI_MANIFEST.into(),
            bytes: Bytes::from(format!(
                r#"{{"schemaVersion":2,"config":{},"layers":[],"annotations":{{"k":"v"}}}}"#,
                d("application/vnd.example.sig", 'a', 2)
            )),
        };
        let r = referrer_descriptor(&m);
        assert_eq!(
            r.as_ref().and_then(|r| r.artifact_type.as_deref()),
            Some("application/vnd.example.sig")
        );
        assert_eq!(
            r.and_then(|r| r.annotations)
                .and_then(|a| a.get("k").cloned()),
            Some("v".to_string())
        );
    }
}
