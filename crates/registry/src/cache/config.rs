//! The `[upstream]` section of the server config: which registry the pull-through cache
//! fronts, with what credentials, and how much it may keep (disk and memory bounds, how long
//! a tag stays fresh, how long a stale copy may stand in for an unreachable upstream).
//!
//! Durations are written either as whole seconds (`manifest_ttl = 60`) or as a number with a
//! unit (`"500ms"`, `"30s"`, `"5m"`, `"1h"`), so operators need not convert.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Configuration of the pull-through cache (TOML section `[upstream]`).
///
/// `password` is never printed by `Debug` and never sent to clients of ferry.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL of the upstream registry, e.g. `https://registry-1.docker.io` or
    /// `http://127.0.0.1:5001`. Only scheme, host and port are used.
    pub url: String,
    /// Repository prefix prepended upstream (`namespace = "library"` maps `alpine` to
    /// `library/alpine`; a Harbor project name fronts one project). Empty: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Upstream user name (basic auth, or the account for a bearer-token exchange).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Upstream password or token. Used only towards upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Allow plain HTTP to an upstream that is not on loopback.
    #[serde(default)]
    pub plain_http: bool,
    /// Where cached blobs live. `None`: `<storage root>/cache` (see
    /// [`UpstreamConfig::with_default_cache_dir`]), else `./ferry-data/cache`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// Upper bound of the blob cache on disk; least recently used blobs are evicted.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    /// Upper bound of the in-memory manifest / tag-list / referrers cache.
    #[serde(default = "default_memory_bytes")]
    pub memory_bytes: u64,
    /// How long a manifest fetched by tag is served without asking upstream again.
    /// Manifests fetched by digest never expire (they cannot change).
    #[serde(default = "default_manifest_ttl", with = "duration_serde")]
    pub manifest_ttl: Duration,
    /// How long tag lists and referrers responses are served from memory.
    #[serde(default = "default_list_ttl", with = "duration_serde")]
    pub list_ttl: Duration,
    /// How long past its TTL an entry may still be served while upstream answers 429/5xx or
    /// cannot be reached.
    #[serde(default = "default_stale_limit", with = "duration_serde")]
    pub stale_limit: Duration,
    /// TCP/TLS connect timeout towards upstream.
    #[serde(default = "default_connect_timeout", with = "duration_serde")]
    pub connect_timeout: Duration,
    /// Whole-request timeout for small upstream requests (manifests, HEAD, lists, tokens).
    #[serde(default = "default_request_timeout", with = "duration_serde")]
    pub request_timeout: Duration,
    /// A blob download from upstream fails if no byte arrives for this long.
    #[serde(default = "default_idle_timeout", with = "duration_serde")]
    pub idle_timeout: Duration,
    /// A range request starting more than this many bytes past what a running download
    /// has received is fetched from upstream directly (not cached) instead of waiting.
    #[serde(default = "default_range_passthrough_bytes")]
    pub range_passthrough_bytes: u64,
    /// Largest blob fetched from upstream (bigger ones are refused).
    #[serde(default = "default_max_blob_bytes")]
    pub max_blob_bytes: u64,
}

fn default_max_bytes() -> u64 {
    20 << 30
}
fn default_memory_bytes() -> u64 {
    64 << 20
}
fn default_manifest_ttl() -> Duration {
    Duration::from_secs(60)
}
fn default_list_ttl() -> Duration {
    Duration::from_secs(10)
}
fn default_stale_limit() -> Duration {
    Duration::from_secs(3600)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_range_passthrough_bytes() -> u64 {
    8 << 20
}
fn default_max_blob_bytes() -> u64 {
    64 << 30
}

impl UpstreamConfig {
    /// A config for `url` with every other setting at its default.
    pub fn new(url: impl Into<String>) -> Self {
        UpstreamConfig {
            url: url.into(),
            namespace: None,
            username: None,
            password: None,
            plain_http: false,
            cache_dir: None,
            max_bytes: default_max_bytes(),
            memory_bytes: default_memory_bytes(),
            manifest_ttl: default_manifest_ttl(),
            list_ttl: default_list_ttl(),
            stale_limit: default_stale_limit(),
            connect_timeout: default_connect_timeout(),
            request_timeout: default_request_timeout(),
            idle_timeout: default_idle_timeout(),
            range_passthrough_bytes: default_range_passthrough_bytes(),
            max_blob_bytes: default_max_blob_bytes(),
        }
    }

    /// Fills in `cache_dir` as `<storage_root>/cache` when the config left it unset. The
    /// server calls this with its filesystem storage root.
    pub fn with_default_cache_dir(mut self, storage_root: &Path) -> Self {
        if self.cache_dir.is_none() {
            self.cache_dir = Some(storage_root.join("cache"));
        }
        self
    }

    /// The directory the blob cache uses.
    pub fn effective_cache_dir(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("./ferry-data/cache"))
    }
}

