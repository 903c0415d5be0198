#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;

use super::*;

const V1: &str = "credentialprovider.kubelet.k8s.io/v1";

#[test]
fn match_images_as_the_kubelet_matches() {
    let m = |p: &str, i: &str| ImagePattern::parse(p).unwrap().matches(i);
    // Globs within one host part.
    assert!(m("*.azurecr.io", "myreg.azurecr.io/app"));
    assert!(!m("*.azurecr.io", "azurecr.io/app"), "one part per glob");
    assert!(
        !m("*.io", "a.azurecr.io/app"),
        "a glob matches one part only"
    );
    assert!(m("k8s.*.io", "k8s.gcr.io/pause"));
    assert!(m("app*.k8s.io", "app1.k8s.io/x"));
    assert!(!m("app*.k8s.io", "bpp1.k8s.io/x"));
    assert!(m("*.*.registry.io", "a.b.registry.io/x"));
    assert!(m(
        "*.dkr.ecr.*.amazonaws.com",
        "123456789.dkr.ecr.us-east-1.amazonaws.com/team/app"
    ));
    assert!(m("gcr.io", "gcr.io/project/image"));
    assert!(m("GCR.io", "gcr.IO/project"), "hosts are case-insensitive");
    assert!(!m("gcr.io", "eu.gcr.io/project/image"));
    // Ports: must be equal, absent on both or the same number.
    assert!(m("registry.io:8080/path", "registry.io:8080/path/app"));
    assert!(!m("registry.io:8080", "registry.io:8081/app"));
    assert!(!m("registry.io:8080", "registry.io/app"));
    assert!(!m("registry.io", "registry.io:5000/app"));
    assert!(m("127.0.0.1:5000", "127.0.0.1:5000/private/app"));
    // Paths: a string prefix, as the kubelet's.
    assert!(m("registry.io/team", "registry.io/team/app"));
    assert!(m("registry.io/team", "registry.io/teamwork"));
    assert!(!m("registry.io/team", "registry.io/other/app"));
    // Globs only in the host.
    assert!(ImagePattern::parse("registry.io:*").is_err());
    assert!(ImagePattern::parse("registry.io/te*m").is_err());
    assert!(ImagePattern::parse("").is_err());
}

#[test]
fn go_durations() {
    let d = |s: &str| parse_go_duration(s).unwrap();
    assert_eq!(d("0"), Duration::ZERO);
    assert_eq!(d("0s"), Duration::ZERO);
    assert_eq!(d("12h"), Duration::from_secs(12 * 3600));
    assert_eq!(d("1h30m"), Duration::from_secs(5400));
    assert_eq!(d("1.5s"), Duration::from_millis(1500));
    assert_eq!(d("300ms"), Duration::from_millis(300));
    for bad in ["", "-1s", "5", "1x", "h", "1..2s", "99999999999999h"] {
        assert!(parse_go_duration(bad).is_err(), "{bad:?}");
    }
}

const YAML_CONFIG: &str = r#"apiVersion: kubelet.config.k8s.io/v1
kind: CredentialProviderConfig
providers:
  - name: ecr-credential-provider
    matchImages:
      - "*.dkr.ecr.*.amazonaws.com"
    defaultCacheDuration: "12h"
    apiVersion: credentialprovider.kubelet.k8s.io/v1
    args:
      - get-credentials
    env:
      - name: AWS_PROFILE
        value: very-secret-profile
  - name: sa-token-plugin
    matchImages: ["example.com"]
    defaultCacheDuration: 1m
    apiVersion: credentialprovider.kubelet.k8s.io/v1
    tokenAttributes:
      serviceAccountTokenAudience: x
"#;

