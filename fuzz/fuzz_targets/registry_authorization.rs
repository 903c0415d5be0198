//! Fuzzes the registry's request authentication: `Authorization` header parsing (Basic and
//! Bearer) and JWT verification, through the real [`Authenticator`] with a fixed HS256
//! key, one htpasswd user and no anonymous access. The invariant is the one that matters:
//! a request is let in only with `alice`'s exact password, or with a token whose HS256
//! signature over its own header and payload checks out under the key (checked here
//! independently with a from-scratch HMAC) — never a token signed by another key, with
//! another algorithm or `none`, or altered after signing.
//!
//! Inputs pick a mode: a raw header value; a token the key really signed (claims from the
//! input), then altered at an input-chosen byte; or a token assembled from an
//! input-chosen JOSE header, real claims and a signature by the right or a wrong key.
#![no_main]

use std::sync::OnceLock;

use base64::Engine as _;
use ferry_registry::auth::scope::{Actions, Scope};
use ferry_registry::auth::token::{ResourceActions, TokenSigner, unix_now};
use ferry_registry::auth::{AccessRule, AuthConfig, Authenticator};
use ferry_registry::fuzz_api::{AuthorizationCredential, parse_authorization};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

const SECRET: &[u8] = b"fuzz-token-secret-0123456789abcdef";
const WRONG_SECRET: &[u8] = b"fuzz-token-secret-0123456789abcdeF";
const USER: &str = "alice";
const PASSWORD: &str = "wonderland";
const SERVICE: &str = "fuzz-registry";

struct Fixture {
    auth: Authenticator,
    signer: TokenSigner,
    wrong: TokenSigner,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let htpasswd = dir.path().join("htpasswd");
        let line = ferry_registry::auth::htpasswd_line(USER, PASSWORD, 4).expect("hash");
        std::fs::write(&htpasswd, format!("{line}\n")).expect("write htpasswd");
        let cfg = AuthConfig {
            enabled: Some(true),
            htpasswd: Some(htpasswd),
            service: SERVICE.to_string(),
            secret: Some(String::from_utf8(SECRET.to_vec()).expect("ascii")),
            catalog: vec![USER.to_string()],
            rules: vec![AccessRule {
                repository: "**".to_string(),
                users: vec![USER.to_string()],
                actions: vec!["*".to_string()],
            }],
            ..AuthConfig::default()
        };
        Fixture {
            auth: Authenticator::new(&cfg).expect("authenticator"),
            signer: TokenSigner::hs256(SECRET, SERVICE.to_string(), SERVICE.to_string()),
            wrong: TokenSigner::hs256(WRONG_SECRET, SERVICE.to_string(), SERVICE.to_string()),
            _dir: dir,
        }
    })
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut block = [0u8; 64];
    block[..key.len()].copy_from_slice(key);
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().to_vec()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Whether `token` is HS256 and really signed by [`SECRET`], judged without jsonwebtoken.
fn signed_by_key(token: &str) -> bool {
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let Ok(header_json) = engine.decode(header) else {
        return false;
    };
    // Read leniently: the verifier skips unknown members without checking their UTF-8, so
    // a strict parse here would call a genuinely signed token forged. Replacing invalid
    // bytes cannot create an `alg` member or turn its value into "HS256".
    let alg_is_hs256 =
        serde_json::from_str::<serde_json::Value>(&String::from_utf8_lossy(&header_json))
            .ok()
            .and_then(|h| h.get("alg").and_then(|a| a.as_str()).map(|a| a == "HS256"))
            .unwrap_or(false);
    let Ok(signature) = engine.decode(signature) else {
        return false;
    };
    alg_is_hs256 && signature == hmac_sha256(SECRET, format!("{header}.{payload}").as_bytes())
}

/// Real claims for a token, from the input.
fn claims_from(data: &[u8]) -> (Option<String>, Vec<ResourceActions>, bool) {
    let text = String::from_utf8_lossy(data);
    let mut fields = text.split('\n');
    let subject = fields.next().filter(|s| !s.is_empty()).map(str::to_string);
    let access = fields
        .by_ref()
        .take(4)
        .map(|line| {
            let (name, actions) = line.split_once(' ').unwrap_or((line, "pull"));
            ResourceActions {
                kind: if name == "catalog" { "registry" } else { "repository" }.to_string(),
                name: name.to_string(),
                actions: actions.split(',').map(str::to_string).collect(),
            }
        })
        .collect();
    (subject, access, data.first().is_some_and(|b| b & 1 == 1))
}

