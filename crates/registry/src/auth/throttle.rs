//! Failed-login throttling: bcrypt runs for a wrong password only within a budget per
//! client address and per user name, so a flood of bad logins cannot occupy the CPUs that
//! serve everyone else (a verified credential is cached and never reaches bcrypt again).
//!
//! Each key holds a token bucket: `FAILURE_BURST` checks at once, refilled at
//! `FAILURES_PER_SEC`. A check takes from its client's and its user's bucket before bcrypt
//! runs (so a flood of parallel attempts is bounded too) and a right password gives it
//! back, so only failures drain buckets and clients that log in correctly are never
//! slowed. A login whose client or user bucket is empty is refused (429) unchecked. Memory is bounded: past `MAX_KEYS` keys, full buckets (which say
//! nothing) are dropped, then the fullest.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

use parking_lot::Mutex;

/// Failures a client (or a user name) may have at once before it must wait.
pub const FAILURE_BURST: f64 = 10.0;
/// Failures allowed per second after the burst.
pub const FAILURES_PER_SEC: f64 = 1.0;
/// How long a throttled client is told to wait (`Retry-After`, seconds).
pub const RETRY_AFTER_SECS: u64 = 1;
/// Most buckets kept.
const MAX_KEYS: usize = 65_536;
/// Longest user name used as a key (longer names share the truncated key).
const MAX_USER_KEY: usize = 256;

/// The address of the client a request came from, set by the listener per connection
/// (a request extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientAddr(pub IpAddr);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Client(IpAddr),
    User(String),
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn level(&self, now: Instant) -> f64 {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * FAILURES_PER_SEC;
        (self.tokens + refill).min(FAILURE_BURST)
    }
}

/// Token buckets of failed logins by client address and by user name.
#[derive(Debug, Default)]
pub struct LoginThrottle {
    buckets: Mutex<HashMap<Key, Bucket>>,
}

impl LoginThrottle {
    pub fn new() -> Self {
        Self::default()
    }

    fn keys(client: Option<IpAddr>, user: &str) -> impl Iterator<Item = Key> {
        let user = user.get(..MAX_USER_KEY).unwrap_or(user);
        client
            .map(Key::Client)
            .into_iter()
            .chain(std::iter::once(Key::User(user.to_string())))
    }

    /// Takes one failure's worth from the buckets of `client` and `user` if both have it,
    /// before a password check runs: `true` means go ahead (and call
    /// [`LoginThrottle::succeeded`] if the password was right), `false` means refuse
    /// without checking. Taking before checking bounds the bcrypt runs in flight too, not
    /// only the failures already counted.
    pub fn try_begin(&self, client: Option<IpAddr>, user: &str, now: Instant) -> bool {
        let mut buckets = self.buckets.lock();
        let keys: Vec<Key> = Self::keys(client, user).collect();
        if !keys
            .iter()
            .all(|key| buckets.get(key).is_none_or(|b| b.level(now) >= 1.0))
        {
            return false;
        }
        if buckets.len() + keys.len() > MAX_KEYS {
            Self::make_room(&mut buckets, now);
        }
        for key in keys {
            let level = buckets.get(&key).map_or(FAILURE_BURST, |b| b.level(now));
            buckets.insert(
                key,
                Bucket {
                    tokens: level - 1.0,
                    at: now,
                },
            );
        }
        true
    }

    /// Gives back what [`LoginThrottle::try_begin`] took: the password was right.
    pub fn succeeded(&self, client: Option<IpAddr>, user: &str, now: Instant) {
        let mut buckets = self.buckets.lock();
        for key in Self::keys(client, user) {
            if let Some(bucket) = buckets.get_mut(&key) {
                let level = (bucket.level(now) + 1.0).min(FAILURE_BURST);
                *bucket = Bucket {
                    tokens: level,
                    at: now,
                };
            }
        }
    }

    /// Drops full buckets (they say nothing), then, if everyone is failing, all but the
    /// emptiest quarter (the most active).
    fn make_room(buckets: &mut HashMap<Key, Bucket>, now: Instant) {
        buckets.retain(|_, b| b.level(now) < FAILURE_BURST);
        if buckets.len() >= MAX_KEYS {
            let mut levels: Vec<f64> = buckets.values().map(|b| b.level(now)).collect();
            let cut = levels.len() / 4;
            levels.select_nth_unstable_by(cut, f64::total_cmp);
            let threshold = levels[cut];
            buckets.retain(|_, b| b.level(now) < threshold);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn a_client_is_stopped_after_its_burst_and_refills() {
        let t = LoginThrottle::new();
        let now = Instant::now();
        for i in 0..FAILURE_BURST as usize {
            assert!(t.try_begin(ip(1), &format!("user{i}"), now), "attempt {i}");
        }
        assert!(!t.try_begin(ip(1), "someone-else", now));
        // Another client is not affected, nor is a user that never failed.
        assert!(t.try_begin(ip(2), "someone-else", now));
        let later = now + Duration::from_secs_f64(1.0 / FAILURES_PER_SEC);
        assert!(t.try_begin(ip(1), "someone-else", later));
        assert!(!t.try_begin(ip(1), "someone-else", later));
    }

    #[test]
    fn a_user_is_stopped_across_clients() {
        let t = LoginThrottle::new();
        let now = Instant::now();
        for i in 0..FAILURE_BURST as u8 {
            assert!(t.try_begin(ip(i), "alice", now));
        }
        assert!(!t.try_begin(ip(200), "alice", now));
        assert!(t.try_begin(ip(200), "bob", now));
        assert!(!t.try_begin(None, "alice", now));
    }

    #[test]
    fn right_passwords_cost_nothing() {
        let t = LoginThrottle::new();
        let now = Instant::now();
        for _ in 0..(FAILURE_BURST as usize * 3) {
            assert!(t.try_begin(ip(1), "alice", now));
            t.succeeded(ip(1), "alice", now);
        }
    }

    #[test]
    fn memory_stays_bounded() {
        let t = LoginThrottle::new();
        let now = Instant::now();
        for i in 0..(MAX_KEYS + 100) {
            t.try_begin(None, &format!("u{i}"), now);
        }
        assert!(t.buckets.lock().len() <= MAX_KEYS);
    }
}
