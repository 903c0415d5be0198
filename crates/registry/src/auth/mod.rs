//! Registry authentication and authorization: the Docker token protocol (Bearer
//! challenges, a token endpoint issuing signed JWTs with per-repository scopes), htpasswd
//! bcrypt users, per-repository access rules and optional anonymous pull.
//!
//! Every API request goes through [`Authenticator::check`], so its hot path is built to
//! cost almost nothing: verified tokens and verified Basic credentials are cached (by the
//! SHA-256 of the exact credential, successes only), and the htpasswd file is stat'ed at
//! most once per second.

pub mod cache;
pub mod challenge;
pub mod config;
mod endpoint;
pub mod htpasswd;
pub mod rules;
pub mod scope;
pub mod throttle;
pub mod token;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use base64::Engine as _;
use http::HeaderMap;

use cache::{ExpiringCache, credential_key};
use challenge::{BearerError, basic_challenge, bearer_challenge};
use htpasswd::UserFile;
use rules::Rules;
use scope::RequestedScope;
use throttle::LoginThrottle;
use token::{Grant, ResourceActions, TokenSigner, unix_now};

pub use challenge::{Denied, DeniedKind};
pub use config::{AccessRule, AuthConfig, AuthMode};
pub use endpoint::token_router;
pub use htpasswd::{HtpasswdError, hash_password, htpasswd_line, set_user};
pub use scope::{Actions, Scope};
pub use throttle::ClientAddr;

/// How many verified tokens are remembered.
const TOKEN_CACHE_ENTRIES: usize = 65_536;
/// How many verified Basic credentials are remembered.
const BASIC_CACHE_ENTRIES: usize = 16_384;
/// How long a verified Basic credential is trusted without re-running bcrypt (a changed
/// htpasswd file invalidates sooner).
const BASIC_CACHE_TTL_SECS: u64 = 300;
/// Largest Authorization header value looked at.
const MAX_AUTHORIZATION_LEN: usize = 16 << 10;

/// Who was let in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// The authenticated user; `None` for anonymous access.
    pub subject: Option<String>,
}

/// Configuration or key material problems found when building an [`Authenticator`].
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("auth config: {0}")]
    Config(String),
    #[error(transparent)]
    Htpasswd(#[from] HtpasswdError),
}

/// Decides whether a request may do what it asks. Share it as `Arc<Authenticator>`.
#[derive(Debug)]
pub struct Authenticator {
    inner: Option<Box<Enabled>>,
    tls: bool,
}

#[derive(Debug)]
struct Enabled {
    mode: AuthMode,
    realm: Option<String>,
    service: String,
    users: Option<UserFile>,
    rules: Rules,
    signer: TokenSigner,
    token_ttl: u64,
    refresh_ttl: u64,
    token_cache: ExpiringCache<Arc<Grant>>,
    /// user and the htpasswd generation it was verified against.
    basic_cache: ExpiringCache<(Arc<str>, u64)>,
    bcrypt_runs: AtomicU64,
    failed_logins: LoginThrottle,
}

/// A user whose password was verified.
#[derive(Debug, Clone)]
pub(crate) struct VerifiedUser {
    pub name: Arc<str>,
}

/// Why a user name and password were not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoginRefused {
    /// Unknown user or wrong password.
    Wrong,
    /// Too many recent failures from this client or for this user; not checked.
    Throttled,
}

impl Authenticator {
    /// Build from config. With auth disabled nothing is opened or created.
    pub fn new(cfg: &AuthConfig) -> Result<Self, AuthError> {
        if !cfg.is_enabled() {
            return Ok(Authenticator {
                inner: None,
                tls: false,
            });
        }
        if cfg.service.is_empty() {
            return Err(AuthError::Config("`service` must not be empty".to_string()));
        }
        if cfg.token_ttl.as_secs() == 0 {
            return Err(AuthError::Config(
                "`token_ttl` must be at least one second".to_string(),
            ));
        }
        if let Some(realm) = &cfg.realm
            && (realm.is_empty() || realm.chars().any(|c| c.is_control() || c == '"'))
        {
            return Err(AuthError::Config(format!("invalid realm {realm:?}")));
        }
        let users = cfg.htpasswd.as_deref().map(UserFile::open).transpose()?;
        let rules = Rules::new(cfg)?;
        let signer = TokenSigner::from_config(cfg)?;
        Ok(Authenticator {
            inner: Some(Box::new(Enabled {
                mode: cfg.mode,
                realm: cfg.realm.clone(),
                service: cfg.service.clone(),
                users,
                rules,
                signer,
                token_ttl: cfg.token_ttl.as_secs(),
                refresh_ttl: cfg.refresh_ttl.as_secs().max(1),
                token_cache: ExpiringCache::new(TOKEN_CACHE_ENTRIES),
                basic_cache: ExpiringCache::new(BASIC_CACHE_ENTRIES),
                bcrypt_runs: AtomicU64::new(0),
                failed_logins: LoginThrottle::new(),
            })),
            tls: false,
        })
    }

