//! Distribution-spec error responses.
//!
//! Every failure the HTTP layer returns goes through [`ApiError`], so clients always get a
//! spec code and the `{"errors":[{"code","message","detail"}]}` body, whatever went wrong.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode, header};
use serde::Serialize;

use crate::storage::StorageError;

/// The error codes of the OCI distribution spec (plus `TOOMANYREQUESTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BlobUnknown,
    BlobUploadInvalid,
    BlobUploadUnknown,
    DigestInvalid,
    ManifestBlobUnknown,
    ManifestInvalid,
    ManifestUnknown,
    NameInvalid,
    NameUnknown,
    SizeInvalid,
    Unauthorized,
    Denied,
    Unsupported,
    TooManyRequests,
    /// A server-side failure (distribution's `UNKNOWN`).
    Unknown,
    /// The upstream registry (pull-through) failed (distribution's `UNAVAILABLE`).
    Unavailable,
}

impl ErrorCode {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BlobUnknown => "BLOB_UNKNOWN",
            ErrorCode::BlobUploadInvalid => "BLOB_UPLOAD_INVALID",
            ErrorCode::BlobUploadUnknown => "BLOB_UPLOAD_UNKNOWN",
            ErrorCode::DigestInvalid => "DIGEST_INVALID",
            ErrorCode::ManifestBlobUnknown => "MANIFEST_BLOB_UNKNOWN",
            ErrorCode::ManifestInvalid => "MANIFEST_INVALID",
            ErrorCode::ManifestUnknown => "MANIFEST_UNKNOWN",
            ErrorCode::NameInvalid => "NAME_INVALID",
            ErrorCode::NameUnknown => "NAME_UNKNOWN",
            ErrorCode::SizeInvalid => "SIZE_INVALID",
            ErrorCode::Unauthorized => "UNAUTHORIZED",
            ErrorCode::Denied => "DENIED",
            ErrorCode::Unsupported => "UNSUPPORTED",
            ErrorCode::TooManyRequests => "TOOMANYREQUESTS",
            ErrorCode::Unknown => "UNKNOWN",
            ErrorCode::Unavailable => "UNAVAILABLE",
        }
    }

    /// The status the spec pairs with the code by default.
    pub fn default_status(self) -> StatusCode {
        match self {
            ErrorCode::BlobUnknown
            | ErrorCode::BlobUploadUnknown
            | ErrorCode::ManifestUnknown
            | ErrorCode::NameUnknown
            | ErrorCode::ManifestBlobUnknown => StatusCode::NOT_FOUND,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::Denied => StatusCode::FORBIDDEN,
            ErrorCode::Unsupported => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::Unknown => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::BlobUploadInvalid
            | ErrorCode::DigestInvalid
            | ErrorCode::ManifestInvalid
            | ErrorCode::NameInvalid
            | ErrorCode::SizeInvalid => StatusCode::BAD_REQUEST,
        }
    }
}

