//! In-process [`Storage`]: everything in maps behind one lock, lost on exit.
//!
//! Used by tests (of the server, cache and garbage collector) and benchmarks; it keeps
//! every invariant of the trait so tests against it mean something for the real
//! backends. Bodies are collected before the lock is taken, so a slow client never holds
//! it, and each change happens under one lock acquisition, so it is atomic.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_oci::digest::ContentHasher;
use ferry_oci::{Digest, RepositoryName, Tag};
use futures_util::StreamExt;
use parking_lot::{Mutex, MutexGuard};

use super::{
    BlobInfo, BlobRead, ByteStream, LinkInfo, Result, Storage, StorageError, StoredManifest,
    check_gc_record, digest_like, digest_parts, digest_string, hasher_for, new_upload_id,
    valid_upload_id,
};

/// A [`Storage`] held in memory.
#[derive(Debug, Default)]
pub struct MemoryStorage {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    blobs: HashMap<String, Blob>,
    uploads: HashMap<String, Upload>,
    repos: BTreeMap<String, Repo>,
    /// Garbage collection's coordination records: (dir, name) → when written.
    records: BTreeMap<(String, String), SystemTime>,
}

#[derive(Debug)]
struct Blob {
    bytes: Bytes,
    modified: SystemTime,
}

#[derive(Debug)]
struct Upload {
    repo: String,
    data: BytesMut,
    /// Running sha256 of `data` (the canonical algorithm); a finish under another
    /// algorithm hashes `data` again.
    hasher: ContentHasher,
    touched: SystemTime,
}

#[derive(Debug, Default)]
struct Repo {
    blobs: HashMap<String, SystemTime>,
    /// Manifest digest → (media type, link time).
    manifests: HashMap<String, (String, SystemTime)>,
    tags: BTreeMap<String, String>,
    /// Subject digest → referrer digests.
    referrers: HashMap<String, BTreeSet<String>>,
}

impl MemoryStorage {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }
}

