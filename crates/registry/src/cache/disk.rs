//! The blob cache on disk: content-addressed files under a size bound, least recently used
//! evicted first, on the node's shared disk-cache primitive ([`ferry_store::diskcache`]:
//! the temp files, their recovery, the synced rename and the LRU index with pins and
//! reservations are its; the names, the digest check and the deletions are this module's).
//!
//! Files are the truth: the in-memory index (size and last access of every blob) is rebuilt
//! from the directory on start, ordered by modification time, which hits refresh at most
//! once a minute so the order survives restarts. A blob enters the directory only by an
//! atomic rename of a fully written, digest-verified, fsynced temp file
//! ([`Durability::Synced`]); temp files left by a crash are deleted on start. Directories
//! are 0700 and files 0600, like all node state.
//!
//! A blob somebody is reading or fetching is *pinned* and never evicted. Renames into the
//! cache and deletions by eviction are serialized, so an eviction can never delete a file
//! that a concurrent fetch has just committed under the same name.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use ferry_store::diskcache::{Durability, LruIndex, Staging, TempRecovery, place};
use parking_lot::Mutex;

use super::CacheError;

/// A hit refreshes the file's mtime (the persisted LRU order) at most this often.
const TOUCH_INTERVAL: Duration = Duration::from_secs(60);

/// Index entries by blob hex; the value is when the file's mtime was last refreshed.
type Index = LruIndex<String, SystemTime>;

#[derive(Debug)]
struct Inner {
    blobs_dir: PathBuf,
    staging: Staging,
    max_bytes: u64,
    index: Mutex<Index>,
    /// Held across "rename into cache" and "delete evicted files".
    fs_lock: tokio::sync::Mutex<()>,
}

/// The on-disk blob cache. Cheap to clone.
#[derive(Debug, Clone)]
pub struct DiskCache {
    inner: Arc<Inner>,
}

/// Keeps a blob from being evicted while it is read or fetched.
#[derive(Debug)]
pub struct BlobPin {
    inner: Arc<Inner>,
    hex: String,
}

impl Drop for BlobPin {
    fn drop(&mut self) {
        self.inner.lock().unpin(&self.hex);
    }
}

/// Bytes set aside for a fetch in progress; released on drop.
#[derive(Debug)]
pub struct Reservation {
    inner: Arc<Inner>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.inner.lock().release(self.bytes);
    }
}

/// A cached blob opened for reading (pinned while this lives).
#[derive(Debug)]
pub struct OpenBlob {
    pub file: Arc<File>,
    pub size: u64,
    pub pin: BlobPin,
}

/// A new temp file for a fetch: one handle to write, one to read (both stay valid after the
/// file is renamed into the cache or deleted).
#[derive(Debug)]
pub struct TempBlob {
    pub path: PathBuf,
    pub writer: File,
    pub reader: Arc<File>,
}

fn io_error(path: &Path, source: io::Error) -> CacheError {
    CacheError::Io {
        path: path.display().to_string(),
        message: source.to_string(),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CacheError> + Send + 'static,
) -> Result<T, CacheError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CacheError::Internal(format!("blocking task failed: {e}")))?
}

impl Inner {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Index> {
        self.index.lock()
    }
}

impl DiskCache {
    /// Opens (creating) the cache under `root`: deletes leftover temp files, indexes the
    /// blobs present, and evicts down to `max_bytes`.
    pub async fn open(root: &Path, max_bytes: u64) -> Result<DiskCache, CacheError> {
        let blobs_dir = root.join("blobs").join("sha256");
        let tmp_dir = root.join("tmp");
        let (index, blobs_dir, staging) = blocking(move || {
            // This process is the directory's only user: every temp file is a dead one's.
            let (staging, _) =
                Staging::open(&tmp_dir, TempRecovery::All).map_err(|e| io_error(&tmp_dir, e))?;
            let index = scan(&blobs_dir)?;
            Ok((index, blobs_dir, staging))
        })
        .await?;
        let cache = DiskCache {
            inner: Arc::new(Inner {
                blobs_dir,
                staging,
                max_bytes,
                index: Mutex::new(index),
                fs_lock: tokio::sync::Mutex::new(()),
            }),
        };
        cache.evict_now().await;
        Ok(cache)
    }

