//! Fuzzes the client's `WWW-Authenticate` parser (every challenge, all parameters) and
//! the load tester's reading of it (first challenge, Basic or Bearer with a realm). Neither
//! may panic or produce more than the input holds; challenges written back in canonical
//! form (`scheme k="v", …` with `\` escapes) must parse to the same thing both ways.
#![no_main]

use ferry_registry_client::auth::{Challenge as ClientChallenge, parse_challenges};
use ferry_loadtest::{Challenge, parse_challenge};
use libfuzzer_sys::fuzz_target;

fn quote(v: &str) -> String {
    let mut out = String::with_capacity(v.len() + 2);
    out.push('"');
    for c in v.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn write(challenges: &[ClientChallenge]) -> String {
    challenges
        .iter()
        .map(|c| {
            let mut params: Vec<_> = c.params.iter().collect();
            params.sort();
            let params: Vec<String> =
                params.iter().map(|(k, v)| format!("{k}={}", quote(v))).collect();
            if params.is_empty() {
                c.scheme.clone()
            } else {
                format!("{} {}", c.scheme, params.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fuzz_target!(|data: &[u8]| {
    let Ok(header) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = parse_challenges(header);
    assert!(parsed.len() <= header.len());
    for c in &parsed {
        assert!(!c.scheme.is_empty());
        assert!(!c.scheme.contains(|ch: char| ch.is_whitespace() || ch == '=' || ch == ','));
        assert_eq!(c.scheme, c.scheme.to_ascii_lowercase());
        for (k, v) in &c.params {
            assert!(!k.is_empty() && k.len() <= header.len() && v.len() <= header.len());
        }
    }
    if let Some(Challenge::Bearer { realm, .. }) = parse_challenge(header) {
        assert!(realm.len() <= header.len());
    }

    // Canonical form round trips through the client parser.
    let canonical = write(&parsed);
    assert_eq!(parse_challenges(&canonical), parsed, "{header:?} -> {canonical:?}");

    // …and the load tester reads the first of them the same way (within its length cap).
    if let Some(first) = parsed.first()
        && canonical.len() <= 8192
        && !first.params.is_empty()
        && first.params.keys().all(|k| !k.contains(['"', '\\']))
    {
        let want = match first.scheme.as_str() {
            "basic" => Some(Challenge::Basic),
            "bearer" => first.params.get("realm").map(|realm| Challenge::Bearer {
                realm: realm.clone(),
                service: first.params.get("service").cloned(),
                scope: first.params.get("scope").cloned(),
            }),
            _ => None,
        };
        assert_eq!(parse_challenge(&canonical), want, "load tester on {canonical:?}");
    }
});
