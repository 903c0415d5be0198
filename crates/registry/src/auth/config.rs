//! The `[auth]` TOML section. Kept separate from the authenticator so the server's config
//! can embed it with serde and validate it before anything is opened.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

/// Default lifetime of an issued access token.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(300);
/// Default lifetime of an offline (refresh) token.
pub const DEFAULT_REFRESH_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default `service` (JWT audience) name.
pub const DEFAULT_SERVICE: &str = "ferry-registry";

/// `[auth]`: who may do what. The default (no section) turns authentication off.
///
/// Auth is on when `enabled = true`, or when `enabled` is absent and an `htpasswd` file is
/// configured. `Debug` hides the inline `secret`; [`AuthConfig::redacted`] for printing.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Explicit switch; absent = on iff `htpasswd` is set.
    pub enabled: Option<bool>,
    /// htpasswd file with bcrypt entries (`user:$2y$…`). Re-read when it changes.
    pub htpasswd: Option<PathBuf>,
    /// Token endpoint URL named in Bearer challenges (and realm of Basic challenges).
    /// Absent: `http(s)://<request Host>/token`.
    pub realm: Option<String>,
    /// Service name: the `service` challenge parameter and the tokens' audience.
    pub service: String,
    /// Token issuer (`iss`). Absent: the service name.
    pub issuer: Option<String>,
    /// HS256 signing secret given inline.
    pub secret: Option<String>,
    /// HS256 signing secret file; generated (32 random bytes, hex, mode 0600) if absent,
    /// so replicas can share it.
    pub secret_file: Option<PathBuf>,
    /// PEM private key (EC P-256 → ES256, RSA → RS256) for interoperable tokens.
    pub private_key: Option<PathBuf>,
    /// PEM public key matching `private_key` (used to verify).
    pub public_key: Option<PathBuf>,
    /// Access token lifetime: seconds, or a string like "300s", "5m", "1h".
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub token_ttl: Duration,
    /// Offline (refresh) token lifetime.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub refresh_ttl: Duration,
    /// Anonymous clients may pull every repository (an implicit last rule).
    pub anonymous_pull: bool,
    /// Challenge style.
    pub mode: AuthMode,
    /// Who may list the catalog: user names, "*" (any authenticated), "anonymous".
    pub catalog: Vec<String>,
    /// Per-repository rules, first match wins.
    pub rules: Vec<AccessRule>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            enabled: None,
            htpasswd: None,
            realm: None,
            service: DEFAULT_SERVICE.to_string(),
            issuer: None,
            secret: None,
            secret_file: None,
            private_key: None,
            public_key: None,
            token_ttl: DEFAULT_TOKEN_TTL,
            refresh_ttl: DEFAULT_REFRESH_TTL,
            anonymous_pull: false,
            mode: AuthMode::Token,
            catalog: vec!["*".to_string()],
            rules: Vec::new(),
        }
    }
}

impl AuthConfig {
    /// Whether this configuration asks for authentication at all.
    pub fn is_enabled(&self) -> bool {
        self.enabled.unwrap_or(self.htpasswd.is_some())
    }
}

/// How clients are challenged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// Docker token protocol: `Bearer` challenges naming the token endpoint. Basic
    /// credentials are still accepted directly on API requests for simple clients.
    #[default]
    Token,
    /// `Basic` challenges only.
    Basic,
}

impl AuthConfig {
    /// This config with the inline signing secret replaced by [`crate::REDACTED`].
    pub fn redacted(&self) -> AuthConfig {
        let mut out = self.clone();
        if out.secret.is_some() {
            out.secret = Some(crate::REDACTED.to_string());
        }
        out
    }
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("AuthConfig")
            .field("enabled", &r.enabled)
            .field("htpasswd", &r.htpasswd)
            .field("realm", &r.realm)
            .field("service", &r.service)
            .field("issuer", &r.issuer)
            .field("secret", &r.secret)
            .field("secret_file", &r.secret_file)
            .field("private_key", &r.private_key)
            .field("public_key", &r.public_key)
            .field("token_ttl", &r.token_ttl)
            .field("refresh_ttl", &r.refresh_ttl)
            .field("anonymous_pull", &r.anonymous_pull)
            .field("mode", &r.mode)
            .field("catalog", &r.catalog)
            .field("rules", &r.rules)
            .finish()
    }
}

/// One `[[auth.rules]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessRule {
    /// Repository glob: `*` matches within one path segment, `**` any number of segments.
    pub repository: String,
    /// User names; "*" = any authenticated user; "anonymous" = unauthenticated clients.
    pub users: Vec<String>,
    /// "pull", "push", "delete" or "*".
    pub actions: Vec<String>,
}

fn de_duration<'de, D: Deserializer<'de>>(de: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Seconds(u64),
        Text(String),
    }
    match Raw::deserialize(de)? {
        Raw::Seconds(s) => Ok(Duration::from_secs(s)),
        Raw::Text(t) => ferry_oci::units::parse_duration(&t).map_err(serde::de::Error::custom),
    }
}

fn ser_duration<S: serde::Serializer>(d: &Duration, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_u64(d.as_secs())
}
