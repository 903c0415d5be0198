//! Blob GET/HEAD (the layer requests a fleet's cold start is made of) and DELETE.
//!
//! A blob is served only through a repository that links it. Small blobs (configs) come
//! from memory; others stream from storage, or redirect to a presigned URL when the
//! backend offers one. Single byte ranges are honoured (206), unsatisfiable ones get 416.

use ferry_oci::{Digest, RepositoryName};
use std::ops::Range;

use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::request::Parts;
use http::{HeaderValue, Method, StatusCode, header};

use super::errors::{ApiError, ErrorCode};
use super::range::{RangeRequest, parse_range};
use super::routes::parse_digest;
use super::{DOCKER_CONTENT_DIGEST, Handled, StateInner, header_value, read_only};
use crate::auth::Actions;
use crate::storage::{BlobRead, ByteStream};
use ferry_registry_client::byteranges;

pub(super) async fn pull(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    digest: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PULL)?;
    let typed = parse_digest(digest)?;
    let head = parts.method == Method::HEAD;
    let range_header = parts
        .headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok());
    if st.upstream.is_some() {
        super::pull_through_digest(&typed)?;
        return pull_upstream(st, name, digest, head, range_header).await;
    }
    let size = st
        .linked_blob_size(name, &typed)
        .await?
        .ok_or_else(|| ApiError::blob_unknown(digest))?;
    let range = parse_range(range_header, size);
    if range == RangeRequest::Unsatisfiable {
        return Err(unsatisfiable(size).into());
    }
    if head {
        return Ok(blob_response(digest, size, &range, Body::empty())?);
    }
    let several = byteranges::parse_ranges(range_header, size);
    let redirect = st
        .storage
        .blob_redirect(&typed)
        .await
        .map_err(|e| ApiError::from_storage(e, "presigning a blob URL"))?;
    if let Some(url) = redirect {
        let mut resp = Response::new(Body::empty());
        *resp.status_mut() = StatusCode::TEMPORARY_REDIRECT;
        let h = resp.headers_mut();
        h.insert(header::LOCATION, header_value(&url)?);
        h.insert(DOCKER_CONTENT_DIGEST, header_value(digest)?);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        return Ok(resp);
    }
    if size <= st.small_blob_max
        && let Some(bytes) = small_blob(st, &typed, size).await?
    {
        if let Some(ranges) = several {
            let bodies = ranges
                .iter()
                .map(|r| one_piece(bytes.slice(r.start as usize..r.end as usize)))
                .collect();
            return Ok(multipart_response(digest, size, &ranges, bodies)?);
        }
        let body = match &range {
            RangeRequest::Partial(r) => bytes.slice(r.start as usize..r.end as usize),
            _ => bytes,
        };
        return Ok(blob_response(digest, size, &range, Body::from(body))?);
    }
    if let Some(ranges) = several {
        let mut bodies = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let read = st
                .storage
                .blob_read(&typed, Some(r.clone()))
                .await
                .map_err(|e| ApiError::from_storage(e, "reading a blob"))?
                .ok_or_else(|| ApiError::blob_unknown(digest))?;
            bodies.push(read.body);
        }
        return Ok(multipart_response(digest, size, &ranges, bodies)?);
    }
    let wanted = match &range {
        RangeRequest::Partial(r) => Some(r.clone()),
        _ => None,
    };
    let read = st
        .storage
        .blob_read(&typed, wanted)
        .await
        .map_err(|e| ApiError::from_storage(e, "reading a blob"))?;
    let Some(read) = read else {
        // Linked but gone (collected elsewhere): forget the link we cached.
        st.links.remove(name, digest);
        return Err(ApiError::blob_unknown(digest).into());
    };
    Ok(blob_response(
        digest,
        size,
        &range,
        Body::from_stream(read.body),
    )?)
}

/// Pull-through: sizes and bytes come from the cache, which fetches from upstream once.
async fn pull_upstream(
    st: &StateInner,
    name: &str,
    digest: &str,
    head: bool,
    range_header: Option<&str>,
) -> Handled {
    let Some(pt) = st.upstream.as_deref() else {
        return Err(ApiError::internal("pull-through", &"no upstream").into());
    };
    if head || range_header.is_some() {
        let size = pt
            .blob_size(name, digest)
            .await
            .map_err(|e| st.upstream_failure("blob size", e))?
            .ok_or_else(|| ApiError::blob_unknown(digest))?;
        let range = parse_range(range_header, size);
        if range == RangeRequest::Unsatisfiable {
            return Err(unsatisfiable(size).into());
        }
        if head {
            return Ok(blob_response(digest, size, &range, Body::empty())?);
        }
        if let Some(ranges) = byteranges::parse_ranges(range_header, size) {
            let mut bodies = Vec::with_capacity(ranges.len());
            for r in &ranges {
                let read = pt
                    .blob(name, digest, Some(r.clone()))
                    .await
                    .map_err(|e| st.upstream_failure("blob", e))?
                    .ok_or_else(|| ApiError::blob_unknown(digest))?;
                bodies.push(read.body);
            }
            return Ok(multipart_response(digest, size, &ranges, bodies)?);
        }
        let wanted = match &range {
            RangeRequest::Partial(r) => Some(r.clone()),
            _ => None,
        };
        let read = pt
            .blob(name, digest, wanted)
            .await
            .map_err(|e| st.upstream_failure("blob", e))?
            .ok_or_else(|| ApiError::blob_unknown(digest))?;
        return Ok(blob_response(
            digest,
            read.size,
            &range,
            Body::from_stream(read.body),
        )?);
    }
    let read: BlobRead = pt
        .blob(name, digest, None)
        .await
        .map_err(|e| st.upstream_failure("blob", e))?
        .ok_or_else(|| ApiError::blob_unknown(digest))?;
    Ok(blob_response(
        digest,
        read.size,
        &RangeRequest::Full,
        Body::from_stream(read.body),
    )?)
}

