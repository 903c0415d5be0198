//! A [`Storage`] for tests that forces interleavings: [`MemoryStorage`] underneath, and a
//! one-shot gate that stops the first call of a chosen kind until the test releases it.
//!
//! `let gate = s.arm("unlink_blob");` … `gate.reached().await` (the call is now held,
//! nothing of it done) … `gate.release()`. Call kinds are the method names, with the
//! record directory for coordination records (`gc_record_put deleting`).

#![allow(clippy::unwrap_used)]

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use ferry_oci::{Digest, RepositoryName, Tag};
use tokio::sync::Notify;

use super::memory::MemoryStorage;
use super::{BlobInfo, BlobRead, ByteStream, LinkInfo, Result, Storage, StoredManifest};

#[derive(Debug, Default)]
pub struct Gated {
    pub inner: MemoryStorage,
    gates: Mutex<Vec<(Vec<String>, Gate)>>,
    /// Every gated-kind call, in order (for asserting what happened).
    pub calls: Mutex<Vec<String>>,
}

/// A held call: the test waits for it to be reached and then lets it go on.
#[derive(Debug, Clone, Default)]
pub struct Gate {
    reached: Arc<Notify>,
    release: Arc<Notify>,
}

impl Gate {
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    pub fn release(&self) {
        self.release.notify_one();
    }
}

impl Gated {
    /// Holds the next call of kind `at`.
    pub fn arm(&self, at: &str) -> Gate {
        self.arm_any(&[at])
    }

    /// Holds the next call of any of the kinds `at` (one call in all).
    pub fn arm_any(&self, at: &[&str]) -> Gate {
        let gate = Gate::default();
        self.gates
            .lock()
            .unwrap()
            .push((at.iter().map(|a| a.to_string()).collect(), gate.clone()));
        gate
    }

    async fn pass(&self, call: String) {
        let gate = {
            let mut gates = self.gates.lock().unwrap();
            gates
                .iter()
                .position(|(at, _)| at.contains(&call))
                .map(|i| gates.remove(i).1)
        };
        self.calls.lock().unwrap().push(call);
        if let Some(gate) = gate {
            gate.reached.notify_one();
            gate.release.notified().await;
        }
    }
}

#[async_trait]
impl Storage for Gated {
    async fn blob_size(&self, digest: &Digest) -> Result<Option<u64>> {
        self.inner.blob_size(digest).await
    }
    async fn blob_read(
        &self,
        digest: &Digest,
        range: Option<Range<u64>>,
    ) -> Result<Option<BlobRead>> {
        self.inner.blob_read(digest, range).await
    }
    async fn blob_delete(&self, digest: &Digest) -> Result<bool> {
        self.pass("blob_delete".into()).await;
        self.inner.blob_delete(digest).await
    }
    async fn blob_list(&self) -> Result<Vec<BlobInfo>> {
        self.pass("blob_list".into()).await;
        self.inner.blob_list().await
    }
    async fn blob_put(&self, digest: &Digest, body: ByteStream, limit: u64) -> Result<u64> {
        self.inner.blob_put(digest, body, limit).await
    }
    async fn upload_start(&self, repo: &RepositoryName) -> Result<String> {
        self.inner.upload_start(repo).await
    }
    async fn upload_repo(&self, id: &str) -> Result<Option<String>> {
        self.inner.upload_repo(id).await
    }
    async fn upload_size(&self, id: &str) -> Result<Option<u64>> {
        self.inner.upload_size(id).await
    }
    async fn upload_append(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        limit: u64,
    ) -> Result<u64> {
        self.inner.upload_append(id, offset, body, limit).await
    }
    async fn upload_finish(&self, id: &str, digest: &Digest) -> Result<u64> {
        self.inner.upload_finish(id, digest).await
    }
    async fn upload_cancel(&self, id: &str) -> Result<bool> {
        self.inner.upload_cancel(id).await
    }
    async fn upload_list_stale(&self, older_than: Duration) -> Result<Vec<String>> {
        self.inner.upload_list_stale(older_than).await
    }
    async fn link_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<()> {
        self.pass("link_blob".into()).await;
        self.inner.link_blob(repo, digest).await
    }
    async fn blob_linked(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        self.inner.blob_linked(repo, digest).await
    }
    async fn unlink_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        self.pass("unlink_blob".into()).await;
        self.inner.unlink_blob(repo, digest).await
    }
    async fn repo_blobs(&self, repo: &RepositoryName) -> Result<Vec<String>> {
        self.inner.repo_blobs(repo).await
    }
    async fn repo_blob_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        self.inner.repo_blob_links(repo).await
    }
    async fn manifest_put(&self, repo: &RepositoryName, manifest: &StoredManifest) -> Result<()> {
        self.pass("manifest_put".into()).await;
        self.inner.manifest_put(repo, manifest).await
    }
    async fn manifest_get(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<StoredManifest>> {
        self.inner.manifest_get(repo, digest).await
    }
    async fn manifest_delete(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        self.pass("manifest_delete".into()).await;
        self.inner.manifest_delete(repo, digest).await
    }
    async fn manifest_list(&self, repo: &RepositoryName) -> Result<Vec<String>> {
        self.inner.manifest_list(repo).await
    }
    async fn manifest_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        self.inner.manifest_links(repo).await
    }
    async fn tag_set(&self, repo: &RepositoryName, tag: &Tag, digest: &Digest) -> Result<()> {
        self.pass("tag_set".into()).await;
        self.inner.tag_set(repo, tag, digest).await
    }
    async fn tag_get(&self, repo: &RepositoryName, tag: &Tag) -> Result<Option<String>> {
        self.inner.tag_get(repo, tag).await
    }
    async fn tag_delete(&self, repo: &RepositoryName, tag: &Tag) -> Result<bool> {
        self.inner.tag_delete(repo, tag).await
    }
    async fn tag_list(&self, repo: &RepositoryName) -> Result<Option<Vec<String>>> {
        self.inner.tag_list(repo).await
    }
    async fn repo_list(&self) -> Result<Vec<String>> {
        self.pass("repo_list".into()).await;
        self.inner.repo_list().await
    }
    async fn referrer_add(
        &self,
        repo: &RepositoryName,
        subject: &Digest,
        referrer: &Digest,
    ) -> Result<()> {
        self.inner.referrer_add(repo, subject, referrer).await
    }
    async fn referrer_list(&self, repo: &RepositoryName, subject: &Digest) -> Result<Vec<String>> {
        self.inner.referrer_list(repo, subject).await
    }
    async fn gc_record_put(&self, dir: &str, name: &str) -> Result<()> {
        self.pass(format!("gc_record_put {dir}")).await;
        self.inner.gc_record_put(dir, name).await
    }
    async fn gc_record_exists(&self, dir: &str, name: &str) -> Result<bool> {
        self.inner.gc_record_exists(dir, name).await
    }
    async fn gc_record_list(&self, dir: &str) -> Result<Vec<(String, SystemTime)>> {
        self.pass(format!("gc_record_list {dir}")).await;
        self.inner.gc_record_list(dir).await
    }
    async fn gc_record_delete(&self, dir: &str, name: &str) -> Result<bool> {
        self.pass(format!("gc_record_delete {dir}")).await;
        self.inner.gc_record_delete(dir, name).await
    }
}
