//! The chunk store proper: the in-memory index over the chunk files, the put/get paths,
//! eviction, pins and the batched metadata flush.
//!
//! Locking: one mutex guards the in-memory index ([`State`]); it is held only for map
//! updates, never across hashing, file I/O or a metadata commit, so a reader hitting a
//! cached entry is never stuck behind a big write. A key being written or removed is
//! marked *busy*; other puts of the same key wait for it (one copy is written), and
//! readers simply miss until it is committed. Pin changes take a second mutex so the
//! persisted pins are written in the same order as the in-memory ones change.
//!
//! On-disk layout under the store root:
//! - `chunks/<2 hex>/<64 hex>`: one file per entry, named by its hash, never modified
//!   in place (only created by rename and unlinked), so an open file handle stays valid
//!   and correct even after the entry is evicted.
//! - `tmp/`: files being written; emptied on open.
//! - `meta.redb`: the metadata (see `meta.rs`).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};
use redb::Database;
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::clock::{Clock, SystemClock};
use crate::config::{DEFAULT_MAX_BYTES, StoreConfig};
use crate::diskcache::{Durability, LruIndex, Slot, Staging, TempFile, TempRecovery};
use crate::error::{Error, Result};
use crate::key::ChunkKey;
use crate::meta::{self, ENTRIES, PINS, Record, SETTINGS};

/// Block size used when hashing or copying entry files.
const IO_BLOCK: usize = 1 << 20;

/// How the store behaves; [`StoreOptions::default`] is what the daemon uses.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Bound on stored bytes. `None` keeps the bound the store was last opened with (or
    /// [`DEFAULT_MAX_BYTES`] for a new store): maintenance commands use `None` so they
    /// never shrink the daemon's store by accident. A `Some` smaller than what is stored
    /// evicts unpinned entries at open.
    pub max_bytes: Option<u64>,
    /// Pins persisted by a previous process stay in force this long after open; owners
    /// that do not re-register (call [`Store::pin`]) within it lose them.
    pub pin_grace: Duration,
    /// How often a background thread writes batched access times (and expires restored
    /// pins). `None`: no thread; call [`Store::flush`] yourself.
    pub flush_interval: Option<Duration>,
    /// Wall time source.
    pub clock: Arc<dyn Clock>,
    /// A read-only seed store under this one: a directory written by [`Store::export`],
    /// used in place (see `seed.rs`). `None`: no seed.
    pub seed: Option<PathBuf>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_bytes: None,
            pin_grace: Duration::from_secs(120),
            flush_interval: Some(Duration::from_secs(5)),
            clock: Arc::new(SystemClock),
            seed: None,
        }
    }
}

/// What [`Store::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The bytes were written and committed.
    Stored,
    /// The key was already stored; nothing was written.
    AlreadyPresent,
}

/// A verified entry opened for reading. The file is never modified in place, so reads
/// through this handle stay correct even if the entry is evicted meanwhile (the inode
/// lives until the handle closes). Suitable for FUSE passthrough.
#[derive(Debug)]
pub struct ChunkFile {
    file: File,
    len: u64,
    path: PathBuf,
}

impl ChunkFile {
    /// The open, read-only file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Takes the file.
    pub fn into_file(self) -> File {
        self.file
    }

    /// Length of the entry in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the entry's file was when opened (it may be unlinked by eviction later).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads at `offset` (positional; safe to share between threads).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }
}

/// One entry as `ferry store ls` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EntryInfo {
    /// The entry's key.
    pub key: ChunkKey,
    /// Its size in bytes.
    pub size: u64,
    /// Last access, ms since the epoch (0: unknown, e.g. adopted after a crash).
    pub last_access_ms: u64,
    /// Last time its content was hashed and found good, ms since the epoch (0: never).
    pub verified_at_ms: u64,
    /// How many owners pin it.
    pub pins: u32,
}

/// Counters and sizes for `ferry status` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Committed entries.
    pub entries: u64,
    /// Bytes of committed entries.
    pub bytes: u64,
    /// Bytes reserved by puts in progress.
    pub reserved_bytes: u64,
    /// The bound.
    pub max_bytes: u64,
    /// Bytes of committed entries that are pinned.
    pub pinned_bytes: u64,
    /// Committed entries that are pinned.
    pub pinned_entries: u64,
    /// Owners holding pins (including restored ones not yet re-registered).
    pub pin_owners: u64,
    /// Reads served (by the live store or, when it lacks the key, the seed store).
    pub hits: u64,
    /// Reads not served (absent, or dropped as corrupt, in the live store and the seed).
    pub misses: u64,
    /// Entries committed by this process.
    pub inserts: u64,
    /// Entries evicted to respect the bound or by gc.
    pub evictions: u64,
    /// Entries dropped because their file was missing, of the wrong size or failed
    /// verification (at open, on read or by verify).
    pub verification_failures: u64,
    /// Puts refused because the bytes did not match the key.
    pub rejected_puts: u64,
}

/// What opening the store found and repaired.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OpenReport {
    /// Entries found committed.
    pub entries: u64,
    /// Leftover temporary files removed.
    pub removed_temp_files: u64,
    /// Entries dropped: file missing, size not matching its record, or bad record.
    pub dropped_entries: u64,
    /// Chunk files without a record, adopted (unverified, least recent).
    pub adopted_files: u64,
    /// Stray files in the chunk directories removed.
    pub removed_stray_files: u64,
    /// Restored pins (owner, key pairs) waiting for their owners to re-register.
    pub restored_pins: u64,
    /// The metadata file was unusable and was rebuilt from the chunk files.
    pub metadata_rebuilt: bool,
    /// Entries evicted at open because the bound shrank.
    pub evicted_at_open: u64,
}

/// What [`Store::gc_to`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GcReport {
    /// Entries evicted.
    pub evicted_entries: u64,
    /// Bytes they held.
    pub freed_bytes: u64,
    /// Bytes still stored.
    pub bytes: u64,
    /// Bytes still stored that are pinned (gc never evicts them).
    pub pinned_bytes: u64,
}

/// What [`Store::verify_all`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Entries hashed and found good.
    pub good_entries: u64,
    /// Bytes hashed.
    pub checked_bytes: u64,
    /// Entries dropped: missing, wrong size or wrong content.
    pub dropped: Vec<ChunkKey>,
}

/// One pin owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OwnerInfo {
    /// Owner name.
    pub owner: String,
    /// Keys it pins.
    pub keys: u64,
    /// Bytes of the stored entries among them (keys pinned before their bytes were
    /// stored count nothing yet; entries pinned by several owners count for each).
    pub bytes: u64,
    /// Restored from a previous process and not re-registered yet.
    pub restored: bool,
}

