//! Bounded in-memory cache for small documents (manifests, tag lists, referrers indexes).
//!
//! Bounded by bytes, not entries, because a manifest list can be a hundred times larger
//! than a single-platform manifest; the least recently used entries go first. Each entry
//! remembers when upstream last vouched for it, so the caller can decide between fresh,
//! revalidate, and serve-stale — the policy lives in the caller, this only keeps time.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::time::Instant;

use parking_lot::Mutex;

/// Fixed bookkeeping cost charged per entry on top of the caller's weight.
pub const ENTRY_OVERHEAD: u64 = 96;

#[derive(Debug)]
struct Slot<V> {
    value: V,
    weight: u64,
    validated_at: Instant,
    tick: u64,
}

#[derive(Debug)]
struct Lru<K, V> {
    slots: HashMap<K, Slot<V>>,
    by_tick: BTreeMap<u64, K>,
    used: u64,
    next_tick: u64,
}

/// A byte-bounded LRU map whose entries carry the time they were last validated.
#[derive(Debug)]
pub struct MemoryCache<K, V> {
    capacity: u64,
    lru: Mutex<Lru<K, V>>,
}

impl<K: Eq + Hash + Clone, V: Clone> MemoryCache<K, V> {
    /// An empty cache holding at most `capacity` bytes (weights plus overhead).
    pub fn new(capacity: u64) -> Self {
        MemoryCache {
            capacity,
            lru: Mutex::new(Lru {
                slots: HashMap::new(),
                by_tick: BTreeMap::new(),
                used: 0,
                next_tick: 0,
            }),
        }
    }

    /// The value and when it was last validated; marks it recently used.
    pub fn get(&self, key: &K) -> Option<(V, Instant)> {
        let mut lru = self.lru.lock();
        let tick = lru.next_tick;
        lru.next_tick += 1;
        let slot = lru.slots.get_mut(key)?;
        let old_tick = std::mem::replace(&mut slot.tick, tick);
        let found = (slot.value.clone(), slot.validated_at);
        if let Some(k) = lru.by_tick.remove(&old_tick) {
            lru.by_tick.insert(tick, k);
        }
        Some(found)
    }

    /// Stores `value` (costing `weight` bytes) as validated at `validated_at`, evicting the
    /// least recently used entries to fit. A value larger than the whole cache is not kept.
    pub fn insert(&self, key: K, value: V, weight: u64, validated_at: Instant) {
        let weight = weight.saturating_add(ENTRY_OVERHEAD);
        let mut lru = self.lru.lock();
        if let Some(old) = lru.slots.remove(&key) {
            lru.by_tick.remove(&old.tick);
            lru.used -= old.weight;
        }
        if weight > self.capacity {
            return;
        }
        while lru.used + weight > self.capacity {
            let Some((_, victim)) = lru.by_tick.pop_first() else {
                break;
            };
            if let Some(old) = lru.slots.remove(&victim) {
                lru.used -= old.weight;
            }
        }
        let tick = lru.next_tick;
        lru.next_tick += 1;
        lru.used += weight;
        lru.by_tick.insert(tick, key.clone());
        lru.slots.insert(
            key,
            Slot {
                value,
                weight,
                validated_at,
                tick,
            },
        );
    }

    /// Records that upstream confirmed the entry is still current.
    pub fn revalidated(&self, key: &K, at: Instant) {
        if let Some(slot) = self.lru.lock().slots.get_mut(key) {
            slot.validated_at = at;
        }
    }

    /// Drops an entry; returns whether it was there.
    pub fn remove(&self, key: &K) -> bool {
        let mut lru = self.lru.lock();
        match lru.slots.remove(key) {
            Some(old) => {
                lru.by_tick.remove(&old.tick);
                lru.used -= old.weight;
                true
            }
            None => false,
        }
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        self.lru.lock().used
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.lru.lock().slots.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn evicts_least_recently_used_to_stay_under_the_bound() {
        let now = Instant::now();
        let cache: MemoryCache<&str, u32> = MemoryCache::new(3 * (100 + ENTRY_OVERHEAD));
        cache.insert("a", 1, 100, now);
        cache.insert("b", 2, 100, now);
        cache.insert("c", 3, 100, now);
        assert_eq!(cache.len(), 3);
        // Touch "a" so "b" is the oldest.
        assert_eq!(cache.get(&"a").unwrap().0, 1);
        cache.insert("d", 4, 100, now);
        assert!(cache.get(&"b").is_none());
        assert_eq!(cache.get(&"a").unwrap().0, 1);
        assert_eq!(cache.get(&"c").unwrap().0, 3);
        assert_eq!(cache.get(&"d").unwrap().0, 4);
        assert_eq!(cache.used(), 3 * (100 + ENTRY_OVERHEAD));
        // A big entry pushes out several.
        cache.insert("big", 5, 250, now);
        assert!(cache.used() <= 3 * (100 + ENTRY_OVERHEAD));
        assert_eq!(cache.get(&"big").unwrap().0, 5);
    }

    #[test]
    fn oversized_values_are_not_kept_and_replacing_recharges() {
        let now = Instant::now();
        let cache: MemoryCache<u8, u8> = MemoryCache::new(1000);
        cache.insert(1, 1, 5000, now);
        assert!(cache.is_empty());
        cache.insert(1, 1, 100, now);
        cache.insert(1, 2, 200, now);
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.used(), 200 + ENTRY_OVERHEAD);
        assert!(cache.remove(&1));
        assert!(!cache.remove(&1));
        assert_eq!(cache.used(), 0);
    }

    #[test]
    fn revalidation_moves_the_timestamp() {
        let then = Instant::now();
        let later = then + Duration::from_secs(5);
        let cache: MemoryCache<u8, u8> = MemoryCache::new(1000);
        cache.insert(1, 9, 1, then);
        assert_eq!(cache.get(&1).unwrap().1, then);
        cache.revalidated(&1, later);
        assert_eq!(cache.get(&1).unwrap(), (9, later));
    }
}
