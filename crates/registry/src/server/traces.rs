//! `PUT /v2/<name>/ferry-traces/<subject>`: startup traces from nodes that may only
//! pull.
//!
//! A node that recorded which files an image's first start read shares the trace as an
//! OCI artifact referring to the image; with push access it pushes the artifact itself
//! (ordinary manifest PUT). This endpoint is for nodes whose credentials only allow pull,
//! for images this registry serves. What such a user can do here is bounded: add one
//! trace artifact, built by the registry from a trace JSON of at most
//! [`MAX_ACCEPTED_TRACE_BYTES`] bytes (content type [`TRACE_BLOB_MEDIA_TYPE`], parsed
//! and checked with bounds), whose subject is an image manifest or index that exists in
//! that repository. It replaces the trace accepted here before for the same subject
//! (never one a pusher published), so the repository holds at most one accepted trace
//! per manifest, and it moves the repository's [`REPOSITORY_TRACE_TAG`] to the new
//! artifact (how a new tag of the repository finds the trace of the version before it).
//! Nothing else of the repository changes. Anonymous callers are refused even where
//! anonymous pull is allowed: a trace is tied to an authenticated user.

use ferry_oci::{Digest, RepositoryName, Tag};
use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{StatusCode, header};

use super::body::{check_declared_length, collect_bounded};
use super::errors::{ApiError, ErrorCode};
use super::routes::parse_digest;
use super::{DOCKER_CONTENT_DIGEST, Handled, OCI_SUBJECT, StateInner, header_value, read_only};
use crate::auth::{Actions, Scope};
use crate::storage::{ByteStream, StoredManifest};
use ferry_oci::media;

/// Artifact type of a startup trace artifact manifest.
pub const TRACE_ARTIFACT_TYPE: &str = media::FERRY_TRACE_ARTIFACT;
/// Media type of the trace JSON (the artifact's one layer, and this endpoint's body).
pub const TRACE_BLOB_MEDIA_TYPE: &str = media::FERRY_TRACE;
/// Tag that points at the newest trace artifact of a repository, whatever its subject.
pub const REPOSITORY_TRACE_TAG: &str = media::FERRY_TRACE_TAG;
/// Annotation: when the trace was recorded or accepted (seconds since the epoch).
pub const ANNOTATION_TRACE_CREATED: &str = media::ANNOTATION_TRACE_CREATED;
/// Annotation on artifacts built by this endpoint: the user who sent the trace.
pub const ANNOTATION_TRACE_ACCEPTED_FROM: &str = "dev.ferry.trace.accepted-from";
/// Largest trace JSON accepted from a pull-only user.
pub const MAX_ACCEPTED_TRACE_BYTES: u64 = 4 << 20;
/// Most reads in an accepted trace.
pub const MAX_ACCEPTED_TRACE_READS: usize = 100_000;
/// Longest path in an accepted trace.
pub const MAX_TRACE_PATH: usize = 4096;

