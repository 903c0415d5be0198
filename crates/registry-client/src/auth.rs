//! Registry authentication: `WWW-Authenticate` challenges, the Docker token protocol and
//! the per-(host, scope) token cache every request shares.
//!
//! Tokens are cached so a lazy filesystem reading thousands of ranges asks the token
//! endpoint once, refreshed shortly before they expire (a long pull outlives a 60 s token),
//! and thrown away when the registry answers 401 anyway, so the caller can re-authenticate
//! once and retry. Basic credentials are sent only to a host that asked for them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use parking_lot::Mutex;
use serde::Deserialize;

use super::ClientError;
use super::config::Credentials;

/// One parsed challenge of a `WWW-Authenticate` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Lower-cased scheme (`bearer`, `basic`).
    pub scheme: String,
    /// Parameters with lower-cased names (`realm`, `service`, `scope`, `error`).
    pub params: HashMap<String, String>,
}

impl Challenge {
    fn param(&self, name: &str) -> Option<&str> {
        self.params.get(name).map(String::as_str)
    }
}

/// Parses every challenge of a `WWW-Authenticate` value (RFC 7235: `Scheme k=v, k="v"`,
/// several challenges separated by commas). Quoted strings may hold commas and `\"`.
pub fn parse_challenges(header: &str) -> Vec<Challenge> {
    let chars: Vec<char> = header.chars().collect();
    let mut out: Vec<Challenge> = Vec::new();
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while *i < chars.len() && chars[*i].is_whitespace() {
            *i += 1;
        }
    };
    while i < chars.len() {
        skip_ws(&mut i);
        while i < chars.len() && (chars[i] == ',' || chars[i].is_whitespace()) {
            i += 1;
        }
        let start = i;
        while i < chars.len() && !chars[i].is_whitespace() && chars[i] != '=' && chars[i] != ',' {
            i += 1;
        }
        let token: String = chars[start..i].iter().collect();
        if token.is_empty() {
            if i < chars.len() {
                i += 1; // a stray '='
            }
            continue;
        }
        let mut j = i;
        skip_ws(&mut j);
        if j < chars.len() && chars[j] == '=' {
            // A parameter of the current challenge.
            j += 1;
            skip_ws(&mut j);
            let mut value = String::new();
            if j < chars.len() && chars[j] == '"' {
                j += 1;
                while j < chars.len() && chars[j] != '"' {
                    if chars[j] == '\\' && j + 1 < chars.len() {
                        j += 1;
                    }
                    value.push(chars[j]);
                    j += 1;
                }
                j += 1; // closing quote
            } else {
                while j < chars.len() && chars[j] != ',' && !chars[j].is_whitespace() {
                    value.push(chars[j]);
                    j += 1;
                }
            }
            i = j;
            if let Some(current) = out.last_mut() {
                current.params.insert(token.to_ascii_lowercase(), value);
            }
        } else {
            out.push(Challenge {
                scheme: token.to_ascii_lowercase(),
                params: HashMap::new(),
            });
        }
    }
    out
}

/// What a host asked for the last time it challenged us.
#[derive(Debug, Clone)]
pub(crate) enum HostAuth {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

#[derive(Debug, Clone)]
struct Token {
    value: String,
    refresh_at: Instant,
}

/// Secrets for one host: basic credentials and/or an OAuth2 identity (refresh) token.
#[derive(Clone, Default)]
pub(crate) struct HostSecret {
    pub basic: Option<Credentials>,
    pub identity_token: Option<String>,
    /// The credentials came from a kubelet credential provider plugin: a refusal drops
    /// them and asks the plugin again (once).
    pub from_provider: bool,
}

impl std::fmt::Debug for HostSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSecret")
            .field("basic", &self.basic)
            .field(
                "identity_token",
                &self.identity_token.as_ref().map(|_| "<redacted>"),
            )
            .field("from_provider", &self.from_provider)
            .finish()
    }
}

impl HostSecret {
    pub fn is_anonymous(&self) -> bool {
        self.basic.is_none() && self.identity_token.is_none()
    }
}

/// (host, scope): what a token is good for.
type TokenKey = (String, String);

/// Shared authentication state of a [`super::Client`].
#[derive(Debug, Default)]
pub(crate) struct AuthState {
    hosts: Mutex<HashMap<String, HostAuth>>,
    tokens: Mutex<HashMap<TokenKey, Token>>,
    /// Serializes token fetches per (host, scope) so a burst of requests fetches once.
    fetching: Mutex<HashMap<TokenKey, Arc<tokio::sync::Mutex<()>>>>,
    /// How many tokens were fetched (tests and diagnostics).
    pub fetched: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Deserialize)]
