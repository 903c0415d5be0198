//! containerd's registry host configuration: a `config_path` directory (containerd's
//! default `/etc/containerd/certs.d`) holding one directory per registry host, each with
//! a `hosts.toml`, so that one configuration serves containerd and ferry.
//!
//! What is read, and how (containerd's rules, checked against its docs/hosts.md and
//! `remotes/docker/config`):
//!
//! - The directory for `host:port` is `host_port_` if present, else `host:port`, else
//!   `_default`; the first that exists is the only one read.
//! - `hosts.toml`: `[host."URL"]` tables are the hosts tried first, **in file order**;
//!   the top-level `server` (default: the registry itself) is tried last, with the
//!   top-level keys as its settings.
//! - Per host: `capabilities` (`pull`, `resolve`, `push`; default all three; an unknown
//!   one is an error), `skip_verify`, `ca` (a file or a list), `client` (a file holding
//!   certificate and key, or a list of such files or of `[cert, key]` pairs),
//!   `header` (name = value or list of values), `override_path`, `dial_timeout`.
//!   Relative file names are taken against the host's directory.
//! - A URL without `/v2` at the end of its path gets it appended, unless
//!   `override_path = true`, when the path is the API root itself.
//! - A directory without `hosts.toml` (or whose `hosts.toml` does not parse: containerd
//!   logs it and does the same) is read docker's way: `*.crt` are CA files, `*.cert` client
//!   certificates with the `*.key` of the same name.
//!
//! Choices of ferry's own (containerd has none to copy):
//! - Unknown keys are tolerated, as containerd's TOML decoder ignores them, but reported
//!   ([`HostsFile::ignored_keys`]) so the loader can log them: a typo should not pass
//!   silently.
//! - A host URL without a scheme is https, except that a loopback registry that does not
//!   speak TLS is reached over http (ferry's rule for every registry).
//! - Bounds: [`MAX_HOSTS_FILE_BYTES`] per file, [`MAX_HOSTS`] `[host]` tables,
//!   [`MAX_VALUES`] entries in any list, [`MAX_DIR_ENTRIES`] files looked at in a
//!   directory without `hosts.toml`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};

/// containerd's default `config_path`, and ferry's.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/containerd/certs.d";

/// Largest `hosts.toml` read.
pub const MAX_HOSTS_FILE_BYTES: u64 = 1 << 20;
/// Most `[host."…"]` tables in one file.
pub const MAX_HOSTS: usize = 64;
/// Most entries in one list (`ca`, `client`, `capabilities`, `header` and its values).
pub const MAX_VALUES: usize = 64;
/// Most directory entries looked at for docker-style certificate files.
pub const MAX_DIR_ENTRIES: usize = 1024;
/// Longest `dial_timeout` accepted.
pub const MAX_DIAL_TIMEOUT: Duration = Duration::from_secs(600);

/// A hosts configuration that cannot be used; the message names the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    #[error("{file}: {message}")]
    Syntax { file: String, message: String },
    #[error("{file}: {key}: {message}")]
    Key {
        file: String,
        key: String,
        message: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// What a host may be asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// Content by digest: blobs, manifests by digest, referrers.
    pub pull: bool,
    /// Tags to digests: manifests by tag, tag lists.
    pub resolve: bool,
    /// Uploads.
    pub push: bool,
}

impl Capabilities {
    /// containerd's default for a host that names none.
    pub const ALL: Capabilities = Capabilities {
        pull: true,
        resolve: true,
        push: true,
    };
}

/// The TLS settings of one host; files, read when a connection is first needed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TlsFiles {
    /// PEM files of CA certificates added to the root store for this host.
    pub ca: Vec<PathBuf>,
    /// Client certificates: (certificate file, key file); no key file means the key is
    /// in the certificate's file.
    pub client: Vec<(PathBuf, Option<PathBuf>)>,
    /// `skip_verify`, when set.
    pub skip_verify: Option<bool>,
}

impl TlsFiles {
    /// True when nothing is set (the client's default TLS applies).
    pub fn is_default(&self) -> bool {
        self.ca.is_empty() && self.client.is_empty() && self.skip_verify.is_none()
    }
}

