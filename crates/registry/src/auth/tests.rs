//! Tests for the auth module: parsing, signing, rules, caching, challenges and the token
//! endpoint end to end.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use base64::Engine as _;
use http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use http_body_util::BodyExt as _;
use tower::ServiceExt as _;

use super::htpasswd::{Htpasswd, HtpasswdError, UserFile, htpasswd_line};
use super::rules::{RepositoryGlob, Rules};
use super::scope::{RequestedScope, ScopeError, parse_scope, parse_scopes, valid_repository_name};
use super::token::{Grant, ResourceActions, TokenSigner, unix_now};
use super::*;

const COST: u32 = 4;
const SECRET: &str = "0123456789abcdef0123456789abcdef";

fn line(user: &str, password: &str) -> String {
    htpasswd_line(user, password, COST).unwrap()
}

struct Fixture {
    _dir: tempfile::TempDir,
    htpasswd: PathBuf,
    auth: Arc<Authenticator>,
}

/// An enabled authenticator with users alice/alice-pw and bob/bob-pw plus extra TOML.
fn fixture(extra_toml: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let htpasswd = dir.path().join("htpasswd");
    std::fs::write(
        &htpasswd,
        format!("{}\n{}\n", line("alice", "alice-pw"), line("bob", "bob-pw")),
    )
    .unwrap();
    let text = format!(
        "htpasswd = {:?}\nsecret = {SECRET:?}\nrealm = \"https://reg.example/token\"\nservice = \"reg.example\"\n{extra_toml}",
        htpasswd.display().to_string()
    );
    let cfg: AuthConfig = toml::from_str(&text).unwrap();
    let auth = Arc::new(Authenticator::new(&cfg).unwrap());
    Fixture {
        _dir: dir,
        htpasswd,
        auth,
    }
}

fn basic(user: &str, password: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    headers.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Basic {encoded}")).unwrap(),
    );
    headers
}

fn bearer(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    headers
}

fn signer() -> TokenSigner {
    TokenSigner::hs256(
        SECRET.as_bytes(),
        "reg.example".into(),
        "reg.example".into(),
    )
}

fn repo_access(name: &str, actions: &[&str]) -> Vec<ResourceActions> {
    vec![ResourceActions {
        kind: "repository".into(),
        name: name.into(),
        actions: actions.iter().map(|a| a.to_string()).collect(),
    }]
}

// ---------- config ----------

#[test]
fn default_config_disables_auth() {
    let cfg = AuthConfig::default();
    assert!(!cfg.is_enabled());
    let auth = Authenticator::new(&cfg).unwrap();
    assert!(!auth.enabled());
    let ok = auth
        .check(&HeaderMap::new(), &Scope::repository("a", Actions::ALL))
        .unwrap();
    assert_eq!(ok.subject, None);
}

#[test]
fn config_parses_durations_and_rejects_unknown_fields() {
    let cfg: AuthConfig =
        toml::from_str("token_ttl = \"5m\"\nrefresh_ttl = 60\nmode = \"basic\"").unwrap();
    assert_eq!(cfg.token_ttl.as_secs(), 300);
    assert_eq!(cfg.refresh_ttl.as_secs(), 60);
    assert_eq!(cfg.mode, AuthMode::Basic);
    assert!(toml::from_str::<AuthConfig>("tokenttl = 5").is_err());
    assert!(
        toml::from_str::<AuthConfig>(
            "[[rules]]\nrepository = \"a\"\nusers = []\nactions = []\nextra = 1"
        )
        .is_err()
    );
}

#[test]
fn bad_rule_action_is_a_config_error() {
    let cfg: AuthConfig =
        toml::from_str("enabled = true\nsecret = \"0123456789abcdef\"\n[[rules]]\nrepository = \"a/**\"\nusers = [\"*\"]\nactions = [\"write\"]")
            .unwrap();
    let err = Authenticator::new(&cfg).unwrap_err().to_string();
    assert!(err.contains("rules[0]") && err.contains("write"), "{err}");
}

#[test]
fn short_secret_and_ambiguous_keys_refused() {
    let cfg: AuthConfig = toml::from_str("enabled = true\nsecret = \"short\"").unwrap();
    assert!(Authenticator::new(&cfg).is_err());
    let cfg: AuthConfig =
        toml::from_str("enabled = true\nsecret = \"0123456789abcdef\"\nsecret_file = \"/tmp/x\"")
            .unwrap();
    assert!(Authenticator::new(&cfg).is_err());
}

// ---------- htpasswd ----------

#[test]
fn htpasswd_parses_good_lines() {
    let text = format!(
        "# users\n\n{}\n  {}  \n",
        line("alice", "a"),
        line("bob", "b")
    );
    let parsed = Htpasswd::parse(&text, Path::new("x")).unwrap();
    assert_eq!(parsed.len(), 2);
    assert!(parsed.hash_of("alice").unwrap().starts_with("$2y$04$"));
    assert!(parsed.hash_of("carol").is_none());
    // $2a$/$2b$ variants are bcrypt too.
    let b = line("carol", "c").replacen("$2y$", "$2b$", 1);
    assert!(Htpasswd::parse(&b, Path::new("x")).is_ok());
}

#[test]
fn htpasswd_max_cost_is_the_slowest_users() {
    // Unknown users are checked against a dummy hash of this cost: timing must not
    // tell them apart from the slowest real user.
    let five = htpasswd_line("dave", "d", 5).unwrap();
    let text = format!("{}\n{five}\n", line("alice", "a"));
    assert_eq!(
        Htpasswd::parse(&text, Path::new("x")).unwrap().max_cost(),
        Some(5)
    );
    assert_eq!(Htpasswd::default().max_cost(), None);
}

