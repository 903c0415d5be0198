//! Parsing `/v2/...` paths into routes, and validating the names in them.
//!
//! Repository names contain slashes, so the path is parsed from its end (the reference,
//! digest or upload id can never contain a slash). The raw, undecoded path is used: any
//! `%` escape, empty component or dot-segment is simply not a valid name, which closes
//! every path-traversal trick before a name reaches storage.

use ferry_oci::{Digest, Reference, RepositoryName, Tag};

use crate::server::errors::ApiError;

/// What a `/v2/` path addresses. Borrowed from the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'a> {
    /// `/v2/`
    Base,
    /// `/v2/_catalog`
    Catalog,
    /// `/v2/<name>/tags/list`
    Tags { name: &'a str },
    /// `/v2/<name>/manifests/<reference>`
    Manifest { name: &'a str, reference: &'a str },
    /// `/v2/<name>/blobs/<digest>`
    Blob { name: &'a str, digest: &'a str },
    /// `/v2/<name>/blobs/uploads/`
    UploadStart { name: &'a str },
    /// `/v2/<name>/blobs/uploads/<id>`
    Upload { name: &'a str, id: &'a str },
    /// `/v2/<name>/referrers/<digest>`
    Referrers { name: &'a str, digest: &'a str },
    /// `/v2/<name>/ferry-traces/<subject digest>`: a startup trace from a node that may
    /// only pull ([`crate::server::traces`]).
    Traces { name: &'a str, subject: &'a str },
}

impl<'a> Route<'a> {
    /// Parses a full request path. `None` if it is not a registry API path.
    pub fn parse(path: &'a str) -> Option<Route<'a>> {
        let tail = path.strip_prefix("/v2")?;
        if tail.is_empty() || tail == "/" {
            return Some(Route::Base);
        }
        let tail = tail.strip_prefix('/')?;
        if tail == "_catalog" {
            return Some(Route::Catalog);
        }
        if let Some(name) = tail.strip_suffix("/tags/list") {
            return Some(Route::Tags { name });
        }
        if let Some(name) = tail
            .strip_suffix("/blobs/uploads/")
            .or_else(|| tail.strip_suffix("/blobs/uploads"))
        {
            return Some(Route::UploadStart { name });
        }
        // `<name>/<kind>/<last>` with `last` free of slashes.
        let (head, last) = tail.rsplit_once('/')?;
        if let Some(name) = head.strip_suffix("/blobs/uploads") {
            return Some(Route::Upload { name, id: last });
        }
        let (name, kind) = head.rsplit_once('/')?;
        match kind {
            "manifests" => Some(Route::Manifest {
                name,
                reference: last,
            }),
            "blobs" => Some(Route::Blob { name, digest: last }),
            "referrers" => Some(Route::Referrers { name, digest: last }),
            "ferry-traces" => Some(Route::Traces {
                name,
                subject: last,
            }),
            _ => None,
        }
    }

    /// The repository the route addresses, if any.
    pub fn name(&self) -> Option<&'a str> {
        match *self {
            Route::Base | Route::Catalog => None,
            Route::Tags { name }
            | Route::Manifest { name, .. }
            | Route::Blob { name, .. }
            | Route::UploadStart { name }
            | Route::Upload { name, .. }
            | Route::Referrers { name, .. }
            | Route::Traces { name, .. } => Some(name),
        }
    }
}

/// Parses a repository name from a route (ferry-oci's one rule: the distribution grammar
/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`, at most 255
/// bytes), as `NAME_INVALID` otherwise.
pub fn parse_name(name: &str) -> Result<RepositoryName, ApiError> {
    RepositoryName::parse(name).map_err(|_| ApiError::name_invalid(name))
}

/// Parses a tag (`[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`), as `MANIFEST_INVALID` otherwise.
pub fn parse_tag(tag: &str) -> Result<Tag, ApiError> {
    Tag::parse(tag).map_err(|why| {
        ApiError::new(
            crate::server::errors::ErrorCode::ManifestInvalid,
            "invalid tag",
        )
        .with_detail(serde_json::json!({ "tag": tag, "reason": why.to_string() }))
    })
}

/// Parses a content digest that must be of an algorithm content is stored under (sha256
/// or sha512): well-formed digests of other algorithms are refused as unsupported,
/// malformed ones as invalid (both `DIGEST_INVALID`).
pub fn parse_digest(digest: &str) -> Result<Digest, ApiError> {
    match ferry_oci::digest::parse(digest) {
        Ok(d) if ferry_oci::digest::is_stored_algorithm(&d) => Ok(d),
        Ok(_) => Err(ApiError::digest_invalid(
            digest,
            "unsupported digest algorithm (only sha256 and sha512)",
        )),
        Err(_) => Err(ApiError::digest_invalid(digest, "invalid digest")),
    }
}

/// Parses a manifest reference: a sha256 or sha512 digest (it has a `:`) or a tag.
pub fn parse_reference(reference: &str) -> Result<Reference, ApiError> {
    if ferry_oci::digest::is_digest_reference(reference) {
        parse_digest(reference).map(Reference::Digest)
    } else {
        parse_tag(reference).map(Reference::Tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_routes() {
        assert_eq!(Route::parse("/v2/"), Some(Route::Base));
        assert_eq!(Route::parse("/v2"), Some(Route::Base));
        assert_eq!(Route::parse("/v2/_catalog"), Some(Route::Catalog));
        assert_eq!(
            Route::parse("/v2/a/b/tags/list"),
            Some(Route::Tags { name: "a/b" })
        );
        assert_eq!(
            Route::parse("/v2/a/manifests/b/manifests/latest"),
            Some(Route::Manifest {
                name: "a/manifests/b",
                reference: "latest"
            })
        );
        assert_eq!(
            Route::parse("/v2/x/blobs/sha256:00"),
            Some(Route::Blob {
                name: "x",
                digest: "sha256:00"
            })
        );
        assert_eq!(
            Route::parse("/v2/x/y/blobs/uploads/"),
            Some(Route::UploadStart { name: "x/y" })
        );
        assert_eq!(
            Route::parse("/v2/x/blobs/uploads/abc-123"),
            Some(Route::Upload {
                name: "x",
                id: "abc-123"
            })
        );
        assert_eq!(
            Route::parse("/v2/x/referrers/sha256:ff"),
            Some(Route::Referrers {
                name: "x",
                digest: "sha256:ff"
            })
        );
        assert_eq!(Route::parse("/v2/x/whatever/y"), None);
        assert_eq!(Route::parse("/v3/x/blobs/y"), None);
        assert_eq!(Route::parse("/v2x/blobs/y"), None);
        assert_eq!(Route::parse("/metrics"), None);
    }

    #[test]
    fn names() {
        for ok in ["a", "library/ubuntu", "a-b/c.d/e_f/g__h", "a--b", "0/1/2"] {
            assert!(parse_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "..",
            "a/../b",
            "a/./b",
            "%2e%2e",
            "a/%2e%2e/b",
            "a//b",
            "/a",
            "a/",
            "A",
            "a..b",
            "a___b",
            "a.-b",
            "-a",
            "a b",
            &"a".repeat(256),
        ] {
            assert!(parse_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn digests_and_tags() {
        let good = format!("sha256:{}", "a".repeat(64));
        assert!(parse_digest(&good).is_ok());
        assert!(parse_digest(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(parse_digest("sha256:abc").is_err());
        assert!(parse_digest(&format!("sha512:{}", "a".repeat(128))).is_ok());
        assert!(parse_digest(&format!("sha512:{}", "a".repeat(64))).is_err());
        assert!(parse_digest(&format!("sha384:{}", "a".repeat(96))).is_err());
        assert!(parse_digest("nocolon").is_err());
        assert!(parse_tag("v1.0_rc-1").is_ok());
        assert!(parse_tag(".hidden").is_err());
        assert!(parse_tag(&"t".repeat(129)).is_err());
        assert!(matches!(parse_reference(&good), Ok(Reference::Digest(_))));
        assert!(matches!(parse_reference("latest"), Ok(Reference::Tag(_))));
    }
}