/// An error response: status, spec code, message, optional detail and extra headers.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
    pub detail: Option<serde_json::Value>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            status: code.default_status(),
            code,
            message: message.into(),
            detail: None,
            headers: Vec::new(),
        }
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn with_detail(mut self, detail: serde_json::Value) -> Self {
        self.detail = Some(detail);
        self
    }

    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// A storage or other server-side failure: 500 with a generic message (the cause is
    /// logged, not sent, so paths and backend details stay private).
    pub fn internal(what: &str, err: &dyn std::fmt::Display) -> Self {
        tracing::error!(%err, "{what}");
        ApiError::new(ErrorCode::Unknown, format!("internal error: {what}"))
    }

    pub fn name_invalid(name: &str) -> Self {
        ApiError::new(ErrorCode::NameInvalid, "invalid repository name")
            .with_detail(serde_json::json!({ "name": name }))
    }

    pub fn name_unknown(name: &str) -> Self {
        ApiError::new(
            ErrorCode::NameUnknown,
            "repository name not known to registry",
        )
        .with_detail(serde_json::json!({ "name": name }))
    }

    pub fn digest_invalid(digest: &str, why: &str) -> Self {
        ApiError::new(ErrorCode::DigestInvalid, why.to_string())
            .with_detail(serde_json::json!({ "digest": digest }))
    }

    pub fn blob_unknown(digest: &str) -> Self {
        ApiError::new(ErrorCode::BlobUnknown, "blob unknown to registry")
            .with_detail(serde_json::json!({ "digest": digest }))
    }

    pub fn manifest_unknown(reference: &str) -> Self {
        ApiError::new(ErrorCode::ManifestUnknown, "manifest unknown")
            .with_detail(serde_json::json!({ "reference": reference }))
    }

    pub fn upload_unknown(id: &str) -> Self {
        ApiError::new(
            ErrorCode::BlobUploadUnknown,
            "blob upload unknown to registry",
        )
        .with_detail(serde_json::json!({ "uuid": id }))
    }

    pub fn unsupported(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::Unsupported, message)
    }

    pub fn too_large(code: ErrorCode, limit: u64) -> Self {
        ApiError::new(code, format!("content exceeds the limit of {limit} bytes"))
            .with_status(StatusCode::PAYLOAD_TOO_LARGE)
            .with_detail(serde_json::json!({ "limit": limit }))
    }

    /// Maps a storage failure on a blob/upload path to the spec's answer.
    pub fn from_storage(err: StorageError, what: &str) -> Self {
        match err {
            StorageError::UploadUnknown(id) => ApiError::upload_unknown(&id),
            StorageError::OutOfOrder { have, got } => ApiError::new(
                ErrorCode::BlobUploadInvalid,
                format!("chunk starts at {got} but the upload has {have} bytes"),
            )
            .with_status(StatusCode::RANGE_NOT_SATISFIABLE),
            StorageError::DigestMismatch { expected, actual } => ApiError::new(
                ErrorCode::DigestInvalid,
                "provided digest did not match uploaded content",
            )
            .with_detail(serde_json::json!({ "expected": expected, "actual": actual })),
            StorageError::TooLarge { limit } => ApiError::too_large(ErrorCode::SizeInvalid, limit),
            StorageError::Body(e) => {
                tracing::debug!(%e, "request body failed");
                ApiError::new(
                    ErrorCode::BlobUploadInvalid,
                    format!("request body failed: {e}"),
                )
            }
            StorageError::Invalid(why) => ApiError::new(ErrorCode::NameInvalid, why),
            other => ApiError::internal(what, &other),
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    errors: [ErrorEntry<'a>; 1],
}

#[derive(Serialize)]
struct ErrorEntry<'a> {
    code: &'static str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a serde_json::Value>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            errors: [ErrorEntry {
                code: self.code.as_str(),
                message: &self.message,
                detail: self.detail.as_ref(),
            }],
        };
        let json = serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"errors\":[]}".to_vec());
        let mut response = Response::new(Body::from(json));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        response
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn body_shape() {
        let r = ApiError::blob_unknown("sha256:ab").into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let bytes = http_body_util::BodyExt::collect(r.into_body())
            .await
            .unwrap()
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["errors"][0]["code"], "BLOB_UNKNOWN");
        assert_eq!(v["errors"][0]["detail"]["digest"], "sha256:ab");
        assert!(v["errors"][0]["message"].is_string());
    }

    #[test]
    fn storage_mapping() {
        let e = ApiError::from_storage(StorageError::OutOfOrder { have: 3, got: 5 }, "x");
        assert_eq!(e.status, StatusCode::RANGE_NOT_SATISFIABLE);
        let e = ApiError::from_storage(
            StorageError::DigestMismatch {
                expected: "a".into(),
                actual: "b".into(),
            },
            "x",
        );
        assert_eq!(e.code, ErrorCode::DigestInvalid);
        let e = ApiError::from_storage(StorageError::TooLarge { limit: 9 }, "x");
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(e.code, ErrorCode::SizeInvalid);
    }
}
