//! The mechanics every on-disk cache of ferry shares: the chunk store, the file cache
//! (ferry-fs) and the registry's pull-through blob cache are each a directory of files
//! named by what they hold, bounded in bytes, least recently used first out, with pins
//! that keep entries in use, and each must come back from a kill -9 at any moment
//! without serving a torn file. This module owns that, once:
//!
//! - [`Staging`]: the `tmp/` directory where files are written before they enter the
//!   cache (private: 0700, files 0600), its unique temp names, and its recovery at open
//!   (every left-over removed, or only those of processes that are gone, for a directory
//!   several processes share).
//! - [`TempFile`]: one file being written, removed when dropped unless committed;
//!   [`TempFile::commit`] renames it into place under a [`Durability`] policy.
//! - [`LruIndex`]: the in-memory index over the committed files: sizes, recency,
//!   reservations for writes in progress, counted pins (of keys present or not yet),
//!   and the choice of eviction victims.
//!
//! What it must not do: decide what a file's name, content or verification is (each
//! cache names and checks its own files, and rebuilds its index from its directory or
//! metadata with [`LruIndex::insert_at`]), delete committed files (the caller deletes
//! the victims it is handed, under whatever lock keeps a concurrent commit safe), or do
//! any I/O while a caller holds its lock (the index is plain data).

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::hash::Hash;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// When a commit makes the file durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Rename only, no fsync: after a power cut a file under its final name may be torn
    /// or empty, so the owner must verify what it reads (the chunk store hashes every
    /// entry on its first read after open) and tolerate a missing file.
    RenameOnly,
    /// fsync the file before the rename and its directory after it: a file found under
    /// its final name is complete. The directory sync is best effort (its failure only
    /// risks losing the entry to a power cut, never tearing it), so it is not an error.
    Synced,
}

/// Which left-over temp files [`Staging::open`] removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TempRecovery {
    /// All of them: the directory is this process's alone (e.g. guarded by a lock).
    All,
    /// Those of processes no longer running (and of an earlier process with this pid):
    /// the directory is shared by several processes of the node.
    DeadProcesses,
}

/// The directory files are written in before they are committed into a cache.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    seq: AtomicU64,
}

impl Staging {
    /// Creates `dir` private (see [`crate::private_dir`]) and removes left-over temp
    /// files as `recovery` says; returns it and how many were removed.
    pub fn open(dir: &Path, recovery: TempRecovery) -> io::Result<(Staging, u64)> {
        crate::private_dir(dir)?;
        let removed = remove_leftovers(dir, recovery)?;
        Ok((
            Staging {
                dir: dir.to_path_buf(),
                seq: AtomicU64::new(0),
            },
            removed,
        ))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new empty temp file (0600), named `<pid>-<n>.part` so recovery can tell whose
    /// it is.
    pub fn create(&self) -> io::Result<TempFile> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{}-{seq}.part", std::process::id()));
        let file = crate::new_private_file().open(&path)?;
        Ok(TempFile {
            path,
            file,
            armed: true,
        })
    }
}

/// The pid a temp file name starts with.
fn temp_owner(name: &str) -> Option<u32> {
    name.split_once('-').and_then(|(pid, _)| pid.parse().ok())
}