/// The node's chunk store. Cheap to clone; all clones share one store. Every method is
/// synchronous and thread-safe; from async code call them through
/// `tokio::task::spawn_blocking` (puts hash and write, first reads hash).
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    chunks_dir: PathBuf,
    staging: Staging,
    db: Database,
    max_bytes: u64,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    /// Signalled whenever a key stops being busy.
    settled: Condvar,
    /// Serialises pin changes with their persistence.
    pin_io: Mutex<()>,
    /// Serialises access-time flushes.
    flush_io: Mutex<()>,
    /// True while restored pins await re-registration.
    restore_pending: AtomicBool,
    counters: Counters,
    open_report: OpenReport,
    flusher: Mutex<Option<Flusher>>,
    /// The read-only seed store under this one, if any.
    seed: Option<Seed>,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
    evictions: AtomicU64,
    verification_failures: AtomicU64,
    rejected_puts: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// What the index keeps about an entry besides its size and recency.
#[derive(Debug, Clone, Copy)]
struct Entry {
    last_access_ms: u64,
    verified_at_ms: u64,
    /// Hashed and found good (or written) by this process.
    verified: bool,
    /// Distinguishes this commit from a later one of the same key.
    generation: u64,
}

#[derive(Debug, Default)]
struct Owner {
    keys: HashSet<ChunkKey>,
    /// Set for owners restored from disk: when their pins lapse unless re-registered.
    restore_deadline_ms: Option<u64>,
}

/// The in-memory index. Sizes, recency, reservations and pin counts are the shared
/// disk-cache index's ([`LruIndex`]); a key's pin count there is the number of owners
/// pinning it. Invariant: a busy key is never in `index`.
#[derive(Debug, Default)]
struct State {
    index: LruIndex<ChunkKey, Entry>,
    next_generation: u64,
    owners: HashMap<String, Owner>,
    busy: HashSet<ChunkKey>,
    /// Entries whose record is stale or, for entries put since the last flush, not
    /// written yet (a crash before the flush leaves files the next open adopts).
    dirty: HashSet<ChunkKey>,
}

impl State {
    /// Marks an access; returns the entry's size and the entry as it now is.
    fn touch(&mut self, key: &ChunkKey, now_ms: u64) -> Option<(u64, Entry)> {
        let slot = self.index.touch(key)?;
        slot.value.last_access_ms = now_ms;
        let out = (slot.size(), slot.value);
        self.dirty.insert(*key);
        Some(out)
    }

    /// Adds a committed entry, the most recent one.
    fn insert(&mut self, key: ChunkKey, size: u64, mut entry: Entry) {
        self.next_generation += 1;
        entry.generation = self.next_generation;
        self.index.insert(key, size, entry);
    }

    /// Adds an entry found at open with its persisted `tick`; returns the tick used.
    fn restore(&mut self, key: ChunkKey, size: u64, entry: Entry, tick: u64) -> u64 {
        self.index.insert_at(key, size, entry, tick)
    }

    fn remove(&mut self, key: &ChunkKey) -> Option<(u64, Entry)> {
        let removed = self.index.remove(key)?;
        self.dirty.remove(key);
        Some(removed)
    }

    fn add_pin(&mut self, key: ChunkKey) {
        self.index.pin(key);
    }

    fn drop_pin(&mut self, key: &ChunkKey) {
        self.index.unpin(key);
    }

    /// Removes least recently used unpinned entries until committed + reserved bytes are
    /// at most `target`; marks them busy. Returns them (key, size).
    fn take_victims(&mut self, target: u64) -> Vec<(ChunkKey, u64)> {
        let victims = self.index.take_victims(target);
        victims
            .into_iter()
            .map(|v| {
                self.dirty.remove(&v.key);
                self.busy.insert(v.key);
                (v.key, v.size)
            })
            .collect()
    }

    fn pinned_bytes(&self) -> u64 {
        self.index.pinned_bytes()
    }
}

/// Marks a key busy for the duration of a put; unmarks it (and wakes waiters) on drop.
struct BusyGuard<'a> {
    inner: &'a Inner,
    key: ChunkKey,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.inner.lock_state();
        st.busy.remove(&self.key);
        drop(st);
        self.inner.settled.notify_all();
    }
}

#[derive(Debug)]
struct Flusher {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl Flusher {
    fn signal(&self) {
        let (flag, cv) = &*self.stop;
        *flag.lock() = true;
        cv.notify_all();
    }
}

/// An entry looked up for a read.
struct Found {
    size: u64,
    verified: bool,
    generation: u64,
}

/// Why an entry's file could not be served.
enum Unservable {
    Missing,
    Corrupt,
}

impl Store {
    /// Opens (creating if needed) the store a config describes: [`StoreConfig::resolve_path`]
    /// and its `max_bytes`, with default options otherwise.
    pub fn open(config: &StoreConfig) -> Result<Store> {
        Store::open_with(
            &config.resolve_path(),
            StoreOptions {
                max_bytes: Some(config.max_bytes),
                seed: config.seed.clone(),
                ..StoreOptions::default()
            },
        )
    }

