//! The small-file pack: whole small files of layers, decompressed, appended together to
//! a few large files on local disk, so the next read of a small file is a `pread`
//! instead of inflating its span again.
//!
//! Why: the file cache keeps one file per layer file, which costs a create, an fsync and
//! a rename each, and a backing open at every FUSE open; for the hundreds of small files
//! of a start that is slower than inflating them (measured: caching every file that way
//! made a pandas start 60 % slower). But inflating is not free either: the first read of
//! a span inflates all of it (3-4 MB) to serve a few KB, and a pandas start pays that
//! 142 times on its critical path, about 0.3 s, warm store or not. Here a small file
//! costs an append and a 64-byte record.
//!
//! Layout under its directory (`<file cache>/pack/`, root's alone):
//! - `<generation>.data`: file contents, appended;
//! - `<generation>.idx`: 64-byte records, one per file: its [`FileKey`], where it is in
//!   the data file, its length, the first 16 bytes of its SHA-256, and a checksum of the
//!   record; appended after the data they describe;
//! - `lock`: held (`flock`) by the one process that may append; another process opening
//!   the same directory gets no pack (it reads through its layers as before).
//!
//! Eviction is by generation: appends go to the newest one; when it holds half the
//! bound a new one starts, and beyond two the oldest is deleted with its records. What
//! a start reads is written in one burst, so it lives and dies together.
//!
//! Trust: the bytes come from reads that verified their spans against the index, and a
//! file's content hash is rechecked at its first read in each process (a torn append
//! after a crash, a damaged disk): a mismatch drops the record and the read goes to the
//! layer. It must not hold file contents in memory, serve a file it has not checked in
//! this process, or know FUSE or layer formats.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};

use crate::filecache::{FileKey, read_full_at};

/// One record's size in an index file.
const RECORD: usize = 64;
/// Live generations at most (the newest takes appends).
const GENERATIONS: usize = 2;
/// Largest file the pack takes (a file cache's `min_file_bytes` is usually far below).
pub const MAX_PACKED_FILE: u64 = 4 << 20;

/// Where one packed file is.
#[derive(Debug, Clone, Copy)]
struct Slot {
    generation: u64,
    offset: u64,
    len: u32,
    hash: [u8; 16],
    /// Checked against `hash` in this process.
    checked: bool,
}

#[derive(Debug)]
struct Generation {
    id: u64,
    data: Arc<File>,
    index: File,
    /// Where the next append goes in `data`.
    len: u64,
    /// Bytes of `index` (a multiple of [`RECORD`]).
    index_len: u64,
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<FileKey, Slot>,
    /// Oldest first; the last takes appends.
    generations: VecDeque<Generation>,
}

/// Counters for `ferry status` and metrics.
#[derive(Debug, Default)]
pub struct PackStats {
    /// Reads served from the pack.
    pub hits: AtomicU64,
    /// Files appended.
    pub packed: AtomicU64,
    /// Records dropped because the bytes did not match their hash.
    pub corrupt: AtomicU64,
    /// Files dropped with an evicted generation.
    pub evicted: AtomicU64,
}

/// A node's small-file pack. Cheap to share behind the file cache.
#[derive(Debug)]
pub struct FilePack {
    dir: PathBuf,
    max_bytes: u64,
    inner: Mutex<Inner>,
    stats: PackStats,
    /// Held for the pack's life: the append lock.
    _lock: File,
}

fn io_err(what: String) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn content_hash(bytes: &[u8]) -> [u8; 16] {
    let full: [u8; 32] = Sha256::digest(bytes).into();
    let mut h = [0u8; 16];
    h.copy_from_slice(&full[..16]);
    h
}

fn record_check(head: &[u8]) -> [u8; 4] {
    let full: [u8; 32] = Sha256::digest(head).into();
    [full[0], full[1], full[2], full[3]]
}

fn encode(key: &FileKey, offset: u64, len: u32, hash: &[u8; 16]) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[..32].copy_from_slice(key.as_bytes());
    r[32..40].copy_from_slice(&offset.to_le_bytes());
    r[40..44].copy_from_slice(&len.to_le_bytes());
    r[44..60].copy_from_slice(hash);
    let check = record_check(&r[..60]);
    r[60..].copy_from_slice(&check);
    r
}