fn remove_leftovers(dir: &Path, recovery: TempRecovery) -> io::Result<u64> {
    let mut removed = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let keep = recovery == TempRecovery::DeadProcesses
            && entry
                .file_name()
                .to_str()
                .and_then(temp_owner)
                .is_some_and(|pid| {
                    pid != std::process::id() && Path::new("/proc").join(pid.to_string()).exists()
                });
        if keep {
            continue;
        }
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        let gone = if is_dir {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match gone {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// A file in a [`Staging`] directory, removed when dropped unless committed or handed
/// over with [`TempFile::keep`].
#[derive(Debug)]
pub struct TempFile {
    path: PathBuf,
    file: File,
    armed: bool,
}

impl TempFile {
    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file (written through `&File`, which implements `Write`).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The open file, mutably.
    pub fn file_mut(&mut self) -> &mut File {
        &mut self.file
    }

    /// Renames it to `target` under `durability`. On an error the temp file is removed
    /// and `target` is untouched.
    pub fn commit(mut self, target: &Path, durability: Durability) -> io::Result<()> {
        if durability == Durability::Synced {
            self.file.sync_all()?;
        }
        fs::rename(&self.path, target)?;
        self.armed = false;
        if durability == Durability::Synced {
            sync_parent(target);
        }
        Ok(())
    }

    /// Gives up the removal on drop and returns the path: the caller commits it with
    /// [`place`] or removes it itself (a write that outlives this value, e.g. a download
    /// streamed by another task through a [`File::try_clone`] of [`TempFile::file`]). A
    /// crash meanwhile leaves it to [`Staging::open`].
    pub fn keep(mut self) -> PathBuf {
        self.armed = false;
        std::mem::take(&mut self.path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Commits the temp file at `temp` (handed over by [`TempFile::keep`]) to `target`
/// under `durability`. On an error the temp file is left for the caller to remove.
pub fn place(temp: &Path, target: &Path, durability: Durability) -> io::Result<()> {
    if durability == Durability::Synced {
        File::open(temp)?.sync_all()?;
    }
    fs::rename(temp, target)?;
    if durability == Durability::Synced {
        sync_parent(target);
    }
    Ok(())
}

/// Makes a rename into `path`'s directory durable, best effort (see [`Durability::Synced`]).
fn sync_parent(path: &Path) {
    let Some(dir) = path.parent() else { return };
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::debug!(dir = %dir.display(), error = %e, "syncing a cache directory failed");
    }
}

/// One committed entry of an [`LruIndex`].
#[derive(Debug, Clone)]
pub struct Slot<V> {
    size: u64,
    tick: u64,
    /// What the cache keeps about the entry besides its size and recency.
    pub value: V,
}

impl<V> Slot<V> {
    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Its recency: larger is more recent; unique within the index.
    pub fn tick(&self) -> u64 {
        self.tick
    }
}

/// An evicted entry: out of the index, its file still to delete.
#[derive(Debug, Clone)]
pub struct Victim<K, V> {
    /// Its key.
    pub key: K,
    /// Its size.
    pub size: u64,
    /// Its value.
    pub value: V,
}

/// The in-memory index of a size-bounded cache directory (see the module doc).
///
/// Invariants: `order` holds exactly the entries nobody pins, keyed by their tick;
/// `unpinned_bytes` is their size sum and `bytes` that of all entries; `pins` holds only
/// counts above zero, for keys present or not.
#[derive(Debug)]
pub struct LruIndex<K, V> {
    entries: HashMap<K, Slot<V>>,
    order: BTreeMap<u64, K>,
    bytes: u64,
    unpinned_bytes: u64,
    reserved: u64,
    next_tick: u64,
    pins: HashMap<K, u32>,
}

impl<K, V> Default for LruIndex<K, V> {
    fn default() -> Self {
        LruIndex {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            bytes: 0,
            unpinned_bytes: 0,
            reserved: 0,
            next_tick: 0,
            pins: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Clone, V> LruIndex<K, V> {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    /// Adds (or replaces) `key` as the most recently used entry; returns the replaced
    /// one's size and value.
    pub fn insert(&mut self, key: K, size: u64, value: V) -> Option<(u64, V)> {
        let tick = self.tick();
        self.insert_with(key, size, value, tick)
    }

    /// Adds `key` with the recency `tick` an index of an earlier process gave it (restoring
    /// the order at open: insert in ascending order). A tick not above every tick given so
    /// far is moved up; returns the tick used.
    pub fn insert_at(&mut self, key: K, size: u64, value: V, tick: u64) -> u64 {
        let tick = tick.max(self.next_tick + 1);
        self.next_tick = tick;
        self.insert_with(key, size, value, tick);
        tick
    }

    fn insert_with(&mut self, key: K, size: u64, value: V, tick: u64) -> Option<(u64, V)> {
        let old = self.remove(&key);
        if !self.pins.contains_key(&key) {
            self.order.insert(tick, key.clone());
            self.unpinned_bytes += size;
        }
        self.bytes += size;
        self.entries.insert(key, Slot { size, tick, value });
        old
    }

    /// Marks `key` used (most recent) and returns it.
    pub fn touch(&mut self, key: &K) -> Option<&mut Slot<V>> {
        if !self.entries.contains_key(key) {
            return None;
        }
        let tick = self.tick();
        let pinned = self.pins.contains_key(key);
        let slot = self.entries.get_mut(key)?;
        if !pinned && let Some(k) = self.order.remove(&slot.tick) {
            self.order.insert(tick, k);
        }
        slot.tick = tick;
        Some(slot)
    }

    /// The entry, without counting a use.
    pub fn get(&self, key: &K) -> Option<&Slot<V>> {
        self.entries.get(key)
    }

    /// The entry's value, mutably, without counting a use.
    pub fn value_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|s| &mut s.value)
    }

    /// True when `key` is committed.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Drops `key`; returns its size and value.
    pub fn remove(&mut self, key: &K) -> Option<(u64, V)> {
        let slot = self.entries.remove(key)?;
        if self.order.remove(&slot.tick).is_some() {
            self.unpinned_bytes -= slot.size;
        }
        self.bytes -= slot.size;
        Some((slot.size, slot.value))
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &Slot<V>)> {
        self.entries.iter()
    }

    /// Adds one pin on `key` (present or not): a pinned entry is never a victim.
    pub fn pin(&mut self, key: K) {
        let count = self.pins.entry(key.clone()).or_insert(0);
        *count += 1;
        if *count == 1
            && let Some(slot) = self.entries.get(&key)
            && self.order.remove(&slot.tick).is_some()
        {
            self.unpinned_bytes -= slot.size;
        }
    }

    /// Drops one pin on `key`; the last one makes it evictable again.
    pub fn unpin(&mut self, key: &K) {
        let Some(count) = self.pins.get_mut(key) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            self.pins.remove(key);
            if let Some(slot) = self.entries.get(key) {
                self.order.insert(slot.tick, key.clone());
                self.unpinned_bytes += slot.size;
            }
        }
    }

    /// How many pins `key` has.
    pub fn pins(&self, key: &K) -> u32 {
        self.pins.get(key).copied().unwrap_or(0)
    }

    /// Sets aside `bytes` for a write in progress (counted against the bound by
    /// [`LruIndex::take_victims`] and [`LruIndex::has_room`]).
    pub fn reserve(&mut self, bytes: u64) {
        self.reserved += bytes;
    }

    /// Releases a reservation.
    pub fn release(&mut self, bytes: u64) {
        self.reserved = self.reserved.saturating_sub(bytes);
    }

    /// Takes least recently used unpinned entries out until committed plus reserved bytes
    /// are at most `target`, or nothing unpinned is left.
    pub fn take_victims(&mut self, target: u64) -> Vec<Victim<K, V>> {
        let mut victims = Vec::new();
        while self.bytes + self.reserved > target {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            // The key left `order` above, so `remove` sees it as unpinned already.
            match self.entries.remove(&key) {
                Some(slot) => {
                    self.unpinned_bytes -= slot.size;
                    self.bytes -= slot.size;
                    victims.push(Victim {
                        key,
                        size: slot.size,
                        value: slot.value,
                    });
                }
                // Unreachable while the invariants hold; the key is out of `order` now.
                None => continue,
            }
        }
        victims
    }

    /// True when `size` more bytes fit under `max_bytes` once every unpinned entry is
    /// evicted.
    pub fn has_room(&self, size: u64, max_bytes: u64) -> bool {
        let limit = max_bytes.saturating_sub(size);
        size <= max_bytes
            && (self.bytes + self.reserved).saturating_sub(limit) <= self.unpinned_bytes
    }

    /// Committed entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is committed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of committed entries.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes reserved by writes in progress.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Bytes of committed entries that are pinned.
    pub fn pinned_bytes(&self) -> u64 {
        self.bytes - self.unpinned_bytes
    }

    /// Committed entries that are pinned.
    pub fn pinned_entries(&self) -> usize {
        self.entries.len() - self.order.len()
    }

    /// What breaks the invariants, if anything (for tests of the caches built on it).
    pub fn inconsistency(&self) -> Option<String> {
        let bytes: u64 = self.entries.values().map(|s| s.size).sum();
        if bytes != self.bytes {
            return Some(format!("bytes {} != sum {bytes}", self.bytes));
        }
        let mut unpinned = 0;
        for (tick, key) in &self.order {
            match self.entries.get(key) {
                Some(s) if s.tick == *tick => unpinned += s.size,
                _ => return Some(format!("order has a stale tick {tick}")),
            }
        }
        if unpinned != self.unpinned_bytes {
            return Some(format!(
                "unpinned bytes {} != sum {unpinned}",
                self.unpinned_bytes
            ));
        }
        for (key, slot) in &self.entries {
            let ordered = self.order.get(&slot.tick) == Some(key);
            if ordered == self.pins.contains_key(key) {
                return Some(format!("entry at tick {} ordered: {ordered}", slot.tick));
            }
        }
        if self.pins.values().any(|n| *n == 0) {
            return Some("a zero pin count".into());
        }
        None
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_committed_temp_file_is_in_place_private_and_gone_from_staging() {
        let t = tempfile::tempdir().unwrap();
        let (staging, removed) = Staging::open(&t.path().join("tmp"), TempRecovery::All).unwrap();
        assert_eq!(removed, 0);
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(staging.dir()), 0o700);
        for (n, durability) in [(1, Durability::RenameOnly), (2, Durability::Synced)] {
            let mut temp = staging.create().unwrap();
            assert_eq!(mode(temp.path()), 0o600);
            temp.file_mut().write_all(b"bytes").unwrap();
            let target = t.path().join(format!("entry{n}"));
            temp.commit(&target, durability).unwrap();
            assert_eq!(fs::read(&target).unwrap(), b"bytes");
            assert_eq!(mode(&target), 0o600);
        }
        assert!(names(staging.dir()).is_empty());
    }

    #[test]
    fn a_temp_file_dropped_without_commit_is_removed_and_a_failed_commit_leaves_nothing() {
        let t = tempfile::tempdir().unwrap();
        let (staging, _) = Staging::open(&t.path().join("tmp"), TempRecovery::All).unwrap();
        let mut temp = staging.create().unwrap();
        temp.file_mut().write_all(b"half").unwrap();
        drop(temp);
        assert!(names(staging.dir()).is_empty());
        let temp = staging.create().unwrap();
        let missing_dir = t.path().join("no/such/dir/entry");
        assert!(temp.commit(&missing_dir, Durability::Synced).is_err());
        assert!(names(staging.dir()).is_empty());
    }

    #[test]
    fn a_kept_temp_file_survives_its_handle_and_is_placed_by_path() {
        let t = tempfile::tempdir().unwrap();
        let (staging, _) = Staging::open(&t.path().join("tmp"), TempRecovery::All).unwrap();
        let temp = staging.create().unwrap();
        let mut writer = temp.file().try_clone().unwrap();
        let path = temp.keep();
        writer.write_all(b"streamed").unwrap();
        assert!(path.exists());
        let target = t.path().join("blob");
        place(&path, &target, Durability::Synced).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"streamed");
        assert!(!path.exists());
    }

    #[test]
    fn recovery_after_a_crash_removes_half_written_files() {
        let t = tempfile::tempdir().unwrap();
        let tmp = t.path().join("tmp");
        {
            let (staging, _) = Staging::open(&tmp, TempRecovery::All).unwrap();
            let temp = staging.create().unwrap();
            temp.file().write_all(b"torn").unwrap();
            // A kill -9 mid-write: the value is never dropped.
            std::mem::forget(temp);
        }
        fs::create_dir(tmp.join("junk-dir")).unwrap();
        fs::write(tmp.join("not-a-temp-name"), b"x").unwrap();
        assert_eq!(names(&tmp).len(), 3);
        let (_, removed) = Staging::open(&tmp, TempRecovery::All).unwrap();
        assert_eq!(removed, 3);
        assert!(names(&tmp).is_empty());
    }

    #[test]
    fn shared_recovery_keeps_files_of_live_processes_only() {
        let t = tempfile::tempdir().unwrap();
        let tmp = t.path().join("tmp");
        crate::private_dir(&tmp).unwrap();
        // pid 1 always runs; a pid above the kernel's maximum never does; our own pid's
        // files are an earlier process's (we have not written any yet).
        let live = "1-0.part";
        let dead = format!("{}-0.part", u32::MAX);
        let ours = format!("{}-7.part", std::process::id());
        for n in [live, dead.as_str(), ours.as_str(), "stray"] {
            fs::write(tmp.join(n), b"x").unwrap();
        }
        let (_, removed) = Staging::open(&tmp, TempRecovery::DeadProcesses).unwrap();
        assert_eq!(removed, 3);
        assert_eq!(names(&tmp), vec![live.to_string()]);
    }

    #[test]
    fn victims_are_least_recently_used_and_never_pinned() {
        let mut lru: LruIndex<&str, ()> = LruIndex::new();
        for k in ["a", "b", "c", "d"] {
            lru.insert(k, 10, ());
        }
        assert!(lru.touch(&"a").is_some());
        lru.pin("b");
        lru.pin("b");
        assert_eq!(lru.pinned_bytes(), 10);
        let v: Vec<&str> = lru.take_victims(20).into_iter().map(|v| v.key).collect();
        assert_eq!(v, vec!["c", "d"]);
        assert_eq!((lru.bytes(), lru.len()), (20, 2));
        // Only pinned left to go: "a" goes, "b" stays however low the target.
        assert_eq!(lru.take_victims(0).len(), 1);
        assert!(lru.contains(&"b"));
        lru.unpin(&"b");
        assert_eq!(lru.pins(&"b"), 1);
        assert!(lru.take_victims(0).is_empty());
        lru.unpin(&"b");
        assert_eq!(lru.take_victims(0).len(), 1);
        assert!(lru.is_empty());
        assert_eq!(lru.inconsistency(), None);
    }

    #[test]
    fn a_pin_before_the_entry_protects_it_once_inserted() {
        let mut lru: LruIndex<u8, &str> = LruIndex::new();
        lru.pin(1);
        lru.insert(1, 100, "x");
        assert!(lru.take_victims(0).is_empty());
        assert_eq!(lru.pinned_entries(), 1);
        // Replacing an entry recharges its size once.
        assert_eq!(lru.insert(1, 50, "y"), Some((100, "x")));
        assert_eq!(lru.bytes(), 50);
        assert_eq!(lru.get(&1).map(|s| s.value), Some("y"));
        assert_eq!(lru.inconsistency(), None);
    }

    #[test]
    fn reservations_count_against_the_bound() {
        let mut lru: LruIndex<u8, ()> = LruIndex::new();
        lru.insert(1, 60, ());
        lru.insert(2, 30, ());
        lru.pin(2);
        assert!(lru.has_room(70, 100), "evicting 1 makes room");
        assert!(!lru.has_room(71, 100), "2 is pinned");
        assert!(!lru.has_room(101, 100), "bigger than the bound");
        lru.reserve(50);
        assert_eq!(lru.take_victims(100).len(), 1);
        assert_eq!(lru.bytes() + lru.reserved(), 80);
        lru.release(50);
        assert_eq!(lru.reserved(), 0);
    }

    #[test]
    fn restored_order_keeps_earlier_ticks_and_moves_collisions_up() {
        let mut lru: LruIndex<u8, ()> = LruIndex::new();
        assert_eq!(lru.insert_at(1, 1, (), 0), 1);
        assert_eq!(lru.insert_at(2, 1, (), 0), 2);
        assert_eq!(lru.insert_at(3, 1, (), 40), 40);
        lru.insert(4, 1, ());
        assert_eq!(lru.get(&4).map(Slot::tick), Some(41));
        let order: Vec<u8> = lru.take_victims(0).into_iter().map(|v| v.key).collect();
        assert_eq!(order, vec![1, 2, 3, 4]);
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        // A small deterministic generator: the point is many interleavings, not chance.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut lru: LruIndex<u64, ()> = LruIndex::new();
        for _ in 0..5000 {
            let key = next() % 16;
            match next() % 6 {
                0 | 1 => {
                    lru.insert(key, next() % 100, ());
                }
                2 => {
                    lru.touch(&key);
                }
                3 => lru.pin(key),
                4 => lru.unpin(&key),
                _ => {
                    let target = next() % 800;
                    let pinned = lru.pinned_bytes();
                    lru.take_victims(target);
                    assert!(lru.bytes() <= target.max(pinned));
                }
            }
            assert_eq!(lru.inconsistency(), None);
        }
    }
}