    /// The configured bound.
    pub fn max_bytes(&self) -> u64 {
        self.inner.max_bytes
    }

    /// Bytes of committed blobs.
    pub fn total_bytes(&self) -> u64 {
        self.inner.lock().bytes()
    }

    /// Number of committed blobs.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    /// Whether no blob is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a blob is cached (no access recorded).
    pub fn contains(&self, hex: &str) -> bool {
        self.inner.lock().contains(&hex.to_owned())
    }

    /// Size of a cached blob; counts as an access.
    pub fn size_of(&self, hex: &str) -> Option<u64> {
        self.inner.lock().touch(&hex.to_owned()).map(|e| e.size())
    }

    fn blob_path(&self, hex: &str) -> PathBuf {
        self.inner.blobs_dir.join(hex)
    }

    /// Pins `hex` (cached or not) against eviction until the pin is dropped.
    pub fn pin(&self, hex: &str) -> BlobPin {
        self.inner.lock().pin(hex.to_owned());
        BlobPin {
            inner: Arc::clone(&self.inner),
            hex: hex.to_owned(),
        }
    }

    /// Opens a cached blob for reading, or `None` if it is not cached.
    pub async fn open_blob(&self, hex: &str) -> Result<Option<OpenBlob>, CacheError> {
        let (size, touch) = {
            let mut index = self.inner.lock();
            let now = SystemTime::now();
            let key = hex.to_owned();
            let Some(entry) = index.touch(&key) else {
                return Ok(None);
            };
            let size = entry.size();
            let touch = now
                .duration_since(entry.value)
                .map(|age| age >= TOUCH_INTERVAL)
                .unwrap_or(false);
            if touch {
                entry.value = now;
            }
            index.pin(key);
            (size, touch)
        };
        let pin = BlobPin {
            inner: Arc::clone(&self.inner),
            hex: hex.to_owned(),
        };
        let path = self.blob_path(hex);
        let opened = blocking(move || match File::open(&path) {
            Ok(file) => {
                if touch {
                    // Best effort: only the LRU order after a restart depends on it.
                    let _ = file.set_modified(SystemTime::now());
                }
                Ok(Some(file))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error(&path, e)),
        })
        .await?;
        match opened {
            Some(file) => Ok(Some(OpenBlob {
                file: Arc::new(file),
                size,
                pin,
            })),
            None => {
                // Deleted behind our back: forget it.
                drop(pin);
                self.inner.lock().remove(&hex.to_owned());
                Ok(None)
            }
        }
    }

    /// Creates a temp file for fetching a blob; the caller commits or discards it.
    pub async fn create_temp(&self) -> Result<TempBlob, CacheError> {
        let inner = Arc::clone(&self.inner);
        blocking(move || {
            let dir = inner.staging.dir();
            let temp = inner.staging.create().map_err(|e| io_error(dir, e))?;
            let writer = temp
                .file()
                .try_clone()
                .map_err(|e| io_error(temp.path(), e))?;
            let reader = File::open(temp.path()).map_err(|e| io_error(temp.path(), e))?;
            // The download streams on in another task; it commits or discards the path.
            let path = temp.keep();
            Ok(TempBlob {
                path,
                writer,
                reader: Arc::new(reader),
            })
        })
        .await
    }

    /// Sets aside `bytes` for a fetch in progress, evicting to make room.
    pub async fn reserve(&self, bytes: u64) -> Reservation {
        self.inner.lock().reserve(bytes);
        let reservation = Reservation {
            inner: Arc::clone(&self.inner),
            bytes,
        };
        self.evict_now().await;
        reservation
    }

