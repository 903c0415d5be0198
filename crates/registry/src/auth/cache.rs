//! Bounded expiring caches for verified credentials, so the per-request cost of auth is a
//! hash and a read-locked map lookup instead of a signature check or a bcrypt run.
//!
//! Only successes are cached, keyed by the SHA-256 of the exact credential bytes, so a
//! different (wrong) credential can never hit an entry.

use std::collections::HashMap;

use parking_lot::RwLock;
use sha2::{Digest, Sha256};

/// Cache key: SHA-256 of the credential.
pub type CredentialKey = [u8; 32];

pub fn credential_key(credential: &[u8]) -> CredentialKey {
    Sha256::digest(credential).into()
}

/// Map from credential hash to a value that expires at a unix time (seconds).
#[derive(Debug)]
pub struct ExpiringCache<V> {
    capacity: usize,
    entries: RwLock<HashMap<CredentialKey, (V, u64)>>,
}

impl<V: Clone> ExpiringCache<V> {
    pub fn new(capacity: usize) -> Self {
        ExpiringCache {
            capacity: capacity.max(1),
            entries: RwLock::new(HashMap::new()),
        }
    }

    /// The value for `key` if present and not expired at `now`.
    pub fn get(&self, key: &CredentialKey, now: u64) -> Option<V> {
        let entries = self.entries.read();
        match entries.get(key) {
            Some((value, expires)) if *expires > now => Some(value.clone()),
            _ => None,
        }
    }

    /// Insert, making room first: expired entries go, then the soonest-expiring quarter.
    pub fn insert(&self, key: CredentialKey, value: V, expires: u64, now: u64) {
        if expires <= now {
            return;
        }
        let mut entries = self.entries.write();
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            entries.retain(|_, (_, exp)| *exp > now);
            if entries.len() >= self.capacity {
                let mut expiries: Vec<u64> = entries.values().map(|(_, exp)| *exp).collect();
                let cut = expiries.len() / 4;
                let (_, threshold, _) = expiries.select_nth_unstable(cut);
                let threshold = *threshold;
                entries.retain(|_, (_, exp)| *exp > threshold);
            }
        }
        entries.insert(key, (value, expires));
    }

    pub fn clear(&self) {
        self.entries.write().clear();
    }

    pub fn len(&self) -> usize {
        self.entries.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
