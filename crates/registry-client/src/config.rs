//! Client configuration (serde, TOML-friendly): defaults plus a table per registry.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Username and password (or token) for one registry.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Settings of one registry (`[registry."host:port"]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// Pull mirrors, tried in order before the registry itself.
    pub mirrors: Vec<String>,
    /// Speak plain HTTP to this registry.
    pub plain_http: bool,
    /// Accept any TLS certificate (testing only).
    pub skip_tls_verify: bool,
    /// Explicit credentials (take precedence over docker/podman auth files).
    pub credentials: Option<Credentials>,
}

/// Client configuration (`[client]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// TCP+TLS connect timeout.
    #[serde(with = "secs")]
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of a response.
    #[serde(with = "secs")]
    pub idle_timeout: Duration,
    /// Attempts per request (1 = no retry).
    pub max_attempts: u32,
    /// First retry delay; doubles each attempt, with jitter.
    #[serde(with = "millis")]
    pub base_backoff: Duration,
    /// Concurrent range requests / blob copies per image.
    pub max_concurrent_downloads: usize,
    /// Bytes per range request in parallel downloads and per PATCH in chunked pushes.
    pub chunk_size: u64,
    /// Blobs larger than this are pushed in chunked PATCHes of `chunk_size` (for
    /// registries or proxies that limit request bodies); smaller ones in one PUT.
    pub monolithic_push_limit: u64,
    /// Look credentials up in docker's and podman's auth files.
    pub use_auth_files: bool,
    /// containerd's registry host directory (`hosts.toml` per registry; see
    /// [`crate::hosts`]). `None` or empty: not read. Where a host directory applies to a
    /// registry, its hosts replace `mirrors` for that registry; `plain_http`,
    /// `skip_tls_verify` and `credentials` still apply where hosts.toml leaves them unsaid
    /// (credentials always come from here or the auth files, never from hosts.toml).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_path: Option<std::path::PathBuf>,
    /// The kubelet's credential provider config (`CredentialProviderConfig`, as given to
    /// its `--image-credential-provider-config`; see [`crate::credprovider`]). `None`:
    /// no plugins. Plugins are asked only when neither `credentials` nor the auth files
    /// have credentials for a repository.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_provider_config: Option<std::path::PathBuf>,
    /// Where the plugins named in `credential_provider_config` are (the kubelet's
    /// `--image-credential-provider-bin-dir`); required with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_provider_bin_dir: Option<std::path::PathBuf>,
    /// Per-registry settings, keyed by `host[:port]`.
    pub registry: BTreeMap<String, RegistryConfig>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_attempts: 4,
            base_backoff: Duration::from_millis(200),
            max_concurrent_downloads: 10,
            chunk_size: 16 << 20,
            monolithic_push_limit: 1 << 30,
            use_auth_files: true,
            config_path: None,
            credential_provider_config: None,
            credential_provider_bin_dir: None,
            registry: BTreeMap::new(),
        }
    }
}

mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn toml_with_registry_tables() {
        let cfg: ClientConfig = toml::from_str(
            r#"
            connect_timeout = 2.5
            max_attempts = 6
            base_backoff = 50
            chunk_size = 8388608
            [registry."docker.io"]
            mirrors = ["https://mirror.example.com", "http://10.0.0.5:5000"]
            [registry."127.0.0.1:5000"]
            plain_http = true
            credentials = { username = "u", password = "p" }
            "#,
        )
        .unwrap();
        assert_eq!(cfg.connect_timeout, Duration::from_millis(2500));
        assert_eq!(cfg.base_backoff, Duration::from_millis(50));
        assert_eq!(cfg.max_attempts, 6);
        assert_eq!(cfg.chunk_size, 8 << 20);
        assert_eq!(cfg.max_concurrent_downloads, 10, "defaults fill the rest");
        assert_eq!(cfg.registry["docker.io"].mirrors.len(), 2);
        let local = &cfg.registry["127.0.0.1:5000"];
        assert!(local.plain_http);
        assert_eq!(local.credentials.as_ref().unwrap().username, "u");
        let again: ClientConfig = toml::from_str(&toml::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(again, cfg);
        assert!(toml::from_str::<ClientConfig>("bogus = 1").is_err());
        assert!(!format!("{:?}", local.credentials).contains("\"p\""));
    }
}