/// Where a host is: scheme, `host[:port]`, API root path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// `Some("http" | "https")` when the URL says; `None`: https (loopback falls back).
    pub scheme: Option<&'static str>,
    /// `host[:port]` (IPv6 in brackets).
    pub host: String,
    /// What replaces `/v2` in request paths: `/v2` itself unless the URL had a path or
    /// `override_path` was set; never ends with `/` (`""` is the server's root).
    pub root: String,
}

/// The settings of one host (a `[host."…"]` table, or the top level for `server`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSettings {
    pub capabilities: Capabilities,
    pub tls: TlsFiles,
    /// Headers sent with every request to this host.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub override_path: bool,
    pub dial_timeout: Option<Duration>,
}

impl Default for HostSettings {
    fn default() -> Self {
        HostSettings {
            capabilities: Capabilities::ALL,
            tls: TlsFiles::default(),
            headers: Vec::new(),
            override_path: false,
            dial_timeout: None,
        }
    }
}

/// One `[host."URL"]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    pub location: Location,
    pub settings: HostSettings,
}

/// A parsed host directory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostsFile {
    /// The file (or directory, for docker-style certificates) this came from.
    pub source: PathBuf,
    /// `[host."…"]` tables in file order: tried before the server.
    pub hosts: Vec<HostEntry>,
    /// The top-level `server`; `None`: the registry itself.
    pub server: Option<Location>,
    /// The top-level settings, which are the server's.
    pub server_settings: HostSettings,
    /// Keys that mean nothing here and were ignored (dotted paths).
    pub ignored_keys: Vec<String>,
}

/// The directory name containerd gives `host:port` first (`host_port_`), when it differs.
fn port_directory(host: &str) -> Option<String> {
    let idx = host.rfind(':')?;
    (idx > 0).then(|| format!("{}_{}_", &host[..idx], &host[idx + 1..]))
}

/// Whether `registry` can name a directory under the config path (no separators, no
/// `.`/`..`).
fn safe_name(registry: &str) -> bool {
    !registry.is_empty()
        && registry != "."
        && registry != ".."
        && !registry.contains(['/', '\\', '\0'])
}

/// The host directory that applies to `registry` under `config_path`, if any.
pub fn host_dir(config_path: &Path, registry: &str) -> Result<Option<PathBuf>, HostsError> {
    if !safe_name(registry) {
        return Ok(None);
    }
    let mut candidates: Vec<String> = Vec::new();
    if let Some(d) = port_directory(registry) {
        candidates.push(d);
    }
    candidates.push(registry.to_string());
    candidates.push("_default".to_string());
    for c in candidates {
        let p = config_path.join(&c);
        match std::fs::metadata(&p) {
            Ok(m) if m.is_dir() => return Ok(Some(p)),
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(HostsError::Io {
                    path: p.display().to_string(),
                    source: e,
                });
            }
        }
    }
    Ok(None)
}

