//! Refusals: the `WWW-Authenticate` challenge a client needs to authenticate (or to ask
//! for a wider token) and the spec JSON error body, built once here so every route
//! refuses the same way.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

use super::scope::Scope;

/// Why access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeniedKind {
    /// 401 UNAUTHORIZED: no, wrong, expired or too narrow credentials; the client should
    /// (re)authenticate as the challenge says.
    Unauthorized,
    /// 403 DENIED: the client is authenticated but its user may not do this.
    Forbidden,
    /// 429 TOOMANYREQUESTS: too many failed logins from this client or for this user;
    /// the password was not checked.
    Throttled,
}

/// A refused request. Renders as 401 + `WWW-Authenticate` or 403, with the spec body.
#[derive(Debug, Clone)]
pub struct Denied {
    kind: DeniedKind,
    /// Full `WWW-Authenticate` value (401 only).
    challenge: Option<String>,
    scope: Scope,
    message: String,
}

impl Denied {
    pub(crate) fn unauthorized(
        challenge: String,
        scope: &Scope,
        message: impl Into<String>,
    ) -> Denied {
        Denied {
            kind: DeniedKind::Unauthorized,
            challenge: Some(challenge),
            scope: scope.clone(),
            message: message.into(),
        }
    }

    pub(crate) fn forbidden(scope: &Scope, message: impl Into<String>) -> Denied {
        Denied {
            kind: DeniedKind::Forbidden,
            challenge: None,
            scope: scope.clone(),
            message: message.into(),
        }
    }

    pub(crate) fn throttled(scope: &Scope, message: impl Into<String>) -> Denied {
        Denied {
            kind: DeniedKind::Throttled,
            challenge: None,
            scope: scope.clone(),
            message: message.into(),
        }
    }

    pub fn kind(&self) -> DeniedKind {
        self.kind
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            DeniedKind::Unauthorized => StatusCode::UNAUTHORIZED,
            DeniedKind::Forbidden => StatusCode::FORBIDDEN,
            DeniedKind::Throttled => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// The spec error code: "UNAUTHORIZED", "DENIED" or "TOOMANYREQUESTS".
    pub fn code(&self) -> &'static str {
        match self.kind {
            DeniedKind::Unauthorized => "UNAUTHORIZED",
            DeniedKind::Forbidden => "DENIED",
            DeniedKind::Throttled => "TOOMANYREQUESTS",
        }
    }

    /// The `WWW-Authenticate` header value, if this is a 401.
    pub fn challenge(&self) -> Option<&str> {
        self.challenge.as_deref()
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        error_body(self.code(), &self.message, &self.scope)
    }
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code(), self.message)
    }
}

impl std::error::Error for Denied {}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut response = (self.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self.kind == DeniedKind::Throttled {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(super::throttle::RETRY_AFTER_SECS),
            );
        }
        if let Some(challenge) = &self.challenge {
            // Challenge parts are escaped when built; a value that still is not a valid
            // header (control bytes in a configured realm) degrades to no header rather
            // than a panic.
            if let Ok(value) = HeaderValue::from_str(challenge) {
                headers.insert(header::WWW_AUTHENTICATE, value);
            }
        }
        response
    }
}

/// `{"errors":[{"code","message","detail":[{"Type","Name","Action"}…]}]}`.
pub(crate) fn error_body(code: &str, message: &str, scope: &Scope) -> serde_json::Value {
    let detail: Vec<serde_json::Value> = match &scope.repository {
        Some(name) => scope
            .actions
            .names()
            .into_iter()
            .map(|action| serde_json::json!({"Type": "repository", "Name": name, "Action": action}))
            .collect(),
        None if scope.is_catalog() => {
            vec![serde_json::json!({"Type": "registry", "Name": "catalog", "Action": "*"})]
        }
        None => Vec::new(),
    };
    let mut error = serde_json::json!({"code": code, "message": message});
    if !detail.is_empty() {
        error["detail"] = serde_json::Value::Array(detail);
    }
    serde_json::json!({ "errors": [error] })
}

/// Token-auth error in the `error=` challenge parameter (RFC 6750).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BearerError {
    None,
    InvalidToken,
    InsufficientScope,
}

/// `Bearer realm="…",service="…",scope="…"[,error="…"]`.
pub(crate) fn bearer_challenge(
    realm: &str,
    service: &str,
    scope: &Scope,
    error: BearerError,
) -> String {
    let mut out = format!(
        "Bearer realm=\"{}\",service=\"{}\"",
        quote_escape(realm),
        quote_escape(service)
    );
    if !scope.is_base() {
        out.push_str(&format!(",scope=\"{}\"", quote_escape(&scope.to_string())));
    }
    match error {
        BearerError::None => {}
        BearerError::InvalidToken => out.push_str(",error=\"invalid_token\""),
        BearerError::InsufficientScope => out.push_str(",error=\"insufficient_scope\""),
    }
    out
}

/// `Basic realm="…"`.
pub(crate) fn basic_challenge(realm: &str) -> String {
    format!("Basic realm=\"{}\"", quote_escape(realm))
}

/// Escape for an RFC 7230 quoted-string, dropping bytes a header cannot carry.
fn quote_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}