fn line_error(text: &str) -> (usize, String) {
    match Htpasswd::parse(text, Path::new("/etc/ferry/htpasswd")).unwrap_err() {
        HtpasswdError::Line { line, reason, path } => {
            assert_eq!(path, Path::new("/etc/ferry/htpasswd"));
            (line, reason)
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn htpasswd_refuses_non_bcrypt_and_bad_lines_naming_the_line() {
    let good = line("alice", "a");
    let (n, why) = line_error(&format!("{good}\nbob:$apr1$abc$def\n"));
    assert_eq!(n, 2);
    assert!(why.contains("Apache MD5") && why.contains("bob"), "{why}");
    let (n, why) = line_error(&format!(
        "#c\n{good}\ncarol:{{SHA}}qUqP5cyxm6YcTAhz05Hph5gvu9M=\n"
    ));
    assert_eq!(n, 3);
    assert!(why.contains("SHA-1"), "{why}");
    let (_, why) = line_error("dave:plaintext");
    assert!(why.contains("not a bcrypt hash"), "{why}");
    let (_, why) = line_error("no-colon-here");
    assert!(why.contains("user:hash"), "{why}");
    let (_, why) = line_error("erin:$2y$04$short");
    assert!(why.contains("malformed"), "{why}");
    // Found by fuzzing: hashes bcrypt can never verify used to load (every login then
    // failed silently): a signed cost, and characters outside bcrypt's base64.
    let hash = good.split_once(':').unwrap().1.to_string();
    for bad in [
        hash.replacen("$04$", "$+4$", 1),
        format!("{}\u{e}{}", &hash[..40], &hash[41..]),
        format!("{}:{}", &hash[..40], &hash[41..]),
        format!("{}é{}", &hash[..40], &hash[42..]),
    ] {
        let (_, why) = line_error(&format!("frank:{bad}"));
        assert!(why.contains("malformed"), "{bad:?}: {why}");
    }
    let (n, why) = line_error(&format!("{good}\n{good}"));
    assert_eq!(n, 2);
    assert!(why.contains("twice"));
    let (_, why) = line_error(&line("x", "y").replacen("x:", "anonymous:", 1));
    assert!(why.contains("invalid user name"), "{why}");
    let full = HtpasswdError::Line {
        path: "/p".into(),
        line: 7,
        reason: "r".into(),
    }
    .to_string();
    assert_eq!(full, "htpasswd /p line 7: r");
}

#[test]
fn htpasswd_line_and_set_user_write_verifiable_bcrypt() {
    let l = line("alice", "s3cret");
    let (user, hash) = l.split_once(':').unwrap();
    assert_eq!(user, "alice");
    assert!(bcrypt::verify("s3cret", hash).unwrap());
    assert!(!bcrypt::verify("wrong", hash).unwrap());
    assert!(htpasswd_line("bad:name", "x", COST).is_err());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("htpasswd");
    set_user(&path, "alice", "one", COST).unwrap();
    set_user(&path, "bob", "two", COST).unwrap();
    set_user(&path, "alice", "three", COST).unwrap();
    let parsed = Htpasswd::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    assert_eq!(parsed.len(), 2);
    assert!(bcrypt::verify("three", parsed.hash_of("alice").unwrap()).unwrap());
    assert!(bcrypt::verify("two", parsed.hash_of("bob").unwrap()).unwrap());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}

#[test]
fn user_file_reloads_and_fails_closed_on_bad_content() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("htpasswd");
    std::fs::write(&path, line("alice", "a")).unwrap();
    let file = UserFile::open(&path).unwrap();
    let (users, generation) = file.current();
    assert!(users.hash_of("alice").is_some());
    std::fs::write(
        &path,
        format!("{}\n{}", line("alice", "a"), line("bob", "b")),
    )
    .unwrap();
    file.force_recheck();
    let (users, next) = file.current();
    assert!(users.hash_of("bob").is_some());
    assert!(next > generation);
    std::fs::write(&path, "alice:$apr1$x$y\n").unwrap();
    file.force_recheck();
    assert!(file.current().0.is_empty());
}

// ---------- tokens ----------

#[test]
fn token_roundtrip_carries_subject_and_access() {
    let s = signer();
    let token = s
        .issue(
            Some("alice"),
            repo_access("team/app", &["pull", "push"]),
            unix_now(),
            300,
            None,
        )
        .unwrap();
    let grant = s.verify_access(&token).unwrap();
    assert_eq!(grant.subject.as_deref(), Some("alice"));
    assert!(grant.covers(&Scope::repository("team/app", Actions::PULL_PUSH)));
    assert!(grant.covers(&Scope::repository("team/app", Actions::PULL)));
    assert!(grant.covers(&Scope::base()));
    assert!(!grant.covers(&Scope::repository("team/app", Actions::DELETE)));
    assert!(!grant.covers(&Scope::repository("team/other", Actions::PULL)));
    assert!(!grant.covers(&Scope::catalog()));
    let anonymous = s.issue(None, Vec::new(), unix_now(), 300, None).unwrap();
    assert_eq!(s.verify_access(&anonymous).unwrap().subject, None);
}

#[test]
fn expired_and_not_yet_valid_tokens_refused() {
    let s = signer();
    let old = s
        .issue(Some("alice"), Vec::new(), unix_now() - 1000, 60, None)
        .unwrap();
    assert!(s.verify_access(&old).is_err());
    let future = s
        .issue(Some("alice"), Vec::new(), unix_now() + 1000, 60, None)
        .unwrap();
    assert!(s.verify_access(&future).is_err());
}

#[test]
fn wrong_audience_issuer_or_key_refused() {
    let s = signer();
    let other_aud = TokenSigner::hs256(SECRET.as_bytes(), "reg.example".into(), "other".into());
    let other_iss = TokenSigner::hs256(SECRET.as_bytes(), "evil".into(), "reg.example".into());
    let other_key = TokenSigner::hs256(
        b"another-secret-of-enough-length",
        "reg.example".into(),
        "reg.example".into(),
    );
    for foreign in [&other_aud, &other_iss, &other_key] {
        let token = foreign
            .issue(
                Some("alice"),
                repo_access("a", &["pull"]),
                unix_now(),
                300,
                None,
            )
            .unwrap();
        assert!(s.verify_access(&token).is_err());
    }
}

#[test]
fn tampered_and_unsigned_tokens_refused() {
    let s = signer();
    let token = s
        .issue(
            Some("bob"),
            repo_access("a", &["pull"]),
            unix_now(),
            300,
            None,
        )
        .unwrap();
    let parts: Vec<&str> = token.split('.').collect();
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let payload = String::from_utf8(engine.decode(parts[1]).unwrap()).unwrap();
    let forged = engine.encode(
        payload
            .replace("\"pull\"", "\"push\"")
            .replace("bob", "eve"),
    );
    assert!(
        s.verify_access(&format!("{}.{}.{}", parts[0], forged, parts[2]))
            .is_err()
    );
    let none_header = engine.encode(r#"{"alg":"none","typ":"JWT"}"#);
    assert!(
        s.verify_access(&format!("{none_header}.{}.", parts[1]))
            .is_err()
    );
    assert!(s.verify_access("not-a-jwt").is_err());
    assert!(s.verify_access(&"a".repeat(20_000)).is_err());
}

#[test]
fn refresh_tokens_are_not_access_tokens() {
    let s = signer();
    let refresh = s
        .issue(
            Some("alice"),
            Vec::new(),
            unix_now(),
            300,
            Some("fp".into()),
        )
        .unwrap();
    assert!(s.verify_access(&refresh).is_err());
    assert_eq!(
        s.verify_refresh(&refresh).unwrap(),
        ("alice".to_string(), "fp".to_string())
    );
    let access = s
        .issue(Some("alice"), Vec::new(), unix_now(), 300, None)
        .unwrap();
    assert!(s.verify_refresh(&access).is_err());
}

#[test]
fn es256_and_rs256_key_pairs_sign_and_verify() {
    let es_priv = include_bytes!("testdata/es256-private.pem");
    let es_pub = include_bytes!("testdata/es256-public.pem");
    let es = TokenSigner::from_pem(es_priv, es_pub, "i".into(), "a".into()).unwrap();
    assert_eq!(es.algorithm(), jsonwebtoken::Algorithm::ES256);
    let token = es
        .issue(Some("alice"), Vec::new(), unix_now(), 60, None)
        .unwrap();
    assert!(es.verify_access(&token).is_ok());
    let header = jsonwebtoken::decode_header(&token).unwrap();
    let kid = header.kid.unwrap();
    assert_eq!(kid.len(), 12 * 4 + 11, "libtrust key id: {kid}");
    assert_eq!(kid.split(':').count(), 12);

    // Mismatched pair fails at startup.
    let other_pub = include_bytes!("testdata/es256-other-public.pem");
    let err = TokenSigner::from_pem(es_priv, other_pub, "i".into(), "a".into()).unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");

    let rs = TokenSigner::from_pem(
        include_bytes!("testdata/rs256-private.pem"),
        include_bytes!("testdata/rs256-public.pem"),
        "i".into(),
        "a".into(),
    )
    .unwrap();
    assert_eq!(rs.algorithm(), jsonwebtoken::Algorithm::RS256);
    let token = rs.issue(None, Vec::new(), unix_now(), 60, None).unwrap();
    assert!(rs.verify_access(&token).is_ok());
    // An ES256 verifier does not accept the RS256 token (algorithm pinned).
    assert!(es.verify_access(&token).is_err());
    assert!(TokenSigner::from_pem(b"garbage", es_pub, "i".into(), "a".into()).is_err());
}

#[test]
fn secret_file_is_created_private_and_shared() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("keys/token.secret");
    let text = format!(
        "enabled = true\nsecret_file = {:?}",
        secret.display().to_string()
    );
    let cfg: AuthConfig = toml::from_str(&text).unwrap();
    let first = TokenSigner::from_config(&cfg).unwrap();
    let contents = std::fs::read_to_string(&secret).unwrap();
    assert_eq!(contents.trim().len(), 64);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    let second = TokenSigner::from_config(&cfg).unwrap();
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), contents);
    let token = first
        .issue(Some("alice"), Vec::new(), unix_now(), 60, None)
        .unwrap();
    assert!(second.verify_access(&token).is_ok());
    // Only the secret file remains in the directory (no temp leftovers).
    assert_eq!(
        std::fs::read_dir(secret.parent().unwrap()).unwrap().count(),
        1
    );
}

