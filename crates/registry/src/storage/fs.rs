//! The default [`Storage`]: a crash-safe layout on a local filesystem.
//!
//! Layout under the root (all on one filesystem, so renames are atomic):
//!
//! ```text
//! blobs/<alg>/<ab>/<abcdef…>                        committed blob content (immutable)
//! uploads/<id>/data                                 bytes of an upload session so far
//! repositories/<name>/_layers/<alg>/<hex>           empty file: the repository links a blob
//! repositories/<name>/_manifests/revisions/<alg>/<hex>  manifest link; holds its media type
//! repositories/<name>/_manifests/tags/<tag>         the tag's manifest digest
//! repositories/<name>/_referrers/<alg>/<subject>/<alg>/<referrer>   empty file
//! tmp/<random>                                      files being written (stale ones removed on open)
//! gc/{running,deleting,pins}/<name>                 empty files: collections' coordination
//! ```
//!
//! `<alg>` is the digest's algorithm, `sha256` or `sha512` (content pushed under a sha512
//! digest lives under `sha512/`, hashed with it; the two never share a path).
//!
//! Why it survives crashes: every file whose *content* matters (blobs, manifest links,
//! tags) is written to `tmp/`, fsynced, renamed into place and its directory fsynced, so a
//! reader sees the old content or the new, never a torn one. Upload bytes live only under
//! `uploads/`; `upload_finish` hashes them, fsyncs, and renames the data file into
//! `blobs/` — so a blob path exists only with verified, complete content, and a crash
//! mid-upload leaves at worst an upload directory (garbage collection removes stale ones)
//! or a temp file (removed when the root is opened an hour or more later: younger ones may
//! be another process's writes). Empty link files are created in
//! place: creating a file is atomic and there is no content to tear.
//!
//! The media type of a manifest lives in its revision link rather than beside the blob:
//! one read answers both "is it linked here" and "what type was it pushed as", and the
//! type goes away with the link.
//!
//! Speed: existence checks (`blob_size`, `blob_linked`, `upload_size`) are one `stat`;
//! multi-step operations run as one blocking task each; uploads are written in 1 MiB
//! batches off the async threads, hashing as they go, and the hash state is kept in
//! memory between chunks so finishing does not re-read the data (after a restart it is
//! re-read once; and once when a session hashed as sha256 finishes under a sha512 digest,
//! see [`Storage::upload_finish`]). One server process per root: upload chunk ordering is serialised in
//! process; opening the root removes temp files untouched for an hour.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::BytesMut;
use ferry_oci::digest::ContentHasher;
use ferry_oci::{Digest, RepositoryName, Tag};
use futures_util::StreamExt;
use parking_lot::{Mutex, MutexGuard};
use tokio::io::AsyncReadExt;
use tokio::task::JoinHandle;
use tokio_util::io::ReaderStream;

use super::{
    BlobInfo, BlobRead, ByteStream, LinkInfo, Result, STORED_ALGORITHMS, Storage, StorageError,
    StoredManifest, check_gc_record, check_repo, check_tag, digest_like, digest_parts,
    digest_string, hasher_for, listed_digest, new_upload_id, valid_upload_id,
};

/// Upload bytes are written in batches of this size (one blocking task each).
const WRITE_BATCH: usize = 1 << 20;
/// Read buffer of blob streams.
const READ_CHUNK: usize = 256 * 1024;
/// Largest manifest this backend will read back into memory.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Largest media type kept in a manifest link.
const MAX_MEDIA_TYPE_BYTES: usize = 1024;
/// Temp files untouched this long belong to no write in progress (every write finishes
/// or fails long before: client bodies that stall are cut off within minutes).
pub const TMP_STALE: Duration = Duration::from_secs(60 * 60);

/// A [`Storage`] in a directory tree (see the module documentation for the layout).
#[derive(Debug)]
pub struct FsStorage {
    root: PathBuf,
    /// Per-session lock and running hash of uploads this process has appended to.
    sessions: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<RunningHash>>>>>,
}

/// The hash of an upload's first `len` bytes.
#[derive(Debug, Clone)]
struct RunningHash {
    hasher: ContentHasher,
    len: u64,
}

