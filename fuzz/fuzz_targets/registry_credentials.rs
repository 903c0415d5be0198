//! Fuzzes the client's reading of docker `config.json` / podman `auth.json`. Nothing may
//! panic; and credentials are never sent to the wrong place: whatever is picked for a
//! registry and repository comes from an entry whose key names that registry's host (or a
//! Docker Hub alias for Docker Hub) and, if the key has a path, a namespace containing the
//! repository — the same for the credential helper chosen.
#![no_main]

use base64::Engine as _;
use ferry_registry_client::fuzz_api::auth_file_choice;
use libfuzzer_sys::fuzz_target;

const TARGETS: &[(&str, &str)] = &[
    ("ghcr.io", "org/app"),
    ("docker.io", "library/ubuntu"),
    ("localhost:5000", "a/b"),
    ("quay.io", "org/sub/app"),
    ("registry.example.com", "team/app"),
];
const DOCKER_HUB: [&str; 3] = ["docker.io", "index.docker.io", "registry-1.docker.io"];

/// Whether an auth-file key may carry credentials for `registry`/`repository`.
fn applies(key: &str, registry: &str, repository: &str) -> bool {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key)
        .trim_end_matches('/');
    let k = k.strip_suffix("/v1").or_else(|| k.strip_suffix("/v2")).unwrap_or(k);
    let (host, namespace) = k.split_once('/').unwrap_or((k, ""));
    let host_ok = host == registry
        || (DOCKER_HUB.contains(&registry) && DOCKER_HUB.contains(&host));
    host_ok
        && (namespace.is_empty()
            || repository == namespace
            || repository.starts_with(&format!("{namespace}/")))
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, json)) = data.split_first() else {
        return;
    };
    let (registry, repository) = TARGETS[usize::from(selector) % TARGETS.len()];
    let Some(choice) = auth_file_choice(json, registry, repository) else {
        return;
    };
    // serde skips fields it ignores without checking their UTF-8 or number range, so a
    // file the client reads may still be one `Value` refuses; such files are not judged.
    let Ok(file) = serde_json::from_str::<serde_json::Value>(&String::from_utf8_lossy(json))
    else {
        return;
    };
    let entries: Vec<(&String, &serde_json::Value)> = file
        .get("auths")
        .and_then(|a| a.as_object())
        .map(|m| m.iter().filter(|(k, _)| applies(k, registry, repository)).collect())
        .unwrap_or_default();
    let field = |e: &serde_json::Value, name: &str| {
        e.get(name).and_then(|v| v.as_str()).map(str::to_string)
    };
    if let Some((user, password)) = &choice.basic {
        let from_some_entry = entries.iter().any(|(_, e)| {
            let from_auth = field(e, "auth")
                .and_then(|a| base64::engine::general_purpose::STANDARD.decode(a.trim()).ok())
                .and_then(|d| String::from_utf8(d).ok())
                .is_some_and(|d| d == format!("{user}:{password}") && !user.contains(':'));
            let from_fields = field(e, "username").as_deref() == Some(user.as_str())
                && field(e, "password").as_deref() == Some(password.as_str());
            from_auth || from_fields
        });
        assert!(from_some_entry, "credentials for {registry}/{repository} from elsewhere");
    }
    if let Some(token) = &choice.identity_token {
        assert!(
            entries
                .iter()
                .any(|(_, e)| field(e, "identitytoken").as_deref() == Some(token.as_str())),
            "identity token for {registry}/{repository} from elsewhere"
        );
    }
    if let Some(helper) = &choice.helper {
        let from_helpers = file
            .get("credHelpers")
            .and_then(|h| h.as_object())
            .is_some_and(|m| {
                m.iter().any(|(k, v)| {
                    applies(k, registry, repository) && v.as_str() == Some(helper.as_str())
                })
            });
        let from_store = file.get("credsStore").and_then(|s| s.as_str()) == Some(helper.as_str());
        assert!(from_helpers || from_store, "helper {helper:?} from elsewhere");
    }
});