impl UpstreamConfig {
    /// This config with the password replaced by [`crate::REDACTED`].
    pub fn redacted(&self) -> UpstreamConfig {
        let mut out = self.clone();
        if out.password.is_some() {
            out.password = Some(crate::REDACTED.to_string());
        }
        out
    }
}

impl fmt::Debug for UpstreamConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("url", &self.url)
            .field("namespace", &self.namespace)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| crate::REDACTED))
            .field("plain_http", &self.plain_http)
            .field("cache_dir", &self.cache_dir)
            .field("max_bytes", &self.max_bytes)
            .field("memory_bytes", &self.memory_bytes)
            .field("manifest_ttl", &self.manifest_ttl)
            .field("list_ttl", &self.list_ttl)
            .field("stale_limit", &self.stale_limit)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("range_passthrough_bytes", &self.range_passthrough_bytes)
            .field("max_blob_bytes", &self.max_blob_bytes)
            .finish()
    }
}

/// Serde for durations as seconds or `"<n><unit>"` strings (serialized as `"<n>ms"` or
/// `"<n>s"`).
mod duration_serde {
    use std::time::Duration;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        if value.subsec_millis() == 0 {
            serializer.serialize_str(&format!("{}s", value.as_secs()))
        } else {
            serializer.serialize_str(&format!("{}ms", value.as_millis()))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        struct DurationVisitor;
        impl Visitor<'_> for DurationVisitor {
            type Value = Duration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("seconds, or a string like \"500ms\", \"30s\", \"5m\", \"1h\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
                Ok(Duration::from_secs(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
                u64::try_from(v)
                    .map(Duration::from_secs)
                    .map_err(|_| E::custom("a duration cannot be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                ferry_oci::units::parse_duration(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(DurationVisitor)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_section_with_units() {
        let cfg: UpstreamConfig = toml::from_str(
            r#"
            url = "https://registry-1.docker.io"
            namespace = "library"
            username = "bot"
            password = "s3cret"
            cache_dir = "/var/cache/ferry"
            max_bytes = 1073741824
            memory_bytes = 1048576
            manifest_ttl = "2m"
            list_ttl = 5
            stale_limit = "1h"
            connect_timeout = "1500ms"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.manifest_ttl, Duration::from_secs(120));
        assert_eq!(cfg.list_ttl, Duration::from_secs(5));
        assert_eq!(cfg.stale_limit, Duration::from_secs(3600));
        assert_eq!(cfg.connect_timeout, Duration::from_millis(1500));
        assert_eq!(cfg.max_bytes, 1 << 30);
        assert_eq!(cfg.effective_cache_dir(), PathBuf::from("/var/cache/ferry"));
        // Round trip through TOML keeps every field.
        let again: UpstreamConfig = toml::from_str(&toml::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(again, cfg);
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let cfg: UpstreamConfig = toml::from_str(r#"url = "http://127.0.0.1:5001""#).unwrap();
        assert_eq!(cfg, UpstreamConfig::new("http://127.0.0.1:5001"));
        assert_eq!(cfg.manifest_ttl, Duration::from_secs(60));
        assert_eq!(cfg.stale_limit, Duration::from_secs(3600));
        let cfg = cfg.with_default_cache_dir(Path::new("/data"));
        assert_eq!(cfg.effective_cache_dir(), PathBuf::from("/data/cache"));
        assert!(toml::from_str::<UpstreamConfig>("url = \"x\"\nmax_byte = 3").is_err());
        assert!(
            toml::from_str::<UpstreamConfig>("url = \"x\"\nmanifest_ttl = \"3 weeks\"").is_err()
        );
        assert!(toml::from_str::<UpstreamConfig>("url = \"x\"\nmanifest_ttl = -1").is_err());
    }

    #[test]
    fn debug_hides_the_password() {
        let mut cfg = UpstreamConfig::new("https://r.example");
        cfg.password = Some("hunter2".into());
        let shown = format!("{cfg:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }
}