    /// Opens (creating if needed) the store at `root`. Removes leftover temporary files,
    /// reconciles metadata with the chunk files (dropping entries whose file is missing
    /// or of the wrong size, adopting files without a record), restores persisted pins
    /// for [`StoreOptions::pin_grace`], and evicts down to a smaller bound if one is given.
    /// With [`StoreOptions::seed`], first opens the seed store read-only (its manifest
    /// read and checked; nothing copied) and fails with [`Error::Seed`] if it is not a
    /// usable export. Fails with [`Error::InUse`] while another process has it open.
    pub fn open_with(root: &Path, options: StoreOptions) -> Result<Store> {
        // Before anything of the live store is created or repaired.
        let seed = options
            .seed
            .as_deref()
            .map(|seed| Seed::open(seed, root))
            .transpose()?;
        let chunks_dir = root.join("chunks");
        for dir in [root, &chunks_dir] {
            crate::private_dir(dir).map_err(|e| Error::io(dir, e))?;
        }
        let db_path = root.join("meta.redb");
        // The metadata lock is the store lock: nothing below runs while another process
        // uses the store.
        let (mut db, mut rebuilt) = meta::open(root, &db_path)?;
        crate::tighten(&db_path, crate::PRIVATE_FILE_MODE).map_err(|e| Error::io(&db_path, e))?;
        let loaded = match meta::load(&db) {
            Ok(l) => l,
            Err(e) if meta::is_corruption(&e) => {
                drop(db);
                let moved = meta::quarantine(&db_path)?;
                tracing::warn!(error = %e, moved_to = %moved.display(), "store metadata damaged; rebuilding");
                let (fresh, _) = meta::open(root, &db_path)?;
                db = fresh;
                rebuilt = true;
                meta::load(&db)?
            }
            Err(e) => return Err(e),
        };
        if let Some(found) = loaded.format
            && found > meta::FORMAT_VERSION
        {
            return Err(Error::UnsupportedFormat {
                path: root.to_path_buf(),
                found,
                supported: meta::FORMAT_VERSION,
            });
        }
        let max_bytes = options
            .max_bytes
            .or(loaded.max_bytes)
            .unwrap_or(DEFAULT_MAX_BYTES);

        let mut report = OpenReport {
            metadata_rebuilt: rebuilt,
            ..OpenReport::default()
        };
        let tmp_dir = root.join("tmp");
        // The metadata lock keeps other processes out, so every temp file is a dead one's.
        let (staging, removed_temp_files) =
            Staging::open(&tmp_dir, TempRecovery::All).map_err(|e| Error::io(&tmp_dir, e))?;
        report.removed_temp_files = removed_temp_files;
        ensure_fanout_dirs(&chunks_dir)?;
        let now = options.clock.now_ms();
        let reconciled = reconcile(&chunks_dir, loaded, &mut report)?;

        // Persist the repairs, the format and the bound in one commit.
        let txn = db.begin_write().map_err(Error::db)?;
        {
            let mut entries = txn.open_table(ENTRIES).map_err(Error::db)?;
            for raw in &reconciled.remove_records {
                entries.remove(raw.as_slice()).map_err(Error::db)?;
            }
            for (key, rec) in &reconciled.insert_records {
                entries
                    .insert(key.raw().as_slice(), rec.encode().as_slice())
                    .map_err(Error::db)?;
            }
            let mut pins = txn.open_multimap_table(PINS).map_err(Error::db)?;
            for (owner, raw) in &reconciled.remove_pins {
                pins.remove(owner.as_str(), raw.as_slice())
                    .map_err(Error::db)?;
            }
            let mut settings = txn.open_table(SETTINGS).map_err(Error::db)?;
            settings
                .insert(meta::SETTING_FORMAT, meta::FORMAT_VERSION)
                .map_err(Error::db)?;
            settings
                .insert(meta::SETTING_MAX_BYTES, max_bytes)
                .map_err(Error::db)?;
        }
        txn.commit().map_err(Error::db)?;

        let mut state = State::default();
        let mut records = reconciled.records;
        records.sort_by_key(|(k, r)| (r.tick, r.last_access_ms, *k));
        for (key, rec) in records {
            // Keep persisted ticks (new ones must rank after them); only collisions, e.g.
            // among adopted files, are moved up, and persisted with the next flush.
            let entry = Entry {
                last_access_ms: rec.last_access_ms,
                verified_at_ms: rec.verified_at_ms,
                verified: false,
                generation: 0,
            };
            if state.restore(key, rec.size, entry, rec.tick) != rec.tick {
                state.dirty.insert(key);
            }
        }
        let deadline = now.saturating_add(duration_ms(options.pin_grace));
        for (owner, key) in reconciled.pins {
            let o = state.owners.entry(owner).or_default();
            o.restore_deadline_ms = Some(deadline);
            if o.keys.insert(key) {
                state.add_pin(key);
                report.restored_pins += 1;
            }
        }
        report.entries = state.index.len() as u64;

        let inner = Arc::new(Inner {
            root: root.to_path_buf(),
            chunks_dir,
            staging,
            db,
            max_bytes,
            clock: options.clock,
            restore_pending: AtomicBool::new(!state.owners.is_empty()),
            state: Mutex::new(state),
            settled: Condvar::new(),
            pin_io: Mutex::new(()),
            flush_io: Mutex::new(()),
            counters: Counters::default(),
            open_report: report,
            flusher: Mutex::new(None),
            seed,
        });
        bump(
            &inner.counters.verification_failures,
            report.dropped_entries,
        );
        let mut store = Store { inner };

        let victims = store.inner.lock_state().take_victims(max_bytes);
        if !victims.is_empty() {
            let n = victims.len() as u64;
            store.inner.evict(victims)?;
            if let Some(inner) = Arc::get_mut(&mut store.inner) {
                inner.open_report.evicted_at_open = n;
            }
        }
        if let Some(interval) = options.flush_interval {
            store.start_flusher(interval);
        }
        tracing::debug!(root = %root.display(), report = ?store.inner.open_report, "chunk store open");
        Ok(store)
    }

    /// The store directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The bound on stored bytes.
    pub fn max_bytes(&self) -> u64 {
        self.inner.max_bytes
    }

    /// What opening the store found and repaired.
    pub fn open_report(&self) -> OpenReport {
        self.inner.open_report
    }

    /// Stores `bytes` under `key` after checking that they hash to it. Returns once the
    /// entry is in place and served (renamed into place; its record is written by the
    /// next flush, and a crash before it costs only a re-hash on the next read); evicts
    /// least recently used unpinned entries first if needed, so the bound holds when this
    /// returns. Concurrent puts of one key write it once. A key the seed store has served
    /// verified is [`PutOutcome::AlreadyPresent`] (nothing written). Errors: [`Error::DigestMismatch`],
    /// [`Error::TooLarge`], [`Error::Full`] (nothing stored in each case), I/O, metadata.
    pub fn put(&self, key: &ChunkKey, bytes: &[u8]) -> Result<PutOutcome> {
        let chunk = crate::key::Hashed::new(bytes);
        if chunk.key() != key {
            bump(&self.inner.counters.rejected_puts, 1);
            return Err(Error::DigestMismatch {
                expected: *key,
                actual: *chunk.key(),
            });
        }
        self.put_hashed(&chunk)
    }

    /// [`Store::put`] of bytes hashed already (their key is theirs by construction).
    pub fn put_hashed(&self, chunk: &crate::key::Hashed<'_>) -> Result<PutOutcome> {
        let inner = &*self.inner;
        let (key, bytes) = (chunk.key(), chunk.bytes());
        let size = bytes.len() as u64;
        if size > inner.max_bytes {
            return Err(Error::TooLarge {
                size,
                max_bytes: inner.max_bytes,
            });
        }
        if inner.seed_serves(key) {
            return Ok(PutOutcome::AlreadyPresent);
        }
        inner.expire_restored_pins()?;
        let Some(guard) = inner.claim(key) else {
            return Ok(PutOutcome::AlreadyPresent);
        };
        // Refuse before writing when pins leave no room (the commit re-checks).
        inner.check_room(size)?;
        let (temp, ()) = inner.write_temp(|f| f.write_all(bytes))?;
        inner.commit(guard, temp, size)?;
        Ok(PutOutcome::Stored)
    }

