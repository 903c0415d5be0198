//! The two checks before a peer gets a byte.
//!
//! 1. **Cluster membership**: the caller presents the cluster's shared secret
//!    (`Authorization: Bearer <token>`); it is compared with ours in constant time
//!    (both sides hashed first, so neither length nor content leaks through timing).
//! 2. **Pull rights**: the caller forwards the `Authorization` value it uses with the
//!    origin registry for the repository it names (or none, for anonymous pulls). We ask
//!    the registry whether that credential may read the blob in that repository
//!    ([`PullRights`]: a `HEAD` of the blob), and remember a yes for a short time
//!    ([`PullCache`]). The key holds a hash of the credential, never the credential, and
//!    the digest as well as the repository: a yes for repository A must not let a peer
//!    name A and read a blob of B.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use base64::Engine as _;
use ferry_oci::Digest;
use ferry_registry_client::cache::flight::SingleFlight;
use ferry_registry_client::{Client, Repo};
use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};

/// Shortest accepted cluster token.
pub const MIN_TOKEN_LEN: usize = 16;
/// Most bytes of a token file read.
const MAX_TOKEN_FILE: u64 = 4096;
/// Most cached yeses.
const MAX_CACHED: usize = 16_384;

/// Why the cluster token could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}: the cluster token must be at least {MIN_TOKEN_LEN} bytes of visible ASCII")]
    Invalid(String),
}

/// The cluster's shared secret. Its `Debug` shows nothing of it.
#[derive(Clone)]
pub struct ClusterToken {
    token: String,
    hash: [u8; 32],
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterToken(..)")
    }
}

impl ClusterToken {
    /// The token `text` (surrounding whitespace ignored): at least [`MIN_TOKEN_LEN`]
    /// bytes of visible ASCII, so it fits an HTTP header as is.
    pub fn new(text: &str) -> Result<ClusterToken, TokenError> {
        let token = text.trim();
        if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Invalid("the token".into()));
        }
        Ok(ClusterToken {
            token: token.to_owned(),
            hash: Sha256::digest(token.as_bytes()).into(),
        })
    }

    /// The token in file `path`.
    pub fn load(path: &Path) -> Result<ClusterToken, TokenError> {
        use std::io::Read;
        let read_err = |source| TokenError::Read {
            path: path.display().to_string(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .map_err(read_err)?
            .take(MAX_TOKEN_FILE)
            .read_to_string(&mut text)
            .map_err(read_err)?;
        ClusterToken::new(&text).map_err(|_| TokenError::Invalid(path.display().to_string()))
    }

    /// The `Authorization` value a daemon presents to its peers.
    pub fn header_value(&self) -> String {
        format!("Bearer {}", self.token)
    }

    /// The key gossip datagrams are authenticated with (derived from the token).
    pub fn gossip_key(&self) -> super::gossip::GossipKey {
        super::gossip::GossipKey::from_secret(self.token.as_bytes())
    }

    /// Whether an `Authorization` value carries this token.
    pub fn admits(&self, authorization: Option<&str>) -> bool {
        let Some(presented) = authorization.and_then(|a| a.strip_prefix("Bearer ")) else {
            return false;
        };
        let theirs: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        constant_time_eq(&theirs, &self.hash)
    }
}

/// Equality of two hashes without an early exit.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Why a pull right could not be decided.
#[derive(Debug, Clone, thiserror::Error)]
#[error("asking the registry about a peer's pull right: {0}")]
pub struct PullCheckError(pub String);

/// Whether a credential may pull a blob of a repository: the registry's answer.
#[async_trait]
pub trait PullRights: Send + Sync + fmt::Debug {
    /// `Ok(true)` when `authorization` (an `Authorization` value, `None` for anonymous)
    /// may read `blob` in `repo`.
    async fn may_pull(
        &self,
        repo: &Repo,
        blob: &Digest,
        authorization: Option<&str>,
    ) -> Result<bool, PullCheckError>;
}

/// [`PullRights`] through the registry client: a `HEAD` of the blob at the registry
/// itself with the forwarded credential.
#[derive(Debug, Clone)]
pub struct RegistryPullRights {
    pub client: Client,
}

#[async_trait]
impl PullRights for RegistryPullRights {
    async fn may_pull(
        &self,
        repo: &Repo,
        blob: &Digest,
        authorization: Option<&str>,
    ) -> Result<bool, PullCheckError> {
        self.client
            .may_pull_with(repo, blob.as_ref(), authorization)
            .await
            .map_err(|e| PullCheckError(e.to_string()))
    }
}

/// What a cached yes is for: hash of the credential, registry, repository, blob.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PullKey {
    credential: [u8; 32],
    registry: String,
    repository: String,
    blob: Digest,
}