/// Reads the host configuration for `registry` under `config_path`: `Ok(None)` when no
/// directory applies. A `hosts.toml` that does not parse is logged and the directory
/// read docker's way, as containerd does.
pub fn load(config_path: &Path, registry: &str) -> Result<Option<HostsFile>, HostsError> {
    let Some(dir) = host_dir(config_path, registry)? else {
        return Ok(None);
    };
    let file = dir.join("hosts.toml");
    let text = match read_bounded(&file) {
        Ok(t) => Some(t),
        Err(HostsError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    if let Some(text) = text.filter(|t| !t.is_empty()) {
        match parse(&text, &dir, &file) {
            Ok(h) => return Ok(Some(h)),
            Err(e) => {
                tracing::error!(error = %e, "cannot use this hosts.toml; reading its directory for docker-style certificates instead, as containerd does");
            }
        }
    }
    cert_files(&dir).map(Some)
}

fn read_bounded(file: &Path) -> Result<String, HostsError> {
    use std::io::Read;
    let io = |source| HostsError::Io {
        path: file.display().to_string(),
        source,
    };
    let f = std::fs::File::open(file).map_err(io)?;
    let mut text = String::new();
    f.take(MAX_HOSTS_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_HOSTS_FILE_BYTES {
        return Err(HostsError::Syntax {
            file: file.display().to_string(),
            message: format!("larger than {MAX_HOSTS_FILE_BYTES} bytes"),
        });
    }
    Ok(text)
}

/// A directory read docker's way: `*.crt` CA files, `*.cert` + `*.key` client pairs, for
/// the registry itself.
pub fn cert_files(dir: &Path) -> Result<HostsFile, HostsError> {
    let io = |source| HostsError::Io {
        path: dir.display().to_string(),
        source,
    };
    let mut names: Vec<String> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)?.take(MAX_DIR_ENTRIES) {
        let entry = entry.map_err(io)?;
        if entry.file_type().map_err(io)?.is_dir() {
            continue;
        }
        if let Some(n) = entry.file_name().to_str() {
            names.push(n.to_string());
        }
    }
    // read_dir's order is the filesystem's; sort so the result does not depend on it.
    names.sort();
    let mut tls = TlsFiles::default();
    for n in &names {
        if n.ends_with(".crt") {
            tls.ca.push(dir.join(n));
        } else if let Some(stem) = n.strip_suffix(".cert") {
            let key = format!("{stem}.key");
            let key = names.contains(&key).then(|| dir.join(key));
            tls.client.push((dir.join(n), key));
        }
    }
    Ok(HostsFile {
        source: dir.to_path_buf(),
        server_settings: HostSettings {
            tls,
            ..HostSettings::default()
        },
        ..HostsFile::default()
    })
}

/// Parses the text of a `hosts.toml` found in `dir` (relative file names are taken
/// against it); `file` names it in errors.
pub fn parse(text: &str, dir: &Path, file: &Path) -> Result<HostsFile, HostsError> {
    let fname = file.display().to_string();
    if text.len() as u64 > MAX_HOSTS_FILE_BYTES {
        return Err(HostsError::Syntax {
            file: fname,
            message: format!("larger than {MAX_HOSTS_FILE_BYTES} bytes"),
        });
    }
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| HostsError::Syntax {
            file: fname.clone(),
            message: e.to_string().trim().to_string(),
        })?;
    let p = Parser {
        file: fname.clone(),
        dir,
    };
    let mut out = HostsFile {
        source: file.to_path_buf(),
        ..HostsFile::default()
    };
    out.server_settings = p.settings(&table, "", &mut out.ignored_keys, &["server", "host"])?;
    if let Some(v) = table.get("server") {
        let s = v
            .as_str()
            .ok_or_else(|| p.key("server", "must be a string"))?;
        if !s.is_empty() {
            out.server = Some(p.location(s, "server", out.server_settings.override_path)?);
        }
    }
    if let Some(v) = table.get("host") {
        let hosts = v
            .as_table()
            .ok_or_else(|| p.key("host", "must be a table of [host.\"URL\"] tables"))?;
        if hosts.len() > MAX_HOSTS {
            return Err(p.key("host", &format!("more than {MAX_HOSTS} hosts")));
        }
        for name in host_order(text, hosts) {
            let key = format!("host.{name:?}");
            let Some(t) = hosts.get(&name).and_then(|v| v.as_table()) else {
                return Err(p.key(&key, "must be a table"));
            };
            let settings = p.settings(t, &key, &mut out.ignored_keys, &[])?;
            let location = p.location(&name, &key, settings.override_path)?;
            out.hosts.push(HostEntry { location, settings });
        }
    }
    Ok(out)
}

/// The `[host."…"]` names in the order the file gives them (the parsed table is keyed,
/// not ordered; the spans say where each name first appears).
fn host_order(text: &str, hosts: &toml::Table) -> Vec<String> {
    let mut spans: Vec<(usize, String)> = Vec::new();
    if let Ok(doc) = toml::de::DeTable::parse(text)
        && let Some((_, v)) = doc.get_ref().iter().find(|(k, _)| k.get_ref() == "host")
        && let toml::de::DeValue::Table(t) = v.get_ref()
    {
        for k in t.keys() {
            spans.push((k.span().start, k.get_ref().to_string()));
        }
    }
    spans.sort();
    let mut names: Vec<String> = spans.into_iter().map(|(_, n)| n).collect();
    // Anything the span walk missed still counts, after the rest.
    let mut rest: Vec<&String> = hosts.keys().filter(|k| !names.contains(k)).collect();
    rest.sort();
    names.extend(rest.into_iter().cloned());
    names.retain(|n| hosts.contains_key(n));
    names.dedup();
    names
}

struct Parser<'a> {
    file: String,
    dir: &'a Path,
}