fn check(header: &[u8]) {
    let fx = fixture();
    let credential = parse_authorization(header);
    if let Some(AuthorizationCredential::Bearer(t) | AuthorizationCredential::Basic(t)) = credential
    {
        assert!(!t.is_empty() && t.len() <= header.len());
    }
    let Ok(value) = http::HeaderValue::from_bytes(header) else {
        return;
    };
    let basic_decoded = match credential {
        Some(AuthorizationCredential::Basic(b)) => {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
                .and_then(|d| String::from_utf8(d).ok());
            // Unknown users cost a full-strength bcrypt run (by design); keep the fuzzer
            // fast by only sending the known user's attempts through the authenticator.
            if !decoded.as_deref().is_some_and(|d| d.starts_with("alice:")) {
                return;
            }
            decoded
        }
        _ => None,
    };
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::AUTHORIZATION, value);
    let scopes = [
        Scope::base(),
        Scope::catalog(),
        Scope::repository("library/app", Actions::PULL),
        Scope::repository("library/app", Actions::ALL),
    ];
    for scope in &scopes {
        let Ok(access) = fx.auth.check(&headers, scope) else {
            continue;
        };
        match credential {
            Some(AuthorizationCredential::Bearer(token)) => assert!(
                signed_by_key(token),
                "let in with a token the key did not sign: {token:?} ({access:?})"
            ),
            Some(AuthorizationCredential::Basic(_)) => {
                assert_eq!(
                    basic_decoded.as_deref(),
                    Some("alice:wonderland"),
                    "let in with a wrong password"
                );
                assert_eq!(access.subject.as_deref(), Some(USER));
            }
            None => panic!("let in without credentials: {header:?} {scope:?}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let fx = fixture();
    let now = unix_now();
    match mode % 4 {
        0 | 1 => check(rest),
        2 => {
            // A genuine token, then one byte changed (or the token cut short).
            if rest.len() < 3 {
                return;
            }
            let (subject, access, refresh) = claims_from(&rest[3..]);
            let refresh = refresh.then(|| "fingerprint".to_string());
            let Ok(token) = fx.signer.issue(subject.as_deref(), access, now, 300, refresh) else {
                return;
            };
            let mut bytes = token.clone().into_bytes();
            let at = usize::from(u16::from_le_bytes([rest[0], rest[1]])) % bytes.len();
            if rest[2] == 0 {
                bytes.truncate(at);
            } else {
                bytes[at] = rest[2] & 0x7f;
            }
            let altered = String::from_utf8(bytes).unwrap_or_default();
            if altered != token {
                assert!(
                    fx.signer.verify_claims(&altered).is_err()
                        || signed_by_key(&altered),
                    "altered token accepted: {altered:?}"
                );
            }
            check(format!("Bearer {altered}").as_bytes());
        }
        _ => {
            // Input-chosen JOSE header over real claims, signed by the right or wrong key.
            let Some((&flags, jose)) = rest.split_first() else {
                return;
            };
            let claims = serde_json::json!({
                "iss": SERVICE, "sub": USER, "aud": SERVICE,
                "exp": now + 300, "nbf": now - 1, "iat": now, "jti": "x",
                "access": [{"type": "repository", "name": "library/app", "actions": ["*"]}],
            });
            let signing_input = format!("{}.{}", b64(jose), b64(claims.to_string().as_bytes()));
            let key = if flags & 1 == 0 { SECRET } else { WRONG_SECRET };
            let signature = if flags & 2 == 0 {
                b64(&hmac_sha256(key, signing_input.as_bytes()))
            } else {
                String::new()
            };
            let token = format!("{signing_input}.{signature}");
            if fx.signer.verify_claims(&token).is_ok() {
                assert!(signed_by_key(&token), "accepted {token:?}");
            }
            assert!(fx.wrong.verify_claims(&token).is_err() || key == WRONG_SECRET);
            check(format!("Bearer {token}").as_bytes());
        }
    }
});
