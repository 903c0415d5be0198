//! Discovery: tag list and catalog (with `n`/`last` pagination and `Link` headers) and
//! the referrers API (an image index of the manifests whose subject is a digest).

use axum::response::Response;
use bytes::Bytes;
use ferry_oci::RepositoryName;
use http::request::Parts;
use http::{HeaderValue, StatusCode, header};
use serde::{Deserialize, Serialize};

use super::errors::{ApiError, ErrorCode};
use super::manifests::{ReferrerDescriptor, referrer_descriptor};
use super::routes::parse_digest;
use super::{Handled, OCI_FILTERS_APPLIED, StateInner, header_value, query_param, read_only};
use crate::auth::{Actions, Scope};
use ferry_oci::media;

/// One page of a sorted list.
struct Page<'a> {
    items: &'a [String],
    /// Set when more items follow: the `last` to ask for next.
    next_last: Option<&'a str>,
    /// The page size to repeat in the next link.
    n: usize,
}

/// Items strictly after `last`, at most `n` (capped at `max`).
fn paginate<'a>(all: &'a [String], n: Option<usize>, last: Option<&str>, max: usize) -> Page<'a> {
    let from = match last {
        Some(last) => all.partition_point(|t| t.as_str() <= last),
        None => 0,
    };
    let rest = &all[from..];
    let n = n.unwrap_or(max).min(max);
    let take = rest.len().min(n);
    let items = &rest[..take];
    let next_last = if take < rest.len() && take > 0 {
        items.last().map(String::as_str)
    } else {
        None
    };
    Page {
        items,
        next_last,
        n,
    }
}

fn parse_n(parts: &Parts) -> Result<Option<usize>, ApiError> {
    match query_param(parts, "n") {
        None => Ok(None),
        Some(v) => v.parse::<usize>().map(Some).map_err(|_| {
            ApiError::new(ErrorCode::Unsupported, "invalid page size n")
                .with_status(StatusCode::BAD_REQUEST)
                .with_detail(serde_json::json!({ "n": v }))
        }),
    }
}

fn link_header(path: &str, n: usize, last: &str) -> Result<HeaderValue, ApiError> {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("n", &n.to_string())
        .append_pair("last", last)
        .finish();
    header_value(&format!("<{path}?{query}>; rel=\"next\""))
}

fn json_page<T: Serialize>(
    parts: &Parts,
    body: &T,
    link: Option<HeaderValue>,
) -> Result<Response, ApiError> {
    let json = serde_json::to_vec(body).map_err(|e| ApiError::internal("encoding JSON", &e))?;
    let mut resp = super::json_response(StatusCode::OK, Bytes::from(json), &parts.method);
    if let Some(link) = link {
        resp.headers_mut().insert(header::LINK, link);
    }
    Ok(resp)
}

#[derive(Serialize)]
struct TagList<'a> {
    name: &'a str,
    tags: &'a [String],
}

/// `GET /v2/<name>/tags/list[?n=&last=]`.
pub(super) async fn tags(st: &StateInner, parts: &Parts, name: &RepositoryName) -> Handled {
    st.authorize_repo(parts, name, Actions::PULL)?;
    let n = parse_n(parts)?;
    let last = query_param(parts, "last");
    let all = match st.upstream.as_deref() {
        Some(pt) => pt
            .tags(name)
            .await
            .map_err(|e| st.upstream_failure("tags", e))?,
        None => st
            .storage
            .tag_list(name)
            .await
            .map_err(|e| super::storage_failure("listing tags", e))?,
    };
    let Some(mut all) = all else {
        return Err(ApiError::name_unknown(name).into());
    };
    if st.upstream.is_some() {
        all.sort_unstable(); // upstreams do not all sort
    }
    let page = paginate(&all, n, last.as_deref(), st.limits.max_page_entries);
    let link = match page.next_last {
        Some(l) => Some(link_header(&format!("/v2/{name}/tags/list"), page.n, l)?),
        None => None,
    };
    Ok(json_page(
        parts,
        &TagList {
            name,
            tags: page.items,
        },
        link,
    )?)
}

#[derive(Serialize)]
struct Catalog<'a> {
    repositories: &'a [String],
}

