//! The file cache: whole regular files of layers, decompressed, kept on local disk so a
//! file that is fully local can be served at native speed (FUSE passthrough, or plain
//! `pread` when passthrough is unavailable) instead of being inflated span by span.
//!
//! Node-wide and shared by every mount (and by every ferry process on the node: all
//! state that matters is on disk). Layout under its directory (by default
//! `<chunk store root>/files/`):
//! - `data/<key hex>.<sha256 hex>`: one file per cached layer file, named by its
//!   [`FileKey`] and the SHA-256 of its content (so [`FileCache::verify`] can recheck
//!   it), created only by rename after an fsync, never modified in place; an open
//!   handle stays valid after eviction unlinks it. Its mtime is the last use (LRU order
//!   survives restarts).
//! - `tmp/<pid>-<n>.part`: files being written; left-overs of dead processes are removed
//!   on open.
//!
//! The temp files, their recovery, the synced rename and the LRU index are the node's
//! shared disk-cache primitive's ([`ferry_store::diskcache`]); the names, the hashes and
//! the rescans of a directory other processes write too are this module's.
//!
//! The bytes come from the device layer, which verifies every span against the index
//! before inflating, so a cached file is as trustworthy as a read through FUSE.
//! Materialization runs on one low-priority background thread with a bounded queue,
//! never in a FUSE request. This module must not know FUSE or layer formats: callers
//! hand it a key, a length and a closure writing the bytes.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_store::Store;
use ferry_store::diskcache::{Durability, LruIndex, Staging, TempRecovery};
use parking_lot::{Condvar, Mutex};
use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};

/// Default bound on cached bytes.
pub const DEFAULT_FILE_CACHE_BYTES: u64 = 2 << 30;

/// Default bound on the small-file pack: a pandas start reads about 25 MB of small
/// files, so this holds the small files of tens of starts.
pub const DEFAULT_PACK_BYTES: u64 = 512 << 20;

/// Materializations waiting for the worker at most; more are dropped (they are
/// retried the next time the file qualifies).
const QUEUE_LEN: usize = 64;

/// A use refreshes the file's mtime (the persisted LRU order) at most this often.
const TOUCH_EVERY: Duration = Duration::from_secs(60);

/// Block size for hashing and copying.
const IO_BLOCK: usize = 1 << 20;

/// How the file cache behaves; what the daemon's configuration sets.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileCacheConfig {
    /// Use the file cache at all.
    pub enabled: bool,
    /// Where it lives; `None`: `files/` under the chunk store's root.
    pub dir: Option<PathBuf>,
    /// Bound on cached bytes; least recently used files are evicted to stay under it.
    pub max_bytes: u64,
    /// A file read in full through the mount is materialized when at least this big
    /// (smaller ones are served well enough by the page cache).
    pub min_file_bytes: u64,
    /// A file opened while all its data is already in the chunk store is materialized
    /// right away when at least this big (0: never on open).
    pub eager_min_bytes: u64,
    /// Serve cached files through FUSE passthrough when the kernel allows it.
    pub passthrough: bool,
    /// Bound on the small-file pack (files under `min_file_bytes` that a start reads,
    /// kept decompressed together; [`crate::filepack`]); 0 turns it off.
    pub pack_max_bytes: u64,
}

impl Default for FileCacheConfig {
    fn default() -> Self {
        FileCacheConfig {
            enabled: true,
            dir: None,
            max_bytes: DEFAULT_FILE_CACHE_BYTES,
            min_file_bytes: 256 << 10,
            eager_min_bytes: 1 << 20,
            passthrough: true,
            pack_max_bytes: DEFAULT_PACK_BYTES,
        }
    }
}

/// Identity of one file of one layer: a hash of the layer's identity and the file's
/// place in it, so the same file of the same layer is cached once for every image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileKey([u8; 32]);

impl FileKey {
    /// The key of the `size`-byte file whose data starts at `data_offset` of the layer
    /// identified by `layer` (a layer digest, or anything as unique), in `offset_space`
    /// (what the offset is relative to, e.g. `"tar"` or `"estargz"`).
    pub fn new(layer: &str, offset_space: &str, data_offset: u64, size: u64) -> FileKey {
        let mut h = Sha256::new();
        h.update(b"ferry-file-cache-v1\0");
        h.update(layer.as_bytes());
        h.update([0]);
        h.update(offset_space.as_bytes());
        h.update([0]);
        h.update(data_offset.to_be_bytes());
        h.update(size.to_be_bytes());
        FileKey(h.finalize().into())
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key with these bytes (as [`FileKey::as_bytes`] gave them).
    pub fn from_bytes(bytes: [u8; 32]) -> FileKey {
        FileKey(bytes)
    }

    /// Lower-case hex.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    fn from_hex(s: &str) -> Option<FileKey> {
        parse_hex32(s).map(FileKey)
    }
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if !ferry_oci::digest::is_sha256_hex(s) {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// A cached file opened for reading: read-only, never modified in place.
#[derive(Debug)]
pub struct CachedFile {
    file: File,
    len: u64,
}

impl CachedFile {
    /// The open file (what FUSE passthrough is given).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads up to `buf.len()` bytes at `offset`, fewer only at the end of the file.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        read_full_at(&self.file, buf, offset)
    }

    /// Takes the file.
    pub fn into_file(self) -> File {
        self.file
    }
}

/// Reads up to `buf.len()` bytes of `file` at `offset`, fewer only at its end (a short
/// `pread` is retried, as is an interrupted one).
pub(crate) fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// What [`FileCache::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Written and committed.
    Stored,
    /// Already cached; nothing written.
    AlreadyPresent,
    /// Larger than the whole cache; not written.
    TooLarge,
}

