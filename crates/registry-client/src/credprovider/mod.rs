//! Kubelet credential provider plugins: the exec protocol ECR, GCR and ACR helpers speak,
//! configured by the kubelet's own `CredentialProviderConfig` file, so one file serves
//! the kubelet and ferry.
//!
//! A provider whose `matchImages` match a repository is run on demand, the first time
//! that repository needs credentials and no other source had any: a
//! `CredentialProviderRequest` on its stdin, a `CredentialProviderResponse` from its
//! stdout. The answer is cached in memory only (never on disk) until the duration it
//! gives (else the provider's `defaultCacheDuration`; `0` means not cached), under the
//! key its `cacheKeyType` says (the image, its registry, or one for everything). An
//! expired answer is asked for again; [`CredentialProviders::forget`] drops an answer the
//! registry refused. Concurrent lookups for the same image share one plugin run.
//!
//! The plugin runs with a timeout (killed at it), its stdout read up to 1 MiB, its stderr
//! kept only for a short error message, and an environment of `PATH` plus the config's
//! `env` (the kubelet passes its whole environment; a node daemon's environment is not
//! the plugin's business). A plugin that fails or answers garbage is an error naming it;
//! the client logs it and goes on without its credentials, and does not run it again for
//! that image for [`FAILURE_BACKOFF`].
//!
//! ferry asks for `HOST/REPOSITORY` (no tag or digest): credentials are scoped to a
//! repository, and a lazy read long after the pull knows no tag.

mod kyaml;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Deserialize;

use crate::cache::flight::SingleFlight;
use crate::config::Credentials;

/// `apiVersion`s of the config file the kubelet reads.
pub const CONFIG_API_VERSIONS: [&str; 3] = [
    "kubelet.config.k8s.io/v1",
    "kubelet.config.k8s.io/v1beta1",
    "kubelet.config.k8s.io/v1alpha1",
];
/// `apiVersion`s of the request/response exchange.
pub const EXCHANGE_API_VERSIONS: [&str; 3] = [
    "credentialprovider.kubelet.k8s.io/v1",
    "credentialprovider.kubelet.k8s.io/v1beta1",
    "credentialprovider.kubelet.k8s.io/v1alpha1",
];
/// Largest config file read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Largest plugin response read; a plugin writing more is killed.
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;
/// Stderr bytes read for an error message.
const MAX_STDERR_BYTES: usize = 4096;
/// Longest a plugin may run before it is killed.
pub const DEFAULT_PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a failed plugin is not run again for the same image: a lazy filesystem asks
/// for credentials on every range it reads, and a broken plugin must not run for each.
pub const FAILURE_BACKOFF: Duration = Duration::from_secs(10);
/// Most cached answers kept (expired ones go first).
const MAX_CACHED: usize = 4096;

/// Why a provider config or a provider's answer cannot be used. Clone: single flight
/// hands one outcome to every waiter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    #[error("credential provider config {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("credential provider {provider:?}: {reason}")]
    Plugin { provider: String, reason: String },
}

fn plugin_err(provider: &str, reason: impl Into<String>) -> ProviderError {
    ProviderError::Plugin {
        provider: provider.to_string(),
        reason: reason.into(),
    }
}

// ------------------------------------------------------------------ clock

/// The time the cache expires entries by; behind a trait so tests move it.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Instant;
}

/// The real clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Instant>,
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock {
            now: Mutex::new(Instant::now()),
        }
    }
}

impl ManualClock {
    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        *self.now.lock() += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.now.lock()
    }
}

// ------------------------------------------------------------------ durations

