//! Blob pushes: upload sessions (monolithic, chunked, streamed), cross-repository mount,
//! status and cancel.
//!
//! Storage verifies the digest against the bytes received and bounds the size; this layer
//! refuses a push that sends no bytes for a non-empty digest unless the repository already
//! links that blob (a digest alone proves nothing: the only way to link an existing blob
//! without its bytes is a cross-repository mount, which checks pull rights on the source),
//! checks declared lengths before reading, orders chunks (416 with the current `Range` when a chunk does not start
//! where the upload ends), and cancels a session whose body failed or stalled, so nothing
//! half-written lingers.

use axum::body::Body;
use axum::response::Response;
use ferry_oci::{Digest, RepositoryName};
use http::request::Parts;
use http::{HeaderValue, StatusCode, header};

use super::body::{IdleTimeoutBody, body_is_empty, check_declared_length, content_length};
use super::errors::{ApiError, ErrorCode};
use super::range::parse_content_range;
use super::routes::{parse_digest, parse_name};
use super::{
    DOCKER_CONTENT_DIGEST, DOCKER_UPLOAD_UUID, Handled, Refusal, StateInner, header_value,
    query_param, read_only,
};
use crate::auth::Actions;
use crate::storage::StorageError;

/// `POST /v2/<name>/blobs/uploads/` — start a session, push monolithically (`?digest=`),
/// or mount (`?mount=&from=`).
pub(super) async fn start(
    st: &StateInner,
    parts: &Parts,
    body: Body,
    name: &RepositoryName,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PUSH)?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    check_digest_algorithm(parts)?;
    if let Some(mount) = query_param(parts, "mount") {
        let typed = parse_digest(&mount)?;
        let from = query_param(parts, "from");
        if let Some(from) = from.as_deref()
            && try_mount(st, parts, name, &typed, from).await?
        {
            return Ok(created(name, &mount)?);
        }
        // Not mountable (unknown source, not linked there, or not readable by the
        // caller): fall back to a regular upload session, as the spec asks.
        return new_session(st, name).await;
    }
    if let Some(digest) = query_param(parts, "digest") {
        let typed = parse_digest(&digest)?;
        if sends_no_bytes(parts, &body) && !is_empty_blob(&typed) {
            return bodyless_push(st, name, &typed).await;
        }
        let limit = st.limits.max_blob_bytes;
        check_declared_length(&parts.headers, limit, ErrorCode::SizeInvalid)?;
        let stream = IdleTimeoutBody::new(body, st.idle(), st.metrics.clone()).into_stream();
        let size = st
            .storage
            .blob_put(&typed, stream, limit)
            .await
            .map_err(|e| ApiError::from_storage(e, "storing a blob"))?;
        if let Some(declared) = content_length(&parts.headers)
            && declared != size
        {
            // The blob is stored (verified) but the request lied about its length.
            return Err(ApiError::new(
                ErrorCode::SizeInvalid,
                "Content-Length does not match the body",
            )
            .into());
        }
        link(st, name, &typed, size).await?;
        return Ok(created(name, &digest)?);
    }
    new_session(st, name).await
}

/// Whether `digest` is that of zero bytes (in its algorithm): the one digest an empty
/// body really is.
fn is_empty_blob(digest: &Digest) -> bool {
    *digest == ferry_oci::digest::digest_like(digest, b"")
}

/// Refuses a `digest-algorithm` the registry cannot store under (the spec's hint for a
/// session that will finish under a digest other than sha256). A supported one needs no
/// more: sessions hash as sha256 while bytes arrive and a sha512 finish hashes the data
/// once more (see `Storage::upload_finish`).
fn check_digest_algorithm(parts: &Parts) -> Result<(), ApiError> {
    match query_param(parts, "digest-algorithm").as_deref() {
        None | Some("sha256") | Some("sha512") => Ok(()),
        Some(other) => Err(ApiError::digest_invalid(
            other,
            "unsupported digest algorithm (only sha256 and sha512)",
        )),
    }
}

/// Whether the request declares or has no body.
fn sends_no_bytes(parts: &Parts, body: &Body) -> bool {
    content_length(&parts.headers) == Some(0) || body_is_empty(body)
}

/// A push naming `digest` without sending its bytes: accepted (idempotently) only when
/// `name` already links the blob; anything else would link a blob by knowing its digest.
async fn bodyless_push(st: &StateInner, name: &RepositoryName, digest: &Digest) -> Handled {
    if st.linked_blob_size(name, digest).await?.is_some() {
        return Ok(created(name, digest.as_ref())?);
    }
    Err(ApiError::digest_invalid(
        digest.as_ref(),
        "no content was sent for this digest; push the blob's bytes or mount it from a \
         repository you may pull",
    )
    .into())
}