struct TokenResponse {
    token: Option<String>,
    access_token: Option<String>,
    expires_in: Option<u64>,
}

/// Lifetime assumed when the token endpoint does not say (the token spec's default).
const DEFAULT_TOKEN_LIFETIME: Duration = Duration::from_secs(60);
const MAX_TOKEN_RESPONSE: u64 = 1 << 20;

pub(crate) fn basic_header(c: &Credentials) -> String {
    let raw = format!("{}:{}", c.username, c.password);
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    )
}

impl AuthState {
    /// The Authorization header to send to `host` for `scope`, if we already know how
    /// this host authenticates and hold a fresh token (or basic credentials).
    pub fn cached_header(&self, host: &str, scope: &str, secret: &HostSecret) -> Option<String> {
        let how = self.hosts.lock().get(host).cloned()?;
        match how {
            HostAuth::Basic => secret.basic.as_ref().map(basic_header),
            HostAuth::Bearer { .. } => {
                let tokens = self.tokens.lock();
                let t = tokens.get(&(host.to_string(), scope.to_string()))?;
                (Instant::now() < t.refresh_at).then(|| format!("Bearer {}", t.value))
            }
        }
    }

    /// Whether the host is known to want a bearer token.
    #[cfg(test)]
    pub fn known_bearer(&self, host: &str) -> bool {
        matches!(self.hosts.lock().get(host), Some(HostAuth::Bearer { .. }))
    }

    /// Forgets a token the registry refused.
    pub fn invalidate(&self, host: &str, scope: &str) {
        self.tokens
            .lock()
            .remove(&(host.to_string(), scope.to_string()));
    }

    /// Records a challenge from `host`.
    pub fn remember_challenge(&self, host: &str, challenges: &[Challenge]) -> Option<HostAuth> {
        let how = challenges.iter().find_map(|c| match c.scheme.as_str() {
            "bearer" => c.param("realm").map(|realm| HostAuth::Bearer {
                realm: realm.to_string(),
                service: c.param("service").map(str::to_string),
            }),
            _ => None,
        });
        let how = how.or_else(|| {
            challenges
                .iter()
                .any(|c| c.scheme == "basic")
                .then_some(HostAuth::Basic)
        })?;
        self.hosts.lock().insert(host.to_string(), how.clone());
        Some(how)
    }

    /// Gets (fetching if needed) the Authorization header for `host` and `scope` after a
    /// challenge is known. `force` skips the cache (the registry refused the cached one).
    pub async fn authorize(
        &self,
        http: &reqwest::Client,
        host: &str,
        scope: &str,
        secret: &HostSecret,
        force: bool,
    ) -> Result<Option<String>, ClientError> {
        let how = self.hosts.lock().get(host).cloned();
        let (realm, service) = match how {
            None => return Ok(None),
            Some(HostAuth::Basic) => {
                return match &secret.basic {
                    Some(c) => Ok(Some(basic_header(c))),
                    None => Err(unauthorized(
                        host,
                        "the registry wants a username and password",
                    )),
                };
            }
            Some(HostAuth::Bearer { realm, service }) => (realm, service),
        };
        let key = (host.to_string(), scope.to_string());
        let gate = self.fetching.lock().entry(key.clone()).or_default().clone();
        let _held = gate.lock().await;
        if !force && let Some(h) = self.cached_header(host, scope, secret) {
            return Ok(Some(h));
        }
        let token = self
            .fetch_token(http, host, &realm, service.as_deref(), scope, secret)
            .await?;
        let header = format!("Bearer {}", token.value);
        self.tokens.lock().insert(key, token);
        Ok(Some(header))
    }