/// `GET /v2/_catalog[?n=&last=]`.
pub(super) async fn catalog(st: &StateInner, parts: &Parts) -> Handled {
    let access = st.authorize(parts, Scope::catalog())?;
    if st.upstream.is_some() {
        return Err(read_only());
    }
    let n = parse_n(parts)?;
    let last = query_param(parts, "last");
    // Only names the caller may do something with: a repository's name is information
    // the access rules protect as much as its content.
    let subject = access.subject.as_deref();
    let all: Vec<String> = st
        .storage
        .repo_list()
        .await
        .map_err(|e| super::storage_failure("listing repositories", e))?
        .into_iter()
        .filter(|repo| st.auth.allowed_actions(subject, repo) != Actions::NONE)
        .collect();
    let page = paginate(&all, n, last.as_deref(), st.limits.max_page_entries);
    let link = match page.next_last {
        Some(l) => Some(link_header("/v2/_catalog", page.n, l)?),
        None => None,
    };
    Ok(json_page(
        parts,
        &Catalog {
            repositories: page.items,
        },
        link,
    )?)
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReferrersIndex {
    schema_version: u32,
    media_type: String,
    manifests: Vec<ReferrerDescriptor>,
}

/// `GET /v2/<name>/referrers/<digest>[?artifactType=]`.
pub(super) async fn referrers(
    st: &StateInner,
    parts: &Parts,
    name: &RepositoryName,
    subject: &str,
) -> Handled {
    st.authorize_repo(parts, name, Actions::PULL)?;
    let typed = parse_digest(subject)?;
    let filter = query_param(parts, "artifactType");
    let mut manifests = match st.upstream.as_deref() {
        Some(pt) => {
            let json = pt
                .referrers(name, subject)
                .await
                .map_err(|e| st.upstream_failure("referrers", e))?;
            match json {
                Some(json) => {
                    let limit = st.limits.max_manifest_bytes as usize;
                    if json.len() > limit {
                        return Err(ApiError::new(
                            ErrorCode::Unavailable,
                            "upstream referrers index too large",
                        )
                        .with_status(StatusCode::BAD_GATEWAY)
                        .into());
                    }
                    let index: ReferrersIndex = serde_json::from_slice(&json).map_err(|e| {
                        ApiError::new(
                            ErrorCode::Unavailable,
                            format!("upstream referrers index is invalid: {e}"),
                        )
                        .with_status(StatusCode::BAD_GATEWAY)
                    })?;
                    index.manifests
                }
                None => Vec::new(),
            }
        }
        None => {
            let digests = st
                .storage
                .referrer_list(name, &typed)
                .await
                .map_err(|e| super::storage_failure("listing referrers", e))?;
            let mut out = Vec::with_capacity(digests.len());
            for d in digests {
                // Listed by the backend, so it parses; text becomes typed here.
                let Ok(d) = ferry_oci::digest::parse(&d) else {
                    continue;
                };
                if let Some(m) = st.manifest(name, &d).await?
                    && let Some(desc) = referrer_descriptor(&m)
                {
                    out.push(desc);
                }
            }
            out
        }
    };
    if let Some(f) = &filter {
        manifests.retain(|m| m.artifact_type.as_deref() == Some(f.as_str()));
    }
    let index = ReferrersIndex {
        schema_version: 2,
        media_type: media::OCI_INDEX.to_string(),
        manifests,
    };
    let json = serde_json::to_vec(&index).map_err(|e| ApiError::internal("encoding JSON", &e))?;
    let mut resp = super::json_response(StatusCode::OK, Bytes::from(json), &parts.method);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(media::OCI_INDEX),
    );
    if filter.is_some() {
        h.insert(
            OCI_FILTERS_APPLIED,
            HeaderValue::from_static("artifactType"),
        );
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn pages() {
        let all = list(&["a", "b", "c", "d", "e"]);
        let p = paginate(&all, Some(2), None, 100);
        assert_eq!(p.items, &all[0..2]);
        assert_eq!(p.next_last, Some("b"));
        let p = paginate(&all, Some(2), Some("b"), 100);
        assert_eq!(p.items, &all[2..4]);
        assert_eq!(p.next_last, Some("d"));
        let p = paginate(&all, Some(2), Some("d"), 100);
        assert_eq!(p.items, &all[4..5]);
        assert_eq!(p.next_last, None);
        // `last` need not be an element.
        let p = paginate(&all, None, Some("bb"), 100);
        assert_eq!(p.items, &all[2..5]);
        // n = 0: nothing, and no next link.
        let p = paginate(&all, Some(0), None, 100);
        assert!(p.items.is_empty());
        assert_eq!(p.next_last, None);
        // Capped by the server's maximum.
        let p = paginate(&all, Some(1000), None, 3);
        assert_eq!(p.items.len(), 3);
        assert_eq!(p.next_last, Some("c"));
        assert_eq!(p.n, 3);
    }
}
