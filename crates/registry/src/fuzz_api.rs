//! Entry points for the fuzz targets in `fuzz/` into server parsers that are private to
//! their modules. Each function here is a thin wrapper over the code the registry really
//! runs (never a copy), so what the fuzzer proves holds for the server. Not part of the
//! supported API. The client's are in `ferry_registry_client::fuzz_api`.

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
        blobs: v
            .blobs
            .into_iter()
            .map(|(d, n)| (d.to_string(), n))
            .collect(),
        children: v
            .children
            .into_iter()
            .map(|(d, n)| (d.to_string(), n))
            .collect(),
        subject: v.subject.map(|d| d.to_string()),
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

/// The blob digests (hex) the pull-through cache links for an upstream manifest.
pub fn cache_referenced_blobs(bytes: &[u8]) -> Vec<String> {
    crate::cache::referenced_blobs(bytes)
}

/// The pull-through cache's reading of its upstream URL: `(host[:port], plain_http)`.
pub fn cache_upstream_url(url: &str) -> Option<(String, bool)> {
    crate::cache::parse_upstream_url(url).ok()
}