#[test]
fn kubelet_config_yaml_and_json() {
    let c = parse_config(YAML_CONFIG.as_bytes()).unwrap();
    assert_eq!(c.providers.len(), 1);
    let p = &c.providers[0];
    assert_eq!(p.name, "ecr-credential-provider");
    assert_eq!(p.default_cache_duration, Duration::from_secs(12 * 3600));
    assert_eq!(p.args, ["get-credentials"]);
    assert!(p.matches("1.dkr.ecr.eu-west-1.amazonaws.com/x"));
    assert_eq!(
        c.skipped.len(),
        1,
        "service-account-token plugins are skipped"
    );
    assert!(
        !format!("{c:?}").contains("very-secret-profile"),
        "env values are redacted"
    );

    let json = r#"{"apiVersion":"kubelet.config.k8s.io/v1","kind":"CredentialProviderConfig",
        "providers":[{"name":"p","matchImages":["gcr.io"],"defaultCacheDuration":"5m",
        "apiVersion":"credentialprovider.kubelet.k8s.io/v1"}]}"#;
    assert_eq!(parse_config(json.as_bytes()).unwrap().providers.len(), 1);
}

#[test]
fn bad_configs_say_why() {
    let base = |provider: &str| {
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n{provider}"
        )
    };
    let cases = [
        (
            "  - name: p\n    defaultCacheDuration: 1m\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
            "matchImages",
        ),
        (
            "  - name: p\n    matchImages: [a.io]\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
            "defaultCacheDuration",
        ),
        (
            "  - name: p\n    matchImages: [a.io]\n    defaultCacheDuration: 1m\n    apiVersion: v9\n",
            "apiVersion",
        ),
        (
            "  - name: ../p\n    matchImages: [a.io]\n    defaultCacheDuration: 1m\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
            "file name",
        ),
        (
            "  - name: p\n    matchImages: [a.io]\n    defaultCacheDuration: 1m\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n    surprise: 1\n",
            "surprise",
        ),
    ];
    for (provider, why) in cases {
        let err = parse_config(base(provider).as_bytes()).unwrap_err();
        assert!(err.contains(why), "{why}: {err}");
    }
    let dup = base(
        "  - name: p\n    matchImages: [a.io]\n    defaultCacheDuration: 1m\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n  - name: p\n    matchImages: [b.io]\n    defaultCacheDuration: 1m\n    apiVersion: credentialprovider.kubelet.k8s.io/v1\n",
    );
    assert!(parse_config(dup.as_bytes()).unwrap_err().contains("twice"));
    assert!(parse_config(b"kind: Other\napiVersion: kubelet.config.k8s.io/v1\n").is_err());
}

#[test]
fn responses_parse_and_garbage_never_echoes_the_secret() {
    let ok = r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderResponse",
        "cacheKeyType":"Registry","cacheDuration":"5m",
        "auth":{"*.example.com":{"username":"u1","password":"p1"},
                "reg.example.com/team":{"username":"u2","password":"p2"}}}"#;
    let r = parse_response(ok.as_bytes(), V1).unwrap();
    assert_eq!(r.cache_key_type, CacheKeyType::Registry);
    assert_eq!(r.cache_duration, Some(Duration::from_secs(300)));
    assert_eq!(
        r.credentials_for("reg.example.com/team/app")
            .unwrap()
            .username,
        "u2",
        "the most specific key wins"
    );
    assert_eq!(
        r.credentials_for("reg.example.com/other").unwrap().username,
        "u1"
    );
    assert!(r.credentials_for("example.com/x").is_none());
    assert!(!format!("{r:?}").contains("p2"));

    assert!(parse_response(ok.as_bytes(), "credentialprovider.kubelet.k8s.io/v1beta1").is_err());
    for bad in [
        "hello",
        "{}",
        r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderResponse","cacheKeyType":"Forever"}"#,
        r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"Nope","cacheKeyType":"Image"}"#,
        r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderResponse","cacheKeyType":"Image","auth":"hunter2"}"#,
        r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderResponse","cacheKeyType":"Image","auth":{"x.io":{"username":"u","password":7}}}"#,
    ] {
        let err = parse_response(bad.as_bytes(), V1).unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
    }
}

// ------------------------------------------------------------------ plugins

/// A plugin directory with one shell script, `plugin`, which appends a line to `runs`
/// each time it runs, keeps its request in `request`, then runs `body`.
struct Plugin {
    dir: tempfile::TempDir,
}