    /// An authenticator that lets everything through.
    pub fn disabled() -> Self {
        Authenticator {
            inner: None,
            tls: false,
        }
    }

    /// Whether the server speaks TLS itself (the derived default realm is then `https`).
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Check a request's `Authorization` header for `scope`.
    ///
    /// The default realm is derived from the `Host` header; HTTP/2 requests carry the
    /// authority in the URI instead, so prefer [`Authenticator::check_request`] where the
    /// URI is at hand.
    pub fn check(&self, headers: &HeaderMap, scope: &Scope) -> Result<Access, Denied> {
        self.check_request(None, headers, scope)
    }

    /// [`Authenticator::check`], also using the request URI's authority (HTTP/2) when
    /// deriving the realm for a challenge.
    pub fn check_request(
        &self,
        uri: Option<&http::Uri>,
        headers: &HeaderMap,
        scope: &Scope,
    ) -> Result<Access, Denied> {
        self.check_request_from(None, uri, headers, scope)
    }

    /// [`Authenticator::check_request`] for a request from `client`, whose failed logins
    /// are throttled per address.
    pub fn check_request_from(
        &self,
        client: Option<IpAddr>,
        uri: Option<&http::Uri>,
        headers: &HeaderMap,
        scope: &Scope,
    ) -> Result<Access, Denied> {
        let Some(auth) = &self.inner else {
            return Ok(Access { subject: None });
        };
        let challenge = |error: BearerError| self.challenge(uri, headers, scope, error);
        let authorization = headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        match authorization.and_then(parse_authorization) {
            Some(Credential::Bearer(token)) => {
                let Some(grant) = self.verify_token(auth, token) else {
                    return Err(Denied::unauthorized(
                        challenge(BearerError::InvalidToken),
                        scope,
                        "invalid or expired token",
                    ));
                };
                if grant.covers(scope) {
                    return Ok(Access {
                        subject: grant.subject.clone(),
                    });
                }
                let subject = grant.subject.as_deref();
                if subject.is_some() && !self.rules_allow(auth, subject, scope) {
                    return Err(Denied::forbidden(
                        scope,
                        "requested access to the resource is denied",
                    ));
                }
                Err(Denied::unauthorized(
                    challenge(BearerError::InsufficientScope),
                    scope,
                    "token does not grant the requested access",
                ))
            }
            Some(Credential::Basic(value)) => match self.authenticate_basic(auth, client, value) {
                Ok(user) => {
                    if scope.is_base() || self.rules_allow(auth, Some(&user.name), scope) {
                        Ok(Access {
                            subject: Some(user.name.to_string()),
                        })
                    } else {
                        Err(Denied::forbidden(
                            scope,
                            "requested access to the resource is denied",
                        ))
                    }
                }
                Err(LoginRefused::Wrong) => Err(Denied::unauthorized(
                    challenge(BearerError::None),
                    scope,
                    "invalid username or password",
                )),
                Err(LoginRefused::Throttled) => Err(Denied::throttled(
                    scope,
                    "too many failed logins; retry later",
                )),
            },
            None if authorization.is_some() => Err(Denied::unauthorized(
                challenge(BearerError::None),
                scope,
                "unsupported or malformed Authorization header",
            )),
            None => {
                if !scope.is_base() && self.rules_allow(auth, None, scope) {
                    Ok(Access { subject: None })
                } else {
                    Err(Denied::unauthorized(
                        challenge(BearerError::None),
                        scope,
                        "authentication required",
                    ))
                }
            }
        }
    }