// ---------- scopes ----------

#[test]
fn scope_parsing_edge_cases() {
    assert_eq!(
        parse_scope("repository:team/sub/app:pull,push").unwrap(),
        RequestedScope::Repository {
            name: "team/sub/app".into(),
            actions: Actions::PULL_PUSH
        }
    );
    assert_eq!(
        parse_scope("repository(plugin):vieux/sshfs:pull").unwrap(),
        RequestedScope::Repository {
            name: "vieux/sshfs".into(),
            actions: Actions::PULL
        }
    );
    assert_eq!(
        parse_scope("repository:a:*").unwrap(),
        RequestedScope::Repository {
            name: "a".into(),
            actions: Actions::ALL
        }
    );
    assert_eq!(
        parse_scope("repository:a:pull,frobnicate").unwrap(),
        RequestedScope::Repository {
            name: "a".into(),
            actions: Actions::PULL
        }
    );
    assert_eq!(
        parse_scope("repository:a:").unwrap(),
        RequestedScope::Repository {
            name: "a".into(),
            actions: Actions::NONE
        }
    );
    assert_eq!(
        parse_scope("registry:catalog:*").unwrap(),
        RequestedScope::Catalog
    );
    assert_eq!(
        parse_scope("registry:other:*").unwrap(),
        RequestedScope::Other
    );
    assert_eq!(
        parse_scope("artifact:x:pull").unwrap(),
        RequestedScope::Other
    );
    assert!(matches!(
        parse_scope("repository"),
        Err(ScopeError::Malformed(_))
    ));
    assert!(matches!(
        parse_scope("repository:pull"),
        Err(ScopeError::Malformed(_))
    ));
    assert!(matches!(
        parse_scope("repository::pull"),
        Err(ScopeError::Malformed(_))
    ));
    assert!(matches!(
        parse_scope(":a:pull"),
        Err(ScopeError::Malformed(_))
    ));
    assert!(matches!(
        parse_scope("repository:../etc:pull"),
        Err(ScopeError::InvalidName(_))
    ));
    assert!(matches!(
        parse_scope("repository:Upper/Case:pull"),
        Err(ScopeError::InvalidName(_))
    ));
    assert!(matches!(
        parse_scope("repository:host:5000/a:pull"),
        Err(ScopeError::InvalidName(_))
    ));
    assert!(matches!(
        parse_scope(&"x".repeat(2000)),
        Err(ScopeError::TooLong(_))
    ));

    let many = parse_scopes([
        "repository:a:pull repository:b/c:push",
        "registry:catalog:*",
    ])
    .unwrap();
    assert_eq!(many.len(), 3);
    assert_eq!(many[2], RequestedScope::Catalog);
    assert!(parse_scopes(["repository:a:pull bad"]).is_err());
    assert!(parse_scopes(Vec::<&str>::new()).unwrap().is_empty());
}

