//! Credentials handed to a pull by its caller (the kubelet's image pull secrets, sent in
//! a CRI `PullImage`), kept in memory for the pulls' lazy reads that follow.
//!
//! Each credential is scoped to the registry and repository of the image it came with:
//! a pull of `host/team/app` lends its credentials to later reads of `host/team/app`
//! only, never to another repository of the same host. The store is bounded (the oldest
//! scope goes first), never written anywhere, and its `Debug` prints no secret. A later
//! pull of the same repository replaces the credentials (a rotated pull secret wins),
//! so a long-running container reading a cold file hours later uses the newest ones;
//! bearer tokens are exchanged from them by the client as usual, again on expiry.

use std::collections::HashMap;

use base64::Engine as _;
use parking_lot::Mutex;

use crate::config::Credentials;

/// Most scopes kept; a node pulls far fewer distinct repositories.
pub const MAX_SCOPES: usize = 4096;

/// What a caller may hand over for one pull (the fields of CRI's `AuthConfig`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PullSecret {
    pub username: String,
    pub password: String,
    /// `base64(username:password)`, as docker config files keep it.
    pub auth: String,
    /// An OAuth2 refresh token (`identitytoken`).
    pub identity_token: String,
    /// A bearer token for the registry itself.
    pub registry_token: String,
}

impl std::fmt::Debug for PullSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullSecret")
            .field("username", &self.username)
            .field("password", &redacted(&self.password))
            .field("auth", &redacted(&self.auth))
            .field("identity_token", &redacted(&self.identity_token))
            .field("registry_token", &redacted(&self.registry_token))
            .finish()
    }
}

fn redacted(s: &str) -> &'static str {
    if s.is_empty() { "" } else { "<redacted>" }
}

/// A [`PullSecret`] in the form the client uses: basic credentials and/or an identity
/// token. `None` when it carries nothing usable.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Usable {
    pub basic: Option<Credentials>,
    pub identity_token: Option<String>,
}

impl PullSecret {
    /// True when it carries no credential at all (an anonymous pull).
    pub fn is_empty(&self) -> bool {
        self.username.is_empty()
            && self.password.is_empty()
            && self.auth.is_empty()
            && self.identity_token.is_empty()
            && self.registry_token.is_empty()
    }

    /// Basic credentials from `username`/`password`, else from `auth`; the identity
    /// token as it is. A registry token alone is not usable: the client exchanges
    /// tokens itself, per scope, and a caller's bearer token may be for another scope.
    pub(crate) fn usable(&self) -> Option<Usable> {
        let basic = if !self.username.is_empty() || !self.password.is_empty() {
            Some(Credentials {
                username: self.username.clone(),
                password: self.password.clone(),
            })
        } else if !self.auth.is_empty() {
            decode_auth(&self.auth)
        } else {
            None
        };
        let identity_token = Some(self.identity_token.clone()).filter(|t| !t.is_empty());
        (basic.is_some() || identity_token.is_some()).then_some(Usable {
            basic,
            identity_token,
        })
    }
}

/// `base64(user:password)` → credentials; `None` for anything else.
fn decode_auth(auth: &str) -> Option<Credentials> {
    if auth.len() > 64 << 10 {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (user, pass) = text.split_once(':')?;
    Some(Credentials {
        username: user.to_owned(),
        password: pass.to_owned(),
    })
}

/// The store: (registry, repository) → the latest credentials a pull brought.
#[derive(Default)]
pub struct PullSecrets {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    map: HashMap<(String, String), (u64, Usable)>,
    /// Insertion counter: the smallest goes first when the store is full.
    seq: u64,
}

impl std::fmt::Debug for PullSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullSecrets")
            .field("scopes", &self.len())
            .finish()
    }
}

impl PullSecrets {
    pub fn new() -> PullSecrets {
        PullSecrets::default()
    }