impl Plugin {
    fn new(body: &str) -> Plugin {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "#!/bin/sh\nd=\"$(dirname \"$0\")\"\necho run >> \"$d/runs\"\ncat > \"$d/request\"\n{body}\n"
        );
        let path = dir.path().join("plugin");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        Plugin { dir }
    }

    fn runs(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("runs"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    fn providers(&self, match_images: &[&str], clock: Arc<dyn Clock>) -> CredentialProviders {
        let config = ProvidersConfig {
            providers: vec![Provider {
                name: "plugin".into(),
                match_images: match_images
                    .iter()
                    .map(|m| ImagePattern::parse(m).unwrap())
                    .collect(),
                default_cache_duration: Duration::from_secs(600),
                api_version: V1.into(),
                args: vec!["get-credentials".into()],
                env: vec![("PLUGIN_SECRET_ENV".into(), "env-secret".into())],
            }],
            skipped: Vec::new(),
        };
        CredentialProviders::new(config, self.dir.path().to_path_buf(), clock)
    }
}

fn answer(key_type: &str, duration: Option<&str>, auth_key: &str, password: &str) -> String {
    let duration = duration
        .map(|d| format!(r#","cacheDuration":"{d}""#))
        .unwrap_or_default();
    format!(
        r#"cat <<'EOF'
{{"apiVersion":"{V1}","kind":"CredentialProviderResponse","cacheKeyType":"{key_type}"{duration},"auth":{{"{auth_key}":{{"username":"robot","password":"{password}"}}}}}}
EOF"#
    )
}

#[tokio::test]
async fn plugin_gets_the_request_and_its_answer_is_used() {
    let p = Plugin::new(&format!(
        "env > \"$d/env\"\necho \"$@\" > \"$d/args\"\n{}",
        answer("Image", None, "reg.example.com", "pw-1")
    ));
    let providers = p.providers(&["reg.example.com"], Arc::new(ManualClock::default()));
    let c = providers
        .credentials("reg.example.com", "team/app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (c.username.as_str(), c.password.as_str()),
        ("robot", "pw-1")
    );
    let req: serde_json::Value =
        serde_json::from_slice(&std::fs::read(p.dir.path().join("request")).unwrap()).unwrap();
    assert_eq!(req["apiVersion"], V1);
    assert_eq!(req["kind"], "CredentialProviderRequest");
    assert_eq!(req["image"], "reg.example.com/team/app");
    let args = std::fs::read_to_string(p.dir.path().join("args")).unwrap();
    assert_eq!(args.trim(), "get-credentials");
    // Its environment: PATH and what the config says, nothing of ours.
    let env = std::fs::read_to_string(p.dir.path().join("env")).unwrap();
    assert!(env.contains("PLUGIN_SECRET_ENV=env-secret"), "{env}");
    assert!(env.lines().any(|l| l.starts_with("PATH=")), "{env}");
    assert!(!env.lines().any(|l| l.starts_with("HOME=")), "{env}");
    // An image no matchImages covers never runs it.
    assert!(
        providers
            .credentials("other.example.com", "team/app")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        providers
            .credentials("reg.example.com:5000", "team/app")
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(p.runs(), 1);
    // Nothing secret in Debug.
    let shown = format!("{providers:?}");
    assert!(
        !shown.contains("pw-1") && !shown.contains("env-secret"),
        "{shown}"
    );
}

#[tokio::test]
async fn cache_follows_the_cache_key_type() {
    let clock = Arc::new(ManualClock::default());
    // Image: another repository of the same registry asks again.
    let p = Plugin::new(&answer("Image", None, "*.example.com", "pw"));
    let prov = p.providers(&["*.example.com"], clock.clone());
    for _ in 0..3 {
        prov.credentials("a.example.com", "one")
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(p.runs(), 1);
    prov.credentials("a.example.com", "two")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 2);

    // Registry: any repository of the registry is served; another registry asks.
    let p = Plugin::new(&answer("Registry", None, "*.example.com", "pw"));
    let prov = p.providers(&["*.example.com"], clock.clone());
    prov.credentials("a.example.com", "one")
        .await
        .unwrap()
        .unwrap();
    prov.credentials("a.example.com", "two")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 1);
    prov.credentials("b.example.com", "one")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 2);

    // Global: one answer for everything.
    let p = Plugin::new(&answer("Global", None, "*.example.com", "pw"));
    let prov = p.providers(&["*.example.com"], clock.clone());
    prov.credentials("a.example.com", "one")
        .await
        .unwrap()
        .unwrap();
    prov.credentials("b.example.com", "two")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 1);
}

#[tokio::test]
async fn expiry_refresh_and_forget() {
    let clock = Arc::new(ManualClock::default());
    let p = Plugin::new(&answer("Registry", Some("1m"), "reg.example.com", "pw"));
    let prov = p.providers(&["reg.example.com"], clock.clone());
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    clock.advance(Duration::from_secs(59));
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 1, "still fresh");
    clock.advance(Duration::from_secs(2));
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 2, "expired: asked again");
    prov.forget("reg.example.com", "app");
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 3, "forgotten: asked again");

    // cacheDuration 0: never cached.
    let p = Plugin::new(&answer("Image", Some("0s"), "reg.example.com", "pw"));
    let prov = p.providers(&["reg.example.com"], clock.clone());
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 2);

    // No cacheDuration: the provider's default (600 s here).
    let p = Plugin::new(&answer("Image", None, "reg.example.com", "pw"));
    let prov = p.providers(&["reg.example.com"], clock.clone());
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    clock.advance(Duration::from_secs(599));
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 1);
    clock.advance(Duration::from_secs(2));
    prov.credentials("reg.example.com", "app")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.runs(), 2);
}