/// The whole content of a small blob, from memory or read once into memory.
async fn small_blob(
    st: &StateInner,
    digest: &Digest,
    size: u64,
) -> Result<Option<Bytes>, ApiError> {
    if let Some(b) = st.small_blobs.get("", digest.as_ref()) {
        st.metrics.cache_hit("memory_blob");
        return Ok(Some(b));
    }
    st.metrics.cache_miss("memory_blob");
    let Some(mut read) = st
        .storage
        .blob_read(digest, None)
        .await
        .map_err(|e| ApiError::from_storage(e, "reading a blob"))?
    else {
        return Ok(None);
    };
    // `size` is bounded by small_blob_max, so this allocation is bounded too.
    let mut buf = BytesMut::with_capacity(size as usize);
    while let Some(chunk) = read.body.next().await {
        let chunk = chunk.map_err(|e| ApiError::internal("reading a blob", &e))?;
        if (buf.len() + chunk.len()) as u64 > size {
            return Err(ApiError::internal(
                "reading a blob",
                &"blob is longer than its recorded size",
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    if buf.len() as u64 != size {
        return Err(ApiError::internal(
            "reading a blob",
            &"blob is shorter than its recorded size",
        ));
    }
    let bytes = buf.freeze();
    st.small_blobs
        .insert("", digest.as_ref(), bytes.clone(), size);
    Ok(Some(bytes))
}

/// 200 or 206 with the blob headers; `body` must carry exactly the announced bytes.
fn blob_response(
    digest: &str,
    size: u64,
    range: &RangeRequest,
    body: Body,
) -> Result<Response, ApiError> {
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    let digest_value = header_value(digest)?;
    h.insert(header::ETAG, header_value(&format!("\"{digest}\""))?);
    h.insert(DOCKER_CONTENT_DIGEST, digest_value);
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=31536000"),
    );
    match range {
        RangeRequest::Partial(Range { start, end }) => {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(end - start));
            h.insert(
                header::CONTENT_RANGE,
                header_value(&format!("bytes {start}-{}/{size}", end - 1))?,
            );
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        }
        _ => {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
        }
    }
    Ok(resp)
}

fn one_piece(bytes: Bytes) -> ByteStream {
    Box::pin(futures_util::stream::once(async move { Ok(bytes) }))
}

/// 206 `multipart/byteranges` for `ranges` of a blob of `size` bytes (as
/// [`byteranges::parse_ranges`] gives them), each part's bytes from the body at its
/// place in `bodies`: a client asking for several ranges pays one request, not one per
/// range. The boundary is random, so no blob's bytes can be crafted to contain it
/// (clients that find parts by scanning for it, as Go's do, stay safe).
fn multipart_response(
    digest: &str,
    size: u64,
    ranges: &[Range<u64>],
    bodies: Vec<ByteStream>,
) -> Result<Response, ApiError> {
    let boundary = hex::encode(rand::random::<[u8; 16]>());
    let len = byteranges::body_len(&boundary, ranges, size);
    let mut pieces: Vec<ByteStream> = Vec::with_capacity(ranges.len() * 2 + 1);
    for (r, body) in ranges.iter().zip(bodies) {
        pieces.push(one_piece(Bytes::from(byteranges::part_head(
            &boundary, r, size,
        ))));
        pieces.push(body);
    }
    pieces.push(one_piece(Bytes::from(byteranges::tail(&boundary))));
    let stream = futures_util::stream::iter(pieces).flatten();
    let mut resp = blob_response(digest, size, &RangeRequest::Full, Body::from_stream(stream))?;
    *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    h.insert(
        header::CONTENT_TYPE,
        header_value(&byteranges::content_type(&boundary))?,
    );
    Ok(resp)
}

fn unsatisfiable(size: u64) -> ApiError {
    ApiError::new(ErrorCode::SizeInvalid, "requested range not satisfiable")
        .with_status(StatusCode::RANGE_NOT_SATISFIABLE)
        .with_header(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&format!("bytes */{size}"))
                .unwrap_or(HeaderValue::from_static("bytes */0")),
        )
}

pub(super) async fn delete(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    digest: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::DELETE)?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let typed = parse_digest(digest)?;
    let existed = st
        .storage
        .unlink_blob(name, &typed)
        .await
        .map_err(|e| ApiError::from_storage(e, "unlinking a blob"))?;
    st.links.remove(name, digest);
    if !existed {
        return Err(ApiError::blob_unknown(digest).into());
    }
    Ok(super::empty_response(StatusCode::ACCEPTED))
}