    /// Keeps `secret` for reads of `registry`/`repository` (a registry as references
    /// name it: `host[:port]`, `docker.io` for Docker Hub). An empty or unusable secret
    /// forgets what the scope had: the caller pulled anonymously this time. False when
    /// nothing usable was kept.
    pub fn remember(&self, registry: &str, repository: &str, secret: &PullSecret) -> bool {
        let key = (registry.to_owned(), repository.to_owned());
        let mut inner = self.inner.lock();
        let Some(usable) = secret.usable() else {
            inner.map.remove(&key);
            return false;
        };
        inner.seq += 1;
        let seq = inner.seq;
        inner.map.insert(key, (seq, usable));
        if inner.map.len() > MAX_SCOPES {
            let oldest = inner
                .map
                .iter()
                .min_by_key(|(_, (s, _))| *s)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                inner.map.remove(&k);
            }
        }
        true
    }

    /// The credentials kept for exactly this registry and repository.
    pub(crate) fn get(&self, registry: &str, repository: &str) -> Option<Usable> {
        let inner = self.inner.lock();
        inner
            .map
            .get(&(registry.to_owned(), repository.to_owned()))
            .map(|(_, u)| u.clone())
    }

    /// True when a scope is kept for this registry and repository.
    pub fn has(&self, registry: &str, repository: &str) -> bool {
        self.get(registry, repository).is_some()
    }

    /// Scopes kept.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn basic(user: &str, pass: &str) -> PullSecret {
        PullSecret {
            username: user.into(),
            password: pass.into(),
            ..PullSecret::default()
        }
    }

    #[test]
    fn a_secret_serves_only_its_own_repository() {
        let s = PullSecrets::new();
        assert!(s.remember("reg:5000", "team/app", &basic("u", "p")));
        let got = s.get("reg:5000", "team/app").unwrap();
        assert_eq!(got.basic.unwrap().password, "p");
        // Another repository of the same host, the same repository elsewhere: nothing.
        assert!(s.get("reg:5000", "team/other").is_none());
        assert!(s.get("reg:5000", "team").is_none());
        assert!(s.get("reg:5001", "team/app").is_none());
        assert!(s.get("other", "team/app").is_none());
    }

    #[test]
    fn a_later_pull_replaces_and_an_anonymous_one_forgets() {
        let s = PullSecrets::new();
        s.remember("r", "a", &basic("u", "old"));
        s.remember("r", "a", &basic("u", "new"));
        assert_eq!(s.get("r", "a").unwrap().basic.unwrap().password, "new");
        assert!(!s.remember("r", "a", &PullSecret::default()));
        assert!(s.get("r", "a").is_none());
        assert!(s.is_empty());
    }

    #[test]
    fn auth_field_and_identity_token_are_understood() {
        let s = PullSecrets::new();
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        s.remember(
            "r",
            "a",
            &PullSecret {
                auth,
                ..PullSecret::default()
            },
        );
        let b = s.get("r", "a").unwrap().basic.unwrap();
        assert_eq!(
            (b.username.as_str(), b.password.as_str()),
            ("alice", "s3cret")
        );
        s.remember(
            "r",
            "b",
            &PullSecret {
                identity_token: "refresh".into(),
                ..PullSecret::default()
            },
        );
        assert_eq!(
            s.get("r", "b").unwrap().identity_token.as_deref(),
            Some("refresh")
        );
        // Garbage in `auth`, or only a registry token: nothing usable, nothing kept.
        for bad in [
            PullSecret {
                auth: "%%%".into(),
                ..PullSecret::default()
            },
            PullSecret {
                auth: base64::engine::general_purpose::STANDARD.encode("no-colon"),
                ..PullSecret::default()
            },
            PullSecret {
                registry_token: "t".into(),
                ..PullSecret::default()
            },
        ] {
            assert!(!s.remember("r", "c", &bad));
        }
        assert!(s.get("r", "c").is_none());
    }

    #[test]
    fn the_store_is_bounded_oldest_first() {
        let s = PullSecrets::new();
        for i in 0..MAX_SCOPES + 10 {
            s.remember("r", &format!("repo{i}"), &basic("u", "p"));
        }
        assert_eq!(s.len(), MAX_SCOPES);
        assert!(s.get("r", "repo0").is_none());
        assert!(s.get("r", &format!("repo{}", MAX_SCOPES + 9)).is_some());
    }

    #[test]
    fn debug_prints_no_secret() {
        let p = PullSecret {
            username: "alice".into(),
            password: "hunter2".into(),
            auth: "YWxpY2U6aHVudGVyMg==".into(),
            identity_token: "idtok".into(),
            registry_token: "regtok".into(),
        };
        let text = format!("{p:?}");
        for secret in ["hunter2", "YWxpY2U6aHVudGVyMg==", "idtok", "regtok"] {
            assert!(!text.contains(secret), "{text}");
        }
        let s = PullSecrets::new();
        s.remember("r", "a", &p);
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