    /// Moves a verified temp file into the cache as blob `hex` and evicts to stay under the
    /// bound. Blobs larger than the whole cache are not kept (the temp file is deleted).
    /// Returns whether the blob is now cached.
    pub async fn commit(&self, hex: &str, temp: &Path, size: u64) -> Result<bool, CacheError> {
        if size > self.inner.max_bytes {
            let temp = temp.to_owned();
            blocking(move || {
                let _ = std::fs::remove_file(&temp);
                Ok(())
            })
            .await?;
            return Ok(false);
        }
        let _fs = self.inner.fs_lock.lock().await;
        let target = self.blob_path(hex);
        let temp_owned = temp.to_owned();
        blocking(move || {
            place(&temp_owned, &target, Durability::Synced).map_err(|e| io_error(&target, e))
        })
        .await?;
        let victims = {
            let mut index = self.inner.lock();
            index.insert(hex.to_owned(), size, SystemTime::now());
            index.take_victims(self.inner.max_bytes)
        };
        self.delete_files(victims).await;
        Ok(true)
    }

    /// Evicts to stay under the bound now.
    pub async fn evict_now(&self) {
        let _fs = self.inner.fs_lock.lock().await;
        let victims = self.inner.lock().take_victims(self.inner.max_bytes);
        self.delete_files(victims).await;
    }

    /// Deletes evicted files; the caller holds `fs_lock`.
    async fn delete_files(&self, victims: Vec<ferry_store::diskcache::Victim<String, SystemTime>>) {
        if victims.is_empty() {
            return;
        }
        tracing::debug!(count = victims.len(), "evicting cached blobs");
        let dir = self.inner.blobs_dir.clone();
        let result = blocking(move || {
            for victim in victims {
                let path = dir.join(&victim.key);
                if let Err(e) = std::fs::remove_file(&path)
                    && e.kind() != io::ErrorKind::NotFound
                {
                    tracing::warn!(path = %path.display(), error = %e, "cannot evict cached blob");
                }
            }
            Ok(())
        })
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "eviction failed");
        }
    }

    /// Deletes a temp file (failed fetch).
    pub async fn discard_temp(&self, temp: &Path) {
        let temp = temp.to_owned();
        let _ = blocking(move || {
            let _ = std::fs::remove_file(&temp);
            Ok(())
        })
        .await;
    }
}

/// Rebuilds the index from the directory, oldest modification first; stray names are
/// ignored. Files made before the cache was private are tightened.
fn scan(blobs_dir: &Path) -> Result<Index, CacheError> {
    ferry_store::private_dir(blobs_dir).map_err(|e| io_error(blobs_dir, e))?;
    let mut found: Vec<(SystemTime, String, u64)> = Vec::new();
    for entry in std::fs::read_dir(blobs_dir).map_err(|e| io_error(blobs_dir, e))? {
        let entry = entry.map_err(|e| io_error(blobs_dir, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !ferry_oci::digest::is_sha256_hex(&name) {
            continue;
        }
        let meta = match entry.metadata() {
            Ok(meta) if meta.is_file() => meta,
            _ => continue,
        };
        let path = entry.path();
        ferry_store::tighten(&path, ferry_store::PRIVATE_FILE_MODE)
            .map_err(|e| io_error(&path, e))?;
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        found.push((modified, name, meta.len()));
    }
    found.sort();
    let mut index = Index::new();
    for (modified, name, size) in found {
        index.insert(name, size, modified);
    }
    Ok(index)
}

/// Reads `len` bytes at `offset` (blocking; run on the blocking pool).
pub fn read_exact_at(file: &File, offset: u64, len: usize) -> io::Result<Bytes> {
    let mut buf = BytesMut::zeroed(len);
    let mut filled = 0;
    while filled < len {
        let n = file.read_at(&mut buf[filled..], offset + filled as u64)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "cached blob is shorter than recorded",
            ));
        }
        filled += n;
    }
    Ok(buf.freeze())
}