    /// Like [`Store::put`] but streams the bytes from `reader` (large entries, e.g. a whole
    /// layer), hashing while writing. Reads at most `max_bytes + 1` bytes.
    pub fn put_reader(&self, key: &ChunkKey, reader: &mut dyn Read) -> Result<PutOutcome> {
        let inner = &*self.inner;
        if inner.seed_serves(key) {
            return Ok(PutOutcome::AlreadyPresent);
        }
        inner.expire_restored_pins()?;
        let Some(guard) = inner.claim(key) else {
            return Ok(PutOutcome::AlreadyPresent);
        };
        let max = inner.max_bytes;
        let (temp, (size, actual)) = inner.write_temp(|f| copy_hashing(reader, f, max))?;
        if size > max {
            return Err(Error::TooLarge {
                size,
                max_bytes: max,
            });
        }
        if actual != *key {
            bump(&inner.counters.rejected_puts, 1);
            return Err(Error::DigestMismatch {
                expected: *key,
                actual,
            });
        }
        inner.commit(guard, temp, size)?;
        Ok(PutOutcome::Stored)
    }

    /// The entry's bytes, verified (hashed on the first read after this process opened the
    /// store; trusted afterwards). `None` on a miss, including an entry found corrupt,
    /// which is dropped and counted. With a seed store, a key the live store cannot serve
    /// is read from the seed (see `seed.rs`: hashed on its first read, a bad seed object
    /// is a miss). Errors are I/O failures of the live store other than a missing file.
    pub fn get(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>> {
        let inner = &*self.inner;
        if let Some(found) = inner.lookup(key) {
            let path = inner.entry_path(key);
            let read = open_entry(&path)
                .and_then(|file| match file {
                    Some(f) => read_entry(&f, key, found.size, found.verified),
                    None => Ok(Err(Unservable::Missing)),
                })
                .map_err(|e| Error::io(&path, e))?;
            if let Some(bytes) = inner.finish_read(key, &found, read)? {
                return Ok(Some(bytes));
            }
        }
        Ok(inner.read_seed(|seed| seed.read(key)))
    }

    /// The entry opened read-only, verified like [`Store::get`] (through the returned
    /// handle itself, so what was checked is what will be read). `None` on a miss. Falls
    /// back to the seed store like [`Store::get`].
    pub fn open_chunk(&self, key: &ChunkKey) -> Result<Option<ChunkFile>> {
        let inner = &*self.inner;
        if let Some(found) = inner.lookup(key) {
            let path = inner.entry_path(key);
            let opened = open_entry(&path)
                .and_then(|file| match file {
                    Some(f) => Ok(check_entry(&f, key, found.size, found.verified)?.map(|()| f)),
                    None => Ok(Err(Unservable::Missing)),
                })
                .map_err(|e| Error::io(&path, e))?;
            if let Some(file) = inner.finish_read(key, &found, opened)? {
                return Ok(Some(ChunkFile {
                    file,
                    len: found.size,
                    path,
                }));
            }
        }
        Ok(inner.read_seed(|seed| seed.open_chunk(key)))
    }

    /// True when the key is committed in the live store or listed by the seed store and
    /// not found bad there (no access recorded, no verification).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.inner.contains_live(key) || self.inner.seed.as_ref().is_some_and(|s| s.contains(key))
    }

    /// Pins `keys` for `owner` (a live mount), adding to what it already pins: pinned
    /// entries are never evicted. Keys not stored yet are pinned too and protected once
    /// stored. Re-registers an owner restored from a previous process. Persisted; on an
    /// error the pins still hold in this process.
    pub fn pin(&self, owner: &str, keys: &[ChunkKey]) -> Result<()> {
        if !crate::valid_owner(owner) {
            return Err(Error::InvalidOwner(owner.chars().take(80).collect()));
        }
        let inner = &*self.inner;
        let _io = inner.pin_io.lock();
        let added: Vec<ChunkKey> = {
            let mut st = inner.lock_state();
            let st = &mut *st;
            let o = st.owners.entry(owner.to_string()).or_default();
            o.restore_deadline_ms = None;
            let added: Vec<ChunkKey> = keys
                .iter()
                .filter(|k| o.keys.insert(**k))
                .copied()
                .collect();
            for k in &added {
                st.add_pin(*k);
            }
            added
        };
        if added.is_empty() {
            return Ok(());
        }
        let txn = inner.db.begin_write().map_err(Error::db)?;
        {
            let mut pins = txn.open_multimap_table(PINS).map_err(Error::db)?;
            for k in &added {
                pins.insert(owner, k.raw().as_slice()).map_err(Error::db)?;
            }
        }
        txn.commit().map_err(Error::db)
    }

    /// Releases every pin `owner` holds (its mount went away). Returns how many keys it
    /// pinned.
    pub fn unpin_owner(&self, owner: &str) -> Result<usize> {
        self.inner.unpin_owner(owner, false)
    }

