//! The server's TOML configuration.
//!
//! Every section has a default so `ferry registry serve` runs with no file at all
//! (127.0.0.1:5000, filesystem storage under `./ferry-data`, no auth). Unknown keys are
//! errors everywhere: a typo in a security setting must not silently fall back to a default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::auth::AuthConfig;
use crate::cache::UpstreamConfig;
use crate::storage::StorageConfig;

/// The address served when nothing else is configured.
pub const DEFAULT_ADDR: &str = "127.0.0.1:5000";

/// Errors loading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The whole server configuration (`ferry registry serve --config FILE`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listen address, `HOST:PORT`.
    #[serde(default = "default_addr")]
    pub addr: SocketAddr,
    /// Serve HTTPS with these PEM files; plain HTTP (h1 and h2c) when absent.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    #[serde(default)]
    pub storage: StorageConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    /// Pull-through mode: serve (read-only) what this upstream registry has.
    #[serde(default)]
    pub upstream: Option<UpstreamConfig>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub gc: GcConfig,
    #[serde(default)]
    pub memory_cache: MemoryCacheConfig,
}

fn default_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 5000))
}

impl Default for Config {
    fn default() -> Self {
        Config {
            addr: default_addr(),
            tls: None,
            storage: StorageConfig::default(),
            auth: AuthConfig::default(),
            upstream: None,
            limits: Limits::default(),
            gc: GcConfig::default(),
            memory_cache: MemoryCacheConfig::default(),
        }
    }
}

impl Config {
    /// Parse a TOML document.
    pub fn from_toml(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.to_path_buf(),
            source: Box::new(source),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Read and parse a TOML file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml(&text, path)
    }

    /// Checks values serde cannot (zero limits and the like).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        if l.max_manifest_bytes == 0 || l.max_blob_bytes == 0 {
            return Err(ConfigError::Invalid(
                "limits.max_manifest_bytes and limits.max_blob_bytes must be > 0".into(),
            ));
        }
        if l.body_idle_timeout.is_zero()
            || l.header_read_timeout.is_zero()
            || l.idle_timeout.is_zero()
        {
            return Err(ConfigError::Invalid(
                "limits.body_idle_timeout, limits.header_read_timeout and limits.idle_timeout \
                 must be > 0"
                    .into(),
            ));
        }
        if l.max_connections == 0 || l.max_connections_per_client == 0 {
            return Err(ConfigError::Invalid(
                "limits.max_connections and limits.max_connections_per_client must be > 0".into(),
            ));
        }
        if l.max_page_entries == 0 {
            return Err(ConfigError::Invalid(
                "limits.max_page_entries must be > 0".into(),
            ));
        }
        Ok(())
    }

    /// This config with every secret (upstream password, inline token secret, S3 secret
    /// key and session token) replaced by [`crate::REDACTED`]: what is printed.
    pub fn redacted(&self) -> Config {
        let mut out = self.clone();
        out.auth = self.auth.redacted();
        out.upstream = self.upstream.as_ref().map(UpstreamConfig::redacted);
        if let StorageConfig::S3(s3) = &self.storage {
            out.storage = StorageConfig::S3(s3.redacted());
        }
        out
    }

    /// Apply `--root DIR`: filesystem storage rooted there.
    pub fn set_root(&mut self, root: PathBuf) {
        self.storage = StorageConfig::Filesystem { root };
    }
}

/// HTTPS certificate and key (PEM).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Bounds on what clients may send, and how slowly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest manifest or index accepted (default 4 MiB, the spec's suggested minimum).
    pub max_manifest_bytes: u64,
    /// Largest blob accepted (default 64 GiB).
    pub max_blob_bytes: u64,
    /// A request body that sends nothing for this long is abandoned (and its upload
    /// session cancelled).
    #[serde(with = "duration_str")]
    pub body_idle_timeout: Duration,
    /// Time allowed to send the request headers, counted from accept for the first request
    /// of a connection (slowloris guard; a silent socket is closed after it).
    #[serde(with = "duration_str")]
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and no bytes moving for this long is closed;
    /// so is one whose response the client has stopped reading.
    #[serde(with = "duration_str")]
    pub idle_timeout: Duration,
    /// Largest page of tags or repositories returned at once (`n` is capped to it).
    pub max_page_entries: usize,
    /// Connections open at once; further ones wait in the accept queue.
    pub max_connections: usize,
    /// Connections one client address may have open at once; more are closed at accept,
    /// so no single client holds every slot. (Clients behind one NAT share it.)
    pub max_connections_per_client: usize,
    /// Accept sparse manifests (default true): an image manifest whose layers, or an
    /// index whose child manifests, are not in the repository (a partial copy of a
    /// multi-platform image, say), as the distribution spec allows and its conformance
    /// suite's `sparse` workflow expects. What is there must still match its descriptor,
    /// and a missing config is always refused. `false` refuses every manifest that
    /// references something absent, so a tag never points at content that cannot be
    /// pulled in full.
    pub sparse_manifests: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_manifest_bytes: ferry_oci::MAX_MANIFEST_BYTES,
            max_blob_bytes: 64 << 30,
            body_idle_timeout: Duration::from_secs(30),
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(90),
            max_page_entries: 10_000,
            max_connections: 16_384,
            max_connections_per_client: 4096,
            sparse_manifests: true,
        }
    }
}