/// Parses a Go duration (`meta/v1.Duration`): `300ms`, `1.5h`, `2h45m`, `0`. Negative
/// durations are refused (they mean nothing for a cache).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let body = s.strip_prefix('+').unwrap_or(s);
    if body.starts_with('-') {
        return Err(format!("{s:?} is negative"));
    }
    if body == "0" {
        return Ok(Duration::ZERO);
    }
    if body.is_empty() {
        return Err("empty duration".into());
    }
    let mut total: f64 = 0.0;
    let mut rest = body;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{s:?}: a number without a unit"))?;
        let num = &rest[..num_end];
        if num.is_empty() || num == "." || num.matches('.').count() > 1 {
            return Err(format!("{s:?}: bad number"));
        }
        let value: f64 = num.parse().map_err(|_| format!("{s:?}: bad number"))?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let secs = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            u => return Err(format!("{s:?}: unknown unit {u:?}")),
        };
        total += value * secs;
        rest = &rest[unit_end..];
    }
    // Go's limit is about 292 years; anything near it is "for ever" to a cache.
    if !total.is_finite() || total > 9.2e9 {
        return Err(format!("{s:?} is too long"));
    }
    Ok(Duration::from_secs_f64(total))
}

// ------------------------------------------------------------------ image patterns

/// A `matchImages` entry or a response `auth` key: host parts (globs allowed), an
/// optional port and a path prefix, matched as the kubelet matches them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePattern {
    text: String,
    host_parts: Vec<String>,
    port: String,
    path: String,
}

/// Splits `host[:port][/path]` (an optional `https://` or `http://` is dropped).
fn split_image(s: &str) -> Result<(Vec<String>, String, String), String> {
    let s = s
        .strip_prefix("https://")
        .or_else(|| s.strip_prefix("http://"))
        .unwrap_or(s);
    let (hostport, path) = match s.find('/') {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, ""),
    };
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => (h, p),
        Some(_) => return Err(format!("{s:?}: bad port")),
        None => (hostport, ""),
    };
    if host.is_empty() {
        return Err(format!("{s:?}: no host"));
    }
    if host
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b"@?#[]\\".contains(&b))
    {
        return Err(format!("{s:?}: unexpected character in the host"));
    }
    Ok((
        host.to_ascii_lowercase()
            .split('.')
            .map(str::to_string)
            .collect(),
        port.to_string(),
        path.to_string(),
    ))
}