const EMPTY_JSON: &[u8] = b"{}";

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WireTrace {
    version: u32,
    reads: Vec<WireRead>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WireRead {
    path: String,
    offset: u64,
    len: u64,
}

/// Checks trace JSON the way a node reads it (version 1, absolute paths without NUL of
/// at most [`MAX_TRACE_PATH`] bytes, non-empty reads that do not overflow), with this
/// endpoint's tighter bounds.
pub fn check_trace_json(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() as u64 > MAX_ACCEPTED_TRACE_BYTES {
        return Err(format!(
            "{} bytes, more than the {MAX_ACCEPTED_TRACE_BYTES} accepted",
            bytes.len()
        ));
    }
    let wire: WireTrace = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if wire.version != 1 {
        return Err(format!(
            "version {} (only version 1 is accepted)",
            wire.version
        ));
    }
    if wire.reads.is_empty() || wire.reads.len() > MAX_ACCEPTED_TRACE_READS {
        return Err(format!(
            "{} reads (between 1 and {MAX_ACCEPTED_TRACE_READS} are accepted)",
            wire.reads.len()
        ));
    }
    for (i, r) in wire.reads.iter().enumerate() {
        if !r.path.starts_with('/') || r.path.len() > MAX_TRACE_PATH || r.path.contains('\0') {
            return Err(format!(
                "read #{i}: path must be absolute, without NUL, at most {MAX_TRACE_PATH} bytes"
            ));
        }
        if r.len == 0 || r.offset.checked_add(r.len).is_none() {
            return Err(format!("read #{i}: empty or past the largest offset"));
        }
    }
    Ok(())
}

fn sha256(bytes: &[u8]) -> Digest {
    ferry_oci::sha256_digest(bytes)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The user a trace is accepted from: anyone who may push to `name`, or an
/// authenticated user who may pull from it.
fn authorize(st: &StateInner, parts: &Parts, name: &str) -> Result<String, super::Refusal> {
    let check = |actions| {
        st.auth.check_request(
            Some(&parts.uri),
            &parts.headers,
            &Scope::repository(name, actions),
        )
    };
    match check(Actions::PUSH) {
        Ok(access) => Ok(access.subject.unwrap_or_default()),
        Err(push_denied) => match check(Actions::PULL)? {
            crate::auth::Access {
                subject: Some(user),
            } => Ok(user),
            // Anonymous pull: answer with the push challenge, so a client with
            // credentials logs in; one without stays refused.
            crate::auth::Access { subject: None } => Err(push_denied.into()),
        },
    }
}

/// `PUT /v2/<name>/ferry-traces/<subject>` (see the module doc).
pub(super) async fn accept(
    st: &StateInner,
    parts: &Parts,
    body: Body,
    name: &RepositoryName,
    subject: &str,
) -> Handled {
    let user = authorize(st, parts, name)?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let typed_subject = parse_digest(subject)?;
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type != TRACE_BLOB_MEDIA_TYPE {
        return Err(ApiError::new(
            ErrorCode::ManifestInvalid,
            format!("a startup trace must be sent as {TRACE_BLOB_MEDIA_TYPE}"),
        )
        .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE)
        .into());
    }
    let target = st
        .manifest(name, &typed_subject)
        .await?
        .ok_or_else(|| ApiError::manifest_unknown(subject))?;
    let target_type = target.media_type.as_str();
    let is_image = target_type == media::OCI_MANIFEST
        || target_type == media::DOCKER_MANIFEST
        || target_type == media::OCI_INDEX
        || target_type == media::DOCKER_MANIFEST_LIST;
    if !is_image || has_subject(&target.bytes) {
        return Err(ApiError::new(
            ErrorCode::ManifestInvalid,
            "a startup trace's subject must be an image manifest or index",
        )
        .into());
    }
    check_declared_length(
        &parts.headers,
        MAX_ACCEPTED_TRACE_BYTES,
        ErrorCode::SizeInvalid,
    )?;
    let trace: Bytes = collect_bounded(
        body,
        MAX_ACCEPTED_TRACE_BYTES,
        st.idle(),
        &st.metrics,
        ErrorCode::SizeInvalid,
    )
    .await?;
    check_trace_json(&trace).map_err(|why| {
        ApiError::new(ErrorCode::ManifestInvalid, format!("startup trace: {why}"))
    })?;

    let trace_digest = sha256(&trace);
    let empty_digest = sha256(EMPTY_JSON);
    for (digest, bytes) in [
        (&empty_digest, Bytes::from_static(EMPTY_JSON)),
        (&trace_digest, trace.clone()),
    ] {
        let len = bytes.len() as u64;
        let stream: ByteStream = Box::pin(futures_util::stream::once(async move { Ok(bytes) }));
        st.storage
            .blob_put(digest, stream, len)
            .await
            .map_err(|e| ApiError::from_storage(e, "storing a trace blob"))?;
        st.storage
            .link_blob(name, digest)
            .await
            .map_err(|e| ApiError::from_storage(e, "linking a trace blob"))?;
        st.links.insert(name, digest.as_ref(), len, 0);
    }
    let mut annotations = BTreeMap::new();
    annotations.insert(ANNOTATION_TRACE_CREATED, now_secs().to_string());
    annotations.insert(ANNOTATION_TRACE_ACCEPTED_FROM, user);
    let artifact = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media::OCI_MANIFEST,
        "artifactType": TRACE_ARTIFACT_TYPE,
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": empty_digest,
            "size": EMPTY_JSON.len(),
        },
        "layers": [{
            "mediaType": TRACE_BLOB_MEDIA_TYPE,
            "digest": trace_digest,
            "size": trace.len(),
        }],
        "subject": {
            "mediaType": target.media_type,
            "digest": subject,
            "size": target.bytes.len(),
        },
        "annotations": annotations,
    });
    let bytes = Bytes::from(
        serde_json::to_vec(&artifact).map_err(|e| ApiError::internal("encoding a trace", &e))?,
    );
    let digest = sha256(&bytes);
    let earlier = accepted_traces_of(st, name, &typed_subject).await?;
    let stored = StoredManifest {
        digest: digest.to_string(),
        media_type: media::OCI_MANIFEST.to_owned(),
        bytes,
    };
    st.storage
        .manifest_put(name, &stored)
        .await
        .map_err(|e| ApiError::from_storage(e, "storing a trace artifact"))?;
    st.storage
        .referrer_add(name, &typed_subject, &digest)
        .await
        .map_err(|e| ApiError::from_storage(e, "recording a referrer"))?;
    let trace_tag =
        Tag::parse(REPOSITORY_TRACE_TAG).map_err(|e| ApiError::internal("the trace tag", &e))?;
    st.storage
        .tag_set(name, &trace_tag, &digest)
        .await
        .map_err(|e| ApiError::from_storage(e, "setting the repository's trace tag"))?;
    st.tags
        .insert(name, REPOSITORY_TRACE_TAG, digest.as_ref().into(), 0);
    let weight = stored.bytes.len() as u64;
    st.manifests
        .insert(name, digest.as_ref(), Arc::new(stored), weight);
    // One accepted trace per subject: the earlier ones go (after the new one is in, so a
    // failure here leaves two, never none).
    for old in earlier.into_iter().filter(|d| *d != digest) {
        match st.storage.manifest_delete(name, &old).await {
            Ok(_) => st.manifests.remove(name, old.as_ref()),
            Err(e) => {
                tracing::warn!(repository = %name, digest = %old, error = %e, "could not remove a replaced trace")
            }
        }
    }
    tracing::info!(repository = %name, subject, artifact = %digest, "accepted a startup trace");

    let mut resp = super::empty_response(StatusCode::CREATED);
    let h = resp.headers_mut();
    h.insert(
        header::LOCATION,
        header_value(&format!("/v2/{name}/manifests/{digest}"))?,
    );
    h.insert(DOCKER_CONTENT_DIGEST, header_value(digest.as_ref())?);
    h.insert(OCI_SUBJECT, header_value(subject)?);
    Ok(resp)
}