#[test]
fn repository_name_grammar() {
    for good in ["a", "library/ubuntu", "a-b/c.d/e_f", "a__b", "a--b", "0/1"] {
        assert!(valid_repository_name(good), "{good}");
    }
    for bad in [
        "",
        "A",
        "a/",
        "/a",
        "a//b",
        "-a",
        "a-",
        "a___b",
        "a..b",
        "a/./b",
        "a b",
        &"a".repeat(256),
    ] {
        assert!(!valid_repository_name(bad), "{bad}");
    }
}

#[test]
fn scope_display_is_the_challenge_form() {
    assert_eq!(
        Scope::repository("foo/bar", Actions::PULL_PUSH).to_string(),
        "repository:foo/bar:pull,push"
    );
    assert_eq!(
        Scope::repository("foo", Actions::ALL).to_string(),
        "repository:foo:pull,push,delete"
    );
    assert_eq!(Scope::catalog().to_string(), "registry:catalog:*");
    assert_eq!(Scope::base().to_string(), "");
}

// ---------- rules ----------

#[test]
fn repository_globs() {
    let team = RepositoryGlob::new("team/**").unwrap();
    assert!(team.matches("team/a"));
    assert!(team.matches("team/a/b/c"));
    assert!(team.matches("team"));
    assert!(!team.matches("teamx/a"));
    assert!(!team.matches("other/team/a"));
    let one = RepositoryGlob::new("*/app").unwrap();
    assert!(one.matches("x/app"));
    assert!(!one.matches("x/y/app"));
    assert!(!one.matches("app"));
    let mid = RepositoryGlob::new("**/base").unwrap();
    assert!(mid.matches("base"));
    assert!(mid.matches("a/b/base"));
    assert!(!mid.matches("a/base/x"));
    let within = RepositoryGlob::new("lib/a*c?").unwrap();
    assert!(within.matches("lib/abcd"));
    assert!(within.matches("lib/acx"));
    assert!(!within.matches("lib/ac"));
    assert!(!within.matches("lib/ab/cd"));
    let both = RepositoryGlob::new("**/x/**/y").unwrap();
    assert!(both.matches("x/y"));
    assert!(both.matches("a/x/b/c/y"));
    assert!(!both.matches("a/x/b/c/y/z"));
    assert!(RepositoryGlob::new("").is_err());
    assert!(RepositoryGlob::new("a//b").is_err());
    assert!(RepositoryGlob::new("a/b**").is_err());
    // Worst-case input stays cheap (no exponential backtracking).
    let nasty = RepositoryGlob::new("**/a*a*a*a*a*b/**/c").unwrap();
    assert!(!nasty.matches(&vec!["a".repeat(40); 6].join("/")));
}

fn rules(toml_text: &str) -> Rules {
    Rules::new(&toml::from_str::<AuthConfig>(toml_text).unwrap()).unwrap()
}

#[test]
fn rules_first_match_wins_with_users_and_anonymous() {
    let r = rules(
        r#"
        anonymous_pull = true
        [[rules]]
        repository = "team/**"
        users = ["alice"]
        actions = ["*"]
        [[rules]]
        repository = "team/**"
        users = ["*"]
        actions = ["pull"]
        [[rules]]
        repository = "public/*"
        users = ["anonymous", "*"]
        actions = ["pull"]
        "#,
    );
    assert_eq!(r.allowed(Some("alice"), "team/app"), Actions::ALL);
    assert_eq!(r.allowed(Some("bob"), "team/app"), Actions::PULL);
    assert_eq!(
        r.allowed(None, "team/app"),
        Actions::PULL,
        "implicit anonymous_pull rule"
    );
    assert_eq!(
        r.allowed(Some("bob"), "private/x"),
        Actions::NONE,
        "rules configured: no implicit grant"
    );
    assert_eq!(r.allowed(None, "public/x"), Actions::PULL);
    assert!(r.catalog_allowed(Some("bob")));
    assert!(!r.catalog_allowed(None));
}