/// Writes the bytes of a file being materialized.
pub type FillFn = Box<dyn FnOnce(&mut dyn Write) -> io::Result<()> + Send>;

/// Decides on the worker whether a queued materialization still goes ahead.
pub type CheckFn = Box<dyn FnOnce() -> bool + Send>;

/// A file to materialize in the background.
pub struct Materialize {
    /// Its key.
    pub key: FileKey,
    /// Its exact length.
    pub len: u64,
    /// Checked on the worker first; `false` skips the job quietly (e.g. "not all of the
    /// file's data is local").
    pub only_if: Option<CheckFn>,
    /// Writes exactly `len` bytes of the file.
    pub fill: FillFn,
}

impl std::fmt::Debug for Materialize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Materialize")
            .field("key", &self.key.hex())
            .field("len", &self.len)
            .finish()
    }
}

/// Counters of the file cache (node-wide).
#[derive(Debug, Default)]
pub struct FileCacheStats {
    /// Lookups that found the file.
    pub hits: AtomicU64,
    /// Lookups that did not.
    pub misses: AtomicU64,
    /// Files written.
    pub materialized: AtomicU64,
    /// Materializations that failed (read, write or length errors).
    pub failures: AtomicU64,
    /// Materializations skipped by their precondition or a full queue.
    pub skipped: AtomicU64,
    /// Files evicted to stay under the bound.
    pub evicted: AtomicU64,
    /// Opens served through FUSE passthrough.
    pub passthrough_opens: AtomicU64,
    /// Opens served from a cached file with pread (passthrough unavailable or the inode
    /// already open in cached mode).
    pub pread_opens: AtomicU64,
}

/// A copy of [`FileCacheStats`] plus the occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct FileCacheSnapshot {
    /// Files cached.
    pub files: u64,
    /// Bytes cached.
    pub bytes: u64,
    /// See [`FileCacheStats::hits`].
    pub hits: u64,
    /// See [`FileCacheStats::misses`].
    pub misses: u64,
    /// See [`FileCacheStats::materialized`].
    pub materialized: u64,
    /// See [`FileCacheStats::failures`].
    pub failures: u64,
    /// See [`FileCacheStats::skipped`].
    pub skipped: u64,
    /// See [`FileCacheStats::evicted`].
    pub evicted: u64,
    /// See [`FileCacheStats::passthrough_opens`].
    pub passthrough_opens: u64,
    /// See [`FileCacheStats::pread_opens`].
    pub pread_opens: u64,
    /// Files queued or being materialized right now.
    #[serde(default)]
    pub pending: u64,
    /// Small files in the small-file pack ([`crate::filepack`]).
    #[serde(default)]
    pub pack_files: u64,
    /// Their bytes.
    #[serde(default)]
    pub pack_bytes: u64,
    /// Reads served from the pack.
    #[serde(default)]
    pub pack_hits: u64,
}

/// What [`FileCache::verify`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct FileVerifyReport {
    /// Files whose content was hashed.
    pub checked: u64,
    /// Files whose content did not match their recorded SHA-256 (removed).
    pub corrupt: u64,
    /// Files that vanished or could not be read (forgotten).
    pub unreadable: u64,
}

/// One cached file as the index knows it (its length is the index's size).
#[derive(Debug, Clone, Copy)]
struct Item {
    sha256: [u8; 32],
    last_used_ms: u64,
    touched_ms: u64,
}

#[derive(Debug, Default)]
struct State {
    items: LruIndex<FileKey, Item>,
    /// Keys queued or being written.
    pending: HashSet<FileKey>,
    /// Keys a [`FileCache::put`] is writing now.
    writing: HashSet<FileKey>,
}

/// The node-wide cache of decompressed files. Cheap to share (`Arc`).
pub struct FileCache {
    config: FileCacheConfig,
    data_dir: PathBuf,
    staging: Staging,
    chunk_store: Option<Arc<Store>>,
    state: Mutex<State>,
    /// Signalled when a put ends (see [`FileCache::wait_written`]).
    written: Condvar,
    stats: FileCacheStats,
    worker: Mutex<Option<SyncSender<Materialize>>>,
    /// Reads served through FUSE so far (by every mount using the cache): the worker
    /// waits for them to pause before materializing.
    foreground_reads: Arc<AtomicU64>,
    /// Small files kept together; `None` when off or another process appends to it.
    pack: Option<crate::filepack::FilePack>,
}

impl std::fmt::Debug for FileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileCache")
            .field("dir", &self.data_dir)
            .field("max_bytes", &self.config.max_bytes)
            .finish()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn mtime_ms(meta: &fs::Metadata) -> u64 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn file_name(key: &FileKey, sha256: &[u8; 32]) -> String {
    format!("{}.{}", key.hex(), hex::encode(sha256))
}