/// Whether `digest` was mounted from `from` into `name`.
async fn try_mount(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    digest: &Digest,
    from: &str,
) -> Result<bool, Refusal> {
    let Ok(from) = parse_name(from) else {
        return Ok(false);
    };
    if st.authorize_repo(parts, &from, Actions::PULL).is_err() {
        return Ok(false);
    }
    let Some(size) = st.linked_blob_size(&from, digest).await? else {
        return Ok(false);
    };
    link(st, name, digest, size).await?;
    Ok(true)
}

async fn link(
    st: &StateInner,
    name: &RepositoryName,
    digest: &Digest,
    size: u64,
) -> Result<(), ApiError> {
    st.storage
        .link_blob(name, digest)
        .await
        .map_err(|e| ApiError::from_storage(e, "linking a blob"))?;
    st.links.insert(name, digest.as_ref(), size, 0);
    Ok(())
}

async fn new_session(st: &StateInner, name: &RepositoryName) -> Handled {
    let id = st
        .storage
        .upload_start(name)
        .await
        .map_err(|e| ApiError::from_storage(e, "starting an upload"))?;
    st.metrics.upload_started();
    Ok(session_response(StatusCode::ACCEPTED, name, &id, 0)?)
}

/// 201 for a committed blob.
fn created(name: &str, digest: &str) -> Result<Response, ApiError> {
    let mut resp = super::empty_response(StatusCode::CREATED);
    let h = resp.headers_mut();
    h.insert(
        header::LOCATION,
        header_value(&format!("/v2/{name}/blobs/{digest}"))?,
    );
    h.insert(DOCKER_CONTENT_DIGEST, header_value(digest)?);
    Ok(resp)
}

/// The `Range` header value for an upload holding `size` bytes: `0-<last byte>`
/// (`0-0` when empty, as clients expect).
fn range_value(size: u64) -> Result<HeaderValue, ApiError> {
    header_value(&format!("0-{}", size.saturating_sub(1)))
}

fn session_response(
    status: StatusCode,
    name: &str,
    id: &str,
    size: u64,
) -> Result<Response, ApiError> {
    let mut resp = super::empty_response(status);
    let h = resp.headers_mut();
    h.insert(
        header::LOCATION,
        header_value(&format!("/v2/{name}/blobs/uploads/{id}"))?,
    );
    h.insert(DOCKER_UPLOAD_UUID, header_value(id)?);
    h.insert(header::RANGE, range_value(size)?);
    Ok(resp)
}

/// Refuses a session started for another repository as unknown (as distribution does):
/// push rights on one repository must not reach another repository's uploads.
async fn owned_session(st: &StateInner, name: &str, id: &str) -> Result<(), ApiError> {
    let owner = st
        .storage
        .upload_repo(id)
        .await
        .map_err(|e| ApiError::from_storage(e, "reading an upload"))?;
    match owner {
        Some(owner) if owner == name => Ok(()),
        _ => Err(ApiError::upload_unknown(id)),
    }
}

async fn current_size(st: &StateInner, id: &str) -> Result<u64, ApiError> {
    st.storage
        .upload_size(id)
        .await
        .map_err(|e| ApiError::from_storage(e, "reading an upload"))?
        .ok_or_else(|| ApiError::upload_unknown(id))
}

/// The 416 answer to a chunk that does not continue the upload.
fn out_of_order(name: &str, id: &str, have: u64) -> Result<ApiError, ApiError> {
    Ok(ApiError::new(
        ErrorCode::BlobUploadInvalid,
        format!("chunk must start at byte {have}"),
    )
    .with_status(StatusCode::RANGE_NOT_SATISFIABLE)
    .with_header(header::RANGE, range_value(have)?)
    .with_header(
        header::LOCATION,
        header_value(&format!("/v2/{name}/blobs/uploads/{id}"))?,
    )
    .with_header(DOCKER_UPLOAD_UUID, header_value(id)?))
}

