//! A small, bounded in-memory cache with expiry, keyed by two strings, on quick_cache.
//!
//! The registry's hot path (a fleet asking for the same few manifests and layers) must not
//! touch storage for every request. This caches facts that are either content-addressed
//! (a manifest's bytes, a small blob) or cheap to be briefly stale about (repository
//! links, tags): entries expire after a TTL so replicas sharing an object store converge,
//! and this process invalidates its own entries on delete.
//!
//! Lookups do not allocate: the two key strings are looked up through a borrowed key
//! equivalent to the stored one. Eviction is quick_cache's (a scan-resistant CLOCK-PRO
//! variant, sharded, no background threads); expired entries are dropped when found. The
//! two bounds (entries and total weight) become one weight: every entry is charged at
//! least the weight budget of one entry (`max_weight / max_entries`), so neither bound can
//! be passed.

use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use quick_cache::sync::Cache;
use quick_cache::{Equivalent, Weighter};

/// Divisor of the weight bound an entry may use at most (one shard's worth of the old
/// sharded cache): a single entry cannot flush a large part of the cache.
const MAX_ENTRY_SHARE: u64 = 16;

/// Stored key: the two strings.
type Key = (Box<str>, Box<str>);

/// A borrowed key, hashed exactly like [`Key`] (a tuple hashes its fields in order).
struct KeyRef<'a>(&'a str, &'a str);

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
        self.1.hash(state);
    }
}

impl Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        *key.0 == *self.0 && *key.1 == *self.1
    }
}

#[derive(Clone)]
struct Entry<V> {
    value: V,
    /// What the entry is charged (see the module doc).
    charge: u64,
    inserted: Instant,
}

#[derive(Clone)]
struct Charge;

impl<V> Weighter<Key, Entry<V>> for Charge {
    fn weight(&self, _key: &Key, entry: &Entry<V>) -> u64 {
        entry.charge
    }
}

/// A bounded TTL cache from `(a, b)` to `V`.
pub struct HotCache<V> {
    /// `None` when disabled.
    cache: Option<Cache<Key, Entry<V>, Charge>>,
    ttl: Duration,
    /// Least charge of an entry.
    unit: u64,
    /// Heaviest weight admitted.
    max_entry_weight: u64,
    /// The weight bound is the entry bound alone (`u64::MAX`: weights are not counted).
    count_only: bool,
}

impl<V> std::fmt::Debug for HotCache<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotCache")
            .field("ttl", &self.ttl)
            .field("unit", &self.unit)
            .finish()
    }
}

impl<V: Clone> HotCache<V> {
    /// At most `max_entries` entries and `max_weight` total weight (e.g. bytes); entries
    /// older than `ttl` are not returned. `max_entries == 0` disables the cache.
    pub fn new(max_entries: usize, max_weight: u64, ttl: Duration) -> Self {
        let entries = max_entries as u64;
        // Weights too large to sum safely mean "no weight bound": count entries only.
        let count_only = entries == 0 || max_weight / entries >= u64::from(u32::MAX);
        let (capacity, unit) = if count_only {
            (entries, 1)
        } else {
            (max_weight, max_weight.div_ceil(entries).max(1))
        };
        let cache = (max_entries > 0).then(|| Cache::with_weighter(max_entries, capacity, Charge));
        HotCache {
            cache,
            ttl,
            unit,
            max_entry_weight: max_weight / MAX_ENTRY_SHARE,
            count_only,
        }
    }

    /// The cached value, if present and fresh.
    pub fn get(&self, a: &str, b: &str) -> Option<V> {
        let cache = self.cache.as_ref()?;
        let key = KeyRef(a, b);
        let entry = cache.get(&key)?;
        if entry.inserted.elapsed() < self.ttl {
            Some(entry.value)
        } else {
            cache.remove(&key);
            None
        }
    }

    /// Caches `value` with `weight` (ignored if it alone exceeds a sixteenth of the
    /// weight bound).
    pub fn insert(&self, a: &str, b: &str, value: V, weight: u64) {
        let Some(cache) = &self.cache else { return };
        if weight > self.max_entry_weight {
            return;
        }
        let charge = if self.count_only {
            1
        } else {
            weight.max(self.unit)
        };
        cache.insert(
            (a.into(), b.into()),
            Entry {
                value,
                charge,
                inserted: Instant::now(),
            },
        );
    }

    /// Drops the entry for `(a, b)`.
    pub fn remove(&self, a: &str, b: &str) {
        if let Some(cache) = &self.cache {
            cache.remove(&KeyRef(a, b));
        }
    }

    /// Drops every entry for which `drop(a, b, value)` is true (rare invalidations).
    pub fn remove_where(&self, drop: impl Fn(&str, &str, &V) -> bool) {
        if let Some(cache) = &self.cache {
            cache.retain(|k, e| !drop(&k.0, &k.1, &e.value));
        }
    }

    /// Entries currently held (including expired ones not yet dropped).
    pub fn len(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.len())
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_insert_remove() {
        let c = HotCache::new(100, 1000, Duration::from_secs(60));
        assert_eq!(c.get("r", "d"), None);
        c.insert("r", "d", 7u64, 1);
        assert_eq!(c.get("r", "d"), Some(7));
        assert_eq!(c.get("r", "e"), None);
        assert_eq!(c.get("rd", ""), None);
        c.insert("r", "d", 8u64, 1);
        assert_eq!(c.get("r", "d"), Some(8));
        c.remove("r", "d");
        assert_eq!(c.get("r", "d"), None);
    }

    #[test]
    fn bounded_by_entries_and_weight() {
        let c = HotCache::new(32, 1 << 20, Duration::from_secs(60));
        for i in 0..1000 {
            c.insert("r", &i.to_string(), i, 1);
        }
        assert!(c.len() <= 32, "{}", c.len());
        let w = HotCache::new(10_000, 16 * 100, Duration::from_secs(60));
        for i in 0..1000 {
            w.insert("r", &i.to_string(), i, 50);
        }
        // Each shard holds at most 100 weight = 2 entries of 50.
        assert!(w.len() <= 32, "{}", w.len());
        // An entry heavier than a shard's budget is not cached at all.
        w.insert("big", "x", 1, 101);
        assert_eq!(w.get("big", "x"), None);
    }

    #[test]
    fn expires() {
        let c = HotCache::new(10, 10, Duration::ZERO);
        c.insert("a", "b", 1, 1);
        assert_eq!(c.get("a", "b"), None);
    }

    #[test]
    fn remove_where_filters() {
        let c = HotCache::new(100, 100, Duration::from_secs(60));
        c.insert("r", "t1", "d1".to_string(), 1);
        c.insert("r", "t2", "d2".to_string(), 1);
        c.insert("s", "t1", "d1".to_string(), 1);
        c.remove_where(|a, _, v| a == "r" && v == "d1");
        assert_eq!(c.get("r", "t1"), None);
        assert_eq!(c.get("r", "t2").as_deref(), Some("d2"));
        assert_eq!(c.get("s", "t1").as_deref(), Some("d1"));
    }

    #[test]
    fn disabled() {
        let c = HotCache::new(0, 100, Duration::from_secs(60));
        c.insert("a", "b", 1, 1);
        assert_eq!(c.get("a", "b"), None);
    }
}
