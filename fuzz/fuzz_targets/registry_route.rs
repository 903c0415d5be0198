//! Fuzzes the registry's `/v2/` router and name checks. Any raw request path must route or
//! not without panicking; every repository name the server then accepts
//! (`parse_name`) must satisfy the OCI grammar (`ferry_oci`'s one rule, which the auth
//! scope check must agree with exactly) and can never traverse: no `..`, `.`, empty
//! or `%`-escaped segment, no backslash, NUL or leading slash. Accepted references and
//! digests are checked the same way, and a route built from accepted parts parses back
//! to the same route.
#![no_main]

use ferry_registry::auth::scope::valid_repository_name;
use ferry_registry::server::routes::{Route, parse_digest, parse_name, parse_tag};
use libfuzzer_sys::fuzz_target;

fn check_name(name: &str) {
    let accepted = parse_name(name).is_ok();
    assert_eq!(
        accepted,
        valid_repository_name(name),
        "router and auth scope disagree on {name:?}"
    );
    if !accepted {
        return;
    }
    assert!(
        ferry_oci::RepositoryName::parse(name).is_ok(),
        "accepted {name:?} that ferry_oci refuses"
    );
    assert!(name.len() <= 255);
    assert!(!name.starts_with('/') && !name.ends_with('/'));
    for segment in name.split('/') {
        assert!(!segment.is_empty(), "empty segment in {name:?}");
        assert!(segment != "." && segment != "..", "dot segment in {name:?}");
        assert!(!segment.contains(".."), "'..' in {name:?}");
    }
    assert!(
        name.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-/".contains(&b)),
        "odd byte in {name:?}"
    );
}

fn check_reference(reference: &str) {
    if parse_tag(reference).is_ok() {
        assert!(!reference.is_empty() && reference.len() <= 128);
        assert!(!reference.contains(['/', ':', '%', '\\']), "{reference:?}");
        assert!(!reference.starts_with('.'), "{reference:?}");
    }
    if parse_digest(reference).is_ok() {
        let hex = reference.strip_prefix("sha256:").unwrap_or("");
        assert_eq!(hex.len(), 64, "{reference:?}");
        assert!(hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    check_name(path);
    check_reference(path);
    let Some(route) = Route::parse(path) else {
        return;
    };
    let last = match route {
        Route::Manifest { reference, .. } => Some(reference),
        Route::Blob { digest, .. }
        | Route::Referrers { digest, .. }
        | Route::Traces {
            subject: digest, ..
        } => Some(digest),
        Route::Upload { id, .. } => Some(id),
        _ => None,
    };
    if let Some(last) = last {
        assert!(!last.contains('/'), "{route:?} from {path:?}");
        check_reference(last);
    }
    if let Some(name) = route.name() {
        check_name(name);
        if parse_name(name).is_ok() {
            // Rebuild the canonical path: it must route to the same thing.
            let rebuilt = match route {
                Route::Tags { name } => format!("/v2/{name}/tags/list"),
                Route::Manifest { name, reference } => format!("/v2/{name}/manifests/{reference}"),
                Route::Blob { name, digest } => format!("/v2/{name}/blobs/{digest}"),
                Route::UploadStart { name } => format!("/v2/{name}/blobs/uploads/"),
                Route::Upload { name, id } => format!("/v2/{name}/blobs/uploads/{id}"),
                Route::Referrers { name, digest } => format!("/v2/{name}/referrers/{digest}"),
                Route::Traces { name, subject } => format!("/v2/{name}/ferry-traces/{subject}"),
                Route::Base | Route::Catalog => unreachable!("no name"),
            };
            assert_eq!(Route::parse(&rebuilt), Some(route), "{path:?} -> {rebuilt:?}");
        }
    }
});
