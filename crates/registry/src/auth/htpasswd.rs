//! htpasswd users (bcrypt only) and the live view of the file: re-read when it changes,
//! stat'ed at most once per second, so operators can add or revoke users without a
//! restart and the hot path never touches the disk.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use parking_lot::RwLock;

use super::rules::ANONYMOUS;

/// Largest htpasswd file read.
pub const MAX_HTPASSWD_BYTES: u64 = 16 << 20;
/// bcrypt cost of hashes written by [`hash_password`].
pub const DEFAULT_BCRYPT_COST: u32 = 10;
/// How often the file's metadata is looked at.
const RELOAD_CHECK_MS: u64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum HtpasswdError {
    #[error("htpasswd {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("htpasswd {path}: larger than {MAX_HTPASSWD_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("htpasswd {path} line {line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("bcrypt: {0}")]
    Bcrypt(#[from] bcrypt::BcryptError),
    #[error(
        "invalid user name {0:?} (no ':', whitespace or control characters; not \"anonymous\")"
    )]
    InvalidUser(String),
}

/// Parsed htpasswd content: user → bcrypt hash.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Htpasswd {
    users: HashMap<String, String>,
}

impl Htpasswd {
    /// Parse htpasswd text. Blank lines and `#` comments are skipped; every other line
    /// must be `user:$2y$…` (also `$2a$`/`$2b$`); other hash types are refused by line.
    pub fn parse(text: &str, path: &Path) -> Result<Htpasswd, HtpasswdError> {
        let mut users = HashMap::new();
        for (index, raw) in text.lines().enumerate() {
            let line_no = index + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: String| HtpasswdError::Line {
                path: path.to_path_buf(),
                line: line_no,
                reason,
            };
            let (user, hash) = line
                .split_once(':')
                .ok_or_else(|| bad("expected user:hash".to_string()))?;
            if !valid_user_name(user) {
                return Err(bad(format!("invalid user name {user:?}")));
            }
            check_bcrypt_hash(hash).map_err(|why| bad(format!("user {user:?}: {why}")))?;
            if users.insert(user.to_string(), hash.to_string()).is_some() {
                return Err(bad(format!("user {user:?} appears twice")));
            }
        }
        Ok(Htpasswd { users })
    }

    pub fn hash_of(&self, user: &str) -> Option<&str> {
        self.users.get(user).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.users.len()
    }

    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// The highest bcrypt cost among the users' hashes (parse checked each one), so an
    /// unknown user's dummy check costs as much as the slowest real one.
    pub fn max_cost(&self) -> Option<u32> {
        self.users.values().filter_map(|h| bcrypt_cost(h)).max()
    }
}

/// The cost field of a hash `check_bcrypt_hash` accepted (`$2y$NN$…`).
fn bcrypt_cost(hash: &str) -> Option<u32> {
    hash.get(4..6)?.parse().ok()
}

/// User names that can appear in htpasswd and rules.
pub fn valid_user_name(user: &str) -> bool {
    !user.is_empty()
        && user.len() <= 256
        && user != ANONYMOUS
        && user != "*"
        && !user
            .chars()
            .any(|c| c == ':' || c.is_whitespace() || c.is_control())
}

fn check_bcrypt_hash(hash: &str) -> Result<(), String> {
    let kind = if hash.starts_with("$apr1$") {
        Some("Apache MD5 ($apr1$)")
    } else if hash.starts_with("{SHA}") {
        Some("SHA-1 ({SHA})")
    } else if hash.starts_with("$1$") {
        Some("MD5-crypt ($1$)")
    } else if hash.starts_with("$5$") || hash.starts_with("$6$") {
        Some("SHA-crypt ($5$/$6$)")
    } else {
        None
    };
    if let Some(kind) = kind {
        return Err(format!(
            "unsupported hash type {kind}; only bcrypt is accepted (recreate with `htpasswd -B`)"
        ));
    }
    let bcrypt_prefix = ["$2y$", "$2b$", "$2a$"].iter().any(|p| hash.starts_with(p));
    if !bcrypt_prefix {
        return Err("not a bcrypt hash ($2y$…); plain-text and crypt passwords are refused (use `htpasswd -B`)".to_string());
    }
    // $2y$NN$ + 53 characters of salt and hash, in bcrypt's base64 alphabet. Anything
    // else would load a user whose every password check fails.
    let b = hash.as_bytes();
    let cost_ok = b.len() == 60
        && b[4].is_ascii_digit()
        && b[5].is_ascii_digit()
        && (4..=31).contains(&(u32::from(b[4] - b'0') * 10 + u32::from(b[5] - b'0')));
    let body_ok = b.len() == 60
        && b[6] == b'$'
        && b[7..]
            .iter()
            .all(|&c| c.is_ascii_alphanumeric() || c == b'.' || c == b'/');
    if !cost_ok || !body_ok {
        return Err("malformed bcrypt hash".to_string());
    }
    Ok(())
}

/// A bcrypt hash of `password` in the `$2y$` form htpasswd writes.
pub fn hash_password(password: &str, cost: u32) -> Result<String, HtpasswdError> {
    Ok(bcrypt::hash_with_result(password, cost)?.format_for_version(bcrypt::Version::TwoY))
}