impl Parser<'_> {
    fn key(&self, key: &str, message: &str) -> HostsError {
        HostsError::Key {
            file: self.file.clone(),
            key: key.to_string(),
            message: message.to_string(),
        }
    }

    fn path(&self, p: &str, key: &str) -> Result<PathBuf, HostsError> {
        if p.is_empty() || p.contains('\0') {
            return Err(self.key(key, "file name must not be empty"));
        }
        let p = Path::new(p);
        Ok(if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.dir.join(p)
        })
    }

    fn strings<'v>(&self, v: &'v toml::Value, key: &str) -> Result<Vec<&'v str>, HostsError> {
        match v {
            toml::Value::String(s) => Ok(vec![s.as_str()]),
            toml::Value::Array(a) => {
                if a.len() > MAX_VALUES {
                    return Err(self.key(key, &format!("more than {MAX_VALUES} values")));
                }
                a.iter()
                    .map(|x| {
                        x.as_str()
                            .ok_or_else(|| self.key(key, "must be a string or a list of strings"))
                    })
                    .collect()
            }
            _ => Err(self.key(key, "must be a string or a list of strings")),
        }
    }

    /// The settings keys of `t` (`prefix` names the table in errors); keys in `skip` are
    /// handled by the caller, others unknown are collected in `ignored`.
    fn settings(
        &self,
        t: &toml::Table,
        prefix: &str,
        ignored: &mut Vec<String>,
        skip: &[&str],
    ) -> Result<HostSettings, HostsError> {
        let name = |k: &str| {
            if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}.{k}")
            }
        };
        let mut s = HostSettings::default();
        for (k, v) in t {
            let key = name(k);
            match k.as_str() {
                "capabilities" => {
                    let list = match v {
                        toml::Value::Array(_) => self.strings(v, &key)?,
                        _ => return Err(self.key(&key, "must be a list of strings")),
                    };
                    // containerd: an empty list means the default.
                    if !list.is_empty() {
                        let mut c = Capabilities {
                            pull: false,
                            resolve: false,
                            push: false,
                        };
                        for cap in list {
                            match cap.to_ascii_lowercase().as_str() {
                                "pull" => c.pull = true,
                                "resolve" => c.resolve = true,
                                "push" => c.push = true,
                                other => {
                                    return Err(self.key(
                                        &key,
                                        &format!(
                                            "unknown capability {other:?} (pull, resolve, push)"
                                        ),
                                    ));
                                }
                            }
                        }
                        s.capabilities = c;
                    }
                }
                "skip_verify" => {
                    s.tls.skip_verify = Some(
                        v.as_bool()
                            .ok_or_else(|| self.key(&key, "must be true or false"))?,
                    );
                }
                "override_path" => {
                    s.override_path = v
                        .as_bool()
                        .ok_or_else(|| self.key(&key, "must be true or false"))?;
                }
                "ca" => {
                    for p in self.strings(v, &key)? {
                        s.tls.ca.push(self.path(p, &key)?);
                    }
                }
                "client" => s.tls.client = self.client(v, &key)?,
                "header" => s.headers = self.headers(v, &key)?,
                "dial_timeout" => {
                    let text = v
                        .as_str()
                        .ok_or_else(|| self.key(&key, "must be a duration such as \"2s\""))?;
                    let d = parse_duration(text).ok_or_else(|| {
                        self.key(&key, &format!("{text:?} is not a duration such as \"2s\""))
                    })?;
                    if d.is_zero() || d > MAX_DIAL_TIMEOUT {
                        return Err(self.key(&key, "must be more than 0 and at most 10m"));
                    }
                    s.dial_timeout = Some(d);
                }
                k if skip.contains(&k) => {}
                _ => {
                    if ignored.len() < MAX_VALUES {
                        ignored.push(key);
                    }
                }
            }
        }
        Ok(s)
    }

    fn client(
        &self,
        v: &toml::Value,
        key: &str,
    ) -> Result<Vec<(PathBuf, Option<PathBuf>)>, HostsError> {
        let bad = || {
            self.key(
                key,
                "must be a file, or a list of files or of [cert, key] pairs",
            )
        };
        let items: Vec<&toml::Value> = match v {
            toml::Value::String(_) => vec![v],
            toml::Value::Array(a) if a.len() <= MAX_VALUES => a.iter().collect(),
            toml::Value::Array(_) => {
                return Err(self.key(key, &format!("more than {MAX_VALUES} values")));
            }
            _ => return Err(bad()),
        };
        let mut out = Vec::new();
        for item in items {
            match item {
                toml::Value::String(s) => out.push((self.path(s, key)?, None)),
                toml::Value::Array(pair) => match pair.as_slice() {
                    [toml::Value::String(c), toml::Value::String(k)] => {
                        out.push((self.path(c, key)?, Some(self.path(k, key)?)));
                    }
                    _ => return Err(bad()),
                },
                _ => return Err(bad()),
            }
        }
        Ok(out)
    }

    fn headers(
        &self,
        v: &toml::Value,
        key: &str,
    ) -> Result<Vec<(HeaderName, HeaderValue)>, HostsError> {
        let t = v
            .as_table()
            .ok_or_else(|| self.key(key, "must be a table of name = value"))?;
        if t.len() > MAX_VALUES {
            return Err(self.key(key, &format!("more than {MAX_VALUES} headers")));
        }
        let mut out = Vec::new();
        for (name, values) in t {
            let hkey = format!("{key}.{name}");
            let hname = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| self.key(&hkey, "is not a valid header name"))?;
            for value in self.strings(values, &hkey)? {
                let hv = HeaderValue::from_str(value)
                    .map_err(|_| self.key(&hkey, "is not a valid header value"))?;
                out.push((hname.clone(), hv));
            }
        }
        Ok(out)
    }

    /// A host URL (`[host."URL"]` or `server`) as a [`Location`].
    fn location(&self, s: &str, key: &str, override_path: bool) -> Result<Location, HostsError> {
        let (scheme, with_scheme) = if let Some(rest) = s.strip_prefix("http://") {
            (Some("http"), format!("http://{rest}"))
        } else if let Some(rest) = s.strip_prefix("https://") {
            (Some("https"), format!("https://{rest}"))
        } else if s.contains("://") {
            return Err(self.key(key, "the scheme must be http or https"));
        } else {
            (None, format!("https://{s}"))
        };
        let u = url::Url::parse(&with_scheme)
            .map_err(|e| self.key(key, &format!("{s:?} is not a host URL: {e}")))?;
        let host = u
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| self.key(key, &format!("{s:?} has no host")))?;
        if !u.username().is_empty() || u.password().is_some() {
            return Err(self.key(key, "credentials do not belong in the URL"));
        }
        if u.query().is_some() || u.fragment().is_some() {
            return Err(self.key(key, "a host URL has no query or fragment"));
        }
        let host = match u.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let mut segments: Vec<&str> = Vec::new();
        for seg in u.path().split('/') {
            match seg {
                "" | "." => {}
                ".." => return Err(self.key(key, "the path must not contain ..")),
                s => segments.push(s),
            }
        }
        let mut root = String::new();
        for seg in &segments {
            root.push('/');
            root.push_str(seg);
        }
        if !override_path && !root.ends_with("/v2") {
            root.push_str("/v2");
        }
        Ok(Location { scheme, host, root })
    }
}