#[test]
fn no_rules_means_authenticated_everything_anonymous_pull_optional() {
    let closed = rules("");
    assert_eq!(closed.allowed(Some("x"), "a/b"), Actions::ALL);
    assert_eq!(closed.allowed(None, "a/b"), Actions::NONE);
    let open = rules("anonymous_pull = true");
    assert_eq!(open.allowed(None, "a/b"), Actions::PULL);
    assert_eq!(open.allowed(Some("x"), "a/b"), Actions::ALL);
}

// ---------- Authenticator::check ----------

#[test]
fn anonymous_access_follows_anonymous_pull() {
    let closed = fixture("");
    let err = closed
        .auth
        .check(&HeaderMap::new(), &Scope::repository("a", Actions::PULL))
        .unwrap_err();
    assert_eq!(err.status(), StatusCode::UNAUTHORIZED);
    let open = fixture("anonymous_pull = true");
    let ok = open
        .auth
        .check(&HeaderMap::new(), &Scope::repository("a", Actions::PULL))
        .unwrap();
    assert_eq!(ok.subject, None);
    let push = open
        .auth
        .check(
            &HeaderMap::new(),
            &Scope::repository("a", Actions::PULL_PUSH),
        )
        .unwrap_err();
    assert_eq!(push.kind(), DeniedKind::Unauthorized);
    // The API base always asks anonymous clients to authenticate (clients learn the realm).
    assert!(open.auth.check(&HeaderMap::new(), &Scope::base()).is_err());
}

#[test]
fn basic_credentials_checked_and_rules_applied() {
    let f = fixture(
        "[[rules]]\nrepository = \"alice/**\"\nusers = [\"alice\"]\nactions = [\"*\"]\n[[rules]]\nrepository = \"**\"\nusers = [\"*\"]\nactions = [\"pull\"]",
    );
    let scope = Scope::repository("alice/app", Actions::PULL_PUSH);
    let ok = f.auth.check(&basic("alice", "alice-pw"), &scope).unwrap();
    assert_eq!(ok.subject.as_deref(), Some("alice"));
    let forbidden = f.auth.check(&basic("bob", "bob-pw"), &scope).unwrap_err();
    assert_eq!(forbidden.status(), StatusCode::FORBIDDEN);
    assert_eq!(forbidden.code(), "DENIED");
    assert!(forbidden.challenge().is_none());
    assert!(
        f.auth
            .check(
                &basic("bob", "bob-pw"),
                &Scope::repository("alice/app", Actions::PULL)
            )
            .is_ok()
    );
    let wrong = f.auth.check(&basic("alice", "bob-pw"), &scope).unwrap_err();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let unknown = f.auth.check(&basic("mallory", "x"), &scope).unwrap_err();
    assert_eq!(unknown.status(), StatusCode::UNAUTHORIZED);
    assert!(
        f.auth
            .check(&basic("bob", "bob-pw"), &Scope::base())
            .is_ok()
    );
    // Garbage headers are refusals, not panics.
    for raw in [
        "Basic !!!",
        "Basic",
        "Digest x",
        "Bearer",
        "Basic bm9jb2xvbg==",
    ] {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static(raw));
        assert_eq!(
            f.auth.check(&headers, &scope).unwrap_err().status(),
            StatusCode::UNAUTHORIZED,
            "{raw}"
        );
    }
}

#[test]
fn basic_cache_hit_skips_bcrypt_and_never_admits_wrong_password() {
    let f = fixture("");
    let scope = Scope::repository("a", Actions::PULL);
    assert_eq!(f.auth.bcrypt_verifications(), 0);
    f.auth.check(&basic("alice", "alice-pw"), &scope).unwrap();
    assert_eq!(f.auth.bcrypt_verifications(), 1);
    for _ in 0..5 {
        f.auth.check(&basic("alice", "alice-pw"), &scope).unwrap();
    }
    assert_eq!(
        f.auth.bcrypt_verifications(),
        1,
        "cache hits must not run bcrypt"
    );
    // Wrong password after a cached success: verified (and refused) every time.
    assert!(f.auth.check(&basic("alice", "wrong"), &scope).is_err());
    assert!(f.auth.check(&basic("alice", "wrong"), &scope).is_err());
    assert_eq!(f.auth.bcrypt_verifications(), 3, "failures are not cached");
}

#[test]
fn changed_htpasswd_revokes_cached_password() {
    let f = fixture("");
    let scope = Scope::repository("a", Actions::PULL);
    f.auth.check(&basic("alice", "alice-pw"), &scope).unwrap();
    std::fs::write(
        &f.htpasswd,
        format!("{}\n{}\n", line("alice", "new-pw"), line("bob", "bob-pw")),
    )
    .unwrap();
    f.auth
        .inner
        .as_ref()
        .unwrap()
        .users
        .as_ref()
        .unwrap()
        .force_recheck();
    assert!(f.auth.check(&basic("alice", "alice-pw"), &scope).is_err());
    assert!(f.auth.check(&basic("alice", "new-pw"), &scope).is_ok());
}