fn parse_name(name: &str) -> Option<(FileKey, [u8; 32])> {
    let (k, s) = name.split_once('.')?;
    Some((FileKey::from_hex(k)?, parse_hex32(s)?))
}

/// Counts bytes and hashes them on the way to the file.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
    limit: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.written + buf.len() as u64 > self.limit {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("file is longer than its {} bytes", self.limit),
            ));
        }
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl FileCache {
    /// Opens (creating if needed) the cache `config` describes; `chunk_store` is the
    /// node chunk store (the default parent directory, and what "all data is local"
    /// is checked against). Removes temporary files of dead processes and stray files.
    pub fn open(config: &FileCacheConfig, chunk_store: Option<Arc<Store>>) -> Result<FileCache> {
        let dir = match (&config.dir, &chunk_store) {
            (Some(d), _) => d.clone(),
            (None, Some(s)) => s.root().join("files"),
            (None, None) => {
                return Err(Error::Invalid(
                    "the file cache needs a directory or a chunk store".into(),
                ));
            }
        };
        let data_dir = dir.join("data");
        let tmp_dir = dir.join("tmp");
        // Decompressed copies of files that may be 0600 in their image: root's alone.
        for d in [&dir, &data_dir] {
            ferry_store::private_dir(d)
                .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
        }
        // Other ferry processes of the node may be writing here.
        let (staging, _) = Staging::open(&tmp_dir, TempRecovery::DeadProcesses)
            .map_err(|e| Error::io(format!("recovering {}", tmp_dir.display()), e))?;
        let pack = if config.pack_max_bytes > 0 {
            let pack_dir = dir.join("pack");
            let pack = crate::filepack::FilePack::open(&pack_dir, config.pack_max_bytes)
                .map_err(|e| Error::io(format!("opening {}", pack_dir.display()), e))?;
            if pack.is_none() {
                tracing::info!(dir = %pack_dir.display(), "another ferry process keeps the small-file pack; small files are read through their layers");
            }
            pack
        } else {
            None
        };
        let cache = FileCache {
            config: config.clone(),
            data_dir,
            staging,
            chunk_store,
            state: Mutex::new(State::default()),
            written: Condvar::new(),
            stats: FileCacheStats::default(),
            worker: Mutex::new(None),
            foreground_reads: Arc::new(AtomicU64::new(0)),
            pack,
        };
        {
            let mut st = cache.state.lock();
            cache.rescan(&mut st)?;
            cache.evict_to(&mut st, cache.config.max_bytes, None);
        }
        Ok(cache)
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &FileCacheConfig {
        &self.config
    }

    /// The small-file pack, when on and this process appends to it.
    pub fn pack(&self) -> Option<&crate::filepack::FilePack> {
        self.pack.as_ref()
    }

    /// The chunk store it was opened with.
    pub fn chunk_store(&self) -> Option<&Arc<Store>> {
        self.chunk_store.as_ref()
    }

    /// Live counters.
    pub fn stats(&self) -> &FileCacheStats {
        &self.stats
    }

    /// Counters and occupancy now.
    pub fn snapshot(&self) -> FileCacheSnapshot {
        let (files, bytes, pending) = {
            let st = self.state.lock();
            (
                st.items.len() as u64,
                st.items.bytes(),
                st.pending.len() as u64,
            )
        };
        let (pack_files, pack_bytes) = self.pack.as_ref().map_or((0, 0), |p| p.occupancy());
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let s = &self.stats;
        FileCacheSnapshot {
            files,
            bytes,
            hits: l(&s.hits),
            misses: l(&s.misses),
            materialized: l(&s.materialized),
            failures: l(&s.failures),
            skipped: l(&s.skipped),
            evicted: l(&s.evicted),
            passthrough_opens: l(&s.passthrough_opens),
            pread_opens: l(&s.pread_opens),
            pending,
            pack_files,
            pack_bytes,
            pack_hits: self.pack.as_ref().map_or(0, |p| l(&p.stats().hits)),
        }
    }

    /// True when `key` is cached (as far as this process knows).
    pub fn contains(&self, key: &FileKey) -> bool {
        self.state.lock().items.contains(key)
    }

    /// Waits, at most `timeout`, while a put writes `key`; true when it is cached then.
    /// An open that finds its file being written (prefetch materializes the files a
    /// startup trace reads, just ahead of the workload) waits a moment for it and gets
    /// the cached file, instead of serving every read of it through FUSE.
    pub fn wait_written(&self, key: &FileKey, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        while st.writing.contains(key) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            self.written.wait_for(&mut st, left);
        }
        st.items.contains(key)
    }

    /// True while a put writes `key`.
    #[cfg(test)]
    pub(crate) fn is_writing(&self, key: &FileKey) -> bool {
        self.state.lock().writing.contains(key)
    }

    /// Opens cached file `key` when it is there and `len` bytes long; a use for the LRU.
    pub fn get(&self, key: &FileKey, len: u64) -> Option<CachedFile> {
        let now = now_ms();
        let (item, touch) = {
            let mut st = self.state.lock();
            // A use only when the length matches (another length is another file).
            let slot = match st.items.get(key) {
                Some(s) if s.size() == len => st.items.touch(key),
                _ => None,
            };
            let Some(slot) = slot else {
                drop(st);
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            let item = &mut slot.value;
            item.last_used_ms = now;
            let touch = now.saturating_sub(item.touched_ms) >= TOUCH_EVERY.as_millis() as u64;
            if touch {
                item.touched_ms = now;
            }
            (*item, touch)
        };
        let path = self.data_dir.join(file_name(key, &item.sha256));
        let opened = File::open(&path).and_then(|f| {
            let meta = f.metadata()?;
            Ok((f, meta.len()))
        });
        match opened {
            Ok((file, on_disk)) if on_disk == len => {
                if touch {
                    // Best effort: the persisted LRU order only matters after a restart.
                    let _ = file.set_modified(SystemTime::now());
                }
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                Some(CachedFile { file, len })
            }
            other => {
                // Evicted by another process, or damaged: forget it (and drop a bad file).
                if other.is_ok() {
                    let _ = fs::remove_file(&path);
                }
                self.forget(key);
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn forget(&self, key: &FileKey) {
        self.state.lock().items.remove(key);
    }

    /// Writes file `key` of `len` bytes with `fill` (temporary file, fsync, rename),
    /// records its SHA-256 and evicts least recently used files to stay under the bound.
    /// Fails, leaving nothing behind, when `fill` fails or writes other than `len` bytes.
    pub fn put(
        &self,
        key: &FileKey,
        len: u64,
        fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> Result<PutOutcome> {
        if len > self.config.max_bytes {
            return Ok(PutOutcome::TooLarge);
        }
        {
            let mut st = self.state.lock();
            if st.items.contains(key) {
                return Ok(PutOutcome::AlreadyPresent);
            }
            st.writing.insert(*key);
        }
        // Ends the `writing` mark on every path out, waking waiting opens.
        struct Writing<'a>(&'a FileCache, FileKey);
        impl Drop for Writing<'_> {
            fn drop(&mut self) {
                self.0.state.lock().writing.remove(&self.1);
                self.0.written.notify_all();
            }
        }
        let _writing = Writing(self, *key);
        // A temp file not committed (a failed fill, a crash) never enters `data/`: the
        // guard removes it, or the next open's recovery does.
        let mut temp = self.staging.create().map_err(|e| {
            Error::io(
                format!("creating a file in {}", self.staging.dir().display()),
                e,
            )
        })?;
        let sha256 = write_hashed(temp.file_mut(), len, fill)?;
        let path = self.data_dir.join(file_name(key, &sha256));
        temp.commit(&path, Durability::Synced)
            .map_err(|e| Error::io(format!("committing {}", path.display()), e))?;
        let now = now_ms();
        let mut st = self.state.lock();
        let item = Item {
            sha256,
            last_used_ms: now,
            touched_ms: now,
        };
        if let Some((_, old)) = st.items.insert(*key, len, item)
            && old.sha256 != sha256
        {
            let _ = fs::remove_file(self.data_dir.join(file_name(key, &old.sha256)));
        }
        if st.items.bytes() > self.config.max_bytes {
            // Other processes may have added files: look at the directory first.
            if let Err(e) = self.rescan(&mut st) {
                tracing::warn!(error = %e, "file cache: rescanning before eviction failed");
            }
            self.evict_to(&mut st, self.config.max_bytes, Some(key));
        }
        drop(st);
        self.stats.materialized.fetch_add(1, Ordering::Relaxed);
        Ok(PutOutcome::Stored)
    }

    /// Queues `job` for the background worker (started on first use, at low CPU
    /// priority). Returns false when the key is cached, already queued, or the queue is
    /// full. Never blocks.
    pub fn schedule(self: &Arc<Self>, job: Materialize) -> bool {
        if job.len > self.config.max_bytes {
            return false;
        }
        {
            let mut st = self.state.lock();
            if st.items.contains(&job.key) || !st.pending.insert(job.key) {
                return false;
            }
        }
        let key = job.key;
        let mut worker = self.worker.lock();
        if worker.is_none() {
            match self.spawn_worker() {
                Ok(tx) => *worker = Some(tx),
                Err(e) => {
                    tracing::warn!(error = %e, "file cache: cannot start the worker");
                    drop(worker);
                    self.state.lock().pending.remove(&key);
                    return false;
                }
            }
        }
        let sent = match worker.as_ref().map(|tx| tx.try_send(job)) {
            Some(Ok(())) => true,
            Some(Err(TrySendError::Full(_))) | None => false,
            Some(Err(TrySendError::Disconnected(_))) => {
                *worker = None;
                false
            }
        };
        drop(worker);
        if !sent {
            self.state.lock().pending.remove(&key);
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// True while `key` is queued or being written.
    pub fn is_pending(&self, key: &FileKey) -> bool {
        self.state.lock().pending.contains(key)
    }

    /// Notes a read served through FUSE (not by passthrough): materializing waits until
    /// such reads pause (see [`wait_for_quiet`]).
    pub fn note_foreground_read(&self) {
        self.foreground_reads.fetch_add(1, Ordering::Relaxed);
    }

    fn spawn_worker(self: &Arc<Self>) -> io::Result<SyncSender<Materialize>> {
        let (tx, rx) = mpsc::sync_channel::<Materialize>(QUEUE_LEN);
        let weak: Weak<FileCache> = Arc::downgrade(self);
        let reads = self.foreground_reads.clone();
        std::thread::Builder::new()
            .name("ferry-filecache".into())
            .spawn(move || {
                lower_thread_priority();
                // Reads counted when the last job started: a queue worked off while no
                // read comes waits for the quiet once, not once per file.
                let mut seen = None;
                // Ends when the cache (holding the sender) is dropped.
                while let Ok(job) = rx.recv() {
                    if seen != Some(reads.load(Ordering::Relaxed)) {
                        wait_for_quiet(&reads);
                    }
                    seen = Some(reads.load(Ordering::Relaxed));
                    let Some(cache) = weak.upgrade() else { break };
                    cache.run(job);
                }
            })?;
        Ok(tx)
    }

    fn run(&self, job: Materialize) {
        let key = job.key;
        let go = job.only_if.map(|check| check()).unwrap_or(true);
        if go {
            match self.put(&key, job.len, job.fill) {
                Ok(outcome) => {
                    tracing::debug!(key = %key.hex(), len = job.len, ?outcome, "file cached")
                }
                Err(e) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(key = %key.hex(), error = %e, "file cache: materializing failed");
                }
            }
        } else {
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
        }
        self.state.lock().pending.remove(&key);
    }

    /// Rehashes every cached file; removes those whose content no longer matches the
    /// SHA-256 in their name, forgets those that cannot be read.
    pub fn verify(&self) -> Result<FileVerifyReport> {
        let items: Vec<(FileKey, [u8; 32], u64)> = {
            let mut st = self.state.lock();
            self.rescan(&mut st)?;
            st.items
                .iter()
                .map(|(k, s)| (*k, s.value.sha256, s.size()))
                .collect()
        };
        let mut report = FileVerifyReport::default();
        for (key, sha256, size) in items {
            let path = self.data_dir.join(file_name(&key, &sha256));
            match hash_file(&path) {
                Ok((sha, len)) if sha == sha256 && len == size => report.checked += 1,
                Ok(_) => {
                    report.checked += 1;
                    report.corrupt += 1;
                    tracing::warn!(path = %path.display(), "file cache: corrupt file removed");
                    let _ = fs::remove_file(&path);
                    self.forget(&key);
                }
                Err(_) => {
                    report.unreadable += 1;
                    self.forget(&key);
                }
            }
        }
        Ok(report)
    }

    /// Rebuilds the index from `data/`, keeping the in-memory use times of known files
    /// and removing files whose names are not cache names.
    fn rescan(&self, st: &mut State) -> Result<()> {
        let rd = fs::read_dir(&self.data_dir)
            .map_err(|e| Error::io(format!("listing {}", self.data_dir.display()), e))?;
        let mut found: HashMap<FileKey, (Item, u64)> = HashMap::new();
        for ent in rd {
            let ent = ent.map_err(|e| Error::io("listing the file cache", e))?;
            let name = ent.file_name();
            let parsed = name.to_str().and_then(parse_name);
            let Ok(meta) = ent.metadata() else { continue };
            let Some((key, sha256)) = parsed.filter(|_| meta.is_file()) else {
                let _ = fs::remove_file(ent.path());
                continue;
            };
            if meta.permissions().mode() & 0o077 != 0 {
                // Written before the cache was private.
                ferry_store::tighten(&ent.path(), ferry_store::PRIVATE_FILE_MODE)
                    .map_err(|e| Error::io("tightening a cached file's mode", e))?;
            }
            let last_used_ms = st
                .items
                .get(&key)
                .filter(|s| s.value.sha256 == sha256)
                .map(|s| s.value.last_used_ms)
                .unwrap_or_else(|| mtime_ms(&meta));
            let item = Item {
                sha256,
                last_used_ms,
                touched_ms: last_used_ms,
            };
            if let Some((dup, _)) = found.insert(key, (item, meta.len())) {
                // Two contents for one key (cannot happen with verified sources): keep one.
                let _ = fs::remove_file(self.data_dir.join(file_name(&key, &dup.sha256)));
            }
        }
        // Least recently used first, so the index's order is the use order.
        let mut found: Vec<(FileKey, (Item, u64))> = found.into_iter().collect();
        found.sort_by_key(|(k, (item, _))| (item.last_used_ms, *k));
        let mut items = LruIndex::new();
        for (key, (item, len)) in found {
            items.insert(key, len, item);
        }
        st.items = items;
        Ok(())
    }

    /// Evicts least recently used files (never `keep`) until at most `target` bytes
    /// are cached.
    fn evict_to(&self, st: &mut State, target: u64, keep: Option<&FileKey>) {
        if let Some(k) = keep {
            st.items.pin(*k);
        }
        let victims = st.items.take_victims(target);
        if let Some(k) = keep {
            st.items.unpin(k);
        }
        for victim in victims {
            let path = self
                .data_dir
                .join(file_name(&victim.key, &victim.value.sha256));
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "file cache: eviction failed")
                }
            }
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Writes exactly `len` bytes with `fill` into `file`, synced by the commit; returns their
/// SHA-256.
fn write_hashed(
    file: &mut File,
    len: u64,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<[u8; 32]> {
    let mut w = HashingWriter {
        inner: BufWriter::with_capacity(IO_BLOCK, file),
        hasher: Sha256::new(),
        written: 0,
        limit: len,
    };
    fill(&mut w).map_err(|e| Error::io("materializing a file", e))?;
    if w.written != len {
        return Err(Error::Invalid(format!(
            "materialized {} bytes of a {len}-byte file",
            w.written
        )));
    }
    w.inner
        .flush()
        .map_err(|e| Error::io("flushing a materialized file", e))?;
    Ok(w.hasher.finalize().into())
}

/// SHA-256 and length of the file at `path`.
fn hash_file(path: &Path) -> io::Result<([u8; 32], u64)> {
    let file = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; IO_BLOCK];
    let mut off = 0u64;
    loop {
        let n = file.read_at(&mut buf, off)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        off += n as u64;
    }
    Ok((h.finalize().into(), off))
}

/// How long FUSE reads must pause before the worker materializes a file.
const QUIET: Duration = Duration::from_millis(100);
/// Longest the worker defers a file while reads go on.
const MAX_DEFER: Duration = Duration::from_secs(5);

/// Waits until no read was served through FUSE for [`QUIET`] (at most [`MAX_DEFER`]).
/// Materializing inflates, hashes and writes whole files: done while a container
/// starts, it takes CPU and disk from the very reads it cannot speed up (an open's
/// mode is fixed when it opens), so it waits for the start's burst of reads to end.
fn wait_for_quiet(reads: &AtomicU64) {
    let mut waited = Duration::ZERO;
    while waited < MAX_DEFER {
        let seen = reads.load(Ordering::Relaxed);
        std::thread::sleep(QUIET);
        waited += QUIET;
        if reads.load(Ordering::Relaxed) == seen {
            return;
        }
    }
}

/// Runs the calling thread at nice 10: materialization must not compete with the
/// workloads being started.
fn lower_thread_priority() {
    // SAFETY: gettid has no preconditions; setpriority only changes this thread's nice
    // value (on Linux PRIO_PROCESS with a tid applies to that thread).
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn config(dir: &Path, max_bytes: u64) -> FileCacheConfig {
        FileCacheConfig {
            dir: Some(dir.to_path_buf()),
            max_bytes,
            ..FileCacheConfig::default()
        }
    }

    fn key(n: u64) -> FileKey {
        FileKey::new("sha256:layer", "tar", n * 512, 100)
    }

    fn put_bytes(cache: &FileCache, k: &FileKey, bytes: &[u8]) -> PutOutcome {
        cache
            .put(k, bytes.len() as u64, |w| w.write_all(bytes))
            .unwrap()
    }

    fn read_all(f: &CachedFile) -> Vec<u8> {
        let mut buf = vec![0u8; f.len() as usize + 10];
        let n = f.read_at(&mut buf, 0).unwrap();
        buf.truncate(n);
        buf
    }

    /// A put of `k` (100 bytes of 7) held in its fill until the sender says whether the
    /// fill succeeds; returns once the put has marked the key.
    fn held_put(
        cache: &Arc<FileCache>,
        k: FileKey,
    ) -> (
        mpsc::Sender<bool>,
        std::thread::JoinHandle<Result<PutOutcome>>,
    ) {
        let (go, gate) = mpsc::channel::<bool>();
        let writer = {
            let cache = cache.clone();
            std::thread::spawn(move || {
                cache.put(&k, 100, |w| {
                    if gate.recv().unwrap() {
                        w.write_all(&[7u8; 100])
                    } else {
                        Err(io::Error::other("fill failed"))
                    }
                })
            })
        };
        while !cache.is_writing(&k) {
            std::thread::yield_now();
        }
        (go, writer)
    }

    /// Cached files are decompressed copies of image files that may be 0600 there: the
    /// cache is root's alone, and a cache made with wider modes is tightened on open.
    #[test]
    fn the_cache_is_private_and_old_caches_are_tightened() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("files");
        let cache = FileCache::open(&config(&root, 1 << 20), None).unwrap();
        cache.put(&key(1), 10, |w| w.write_all(&[1u8; 10])).unwrap();
        drop(cache);
        let file = fs::read_dir(root.join("data"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        for d in [root.clone(), root.join("data"), root.join("tmp")] {
            assert_eq!(mode(&d), 0o700, "{}", d.display());
        }
        assert_eq!(mode(&file), 0o600);
        // As an earlier version left it.
        for (p, m) in [(&root, 0o755), (&root.join("data"), 0o755), (&file, 0o644)] {
            fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();
        }
        let cache = FileCache::open(&config(&root, 1 << 20), None).unwrap();
        assert_eq!((mode(&root), mode(&root.join("data"))), (0o700, 0o700));
        assert_eq!(mode(&file), 0o600);
        assert_eq!(read_all(&cache.get(&key(1), 10).unwrap()), vec![1u8; 10]);
    }

    /// An open that finds its file being written waits for it (bounded), and the mark
    /// ends with the put however it ends.
    #[test]
    fn waiting_for_a_file_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(FileCache::open(&config(dir.path(), 1 << 20), None).unwrap());
        let (k, other) = (key(1), key(2));
        assert!(
            !cache.wait_written(&k, Duration::ZERO),
            "neither cached nor written"
        );
        let (go, writer) = held_put(&cache, k);
        assert!(!cache.is_writing(&other));
        // Bounded: the put is still held.
        assert!(!cache.wait_written(&k, Duration::from_millis(20)));
        let waiter = {
            let cache = cache.clone();
            std::thread::spawn(move || cache.wait_written(&k, Duration::from_secs(30)))
        };
        go.send(true).unwrap();
        assert!(waiter.join().unwrap(), "cached once the put ended");
        assert_eq!(writer.join().unwrap().unwrap(), PutOutcome::Stored);
        assert!(!cache.is_writing(&k));
        assert_eq!(read_all(&cache.get(&k, 100).unwrap()), vec![7u8; 100]);

        // A failed put ends the mark too; the waiter learns it is not cached.
        let (go, writer) = held_put(&cache, other);
        go.send(false).unwrap();
        assert!(!cache.wait_written(&other, Duration::from_secs(30)));
        assert!(writer.join().unwrap().is_err());
        assert!(!cache.is_writing(&other));
    }

    #[test]
    fn keys_differ_by_every_part() {
        let base = FileKey::new("sha256:a", "tar", 512, 10);
        assert_eq!(base, FileKey::new("sha256:a", "tar", 512, 10));
        for other in [
            FileKey::new("sha256:b", "tar", 512, 10),
            FileKey::new("sha256:a", "estargz", 512, 10),
            FileKey::new("sha256:a", "tar", 1024, 10),
            FileKey::new("sha256:a", "tar", 512, 11),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(FileKey::from_hex(&base.hex()), Some(base));
        assert_eq!(FileKey::from_hex("zz"), None);
    }

    #[test]
    fn put_then_get_returns_the_bytes_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let cache = FileCache::open(&config(dir.path(), 1 << 20), None).unwrap();
        let k = key(1);
        assert!(cache.get(&k, 5).is_none());
        assert_eq!(put_bytes(&cache, &k, b"hello"), PutOutcome::Stored);
        assert_eq!(put_bytes(&cache, &k, b"hello"), PutOutcome::AlreadyPresent);
        let f = cache.get(&k, 5).unwrap();
        assert_eq!(read_all(&f), b"hello");
        assert!(cache.get(&k, 6).is_none(), "a length mismatch is a miss");
        let snap = cache.snapshot();
        assert_eq!(
            (snap.files, snap.bytes, snap.hits, snap.materialized),
            (1, 5, 1, 1)
        );
        drop(cache);
        let again = FileCache::open(&config(dir.path(), 1 << 20), None).unwrap();
        assert_eq!(read_all(&again.get(&k, 5).unwrap()), b"hello");
        let names: Vec<String> = fs::read_dir(dir.path().join("data"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let sha = hex::encode(Sha256::digest(b"hello"));
        assert_eq!(names, vec![format!("{}.{sha}", k.hex())]);
    }

    #[test]
    fn failed_or_short_fills_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cache = FileCache::open(&config(dir.path(), 1 << 20), None).unwrap();
        let k = key(2);
        let err = cache.put(&k, 10, |w| {
            w.write_all(b"abc")?;
            Err(io::Error::other("source failed"))
        });
        assert!(err.is_err());
        assert!(cache.put(&k, 10, |w| w.write_all(b"short")).is_err());
        assert!(cache.put(&k, 3, |w| w.write_all(b"too long")).is_err());
        assert!(!cache.contains(&k));
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
        assert_eq!(fs::read_dir(dir.path().join("data")).unwrap().count(), 0);
        assert_eq!(
            cache.put(&k, 2 << 20, |_| Ok(())).unwrap(),
            PutOutcome::TooLarge
        );
    }

    #[test]
    fn crash_leftovers_are_ignored_and_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let cache = FileCache::open(&config(dir.path(), 1 << 20), None).unwrap();
        put_bytes(&cache, &key(1), b"kept");
        drop(cache);
        // A crash mid-write (a dead pid's temp file), a foreign file and a half name.
        let tmp = dir.path().join("tmp");
        fs::write(tmp.join("999999999-0"), b"partial").unwrap();
        fs::write(tmp.join("garbage"), b"x").unwrap();
        // A temp file of a running process (pid 1 always runs) is someone's write.
        let live = tmp.join("1-77");
        fs::write(&live, b"in progress").unwrap();
        let data = dir.path().join("data");
        fs::write(data.join("not-a-cache-file"), b"x").unwrap();
        fs::write(data.join(format!("{}.short", key(3).hex())), b"x").unwrap();
        let cache = FileCache::open(&config(dir.path(), 1 << 20), None).unwrap();
        assert!(!tmp.join("999999999-0").exists());
        assert!(!tmp.join("garbage").exists());
        assert!(live.exists(), "another live process's write is left alone");
        assert_eq!(fs::read_dir(&data).unwrap().count(), 1);
        assert_eq!(cache.snapshot().files, 1);
        assert_eq!(read_all(&cache.get(&key(1), 4).unwrap()), b"kept");
        assert!(cache.get(&key(3), 1).is_none());
    }

    #[test]
    fn eviction_keeps_the_bound_and_drops_least_recently_used_first() {
        let dir = tempfile::tempdir().unwrap();
        let cache = FileCache::open(&config(dir.path(), 300), None).unwrap();
        let block = [7u8; 100];
        for n in 1..=3 {
            put_bytes(&cache, &key(n), &block);
            std::thread::sleep(Duration::from_millis(3));
        }
        // Use 1 so that 2 is now the least recently used.
        assert!(cache.get(&key(1), 100).is_some());
        std::thread::sleep(Duration::from_millis(3));
        put_bytes(&cache, &key(4), &block);
        assert!(cache.contains(&key(1)));
        assert!(!cache.contains(&key(2)), "least recently used goes first");
        assert!(cache.contains(&key(3)) && cache.contains(&key(4)));
        let snap = cache.snapshot();
        assert_eq!((snap.files, snap.bytes, snap.evicted), (3, 300, 1));
        // A bigger file evicts as many as needed, never itself.
        put_bytes(&cache, &key(5), &[1u8; 250]);
        let snap = cache.snapshot();
        assert!(snap.bytes <= 300, "{snap:?}");
        assert!(cache.contains(&key(5)));
        let on_disk: u64 = fs::read_dir(dir.path().join("data"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert_eq!(on_disk, snap.bytes);
        // Reopening with a smaller bound evicts at open.
        drop(cache);
        let small = FileCache::open(&config(dir.path(), 260), None).unwrap();
        assert!(small.snapshot().bytes <= 260);
    }

    #[test]
    fn an_open_handle_survives_eviction() {
        let dir = tempfile::tempdir().unwrap();
        let cache = FileCache::open(&config(dir.path(), 100), None).unwrap();
        put_bytes(&cache, &key(1), &[1u8; 100]);
        let f = cache.get(&key(1), 100).unwrap();
        put_bytes(&cache, &key(2), &[2u8; 100]);
        assert!(!cache.contains(&key(1)));
        assert_eq!(read_all(&f), vec![1u8; 100]);
    }

    #[test]
    fn verify_removes_corrupt_files() {
        let dir = tempfile::tempdir().unwrap();
        let cache = FileCache::open(&config(dir.path(), 1 << 20), None).unwrap();
        put_bytes(&cache, &key(1), b"good bytes");
        put_bytes(&cache, &key(2), b"soon wrong");
        let sha = hex::encode(Sha256::digest(b"soon wrong"));
        let path = dir
            .path()
            .join("data")
            .join(format!("{}.{sha}", key(2).hex()));
        fs::write(&path, b"SOON wrong").unwrap();
        let report = cache.verify().unwrap();
        assert_eq!(
            report,
            FileVerifyReport {
                checked: 2,
                corrupt: 1,
                unreadable: 0
            }
        );
        assert!(!path.exists());
        assert!(cache.get(&key(2), 10).is_none());
        assert_eq!(read_all(&cache.get(&key(1), 10).unwrap()), b"good bytes");
    }

    #[test]
    fn scheduled_jobs_run_in_the_background_once() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(FileCache::open(&config(dir.path(), 1 << 20), None).unwrap());
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let job = |fill: FillFn| Materialize {
            key: key(1),
            len: 4,
            only_if: None,
            fill,
        };
        assert!(cache.schedule(job(Box::new(move |w| {
            gate_rx.recv().map_err(io::Error::other)?;
            w.write_all(b"data")
        }))));
        assert!(cache.is_pending(&key(1)));
        assert!(
            !cache.schedule(job(Box::new(|w| w.write_all(b"dupe")))),
            "one job per key"
        );
        gate_tx.send(()).unwrap();
        while cache.is_pending(&key(1)) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(read_all(&cache.get(&key(1), 4).unwrap()), b"data");
        assert!(
            !cache.schedule(job(Box::new(|w| w.write_all(b"data")))),
            "cached"
        );
        // A job whose precondition fails is skipped without writing.
        assert!(cache.schedule(Materialize {
            key: key(2),
            len: 1,
            only_if: Some(Box::new(|| false)),
            fill: Box::new(|w| w.write_all(b"x")),
        }));
        while cache.is_pending(&key(2)) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(!cache.contains(&key(2)));
        assert_eq!(cache.snapshot().skipped, 1);
    }

    #[test]
    fn needs_a_directory() {
        let cfg = FileCacheConfig::default();
        assert!(FileCache::open(&cfg, None).is_err());
        let parsed: FileCacheConfig = serde_json::from_str(r#"{"max_bytes": 5}"#).unwrap();
        assert_eq!(parsed.max_bytes, 5);
        assert!(parsed.passthrough && parsed.enabled);
        assert!(serde_json::from_str::<FileCacheConfig>(r#"{"max_byte": 5}"#).is_err());
    }
}