fn has_subject(bytes: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Doc {
        subject: Option<serde_json::Value>,
    }
    serde_json::from_slice::<Doc>(bytes).is_ok_and(|d| d.subject.is_some())
}

/// Trace artifacts of `subject` in `name` that this endpoint built earlier.
async fn accepted_traces_of(
    st: &StateInner,
    name: &RepositoryName,
    subject: &Digest,
) -> Result<Vec<Digest>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Doc {
        artifact_type: Option<String>,
        #[serde(default)]
        annotations: BTreeMap<String, String>,
    }
    let referrers = st
        .storage
        .referrer_list(name, subject)
        .await
        .map_err(|e| ApiError::from_storage(e, "listing referrers"))?;
    let mut out = Vec::new();
    for digest in referrers {
        // Listed by the backend, so it parses; text becomes typed here.
        let Ok(digest) = ferry_oci::digest::parse(&digest) else {
            continue;
        };
        let Some(m) = st.manifest(name, &digest).await? else {
            continue;
        };
        if let Ok(doc) = serde_json::from_slice::<Doc>(&m.bytes)
            && doc.artifact_type.as_deref() == Some(TRACE_ARTIFACT_TYPE)
            && doc.annotations.contains_key(ANNOTATION_TRACE_ACCEPTED_FROM)
        {
            out.push(digest);
        }
    }
    Ok(out)
}
