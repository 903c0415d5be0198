//! Entry points for the fuzz targets in `fuzz/` into parsers that are private to their
//! modules. Each function here is a thin wrapper over the code the registry really runs
//! (never a copy), so what the fuzzer proves holds for the server and client. Not part of
//! the supported API.

use crate::server::errors::ApiError;

/// What the server's manifest `PUT` validation learned about a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedManifest {
    /// The media type the manifest is stored under.
    pub media_type: String,
    /// Blobs (config, non-foreign layers) that must be linked in the repository.
    pub blobs: Vec<(String, u64)>,
    /// Index children that must be manifests in the repository.
    pub children: Vec<(String, u64)>,
    /// The `subject` digest, if any.
    pub subject: Option<String>,
}

/// The shape and media-type checks of `PUT /v2/<name>/manifests/<reference>`.
pub fn validate_manifest(bytes: &[u8], content_type: &str) -> Result<ValidatedManifest, ApiError> {
    let v = crate::server::manifests::validate_document(bytes, content_type)?;
    Ok(ValidatedManifest {
        media_type: v.media_type,
        blobs: v.blobs,
        children: v.children,
        subject: v.subject,
    })
}

/// A credential found in an `Authorization` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthorizationCredential<'a> {
    /// The token of `Bearer <token>`.
    Bearer(&'a str),
    /// The base64 part of `Basic <base64>`.
    Basic(&'a str),
}

/// How the server reads an `Authorization` header value.
pub fn parse_authorization(value: &[u8]) -> Option<AuthorizationCredential<'_>> {
    match crate::auth::parse_authorization(value)? {
        crate::auth::Credential::Bearer(t) => Some(AuthorizationCredential::Bearer(t)),
        crate::auth::Credential::Basic(b) => Some(AuthorizationCredential::Basic(b)),
    }
}

/// What the client takes from a docker `config.json` / podman `auth.json` for one
/// repository, without running any helper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthFileChoice {
    /// The credential helper that would be run first.
    pub helper: Option<String>,
    /// `(username, password)` from the matching `auths` entry.
    pub basic: Option<(String, String)>,
    /// The identity (refresh) token from the matching `auths` entry.
    pub identity_token: Option<String>,
}

/// Parses auth-file bytes and picks what applies to `registry`/`repository`; `None` when
/// the file does not parse (the client then ignores it).
pub fn auth_file_choice(bytes: &[u8], registry: &str, repository: &str) -> Option<AuthFileChoice> {
    use crate::client::credentials;
    let file = credentials::parse_auth_file(bytes).ok()?;
    let secret = credentials::from_auths(&file, registry, repository);
    Some(AuthFileChoice {
        helper: credentials::helper_for(&file, registry, repository),
        basic: secret
            .as_ref()
            .and_then(|s| s.basic.as_ref())
            .map(|c| (c.username.clone(), c.password.clone())),
        identity_token: secret.and_then(|s| s.identity_token),
    })
}

/// The client's pagination: the `rel="next"` target of the `Link` header values
/// (values that are not valid header values are left out), resolved against `base`.
pub fn next_link(link_values: &[&str], base: &url::Url) -> Option<url::Url> {
    let mut headers = http::HeaderMap::new();
    for value in link_values {
        if let Ok(v) = http::HeaderValue::from_str(value) {
            headers.append(http::header::LINK, v);
        }
    }
    crate::client::next_link(&headers, base)
}

/// The client's reading of a `206` answer's `Content-Range`: `(first, last, total)`.
pub fn client_content_range(value: &str) -> Option<(u64, u64, Option<u64>)> {
    crate::client::parse_content_range(value)
}

/// The `mediaType` the client takes from a fetched manifest document.
pub fn document_media_type(bytes: &[u8]) -> Option<String> {
    crate::client::document_media_type(bytes)
}

/// The blob digests (hex) the pull-through cache links for an upstream manifest.
pub fn cache_referenced_blobs(bytes: &[u8]) -> Vec<String> {
    crate::cache::referenced_blobs(bytes)
}

/// The pull-through cache's reading of its upstream URL: `(host[:port], plain_http)`.
pub fn cache_upstream_url(url: &str) -> Option<(String, bool)> {
    crate::cache::parse_upstream_url(url).ok()
}