#[test]
fn bearer_tokens_checked_against_scope() {
    let f = fixture(
        "[[rules]]\nrepository = \"**\"\nusers = [\"alice\"]\nactions = [\"*\"]\n[[rules]]\nrepository = \"**\"\nusers = [\"bob\"]\nactions = [\"pull\"]",
    );
    let s = signer();
    let alice = s
        .issue(
            Some("alice"),
            repo_access("x/y", &["pull"]),
            unix_now(),
            300,
            None,
        )
        .unwrap();
    let pull = Scope::repository("x/y", Actions::PULL);
    let push = Scope::repository("x/y", Actions::PULL_PUSH);
    assert_eq!(
        f.auth
            .check(&bearer(&alice), &pull)
            .unwrap()
            .subject
            .as_deref(),
        Some("alice")
    );
    // Allowed by the rules but not in the token: 401 asking for a wider token.
    let wider = f.auth.check(&bearer(&alice), &push).unwrap_err();
    assert_eq!(wider.status(), StatusCode::UNAUTHORIZED);
    assert!(
        wider
            .challenge()
            .unwrap()
            .contains("error=\"insufficient_scope\"")
    );
    // Not allowed by the rules at all: 403.
    let bob = s
        .issue(
            Some("bob"),
            repo_access("x/y", &["pull"]),
            unix_now(),
            300,
            None,
        )
        .unwrap();
    assert_eq!(
        f.auth.check(&bearer(&bob), &push).unwrap_err().status(),
        StatusCode::FORBIDDEN
    );
    // Anonymous token lacking the scope: 401.
    let anon = s.issue(None, Vec::new(), unix_now(), 300, None).unwrap();
    assert_eq!(
        f.auth.check(&bearer(&anon), &pull).unwrap_err().status(),
        StatusCode::UNAUTHORIZED
    );
    assert!(f.auth.check(&bearer(&anon), &Scope::base()).is_ok());
    // Invalid token.
    let bad = f.auth.check(&bearer("abc.def.ghi"), &pull).unwrap_err();
    assert!(bad.challenge().unwrap().contains("error=\"invalid_token\""));
    // Cached path gives the same answers.
    assert!(f.auth.check(&bearer(&alice), &pull).is_ok());
    assert!(f.auth.check(&bearer(&alice), &push).is_err());
}

#[test]
fn token_cache_is_bounded_and_keeps_valid_entries() {
    let cache = cache::ExpiringCache::new(8);
    for i in 0u64..100 {
        cache.insert(cache::credential_key(&i.to_le_bytes()), i, 1000 + i, 10);
        assert!(cache.len() <= 8);
    }
    assert_eq!(
        cache.get(&cache::credential_key(&99u64.to_le_bytes()), 10),
        Some(99)
    );
    assert_eq!(
        cache.get(&cache::credential_key(&99u64.to_le_bytes()), 2000),
        None,
        "expired"
    );
    cache.insert(cache::credential_key(b"x"), 1, 5, 10);
    assert_eq!(
        cache.get(&cache::credential_key(b"x"), 1),
        None,
        "already expired entries are not stored"
    );
}

// ---------- challenges ----------

#[test]
fn bearer_challenge_format() {
    let f = fixture("");
    let err = f
        .auth
        .check(
            &HeaderMap::new(),
            &Scope::repository("foo", Actions::PULL_PUSH),
        )
        .unwrap_err();
    assert_eq!(
        err.challenge().unwrap(),
        r#"Bearer realm="https://reg.example/token",service="reg.example",scope="repository:foo:pull,push""#
    );
    let base = f.auth.check(&HeaderMap::new(), &Scope::base()).unwrap_err();
    assert_eq!(
        base.challenge().unwrap(),
        r#"Bearer realm="https://reg.example/token",service="reg.example""#
    );
}

#[test]
fn default_realm_from_host_and_basic_mode() {
    let dir = tempfile::tempdir().unwrap();
    let htpasswd = dir.path().join("h");
    std::fs::write(&htpasswd, line("a", "b")).unwrap();
    let cfg: AuthConfig =
        toml::from_str(&format!("htpasswd = {:?}", htpasswd.display().to_string())).unwrap();
    let auth = Authenticator::new(&cfg).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert(
        header::HOST,
        HeaderValue::from_static("registry.local:5000"),
    );
    let scope = Scope::repository("a", Actions::PULL);
    let challenge = auth
        .check(&headers, &scope)
        .unwrap_err()
        .challenge()
        .unwrap()
        .to_string();
    assert_eq!(
        challenge,
        r#"Bearer realm="http://registry.local:5000/token",service="ferry-registry",scope="repository:a:pull""#
    );
    let tls = Authenticator::new(&cfg).unwrap().with_tls(true);
    assert!(
        tls.check(&headers, &scope)
            .unwrap_err()
            .challenge()
            .unwrap()
            .contains("realm=\"https://registry.local:5000/token\"")
    );
    // HTTP/2: authority from the URI.
    let uri: http::Uri = "https://h2.example/v2/a/manifests/x".parse().unwrap();
    let h2 = auth
        .check_request(Some(&uri), &HeaderMap::new(), &scope)
        .unwrap_err();
    assert!(
        h2.challenge()
            .unwrap()
            .contains("realm=\"http://h2.example/token\"")
    );
    // A hostile Host header is not echoed.
    let mut evil = HeaderMap::new();
    evil.insert(header::HOST, HeaderValue::from_static("x\",error=\"y"));
    assert!(
        auth.check(&evil, &scope)
            .unwrap_err()
            .challenge()
            .unwrap()
            .contains("realm=\"http://localhost/token\"")
    );

    let basic_cfg = AuthConfig {
        mode: AuthMode::Basic,
        ..cfg
    };
    let basic_auth = Authenticator::new(&basic_cfg).unwrap();
    assert_eq!(
        basic_auth
            .check(&headers, &scope)
            .unwrap_err()
            .challenge()
            .unwrap(),
        r#"Basic realm="ferry-registry""#
    );
}

