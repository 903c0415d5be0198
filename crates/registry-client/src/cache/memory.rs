//! Bounded in-memory cache for small documents (manifests, tag lists, referrers indexes).
//!
//! Bounded by bytes, not entries, because a manifest list can be a hundred times larger
//! than a single-platform manifest. Each entry remembers when upstream last vouched for
//! it, so the caller can decide between fresh, revalidate, and serve-stale — the policy
//! lives in the caller, this only keeps time. Eviction is quick_cache's (a scan-resistant
//! CLOCK-PRO variant: entries used again outlive those seen once), in one shard so the
//! whole byte bound is available to any entry.

use std::hash::Hash;
use std::time::Instant;

use quick_cache::sync::{Cache, EntryAction};
use quick_cache::{OptionsBuilder, Weighter};

/// Fixed bookkeeping cost charged per entry on top of the caller's weight.
pub const ENTRY_OVERHEAD: u64 = 96;

/// Entries a cache is sized for at first (quick_cache grows past it as needed).
const ESTIMATED_ENTRIES: usize = 1024;

#[derive(Debug, Clone)]
struct Slot<V> {
    value: V,
    /// The caller's weight plus [`ENTRY_OVERHEAD`].
    weight: u64,
    validated_at: Instant,
}

#[derive(Debug, Clone)]
struct SlotWeight;

impl<K, V> Weighter<K, Slot<V>> for SlotWeight {
    fn weight(&self, _key: &K, slot: &Slot<V>) -> u64 {
        slot.weight
    }
}

/// A byte-bounded cache whose entries carry the time they were last validated.
pub struct MemoryCache<K, V> {
    capacity: u64,
    cache: Cache<K, Slot<V>, SlotWeight>,
}

impl<K: Eq + Hash, V: Clone> std::fmt::Debug for MemoryCache<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryCache")
            .field("capacity", &self.capacity)
            .field("used", &self.cache.weight())
            .field("len", &self.cache.len())
            .finish()
    }
}

impl<K: Eq + Hash + Clone, V: Clone> MemoryCache<K, V> {
    /// An empty cache holding at most `capacity` bytes (weights plus overhead).
    pub fn new(capacity: u64) -> Self {
        let mut options = OptionsBuilder::new();
        options
            .shards(1)
            .estimated_items_capacity(ESTIMATED_ENTRIES)
            .weight_capacity(capacity);
        let cache = match options.build() {
            Ok(options) => {
                Cache::with_options(options, SlotWeight, Default::default(), Default::default())
            }
            // Unreachable: every option above is set.
            Err(_) => Cache::with_weighter(ESTIMATED_ENTRIES, capacity, SlotWeight),
        };
        MemoryCache { capacity, cache }
    }

    /// The value and when it was last validated; marks it recently used.
    pub fn get(&self, key: &K) -> Option<(V, Instant)> {
        self.cache.get(key).map(|s| (s.value, s.validated_at))
    }

    /// Stores `value` (costing `weight` bytes) as validated at `validated_at`, evicting
    /// what the cache's policy picks to fit. A value larger than quick_cache admits (its
    /// hot share, 97 % of the whole cache) is not kept, and an earlier value under `key`
    /// is dropped.
    pub fn insert(&self, key: K, value: V, weight: u64, validated_at: Instant) {
        let weight = weight.saturating_add(ENTRY_OVERHEAD);
        if weight > self.capacity {
            self.cache.remove(&key);
            return;
        }
        self.cache.insert(
            key,
            Slot {
                value,
                weight,
                validated_at,
            },
        );
    }

    /// Records that upstream confirmed the entry is still current.
    pub fn revalidated(&self, key: &K, at: Instant) {
        // `Some(ZERO)`: an entry being loaded elsewhere is not waited for.
        let _ = self
            .cache
            .entry(key, Some(std::time::Duration::ZERO), |_, slot| {
                slot.validated_at = at;
                EntryAction::Retain(())
            });
    }

    /// Drops an entry; returns whether it was there.
    pub fn remove(&self, key: &K) -> bool {
        self.cache.remove(key).is_some()
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        self.cache.weight()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn evicts_an_entry_seen_once_to_stay_under_the_bound() {
        let now = Instant::now();
        let cache: MemoryCache<&str, u32> = MemoryCache::new(3 * (100 + ENTRY_OVERHEAD));
        cache.insert("a", 1, 100, now);
        cache.insert("b", 2, 100, now);
        cache.insert("c", 3, 100, now);
        assert_eq!(cache.len(), 3);
        // Touch "a": one of the entries seen only once goes, not it.
        assert_eq!(cache.get(&"a").unwrap().0, 1);
        cache.insert("d", 4, 100, now);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(&"a").unwrap().0, 1);
        assert_eq!(cache.get(&"d").unwrap().0, 4);
        let b_or_c = [cache.get(&"b"), cache.get(&"c")];
        assert_eq!(b_or_c.iter().filter(|v| v.is_some()).count(), 1);
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
