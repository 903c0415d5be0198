//! The `[store]` section of ferry's config and where the store lives.
//!
//! Precedence for the location: the `FERRY_STORE` environment variable, then `store.path`
//! in the config, then a default that depends on who runs ferry (root: a system
//! directory shared by the node's daemon; anyone else: their cache directory).

use std::ffi::OsString;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Environment variable that overrides `store.path`.
pub const STORE_ENV: &str = "FERRY_STORE";

/// Default bound on stored bytes: 10 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 10 << 30;

/// Where root's store lives by default.
pub const SYSTEM_STORE_PATH: &str = "/var/lib/ferry/store";

/// The `[store]` config section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Store directory; `None` means the default (see [`StoreConfig::resolve_path`]).
    pub path: Option<PathBuf>,
    /// Most bytes of chunk content the store keeps; least recently used unpinned entries
    /// are evicted to stay under it.
    pub max_bytes: u64,
    /// A read-only seed store under the live one: a directory written by `ferry store
    /// export` (e.g. on a volume baked ahead), read in place, never written or evicted.
    /// `None`: no seed.
    pub seed: Option<PathBuf>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: None,
            max_bytes: DEFAULT_MAX_BYTES,
            seed: None,
        }
    }
}

impl StoreConfig {
    /// The store directory: `FERRY_STORE` if set and non-empty, else `path`, else
    /// `/var/lib/ferry/store` for root, else `$XDG_CACHE_HOME/ferry/store` (falling back to
    /// `$HOME/.cache/ferry/store`, then a directory under the system temp dir).
    pub fn resolve_path(&self) -> PathBuf {
        resolve(
            self.path.as_ref(),
            std::env::var_os(STORE_ENV),
            is_root(),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        )
    }
}

fn non_empty(v: Option<OsString>) -> Option<PathBuf> {
    v.filter(|s| !s.is_empty()).map(PathBuf::from)
}

fn resolve(
    configured: Option<&PathBuf>,
    env: Option<OsString>,
    root: bool,
    xdg_cache: Option<OsString>,
    home: Option<OsString>,
) -> PathBuf {
    if let Some(p) = non_empty(env) {
        return p;
    }
    if let Some(p) = configured {
        return p.clone();
    }
    if root {
        return PathBuf::from(SYSTEM_STORE_PATH);
    }
    // XDG says relative values must be ignored.
    let cache = non_empty(xdg_cache)
        .filter(|p| p.is_absolute())
        .or_else(|| non_empty(home).map(|h| h.join(".cache")))
        .unwrap_or_else(|| std::env::temp_dir().join("ferry-cache"));
    cache.join("ferry").join("store")
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions, touches no memory and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn env_wins_then_config_then_defaults() {
        let cfg = PathBuf::from("/cfg");
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(
            resolve(Some(&cfg), os("/env"), true, None, None),
            PathBuf::from("/env")
        );
        assert_eq!(resolve(Some(&cfg), os(""), true, None, None), cfg);
        assert_eq!(
            resolve(None, None, true, os("/x"), os("/h")),
            PathBuf::from(SYSTEM_STORE_PATH)
        );
        assert_eq!(
            resolve(None, None, false, os("/x"), os("/h")),
            PathBuf::from("/x/ferry/store")
        );
        assert_eq!(
            resolve(None, None, false, os("relative"), os("/h")),
            PathBuf::from("/h/.cache/ferry/store")
        );
        assert_eq!(
            resolve(None, None, false, None, None),
            std::env::temp_dir().join("ferry-cache/ferry/store")
        );
    }

    #[test]
    fn config_section_parses_with_defaults() {
        let c: StoreConfig = serde_json::from_str(r#"{"path": "/s"}"#).unwrap();
        assert_eq!(c.path, Some(PathBuf::from("/s")));
        assert_eq!(c.max_bytes, DEFAULT_MAX_BYTES);
        assert_eq!(c.seed, None);
        assert!(serde_json::from_str::<StoreConfig>(r#"{"max_byte": 1}"#).is_err());
        let seeded: StoreConfig = serde_json::from_str(r#"{"seed": "/vol/seed"}"#).unwrap();
        assert_eq!(seeded.seed, Some(PathBuf::from("/vol/seed")));
    }
}