/// A record, or `None` when its checksum fails (a torn append).
fn decode(r: &[u8]) -> Option<(FileKey, u64, u32, [u8; 16])> {
    if r.len() != RECORD || record_check(&r[..60]) != r[60..64] {
        return None;
    }
    let key = FileKey::from_bytes(r[..32].try_into().ok()?);
    let offset = u64::from_le_bytes(r[32..40].try_into().ok()?);
    let len = u32::from_le_bytes(r[40..44].try_into().ok()?);
    let hash: [u8; 16] = r[44..60].try_into().ok()?;
    Some((key, offset, len, hash))
}

fn open_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))
}

impl FilePack {
    /// Opens (creating if needed) the pack in `dir`, bounded by `max_bytes` on disk.
    /// `Ok(None)` when another process holds the directory's append lock.
    pub fn open(dir: &Path, max_bytes: u64) -> io::Result<Option<FilePack>> {
        ferry_store::private_dir(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let lock = open_private(&dir.join("lock"))?;
        if !try_lock_exclusive(&lock)? {
            return Ok(None);
        }
        let mut ids: Vec<u64> = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err(format!("listing {}", dir.display())))? {
            let name = entry?.file_name();
            let name = name.to_string_lossy();
            if let Some(id) = name.strip_suffix(".idx").and_then(|s| s.parse().ok()) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        // Beyond the live generations: what an earlier, larger bound left.
        while ids.len() > GENERATIONS {
            let id = ids.remove(0);
            remove_generation(dir, id);
        }
        let pack = FilePack {
            dir: dir.to_path_buf(),
            max_bytes,
            inner: Mutex::new(Inner::default()),
            stats: PackStats::default(),
            _lock: lock,
        };
        {
            let mut inner = pack.inner.lock();
            for id in ids {
                let generation = pack.load_generation(id, &mut inner.slots)?;
                inner.generations.push_back(generation);
            }
        }
        Ok(Some(pack))
    }

    /// Reads generation `id`'s records into `slots` (a later record of a key wins) and
    /// cuts a torn tail off its index.
    fn load_generation(
        &self,
        id: u64,
        slots: &mut HashMap<FileKey, Slot>,
    ) -> io::Result<Generation> {
        let data = open_private(&self.dir.join(format!("{id}.data")))?;
        let index = open_private(&self.dir.join(format!("{id}.idx")))?;
        let data_len = data.metadata()?.len();
        let index_bytes = fs::read(self.dir.join(format!("{id}.idx")))?;
        let mut good = 0u64;
        for r in index_bytes.chunks(RECORD) {
            let Some((key, offset, len, hash)) = decode(r) else {
                break;
            };
            good += RECORD as u64;
            if offset
                .checked_add(u64::from(len))
                .is_some_and(|end| end <= data_len)
            {
                let slot = Slot {
                    generation: id,
                    offset,
                    len,
                    hash,
                    checked: false,
                };
                slots.insert(key, slot);
            }
        }
        if good != index_bytes.len() as u64 {
            tracing::info!(
                generation = id,
                "small-file pack index had a torn tail; cut"
            );
            index.set_len(good)?;
        }
        Ok(Generation {
            id,
            data: Arc::new(data),
            index,
            len: data_len,
            index_len: good,
        })
    }

    /// Live counters.
    pub fn stats(&self) -> &PackStats {
        &self.stats
    }

    /// Files and bytes held now.
    pub fn occupancy(&self) -> (u64, u64) {
        let inner = self.inner.lock();
        let bytes = inner.slots.values().map(|s| u64::from(s.len)).sum();
        (inner.slots.len() as u64, bytes)
    }

    /// True when the pack holds `key`.
    pub fn contains(&self, key: &FileKey) -> bool {
        self.inner.lock().slots.contains_key(key)
    }

    /// Reads bytes of file `key` at `offset` into `buf`; `None` when the pack does not
    /// hold it (or its bytes failed their check: the record is dropped). Fewer bytes
    /// than asked only at the end of the file.
    pub fn read_at(&self, key: &FileKey, offset: u64, buf: &mut [u8]) -> Option<usize> {
        let (slot, data) = {
            let inner = self.inner.lock();
            let slot = *inner.slots.get(key)?;
            let generation = inner.generations.iter().find(|g| g.id == slot.generation)?;
            (slot, generation.data.clone())
        };
        let len = u64::from(slot.len);
        if !slot.checked {
            // The whole file once per process: it is small.
            let mut all = vec![0u8; slot.len as usize];
            let ok = read_full_at(&data, &mut all, slot.offset).ok() == Some(all.len())
                && content_hash(&all) == slot.hash;
            let mut inner = self.inner.lock();
            if !ok {
                if inner
                    .slots
                    .get(key)
                    .is_some_and(|s| s.generation == slot.generation)
                {
                    inner.slots.remove(key);
                }
                self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = %key.hex(), "small-file pack entry failed its check; read from the layer");
                return None;
            }
            if let Some(s) = inner.slots.get_mut(key) {
                s.checked = true;
            }
            drop(inner);
            let from = offset.min(len) as usize;
            let n = buf.len().min(all.len() - from);
            buf[..n].copy_from_slice(&all[from..from + n]);
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            return Some(n);
        }
        if offset >= len {
            return Some(0);
        }
        let n = (len - offset).min(buf.len() as u64) as usize;
        let got = read_full_at(&data, &mut buf[..n], slot.offset + offset).ok()?;
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        Some(got)
    }