#[tokio::test]
async fn denied_renders_spec_response() {
    let f = fixture("");
    let denied = f
        .auth
        .check(
            &HeaderMap::new(),
            &Scope::repository("foo", Actions::PULL_PUSH),
        )
        .unwrap_err();
    let response = axum::response::IntoResponse::into_response(denied);
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    assert!(
        response.headers()[header::WWW_AUTHENTICATE]
            .to_str()
            .unwrap()
            .starts_with("Bearer realm=")
    );
    let body: serde_json::Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["errors"][0]["code"], "UNAUTHORIZED");
    assert_eq!(
        body["errors"][0]["detail"],
        serde_json::json!([
            {"Type": "repository", "Name": "foo", "Action": "pull"},
            {"Type": "repository", "Name": "foo", "Action": "push"}
        ])
    );
    assert!(
        f.auth
            .check(&basic("alice", "alice-pw"), &Scope::catalog())
            .is_ok()
    );
    let anonymous_catalog = f
        .auth
        .check(&HeaderMap::new(), &Scope::catalog())
        .unwrap_err();
    let body = anonymous_catalog.body();
    assert_eq!(body["errors"][0]["detail"][0]["Type"], "registry");
}

// ---------- token endpoint ----------

async fn call(
    auth: &Arc<Authenticator>,
    request: Request<Body>,
) -> (StatusCode, HeaderMap, serde_json::Value) {
    let response = token_router(auth.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, serde_json::from_slice(&bytes).unwrap())
}

fn get(uri: &str, credentials: Option<(&str, &str)>) -> Request<Body> {
    let mut builder = Request::get(uri);
    if let Some((user, password)) = credentials {
        let encoded =
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        builder = builder.header(header::AUTHORIZATION, format!("Basic {encoded}"));
    }
    builder.body(Body::empty()).unwrap()
}

fn post(form: &str) -> Request<Body> {
    Request::post("/token")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(form.to_string()))
        .unwrap()
}

fn grant_of(auth: &Authenticator, token: &str) -> Grant {
    auth.inner
        .as_ref()
        .unwrap()
        .signer
        .verify_access(token)
        .unwrap()
}