impl PullKey {
    /// The key of a check. Anonymous and credentialed callers never share a key (the
    /// hash covers a marker of which it is).
    pub fn new(repo: &Repo, blob: &Digest, authorization: Option<&str>) -> PullKey {
        let mut h = Sha256::new();
        match authorization {
            Some(a) => {
                h.update(b"credential\0");
                h.update(a.as_bytes());
            }
            None => h.update(b"anonymous\0"),
        }
        PullKey {
            credential: h.finalize().into(),
            registry: repo.registry.clone(),
            repository: repo.repository.as_str().to_owned(),
            blob: blob.clone(),
        }
    }
}

/// Recent yeses, each until its own expiry; bounded. Times are passed in, so tests
/// need no clock.
#[derive(Debug, Default)]
pub struct PullCache {
    yes: Mutex<HashMap<PullKey, Instant>>,
}

impl PullCache {
    /// Whether `key` had a yes that is still good at `now`.
    pub fn allowed(&self, key: &PullKey, now: Instant) -> bool {
        self.yes.lock().get(key).is_some_and(|until| now < *until)
    }

    /// Remembers a yes for `key` until `until`.
    pub fn remember(&self, key: PullKey, now: Instant, until: Instant) {
        let mut yes = self.yes.lock();
        if yes.len() >= MAX_CACHED {
            yes.retain(|_, u| now < *u);
            if yes.len() >= MAX_CACHED {
                // Still full of live entries: start over rather than grow; the cost is
                // one more registry HEAD per caller.
                yes.clear();
            }
        }
        yes.insert(key, until);
    }

    /// How many entries are held.
    pub fn len(&self) -> usize {
        self.yes.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// When a bearer credential says it expires (a JWT's `exp`), read without checking its
/// signature: it only ever shortens how long a yes is cached, never extends it.
pub fn credential_expiry(authorization: &str) -> Option<SystemTime> {
    let token = authorization.strip_prefix("Bearer ")?;
    let payload = token.split('.').nth(1)?;
    if payload.len() > 8192 {
        return None;
    }
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    #[derive(serde::Deserialize)]
    struct Claims {
        exp: Option<u64>,
    }
    let claims: Claims = serde_json::from_slice(&raw).ok()?;
    // A stranger's number: `UNIX_EPOCH + secs` panics past the clock's range.
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(claims.exp?))
}

/// The registry's answers about pull rights, cached; concurrent identical checks share
/// one registry request.
#[derive(Debug)]
pub struct PullGate {
    rights: Arc<dyn PullRights>,
    cache: PullCache,
    ttl: Duration,
    flights: SingleFlight<PullKey, Result<bool, PullCheckError>>,
}

impl PullGate {
    /// A gate asking `rights`, caching a yes for at most `ttl`.
    pub fn new(rights: Arc<dyn PullRights>, ttl: Duration) -> PullGate {
        PullGate {
            rights,
            cache: PullCache::default(),
            ttl: ttl.min(crate::config::MAX_PULL_CHECK_TTL),
            flights: SingleFlight::new(),
        }
    }

    /// Whether `authorization` may read `blob` in `repo`.
    pub async fn check(
        &self,
        repo: &Repo,
        blob: &Digest,
        authorization: Option<&str>,
    ) -> Result<bool, PullCheckError> {
        let key = PullKey::new(repo, blob, authorization);
        if self.cache.allowed(&key, Instant::now()) {
            return Ok(true);
        }
        let rights = self.rights.clone();
        let (repo_c, blob_c) = (repo.clone(), blob.clone());
        let auth_c = authorization.map(str::to_owned);
        let answer = self
            .flights
            .run(key.clone(), move || async move {
                rights.may_pull(&repo_c, &blob_c, auth_c.as_deref()).await
            })
            .await
            .map_err(|e| PullCheckError(e.to_string()))??;
        if answer && !self.ttl.is_zero() {
            let now = Instant::now();
            let mut ttl = self.ttl;
            if let Some(exp) = authorization.and_then(credential_expiry) {
                ttl = ttl.min(exp.duration_since(SystemTime::now()).unwrap_or_default());
            }
            self.cache.remember(key, now, now + ttl);
        }
        Ok(answer)
    }

    /// The cache (tests, diagnostics).
    pub fn cache(&self) -> &PullCache {
        &self.cache
    }
}