/// One htpasswd line for `user`.
pub fn htpasswd_line(user: &str, password: &str, cost: u32) -> Result<String, HtpasswdError> {
    if !valid_user_name(user) {
        return Err(HtpasswdError::InvalidUser(user.to_string()));
    }
    Ok(format!("{user}:{}", hash_password(password, cost)?))
}

/// Add or replace `user` in the htpasswd file at `path` (created 0600 if absent),
/// atomically (temp file + rename) so a running registry never reads half a file.
/// This is what `ferry registry passwd` runs.
pub fn set_user(path: &Path, user: &str, password: &str, cost: u32) -> Result<(), HtpasswdError> {
    let io = |source| HtpasswdError::Io {
        path: path.to_path_buf(),
        source,
    };
    let new_line = htpasswd_line(user, password, cost)?;
    let existing = match read_bounded(path) {
        Ok(text) => text,
        Err(HtpasswdError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            String::new()
        }
        Err(e) => return Err(e),
    };
    let mut out = String::with_capacity(existing.len() + new_line.len() + 1);
    let mut replaced = false;
    for line in existing.lines() {
        if line.trim().split_once(':').is_some_and(|(u, _)| u == user) {
            if !replaced {
                out.push_str(&new_line);
                out.push('\n');
                replaced = true;
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !replaced {
        out.push_str(&new_line);
        out.push('\n');
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
    {
        use std::io::Write;
        tmp.write_all(out.as_bytes()).map_err(io)?;
        tmp.as_file().sync_all().map_err(io)?;
    }
    // NamedTempFile is created 0600, which is what a password file wants.
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}

fn read_bounded(path: &Path) -> Result<String, HtpasswdError> {
    let io = |source| HtpasswdError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut text = String::new();
    file.take(MAX_HTPASSWD_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_HTPASSWD_BYTES {
        return Err(HtpasswdError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

/// What identifies one version of the file on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> std::io::Result<FileStamp> {
    let meta = std::fs::metadata(path)?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let inode = 0;
    Ok(FileStamp {
        modified: meta.modified().ok(),
        len: meta.len(),
        inode,
    })
}

#[derive(Debug)]
struct Loaded {
    users: Arc<Htpasswd>,
    stamp: Option<FileStamp>,
    generation: u64,
}

/// The htpasswd file as the authenticator sees it, reloaded when it changes.
#[derive(Debug)]
pub struct UserFile {
    path: PathBuf,
    state: RwLock<Loaded>,
    started: Instant,
    /// Milliseconds since `started` of the last metadata check.
    last_check_ms: AtomicU64,
}

impl UserFile {
    /// Load the file; any problem is an error here (at startup), unlike in reloads.
    pub fn open(path: &Path) -> Result<UserFile, HtpasswdError> {
        let file_stamp = stamp(path).map_err(|source| HtpasswdError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let users = Htpasswd::parse(&read_bounded(path)?, path)?;
        Ok(UserFile {
            path: path.to_path_buf(),
            state: RwLock::new(Loaded {
                users: Arc::new(users),
                stamp: Some(file_stamp),
                generation: 0,
            }),
            started: Instant::now(),
            last_check_ms: AtomicU64::new(0),
        })
    }

    /// The current users and their generation (bumped on every reload), after looking for
    /// a change if the last look was more than a second ago.
    pub fn current(&self) -> (Arc<Htpasswd>, u64) {
        self.maybe_reload();
        let state = self.state.read();
        (state.users.clone(), state.generation)
    }

    /// Make the next [`UserFile::current`] look at the file regardless of the last check.
    #[cfg(test)]
    pub(crate) fn force_recheck(&self) {
        self.reload_if_changed();
    }

    /// The current generation without reloading.
    pub fn generation(&self) -> u64 {
        self.state.read().generation
    }

    fn maybe_reload(&self) {
        let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.last_check_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(last) < RELOAD_CHECK_MS
            || self
                .last_check_ms
                .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        self.reload_if_changed();
    }

    /// Re-read the file if its metadata changed. A file that became unreadable or invalid
    /// leaves no users (fail closed) until it is fixed.
    pub fn reload_if_changed(&self) {
        let new_stamp = stamp(&self.path).ok();
        {
            let state = self.state.read();
            if state.stamp == new_stamp && new_stamp.is_some() {
                return;
            }
        }
        let users = match new_stamp {
            None => {
                tracing::error!(path = %self.path.display(), "htpasswd file is gone; refusing all passwords");
                Htpasswd::default()
            }
            Some(_) => {
                match read_bounded(&self.path).and_then(|text| Htpasswd::parse(&text, &self.path)) {
                    Ok(users) => {
                        tracing::info!(path = %self.path.display(), users = users.len(), "htpasswd reloaded");
                        users
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "htpasswd reload failed; refusing all passwords until fixed");
                        Htpasswd::default()
                    }
                }
            }
        };
        let mut state = self.state.write();
        state.users = Arc::new(users);
        state.stamp = new_stamp;
        state.generation += 1;
    }
}