#[tokio::test]
async fn token_endpoint_issues_scoped_tokens_for_users() {
    let f = fixture(
        "[[rules]]\nrepository = \"team/**\"\nusers = [\"alice\"]\nactions = [\"pull\", \"push\"]\n[[rules]]\nrepository = \"**\"\nusers = [\"*\"]\nactions = [\"pull\"]",
    );
    let uri = "/token?service=reg.example&scope=repository:team/app:pull,push&scope=repository:other:pull,push,delete&account=alice";
    let (status, headers, body) = call(&f.auth, get(uri, Some(("alice", "alice-pw")))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    let token = body["token"].as_str().unwrap();
    assert_eq!(body["access_token"], body["token"]);
    assert_eq!(body["expires_in"], 300);
    assert!(body["issued_at"].as_str().unwrap().ends_with('Z'));
    let grant = grant_of(&f.auth, token);
    assert_eq!(grant.subject.as_deref(), Some("alice"));
    assert_eq!(
        grant.access,
        vec![
            (Some("team/app".to_string()), Actions::PULL_PUSH),
            (Some("other".to_string()), Actions::PULL)
        ]
    );
    // The token works on the API.
    let ok = f
        .auth
        .check(
            &bearer(token),
            &Scope::repository("team/app", Actions::PULL_PUSH),
        )
        .unwrap();
    assert_eq!(ok.subject.as_deref(), Some("alice"));
    assert!(
        f.auth
            .check(&bearer(token), &Scope::repository("other", Actions::DELETE))
            .is_err()
    );
}

#[tokio::test]
async fn token_endpoint_refuses_wrong_password_and_bad_requests() {
    let f = fixture("");
    let (status, headers, body) = call(
        &f.auth,
        get(
            "/token?service=reg.example&scope=repository:a:pull",
            Some(("alice", "nope")),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["errors"][0]["code"], "UNAUTHORIZED");
    assert!(
        headers[header::WWW_AUTHENTICATE]
            .to_str()
            .unwrap()
            .starts_with("Basic ")
    );
    let (status, _, body) = call(
        &f.auth,
        get("/token?service=elsewhere&scope=repository:a:pull", None),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, _, _) = call(&f.auth, get("/token?scope=repository", None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _, _) = call(&f.auth, get("/token?scope=repository:..%2Fx:pull", None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _, _) = call(&f.auth, post("grant_type=client_credentials")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let disabled = Arc::new(Authenticator::disabled());
    let (status, _, _) = call(&disabled, get("/token", None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn token_endpoint_anonymous_gets_pull_only_and_empty_grants() {
    let f = fixture("anonymous_pull = true");
    let (status, _, body) = call(
        &f.auth,
        get(
            "/token?service=reg.example&scope=repository:lib/x:pull,push&scope=registry:catalog:*",
            None,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let grant = grant_of(&f.auth, body["token"].as_str().unwrap());
    assert_eq!(grant.subject, None);
    assert_eq!(
        grant.access,
        vec![(Some("lib/x".to_string()), Actions::PULL)],
        "catalog not granted to anonymous"
    );

    let closed = fixture("");
    let (status, _, body) = call(
        &closed.auth,
        get("/token?scope=repository:lib/x:pull", None),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "an empty grant is still a token");
    let grant = grant_of(&closed.auth, body["token"].as_str().unwrap());
    assert_eq!(
        grant.access,
        vec![(Some("lib/x".to_string()), Actions::NONE)]
    );
    assert!(
        closed
            .auth
            .check(
                &bearer(body["token"].as_str().unwrap()),
                &Scope::repository("lib/x", Actions::PULL)
            )
            .is_err()
    );
}

#[tokio::test]
async fn token_endpoint_oauth_password_and_refresh_grants() {
    let f = fixture("");
    let form = "grant_type=password&username=alice&password=alice-pw&service=reg.example&client_id=ferry&access_type=offline&scope=repository%3Aa%3Apull+repository%3Ab%3Apush";
    let (status, _, body) = call(&f.auth, post(form)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["scope"], "repository:a:pull repository:b:push");
    let refresh = body["refresh_token"].as_str().unwrap().to_string();
    // A refresh token is not an access token.
    assert!(f.auth.check(&bearer(&refresh), &Scope::base()).is_err());

    let form = format!(
        "grant_type=refresh_token&refresh_token={refresh}&service=reg.example&scope=repository%3Ac%3Apull"
    );
    let (status, _, body) = call(&f.auth, post(&form)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let grant = grant_of(&f.auth, body["access_token"].as_str().unwrap());
    assert_eq!(grant.subject.as_deref(), Some("alice"));
    assert_eq!(grant.access, vec![(Some("c".to_string()), Actions::PULL)]);

    // GET with offline_token=true also returns one.
    let (_, _, body) = call(
        &f.auth,
        get(
            "/token?offline_token=true&scope=repository:a:pull",
            Some(("bob", "bob-pw")),
        ),
    )
    .await;
    assert!(body["refresh_token"].is_string());

    // Changing the password revokes refresh tokens.
    std::fs::write(&f.htpasswd, format!("{}\n", line("alice", "changed"))).unwrap();
    f.auth
        .inner
        .as_ref()
        .unwrap()
        .users
        .as_ref()
        .unwrap()
        .force_recheck();
    let (status, _, _) = call(&f.auth, post(&form)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = call(
        &f.auth,
        post("grant_type=password&username=alice&password=alice-pw"),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[test]
fn rfc3339_dates() {
    assert_eq!(endpoint::rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(endpoint::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(endpoint::rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn works_inside_a_multi_thread_runtime() {
    // bcrypt runs through block_in_place on workers and inline on blocking threads.
    let f = fixture("");
    let scope = Scope::repository("a", Actions::PULL);
    assert!(f.auth.check(&basic("alice", "alice-pw"), &scope).is_ok());
    let (status, _, body) = call(
        &f.auth,
        get("/token?scope=repository:a:pull", Some(("bob", "bob-pw"))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        f.auth
            .check(&bearer(body["token"].as_str().unwrap()), &scope)
            .is_ok()
    );
    let auth = f.auth.clone();
    let from_task =
        tokio::spawn(async move { auth.check(&basic("bob", "bob-pw"), &Scope::base()).is_ok() });
    assert!(from_task.await.unwrap());
}

#[test]
fn pem_keys_from_config_and_bearer_in_basic_mode() {
    let dir = tempfile::tempdir().unwrap();
    let private = dir.path().join("key.pem");
    let public = dir.path().join("pub.pem");
    std::fs::write(&private, include_bytes!("testdata/es256-private.pem")).unwrap();
    std::fs::write(&public, include_bytes!("testdata/es256-public.pem")).unwrap();
    let htpasswd = dir.path().join("htpasswd");
    std::fs::write(&htpasswd, line("alice", "pw")).unwrap();
    let text = format!(
        "htpasswd = {:?}\nprivate_key = {:?}\npublic_key = {:?}\nmode = \"basic\"\nissuer = \"me\"",
        htpasswd.display().to_string(),
        private.display().to_string(),
        public.display().to_string()
    );
    let auth = Authenticator::new(&toml::from_str(&text).unwrap()).unwrap();
    let inner = auth.inner.as_ref().unwrap();
    assert_eq!(inner.signer.algorithm(), jsonwebtoken::Algorithm::ES256);
    let token = inner
        .signer
        .issue(
            Some("alice"),
            repo_access("a", &["pull"]),
            unix_now(),
            60,
            None,
        )
        .unwrap();
    assert!(
        auth.check(&bearer(&token), &Scope::repository("a", Actions::PULL))
            .is_ok()
    );
    let only_private = format!(
        "enabled = true\nprivate_key = {:?}",
        private.display().to_string()
    );
    assert!(Authenticator::new(&toml::from_str(&only_private).unwrap()).is_err());
}

#[test]
fn apache_htpasswd_output_is_accepted() {
    // Lines written by Apache's `htpasswd -Bbn` (apache2-utils); alice's password has a colon.
    let text = "alice:$2y$05$xV///cSyCCmD8nEx245rZ.7yV6Tcw2Qk6pCP09p.GYKS505GtHP8G\n\n\
                bob:$2y$04$XCzvewnxWVpRPj9MWg6ZPeX0RNj.rbEsO50BPvVQ7LW1HLSj1niD.\n";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("htpasswd");
    std::fs::write(&path, text).unwrap();
    let cfg: AuthConfig =
        toml::from_str(&format!("htpasswd = {:?}", path.display().to_string())).unwrap();
    let auth = Authenticator::new(&cfg).unwrap();
    let scope = Scope::repository("a", Actions::PULL);
    assert!(auth.check(&basic("alice", "s3cr:et"), &scope).is_ok());
    assert!(auth.check(&basic("alice", "s3cr"), &scope).is_err());
    assert!(auth.check(&basic("bob", "pw"), &scope).is_ok());
}