    /// What `subject` (None = anonymous) may do on `repository` under the rules (for
    /// filtering the catalog, for example). Everything when auth is disabled.
    pub fn allowed_actions(&self, subject: Option<&str>, repository: &str) -> Actions {
        match &self.inner {
            None => Actions::ALL,
            Some(auth) => auth.rules.allowed(subject, repository),
        }
    }

    /// Number of bcrypt verifications run so far (cache misses), for metrics and tests.
    pub fn bcrypt_verifications(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(0, |auth| auth.bcrypt_runs.load(Ordering::Relaxed))
    }

    fn rules_allow(&self, auth: &Enabled, subject: Option<&str>, scope: &Scope) -> bool {
        match &scope.repository {
            Some(repository) => auth
                .rules
                .allowed(subject, repository)
                .covers(scope.actions),
            None if scope.is_base() => subject.is_some(),
            None => auth.rules.catalog_allowed(subject),
        }
    }

    fn verify_token(&self, auth: &Enabled, token: &str) -> Option<Arc<Grant>> {
        let now = unix_now();
        let key = credential_key(token.as_bytes());
        if let Some(grant) = auth.token_cache.get(&key, now) {
            return Some(grant);
        }
        match auth.signer.verify_access(token) {
            Ok(grant) => {
                let grant = Arc::new(grant);
                auth.token_cache
                    .insert(key, grant.clone(), grant.expires, now);
                Some(grant)
            }
            Err(e) => {
                tracing::debug!(error = %e, "bearer token refused");
                None
            }
        }
    }

    /// Verify `Basic` credentials (the base64 part), through the cache.
    fn authenticate_basic(
        &self,
        auth: &Enabled,
        client: Option<IpAddr>,
        encoded: &str,
    ) -> Result<VerifiedUser, LoginRefused> {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|_| LoginRefused::Wrong)?;
        let decoded = String::from_utf8(decoded).map_err(|_| LoginRefused::Wrong)?;
        let (user, password) = decoded.split_once(':').ok_or(LoginRefused::Wrong)?;
        self.authenticate_password(auth, client, user, password)
    }

    /// Verify a user name and password, through the cache; bcrypt runs off the async
    /// worker's hot loop (`block_in_place`) when called inside a multi-thread runtime, and
    /// only while `client` and `user` are within their failed-login budget.
    fn authenticate_password(
        &self,
        auth: &Enabled,
        client: Option<IpAddr>,
        user: &str,
        password: &str,
    ) -> Result<VerifiedUser, LoginRefused> {
        let users_file = auth.users.as_ref().ok_or(LoginRefused::Wrong)?;
        let (users, generation) = users_file.current();
        let mut material = Vec::with_capacity(user.len() + password.len() + 1);
        material.extend_from_slice(user.as_bytes());
        material.push(b':');
        material.extend_from_slice(password.as_bytes());
        let key = credential_key(&material);
        let now = unix_now();
        if let Some((name, cached_generation)) = auth.basic_cache.get(&key, now)
            && cached_generation == generation
        {
            return Ok(VerifiedUser { name });
        }
        if !auth.failed_logins.try_begin(client, user, Instant::now()) {
            return Err(LoginRefused::Throttled);
        }
        auth.bcrypt_runs.fetch_add(1, Ordering::Relaxed);
        let matched = match users.hash_of(user) {
            Some(hash) => run_blocking(|| bcrypt::verify(password, hash).unwrap_or(false)),
            None => {
                // Same work for unknown users (at the file's highest cost), so timing
                // does not reveal who exists.
                let dummy = dummy_hash(users.max_cost().unwrap_or(htpasswd::DEFAULT_BCRYPT_COST));
                run_blocking(|| bcrypt::verify(password, &dummy).unwrap_or(false));
                false
            }
        };
        if !matched {
            return Err(LoginRefused::Wrong);
        }
        auth.failed_logins.succeeded(client, user, Instant::now());
        let name: Arc<str> = Arc::from(user);
        auth.basic_cache.insert(
            key,
            (name.clone(), generation),
            now + BASIC_CACHE_TTL_SECS,
            now,
        );
        Ok(VerifiedUser { name })
    }

    /// The `WWW-Authenticate` value for a refusal of `scope`.
    fn challenge(
        &self,
        uri: Option<&http::Uri>,
        headers: &HeaderMap,
        scope: &Scope,
        error: BearerError,
    ) -> String {
        let Some(auth) = &self.inner else {
            return String::new();
        };
        match auth.mode {
            AuthMode::Token => {
                bearer_challenge(&self.realm(uri, headers), &auth.service, scope, error)
            }
            AuthMode::Basic => basic_challenge(auth.realm.as_deref().unwrap_or(&auth.service)),
        }
    }

    /// The token endpoint URL: configured, or `<scheme>://<host>/token` from the request.
    fn realm(&self, uri: Option<&http::Uri>, headers: &HeaderMap) -> String {
        if let Some(realm) = self.inner.as_ref().and_then(|a| a.realm.clone()) {
            return realm;
        }
        let host = headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| uri.and_then(|u| u.authority()).map(|a| a.as_str()))
            .filter(|h| valid_host(h))
            .unwrap_or("localhost");
        let forwarded_https = headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"));
        let scheme = if self.tls || forwarded_https {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{host}/token")
    }

    // ---- used by the token endpoint ----

    fn enabled_inner(&self) -> Option<&Enabled> {
        self.inner.as_deref()
    }

    /// Grant for a token request: requested ∩ allowed, per scope (empty grants included).
    fn grant(
        &self,
        auth: &Enabled,
        subject: Option<&str>,
        requested: &[RequestedScope],
    ) -> Vec<ResourceActions> {
        let mut out: Vec<ResourceActions> = Vec::with_capacity(requested.len());
        for scope in requested {
            match scope {
                RequestedScope::Repository { name, actions } => {
                    let granted = actions.intersect(auth.rules.allowed(subject, name));
                    // Merge repeated scopes for one repository.
                    if let Some(entry) = out
                        .iter_mut()
                        .find(|e| e.kind == "repository" && &e.name == name)
                    {
                        let merged = Actions::parse_list(&entry.actions.join(",")).union(granted);
                        entry.actions = merged.names().into_iter().map(String::from).collect();
                    } else {
                        out.push(ResourceActions {
                            kind: "repository".to_string(),
                            name: name.clone(),
                            actions: granted.names().into_iter().map(String::from).collect(),
                        });
                    }
                }
                RequestedScope::Catalog => {
                    if !out.iter().any(|e| e.kind == "registry") {
                        let actions = if auth.rules.catalog_allowed(subject) {
                            vec!["*".to_string()]
                        } else {
                            Vec::new()
                        };
                        out.push(ResourceActions {
                            kind: "registry".to_string(),
                            name: "catalog".to_string(),
                            actions,
                        });
                    }
                }
                RequestedScope::Other => {}
            }
        }
        out
    }
}