/// Reads `body` fully, failing with [`StorageError::TooLarge`] past `limit` bytes total
/// (counting `already` bytes held before it).
async fn collect_body(mut body: ByteStream, already: u64, limit: u64) -> Result<BytesMut> {
    let mut out = BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(StorageError::Body)?;
        if already + out.len() as u64 + chunk.len() as u64 > limit {
            return Err(StorageError::TooLarge { limit });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

fn slice_range(bytes: &Bytes, range: Option<Range<u64>>) -> Result<Bytes> {
    let len = bytes.len() as u64;
    match range {
        None => Ok(bytes.clone()),
        Some(r) if r.start <= r.end && r.end <= len => {
            // Both bounds are ≤ len, which came from a usize.
            Ok(bytes.slice(r.start as usize..r.end as usize))
        }
        Some(r) => Err(StorageError::Invalid(format!(
            "range {}..{} of a {len}-byte blob",
            r.start, r.end
        ))),
    }
}

#[async_trait]
impl Storage for MemoryStorage {
    async fn blob_size(&self, digest: &Digest) -> Result<Option<u64>> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        Ok(self.lock().blobs.get(digest).map(|b| b.bytes.len() as u64))
    }

    async fn blob_read(
        &self,
        digest: &Digest,
        range: Option<Range<u64>>,
    ) -> Result<Option<BlobRead>> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let Some(bytes) = self.lock().blobs.get(digest).map(|b| b.bytes.clone()) else {
            return Ok(None);
        };
        let part = slice_range(&bytes, range)?;
        Ok(Some(BlobRead {
            size: bytes.len() as u64,
            body: Box::pin(futures_util::stream::iter([Ok(part)])),
        }))
    }

    async fn blob_delete(&self, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        Ok(self.lock().blobs.remove(digest).is_some())
    }

    async fn blob_list(&self) -> Result<Vec<BlobInfo>> {
        let mut list: Vec<BlobInfo> = self
            .lock()
            .blobs
            .iter()
            .map(|(digest, b)| BlobInfo {
                digest: digest.clone(),
                size: b.bytes.len() as u64,
                modified: b.modified,
            })
            .collect();
        list.sort_by(|a, b| a.digest.cmp(&b.digest));
        Ok(list)
    }

    async fn blob_put(&self, digest: &Digest, body: ByteStream, limit: u64) -> Result<u64> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let data = collect_body(body, 0, limit).await?;
        let actual = digest_like(digest, &data)?;
        if actual != digest {
            return Err(StorageError::DigestMismatch {
                expected: digest.to_string(),
                actual,
            });
        }
        let size = data.len() as u64;
        commit_blob(&mut self.lock(), digest, data.freeze());
        Ok(size)
    }

    async fn upload_start(&self, repo: &RepositoryName) -> Result<String> {
        let repo: &str = repo;
        let id = new_upload_id();
        self.lock().uploads.insert(
            id.clone(),
            Upload {
                repo: repo.to_string(),
                data: BytesMut::new(),
                hasher: ContentHasher::default(),
                touched: SystemTime::now(),
            },
        );
        Ok(id)
    }

    async fn upload_repo(&self, id: &str) -> Result<Option<String>> {
        if !valid_upload_id(id) {
            return Ok(None);
        }
        Ok(self.lock().uploads.get(id).map(|u| u.repo.clone()))
    }

    async fn upload_size(&self, id: &str) -> Result<Option<u64>> {
        if !valid_upload_id(id) {
            return Ok(None);
        }
        Ok(self.lock().uploads.get(id).map(|u| u.data.len() as u64))
    }

    async fn upload_append(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        limit: u64,
    ) -> Result<u64> {
        let have = self.upload_size(id).await?;
        let have = have.ok_or_else(|| StorageError::UploadUnknown(id.to_string()))?;
        if have != offset {
            return Err(StorageError::OutOfOrder { have, got: offset });
        }
        let chunk = collect_body(body, offset, limit).await?;
        let mut state = self.lock();
        let upload = state
            .uploads
            .get_mut(id)
            .ok_or_else(|| StorageError::UploadUnknown(id.to_string()))?;
        // Another append may have landed while this body streamed in.
        let have = upload.data.len() as u64;
        if have != offset {
            return Err(StorageError::OutOfOrder { have, got: offset });
        }
        upload.hasher.update(&chunk);
        upload.data.extend_from_slice(&chunk);
        upload.touched = SystemTime::now();
        Ok(upload.data.len() as u64)
    }

    async fn upload_finish(&self, id: &str, digest: &Digest) -> Result<u64> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        if !valid_upload_id(id) {
            return Err(StorageError::UploadUnknown(id.to_string()));
        }
        let mut state = self.lock();
        let upload = state
            .uploads
            .remove(id)
            .ok_or_else(|| StorageError::UploadUnknown(id.to_string()))?;
        let mut fresh = hasher_for(digest)?;
        let actual = if upload.hasher.algorithm() == fresh.algorithm() {
            digest_string(upload.hasher)
        } else {
            fresh.update(&upload.data);
            digest_string(fresh)
        };
        if actual != digest {
            return Err(StorageError::DigestMismatch {
                expected: digest.to_string(),
                actual,
            });
        }
        let size = upload.data.len() as u64;
        commit_blob(&mut state, digest, upload.data.freeze());
        Ok(size)
    }

    async fn upload_cancel(&self, id: &str) -> Result<bool> {
        if !valid_upload_id(id) {
            return Ok(false);
        }
        Ok(self.lock().uploads.remove(id).is_some())
    }

    async fn upload_list_stale(&self, older_than: Duration) -> Result<Vec<String>> {
        let now = SystemTime::now();
        let mut ids: Vec<String> = self
            .lock()
            .uploads
            .iter()
            .filter(|(_, u)| {
                now.duration_since(u.touched)
                    .is_ok_and(|age| age >= older_than)
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        Ok(ids)
    }

    async fn link_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<()> {
        let repo: &str = repo;
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let mut state = self.lock();
        let now = SystemTime::now();
        // Linking an existing blob keeps it young, so a collection running right now
        // does not delete what was just linked.
        if let Some(blob) = state.blobs.get_mut(digest) {
            blob.modified = now;
        }
        state
            .repos
            .entry(repo.to_string())
            .or_default()
            .blobs
            .insert(digest.to_string(), now);
        Ok(())
    }

    async fn blob_linked(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let repo: &str = repo;
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        Ok(self
            .lock()
            .repos
            .get(repo)
            .is_some_and(|r| r.blobs.contains_key(digest)))
    }

    async fn unlink_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let repo: &str = repo;
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        Ok(self
            .lock()
            .repos
            .get_mut(repo)
            .is_some_and(|r| r.blobs.remove(digest).is_some()))
    }

    async fn repo_blobs(&self, repo: &RepositoryName) -> Result<Vec<String>> {
        Ok(self
            .repo_blob_links(repo)
            .await?
            .into_iter()
            .map(|l| l.digest)
            .collect())
    }

    async fn repo_blob_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        let repo: &str = repo;
        let state = self.lock();
        let mut links: Vec<LinkInfo> = state
            .repos
            .get(repo)
            .map(|r| {
                r.blobs
                    .iter()
                    .map(|(d, t)| LinkInfo {
                        digest: d.clone(),
                        modified: Some(*t),
                    })
                    .collect()
            })
            .unwrap_or_default();
        links.sort_by(|a, b| a.digest.cmp(&b.digest));
        Ok(links)
    }

    async fn manifest_put(&self, repo: &RepositoryName, manifest: &StoredManifest) -> Result<()> {
        let repo: &str = repo;
        let actual = digest_like(&manifest.digest, &manifest.bytes)?;
        if actual != manifest.digest {
            return Err(StorageError::DigestMismatch {
                expected: manifest.digest.clone(),
                actual,
            });
        }
        let mut state = self.lock();
        commit_blob(&mut state, &manifest.digest, manifest.bytes.clone());
        state
            .repos
            .entry(repo.to_string())
            .or_default()
            .manifests
            .insert(
                manifest.digest.clone(),
                (manifest.media_type.clone(), SystemTime::now()),
            );
        Ok(())
    }

    async fn manifest_get(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<StoredManifest>> {
        let repo: &str = repo;
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let state = self.lock();
        let Some((media_type, _)) = state.repos.get(repo).and_then(|r| r.manifests.get(digest))
        else {
            return Ok(None);
        };
        Ok(state.blobs.get(digest).map(|b| StoredManifest {
            digest: digest.to_string(),
            media_type: media_type.clone(),
            bytes: b.bytes.clone(),
        }))
    }

    async fn manifest_delete(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let repo: &str = repo;
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let mut state = self.lock();
        let Some(r) = state.repos.get_mut(repo) else {
            return Ok(false);
        };
        let existed = r.manifests.remove(digest).is_some();
        if existed {
            r.tags.retain(|_, target| target != digest);
        }
        Ok(existed)
    }

    async fn manifest_list(&self, repo: &RepositoryName) -> Result<Vec<String>> {
        Ok(self
            .manifest_links(repo)
            .await?
            .into_iter()
            .map(|l| l.digest)
            .collect())
    }

    async fn manifest_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        let repo: &str = repo;
        let state = self.lock();
        let mut links: Vec<LinkInfo> = state
            .repos
            .get(repo)
            .map(|r| {
                r.manifests
                    .iter()
                    .map(|(d, (_, t))| LinkInfo {
                        digest: d.clone(),
                        modified: Some(*t),
                    })
                    .collect()
            })
            .unwrap_or_default();
        links.sort_by(|a, b| a.digest.cmp(&b.digest));
        Ok(links)
    }

    async fn tag_set(&self, repo: &RepositoryName, tag: &Tag, digest: &Digest) -> Result<()> {
        let repo: &str = repo;
        let tag: &str = tag;
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        self.lock()
            .repos
            .entry(repo.to_string())
            .or_default()
            .tags
            .insert(tag.to_string(), digest.to_string());
        Ok(())
    }

    async fn tag_get(&self, repo: &RepositoryName, tag: &Tag) -> Result<Option<String>> {
        let repo: &str = repo;
        let tag: &str = tag;
        Ok(self
            .lock()
            .repos
            .get(repo)
            .and_then(|r| r.tags.get(tag).cloned()))
    }

    async fn tag_delete(&self, repo: &RepositoryName, tag: &Tag) -> Result<bool> {
        let repo: &str = repo;
        let tag: &str = tag;
        Ok(self
            .lock()
            .repos
            .get_mut(repo)
            .is_some_and(|r| r.tags.remove(tag).is_some()))
    }

    async fn tag_list(&self, repo: &RepositoryName) -> Result<Option<Vec<String>>> {
        let repo: &str = repo;
        Ok(self
            .lock()
            .repos
            .get(repo)
            .map(|r| r.tags.keys().cloned().collect()))
    }

    async fn repo_list(&self) -> Result<Vec<String>> {
        Ok(self.lock().repos.keys().cloned().collect())
    }

    async fn referrer_add(
        &self,
        repo: &RepositoryName,
        subject: &Digest,
        referrer: &Digest,
    ) -> Result<()> {
        let repo: &str = repo;
        let subject: &str = subject.as_ref();
        let referrer: &str = referrer.as_ref();
        digest_parts(subject)?;
        digest_parts(referrer)?;
        self.lock()
            .repos
            .entry(repo.to_string())
            .or_default()
            .referrers
            .entry(subject.to_string())
            .or_default()
            .insert(referrer.to_string());
        Ok(())
    }

    async fn referrer_list(&self, repo: &RepositoryName, subject: &Digest) -> Result<Vec<String>> {
        let repo: &str = repo;
        let subject: &str = subject.as_ref();
        digest_parts(subject)?;
        let state = self.lock();
        let Some(r) = state.repos.get(repo) else {
            return Ok(Vec::new());
        };
        Ok(r.referrers
            .get(subject)
            .map(|set| {
                set.iter()
                    .filter(|d| r.manifests.contains_key(*d))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn gc_record_put(&self, dir: &str, name: &str) -> Result<()> {
        check_gc_record(dir, Some(name))?;
        self.lock()
            .records
            .insert((dir.to_string(), name.to_string()), SystemTime::now());
        Ok(())
    }

    async fn gc_record_exists(&self, dir: &str, name: &str) -> Result<bool> {
        check_gc_record(dir, Some(name))?;
        Ok(self
            .lock()
            .records
            .contains_key(&(dir.to_string(), name.to_string())))
    }

    async fn gc_record_list(&self, dir: &str) -> Result<Vec<(String, SystemTime)>> {
        check_gc_record(dir, None)?;
        Ok(self
            .lock()
            .records
            .iter()
            .filter(|((d, _), _)| d == dir)
            .map(|((_, n), t)| (n.clone(), *t))
            .collect())
    }

    async fn gc_record_delete(&self, dir: &str, name: &str) -> Result<bool> {
        check_gc_record(dir, Some(name))?;
        Ok(self
            .lock()
            .records
            .remove(&(dir.to_string(), name.to_string()))
            .is_some())
    }
}

/// Makes `bytes` the committed blob `digest` (already verified), or refreshes the time of
/// an existing one so a concurrent collection keeps it.
fn commit_blob(state: &mut State, digest: &str, bytes: Bytes) {
    let now = SystemTime::now();
    state
        .blobs
        .entry(digest.to_string())
        .and_modify(|b| b.modified = now)
        .or_insert(Blob {
            bytes,
            modified: now,
        });
}

#[cfg(test)]
mod tests {
    use super::super::conformance;
    use super::MemoryStorage;

    #[tokio::test]
    async fn conformance() {
        conformance::run(&MemoryStorage::default()).await;
    }

    #[tokio::test]
    async fn racing_appends() {
        conformance::racing_appends(&MemoryStorage::default()).await;
    }
}
