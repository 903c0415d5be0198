//! A small, bounded, sharded in-memory cache with expiry, keyed by two strings.
//!
//! The registry's hot path (a fleet asking for the same few manifests and layers) must not
//! touch storage for every request. This caches facts that are either content-addressed
//! (a manifest's bytes, a small blob) or cheap to be briefly stale about (repository
//! links, tags): entries expire after a TTL so replicas sharing an object store converge,
//! and this process invalidates its own entries on delete.
//!
//! Lookups do not allocate: the two key strings are hashed to a `u64` and the stored key
//! is compared, so a hash collision is only a miss, never a wrong answer. Eviction when a
//! shard is full drops expired entries first, then arbitrary ones (the hash order), which
//! is good enough for a working set that mostly fits.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::RwLock;
use std::time::{Duration, Instant};

const SHARDS: usize = 16;

/// Hasher for keys that are already uniformly distributed `u64`s.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

struct Entry<V> {
    a: Box<str>,
    b: Box<str>,
    value: V,
    weight: u64,
    inserted: Instant,
}

struct Shard<V> {
    map: HashMap<u64, Entry<V>, BuildHasherDefault<IdentityHasher>>,
    weight: u64,
}

/// A bounded TTL cache from `(a, b)` to `V`.
pub struct HotCache<V> {
    shards: Box<[RwLock<Shard<V>>]>,
    hasher: RandomState,
    ttl: Duration,
    max_entries_per_shard: usize,
    max_weight_per_shard: u64,
}

impl<V> std::fmt::Debug for HotCache<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotCache")
            .field("ttl", &self.ttl)
            .field("max_entries_per_shard", &self.max_entries_per_shard)
            .finish()
    }
}

impl<V: Clone> HotCache<V> {
    /// At most `max_entries` entries and `max_weight` total weight (e.g. bytes); entries
    /// older than `ttl` are not returned. `max_entries == 0` disables the cache.
    pub fn new(max_entries: usize, max_weight: u64, ttl: Duration) -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                RwLock::new(Shard {
                    map: HashMap::default(),
                    weight: 0,
                })
            })
            .collect();
        HotCache {
            shards,
            hasher: RandomState::new(),
            ttl,
            max_entries_per_shard: max_entries.div_ceil(SHARDS),
            max_weight_per_shard: max_weight / SHARDS as u64,
        }
    }

    fn hash(&self, a: &str, b: &str) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write(a.as_bytes());
        h.write_u8(0xff);
        h.write(b.as_bytes());
        h.finish()
    }

    fn shard(&self, h: u64) -> &RwLock<Shard<V>> {
        &self.shards[(h as usize) % SHARDS]
    }

    /// The cached value, if present and fresh.
    pub fn get(&self, a: &str, b: &str) -> Option<V> {
        if self.max_entries_per_shard == 0 {
            return None;
        }
        let h = self.hash(a, b);
        let shard = self.shard(h).read().unwrap_or_else(|p| p.into_inner());
        let e = shard.map.get(&h)?;
        (e.inserted.elapsed() < self.ttl && &*e.a == a && &*e.b == b).then(|| e.value.clone())
    }

    /// Caches `value` with `weight` (ignored if it alone exceeds a shard's budget).
    pub fn insert(&self, a: &str, b: &str, value: V, weight: u64) {
        if self.max_entries_per_shard == 0 || weight > self.max_weight_per_shard {
            return;
        }
        let h = self.hash(a, b);
        let mut shard = self.shard(h).write().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = shard.map.remove(&h) {
            shard.weight -= old.weight;
        }
        if shard.map.len() >= self.max_entries_per_shard
            || shard.weight + weight > self.max_weight_per_shard
        {
            self.evict(&mut shard, weight);
        }
        shard.weight += weight;
        shard.map.insert(
            h,
            Entry {
                a: a.into(),
                b: b.into(),
                value,
                weight,
                inserted: Instant::now(),
            },
        );
    }

    fn evict(&self, shard: &mut Shard<V>, incoming: u64) {
        let ttl = self.ttl;
        let before = shard.map.len();
        shard.map.retain(|_, e| e.inserted.elapsed() < ttl);
        if shard.map.len() != before {
            shard.weight = shard.map.values().map(|e| e.weight).sum();
        }
        while !shard.map.is_empty()
            && (shard.map.len() >= self.max_entries_per_shard
                || shard.weight + incoming > self.max_weight_per_shard)
        {
            let Some(&victim) = shard.map.keys().next() else {
                break;
            };
            if let Some(e) = shard.map.remove(&victim) {
                shard.weight -= e.weight;
            }
        }
    }

    /// Drops the entry for `(a, b)`.
    pub fn remove(&self, a: &str, b: &str) {
        let h = self.hash(a, b);
        let mut shard = self.shard(h).write().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = shard.map.get(&h)
            && &*e.a == a
            && &*e.b == b
            && let Some(e) = shard.map.remove(&h)
        {
            shard.weight -= e.weight;
        }
    }

    /// Drops every entry for which `drop(a, b, value)` is true (rare invalidations).
    pub fn remove_where(&self, mut drop: impl FnMut(&str, &str, &V) -> bool) {
        for shard in self.shards.iter() {
            let mut shard = shard.write().unwrap_or_else(|p| p.into_inner());
            let mut freed = 0;
            shard.map.retain(|_, e| {
                let gone = drop(&e.a, &e.b, &e.value);
                if gone {
                    freed += e.weight;
                }
                !gone
            });
            shard.weight -= freed;
        }
    }

    /// Entries currently held (including expired ones not yet evicted).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|p| p.into_inner()).map.len())
            .sum()
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
