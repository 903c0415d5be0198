//! Entry points for the fuzz targets in `fuzz/` into client parsers that are private to
//! their modules. Each function here is a thin wrapper over the code the client really
//! runs (never a copy), so what the fuzzer proves holds for the client. Not part of the
//! supported API.

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
    use crate::credentials;
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
    let mut headers = reqwest::header::HeaderMap::new();
    for value in link_values {
        if let Ok(v) = reqwest::header::HeaderValue::from_str(value) {
            headers.append(reqwest::header::LINK, v);
        }
    }
    crate::next_link(&headers, base)
}

/// The `mediaType` the client takes from a fetched manifest document.
pub fn document_media_type(bytes: &[u8]) -> Option<String> {
    crate::document_media_type(bytes)
}
