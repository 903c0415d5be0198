//! Parsing `/v2/...` paths into routes, and validating the names in them.
//!
//! Repository names contain slashes, so the path is parsed from its end (the reference,
//! digest or upload id can never contain a slash). The raw, undecoded path is used: any
//! `%` escape, empty component or dot-segment is simply not a valid name, which closes
//! every path-traversal trick before a name reaches storage.

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

/// Checks a repository name against the distribution grammar exactly:
/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`, at most 255
/// bytes. (Stricter than a character check: `a..b` and `a___b` are refused too.)
pub fn validate_name(name: &str) -> Result<(), ApiError> {
    if name.is_empty() || name.len() > 255 || !name.split('/').all(component_ok) {
        return Err(ApiError::name_invalid(name));
    }
    ferry_oci::reference::validate_repository(name).map_err(|_| ApiError::name_invalid(name))
}

fn component_ok(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator run: ".", "_", "__", or one or more "-".
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &b[start..i];
        let ok = sep == b"." || sep == b"_" || sep == b"__" || sep.iter().all(|&x| x == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// Checks a tag against `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn validate_tag(tag: &str) -> Result<(), ApiError> {
    ferry_oci::reference::validate_tag(tag).map_err(|why| {
        ApiError::new(
            crate::server::errors::ErrorCode::ManifestInvalid,
            "invalid tag",
        )
        .with_detail(serde_json::json!({ "tag": tag, "reason": why }))
    })
}

/// Checks a content digest: `sha256:<64 lowercase hex>`, the only algorithm stored.
/// Well-formed digests of other algorithms are refused as unsupported.
pub fn validate_digest(digest: &str) -> Result<(), ApiError> {
    match digest.split_once(':') {
        Some(("sha256", hex)) => {
            if hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            {
                Ok(())
            } else {
                Err(ApiError::digest_invalid(digest, "invalid sha256 digest"))
            }
        }
        Some((alg, hex))
            if !alg.is_empty()
                && alg.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b)
                })
                && !hex.is_empty() =>
        {
            Err(ApiError::digest_invalid(
                digest,
                "unsupported digest algorithm (only sha256)",
            ))
        }
        _ => Err(ApiError::digest_invalid(digest, "invalid digest")),
    }
}

/// Whether a manifest reference is a digest (else it is a tag).
pub fn is_digest_reference(reference: &str) -> bool {
    reference.contains(':')
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
            assert!(validate_name(ok).is_ok(), "{ok}");
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
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn digests_and_tags() {
        let good = format!("sha256:{}", "a".repeat(64));
        assert!(validate_digest(&good).is_ok());
        assert!(validate_digest(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(validate_digest("sha256:abc").is_err());
        assert!(validate_digest(&format!("sha512:{}", "a".repeat(128))).is_err());
        assert!(validate_digest("nocolon").is_err());
        assert!(validate_tag("v1.0_rc-1").is_ok());
        assert!(validate_tag(".hidden").is_err());
        assert!(validate_tag(&"t".repeat(129)).is_err());
        assert!(is_digest_reference(&good));
        assert!(!is_digest_reference("latest"));
    }
}
