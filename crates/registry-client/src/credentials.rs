//! Where credentials come from when none are configured: docker's
//! `$DOCKER_CONFIG/config.json` (or `~/.docker/config.json`) with its credential helpers,
//! then podman's `$REGISTRY_AUTH_FILE` / `$XDG_RUNTIME_DIR/containers/auth.json` /
//! `~/.config/containers/auth.json`. Anonymous when nothing matches.
//!
//! Lookups never fail the request: an unreadable or malformed auth file is logged and
//! skipped, since the registry may well allow anonymous pulls.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use serde::Deserialize;

use super::auth::HostSecret;
use super::config::Credentials;

const MAX_AUTH_FILE: u64 = 4 << 20;
const HELPER_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AuthFile {
    #[serde(default)]
    auths: HashMap<String, AuthEntry>,
    #[serde(default)]
    cred_helpers: HashMap<String, String>,
    #[serde(default)]
    creds_store: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// Docker Hub's names; credentials stored under any of them apply to all.
const DOCKER_HUB: [&str; 3] = ["docker.io", "index.docker.io", "registry-1.docker.io"];

/// Normalizes an auth-file key (`https://index.docker.io/v1/`, `quay.io/org`, `host:5000`)
/// to `host[/namespace]`.
fn normalize_key(key: &str) -> String {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let k = k.trim_end_matches('/');
    let k = k
        .strip_suffix("/v1")
        .or_else(|| k.strip_suffix("/v2"))
        .unwrap_or(k);
    let (host, rest) = k.split_once('/').unwrap_or((k, ""));
    let host = if DOCKER_HUB.contains(&host) {
        "docker.io"
    } else {
        host
    };
    if rest.is_empty() {
        host.to_string()
    } else {
        format!("{host}/{rest}")
    }
}

/// How well `key` matches `registry`/`repository`: the length of the matched name, so the
/// most specific entry (`quay.io/org` over `quay.io`) wins.
fn match_len(key: &str, registry: &str, repository: &str) -> Option<usize> {
    let key = normalize_key(key);
    let host = normalize_key(registry);
    let full = format!("{host}/{repository}");
    if key == host {
        return Some(key.len());
    }
    (full == key || full.starts_with(&format!("{key}/"))).then_some(key.len())
}

fn best_match<'a, V>(
    map: &'a HashMap<String, V>,
    registry: &str,
    repository: &str,
) -> Option<&'a V> {
    map.iter()
        .filter_map(|(k, v)| match_len(k, registry, repository).map(|n| (n, v)))
        .max_by_key(|(n, _)| *n)
        .map(|(_, v)| v)
}

fn entry_secret(e: &AuthEntry) -> Option<HostSecret> {
    let mut secret = HostSecret::default();
    if let Some(token) = e.identitytoken.as_ref().filter(|t| !t.is_empty()) {
        secret.identity_token = Some(token.clone());
    }
    if let Some(auth) = e.auth.as_ref().filter(|a| !a.is_empty()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .ok()
            .and_then(|b| String::from_utf8(b).ok());
        if let Some((user, pass)) = decoded.as_deref().and_then(|s| s.split_once(':')) {
            secret.basic = Some(Credentials {
                username: user.to_string(),
                password: pass.to_string(),
            });
        } else {
            tracing::warn!("ignoring an auth entry whose `auth` is not base64 of user:password");
        }
    } else if let (Some(u), Some(p)) = (&e.username, &e.password) {
        secret.basic = Some(Credentials {
            username: u.clone(),
            password: p.clone(),
        });
    }
    (!secret.is_anonymous()).then_some(secret)
}

/// Credentials for `registry`/`repository` from the parsed file, without running helpers.
pub(crate) fn from_auths(file: &AuthFile, registry: &str, repository: &str) -> Option<HostSecret> {
    best_match(&file.auths, registry, repository).and_then(entry_secret)
}

/// The credential helper docker would run for `registry`/`repository`: the most specific
/// `credHelpers` entry, else `credsStore`.
pub(crate) fn helper_for(file: &AuthFile, registry: &str, repository: &str) -> Option<String> {
    best_match(&file.cred_helpers, registry, repository)
        .cloned()
        .or_else(|| file.creds_store.clone())
}

/// Parses the JSON of a docker `config.json` or podman `auth.json`.
pub(crate) fn parse_auth_file(bytes: &[u8]) -> serde_json::Result<AuthFile> {
    serde_json::from_slice(bytes)
}

fn read_auth_file(path: &Path) -> Option<AuthFile> {
    use std::io::Read;
    let file = std::fs::File::open(path).ok()?;
    let mut buf = Vec::new();
    if let Err(e) = file.take(MAX_AUTH_FILE + 1).read_to_end(&mut buf) {
        tracing::warn!(path = %path.display(), error = %e, "cannot read auth file");
        return None;
    }
    if buf.len() as u64 > MAX_AUTH_FILE {
        tracing::warn!(path = %path.display(), "auth file too large; ignored");
        return None;
    }
    match parse_auth_file(&buf) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "malformed auth file; ignored");
            None
        }
    }
}

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