/// Appends `data` to a temp file (blocking).
pub fn write_all(mut file: &File, data: &[u8]) -> io::Result<()> {
    file.write_all(data)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    async fn put(cache: &DiskCache, hex: &str, content: &[u8]) {
        let temp = cache.create_temp().await.unwrap();
        write_all(&temp.writer, content).unwrap();
        assert!(
            cache
                .commit(hex, &temp.path, content.len() as u64)
                .await
                .unwrap()
        );
    }

    fn name(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    #[tokio::test]
    async fn evicts_least_recently_used_but_never_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(dir.path(), 300).await.unwrap();
        put(&cache, &name(1), &[1; 100]).await;
        put(&cache, &name(2), &[2; 100]).await;
        put(&cache, &name(3), &[3; 100]).await;
        assert_eq!(cache.total_bytes(), 300);
        // 1 is read (recent), 2 is pinned (being read), so 3 is the one to go.
        let one = cache.open_blob(&name(1)).await.unwrap().unwrap();
        drop(one);
        let two = cache.open_blob(&name(2)).await.unwrap().unwrap();
        put(&cache, &name(4), &[4; 100]).await;
        assert!(cache.contains(&name(1)));
        assert!(cache.contains(&name(2)));
        assert!(!cache.contains(&name(3)));
        assert!(cache.contains(&name(4)));
        assert!(!dir.path().join("blobs/sha256").join(name(3)).exists());
        assert!(cache.total_bytes() <= 300);
        // The pinned blob is still readable.
        let bytes = read_exact_at(&two.file, 0, 100).unwrap();
        assert_eq!(&bytes[..], &[2; 100]);
        drop(two);
        // Unpinned now: the next insert may take it (LRU order: 1, 2, 4 -> 2 is older
        // than 4 but 1 was touched before 2).
        put(&cache, &name(5), &[5; 100]).await;
        assert!(!cache.contains(&name(1)));
        assert!(cache.total_bytes() <= 300);
    }

    #[tokio::test]
    async fn a_blob_bigger_than_the_cache_is_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(dir.path(), 10).await.unwrap();
        let temp = cache.create_temp().await.unwrap();
        write_all(&temp.writer, &[0; 11]).unwrap();
        assert!(!cache.commit(&name(7), &temp.path, 11).await.unwrap());
        assert!(cache.is_empty());
        assert!(!temp.path.exists());
    }

    #[tokio::test]
    async fn reopening_rebuilds_the_index_and_cleans_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        {
            let cache = DiskCache::open(dir.path(), 1000).await.unwrap();
            put(&cache, &name(1), &[1; 10]).await;
            put(&cache, &name(2), &[2; 20]).await;
            let temp = cache.create_temp().await.unwrap();
            write_all(&temp.writer, b"partial").unwrap();
        }
        std::fs::write(dir.path().join("blobs/sha256/not-a-digest"), b"x").unwrap();
        let cache = DiskCache::open(dir.path(), 1000).await.unwrap();
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.total_bytes(), 30);
        assert_eq!(cache.size_of(&name(2)), Some(20));
        assert_eq!(
            std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
            0
        );
        let blob = cache.open_blob(&name(1)).await.unwrap().unwrap();
        assert_eq!(&read_exact_at(&blob.file, 0, 10).unwrap()[..], &[1; 10]);
        // A smaller bound on restart evicts the oldest.
        drop(blob);
        drop(cache);
        let cache = DiskCache::open(dir.path(), 25).await.unwrap();
        assert_eq!(cache.len(), 1);
        assert!(cache.total_bytes() <= 25);
    }

    #[tokio::test]
    async fn a_file_deleted_behind_our_back_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(dir.path(), 1000).await.unwrap();
        put(&cache, &name(1), &[1; 10]).await;
        std::fs::remove_file(dir.path().join("blobs/sha256").join(name(1))).unwrap();
        assert!(cache.open_blob(&name(1)).await.unwrap().is_none());
        assert!(!cache.contains(&name(1)));
        assert_eq!(cache.total_bytes(), 0);
    }

    #[tokio::test]
    async fn reservations_make_room_and_are_released() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(dir.path(), 100).await.unwrap();
        put(&cache, &name(1), &[1; 60]).await;
        let reservation = cache.reserve(50).await;
        assert!(cache.is_empty(), "the reservation evicted the old blob");
        drop(reservation);
        put(&cache, &name(2), &[2; 100]).await;
        assert_eq!(cache.total_bytes(), 100);
    }
}