#[tokio::test]
async fn a_slow_plugin_is_killed_at_the_timeout() {
    let p = Plugin::new("sleep 30\necho late");
    let prov = p
        .providers(&["reg.example.com"], Arc::new(SystemClock))
        .with_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let err = prov
        .credentials("reg.example.com", "app")
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    let msg = err.to_string();
    assert!(
        msg.contains("\"plugin\"") && msg.contains("killed"),
        "{msg}"
    );
}

#[tokio::test]
async fn garbage_failure_and_oversized_answers_are_errors_naming_the_provider() {
    let clock = Arc::new(ManualClock::default());
    let p = Plugin::new("echo 'password: hunter2 is not JSON'");
    let prov = p.providers(&["reg.example.com"], clock.clone());
    let err = prov
        .credentials("reg.example.com", "app")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"plugin\"") && err.contains("not a CredentialProviderResponse"));
    assert!(!err.contains("hunter2"), "{err}");
    // It rests a while: no run per request of a lazy read.
    assert!(
        prov.credentials("reg.example.com", "app")
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(p.runs(), 1);
    clock.advance(FAILURE_BACKOFF + Duration::from_secs(1));
    assert!(prov.credentials("reg.example.com", "app").await.is_err());
    assert_eq!(p.runs(), 2);

    let p = Plugin::new("echo 'token service unreachable' >&2\nexit 3");
    let err = p
        .providers(&["reg.example.com"], clock.clone())
        .credentials("reg.example.com", "app")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("exit status: 3") && err.contains("token service unreachable"),
        "{err}"
    );

    let p = Plugin::new("head -c 2000000 /dev/zero");
    let err = p
        .providers(&["reg.example.com"], clock.clone())
        .credentials("reg.example.com", "app")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("larger than"), "{err}");

    let p = Plugin::new("exit 0");
    std::fs::remove_file(p.dir.path().join("plugin")).unwrap();
    let err = p
        .providers(&["reg.example.com"], clock)
        .credentials("reg.example.com", "app")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot run"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_lookups_run_the_plugin_once() {
    let p = Plugin::new(&format!(
        "sleep 0.5\n{}",
        answer("Image", None, "reg.example.com", "pw")
    ));
    let prov = p.providers(&["reg.example.com"], Arc::new(SystemClock));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let prov = prov.clone();
            tokio::spawn(async move { prov.credentials("reg.example.com", "app").await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().unwrap().password, "pw");
    }
    assert_eq!(p.runs(), 1);
    assert_eq!(prov.plugin_runs(), 1);
}
