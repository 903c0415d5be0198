//! The read-only seed store: a store export ([`Store::export`]) used in place under the
//! live store (`[store] seed = PATH`), e.g. a volume baked with a node's image caches.
//!
//! Opening reads and checks the export's manifest (the same untrusted-input parse as
//! import: known format only, bounded) and keeps its object list in memory; no object is
//! read, copied or hashed at open. The seed is never written: its files are opened
//! read-only (`O_RDONLY`, never following a link, never blocking on a FIFO), nothing is
//! created in its directory, and eviction, gc, verify and export only ever walk the live
//! store, so the seed stays byte for byte what was baked.
//!
//! A read the live store cannot serve asks the seed. Each seed object is hashed against
//! its key on its first read in this process (the volume comes from elsewhere) and
//! trusted afterwards; one that is missing, of the wrong size or content, or unreadable
//! (an I/O error other than the process running out of descriptors or memory) is marked
//! bad for the rest of the process, logged and counted, and the read is a miss: the caller fetches the bytes and puts them, which writes them to the live store.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::export::object_path;
use super::image_meta::SeedMetadata;
use super::{
    ChunkFile, Store, Unservable, VerifyReport, bump, check_entry, open_entry, read_entry,
};
use crate::error::{Error, Result};
use crate::key::ChunkKey;

/// Not read yet in this process.
const UNCHECKED: u8 = 0;
/// Hashed and found good.
const GOOD: u8 = 1;
/// Missing, damaged or unreadable: never served by this process.
const BAD: u8 = 2;

/// What the seed store holds and how it served, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedStats {
    /// The seed's directory (a store export).
    pub path: PathBuf,
    /// Objects its manifest lists.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Image records it carries.
    pub images: u64,
    /// Reads the live store could not serve and the seed did.
    pub hits: u64,
    /// Bytes of the objects it served (each read or open counts the whole object).
    pub bytes_served: u64,
    /// Reads that reached the seed and were not served (not listed, or bad).
    pub misses: u64,
    /// Objects found missing, damaged or unreadable (each counted once).
    pub corrupt: u64,
    /// Objects hashed and found good so far.
    pub verified: u64,
}

#[derive(Debug)]
struct Object {
    size: u64,
    state: AtomicU8,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    bytes_served: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    verified: AtomicU64,
}

/// A seed store opened read-only (see the module doc).
#[derive(Debug)]
pub(crate) struct Seed {
    root: PathBuf,
    objects: HashMap<ChunkKey, Object>,
    bytes: u64,
    images: u64,
    counters: Counters,
    /// Its image records and metadata blobs.
    pub(crate) metadata: Arc<SeedMetadata>,
}

impl Seed {
    /// Opens the export at `root` as a seed under the live store at `live_root` (which
    /// may not exist yet): reads and checks its manifest only, and refuses a seed that
    /// overlaps the live store (is it, holds it or is inside it).
    pub(crate) fn open(root: &Path, live_root: &Path) -> Result<Seed> {
        let refuse = |source: Error| Error::Seed {
            path: root.to_path_buf(),
            source: Box::new(source),
        };
        let manifest = Store::read_export_manifest(root).map_err(refuse)?;
        let objects_dir = root.join("objects");
        if !objects_dir.is_dir() {
            return Err(refuse(Error::BadExport {
                path: objects_dir,
                reason: "missing: the export has no objects directory".into(),
            }));
        }
        let seed = resolved(root).map_err(|e| refuse(Error::io(root, e)))?;
        let live = resolved(live_root).map_err(|e| refuse(Error::io(live_root, e)))?;
        if seed.starts_with(&live) || live.starts_with(&seed) {
            return Err(refuse(Error::BadExport {
                path: seed,
                reason: format!(
                    "overlaps the live store {} (the seed must be a directory of its own)",
                    live.display()
                ),
            }));
        }
        let objects = manifest
            .objects
            .iter()
            .map(|o| {
                (
                    o.key,
                    Object {
                        size: o.size,
                        state: AtomicU8::new(UNCHECKED),
                    },
                )
            })
            .collect();
        tracing::info!(
            seed = %root.display(),
            objects = manifest.objects.len(),
            bytes = manifest.total_bytes,
            "seed store open (read-only)"
        );
        Ok(Seed {
            root: root.to_path_buf(),
            objects,
            bytes: manifest.total_bytes,
            images: manifest.images.len() as u64,
            counters: Counters::default(),
            metadata: Arc::new(SeedMetadata::of(root, manifest)),
        })
    }

