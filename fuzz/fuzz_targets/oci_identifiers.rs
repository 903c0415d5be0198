//! Fuzzes ferry-oci's identifier parsers: repository names, tags, digests, manifest
//! references, image references and `--platform` values. Each either refuses its input
//! or returns a value that obeys its grammar and prints back to text that parses to the
//! same value; and the platform chooser, given an index built from the input, only ever
//! returns an entry whose platform runs on the one asked for.
#![no_main]

use ferry_oci::{ImageRef, Platform, Reference, RepositoryName, Tag, digest};
use libfuzzer_sys::fuzz_target;

fn check_name(s: &str) {
    let Ok(n) = RepositoryName::parse(s) else {
        return;
    };
    assert_eq!(n.as_str(), s);
    assert!(!s.is_empty() && s.len() <= 255, "{s:?}");
    for c in s.split('/') {
        let b = c.as_bytes();
        assert!(!b.is_empty(), "empty component in {s:?}");
        assert!(b[0].is_ascii_alphanumeric() && b[b.len() - 1].is_ascii_alphanumeric());
        assert!(!c.contains("..") && !c.contains("___") && !c.contains("_-"), "{s:?}");
        assert!(c.bytes().all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || b"._-".contains(&x)));
    }
    let json = serde_json::to_string(&n).unwrap();
    assert_eq!(serde_json::from_str::<RepositoryName>(&json).unwrap(), n);
}

fn check_tag(s: &str) {
    let Ok(t) = Tag::parse(s) else {
        return;
    };
    assert_eq!(t.as_str(), s);
    assert!(!s.is_empty() && s.len() <= 128);
    assert!(!s.starts_with(['.', '-']) && !s.contains([':', '/', '@', '%']), "{s:?}");
}

fn check_digest(s: &str) {
    let parsed = digest::parse(s);
    if let Ok(d) = &parsed {
        assert_eq!(d.to_string(), s);
        let (alg, enc) = s.split_once(':').unwrap();
        let lower_hex = |n: usize| enc.len() == n && enc.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        match alg {
            "sha256" => assert!(lower_hex(64), "{s:?}"),
            "sha512" => assert!(lower_hex(128), "{s:?}"),
            _ => {}
        }
        assert!(!enc.contains(['/', '.', ':']), "{s:?}");
    }
    assert_eq!(
        digest::parse_sha256(s).is_ok(),
        parsed.as_ref().is_ok_and(digest::is_sha256),
        "{s:?}"
    );
}

fn check_reference(s: &str) {
    if let Ok(r) = Reference::parse(s) {
        assert_eq!(r.as_str(), s);
        assert_eq!(matches!(r, Reference::Digest(_)), s.contains(':'));
    }
}

fn check_image_ref(s: &str) {
    let Ok(r) = ImageRef::parse(s) else {
        return;
    };
    let printed = r.to_string();
    assert_eq!(ImageRef::parse(&printed).ok(), Some(r.clone()), "{s:?} -> {printed:?}");
}

fn check_platform(s: &str) -> Option<Platform> {
    let p = Platform::parse(s).ok()?;
    let printed = p.to_string();
    assert_eq!(Platform::parse(&printed).ok(), Some(p.clone()), "{s:?} -> {printed:?}");
    assert_eq!(p.distance(&p), Some(0));
    Some(p)
}

/// An index whose entries' platforms are the input's lines; the chooser's pick must run
/// on the wanted platform (the first line).
fn check_chooser(lines: &[&str]) {
    let Some((first, rest)) = lines.split_first() else {
        return;
    };
    let Some(want) = check_platform(first) else {
        return;
    };
    let entries: Vec<serde_json::Value> = rest
        .iter()
        .take(16)
        .enumerate()
        .map(|(i, l)| {
            let parts: Vec<&str> = l.split('/').collect();
            let mut e = serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{i:064x}"),
                "size": 1,
            });
            if parts.len() >= 2 {
                e["platform"] = serde_json::json!({"os": parts[0], "architecture": parts[1]});
                if let Some(v) = parts.get(2) {
                    e["platform"]["variant"] = serde_json::json!(v);
                }
            }
            e
        })
        .collect();
    let doc = serde_json::json!({"schemaVersion": 2, "manifests": entries});
    let Ok(index) = serde_json::from_value::<ferry_oci::ImageIndex>(doc) else {
        return;
    };
    if let Ok(d) = ferry_oci::choose_manifest(&index, &want)
        && let Some(p) = d.platform()
    {
        assert!(want.distance(&Platform::of_spec(p)).is_some(), "{want} got {p:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    check_name(s);
    check_tag(s);
    check_digest(s);
    check_reference(s);
    check_image_ref(s);
    check_platform(s);
    let lines: Vec<&str> = s.lines().collect();
    check_chooser(&lines);
});