impl ImagePattern {
    /// Parses a pattern; `*` and `?` are globs within one host part.
    pub fn parse(s: &str) -> Result<ImagePattern, String> {
        let (host_parts, port, path) = split_image(s.trim())?;
        if port.contains('*') || path.contains('*') {
            return Err(format!("{s:?}: globs are allowed in the host only"));
        }
        Ok(ImagePattern {
            text: s.trim().to_string(),
            host_parts,
            port,
            path,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `image` (`host[:port]/path`) matches: as many host parts, each matching
    /// its glob; the same port (none if the pattern has none); and the pattern's path a
    /// prefix of the image's (a string prefix, as the kubelet's).
    pub fn matches(&self, image: &str) -> bool {
        let Ok((parts, port, path)) = split_image(image) else {
            return false;
        };
        parts.len() == self.host_parts.len()
            && port == self.port
            && path.starts_with(&self.path)
            && self
                .host_parts
                .iter()
                .zip(&parts)
                .all(|(g, p)| glob(g.as_bytes(), p.as_bytes()))
    }
}

/// `*` (any run) and `?` (any one byte) within one host part; iterative, so no input
/// makes it slow beyond len(glob) × len(text).
fn glob(g: &[u8], t: &[u8]) -> bool {
    let (mut gi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if gi < g.len() && (g[gi] == b'?' || g[gi] == t[ti]) {
            gi += 1;
            ti += 1;
        } else if gi < g.len() && g[gi] == b'*' {
            star = Some((gi, ti));
            gi += 1;
        } else if let Some((sg, st)) = star {
            gi = sg + 1;
            ti = st + 1;
            star = Some((sg, st + 1));
        } else {
            return false;
        }
    }
    g[gi..].iter().all(|&b| b == b'*')
}

// ------------------------------------------------------------------ config

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawConfig {
    api_version: String,
    kind: String,
    #[serde(default)]
    providers: Option<Vec<RawProvider>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawProvider {
    name: String,
    #[serde(default)]
    match_images: Option<Vec<String>>,
    #[serde(default)]
    default_cache_duration: Option<String>,
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    args: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<RawEnv>>,
    /// Service-account-token plugins (kubelet 1.33+): they need the pod's token, which a
    /// node daemon does not have, so such a provider is skipped.
    #[serde(default)]
    token_attributes: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnv {
    name: String,
    #[serde(default)]
    value: Option<String>,
}

/// One configured plugin.
#[derive(Clone, PartialEq, Eq)]
pub struct Provider {
    pub name: String,
    pub match_images: Vec<ImagePattern>,
    pub default_cache_duration: Duration,
    pub api_version: String,
    pub args: Vec<String>,
    /// Extra environment (values may be secrets: not shown by Debug).
    pub env: Vec<(String, String)>,
}

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provider")
            .field("name", &self.name)
            .field(
                "match_images",
                &self
                    .match_images
                    .iter()
                    .map(ImagePattern::as_str)
                    .collect::<Vec<_>>(),
            )
            .field("default_cache_duration", &self.default_cache_duration)
            .field("api_version", &self.api_version)
            .field("args", &self.args)
            .field(
                "env",
                &self
                    .env
                    .iter()
                    .map(|(k, _)| format!("{k}=<redacted>"))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Provider {
    /// Whether one of its `matchImages` matches `image`.
    pub fn matches(&self, image: &str) -> bool {
        self.match_images.iter().any(|p| p.matches(image))
    }
}

/// A parsed `CredentialProviderConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProvidersConfig {
    pub providers: Vec<Provider>,
    /// Providers left out, with why (logged when loaded).
    pub skipped: Vec<(String, String)>,
}

fn valid_plugin_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
        && name.len() <= 255
}

/// Parses a `CredentialProviderConfig` (YAML, as the kubelet's are usually written, or
/// JSON) and checks it as the kubelet does.
pub fn parse_config(bytes: &[u8]) -> Result<ProvidersConfig, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
    let value = if text.trim_start().starts_with('{') {
        serde_json::from_str(text).map_err(|e| format!("JSON: {e}"))?
    } else {
        kyaml::parse(text).map_err(|e| format!("YAML: {e}"))?
    };
    let raw: RawConfig = serde_json::from_value(value).map_err(|e| e.to_string())?;
    if raw.kind != "CredentialProviderConfig" {
        return Err(format!(
            "kind is {:?}, not CredentialProviderConfig",
            raw.kind
        ));
    }
    if !CONFIG_API_VERSIONS.contains(&raw.api_version.as_str()) {
        return Err(format!(
            "apiVersion {:?} is not one of {}",
            raw.api_version,
            CONFIG_API_VERSIONS.join(", ")
        ));
    }
    let mut out = ProvidersConfig::default();
    let mut names = std::collections::HashSet::new();
    for p in raw.providers.unwrap_or_default() {
        let name = p.name;
        if !valid_plugin_name(&name) {
            return Err(format!(
                "provider name {name:?} is not a file name in the plugin directory"
            ));
        }
        if !names.insert(name.clone()) {
            return Err(format!("provider {name:?} appears twice"));
        }
        let at = |what: String| format!("provider {name:?}: {what}");
        let match_images = p.match_images.unwrap_or_default();
        if match_images.is_empty() {
            return Err(at("matchImages is required".into()));
        }
        let match_images = match_images
            .iter()
            .map(|m| ImagePattern::parse(m).map_err(|e| at(format!("matchImages: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let default_cache_duration = parse_go_duration(
            p.default_cache_duration
                .as_deref()
                .ok_or_else(|| at("defaultCacheDuration is required".into()))?,
        )
        .map_err(|e| at(format!("defaultCacheDuration: {e}")))?;
        let api_version = p
            .api_version
            .ok_or_else(|| at("apiVersion is required".into()))?;
        if !EXCHANGE_API_VERSIONS.contains(&api_version.as_str()) {
            return Err(at(format!(
                "apiVersion {api_version:?} is not one of {}",
                EXCHANGE_API_VERSIONS.join(", ")
            )));
        }
        let mut env = Vec::new();
        for e in p.env.unwrap_or_default() {
            if e.name.is_empty() || e.name.contains('=') || e.name.contains('\0') {
                return Err(at(format!("env name {:?} is not valid", e.name)));
            }
            let value = e.value.unwrap_or_default();
            if value.contains('\0') {
                return Err(at(format!("env {} holds a NUL byte", e.name)));
            }
            env.push((e.name, value));
        }
        if p.token_attributes.is_some() {
            out.skipped.push((
                name,
                "tokenAttributes: it needs a pod's service account token, which ferry does not have"
                    .into(),
            ));
            continue;
        }
        out.providers.push(Provider {
            name,
            match_images,
            default_cache_duration,
            api_version,
            args: p.args.unwrap_or_default(),
            env,
        });
    }
    Ok(out)
}

// ------------------------------------------------------------------ response

/// What the cache is keyed by, as the response says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheKeyType {
    Image,
    Registry,
    Global,
}

/// A parsed `CredentialProviderResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub cache_key_type: CacheKeyType,
    /// `None`: the provider's default.
    pub cache_duration: Option<Duration>,
    /// Credentials by the images they serve, most specific pattern first.
    pub auth: Vec<(ImagePattern, Credentials)>,
}

impl Response {
    /// The credentials for `image`: the first (most specific) pattern that matches.
    pub fn credentials_for(&self, image: &str) -> Option<&Credentials> {
        self.auth
            .iter()
            .find(|(p, _)| p.matches(image))
            .map(|(_, c)| c)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawResponse {
    api_version: String,
    kind: String,
    cache_key_type: String,
    #[serde(default)]
    cache_duration: Option<String>,
    #[serde(default)]
    auth: Option<HashMap<String, RawAuth>>,
}

/// No Debug: it holds the password.
#[derive(Deserialize)]
struct RawAuth {
    #[serde(default)]
    username: String,
    #[serde(default)]
    password: String,
}

/// Parses a plugin's stdout for a request made with `api_version`. Errors never quote
/// the input (it may hold a password).
pub fn parse_response(bytes: &[u8], api_version: &str) -> Result<Response, String> {
    let raw: RawResponse = serde_json::from_slice(bytes).map_err(|e| {
        format!(
            "the answer is not a CredentialProviderResponse ({:?} error at line {} column {})",
            e.classify(),
            e.line(),
            e.column()
        )
    })?;
    if raw.kind != "CredentialProviderResponse" {
        return Err("the answer's kind is not CredentialProviderResponse".into());
    }
    if raw.api_version != api_version {
        return Err(format!(
            "the answer's apiVersion is not the request's {api_version}"
        ));
    }
    let cache_key_type = match raw.cache_key_type.as_str() {
        "Image" => CacheKeyType::Image,
        "Registry" => CacheKeyType::Registry,
        "Global" => CacheKeyType::Global,
        _ => return Err("cacheKeyType is not Image, Registry or Global".into()),
    };
    let cache_duration = raw
        .cache_duration
        .as_deref()
        .map(parse_go_duration)
        .transpose()
        .map_err(|e| format!("cacheDuration: {e}"))?;
    let mut auth = Vec::new();
    for (key, a) in raw.auth.unwrap_or_default() {
        let pattern =
            ImagePattern::parse(&key).map_err(|e| format!("auth key is not an image: {e}"))?;
        auth.push((
            pattern,
            Credentials {
                username: a.username,
                password: a.password,
            },
        ));
    }
    // Most specific first: longer patterns, then fewer globs; ties by text, for a stable
    // choice.
    auth.sort_by(|(a, _), (b, _)| {
        b.text
            .len()
            .cmp(&a.text.len())
            .then(
                a.text
                    .matches('*')
                    .count()
                    .cmp(&b.text.matches('*').count()),
            )
            .then(a.text.cmp(&b.text))
    });
    Ok(Response {
        cache_key_type,
        cache_duration,
        auth,
    })
}

// ------------------------------------------------------------------ running plugins

async fn read_capped<R: tokio::io::AsyncRead + Unpin>(
    r: Option<R>,
    cap: usize,
) -> std::io::Result<(Vec<u8>, bool)> {
    use tokio::io::AsyncReadExt;
    let Some(r) = r else {
        return Ok((Vec::new(), false));
    };
    let mut buf = Vec::new();
    r.take(cap as u64 + 1).read_to_end(&mut buf).await?;
    let over = buf.len() > cap;
    buf.truncate(cap);
    Ok((buf, over))
}

/// A short, printable summary of a plugin's stderr.
fn stderr_summary(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let line = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("");
    let mut s: String = line
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(200)
        .collect();
    if line.chars().count() > 200 {
        s.push('…');
    }
    s
}

/// Runs `provider` for `image` and parses its answer.
pub async fn run_plugin(
    provider: &Provider,
    bin_dir: &Path,
    timeout: Duration,
    image: &str,
) -> Result<Response, ProviderError> {
    use tokio::io::AsyncWriteExt;
    let name = &provider.name;
    let program = bin_dir.join(name);
    let request = serde_json::json!({
        "apiVersion": provider.api_version,
        "kind": "CredentialProviderRequest",
        "image": image,
    })
    .to_string();
    let mut cmd = tokio::process::Command::new(&program);
    cmd.args(&provider.args)
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .envs(provider.env.iter().map(|(k, v)| (k, v)))
        .current_dir(bin_dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut tries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Ok(c) => break c,
            // ETXTBSY: the plugin is being replaced, or another thread of ours forked
            // while it was open for writing; it passes.
            Err(e) if e.raw_os_error() == Some(26) && tries < 5 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20 << tries)).await;
            }
            Err(e) => {
                return Err(plugin_err(
                    name,
                    format!("cannot run {}: {e}", program.display()),
                ));
            }
        }
    };
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let work = async {
        let write = async move {
            if let Some(mut stdin) = stdin {
                // A plugin that does not read its stdin may close it: not an error.
                let _ = stdin.write_all(request.as_bytes()).await;
                let _ = stdin.shutdown().await;
            }
        };
        let ((), out, err) = tokio::join!(
            write,
            read_capped(stdout, MAX_RESPONSE_BYTES),
            read_capped(stderr, MAX_STDERR_BYTES)
        );
        let status = child.wait().await;
        (out, err, status)
    };
    let (out, err, status) = match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => {
            let _ = child.kill().await;
            return Err(plugin_err(
                name,
                format!("no answer within {timeout:?}; killed"),
            ));
        }
    };
    let status = status.map_err(|e| plugin_err(name, format!("waiting for it: {e}")))?;
    let (out, over) = out.map_err(|e| plugin_err(name, format!("reading its answer: {e}")))?;
    let stderr = err.map(|(b, _)| stderr_summary(&b)).unwrap_or_default();
    if over {
        return Err(plugin_err(
            name,
            format!("its answer is larger than {MAX_RESPONSE_BYTES} bytes"),
        ));
    }
    if !status.success() {
        let said = if stderr.is_empty() {
            String::new()
        } else {
            format!(": {stderr}")
        };
        return Err(plugin_err(name, format!("exited with {status}{said}")));
    }
    parse_response(&out, &provider.api_version).map_err(|e| plugin_err(name, e))
}

// ------------------------------------------------------------------ cache

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum CacheKey {
    Image(String),
    Registry(String),
    Global,
}

#[derive(Debug, Clone)]
struct Cached {
    response: Arc<Response>,
    expires: Instant,
}

#[derive(Debug)]
struct Shared {
    providers: Vec<Provider>,
    bin_dir: PathBuf,
    clock: Arc<dyn Clock>,
    timeout: Duration,
    cache: Mutex<HashMap<(usize, CacheKey), Cached>>,
    /// (provider, image) → not run again before this.
    failed: Mutex<HashMap<(usize, String), Instant>>,
    flights: SingleFlight<(usize, String), Result<Arc<Response>, ProviderError>>,
    runs: AtomicU64,
}

/// The configured plugins, their cached answers and their runs; clones share them.
#[derive(Debug, Clone)]
pub struct CredentialProviders {
    shared: Arc<Shared>,
}

impl CredentialProviders {
    /// Providers from a parsed config, running plugins out of `bin_dir`.
    pub fn new(config: ProvidersConfig, bin_dir: PathBuf, clock: Arc<dyn Clock>) -> Self {
        for (name, why) in &config.skipped {
            tracing::warn!(provider = %name, "credential provider skipped: {why}");
        }
        CredentialProviders {
            shared: Arc::new(Shared {
                providers: config.providers,
                bin_dir,
                clock,
                timeout: DEFAULT_PLUGIN_TIMEOUT,
                cache: Mutex::new(HashMap::new()),
                failed: Mutex::new(HashMap::new()),
                flights: SingleFlight::new(),
                runs: AtomicU64::new(0),
            }),
        }
    }