/// Appends the request body to the session at its current end, honouring a
/// `Content-Range` if sent. Cancels the session if the body fails or stalls.
async fn append(
    st: &StateInner,
    parts: &Parts,
    body: Body,
    name: &str,
    id: &str,
    have: u64,
) -> Result<u64, ApiError> {
    let limit = st.limits.max_blob_bytes;
    if let Some(value) = parts.headers.get(header::CONTENT_RANGE) {
        let (start, end) = value
            .to_str()
            .ok()
            .and_then(parse_content_range)
            .ok_or_else(|| {
                ApiError::new(ErrorCode::BlobUploadInvalid, "malformed Content-Range")
            })?;
        if start != have {
            return Err(out_of_order(name, id, have)?);
        }
        if let Some(len) = content_length(&parts.headers)
            && len != end - start + 1
        {
            return Err(ApiError::new(
                ErrorCode::SizeInvalid,
                "Content-Length does not match Content-Range",
            ));
        }
    }
    if let Some(len) = content_length(&parts.headers)
        && have.saturating_add(len) > limit
    {
        cancel_quietly(st, id).await;
        return Err(ApiError::too_large(ErrorCode::SizeInvalid, limit));
    }
    let stream = IdleTimeoutBody::new(body, st.idle(), st.metrics.clone()).into_stream();
    match st.storage.upload_append(id, have, stream, limit).await {
        Ok(size) => Ok(size),
        Err(StorageError::OutOfOrder { have, .. }) => Err(out_of_order(name, id, have)?),
        Err(StorageError::Body(e)) => {
            cancel_quietly(st, id).await;
            Err(super::body::body_error(e))
        }
        Err(e @ StorageError::TooLarge { .. }) => {
            cancel_quietly(st, id).await;
            Err(ApiError::from_storage(e, "appending to an upload"))
        }
        Err(e) => Err(ApiError::from_storage(e, "appending to an upload")),
    }
}

async fn cancel_quietly(st: &StateInner, id: &str) {
    match st.storage.upload_cancel(id).await {
        Ok(true) => st.metrics.upload_ended(),
        Ok(false) => {}
        Err(err) => tracing::warn!(%err, id, "cancelling a failed upload"),
    }
}

/// `PATCH /v2/<name>/blobs/uploads/<id>` — a chunk (with `Content-Range`) or a stream.
pub(super) async fn patch(
    st: &StateInner,
    parts: &Parts,
    body: Body,
    name: &RepositoryName,
    id: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PUSH)?;
    owned_session(st, name, id).await?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let have = current_size(st, id).await?;
    let size = append(st, parts, body, name, id, have).await?;
    Ok(session_response(StatusCode::ACCEPTED, name, id, size)?)
}

/// `PUT /v2/<name>/blobs/uploads/<id>?digest=` — optional last chunk, then commit.
pub(super) async fn finish(
    st: &StateInner,
    parts: &Parts,
    body: Body,
    name: &RepositoryName,
    id: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PUSH)?;
    owned_session(st, name, id).await?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let digest = query_param(parts, "digest")
        .ok_or_else(|| ApiError::digest_invalid("", "the digest query parameter is required"))?;
    let typed = parse_digest(&digest)?;
    let have = current_size(st, id).await?;
    if sends_no_bytes(parts, &body) {
        if have == 0 && !is_empty_blob(&typed) {
            cancel_quietly(st, id).await;
            return bodyless_push(st, name, &typed).await;
        }
    } else {
        append(st, parts, body, name, id, have).await?;
    }
    let size = match st.storage.upload_finish(id, &typed).await {
        Ok(size) => size,
        Err(e) => {
            if matches!(e, StorageError::DigestMismatch { .. }) {
                // The backend dropped the session.
                st.metrics.upload_ended();
            }
            return Err(ApiError::from_storage(e, "committing an upload").into());
        }
    };
    st.metrics.upload_ended();
    link(st, name, &typed, size).await?;
    Ok(created(name, &digest)?)
}

/// `GET /v2/<name>/blobs/uploads/<id>` — how much has arrived.
pub(super) async fn status(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    id: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PUSH)?;
    owned_session(st, name, id).await?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let have = current_size(st, id).await?;
    Ok(session_response(StatusCode::NO_CONTENT, name, id, have)?)
}

/// `DELETE /v2/<name>/blobs/uploads/<id>` — abandon the session.
pub(super) async fn cancel(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    id: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PUSH)?;
    owned_session(st, name, id).await?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let existed = st
        .storage
        .upload_cancel(id)
        .await
        .map_err(|e| ApiError::from_storage(e, "cancelling an upload"))?;
    if !existed {
        return Err(ApiError::upload_unknown(id).into());
    }
    st.metrics.upload_ended();
    Ok(super::empty_response(StatusCode::NO_CONTENT))
}