    /// Appends file `key` with contents `bytes` unless held already. Files larger than
    /// [`MAX_PACKED_FILE`] or a quarter of the bound are refused. Errors are logged
    /// and leave the pack without the file.
    pub fn put(&self, key: &FileKey, bytes: &[u8]) {
        let len = bytes.len() as u64;
        if len > MAX_PACKED_FILE || len.saturating_mul(4) > self.max_bytes {
            return;
        }
        let hash = content_hash(bytes);
        let mut inner = self.inner.lock();
        if inner.slots.contains_key(key) {
            return;
        }
        if let Err(e) = self.append(&mut inner, key, bytes, hash) {
            tracing::warn!(error = %e, "could not add a file to the small-file pack");
        }
    }

    fn append(
        &self,
        inner: &mut Inner,
        key: &FileKey,
        bytes: &[u8],
        hash: [u8; 16],
    ) -> io::Result<()> {
        let len = bytes.len() as u64;
        let per_generation = (self.max_bytes / GENERATIONS as u64).max(1);
        let full = inner
            .generations
            .back()
            .is_none_or(|g| g.len > 0 && g.len + len > per_generation);
        if full {
            self.start_generation(inner)?;
        }
        let Some(generation) = inner.generations.back_mut() else {
            return Err(io::Error::other("no generation to append to"));
        };
        let offset = generation.len;
        generation.data.write_all_at(bytes, offset)?;
        generation.len += len;
        let record = encode(key, offset, bytes.len() as u32, &hash);
        generation
            .index
            .write_all_at(&record, generation.index_len)?;
        generation.index_len += RECORD as u64;
        let slot = Slot {
            generation: generation.id,
            offset,
            len: bytes.len() as u32,
            hash,
            // Written by this process from verified bytes.
            checked: true,
        };
        inner.slots.insert(*key, slot);
        self.stats.packed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Starts a new generation for appends, deleting the oldest beyond the live count.
    fn start_generation(&self, inner: &mut Inner) -> io::Result<()> {
        let id = inner.generations.back().map_or(1, |g| g.id + 1);
        let data = open_private(&self.dir.join(format!("{id}.data")))?;
        data.set_len(0)?;
        let index = open_private(&self.dir.join(format!("{id}.idx")))?;
        index.set_len(0)?;
        inner.generations.push_back(Generation {
            id,
            data: Arc::new(data),
            index,
            len: 0,
            index_len: 0,
        });
        while inner.generations.len() > GENERATIONS {
            let Some(old) = inner.generations.pop_front() else {
                break;
            };
            let before = inner.slots.len();
            inner.slots.retain(|_, s| s.generation != old.id);
            let dropped = (before - inner.slots.len()) as u64;
            self.stats.evicted.fetch_add(dropped, Ordering::Relaxed);
            remove_generation(&self.dir, old.id);
        }
        Ok(())
    }
}

fn remove_generation(dir: &Path, id: u64) {
    // The index first: a data file without an index is only space.
    for suffix in ["idx", "data"] {
        let path = dir.join(format!("{id}.{suffix}"));
        if let Err(e) = fs::remove_file(&path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove an old small-file pack");
        }
    }
}

/// Takes `file`'s exclusive `flock` without waiting; false when another open file
/// description holds it. Released when the file is closed.
fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function borrows for the call's duration.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key(n: u64) -> FileKey {
        FileKey::new("sha256:layer", "tar", n, 10)
    }

    #[test]
    fn a_packed_file_reads_back_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
            pack.put(&key(1), b"hello world");
            pack.put(&key(2), b"second file");
            let mut buf = [0u8; 5];
            assert_eq!(pack.read_at(&key(1), 6, &mut buf), Some(5));
            assert_eq!(&buf, b"world");
        }
        let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
        let mut buf = [0u8; 32];
        assert_eq!(pack.read_at(&key(2), 0, &mut buf), Some(11));
        assert_eq!(&buf[..11], b"second file");
        assert_eq!(pack.read_at(&key(3), 0, &mut buf), None);
        assert_eq!(pack.occupancy(), (2, 22));
    }

    #[test]
    fn a_second_process_gets_no_pack() {
        let dir = tempfile::tempdir().unwrap();
        let first = FilePack::open(dir.path(), 1 << 20).unwrap();
        assert!(first.is_some());
        assert!(FilePack::open(dir.path(), 1 << 20).unwrap().is_none());
        drop(first);
        assert!(FilePack::open(dir.path(), 1 << 20).unwrap().is_some());
    }

    #[test]
    fn damaged_bytes_are_never_served() {
        let dir = tempfile::tempdir().unwrap();
        {
            let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
            pack.put(&key(1), b"original bytes");
        }
        let data = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "data"))
            .unwrap();
        fs::write(&data, b"tampered bytes").unwrap();
        let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
        let mut buf = [0u8; 32];
        assert_eq!(pack.read_at(&key(1), 0, &mut buf), None);
        assert!(!pack.contains(&key(1)));
        assert_eq!(pack.stats().corrupt.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_torn_index_tail_is_cut_and_appends_go_on() {
        let dir = tempfile::tempdir().unwrap();
        {
            let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
            pack.put(&key(1), b"kept");
            pack.put(&key(2), b"torn");
        }
        let idx = dir.path().join("1.idx");
        let bytes = fs::read(&idx).unwrap();
        fs::write(&idx, &bytes[..RECORD + 10]).unwrap();
        let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
        assert!(pack.contains(&key(1)));
        assert!(!pack.contains(&key(2)));
        assert_eq!(fs::metadata(&idx).unwrap().len(), RECORD as u64);
        pack.put(&key(3), b"after");
        drop(pack);
        let pack = FilePack::open(dir.path(), 1 << 20).unwrap().unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(pack.read_at(&key(3), 0, &mut buf), Some(5));
        assert_eq!(&buf[..5], b"after");
        assert_eq!(pack.read_at(&key(1), 0, &mut buf), Some(4));
    }

    #[test]
    fn old_generations_are_evicted_whole() {
        let dir = tempfile::tempdir().unwrap();
        // Two generations of 100 bytes: each holds three 30-byte files.
        let pack = FilePack::open(dir.path(), 200).unwrap().unwrap();
        let bytes = [7u8; 30];
        for n in 0..9 {
            pack.put(&key(n), &bytes);
        }
        // Files 0-2 were in the first generation, gone when the third began.
        assert!(!pack.contains(&key(0)));
        assert!(pack.contains(&key(3)) && pack.contains(&key(8)));
        assert_eq!(pack.stats().evicted.load(Ordering::Relaxed), 3);
        let on_disk = fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(on_disk, 1 + 2 * GENERATIONS, "lock + two live generations");
        // A file larger than a quarter of the bound is refused.
        pack.put(&key(100), &[1u8; 51]);
        assert!(!pack.contains(&key(100)));
    }

    #[test]
    fn the_pack_is_private_to_root() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let packdir = dir.path().join("pack");
        let pack = FilePack::open(&packdir, 1 << 20).unwrap().unwrap();
        pack.put(&key(1), b"secret");
        for entry in fs::read_dir(&packdir).unwrap() {
            let mode = entry.unwrap().metadata().unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "readable beyond its owner: {mode:o}");
        }
        let mode = fs::metadata(&packdir).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0);
    }
}