fn docker_config_path() -> Option<PathBuf> {
    match std::env::var_os("DOCKER_CONFIG") {
        Some(dir) => Some(PathBuf::from(dir).join("config.json")),
        None => home().map(|h| h.join(".docker/config.json")),
    }
}

fn podman_paths() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("REGISTRY_AUTH_FILE") {
        out.push(PathBuf::from(p));
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR") {
        out.push(PathBuf::from(dir).join("containers/auth.json"));
    }
    if let Some(h) = home() {
        out.push(h.join(".config/containers/auth.json"));
    }
    out
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HelperOutput {
    username: String,
    secret: String,
}

/// Runs `docker-credential-<helper> get` for `server`; `None` when the helper is missing
/// or has nothing for this server.
async fn run_helper(helper: &str, server: &str) -> Option<HostSecret> {
    use tokio::io::AsyncWriteExt;
    if helper.is_empty()
        || !helper
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        tracing::warn!(helper, "ignoring a credential helper with an unusual name");
        return None;
    }
    let program = format!("docker-credential-{helper}");
    let mut child = tokio::process::Command::new(&program)
        .arg("get")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| tracing::debug!(program, error = %e, "credential helper not runnable"))
        .ok()?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(server.as_bytes()).await;
    }
    let out = tokio::time::timeout(HELPER_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| tracing::warn!(program, "credential helper timed out"))
        .ok()?
        .ok()?;
    if !out.status.success() || out.stdout.len() > 1 << 20 {
        return None;
    }
    let parsed: HelperOutput = serde_json::from_slice(&out.stdout).ok()?;
    let mut secret = HostSecret::default();
    if parsed.username == "<token>" {
        secret.identity_token = Some(parsed.secret);
    } else {
        secret.basic = Some(Credentials {
            username: parsed.username,
            password: parsed.secret,
        });
    }
    Some(secret)
}

/// The server name docker's credential helpers know a registry by.
fn helper_server_name(registry: &str) -> String {
    if DOCKER_HUB.contains(&registry) {
        "https://index.docker.io/v1/".to_string()
    } else {
        registry.to_string()
    }
}

/// Looks credentials up in docker's and podman's files (and docker's helpers).
pub(crate) async fn lookup(registry: &str, repository: &str) -> HostSecret {
    if let Some(path) = docker_config_path()
        && let Some(file) = read_auth_file(&path)
    {
        if let Some(helper) = helper_for(&file, registry, repository)
            && let Some(s) = run_helper(&helper, &helper_server_name(registry)).await
        {
            return s;
        }
        if let Some(s) = from_auths(&file, registry, repository) {
            return s;
        }
    }
    for path in podman_paths() {
        if let Some(file) = read_auth_file(&path)
            && let Some(s) = from_auths(&file, registry, repository)
        {
            return s;
        }
    }
    HostSecret::default()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(json: &str) -> AuthFile {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn docker_hub_key_matches_docker_io() {
        let f = parse(r#"{"auths":{"https://index.docker.io/v1/":{"auth":"dXNlcjpwYXNz"}}}"#);
        let s = from_auths(&f, "docker.io", "library/debian").unwrap();
        let b = s.basic.unwrap();
        assert_eq!((b.username.as_str(), b.password.as_str()), ("user", "pass"));
        assert!(from_auths(&f, "quay.io", "x/y").is_none());
    }

    #[test]
    fn username_password_and_identity_token() {
        let f = parse(
            r#"{"auths":{"r.example:5000":{"username":"u","password":"p:w"},
                "tok.example":{"identitytoken":"refresh-me"}}}"#,
        );
        let b = from_auths(&f, "r.example:5000", "a")
            .unwrap()
            .basic
            .unwrap();
        assert_eq!(b.password, "p:w");
        let t = from_auths(&f, "tok.example", "a").unwrap();
        assert_eq!(t.identity_token.as_deref(), Some("refresh-me"));
        assert!(t.basic.is_none());
    }

    #[test]
    fn most_specific_namespace_wins() {
        let f = parse(
            r#"{"auths":{"quay.io":{"auth":"YTpi"},"quay.io/org":{"auth":"Yzpk"},
                "quay.io/organic":{"auth":"ZTpm"}}}"#,
        );
        let org = from_auths(&f, "quay.io", "org/app").unwrap().basic.unwrap();
        assert_eq!(org.username, "c");
        let other = from_auths(&f, "quay.io", "orgx/app")
            .unwrap()
            .basic
            .unwrap();
        assert_eq!(other.username, "a");
    }

    #[test]
    fn bad_base64_is_skipped() {
        let f = parse(r#"{"auths":{"h":{"auth":"!!!"}}}"#);
        assert!(from_auths(&f, "h", "r").is_none());
    }

    #[test]
    fn file_with_helpers_parses() {
        let f = parse(
            r#"{"credsStore":"desktop","credHelpers":{"gcr.io":"gcloud"},"auths":{"gcr.io":{}}}"#,
        );
        assert_eq!(f.creds_store.as_deref(), Some("desktop"));
        assert_eq!(
            best_match(&f.cred_helpers, "gcr.io", "p/i").unwrap(),
            "gcloud"
        );
        assert!(from_auths(&f, "gcr.io", "p/i").is_none());
    }
}