    /// Listed and not found bad.
    pub(crate) fn contains(&self, key: &ChunkKey) -> bool {
        self.objects
            .get(key)
            .is_some_and(|o| o.state.load(Ordering::Relaxed) != BAD)
    }

    /// Listed and found good by a read in this process.
    pub(crate) fn verified(&self, key: &ChunkKey) -> bool {
        self.objects
            .get(key)
            .is_some_and(|o| o.state.load(Ordering::Relaxed) == GOOD)
    }

    /// The object's bytes, verified; `None` when it is not listed or is bad.
    pub(crate) fn read(&self, key: &ChunkKey) -> Option<Vec<u8>> {
        self.serve(key, false, |file, size, trusted| {
            read_entry(&file, key, size, trusted)
        })
    }

    /// The object opened read-only, verified through the returned handle; `None` when it
    /// is not listed or is bad.
    pub(crate) fn open_chunk(&self, key: &ChunkKey) -> Option<ChunkFile> {
        self.serve(key, false, |file, size, trusted| {
            Ok(check_entry(&file, key, size, trusted)?.map(|()| ChunkFile {
                file,
                len: size,
                path: object_path(&self.root, key),
            }))
        })
    }

    /// Hashes every object (also those found good before), marking bad ones; the seed
    /// itself is not changed, so `dropped` lists objects this process will not serve.
    pub(crate) fn verify_all(&self) -> VerifyReport {
        let mut keys: Vec<ChunkKey> = self.objects.keys().copied().collect();
        keys.sort();
        let mut report = VerifyReport::default();
        for key in keys {
            let checked = self.serve(&key, true, |file, size, trusted| {
                Ok(check_entry(&file, &key, size, trusted)?.map(|()| size))
            });
            match checked {
                Some(size) => {
                    report.good_entries += 1;
                    report.checked_bytes += size;
                }
                None => report.dropped.push(key),
            }
        }
        report
    }

    /// Opens the object and runs `check` on it (trusted once found good, unless
    /// `rehash`); counts the outcome (a rehash is not a hit) and marks an object that
    /// cannot be served bad.
    fn serve<T>(
        &self,
        key: &ChunkKey,
        rehash: bool,
        check: impl FnOnce(File, u64, bool) -> io::Result<std::result::Result<T, Unservable>>,
    ) -> Option<T> {
        let c = &self.counters;
        let Some(object) = self
            .objects
            .get(key)
            .filter(|o| o.state.load(Ordering::Relaxed) != BAD)
        else {
            bump(&c.misses, 1);
            return None;
        };
        let trusted = !rehash && object.state.load(Ordering::Relaxed) == GOOD;
        let path = object_path(&self.root, key);
        let outcome = open_entry(&path).and_then(|file| match file {
            Some(f) => check(f, object.size, trusted),
            None => Ok(Err(Unservable::Missing)),
        });
        let why = match outcome {
            Ok(Ok(served)) => {
                if !trusted
                    && object
                        .state
                        .compare_exchange(UNCHECKED, GOOD, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    bump(&c.verified, 1);
                }
                if !rehash {
                    bump(&c.hits, 1);
                    bump(&c.bytes_served, object.size);
                }
                return Some(served);
            }
            Ok(Err(Unservable::Missing)) => "missing".to_string(),
            Ok(Err(Unservable::Corrupt)) => {
                "of the wrong size or content (does not hash to its key)".to_string()
            }
            Err(e) if is_transient(&e) => {
                // The process's trouble (out of descriptors or memory), not the object's.
                if !rehash {
                    bump(&c.misses, 1);
                }
                tracing::debug!(%key, error = %e, "seed object not read this time");
                return None;
            }
            Err(e) => format!("unreadable: {e}"),
        };
        if !rehash {
            bump(&c.misses, 1);
        }
        if object.state.swap(BAD, Ordering::Relaxed) != BAD {
            bump(&c.corrupt, 1);
            tracing::warn!(
                %key,
                path = %path.display(),
                problem = why,
                "seed object not usable; treated as a miss (it is fetched and kept in the live store)"
            );
        }
        None
    }