/// Background garbage collection while serving.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GcConfig {
    /// Run a collection this often; `None` (default) = only `ferry registry gc`.
    #[serde(with = "opt_duration_str")]
    pub interval: Option<Duration>,
    /// Content younger than this is never collected (protects pushes in flight).
    #[serde(with = "duration_str")]
    pub grace: Duration,
    /// Also remove manifests no tag reaches (and what only they reference).
    pub delete_untagged: bool,
}

impl GcConfig {
    /// The options of one collection under this configuration.
    pub fn options(&self, dry_run: bool) -> crate::storage::gc::GcOptions {
        crate::storage::gc::GcOptions {
            grace: self.grace,
            delete_untagged: self.delete_untagged,
            dry_run,
        }
    }
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            interval: None,
            grace: Duration::from_secs(3600),
            delete_untagged: false,
        }
    }
}

/// The in-process cache of repository links, manifests, tags and small blobs. Entries
/// are content-addressed or expire after `ttl`, so replicas sharing one object store
/// converge within `ttl` after a delete or retag elsewhere.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryCacheConfig {
    /// Entries per cache (links, manifests, tags, small blobs each).
    pub entries: usize,
    /// How long an entry is trusted.
    #[serde(with = "duration_str")]
    pub ttl: Duration,
    /// Memory for cached manifest documents.
    pub manifest_bytes: u64,
    /// Blobs up to this size are kept in memory (configs, small layers); 0 disables.
    pub small_blob_bytes: u64,
    /// Memory for cached small blobs.
    pub small_blob_total_bytes: u64,
}

impl Default for MemoryCacheConfig {
    fn default() -> Self {
        MemoryCacheConfig {
            entries: 100_000,
            ttl: Duration::from_secs(10),
            manifest_bytes: 64 << 20,
            small_blob_bytes: 256 << 10,
            small_blob_total_bytes: 128 << 20,
        }
    }
}

/// Serde for durations written as strings (`"30s"`) or integer seconds.
pub mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Secs(u64),
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&ferry_oci::units::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        match Repr::deserialize(d)? {
            Repr::Text(t) => ferry_oci::units::parse_duration(&t).map_err(serde::de::Error::custom),
            Repr::Secs(s) => Ok(Duration::from_secs(s)),
        }
    }
}

/// Serde for optional durations.
pub mod opt_duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::duration_str::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        #[derive(Deserialize)]
        struct Wrap(#[serde(with = "super::duration_str")] Duration);
        Ok(Some(Wrap::deserialize(d)?.0))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_the_default() {
        let c = Config::from_toml("", Path::new("x.toml")).unwrap();
        assert_eq!(c.addr.to_string(), DEFAULT_ADDR);
        assert_eq!(c.storage, StorageConfig::default());
        assert!(c.upstream.is_none());
        assert_eq!(c.limits.max_manifest_bytes, 4 << 20);
    }

    #[test]
    fn sections_parse() {
        let c = Config::from_toml(
            r#"
addr = "0.0.0.0:6000"
[tls]
cert = "/c.pem"
key = "/k.pem"
[storage]
type = "filesystem"
root = "/srv/reg"
[limits]
max_blob_bytes = 1000
body_idle_timeout = "5s"
header_read_timeout = 7
[gc]
interval = "1h"
grace = "30m"
[memory_cache]
ttl = "250ms"
"#,
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.addr.port(), 6000);
        assert_eq!(c.tls.unwrap().cert, PathBuf::from("/c.pem"));
        assert_eq!(
            c.storage,
            StorageConfig::Filesystem {
                root: PathBuf::from("/srv/reg")
            }
        );
        assert_eq!(c.limits.max_blob_bytes, 1000);
        assert_eq!(c.limits.body_idle_timeout, Duration::from_secs(5));
        assert_eq!(c.limits.header_read_timeout, Duration::from_secs(7));
        assert_eq!(c.gc.interval, Some(Duration::from_secs(3600)));
        assert_eq!(c.gc.grace, Duration::from_secs(1800));
        assert_eq!(c.memory_cache.ttl, Duration::from_millis(250));
    }

    #[test]
    fn typos_are_errors() {
        assert!(Config::from_toml("adr = \"1.2.3.4:5\"", Path::new("x")).is_err());
        assert!(Config::from_toml("[limits]\nmax_blob = 3", Path::new("x")).is_err());
        assert!(Config::from_toml("[limits]\nmax_blob_bytes = 0", Path::new("x")).is_err());
        assert!(Config::from_toml("[gc]\ngrace = \"5 fortnights\"", Path::new("x")).is_err());
    }
}