    async fn fetch_token(
        &self,
        http: &reqwest::Client,
        host: &str,
        realm: &str,
        service: Option<&str>,
        scope: &str,
        secret: &HostSecret,
    ) -> Result<Token, ClientError> {
        let mut url = url::Url::parse(realm).map_err(|e| ClientError::Invalid {
            what: format!("token realm {realm:?} from {host}"),
            reason: e.to_string(),
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ClientError::Invalid {
                what: format!("token realm {realm:?} from {host}"),
                reason: "not an http(s) URL".into(),
            });
        }
        let started = Instant::now();
        let request = if let Some(refresh) = &secret.identity_token {
            let mut form = vec![
                ("grant_type", "refresh_token".to_string()),
                ("refresh_token", refresh.clone()),
                ("client_id", "ferry".to_string()),
                ("scope", scope.to_string()),
            ];
            if let Some(s) = service {
                form.push(("service", s.to_string()));
            }
            let body = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(form.iter().map(|(k, v)| (*k, v.as_str())))
                .finish();
            http.post(url)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(body)
        } else {
            {
                let mut q = url.query_pairs_mut();
                if let Some(s) = service {
                    q.append_pair("service", s);
                }
                if !scope.is_empty() {
                    q.append_pair("scope", scope);
                }
                if let Some(c) = &secret.basic {
                    q.append_pair("account", &c.username);
                }
            }
            let mut req = http.get(url);
            if let Some(c) = &secret.basic {
                req = req.header("authorization", basic_header(c));
            }
            req
        };
        let resp = request.send().await.map_err(|e| ClientError::Transport {
            registry: host.to_string(),
            message: format!("token endpoint {realm}: {}", super::error_chain(&e)),
        })?;
        let status = resp.status();
        if status == 401 || status == 403 {
            let hint = if secret.is_anonymous() {
                "anonymous access was refused"
            } else {
                "the token endpoint refused these credentials"
            };
            return Err(unauthorized(host, hint));
        }
        if !status.is_success() {
            return Err(ClientError::Status {
                registry: host.to_string(),
                method: "GET".into(),
                path: realm.to_string(),
                status: status.as_u16(),
                message: "token endpoint failed".into(),
            });
        }
        let body =
            super::read_body_bounded(resp, MAX_TOKEN_RESPONSE, host, "token response").await?;
        let parsed: TokenResponse =
            serde_json::from_slice(&body).map_err(|e| ClientError::Invalid {
                what: format!("token response from {realm}"),
                reason: e.to_string(),
            })?;
        let value = parsed
            .token
            .filter(|t| !t.is_empty())
            .or(parsed.access_token.filter(|t| !t.is_empty()))
            .ok_or_else(|| ClientError::Invalid {
                what: format!("token response from {realm}"),
                reason: "neither token nor access_token".into(),
            })?;
        if value.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            return Err(ClientError::Invalid {
                what: format!("token response from {realm}"),
                reason: "token has characters not allowed in a header".into(),
            });
        }
        let lifetime = parsed
            .expires_in
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(s.min(86_400)))
            .unwrap_or(DEFAULT_TOKEN_LIFETIME);
        // Refresh ahead of expiry: a fifth of the lifetime, at most 30 s.
        let margin = (lifetime / 5).min(Duration::from_secs(30));
        self.fetched
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Token {
            value,
            refresh_at: started + lifetime - margin,
        })
    }
}

pub(crate) fn unauthorized(host: &str, why: &str) -> ClientError {
    ClientError::Unauthorized {
        registry: host.to_string(),
        message: format!(
            "{why}; log in with `docker login {host}` (or podman login), or pass --creds USER:PASSWORD"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_with_quoted_commas() {
        let h = r#"Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push""#;
        let c = parse_challenges(h);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].scheme, "bearer");
        assert_eq!(c[0].params["realm"], "https://auth.example.com/token");
        assert_eq!(c[0].params["service"], "registry.example.com");
        assert_eq!(c[0].params["scope"], "repository:a/b:pull,push");
    }

    #[test]
    fn parses_several_challenges_and_escapes() {
        let h =
            r#"Basic realm="Registry \"x\"", Bearer realm=https://t/token, error="invalid_token""#;
        let c = parse_challenges(h);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].scheme, "basic");
        assert_eq!(c[0].params["realm"], "Registry \"x\"");
        assert_eq!(c[1].scheme, "bearer");
        assert_eq!(c[1].params["realm"], "https://t/token");
        assert_eq!(c[1].params["error"], "invalid_token");
    }

    #[test]
    fn garbage_does_not_panic() {
        for h in [
            "",
            "=",
            "\"",
            "Bearer realm=\"unterminated",
            ",,,",
            "a=b=c",
            "Bearer =",
        ] {
            let _ = parse_challenges(h);
        }
        assert!(parse_challenges("").is_empty());
    }

    #[test]
    fn bearer_preferred_over_basic() {
        let state = AuthState::default();
        let c = parse_challenges(r#"Basic realm="x", Bearer realm="https://t/token""#);
        assert!(matches!(
            state.remember_challenge("h", &c),
            Some(HostAuth::Bearer { .. })
        ));
        assert!(state.known_bearer("h"));
    }
}