    /// Sizes and counters.
    pub(crate) fn stats(&self) -> SeedStats {
        let c = &self.counters;
        SeedStats {
            path: self.root.clone(),
            objects: self.objects.len() as u64,
            bytes: self.bytes,
            images: self.images,
            hits: c.hits.load(Ordering::Relaxed),
            bytes_served: c.bytes_served.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            verified: c.verified.load(Ordering::Relaxed),
        }
    }
}

/// Errors that say nothing about the object: it is not marked bad for them.
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN | libc::EINTR)
    )
}

/// `path` absolute with its links resolved, for a path that may not exist yet: its
/// nearest existing ancestor canonicalized, the rest appended.
fn resolved(path: &Path) -> io::Result<PathBuf> {
    let absolute = std::path::absolute(path)?;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        match existing.canonicalize() {
            Ok(mut base) => {
                base.extend(rest.iter().rev());
                return Ok(base);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let (Some(parent), Some(name)) = (existing.parent(), existing.file_name()) else {
                    return Err(e);
                };
                rest.push(name.to_owned());
                existing = parent;
            }
            Err(e) => return Err(e),
        }
    }
}

impl Store {
    /// The seed store's sizes and counters; `None` without a seed.
    pub fn seed_stats(&self) -> Option<SeedStats> {
        self.inner.seed.as_ref().map(Seed::stats)
    }