impl FsStorage {
    /// Opens (creating if needed) a store rooted at `root`, and removes temp files a
    /// previous process left behind: those untouched for [`TMP_STALE`]. Younger ones may
    /// be another process's writes in progress (the server's, while `ferry registry gc`
    /// opens the same root), which must not fail under it.
    pub fn open(root: &Path) -> Result<FsStorage> {
        fs::create_dir_all(root)?;
        for dir in [
            "blobs/sha256",
            "blobs/sha512",
            "uploads",
            "repositories",
            "tmp",
        ] {
            create_dirs_durable(&root.join(dir))?;
        }
        let tmp = root.join("tmp");
        let now = SystemTime::now();
        for entry in fs::read_dir(&tmp)? {
            let entry = entry?;
            let Some(meta) = optional(entry.metadata())? else {
                continue;
            };
            let age = now.duration_since(meta.modified()?).unwrap_or_default();
            if age < TMP_STALE {
                continue;
            }
            let path = entry.path();
            match fs::remove_file(&path) {
                Err(e) if e.kind() == io::ErrorKind::IsADirectory => fs::remove_dir_all(&path)?,
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
        }
        Ok(FsStorage {
            root: root.to_path_buf(),
            sessions: Mutex::new(HashMap::new()),
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf> {
        let (alg, hex) = digest_parts(digest)?;
        let mut p = PathBuf::with_capacity(self.root.as_os_str().len() + 160);
        p.push(&self.root);
        p.push("blobs");
        p.push(alg);
        p.push(&hex[..2]);
        p.push(hex);
        Ok(p)
    }

    fn upload_dir(&self, id: &str) -> Option<PathBuf> {
        valid_upload_id(id).then(|| self.root.join("uploads").join(id))
    }

    fn repo_dir(&self, repo: &RepositoryName) -> Result<PathBuf> {
        let mut p = PathBuf::with_capacity(self.root.as_os_str().len() + repo.len() + 100);
        p.push(&self.root);
        p.push("repositories");
        p.push(repo.as_str());
        Ok(p)
    }

    /// Holds one `<alg>/` directory of blob links per algorithm.
    fn layers_dir(&self, repo: &RepositoryName) -> Result<PathBuf> {
        Ok(self.repo_dir(repo)?.join("_layers"))
    }

    fn layer_link(&self, repo: &RepositoryName, digest: &str) -> Result<PathBuf> {
        let (alg, hex) = digest_parts(digest)?;
        let mut p = self.layers_dir(repo)?;
        p.push(alg);
        p.push(hex);
        Ok(p)
    }

    /// Holds one `<alg>/` directory of manifest links per algorithm.
    fn revisions_dir(&self, repo: &RepositoryName) -> Result<PathBuf> {
        Ok(self.repo_dir(repo)?.join("_manifests/revisions"))
    }

    fn manifest_link(&self, repo: &RepositoryName, digest: &str) -> Result<PathBuf> {
        let (alg, hex) = digest_parts(digest)?;
        let mut p = self.revisions_dir(repo)?;
        p.push(alg);
        p.push(hex);
        Ok(p)
    }

    fn tags_dir(&self, repo: &RepositoryName) -> Result<PathBuf> {
        Ok(self.repo_dir(repo)?.join("_manifests/tags"))
    }

    fn tag_path(&self, repo: &RepositoryName, tag: &Tag) -> Result<PathBuf> {
        let mut p = self.tags_dir(repo)?;
        p.push(tag.as_str());
        Ok(p)
    }

    /// Holds one `<alg>/` directory of referrer links per algorithm.
    fn referrers_dir(&self, repo: &RepositoryName, subject: &str) -> Result<PathBuf> {
        let (alg, hex) = digest_parts(subject)?;
        let mut p = self.repo_dir(repo)?;
        p.push("_referrers");
        p.push(alg);
        p.push(hex);
        Ok(p)
    }

    fn gc_record_path(&self, dir: &str, name: Option<&str>) -> Result<PathBuf> {
        check_gc_record(dir, name)?;
        let dir = self.root.join("gc").join(dir);
        Ok(match name {
            Some(name) => dir.join(name),
            None => dir,
        })
    }

    fn temp_path(&self) -> PathBuf {
        self.root
            .join("tmp")
            .join(hex::encode(rand::random::<[u8; 12]>()))
    }

    fn sessions(
        &self,
    ) -> MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<Option<RunningHash>>>>> {
        self.sessions.lock()
    }

    fn session(&self, id: &str) -> Arc<tokio::sync::Mutex<Option<RunningHash>>> {
        self.sessions().entry(id.to_string()).or_default().clone()
    }

    fn forget_session(&self, id: &str) {
        self.sessions().remove(id);
    }
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| StorageError::Io(io::Error::other(e)))?
}

fn not_found(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
}

/// Maps "not found" to `None`.
fn optional<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` and any missing ancestors, fsyncing each parent that gained an entry.
fn create_dirs_durable(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir
        .parent()
        .ok_or_else(|| io::Error::other(format!("cannot create {}", dir.display())))?;
    create_dirs_durable(parent)?;
    match fs::create_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    sync_dir(parent)
}

/// Renames `from` onto `to` (creating `to`'s directory if needed) and makes it durable.
fn rename_durable(from: &Path, to: &Path) -> io::Result<()> {
    let parent = to
        .parent()
        .ok_or_else(|| io::Error::other(format!("no parent for {}", to.display())))?;
    match fs::rename(from, to) {
        Err(e) if not_found(&e) && from.exists() => {
            create_dirs_durable(parent)?;
            fs::rename(from, to)?;
        }
        other => other?,
    }
    sync_dir(parent)
}

/// Replaces `dest` with `contents` atomically and durably, via a temp file.
fn write_atomic(tmp: &Path, dest: &Path, contents: &[u8]) -> io::Result<()> {
    let result = (|| {
        let mut file = File::create_new(tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        drop(file);
        rename_durable(tmp, dest)
    })();
    if result.is_err() {
        let _ = fs::remove_file(tmp);
    }
    result
}

/// Creates the empty file `path` (a link), or refreshes its time if it exists, so garbage
/// collection's grace period counts from the latest link.
fn touch_link(path: &Path) -> io::Result<()> {
    let created = match File::create_new(path) {
        Ok(_) => true,
        Err(e) if not_found(&e) => {
            let parent = path
                .parent()
                .ok_or_else(|| io::Error::other(format!("no parent for {}", path.display())))?;
            create_dirs_durable(parent)?;
            match File::create_new(path) {
                Ok(_) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                Err(e) => return Err(e),
            }
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(e),
    };
    if created {
        if let Some(parent) = path.parent() {
            sync_dir(parent)?;
        }
    } else {
        touch(path)?;
    }
    Ok(())
}

/// Sets `path`'s modification time to now; `false` if it does not exist.
fn touch(path: &Path) -> io::Result<bool> {
    match optional(OpenOptions::new().write(true).open(path))? {
        Some(file) => {
            file.set_modified(SystemTime::now())?;
            Ok(true)
        }
        None => Ok(false),
    }
}

fn remove_optional(path: &Path) -> io::Result<bool> {
    Ok(optional(fs::remove_file(path))?.is_some())
}

/// Reads a small file whole, refusing more than `max` bytes; `None` if absent.
fn read_small(path: &Path, max: usize) -> io::Result<Option<Vec<u8>>> {
    let Some(file) = optional(File::open(path))? else {
        return Ok(None);
    };
    let mut out = Vec::new();
    file.take(max as u64 + 1).read_to_end(&mut out)?;
    if out.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is larger than {max} bytes", path.display()),
        ));
    }
    Ok(Some(out))
}

/// Names in `dir/<alg>/` (for each stored algorithm) that are hex strings of that
/// algorithm, as `<alg>:<hex>` with their modification time; empty if none exist.
fn list_digests(dir: &Path, with_times: bool) -> io::Result<Vec<(String, Option<SystemTime>)>> {
    let mut out = Vec::new();
    for alg in STORED_ALGORITHMS {
        list_digests_of(&dir.join(alg), alg, with_times, &mut out)?;
    }
    out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

fn list_digests_of(
    dir: &Path,
    alg: &str,
    with_times: bool,
    out: &mut Vec<(String, Option<SystemTime>)>,
) -> io::Result<()> {
    let Some(entries) = optional(fs::read_dir(dir))? else {
        return Ok(());
    };
    for entry in entries {
        let entry = entry?;
        let Some(name) = entry
            .file_name()
            .to_str()
            .and_then(|n| listed_digest(alg, n))
        else {
            continue;
        };
        let modified = if with_times {
            match optional(entry.metadata())? {
                Some(meta) => Some(meta.modified()?),
                None => continue, // removed while listing
            }
        } else {
            None
        };
        out.push((name, modified));
    }
    Ok(())
}

/// Hashes the whole of `file` into `hasher`.
fn hash_file(file: &mut File, mut hasher: ContentHasher) -> io::Result<ContentHasher> {
    file.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; WRITE_BATCH];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher);
        }
        hasher.update(&buf[..n]);
    }
}

/// Writes `body` to `file` (at its current position) in batches on blocking threads,
/// updating `hasher` with the same bytes, refusing to go past `limit` bytes in total
/// (counting the `already` bytes before it). Returns the file, the hash and the number of
/// bytes written. On error some of the body may have been written; the caller undoes it.
async fn write_stream(
    file: File,
    hasher: Option<ContentHasher>,
    mut body: ByteStream,
    already: u64,
    limit: u64,
) -> Result<(File, Option<ContentHasher>, u64)> {
    type Writer = (File, Option<ContentHasher>);
    let mut idle: Option<Writer> = Some((file, hasher));
    let mut busy: Option<JoinHandle<io::Result<Writer>>> = None;

    async fn settle(
        idle: &mut Option<Writer>,
        busy: &mut Option<JoinHandle<io::Result<Writer>>>,
    ) -> Result<Writer> {
        if let Some(handle) = busy.take() {
            return Ok(handle.await.map_err(io::Error::other)??);
        }
        idle.take()
            .ok_or_else(|| StorageError::Io(io::Error::other("upload writer lost")))
    }

    let mut batch = BytesMut::new();
    let mut written: u64 = 0;
    loop {
        let done = match body.next().await {
            Some(Ok(chunk)) => {
                written += chunk.len() as u64;
                if already.saturating_add(written) > limit {
                    settle(&mut idle, &mut busy).await?;
                    return Err(StorageError::TooLarge { limit });
                }
                batch.extend_from_slice(&chunk);
                false
            }
            Some(Err(e)) => {
                settle(&mut idle, &mut busy).await?;
                return Err(StorageError::Body(e));
            }
            None => true,
        };
        if batch.len() >= WRITE_BATCH || (done && !batch.is_empty()) {
            let (mut file, mut hasher) = settle(&mut idle, &mut busy).await?;
            let buf = batch.split().freeze();
            busy = Some(tokio::task::spawn_blocking(move || {
                file.write_all(&buf)?;
                if let Some(h) = hasher.as_mut() {
                    h.update(&buf);
                }
                Ok((file, hasher))
            }));
        }
        if done {
            let (file, hasher) = settle(&mut idle, &mut busy).await?;
            return Ok((file, hasher, written));
        }
    }
}

#[async_trait]
impl Storage for FsStorage {
    async fn blob_size(&self, digest: &Digest) -> Result<Option<u64>> {
        let digest: &str = digest.as_ref();
        let path = self.blob_path(digest)?;
        Ok(optional(tokio::fs::metadata(path).await)?.map(|m| m.len()))
    }

    async fn blob_read(
        &self,
        digest: &Digest,
        range: Option<Range<u64>>,
    ) -> Result<Option<BlobRead>> {
        let digest: &str = digest.as_ref();
        let path = self.blob_path(digest)?;
        let opened = blocking(move || {
            let Some(mut file) = optional(File::open(&path))? else {
                return Ok(None);
            };
            let size = file.metadata()?.len();
            let (start, end) = match range {
                None => (0, size),
                Some(r) if r.start <= r.end && r.end <= size => (r.start, r.end),
                Some(r) => {
                    return Err(StorageError::Invalid(format!(
                        "range {}..{} of a {size}-byte blob",
                        r.start, r.end
                    )));
                }
            };
            if start > 0 {
                file.seek(SeekFrom::Start(start))?;
            }
            Ok(Some((file, size, end - start)))
        })
        .await?;
        Ok(opened.map(|(file, size, len)| {
            let reader = tokio::fs::File::from_std(file).take(len);
            BlobRead {
                size,
                body: Box::pin(ReaderStream::with_capacity(reader, READ_CHUNK)),
            }
        }))
    }

    async fn blob_delete(&self, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let path = self.blob_path(digest)?;
        Ok(optional(tokio::fs::remove_file(path).await)?.is_some())
    }

    async fn blob_list(&self) -> Result<Vec<BlobInfo>> {
        let blobs = self.root.join("blobs");
        blocking(move || {
            let mut out = Vec::new();
            for alg in STORED_ALGORITHMS {
                let Some(shards) = optional(fs::read_dir(blobs.join(alg)))? else {
                    continue;
                };
                for shard in shards {
                    let shard = shard?;
                    let name = shard.file_name();
                    let Some(prefix) = name.to_str() else {
                        continue;
                    };
                    if prefix.len() != 2 || !shard.file_type()?.is_dir() {
                        continue;
                    }
                    for entry in fs::read_dir(shard.path())? {
                        let entry = entry?;
                        let name = entry.file_name();
                        let Some(hex) = name.to_str() else { continue };
                        let Some(digest) = listed_digest(alg, hex) else {
                            continue;
                        };
                        if !hex.starts_with(prefix) {
                            continue;
                        }
                        let Some(meta) = optional(entry.metadata())? else {
                            continue;
                        };
                        out.push(BlobInfo {
                            digest,
                            size: meta.len(),
                            modified: meta.modified()?,
                        });
                    }
                }
            }
            out.sort_unstable_by(|a, b| a.digest.cmp(&b.digest));
            Ok(out)
        })
        .await
    }

    async fn blob_put(&self, digest: &Digest, body: ByteStream, limit: u64) -> Result<u64> {
        let digest: &str = digest.as_ref();
        // The body is always received and hashed, also when the blob is already stored:
        // accepting a push by its digest alone would let anyone with push rights anywhere
        // link (and so read) any blob of any repository by naming it.
        let dest = self.blob_path(digest)?;
        let tmp = self.temp_path();
        let tmp_for_create = tmp.clone();
        let file = blocking(move || Ok(File::create_new(&tmp_for_create)?)).await?;
        let written = write_stream(file, Some(hasher_for(digest)?), body, 0, limit).await;
        let expected = digest.to_string();
        blocking(move || {
            let result = (|| {
                let (file, hasher, size) = written?;
                let actual = hasher.map(digest_string).unwrap_or_default();
                if actual != expected {
                    return Err(StorageError::DigestMismatch { expected, actual });
                }
                // Already stored: keep it young for a concurrent collection, drop the copy.
                if touch(&dest)? {
                    let _ = fs::remove_file(&tmp);
                    return Ok(size);
                }
                file.sync_all()?;
                drop(file);
                rename_durable(&tmp, &dest)?;
                Ok(size)
            })();
            if result.is_err() {
                let _ = fs::remove_file(&tmp);
            }
            result
        })
        .await
    }

    async fn upload_start(&self, repo: &RepositoryName) -> Result<String> {
        let id = new_upload_id();
        let dir = self.root.join("uploads").join(&id);
        let repo = repo.to_string();
        blocking(move || {
            fs::create_dir(&dir)?;
            // The owner is written before the data file exists: a session without its
            // `repo` file is never visible (upload_size looks for `data`).
            fs::write(dir.join("repo"), repo.as_bytes())?;
            File::create_new(dir.join("data"))?;
            Ok(())
        })
        .await?;
        Ok(id)
    }

    async fn upload_repo(&self, id: &str) -> Result<Option<String>> {
        let Some(dir) = self.upload_dir(id) else {
            return Ok(None);
        };
        let Some(bytes) = optional(tokio::fs::read(dir.join("repo")).await)? else {
            return Ok(None);
        };
        // Bounded by what upload_start wrote (a validated name); anything else is garbage.
        if bytes.len() > 4096 {
            return Ok(None);
        }
        Ok(String::from_utf8(bytes).ok())
    }

    async fn upload_size(&self, id: &str) -> Result<Option<u64>> {
        let Some(dir) = self.upload_dir(id) else {
            return Ok(None);
        };
        Ok(optional(tokio::fs::metadata(dir.join("data")).await)?.map(|m| m.len()))
    }

    async fn upload_append(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        limit: u64,
    ) -> Result<u64> {
        let unknown = || StorageError::UploadUnknown(id.to_string());
        let data = self.upload_dir(id).ok_or_else(unknown)?.join("data");
        let session = self.session(id);
        let mut running = session.lock().await;

        let path = data.clone();
        let opened = blocking(move || {
            let Some(file) = optional(OpenOptions::new().append(true).open(&path))? else {
                return Ok(None);
            };
            let have = file.metadata()?.len();
            Ok(Some((file, have)))
        })
        .await?;
        let Some((file, have)) = opened else {
            drop(running);
            self.forget_session(id);
            return Err(unknown());
        };
        if have != offset {
            return Err(StorageError::OutOfOrder { have, got: offset });
        }
        if offset > limit {
            return Err(StorageError::TooLarge { limit });
        }
        let hasher = match running.take() {
            Some(r) if r.len == have => Some(r.hasher),
            // The algorithm is known only at finish: hash as sha256, the canonical one and
            // nearly every push; a sha512 finish re-reads the data once (upload_finish).
            _ if have == 0 => Some(ContentHasher::default()),
            _ => None, // unknown state (restarted): finish re-reads the data
        };
        let before = hasher.clone();
        match write_stream(file, hasher, body, offset, limit).await {
            Ok((_file, hasher, written)) => {
                let len = offset + written;
                *running = hasher.map(|hasher| RunningHash { hasher, len });
                Ok(len)
            }
            Err(e) => {
                // Put the session back as it was before this chunk.
                blocking(move || {
                    OpenOptions::new()
                        .write(true)
                        .open(&data)?
                        .set_len(offset)?;
                    Ok(())
                })
                .await?;
                *running = before.map(|hasher| RunningHash {
                    hasher,
                    len: offset,
                });
                Err(e)
            }
        }
    }

    async fn upload_finish(&self, id: &str, digest: &Digest) -> Result<u64> {
        let digest: &str = digest.as_ref();
        let dest = self.blob_path(digest)?;
        let fresh = hasher_for(digest)?;
        let dir = self
            .upload_dir(id)
            .ok_or_else(|| StorageError::UploadUnknown(id.to_string()))?;
        let session = self.session(id);
        let mut running = session.lock().await;
        let cached = running.take();
        let (expected, id_owned) = (digest.to_string(), id.to_string());
        let result = blocking(move || {
            let data = dir.join("data");
            let Some(mut file) = optional(File::open(&data))? else {
                return Err(StorageError::UploadUnknown(id_owned));
            };
            let size = file.metadata()?.len();
            let hasher = match cached {
                Some(r) if r.len == size && r.hasher.algorithm() == fresh.algorithm() => r.hasher,
                _ => hash_file(&mut file, fresh)?,
            };
            let actual = digest_string(hasher);
            if actual != expected {
                fs::remove_dir_all(&dir)?;
                return Err(StorageError::DigestMismatch { expected, actual });
            }
            if !touch(&dest)? {
                file.sync_all()?;
                drop(file);
                rename_durable(&data, &dest)?;
            }
            fs::remove_dir_all(&dir)?;
            Ok(size)
        })
        .await;
        drop(running);
        self.forget_session(id);
        result
    }

    async fn upload_cancel(&self, id: &str) -> Result<bool> {
        let Some(dir) = self.upload_dir(id) else {
            return Ok(false);
        };
        let session = self.session(id);
        let running = session.lock().await;
        let existed = optional(tokio::fs::remove_dir_all(dir).await)?.is_some();
        drop(running);
        self.forget_session(id);
        Ok(existed)
    }

    async fn upload_list_stale(&self, older_than: Duration) -> Result<Vec<String>> {
        let uploads = self.root.join("uploads");
        blocking(move || {
            let now = SystemTime::now();
            let mut out = Vec::new();
            for entry in fs::read_dir(&uploads)? {
                let entry = entry?;
                let Some(id) = entry.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                if !valid_upload_id(&id) {
                    continue;
                }
                // Appends touch the data file; a session that crashed before creating it
                // only has the directory's time.
                let meta = match optional(fs::metadata(entry.path().join("data")))? {
                    Some(m) => m,
                    None => match optional(entry.metadata())? {
                        Some(m) => m,
                        None => continue,
                    },
                };
                if now
                    .duration_since(meta.modified()?)
                    .is_ok_and(|age| age >= older_than)
                {
                    out.push(id);
                }
            }
            out.sort_unstable();
            Ok(out)
        })
        .await
    }

    async fn link_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<()> {
        let digest: &str = digest.as_ref();
        let link = self.layer_link(repo, digest)?;
        let blob = self.blob_path(digest)?;
        blocking(move || {
            touch_link(&link)?;
            // Keep a linked blob young, so a collection running now does not delete it.
            touch(&blob)?;
            Ok(())
        })
        .await
    }

    async fn blob_linked(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let link = self.layer_link(repo, digest)?;
        Ok(optional(tokio::fs::metadata(link).await)?.is_some())
    }

    async fn unlink_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let link = self.layer_link(repo, digest)?;
        Ok(optional(tokio::fs::remove_file(link).await)?.is_some())
    }

    async fn repo_blobs(&self, repo: &RepositoryName) -> Result<Vec<String>> {
        let dir = self.layers_dir(repo)?;
        let list = blocking(move || Ok(list_digests(&dir, false)?)).await?;
        Ok(list.into_iter().map(|(d, _)| d).collect())
    }

    async fn repo_blob_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        let dir = self.layers_dir(repo)?;
        let list = blocking(move || Ok(list_digests(&dir, true)?)).await?;
        Ok(list
            .into_iter()
            .map(|(digest, modified)| LinkInfo { digest, modified })
            .collect())
    }

    async fn manifest_put(&self, repo: &RepositoryName, manifest: &StoredManifest) -> Result<()> {
        let blob = self.blob_path(&manifest.digest)?;
        let link = self.manifest_link(repo, &manifest.digest)?;
        if manifest.media_type.len() > MAX_MEDIA_TYPE_BYTES {
            return Err(StorageError::Invalid(format!(
                "media type of {} bytes",
                manifest.media_type.len()
            )));
        }
        let (tmp_blob, tmp_link) = (self.temp_path(), self.temp_path());
        let manifest = manifest.clone();
        blocking(move || {
            let actual = digest_like(&manifest.digest, &manifest.bytes)?;
            if actual != manifest.digest {
                return Err(StorageError::DigestMismatch {
                    expected: manifest.digest,
                    actual,
                });
            }
            if !touch(&blob)? {
                write_atomic(&tmp_blob, &blob, &manifest.bytes)?;
            }
            write_atomic(&tmp_link, &link, manifest.media_type.as_bytes())?;
            Ok(())
        })
        .await
    }

    async fn manifest_get(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<StoredManifest>> {
        let digest: &str = digest.as_ref();
        let link = self.manifest_link(repo, digest)?;
        let blob = self.blob_path(digest)?;
        let digest = digest.to_string();
        blocking(move || {
            let Some(media_type) = read_small(&link, MAX_MEDIA_TYPE_BYTES)? else {
                return Ok(None);
            };
            let media_type = String::from_utf8(media_type).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "manifest media type is not UTF-8",
                )
            })?;
            let Some(file) = optional(File::open(&blob))? else {
                return Ok(None);
            };
            let size = file.metadata()?.len();
            if size > MAX_MANIFEST_BYTES {
                return Err(StorageError::TooLarge {
                    limit: MAX_MANIFEST_BYTES,
                });
            }
            let mut bytes = Vec::with_capacity(size as usize);
            file.take(MAX_MANIFEST_BYTES).read_to_end(&mut bytes)?;
            Ok(Some(StoredManifest {
                digest,
                media_type,
                bytes: bytes.into(),
            }))
        })
        .await
    }

    async fn manifest_delete(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let link = self.manifest_link(repo, digest)?;
        let tags = self.tags_dir(repo)?;
        let digest = digest.to_string();
        blocking(move || {
            if !remove_optional(&link)? {
                return Ok(false);
            }
            let Some(entries) = optional(fs::read_dir(&tags))? else {
                return Ok(true);
            };
            for entry in entries {
                let path = entry?.path();
                if read_small(&path, 256)?.is_some_and(|target| target == digest.as_bytes()) {
                    remove_optional(&path)?;
                }
            }
            Ok(true)
        })
        .await
    }

    async fn manifest_list(&self, repo: &RepositoryName) -> Result<Vec<String>> {
        let dir = self.revisions_dir(repo)?;
        let list = blocking(move || Ok(list_digests(&dir, false)?)).await?;
        Ok(list.into_iter().map(|(d, _)| d).collect())
    }

    async fn manifest_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        let dir = self.revisions_dir(repo)?;
        let list = blocking(move || Ok(list_digests(&dir, true)?)).await?;
        Ok(list
            .into_iter()
            .map(|(digest, modified)| LinkInfo { digest, modified })
            .collect())
    }

    async fn tag_set(&self, repo: &RepositoryName, tag: &Tag, digest: &Digest) -> Result<()> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let path = self.tag_path(repo, tag)?;
        let tmp = self.temp_path();
        let digest = digest.to_string();
        blocking(move || Ok(write_atomic(&tmp, &path, digest.as_bytes())?)).await
    }

    async fn tag_get(&self, repo: &RepositoryName, tag: &Tag) -> Result<Option<String>> {
        let path = self.tag_path(repo, tag)?;
        let Some(bytes) = blocking(move || Ok(read_small(&path, 256)?)).await? else {
            return Ok(None);
        };
        let digest = String::from_utf8(bytes)
            .ok()
            .filter(|d| digest_parts(d).is_ok());
        match digest {
            Some(d) => Ok(Some(d)),
            None => Err(StorageError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("tag {tag} of {repo} does not hold a digest"),
            ))),
        }
    }

    async fn tag_delete(&self, repo: &RepositoryName, tag: &Tag) -> Result<bool> {
        let path = self.tag_path(repo, tag)?;
        Ok(optional(tokio::fs::remove_file(path).await)?.is_some())
    }

    async fn tag_list(&self, repo: &RepositoryName) -> Result<Option<Vec<String>>> {
        let tags = self.tags_dir(repo)?;
        let repo_dir = self.repo_dir(repo)?;
        blocking(move || {
            let Some(entries) = optional(fs::read_dir(&tags))? else {
                return Ok(is_repo_dir(&repo_dir)?.then(Vec::new));
            };
            let mut out = Vec::new();
            for entry in entries {
                let entry = entry?;
                match entry.file_name().to_str() {
                    Some(name) if check_tag(name).is_ok() => out.push(name.to_string()),
                    _ => {}
                }
            }
            out.sort_unstable();
            Ok(Some(out))
        })
        .await
    }

    async fn repo_list(&self) -> Result<Vec<String>> {
        let root = self.root.join("repositories");
        blocking(move || {
            let mut out = Vec::new();
            collect_repos(&root, String::new(), 0, &mut out)?;
            out.sort_unstable();
            Ok(out)
        })
        .await
    }

    async fn referrer_add(
        &self,
        repo: &RepositoryName,
        subject: &Digest,
        referrer: &Digest,
    ) -> Result<()> {
        let subject: &str = subject.as_ref();
        let referrer: &str = referrer.as_ref();
        let (alg, hex) = digest_parts(referrer)?;
        let path = self.referrers_dir(repo, subject)?.join(alg).join(hex);
        blocking(move || Ok(touch_link(&path)?)).await
    }

    async fn referrer_list(&self, repo: &RepositoryName, subject: &Digest) -> Result<Vec<String>> {
        let subject: &str = subject.as_ref();
        let dir = self.referrers_dir(repo, subject)?;
        let revisions = self.revisions_dir(repo)?;
        blocking(move || {
            let mut out = Vec::new();
            for (digest, _) in list_digests(&dir, false)? {
                let Some((alg, hex)) = digest.split_once(':') else {
                    continue;
                };
                if revisions.join(alg).join(hex).exists() {
                    out.push(digest);
                }
            }
            Ok(out)
        })
        .await
    }

    async fn gc_record_put(&self, dir: &str, name: &str) -> Result<()> {
        let path = self.gc_record_path(dir, Some(name))?;
        blocking(move || Ok(touch_link(&path)?)).await
    }

    async fn gc_record_exists(&self, dir: &str, name: &str) -> Result<bool> {
        let path = self.gc_record_path(dir, Some(name))?;
        blocking(move || Ok(optional(fs::symlink_metadata(&path))?.is_some())).await
    }

    async fn gc_record_list(&self, dir: &str) -> Result<Vec<(String, SystemTime)>> {
        let dir = self.gc_record_path(dir, None)?;
        blocking(move || {
            let Some(entries) = optional(fs::read_dir(&dir))? else {
                return Ok(Vec::new());
            };
            let mut out = Vec::new();
            for entry in entries {
                let entry = entry?;
                let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                match optional(entry.metadata())? {
                    Some(meta) if meta.is_file() => out.push((name, meta.modified()?)),
                    _ => {} // removed while listing, or not a record
                }
            }
            out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            Ok(out)
        })
        .await
    }

    async fn gc_record_delete(&self, dir: &str, name: &str) -> Result<bool> {
        let path = self.gc_record_path(dir, Some(name))?;
        blocking(move || Ok(remove_optional(&path)?)).await
    }
}

/// Whether `dir` is a repository (holds any of the `_`-prefixed bookkeeping directories).
fn is_repo_dir(dir: &Path) -> io::Result<bool> {
    let Some(entries) = optional(fs::read_dir(dir))? else {
        return Ok(false);
    };
    for entry in entries {
        if entry?
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with('_'))
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Longest repository name: 255 bytes, so at most 128 path components.
const MAX_REPO_DEPTH: usize = 128;

/// Adds every repository at or under `dir` (named `name`) to `out`.
fn collect_repos(dir: &Path, name: String, depth: usize, out: &mut Vec<String>) -> io::Result<()> {
    if depth > MAX_REPO_DEPTH {
        return Ok(());
    }
    let Some(entries) = optional(fs::read_dir(dir))? else {
        return Ok(());
    };
    let mut is_repo = false;
    let mut children = Vec::new();
    for entry in entries {
        let entry = entry?;
        let Some(child) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if child.starts_with('_') {
            is_repo = true;
        } else if entry.file_type()?.is_dir() {
            children.push(child);
        }
    }
    if is_repo && !name.is_empty() {
        out.push(name.clone());
    }
    for child in children {
        let child_name = if name.is_empty() {
            child.clone()
        } else {
            format!("{name}/{child}")
        };
        if check_repo(&child_name).is_ok() {
            collect_repos(&dir.join(&child), child_name, depth + 1, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::conformance::{
        self, LIMIT, body, digest, pattern, read_all, stored, td, tr, tt,
    };
    use super::*;

    #[tokio::test]
    async fn conformance() {
        let dir = tempfile::tempdir().unwrap();
        conformance::run(&FsStorage::open(dir.path()).unwrap()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_appends() {
        let dir = tempfile::tempdir().unwrap();
        conformance::racing_appends(&FsStorage::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn reopen_keeps_everything() {
        let dir = tempfile::tempdir().unwrap();
        let data = pattern(5000, 3);
        let d = digest(&data);
        let m = stored(conformance::manifest_json(&d, &[&d], None));
        let upload;
        {
            let s = FsStorage::open(dir.path()).unwrap();
            s.blob_put(&td(&d), body(&[&data]), LIMIT).await.unwrap();
            s.link_blob(&tr("r/x"), &td(&d)).await.unwrap();
            s.manifest_put(&tr("r/x"), &m).await.unwrap();
            s.tag_set(&tr("r/x"), &tt("latest"), &td(&m.digest))
                .await
                .unwrap();
            s.referrer_add(&tr("r/x"), &td(&d), &td(&m.digest))
                .await
                .unwrap();
            upload = s.upload_start(&tr("conformance/repo")).await.unwrap();
            s.upload_append(&upload, 0, body(&[&data[..1234]]), LIMIT)
                .await
                .unwrap();
        }
        let s = FsStorage::open(dir.path()).unwrap();
        assert_eq!(s.blob_size(&td(&d)).await.unwrap(), Some(5000));
        assert!(s.blob_linked(&tr("r/x"), &td(&d)).await.unwrap());
        assert_eq!(
            s.manifest_get(&tr("r/x"), &td(&m.digest))
                .await
                .unwrap()
                .unwrap()
                .bytes,
            m.bytes
        );
        assert_eq!(
            s.tag_get(&tr("r/x"), &tt("latest")).await.unwrap(),
            Some(m.digest.clone())
        );
        assert_eq!(
            s.referrer_list(&tr("r/x"), &td(&d)).await.unwrap(),
            vec![m.digest.clone()]
        );
        assert_eq!(s.repo_list().await.unwrap(), vec!["r/x"]);
        // The upload continues after the restart; finishing re-hashes what is on disk
        // because this process never saw the first chunk.
        assert_eq!(s.upload_size(&upload).await.unwrap(), Some(1234));
        s.upload_append(&upload, 1234, body(&[&data[1234..]]), LIMIT)
            .await
            .unwrap();
        s.blob_delete(&td(&d)).await.unwrap();
        assert_eq!(s.upload_finish(&upload, &td(&d)).await.unwrap(), 5000);
        let read = s.blob_read(&td(&d), None).await.unwrap().unwrap();
        assert_eq!(read_all(read).await, data);
    }

    #[tokio::test]
    async fn restarted_upload_with_wrong_bytes_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let data = pattern(3000, 9);
        let id = {
            let s = FsStorage::open(dir.path()).unwrap();
            let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
            s.upload_append(&id, 0, body(&[&data]), LIMIT)
                .await
                .unwrap();
            id
        };
        // A crash corrupted the tail (or the client lied): the re-hash catches it.
        let path = dir.path().join("uploads").join(&id).join("data");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[2999] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let s = FsStorage::open(dir.path()).unwrap();
        let err = s.upload_finish(&id, &td(&digest(&data))).await.unwrap_err();
        assert!(
            matches!(err, StorageError::DigestMismatch { .. }),
            "{err:?}"
        );
        assert_eq!(s.blob_size(&td(&digest(&data))).await.unwrap(), None);
        assert!(s.blob_list().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn crash_leftovers_are_never_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let data = b"complete".to_vec();
        let d = digest(&data);
        let hex = d.strip_prefix("sha256:").unwrap().to_string();
        {
            let s = FsStorage::open(root).unwrap();
            s.blob_put(&td(&d), body(&[&data]), LIMIT).await.unwrap();
            let id = s.upload_start(&tr("conformance/repo")).await.unwrap();
            s.upload_append(&id, 0, body(&[b"half of a bl"]), LIMIT)
                .await
                .unwrap();
        }
        // What a crash can leave: a half-written temp file of a blob being put, and a
        // stray non-blob name in a shard (nothing ferry writes, but must be ignored).
        let other = digest(b"other");
        let other_hex = other.strip_prefix("sha256:").unwrap();
        std::fs::write(root.join("tmp").join("0123456789ab"), b"oth").unwrap();
        std::fs::File::options()
            .write(true)
            .open(root.join("tmp").join("0123456789ab"))
            .unwrap()
            .set_modified(SystemTime::now() - TMP_STALE - Duration::from_secs(60))
            .unwrap();
        // A write in progress in another process (the server, while `ferry registry gc`
        // opens the root) stays.
        std::fs::write(root.join("tmp").join("in-progress"), b"writing").unwrap();
        let shard = root.join("blobs/sha256").join(&hex[..2]);
        std::fs::write(shard.join(format!("{hex}.tmp")), b"junk").unwrap();
        std::fs::write(shard.join(other_hex), b"wrong shard").unwrap();

        let s = FsStorage::open(root).unwrap();
        let left: Vec<_> = std::fs::read_dir(root.join("tmp"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            ["in-progress"],
            "stale temp files removed, fresh ones kept"
        );
        let list = s.blob_list().await.unwrap();
        assert_eq!(list.len(), 1, "{list:?}");
        assert_eq!((list[0].digest.as_str(), list[0].size), (d.as_str(), 8));
        assert_eq!(s.blob_size(&td(&other)).await.unwrap(), None);
        assert_eq!(
            s.blob_size(&td(&digest(b"half of a bl"))).await.unwrap(),
            None
        );
        // A session whose start was interrupted before its data file existed.
        let torn = "00000000000000000000000000000000";
        std::fs::create_dir(root.join("uploads").join(torn)).unwrap();
        assert_eq!(s.upload_size(torn).await.unwrap(), None);
        assert!(matches!(
            s.upload_append(torn, 0, body(&[b"x"]), LIMIT)
                .await
                .unwrap_err(),
            StorageError::UploadUnknown(_)
        ));
        // The interrupted uploads are stale, not blobs, and go away when cancelled.
        let stale = s.upload_list_stale(Duration::ZERO).await.unwrap();
        assert_eq!(stale.len(), 2, "{stale:?}");
        assert!(stale.iter().any(|id| id == torn));
        for id in &stale {
            assert!(s.upload_cancel(id).await.unwrap());
        }
        assert_eq!(std::fs::read_dir(root.join("uploads")).unwrap().count(), 0);
        assert_eq!(s.blob_list().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn layout_matches_the_documentation() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let s = FsStorage::open(root).unwrap();
        let data = b"layer".to_vec();
        let d = digest(&data);
        let hex = d.strip_prefix("sha256:").unwrap();
        s.blob_put(&td(&d), body(&[&data]), LIMIT).await.unwrap();
        s.link_blob(&tr("lib/app"), &td(&d)).await.unwrap();
        let m = stored(conformance::manifest_json(&d, &[], None));
        let mhex = m.digest.strip_prefix("sha256:").unwrap();
        s.manifest_put(&tr("lib/app"), &m).await.unwrap();
        s.tag_set(&tr("lib/app"), &tt("v1"), &td(&m.digest))
            .await
            .unwrap();
        s.referrer_add(&tr("lib/app"), &td(&d), &td(&m.digest))
            .await
            .unwrap();
        assert_eq!(
            std::fs::read(root.join(format!("blobs/sha256/{}/{hex}", &hex[..2]))).unwrap(),
            data
        );
        let repo = root.join("repositories/lib/app");
        assert!(repo.join(format!("_layers/sha256/{hex}")).is_file());
        assert_eq!(
            std::fs::read_to_string(repo.join(format!("_manifests/revisions/sha256/{mhex}")))
                .unwrap(),
            m.media_type
        );
        assert_eq!(
            std::fs::read_to_string(repo.join("_manifests/tags/v1")).unwrap(),
            m.digest
        );
        assert!(
            repo.join(format!("_referrers/sha256/{hex}/sha256/{mhex}"))
                .is_file()
        );
        assert_eq!(
            std::fs::read_dir(root.join("tmp")).unwrap().count(),
            0,
            "no temp file left"
        );
    }

    #[tokio::test]
    async fn blob_read_streams_large_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsStorage::open(dir.path()).unwrap();
        let data = pattern(3 * READ_CHUNK + 5, 4);
        let d = digest(&data);
        s.blob_put(&td(&d), body(&[&data]), LIMIT).await.unwrap();
        let range = 7..(2 * READ_CHUNK as u64 + 11);
        let read = s
            .blob_read(&td(&d), Some(range.clone()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read.size, data.len() as u64);
        assert!(read_all(read).await == data[range.start as usize..range.end as usize]);
        let err = s
            .blob_read(&td(&d), Some(5..(data.len() as u64 + 1)))
            .await
            .unwrap_err();
        assert!(matches!(err, StorageError::Invalid(_)), "{err:?}");
    }
}