    /// Reads the config file at `config` (the kubelet's `--image-credential-provider-config`).
    pub fn load(config: &Path, bin_dir: &Path) -> Result<Self, ProviderError> {
        use std::io::Read;
        let err = |reason: String| ProviderError::Config {
            path: config.display().to_string(),
            reason,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(config)
            .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes))
            .map_err(|e| err(e.to_string()))?;
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            return Err(err(format!("larger than {MAX_CONFIG_BYTES} bytes")));
        }
        let parsed = parse_config(&bytes).map_err(err)?;
        if !bin_dir.is_dir() {
            return Err(ProviderError::Config {
                path: config.display().to_string(),
                reason: format!("plugin directory {} is not a directory", bin_dir.display()),
            });
        }
        Ok(Self::new(
            parsed,
            bin_dir.to_path_buf(),
            Arc::new(SystemClock),
        ))
    }

    /// The same providers with another plugin timeout (tests).
    pub fn with_timeout(self, timeout: Duration) -> Self {
        let s = &self.shared;
        CredentialProviders {
            shared: Arc::new(Shared {
                providers: s.providers.clone(),
                bin_dir: s.bin_dir.clone(),
                clock: s.clock.clone(),
                timeout,
                cache: Mutex::new(HashMap::new()),
                failed: Mutex::new(HashMap::new()),
                flights: SingleFlight::new(),
                runs: AtomicU64::new(0),
            }),
        }
    }

    /// The configured providers.
    pub fn providers(&self) -> &[Provider] {
        &self.shared.providers
    }

    /// How many times a plugin was run.
    pub fn plugin_runs(&self) -> u64 {
        self.shared.runs.load(Ordering::Relaxed)
    }

    fn keys(image: &str, registry: &str) -> [CacheKey; 3] {
        [
            CacheKey::Image(image.to_string()),
            CacheKey::Registry(registry.to_string()),
            CacheKey::Global,
        ]
    }

    /// Credentials for `registry`/`repository` from the first matching provider that has
    /// some: a cached answer while it lasts, else the plugin's. `Ok(None)`: no provider
    /// matches, or none had credentials for it (or a failed one is resting). An error
    /// only when a plugin failed and no other provider had credentials.
    pub async fn credentials(
        &self,
        registry: &str,
        repository: &str,
    ) -> Result<Option<Credentials>, ProviderError> {
        let image = format!("{registry}/{repository}");
        let mut failure = None;
        for (idx, provider) in self.shared.providers.iter().enumerate() {
            if !provider.matches(&image) {
                continue;
            }
            let now = self.shared.clock.now();
            let cached = {
                let cache = self.shared.cache.lock();
                Self::keys(&image, registry)
                    .into_iter()
                    .find_map(|k| cache.get(&(idx, k)).filter(|c| c.expires > now).cloned())
            };
            let response = match cached {
                Some(c) => c.response,
                None => {
                    let resting = self
                        .shared
                        .failed
                        .lock()
                        .get(&(idx, image.clone()))
                        .is_some_and(|until| *until > now);
                    if resting {
                        continue;
                    }
                    match self.ask(idx, &image, registry).await {
                        Ok(r) => r,
                        Err(e) => {
                            failure = Some(e);
                            continue;
                        }
                    }
                }
            };
            if let Some(c) = response.credentials_for(&image) {
                return Ok(Some(c.clone()));
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// Runs provider `idx` for `image` (one run for concurrent callers) and caches its
    /// answer before anyone sees it.
    async fn ask(
        &self,
        idx: usize,
        image: &str,
        registry: &str,
    ) -> Result<Arc<Response>, ProviderError> {
        let shared = self.shared.clone();
        let (image_owned, registry_owned) = (image.to_string(), registry.to_string());
        let outcome = self
            .shared
            .flights
            .run((idx, image.to_string()), move || async move {
                let provider = &shared.providers[idx];
                shared.runs.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(provider = %provider.name, image = %image_owned, "running credential provider");
                let result =
                    run_plugin(provider, &shared.bin_dir, shared.timeout, &image_owned).await;
                let now = shared.clock.now();
                match result {
                    Ok(response) => {
                        let response = Arc::new(response);
                        let ttl = response
                            .cache_duration
                            .unwrap_or(provider.default_cache_duration);
                        if !ttl.is_zero() {
                            let key = match response.cache_key_type {
                                CacheKeyType::Image => CacheKey::Image(image_owned.clone()),
                                CacheKeyType::Registry => CacheKey::Registry(registry_owned),
                                CacheKeyType::Global => CacheKey::Global,
                            };
                            let mut cache = shared.cache.lock();
                            if cache.len() >= MAX_CACHED {
                                cache.retain(|_, c| c.expires > now);
                                if cache.len() >= MAX_CACHED {
                                    cache.clear();
                                }
                            }
                            cache.insert(
                                (idx, key),
                                Cached {
                                    response: response.clone(),
                                    expires: now + ttl,
                                },
                            );
                        }
                        shared.failed.lock().remove(&(idx, image_owned));
                        Ok(response)
                    }
                    Err(e) => {
                        let mut failed = shared.failed.lock();
                        if failed.len() >= MAX_CACHED {
                            failed.retain(|_, until| *until > now);
                        }
                        failed.insert((idx, image_owned), now + FAILURE_BACKOFF);
                        Err(e)
                    }
                }
            })
            .await;
        outcome.unwrap_or_else(|_| {
            Err(plugin_err(
                &self.shared.providers[idx].name,
                "the plugin run ended without an answer",
            ))
        })
    }

    /// Drops every cached answer that could serve `registry`/`repository` (the registry
    /// refused its credentials), so the next lookup asks the plugin again.
    pub fn forget(&self, registry: &str, repository: &str) {
        let image = format!("{registry}/{repository}");
        let mut cache = self.shared.cache.lock();
        for (idx, provider) in self.shared.providers.iter().enumerate() {
            if provider.matches(&image) {
                for k in Self::keys(&image, registry) {
                    cache.remove(&(idx, k));
                }
            }
        }
    }

    /// Whether any provider's `matchImages` match `registry`/`repository`.
    pub fn matches(&self, registry: &str, repository: &str) -> bool {
        let image = format!("{registry}/{repository}");
        self.shared.providers.iter().any(|p| p.matches(&image))
    }
}

#[cfg(test)]
mod tests;