pub(crate) enum Credential<'a> {
    Bearer(&'a str),
    Basic(&'a str),
}

pub(crate) fn parse_authorization(value: &[u8]) -> Option<Credential<'_>> {
    if value.len() > MAX_AUTHORIZATION_LEN {
        return None;
    }
    let text = std::str::from_utf8(value).ok()?.trim();
    let (scheme, rest) = text.split_once(' ')?;
    let rest = rest.trim();
    if rest.is_empty() {
        return None;
    }
    if scheme.eq_ignore_ascii_case("bearer") {
        Some(Credential::Bearer(rest))
    } else if scheme.eq_ignore_ascii_case("basic") {
        Some(Credential::Basic(rest))
    } else {
        None
    }
}

/// A Host value safe to echo into a challenge.
fn valid_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 255
        && host.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']' | b'_')
        })
}

/// Run CPU-heavy work without stalling the async worker's other tasks.
fn run_blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// A bcrypt hash of `cost` nobody's password matches, verified for unknown users. One
/// per cost in use (at most 28), made once.
fn dummy_hash(cost: u32) -> Arc<str> {
    static DUMMIES: parking_lot::Mutex<Vec<(u32, Arc<str>)>> = parking_lot::Mutex::new(Vec::new());
    let cost = cost.clamp(4, 31);
    let mut dummies = DUMMIES.lock();
    if let Some((_, h)) = dummies.iter().find(|(c, _)| *c == cost) {
        return h.clone();
    }
    let hash: Arc<str> = hash_password("ferry-no-such-user", cost)
        .unwrap_or_else(|_| {
            "$2y$10$invalidinvalidinvalidinvalidinvalidinvalidinvalidinvali".to_string()
        })
        .into();
    dummies.push((cost, hash.clone()));
    hash
}

#[cfg(test)]
mod tests;