    /// Hashes every object of the seed store (`None` without one). Bad objects are
    /// marked so for this process and listed in `dropped`; the seed is never changed
    /// (rebake it to repair it).
    pub fn verify_seed(&self) -> Option<VerifyReport> {
        self.inner.seed.as_ref().map(Seed::verify_all)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    use super::*;
    use crate::{PutOutcome, StoreOptions};

    fn options(max: u64, seed: Option<&Path>) -> StoreOptions {
        StoreOptions {
            max_bytes: Some(max),
            flush_interval: None,
            pin_grace: Duration::from_secs(60),
            seed: seed.map(Path::to_path_buf),
            ..StoreOptions::default()
        }
    }

    fn chunk(seed: u8, size: usize) -> (ChunkKey, Vec<u8>) {
        let bytes: Vec<u8> = (0..size)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect();
        (ChunkKey::of(&bytes), bytes)
    }

    /// Ten chunks put in a store at `dir/a` and exported to `dir/seed`.
    fn baked(dir: &Path) -> (Vec<(ChunkKey, Vec<u8>)>, PathBuf) {
        let a = Store::open_with(&dir.join("a"), options(64 << 20, None)).unwrap();
        let chunks: Vec<_> = (0..10u8)
            .map(|i| chunk(i, 3000 + 1001 * i as usize))
            .collect();
        for (k, b) in &chunks {
            a.put(k, b).unwrap();
        }
        let seed = dir.join("seed");
        assert_eq!(a.export(&seed).unwrap().objects, 10);
        (chunks, seed)
    }

    /// Every file and directory under `root`: type, mode, size, mtime, contents.
    fn snapshot(root: &Path) -> BTreeMap<PathBuf, (u32, u64, i64, i64, Vec<u8>)> {
        let mut out = BTreeMap::new();
        let mut todo = vec![root.to_path_buf()];
        while let Some(p) = todo.pop() {
            let m = std::fs::symlink_metadata(&p).unwrap();
            let contents = if m.is_file() {
                std::fs::read(&p).unwrap()
            } else {
                Vec::new()
            };
            if m.is_dir() {
                for e in std::fs::read_dir(&p).unwrap() {
                    todo.push(e.unwrap().path());
                }
            }
            out.insert(
                p.strip_prefix(root).unwrap().to_path_buf(),
                (m.mode(), m.len(), m.mtime(), m.mtime_nsec(), contents),
            );
        }
        out
    }

    fn live_files(root: &Path) -> usize {
        std::fs::read_dir(root.join("chunks"))
            .unwrap()
            .map(|d| std::fs::read_dir(d.unwrap().path()).unwrap().count())
            .sum()
    }

    fn flip_first_byte(path: &Path) {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[0] ^= 0xff;
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn seed_objects_are_served_verified_and_nothing_is_written_anywhere() {
        let dir = tempfile::tempdir().unwrap();
        let (chunks, seed) = baked(dir.path());
        let before = snapshot(&seed);
        let live = dir.path().join("live");
        let store = Store::open_with(&live, options(64 << 20, Some(&seed))).unwrap();
        for (k, b) in &chunks {
            assert!(store.contains(k));
            assert_eq!(store.get(k).unwrap().as_deref(), Some(b.as_slice()));
            let f = store.open_chunk(k).unwrap().unwrap();
            assert_eq!(f.len(), b.len() as u64);
            let mut buf = vec![0u8; b.len()];
            f.read_at(&mut buf, 0).unwrap();
            assert_eq!(&buf, b);
            assert!(f.path().starts_with(&seed));
            // Served once verified: a put of the same bytes writes nothing.
            assert_eq!(store.put(k, b).unwrap(), PutOutcome::AlreadyPresent);
        }
        let total: u64 = chunks.iter().map(|(_, b)| b.len() as u64).sum();
        let s = store.seed_stats().unwrap();
        assert_eq!(s.path, seed);
        assert_eq!((s.objects, s.bytes, s.images), (10, total, 0));
        assert_eq!((s.hits, s.bytes_served), (20, 2 * total));
        assert_eq!((s.verified, s.corrupt, s.misses), (10, 0, 0));
        let live_stats = store.stats();
        assert_eq!((live_stats.entries, live_stats.inserts), (0, 0));
        assert_eq!((live_stats.hits, live_stats.misses), (20, 0));
        assert_eq!(live_files(&live), 0);
        store.close().unwrap();
        assert_eq!(snapshot(&seed), before, "the seed directory changed");
    }

    #[test]
    fn the_live_store_is_asked_first() {
        let dir = tempfile::tempdir().unwrap();
        let (chunks, seed) = baked(dir.path());
        // The seed's copy is damaged: a read that reached it would count it corrupt.
        let (k, b) = &chunks[4];
        flip_first_byte(&object_path(&seed, k));
        let store =
            Store::open_with(&dir.path().join("live"), options(64 << 20, Some(&seed))).unwrap();
        assert_eq!(store.put(k, b).unwrap(), PutOutcome::Stored);
        assert_eq!(store.get(k).unwrap().as_deref(), Some(b.as_slice()));
        assert!(
            !store
                .open_chunk(k)
                .unwrap()
                .unwrap()
                .path()
                .starts_with(&seed)
        );
        let s = store.seed_stats().unwrap();
        assert_eq!((s.hits, s.misses, s.corrupt), (0, 0, 0));
    }

    #[test]
    fn writes_and_eviction_only_touch_the_live_store() {
        let dir = tempfile::tempdir().unwrap();
        let (chunks, seed) = baked(dir.path());
        let before = snapshot(&seed);
        let live = dir.path().join("live");
        // Room for about three of the new chunks: puts evict.
        let store = Store::open_with(&live, options(40_000, Some(&seed))).unwrap();
        let fresh: Vec<_> = (100..110u8).map(|i| chunk(i, 12_000)).collect();
        for (k, b) in &fresh {
            assert_eq!(store.put(k, b).unwrap(), PutOutcome::Stored);
        }
        let st = store.stats();
        assert!(st.evictions >= 7, "{st:?}");
        assert!(st.bytes <= 40_000);
        assert_eq!(live_files(&live), st.entries as usize);
        store.gc_to(0).unwrap();
        assert_eq!(store.stats().entries, 0);
        assert_eq!(store.verify_all().unwrap().good_entries, 0);
        // The seed lost nothing to eviction, gc or verify.
        for (k, b) in &chunks {
            assert_eq!(store.get(k).unwrap().as_deref(), Some(b.as_slice()));
        }
        assert!(store.list().is_empty(), "seed objects are not live entries");
        // An export writes the live store's entries only.
        store.put(&fresh[0].0, &fresh[0].1).unwrap();
        let out = dir.path().join("out");
        assert_eq!(store.export(&out).unwrap().objects, 1);
        store.close().unwrap();
        assert_eq!(snapshot(&seed), before, "the seed directory changed");
    }

    #[test]
    fn a_bad_seed_object_is_a_counted_miss_then_fetched_into_the_live_store() {
        let dir = tempfile::tempdir().unwrap();
        let (chunks, seed) = baked(dir.path());
        let (flipped, flipped_bytes) = &chunks[1];
        flip_first_byte(&object_path(&seed, flipped));
        let (gone, _) = &chunks[2];
        std::fs::remove_file(object_path(&seed, gone)).unwrap();
        // A FIFO must not hang the read; a link must not be followed (even to good bytes).
        let (fifo, _) = &chunks[3];
        let fifo_path = object_path(&seed, fifo);
        std::fs::remove_file(&fifo_path).unwrap();
        let c = CString::new(fifo_path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (linked, linked_bytes) = &chunks[5];
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, linked_bytes).unwrap();
        std::fs::remove_file(object_path(&seed, linked)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, object_path(&seed, linked)).unwrap();
        let before = snapshot(&seed);

        let live = dir.path().join("live");
        let store = Store::open_with(&live, options(64 << 20, Some(&seed))).unwrap();
        for key in [flipped, gone, fifo, linked] {
            assert!(store.contains(key), "listed, not read yet");
            assert_eq!(store.get(key).unwrap(), None);
            assert!(store.open_chunk(key).unwrap().is_none());
            assert!(!store.contains(key), "known bad now");
        }
        let s = store.seed_stats().unwrap();
        assert_eq!((s.corrupt, s.misses, s.hits), (4, 8, 0));
        assert_eq!(store.stats().misses, 8);
        // The reader fetches the bytes elsewhere and puts them: they land in the live store.
        assert_eq!(
            store.put(flipped, flipped_bytes).unwrap(),
            PutOutcome::Stored
        );
        assert_eq!(
            store.get(flipped).unwrap().as_deref(),
            Some(flipped_bytes.as_slice())
        );
        assert_eq!(live_files(&live), 1);
        assert_eq!(store.seed_stats().unwrap().corrupt, 4, "counted once each");
        // Verifying the seed names exactly the bad ones and changes nothing.
        let v = store.verify_seed().unwrap();
        let mut bad = vec![*flipped, *gone, *fifo, *linked];
        bad.sort();
        assert_eq!((v.good_entries, v.dropped), (6, bad));
        assert_eq!(store.seed_stats().unwrap().verified, 6);
        // The good objects are still served from the seed.
        let (k, b) = &chunks[0];
        assert_eq!(store.get(k).unwrap().as_deref(), Some(b.as_slice()));
        store.close().unwrap();
        assert_eq!(snapshot(&seed), before, "the seed directory changed");
    }

    #[test]
    fn a_directory_that_is_not_an_export_is_refused_before_the_store_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("live");
        let not_export = dir.path().join("plain");
        std::fs::create_dir(&not_export).unwrap();
        for seed in [not_export.clone(), dir.path().join("absent")] {
            let err = Store::open_with(&live, options(1 << 20, Some(&seed))).unwrap_err();
            assert!(matches!(err, Error::Seed { .. }), "{err}");
            let text = err.to_string();
            assert!(text.contains("not a ferry store export"), "{text}");
            assert!(text.contains("ferry store export DIR"), "{text}");
            assert!(!live.exists(), "the live store was created");
        }
        // A newer format is named as such.
        let (_, seed) = baked(dir.path());
        let manifest = seed.join(crate::MANIFEST_NAME);
        let text = std::fs::read_to_string(&manifest).unwrap();
        std::fs::write(&manifest, text.replace("\"format\": 2", "\"format\": 7")).unwrap();
        let err = Store::open_with(&live, options(1 << 20, Some(&seed))).unwrap_err();
        assert!(err.to_string().contains("format 7"), "{err}");
        std::fs::write(&manifest, text).unwrap();
        // The live store itself (or a directory holding it) is not a seed.
        let err = Store::open_with(&seed, options(1 << 20, Some(&seed))).unwrap_err();
        assert!(err.to_string().contains("overlaps the live store"), "{err}");
        let before = snapshot(&seed);
        let inside = seed.join("live");
        let err = Store::open_with(&inside, options(1 << 20, Some(&seed))).unwrap_err();
        assert!(err.to_string().contains("overlaps the live store"), "{err}");
        assert_eq!(
            snapshot(&seed),
            before,
            "a refused open wrote into the seed"
        );
        // And a good one opens.
        let store = Store::open_with(&live, options(1 << 20, Some(&seed))).unwrap();
        assert_eq!(store.seed_stats().unwrap().objects, 10);
    }
}