/// A Go-style duration (`"500ms"`, `"2s"`, `"1m30s"`); `None` when it is not one.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() || rest.len() > 64 {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * scale;
    }
    Duration::try_from_secs_f64(total).ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<HostsFile, HostsError> {
        parse(
            text,
            Path::new("/etc/containerd/certs.d/reg.example"),
            Path::new("/etc/containerd/certs.d/reg.example/hosts.toml"),
        )
    }

    #[test]
    fn hosts_in_file_order_with_their_settings() {
        let h = p(r#"
server = "https://reg.example"
skip_verify = false

[host."https://z-mirror.example:8443"]
  capabilities = ["pull", "resolve"]
  ca = "mirror-ca.pem"
  client = [["client.pem", "/abs/client.key"], "both.pem"]
  [host."https://z-mirror.example:8443".header]
    x-custom = "1"
    x-multi = ["a", "b"]

[host."http://a-mirror.example/some/prefix"]
  capabilities = ["pull"]
  override_path = true
  dial_timeout = "1500ms"
  skip_verify = true

[host."b-mirror.example/v2"]
"#)
        .unwrap();
        let names: Vec<_> = h.hosts.iter().map(|e| e.location.host.as_str()).collect();
        assert_eq!(
            names,
            [
                "z-mirror.example:8443",
                "a-mirror.example",
                "b-mirror.example"
            ],
            "file order, not alphabetical"
        );
        let z = &h.hosts[0];
        assert_eq!(z.location.scheme, Some("https"));
        assert_eq!(z.location.root, "/v2");
        assert!(z.settings.capabilities.pull && z.settings.capabilities.resolve);
        assert!(!z.settings.capabilities.push);
        assert_eq!(
            z.settings.tls.ca,
            [PathBuf::from(
                "/etc/containerd/certs.d/reg.example/mirror-ca.pem"
            )]
        );
        assert_eq!(
            z.settings.tls.client,
            [
                (
                    PathBuf::from("/etc/containerd/certs.d/reg.example/client.pem"),
                    Some(PathBuf::from("/abs/client.key"))
                ),
                (
                    PathBuf::from("/etc/containerd/certs.d/reg.example/both.pem"),
                    None
                )
            ]
        );
        assert_eq!(z.settings.headers.len(), 3);
        let a = &h.hosts[1];
        assert_eq!(a.location.scheme, Some("http"));
        assert_eq!(
            a.location.root, "/some/prefix",
            "override_path keeps the path"
        );
        assert_eq!(a.settings.dial_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(a.settings.tls.skip_verify, Some(true));
        let b = &h.hosts[2];
        assert_eq!(b.location.scheme, None);
        assert_eq!(b.location.root, "/v2", "an explicit /v2 is not doubled");
        assert_eq!(b.settings.capabilities, Capabilities::ALL);
        let server = h.server.unwrap();
        assert_eq!(server.host, "reg.example");
        assert_eq!(server.root, "/v2");
        assert_eq!(h.server_settings.tls.skip_verify, Some(false));
        assert!(h.ignored_keys.is_empty());
    }

    #[test]
    fn paths_without_v2_get_it_unless_overridden() {
        let h = p("[host.\"https://m.example/cache\"]\n[host.\"https://n.example/\"]\n").unwrap();
        assert_eq!(h.hosts[0].location.root, "/cache/v2");
        assert_eq!(h.hosts[1].location.root, "/v2");
        let h = p("[host.\"https://m.example/\"]\noverride_path = true\n").unwrap();
        assert_eq!(h.hosts[0].location.root, "", "the server's root");
        assert!(h.server.is_none());
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let cases = [
            (
                "[host.\"https://m\"]\ncapabilities = [\"pul\"]",
                "host.\"https://m\".capabilities",
            ),
            (
                "[host.\"https://m\"]\ncapabilities = \"pull\"",
                "capabilities",
            ),
            ("[host.\"https://m\"]\nskip_verify = \"yes\"", "skip_verify"),
            ("ca = 5", "ca"),
            ("client = [[\"a\"]]", "client"),
            ("client = [[\"a\", 1]]", "client"),
            ("server = 5", "server"),
            ("server = \"ftp://x\"", "server"),
            ("server = \"https://u:p@x\"", "server"),
            ("host = 1", "host"),
            (
                "[host.\"https://m\"]\ndial_timeout = \"soon\"",
                "dial_timeout",
            ),
            (
                "[host.\"https://m\"]\ndial_timeout = \"0s\"",
                "dial_timeout",
            ),
            ("[header]\n\"bad name\" = \"x\"", "header.bad name"),
            ("[header]\nx = \"a\\nb\"", "header.x"),
            ("[host.\"https://m\"]\nca = \"\"", "ca"),
        ];
        for (text, key) in cases {
            let e = p(text).unwrap_err().to_string();
            assert!(
                e.starts_with("/etc/containerd/certs.d/reg.example/hosts.toml: "),
                "{e}"
            );
            assert!(e.contains(key), "{text:?}: {e}");
        }
        let e = p("server = [").unwrap_err().to_string();
        assert!(e.contains("hosts.toml"), "{e}");
    }

    #[test]
    fn unknown_keys_are_tolerated_and_reported() {
        let h =
            p("server = \"https://r\"\ncolour = \"red\"\n[host.\"https://m\"]\nmirror_of = 1\n")
                .unwrap();
        assert_eq!(h.ignored_keys, ["colour", "host.\"https://m\".mirror_of"]);
    }

    #[test]
    fn bounds() {
        let mut text = String::new();
        for i in 0..=MAX_HOSTS {
            text.push_str(&format!("[host.\"https://m{i}\"]\n"));
        }
        assert!(p(&text).unwrap_err().to_string().contains("more than"));
        let big = "#".repeat(MAX_HOSTS_FILE_BYTES as usize + 1);
        assert!(p(&big).unwrap_err().to_string().contains("larger than"));
        let many = format!("ca = [{}]", vec!["\"x\""; MAX_VALUES + 1].join(","));
        assert!(p(&many).unwrap_err().to_string().contains("more than"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5h"), Some(Duration::from_secs(5400)));
        for bad in ["", "2", "s", "2x", "-1s", "1e9999s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn directory_precedence_and_docker_certs() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        assert!(load(r, "reg:5000").unwrap().is_none(), "nothing applies");
        std::fs::create_dir(r.join("_default")).unwrap();
        std::fs::write(
            r.join("_default/hosts.toml"),
            "server = \"https://fallback\"\n",
        )
        .unwrap();
        let h = load(r, "reg:5000").unwrap().unwrap();
        assert_eq!(h.server.unwrap().host, "fallback");
        std::fs::create_dir(r.join("reg:5000")).unwrap();
        std::fs::write(r.join("reg:5000/ca.crt"), "").unwrap();
        std::fs::write(r.join("reg:5000/me.cert"), "").unwrap();
        std::fs::write(r.join("reg:5000/me.key"), "").unwrap();
        std::fs::write(r.join("reg:5000/other.cert"), "").unwrap();
        let h = load(r, "reg:5000").unwrap().unwrap();
        assert!(h.server.is_none() && h.hosts.is_empty());
        assert_eq!(h.server_settings.tls.ca, [r.join("reg:5000/ca.crt")]);
        assert_eq!(
            h.server_settings.tls.client,
            [
                (r.join("reg:5000/me.cert"), Some(r.join("reg:5000/me.key"))),
                (r.join("reg:5000/other.cert"), None)
            ]
        );
        std::fs::create_dir(r.join("reg_5000_")).unwrap();
        std::fs::write(
            r.join("reg_5000_/hosts.toml"),
            "[host.\"http://m:1\"]\ncapabilities = [\"pull\"]\n",
        )
        .unwrap();
        let h = load(r, "reg:5000").unwrap().unwrap();
        assert_eq!(h.hosts[0].location.host, "m:1", "host_port_ comes first");
        // A broken hosts.toml: the directory is read docker's way instead.
        std::fs::write(
            r.join("reg_5000_/hosts.toml"),
            "[host.\"http://m:1\"]\ncapabilities = 1\n",
        )
        .unwrap();
        let h = load(r, "reg:5000").unwrap().unwrap();
        assert!(h.hosts.is_empty());
        assert!(load(r, "..").unwrap().is_none(), "no path tricks");
    }
}