    /// The keys `owner` pins (e.g. to restore a mount's hot set after a restart).
    pub fn pinned_keys(&self, owner: &str) -> Vec<ChunkKey> {
        let st = self.inner.lock_state();
        let mut keys: Vec<ChunkKey> = st
            .owners
            .get(owner)
            .map(|o| o.keys.iter().copied().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    /// Every pin owner with what it pins, sorted by name.
    pub fn owners(&self) -> Vec<OwnerInfo> {
        let st = self.inner.lock_state();
        let mut out: Vec<OwnerInfo> = st
            .owners
            .iter()
            .map(|(name, o)| OwnerInfo {
                owner: name.clone(),
                keys: o.keys.len() as u64,
                bytes: o
                    .keys
                    .iter()
                    .filter_map(|k| st.index.get(k))
                    .map(Slot::size)
                    .sum(),
                restored: o.restore_deadline_ms.is_some(),
            })
            .collect();
        out.sort_by(|a, b| a.owner.cmp(&b.owner));
        out
    }

    /// Drops the pins of owners restored from a previous process whose grace period has
    /// passed without them re-registering. Returns their names. Runs by itself on puts,
    /// gc and the background flush.
    pub fn expire_restored_pins(&self) -> Result<Vec<String>> {
        self.inner.expire_restored_pins()
    }

    /// Evicts least recently used unpinned entries until at most `target_bytes` are
    /// stored (pinned entries stay, so the result may be above the target).
    pub fn gc_to(&self, target_bytes: u64) -> Result<GcReport> {
        let inner = &*self.inner;
        inner.expire_restored_pins()?;
        let victims = inner.lock_state().take_victims(target_bytes);
        let evicted_entries = victims.len() as u64;
        let freed_bytes = victims.iter().map(|(_, s)| *s).sum();
        inner.evict(victims)?;
        let st = inner.lock_state();
        Ok(GcReport {
            evicted_entries,
            freed_bytes,
            bytes: st.index.bytes(),
            pinned_bytes: st.pinned_bytes(),
        })
    }

    /// Re-hashes every committed entry; drops (and reports) those whose file is missing,
    /// of the wrong size or of the wrong content. Does not count as an access.
    pub fn verify_all(&self) -> Result<VerifyReport> {
        let inner = &*self.inner;
        let snapshot: Vec<(ChunkKey, u64, u64)> = {
            let st = inner.lock_state();
            st.index
                .iter()
                .map(|(k, e)| (*k, e.size(), e.value.generation))
                .collect()
        };
        let mut report = VerifyReport::default();
        for (key, size, generation) in snapshot {
            let path = inner.entry_path(&key);
            let good = match File::open(&path) {
                Ok(file) => {
                    let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
                    if meta.permissions().mode() & 0o077 != 0 {
                        // Written before store files were private.
                        fs::set_permissions(
                            &path,
                            fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE),
                        )
                        .map_err(|e| Error::io(&path, e))?;
                    }
                    let len = meta.len();
                    len == size
                        && hash_file(&file, size).map_err(|e| Error::io(&path, e))? == Some(key)
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                Err(e) => return Err(Error::io(&path, e)),
            };
            if good {
                report.good_entries += 1;
                report.checked_bytes += size;
                inner.mark_verified(&key, generation);
            } else if inner.drop_if_current(&key, generation)? {
                bump(&inner.counters.verification_failures, 1);
                report.dropped.push(key);
            }
        }
        report.dropped.sort();
        Ok(report)
    }

    /// Every committed entry, least recently used first (the eviction order).
    pub fn list(&self) -> Vec<EntryInfo> {
        let st = self.inner.lock_state();
        let mut entries: Vec<(u64, EntryInfo)> = st
            .index
            .iter()
            .map(|(k, e)| {
                (
                    e.tick(),
                    EntryInfo {
                        key: *k,
                        size: e.size(),
                        last_access_ms: e.value.last_access_ms,
                        verified_at_ms: e.value.verified_at_ms,
                        pins: st.index.pins(k),
                    },
                )
            })
            .collect();
        entries.sort_by_key(|(tick, _)| *tick);
        entries.into_iter().map(|(_, e)| e).collect()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> StoreStats {
        let inner = &*self.inner;
        let c = &inner.counters;
        let st = inner.lock_state();
        StoreStats {
            entries: st.index.len() as u64,
            bytes: st.index.bytes(),
            reserved_bytes: st.index.reserved(),
            max_bytes: inner.max_bytes,
            pinned_bytes: st.pinned_bytes(),
            pinned_entries: st.index.pinned_entries() as u64,
            pin_owners: st.owners.len() as u64,
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            inserts: c.inserts.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            verification_failures: c.verification_failures.load(Ordering::Relaxed),
            rejected_puts: c.rejected_puts.load(Ordering::Relaxed),
        }
    }

    /// Writes batched access times (and verification times) to the metadata. Runs by
    /// itself every [`StoreOptions::flush_interval`] and when the store is dropped;
    /// access times not flushed before a crash are lost, which only ages those entries.
    pub fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    /// Stops the background flusher, waits for it, and flushes. The metadata file is
    /// released when the last clone of this store is dropped.
    pub fn close(self) -> Result<()> {
        let flusher = self.inner.flusher.lock().take();
        if let Some(mut f) = flusher {
            f.signal();
            if let Some(h) = f.handle.take() {
                let _ = h.join();
            }
        }
        self.inner.flush()
    }

    fn start_flusher(&self, interval: Duration) {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let thread_stop = Arc::clone(&stop);
        let spawned = std::thread::Builder::new()
            .name("ferry-store-flush".into())
            .spawn(move || flusher_loop(weak, thread_stop, interval));
        match spawned {
            Ok(handle) => {
                *self.inner.flusher.lock() = Some(Flusher {
                    stop,
                    handle: Some(handle),
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the store flusher; access times flush on drop only")
            }
        }
    }
}

fn flusher_loop(weak: Weak<Inner>, stop: Arc<(Mutex<bool>, Condvar)>, interval: Duration) {
    let (flag, cv) = &*stop;
    let mut stopped = flag.lock();
    loop {
        cv.wait_for(&mut stopped, interval);
        if *stopped {
            return;
        }
        drop(stopped);
        {
            let Some(inner) = weak.upgrade() else {
                return;
            };
            if let Err(e) = inner.flush() {
                tracing::warn!(error = %e, "flushing store access times failed");
            }
            if let Err(e) = inner.expire_restored_pins() {
                tracing::warn!(error = %e, "expiring restored pins failed");
            }
        }
        stopped = flag.lock();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(f) = self.flusher.get_mut().take() {
            // Not joined: this may run on the flusher thread itself.
            f.signal();
        }
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "flushing store access times at close failed");
        }
    }
}

impl Inner {
    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    fn entry_path(&self, key: &ChunkKey) -> PathBuf {
        let hex = key.hex();
        self.chunks_dir.join(&hex[..2]).join(hex)
    }

    /// Finds a live entry for a read and records the access (the read's outcome is
    /// counted by [`Inner::finish_read`] or [`Inner::read_seed`]).
    fn lookup(&self, key: &ChunkKey) -> Option<Found> {
        let now = self.clock.now_ms();
        self.lock_state().touch(key, now).map(|(size, e)| Found {
            size,
            verified: e.verified,
            generation: e.generation,
        })
    }

    fn contains_live(&self, key: &ChunkKey) -> bool {
        self.lock_state().index.contains(key)
    }

    /// True when the seed store holds `key` and has served it verified in this process:
    /// a put of it need not write a copy. A seed object not yet read is not trusted for
    /// this (the put's verified bytes go to the live store).
    fn seed_serves(&self, key: &ChunkKey) -> bool {
        self.seed.as_ref().is_some_and(|s| s.verified(key))
    }

    /// The end of a read the live store could not serve: asks the seed store, if there is
    /// one, and counts the read as a hit or a miss.
    fn read_seed<T>(&self, read: impl FnOnce(&Seed) -> Option<T>) -> Option<T> {
        let served = self.seed.as_ref().and_then(read);
        if served.is_some() {
            bump(&self.counters.hits, 1);
        } else {
            bump(&self.counters.misses, 1);
        }
        served
    }

    /// Counts a hit, or drops an entry that could not be served (the miss is counted by
    /// [`Inner::read_seed`], which the caller asks next).
    fn finish_read<T>(
        &self,
        key: &ChunkKey,
        found: &Found,
        read: std::result::Result<T, Unservable>,
    ) -> Result<Option<T>> {
        match read {
            Ok(v) => {
                if !found.verified {
                    self.mark_verified(key, found.generation);
                }
                bump(&self.counters.hits, 1);
                Ok(Some(v))
            }
            Err(why) => {
                // A missing file is normal when the entry was evicted since the lookup;
                // then the entry is gone already and nothing is dropped or counted.
                if self.drop_if_current(key, found.generation)? {
                    bump(&self.counters.verification_failures, 1);
                    match why {
                        Unservable::Missing => {
                            tracing::warn!(%key, "store entry's file vanished; dropped")
                        }
                        Unservable::Corrupt => {
                            tracing::warn!(%key, "store entry failed verification; dropped")
                        }
                    }
                }
                Ok(None)
            }
        }
    }

    fn mark_verified(&self, key: &ChunkKey, generation: u64) {
        let now = self.clock.now_ms();
        let mut st = self.lock_state();
        if let Some(e) = st.index.value_mut(key)
            && e.generation == generation
        {
            e.verified = true;
            e.verified_at_ms = now;
            st.dirty.insert(*key);
        }
    }

    /// Removes the entry if it is still the commit `generation`; true if it did.
    fn drop_if_current(&self, key: &ChunkKey, generation: u64) -> Result<bool> {
        {
            let mut st = self.lock_state();
            match st.index.get(key) {
                Some(e) if e.value.generation == generation => {}
                _ => return Ok(false),
            }
            st.remove(key);
            st.busy.insert(*key);
        }
        let path = self.entry_path(key);
        let unlinked = remove_file_if_exists(&path);
        let committed = self.remove_records(&[*key]);
        {
            let mut st = self.lock_state();
            st.busy.remove(key);
        }
        self.settled.notify_all();
        unlinked.map_err(|e| Error::io(&path, e))?;
        committed?;
        Ok(true)
    }

    /// Waits until `key` is neither busy nor absent-and-claimable; `None` when it is
    /// committed (access recorded), else marks it busy for the caller.
    fn claim(&self, key: &ChunkKey) -> Option<BusyGuard<'_>> {
        let now = self.clock.now_ms();
        let mut st = self.lock_state();
        loop {
            if st.touch(key, now).is_some() {
                return None;
            }
            if !st.busy.contains(key) {
                st.busy.insert(*key);
                return Some(BusyGuard {
                    inner: self,
                    key: *key,
                });
            }
            self.settled.wait(&mut st);
        }
    }

    /// Writes a temp file with `fill`. Not fsynced: see [`Inner::commit`].
    fn write_temp<T>(
        &self,
        fill: impl FnOnce(&mut File) -> io::Result<T>,
    ) -> Result<(TempFile, T)> {
        let mut temp = self
            .staging
            .create()
            .map_err(|e| Error::io(self.staging.dir(), e))?;
        let out = fill(temp.file_mut()).map_err(|e| Error::io(temp.path(), e))?;
        Ok((temp, out))
    }

    /// Fails with [`Error::Full`] when `size` more bytes cannot fit even after evicting
    /// every unpinned entry.
    fn room_in(&self, st: &State, size: u64) -> Result<()> {
        if !st.index.has_room(size, self.max_bytes) {
            return Err(Error::Full {
                needed: size,
                max_bytes: self.max_bytes,
                pinned_bytes: st.pinned_bytes(),
            });
        }
        Ok(())
    }

    fn check_room(&self, size: u64) -> Result<()> {
        self.room_in(&self.lock_state(), size)
    }

    /// Makes room, renames the temp file into place and commits its record.
    fn commit(&self, guard: BusyGuard<'_>, temp: TempFile, size: u64) -> Result<()> {
        let key = guard.key;
        let victims = {
            let mut st = self.lock_state();
            self.room_in(&st, size)?;
            let victims = st.take_victims(self.max_bytes.saturating_sub(size));
            st.index.reserve(size);
            victims
        };
        let evicted = self.evict(victims);
        let now = self.clock.now_ms();
        let path = self.entry_path(&key);
        // Neither the file nor its directory is fsynced and the record is written by
        // the next flush, not here: a put is on the critical path of every cold read,
        // and three fsyncs plus a metadata commit cost more than fetching the chunk.
        // Nothing is lost for safety: a process that opens the store adopts files
        // without records as unverified, drops records whose file is missing or of the
        // wrong size, and hashes every entry on its first read, so a chunk torn by a
        // crash reads as a miss, never as wrong bytes.
        // A temp file not committed is removed when `temp` drops.
        let placed = evicted.and_then(|()| {
            temp.commit(&path, Durability::RenameOnly)
                .map_err(|e| Error::io(&path, e))
        });
        let mut st = self.lock_state();
        st.index.release(size);
        match placed {
            Ok(()) => {
                st.insert(
                    key,
                    size,
                    Entry {
                        last_access_ms: now,
                        verified_at_ms: now,
                        verified: true,
                        generation: 0,
                    },
                );
                // Recorded, with its tick, by the next flush.
                st.dirty.insert(key);
                drop(st);
                bump(&self.counters.inserts, 1);
                drop(guard);
                Ok(())
            }
            Err(e) => {
                drop(st);
                drop(guard);
                Err(e)
            }
        }
    }

    /// Deletes evicted entries (already out of the index and marked busy): records first,
    /// then files, then un-busies them. A crash in between leaves files without records,
    /// which the next open adopts as unverified entries.
    fn evict(&self, victims: Vec<(ChunkKey, u64)>) -> Result<()> {
        if victims.is_empty() {
            return Ok(());
        }
        let keys: Vec<ChunkKey> = victims.iter().map(|(k, _)| *k).collect();
        let committed = self.remove_records(&keys);
        let mut first_io_error = None;
        for k in &keys {
            let path = self.entry_path(k);
            if let Err(e) = remove_file_if_exists(&path) {
                first_io_error.get_or_insert(Error::io(&path, e));
            }
        }
        {
            let mut st = self.lock_state();
            for k in &keys {
                st.busy.remove(k);
            }
        }
        self.settled.notify_all();
        bump(&self.counters.evictions, keys.len() as u64);
        tracing::debug!(count = keys.len(), "evicted store entries");
        committed?;
        first_io_error.map_or(Ok(()), Err)
    }

    fn remove_records(&self, keys: &[ChunkKey]) -> Result<()> {
        // Not while a flush writes: it may hold a batch taken before these entries left
        // the index, and would otherwise write their records back after this removal.
        let _io = self.flush_io.lock();
        let txn = self.db.begin_write().map_err(Error::db)?;
        {
            let mut entries = txn.open_table(ENTRIES).map_err(Error::db)?;
            for k in keys {
                entries.remove(k.raw().as_slice()).map_err(Error::db)?;
            }
        }
        txn.commit().map_err(Error::db)
    }

    /// Releases `owner`'s pins; with `only_restored`, only if it is still a restored owner
    /// that has not re-registered (checked under the pin lock, so a concurrent
    /// re-registration wins).
    fn unpin_owner(&self, owner: &str, only_restored: bool) -> Result<usize> {
        let _io = self.pin_io.lock();
        let released = {
            let mut st = self.lock_state();
            match st.owners.get(owner) {
                None => return Ok(0),
                Some(o) if only_restored && o.restore_deadline_ms.is_none() => return Ok(0),
                Some(_) => {}
            }
            let Some(o) = st.owners.remove(owner) else {
                return Ok(0);
            };
            for k in &o.keys {
                st.drop_pin(k);
            }
            o.keys.len()
        };
        let txn = self.db.begin_write().map_err(Error::db)?;
        {
            let mut pins = txn.open_multimap_table(PINS).map_err(Error::db)?;
            pins.remove_all(owner).map_err(Error::db)?;
        }
        txn.commit().map_err(Error::db)?;
        Ok(released)
    }

    fn expire_restored_pins(&self) -> Result<Vec<String>> {
        if !self.restore_pending.load(Ordering::Relaxed) {
            return Ok(Vec::new());
        }
        let now = self.clock.now_ms();
        let expired: Vec<String> = {
            let st = self.lock_state();
            let pending = st.owners.values().any(|o| o.restore_deadline_ms.is_some());
            if !pending {
                self.restore_pending.store(false, Ordering::Relaxed);
            }
            st.owners
                .iter()
                .filter(|(_, o)| o.restore_deadline_ms.is_some_and(|d| d <= now))
                .map(|(name, _)| name.clone())
                .collect()
        };
        let mut released = Vec::new();
        for owner in expired {
            if self.unpin_owner(&owner, true)? > 0 {
                tracing::info!(
                    owner,
                    "pins of an owner that did not come back after restart released"
                );
                released.push(owner);
            }
        }
        Ok(released)
    }

    fn flush(&self) -> Result<()> {
        let _io = self.flush_io.lock();
        let batch: Vec<(ChunkKey, Record)> = {
            let mut st = self.lock_state();
            let dirty = std::mem::take(&mut st.dirty);
            dirty
                .into_iter()
                .filter_map(|k| {
                    st.index.get(&k).map(|e| {
                        (
                            k,
                            Record {
                                size: e.size(),
                                last_access_ms: e.value.last_access_ms,
                                tick: e.tick(),
                                verified_at_ms: e.value.verified_at_ms,
                            },
                        )
                    })
                })
                .collect()
        };
        if batch.is_empty() {
            return Ok(());
        }
        let written = (|| -> Result<()> {
            let txn = self.db.begin_write().map_err(Error::db)?;
            {
                let mut entries = txn.open_table(ENTRIES).map_err(Error::db)?;
                // Every key of the batch was in the index when it was taken, and removals
                // of records wait for this flush (`remove_records`), so none of these
                // writes brings back the record of an entry removed meanwhile.
                for (k, rec) in &batch {
                    entries
                        .insert(k.raw().as_slice(), rec.encode().as_slice())
                        .map_err(Error::db)?;
                }
            }
            txn.commit().map_err(Error::db)
        })();
        if written.is_err() {
            let mut st = self.lock_state();
            st.dirty.extend(batch.iter().map(|(k, _)| *k));
        }
        written
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        let st = self.lock_state();
        assert_eq!(st.index.inconsistency(), None);
        for (k, _) in st.index.iter() {
            let owners = st.owners.values().filter(|o| o.keys.contains(k)).count();
            assert_eq!(st.index.pins(k) as usize, owners, "pin count of {k}");
        }
        for o in st.owners.values() {
            for k in &o.keys {
                let owners = st.owners.values().filter(|o| o.keys.contains(k)).count();
                assert_eq!(st.index.pins(k) as usize, owners, "pin count of {k}");
            }
        }
        assert!(st.busy.iter().all(|k| !st.index.contains(k)));
    }
}

/// Files under chunks/ as found at open, matched against the metadata.
struct Reconciled {
    records: Vec<(ChunkKey, Record)>,
    pins: Vec<(String, ChunkKey)>,
    remove_records: Vec<Vec<u8>>,
    insert_records: Vec<(ChunkKey, Record)>,
    remove_pins: Vec<(String, Vec<u8>)>,
}

fn reconcile(
    chunks_dir: &Path,
    loaded: meta::Loaded,
    report: &mut OpenReport,
) -> Result<Reconciled> {
    let mut records: HashMap<ChunkKey, Record> = loaded.records.into_iter().collect();
    let mut out = Reconciled {
        records: Vec::new(),
        pins: loaded.pins,
        remove_records: loaded.bad_records,
        insert_records: Vec::new(),
        remove_pins: loaded.bad_pins,
    };
    report.dropped_entries += out.remove_records.len() as u64;
    let mut kept: HashMap<ChunkKey, Record> = HashMap::new();
    for sub in read_dir(chunks_dir)? {
        let sub_name = sub.file_name();
        let sub_path = sub.path();
        let sub_type = sub.file_type().map_err(|e| Error::io(&sub_path, e))?;
        let prefix = sub_name.to_str().filter(|n| is_fanout_name(n));
        let Some(prefix) = prefix.filter(|_| sub_type.is_dir()) else {
            if sub_type.is_dir() {
                tracing::warn!(path = %sub_path.display(), "unexpected directory in the chunk store; left alone");
            } else {
                remove_file_if_exists(&sub_path).map_err(|e| Error::io(&sub_path, e))?;
                report.removed_stray_files += 1;
            }
            continue;
        };
        for file in read_dir(&sub_path)? {
            let path = file.path();
            let ftype = file.file_type().map_err(|e| Error::io(&path, e))?;
            let key = file
                .file_name()
                .to_str()
                .filter(|n| n.starts_with(prefix))
                .and_then(ChunkKey::from_hex);
            let Some(key) = key.filter(|_| ftype.is_file()) else {
                if ftype.is_dir() {
                    tracing::warn!(path = %path.display(), "unexpected directory in the chunk store; left alone");
                } else {
                    remove_file_if_exists(&path).map_err(|e| Error::io(&path, e))?;
                    report.removed_stray_files += 1;
                }
                continue;
            };
            let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
            if meta.permissions().mode() & 0o077 != 0 {
                // Written before store files were private.
                fs::set_permissions(&path, fs::Permissions::from_mode(crate::PRIVATE_FILE_MODE))
                    .map_err(|e| Error::io(&path, e))?;
            }
            let len = meta.len();
            match records.remove(&key) {
                Some(rec) if rec.size == len => {
                    kept.insert(key, rec);
                }
                Some(_) => {
                    // Wrong size: damaged after commit. Drop file and record.
                    remove_file_if_exists(&path).map_err(|e| Error::io(&path, e))?;
                    out.remove_records.push(key.raw().to_vec());
                    report.dropped_entries += 1;
                }
                None => {
                    // Renamed into place but the record never committed (or metadata was
                    // rebuilt): keep it, unverified, first in line for eviction.
                    let rec = Record {
                        size: len,
                        last_access_ms: 0,
                        tick: 0,
                        verified_at_ms: 0,
                    };
                    out.insert_records.push((key, rec));
                    kept.insert(key, rec);
                    report.adopted_files += 1;
                }
            }
        }
    }
    // Records whose file is gone.
    for key in records.into_keys() {
        out.remove_records.push(key.raw().to_vec());
        report.dropped_entries += 1;
    }
    out.records = kept.into_iter().collect();
    Ok(out)
}

fn is_fanout_name(n: &str) -> bool {
    n.len() == 2
        && n.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn read_dir(dir: &Path) -> Result<Vec<fs::DirEntry>> {
    fs::read_dir(dir)
        .and_then(|it| it.collect::<io::Result<Vec<_>>>())
        .map_err(|e| Error::io(dir, e))
}

/// Creates chunks/00 … chunks/ff, so a put never has to create a directory.
fn ensure_fanout_dirs(chunks_dir: &Path) -> Result<()> {
    let mut created = false;
    for b in 0..=255u8 {
        let dir = chunks_dir.join(hex::encode([b]));
        match fs::DirBuilder::new()
            .mode(crate::PRIVATE_DIR_MODE)
            .create(&dir)
        {
            Ok(()) => created = true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                crate::tighten(&dir, crate::PRIVATE_DIR_MODE).map_err(|e| Error::io(&dir, e))?;
            }
            Err(e) => return Err(Error::io(&dir, e)),
        }
    }
    if created {
        sync_dir(chunks_dir)?;
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

fn remove_file_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Opens an entry's file read-only for a read of the live store or the seed; `None` when
/// it does not exist. Never follows a symbolic link and never blocks on a FIFO (a seed
/// comes from a volume that strangers may have filled); [`read_entry`] and
/// [`check_entry`] refuse anything but a regular file.
fn open_entry(path: &Path) -> io::Result<Option<File>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // Blocking reads from here on (the handle may be handed to the kernel for FUSE
    // passthrough). SAFETY: F_GETFL/F_SETFL on a descriptor this function owns; no
    // memory is passed.
    let cleared = unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(file))
}

/// Checks an opened entry file against what it must be: a regular file of `size` bytes
/// and, unless `trusted`, hashing (through this handle) to `key`.
fn check_entry(
    file: &File,
    key: &ChunkKey,
    size: u64,
    trusted: bool,
) -> io::Result<std::result::Result<(), Unservable>> {
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() != size {
        return Ok(Err(Unservable::Corrupt));
    }
    if !trusted && hash_file(file, size)? != Some(*key) {
        return Ok(Err(Unservable::Corrupt));
    }
    Ok(Ok(()))
}

/// Reads an opened entry file whole, checked like [`check_entry`] (hashing the bytes
/// read, so they are read once).
fn read_entry(
    file: &File,
    key: &ChunkKey,
    size: u64,
    trusted: bool,
) -> io::Result<std::result::Result<Vec<u8>, Unservable>> {
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() != size {
        return Ok(Err(Unservable::Corrupt));
    }
    let too_large = || io::Error::new(io::ErrorKind::OutOfMemory, "entry too large");
    let len = usize::try_from(size).map_err(|_| too_large())?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(len).map_err(|_| too_large())?;
    file.take(size).read_to_end(&mut buf)?;
    if buf.len() != len || (!trusted && ChunkKey::of(&buf) != *key) {
        return Ok(Err(Unservable::Corrupt));
    }
    Ok(Ok(buf))
}

/// Hashes exactly `len` bytes of `file`; `None` if it is shorter.
fn hash_file(file: &File, len: u64) -> io::Result<Option<ChunkKey>> {
    let mut hasher = Sha256::new();
    let mut buf = vec![
        0u8;
        IO_BLOCK
            .min(usize::try_from(len).unwrap_or(IO_BLOCK))
            .max(1)
    ];
    let mut off = 0u64;
    while off < len {
        let want = usize::try_from((len - off).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = file.read_at(&mut buf[..want], off)?;
        if n == 0 {
            return Ok(None);
        }
        hasher.update(&buf[..n]);
        off += n as u64;
    }
    Ok(Some(ChunkKey::from_raw(hasher.finalize().into())))
}

/// Copies `reader` into `out` while hashing; stops after `max + 1` bytes so an oversized
/// input is detected without reading it all.
fn copy_hashing(reader: &mut dyn Read, out: &mut File, max: u64) -> io::Result<(u64, ChunkKey)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; IO_BLOCK];
    let mut total = 0u64;
    let mut limited = reader.take(max.saturating_add(1));
    loop {
        let n = match limited.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        total += n as u64;
    }
    Ok((total, ChunkKey::from_raw(hasher.finalize().into())))
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[path = "export.rs"]
pub(crate) mod export;

#[path = "seed.rs"]
pub(crate) mod seed;

#[path = "image_meta.rs"]
pub(crate) mod image_meta;

use seed::Seed;

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
