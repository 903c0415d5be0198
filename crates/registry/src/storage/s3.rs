//! [`Storage`] on any S3-compatible object store, so several stateless registry replicas
//! can serve one registry.
//!
//! Keys (under an optional prefix) mirror the filesystem layout of [`super::fs`]:
//! `blobs/<alg>/<ab>/<hex>`, `repositories/<name>/_layers/<alg>/<hex>` (empty),
//! `repositories/<name>/_manifests/revisions/<alg>/<hex>` (holds the media type),
//! `repositories/<name>/_manifests/tags/<tag>` (holds the digest),
//! `repositories/<name>/_referrers/<alg>/<subject>/<alg>/<referrer>` (empty), where
//! `<alg>` is the digest's algorithm (`sha256` or `sha512`), and
//! `uploads/<id>/started` plus one object per chunk, `uploads/<id>/part-<offset>`, and
//! garbage collection's coordination records, `gc/{running,deleting,pins}/<name>` (empty).
//!
//! Why uploads look like that: a replica keeps no session state, so each PATCH chunk
//! becomes its own object named by its offset, and the session's size is where the
//! contiguous run of parts ends. Finishing streams the parts in order through SHA-256 into
//! the final key — one put for small blobs, a multipart upload otherwise — and completes
//! that write only once the digest matched (a mismatch aborts it), so the blob key is
//! written once, whole and verified, and no partial blob is ever visible. Every other
//! change (links, tags) is a single-object put, which S3 makes atomic.
//!
//! Differences from the filesystem that follow from S3 having no directories or
//! in-place updates: a repository whose every link was removed no longer exists
//! (`tag_list` says `None`); pushing an existing blob writes it again (that refreshes its
//! time, which garbage collection's grace period relies on), and linking does not touch
//! the blob.
//!
//! A session is assumed to be driven by one client at a time: two chunks racing for the
//! same offset both "succeed" and the later write wins (a client doing that gets a digest
//! mismatch at the end, never a wrong blob).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_oci::digest::ContentHasher;
use ferry_oci::{Digest, RepositoryName, Tag};
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::signer::Signer;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore, PutPayload, WriteMultipart};
use serde::{Deserialize, Serialize};

use super::{
    BlobInfo, BlobRead, ByteStream, LinkInfo, Result, STORED_ALGORITHMS, Storage, StorageError,
    StoredManifest, check_gc_record, check_repo, check_tag, digest_like, digest_parts,
    digest_string, hasher_for, listed_digest, new_upload_id, valid_upload_id,
};

/// Blobs up to this size are buffered and written with one put; larger ones go through a
/// multipart upload with parts of this size.
const PART_SIZE: usize = 8 << 20;
/// Multipart parts in flight at once per upload.
const PARTS_IN_FLIGHT: usize = 4;
/// Largest manifest read back into memory.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Largest media type or tag object read back.
const MAX_SMALL_OBJECT: u64 = 4096;
/// Width of the zero-padded offset in part names, so names sort by offset.
const OFFSET_WIDTH: usize = 20;

/// S3 backend settings (TOML: `[storage] type = "s3"` plus these keys). `Debug` hides
/// the secret key and session token; [`S3Config::redacted`] for printing.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct S3Config {
    pub bucket: String,
    /// Region; default `us-east-1` (or `AWS_REGION`/`AWS_DEFAULT_REGION`).
    pub region: Option<String>,
    /// Endpoint of a non-AWS server (MinIO, Ceph, …); path-style requests are used then.
    pub endpoint: Option<String>,
    /// Credentials; when absent, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/
    /// `AWS_SESSION_TOKEN` from the environment, else instance credentials.
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// Key prefix, so several registries can share a bucket.
    pub prefix: String,
    /// Allow a plain-HTTP endpoint.
    pub allow_http: bool,
    /// Answer blob GETs with a redirect to a presigned URL instead of proxying the bytes.
    pub redirect: bool,
    /// Lifetime of presigned URLs.
    pub redirect_expiry_secs: u64,
}

impl S3Config {
    /// This config with the secret key and session token replaced by [`crate::REDACTED`].
    pub fn redacted(&self) -> S3Config {
        let mut out = self.clone();
        for secret in [&mut out.secret_access_key, &mut out.session_token] {
            if secret.is_some() {
                *secret = Some(crate::REDACTED.to_string());
            }
        }
        out
    }
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("S3Config")
            .field("bucket", &r.bucket)
            .field("region", &r.region)
            .field("endpoint", &r.endpoint)
            .field("access_key_id", &r.access_key_id)
            .field("secret_access_key", &r.secret_access_key)
            .field("session_token", &r.session_token)
            .field("prefix", &r.prefix)
            .field("allow_http", &r.allow_http)
            .field("redirect", &r.redirect)
            .field("redirect_expiry_secs", &r.redirect_expiry_secs)
            .finish()
    }
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            bucket: String::new(),
            region: None,
            endpoint: None,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            prefix: String::new(),
            allow_http: false,
            redirect: false,
            redirect_expiry_secs: 900,
        }
    }
}

/// A [`Storage`] in an S3 bucket (see the module documentation for the key layout).
#[derive(Debug)]
pub struct S3Storage {
    store: Arc<AmazonS3>,
    /// `prefix/` or empty.
    prefix: String,
    redirect: Option<Duration>,
}

fn store_error(e: object_store::Error) -> StorageError {
    StorageError::ObjectStore(e.to_string())
}

/// Maps "not found" to `None`.
fn optional<T>(r: object_store::Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(store_error(e)),
    }
}

impl S3Storage {
    /// Builds the client (no request is made; a wrong bucket shows on first use).
    pub fn open(config: &S3Config) -> Result<S3Storage> {
        if config.bucket.is_empty() {
            return Err(StorageError::Invalid("s3 storage needs a bucket".into()));
        }
        let prefix = config.prefix.trim_matches('/');
        if !prefix.is_empty()
            && !prefix.split('/').all(|c| {
                !c.is_empty()
                    && c != "."
                    && c != ".."
                    && c.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            })
        {
            return Err(StorageError::Invalid(format!(
                "s3 prefix {:?}",
                config.prefix
            )));
        }
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(&config.bucket)
            .with_allow_http(config.allow_http);
        if let Some(region) = &config.region {
            builder = builder.with_region(region);
        }
        if let Some(endpoint) = &config.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_virtual_hosted_style_request(false);
        }
        if let Some(key) = &config.access_key_id {
            builder = builder.with_access_key_id(key);
        }
        if let Some(secret) = &config.secret_access_key {
            builder = builder.with_secret_access_key(secret);
        }
        if let Some(token) = &config.session_token {
            builder = builder.with_token(token);
        }
        let store = builder.build().map_err(store_error)?;
        Ok(S3Storage {
            store: Arc::new(store),
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
            redirect: config
                .redirect
                .then(|| Duration::from_secs(config.redirect_expiry_secs.max(1))),
        })
    }

    fn key(&self, rel: &str) -> Path {
        Path::from(format!("{}{rel}", self.prefix))
    }

    /// The key-relative name of `path` (without the prefix).
    fn rel<'p>(&self, path: &'p Path) -> &'p str {
        let s = path.as_ref();
        s.strip_prefix(self.prefix.as_str()).unwrap_or(s)
    }

    fn blob_key(&self, digest: &str) -> Result<Path> {
        let (alg, hex) = digest_parts(digest)?;
        Ok(self.key(&format!("blobs/{alg}/{}/{hex}", &hex[..2])))
    }

    fn repo_rel(&self, repo: &RepositoryName) -> Result<String> {
        Ok(format!("repositories/{repo}"))
    }

    /// Holds one `<alg>/` prefix of blob links per algorithm.
    fn layers_rel(&self, repo: &RepositoryName) -> Result<String> {
        Ok(format!("{}/_layers", self.repo_rel(repo)?))
    }

    fn layer_key(&self, repo: &RepositoryName, digest: &str) -> Result<Path> {
        let (alg, hex) = digest_parts(digest)?;
        Ok(self.key(&format!("{}/{alg}/{hex}", self.layers_rel(repo)?)))
    }

    /// Holds one `<alg>/` prefix of manifest links per algorithm.
    fn revisions_rel(&self, repo: &RepositoryName) -> Result<String> {
        Ok(format!("{}/_manifests/revisions", self.repo_rel(repo)?))
    }

    fn manifest_key(&self, repo: &RepositoryName, digest: &str) -> Result<Path> {
        let (alg, hex) = digest_parts(digest)?;
        Ok(self.key(&format!("{}/{alg}/{hex}", self.revisions_rel(repo)?)))
    }

    fn tags_rel(&self, repo: &RepositoryName) -> Result<String> {
        Ok(format!("{}/_manifests/tags", self.repo_rel(repo)?))
    }

    fn tag_key(&self, repo: &RepositoryName, tag: &Tag) -> Result<Path> {
        Ok(self.key(&format!("{}/{tag}", self.tags_rel(repo)?)))
    }

    /// Holds one `<alg>/` prefix of referrer links per algorithm.
    fn referrers_rel(&self, repo: &RepositoryName, subject: &str) -> Result<String> {
        let (alg, hex) = digest_parts(subject)?;
        Ok(format!("{}/_referrers/{alg}/{hex}", self.repo_rel(repo)?))
    }

    fn gc_record_key(&self, dir: &str, name: &str) -> Result<Path> {
        check_gc_record(dir, Some(name))?;
        Ok(self.key(&format!("gc/{dir}/{name}")))
    }

    fn upload_rel(&self, id: &str) -> Option<String> {
        valid_upload_id(id).then(|| format!("uploads/{id}"))
    }

    async fn exists(&self, key: &Path) -> Result<bool> {
        Ok(optional(self.store.head(key).await)?.is_some())
    }

    /// Deletes `key`; whether it existed.
    async fn delete_existing(&self, key: &Path) -> Result<bool> {
        if !self.exists(key).await? {
            return Ok(false);
        }
        self.store.delete(key).await.map_err(store_error)?;
        Ok(true)
    }

    async fn list(&self, rel: &str) -> Result<Vec<ObjectMeta>> {
        self.store
            .list(Some(&self.key(rel)))
            .try_collect()
            .await
            .map_err(store_error)
    }

    /// Objects under `rel/<alg>/` (for each stored algorithm) whose last segment is a hex
    /// of that algorithm, as digests.
    async fn list_digests(&self, rel: &str) -> Result<Vec<LinkInfo>> {
        let mut out: Vec<LinkInfo> = Vec::new();
        for alg in STORED_ALGORITHMS {
            out.extend(
                self.list(&format!("{rel}/{alg}"))
                    .await?
                    .into_iter()
                    .filter_map(|meta| {
                        let digest = listed_digest(alg, meta.location.filename()?)?;
                        Some(LinkInfo {
                            digest,
                            modified: Some(SystemTime::from(meta.last_modified)),
                        })
                    }),
            );
        }
        out.sort_unstable_by(|a, b| a.digest.cmp(&b.digest));
        Ok(out)
    }

    async fn get_small(&self, key: &Path, max: u64) -> Result<Option<Bytes>> {
        let Some(got) = optional(self.store.get(key).await)? else {
            return Ok(None);
        };
        if got.meta.size > max {
            return Err(StorageError::TooLarge { limit: max });
        }
        optional(got.bytes().await)
    }

    /// The parts of upload `id` in offset order and where their contiguous run ends, or
    /// `None` if the session does not exist.
    async fn upload_parts(&self, id: &str) -> Result<Option<(Vec<ObjectMeta>, u64)>> {
        let Some(rel) = self.upload_rel(id) else {
            return Ok(None);
        };
        let objects = self.list(&rel).await?;
        let mut started = false;
        let mut parts: Vec<(u64, ObjectMeta)> = Vec::new();
        for meta in objects {
            match meta.location.filename() {
                Some("started") => started = true,
                Some(name) => {
                    if let Some(offset) = name
                        .strip_prefix("part-")
                        .and_then(|o| o.parse::<u64>().ok())
                    {
                        parts.push((offset, meta));
                    }
                }
                None => {}
            }
        }
        if !started {
            return Ok(None);
        }
        parts.sort_by_key(|(offset, _)| *offset);
        let mut end = 0u64;
        let mut run = Vec::with_capacity(parts.len());
        for (offset, meta) in parts {
            if offset != end {
                break; // a gap (a chunk that failed to land) ends the session's content
            }
            end = offset.saturating_add(meta.size);
            run.push(meta);
        }
        Ok(Some((run, end)))
    }

    async fn delete_prefix(&self, rel: &str) -> Result<usize> {
        let objects = self.list(rel).await?;
        let count = objects.len();
        for meta in objects {
            match self.store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store_error(e)),
            }
        }
        Ok(count)
    }

    /// A write of `key` that commits only content hashing to `digest` (in its algorithm).
    fn verified_put(&self, key: Path, digest: &str) -> Result<VerifiedPut> {
        Ok(VerifiedPut {
            store: self.store.clone(),
            key,
            hasher: hasher_for(digest)?,
            size: 0,
            buffer: BytesMut::new(),
            multipart: None,
        })
    }
}

/// Writes a blob's final key only once its content has hashed to the expected digest.
struct VerifiedPut {
    store: Arc<AmazonS3>,
    key: Path,
    hasher: ContentHasher,
    size: u64,
    buffer: BytesMut,
    multipart: Option<WriteMultipart>,
}

impl VerifiedPut {
    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        self.hasher.update(&chunk);
        self.size += chunk.len() as u64;
        if let Some(multipart) = self.multipart.as_mut() {
            multipart.put(chunk);
            return multipart
                .wait_for_capacity(PARTS_IN_FLIGHT)
                .await
                .map_err(store_error);
        }
        self.buffer.extend_from_slice(&chunk);
        if self.buffer.len() >= PART_SIZE {
            let upload = self
                .store
                .put_multipart(&self.key)
                .await
                .map_err(store_error)?;
            let mut multipart = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            multipart.put(self.buffer.split().freeze());
            self.multipart = Some(multipart);
        }
        Ok(())
    }

    /// Completes the write if the content is `expected`; aborts it otherwise.
    async fn commit(self, expected: &str) -> Result<u64> {
        let actual = digest_string(self.hasher);
        if actual != expected {
            if let Some(multipart) = self.multipart {
                abort_quietly(multipart).await;
            }
            return Err(StorageError::DigestMismatch {
                expected: expected.to_string(),
                actual,
            });
        }
        match self.multipart {
            Some(multipart) => {
                multipart.finish().await.map_err(store_error)?;
            }
            None => {
                let payload = PutPayload::from(self.buffer.freeze());
                self.store
                    .put(&self.key, payload)
                    .await
                    .map_err(store_error)?;
            }
        }
        Ok(self.size)
    }

    async fn abort(self) {
        if let Some(multipart) = self.multipart {
            abort_quietly(multipart).await;
        }
    }
}

async fn abort_quietly(multipart: WriteMultipart) {
    if let Err(e) = multipart.abort().await {
        // Invisible either way; a bucket lifecycle rule reclaims the parts.
        tracing::warn!(error = %e, "could not abort an S3 multipart upload");
    }
}

#[async_trait]
impl Storage for S3Storage {
    async fn blob_size(&self, digest: &Digest) -> Result<Option<u64>> {
        let digest: &str = digest.as_ref();
        let key = self.blob_key(digest)?;
        Ok(optional(self.store.head(&key).await)?.map(|m| m.size))
    }

    async fn blob_read(
        &self,
        digest: &Digest,
        range: Option<Range<u64>>,
    ) -> Result<Option<BlobRead>> {
        let digest: &str = digest.as_ref();
        let key = self.blob_key(digest)?;
        let empty_range = range.as_ref().is_some_and(|r| r.start >= r.end);
        if empty_range {
            // S3 cannot express an empty byte range; answer it from the size.
            return Ok(optional(self.store.head(&key).await)?.map(|meta| BlobRead {
                size: meta.size,
                body: Box::pin(futures_util::stream::empty()),
            }));
        }
        let options = GetOptions {
            range: range.map(GetRange::Bounded),
            ..GetOptions::default()
        };
        let Some(got) = optional(self.store.get_opts(&key, options).await)? else {
            return Ok(None);
        };
        let size = got.meta.size;
        let body = got
            .into_stream()
            .map(|chunk| chunk.map_err(std::io::Error::other));
        Ok(Some(BlobRead {
            size,
            body: Box::pin(body),
        }))
    }

    async fn blob_redirect(&self, digest: &Digest) -> Result<Option<String>> {
        let digest: &str = digest.as_ref();
        let Some(expiry) = self.redirect else {
            return Ok(None);
        };
        let key = self.blob_key(digest)?;
        let url = self
            .store
            .signed_url(http::Method::GET, &key, expiry)
            .await
            .map_err(store_error)?;
        Ok(Some(url.to_string()))
    }

    async fn blob_delete(&self, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let key = self.blob_key(digest)?;
        self.delete_existing(&key).await
    }

    async fn blob_list(&self) -> Result<Vec<BlobInfo>> {
        let mut out: Vec<BlobInfo> = Vec::new();
        for alg in STORED_ALGORITHMS {
            out.extend(
                self.list(&format!("blobs/{alg}"))
                    .await?
                    .into_iter()
                    .filter_map(|meta| {
                        let digest = listed_digest(alg, meta.location.filename()?)?;
                        Some(BlobInfo {
                            digest,
                            size: meta.size,
                            modified: SystemTime::from(meta.last_modified),
                        })
                    }),
            );
        }
        out.sort_unstable_by(|a, b| a.digest.cmp(&b.digest));
        Ok(out)
    }

    async fn blob_put(&self, digest: &Digest, mut body: ByteStream, limit: u64) -> Result<u64> {
        let digest: &str = digest.as_ref();
        let key = self.blob_key(digest)?;
        let mut put = self.verified_put(key, digest)?;
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(chunk) if put.size + chunk.len() as u64 <= limit => chunk,
                Ok(_) => {
                    put.abort().await;
                    return Err(StorageError::TooLarge { limit });
                }
                Err(e) => {
                    put.abort().await;
                    return Err(StorageError::Body(e));
                }
            };
            if let Err(e) = put.write(chunk).await {
                put.abort().await;
                return Err(e);
            }
        }
        put.commit(digest).await
    }

    async fn upload_start(&self, repo: &RepositoryName) -> Result<String> {
        let id = new_upload_id();
        let key = self.key(&format!("uploads/{id}/started"));
        // The `started` marker carries the owning repository, so any replica can check it.
        self.store
            .put(&key, PutPayload::from(repo.as_bytes().to_vec()))
            .await
            .map_err(store_error)?;
        Ok(id)
    }

    async fn upload_repo(&self, id: &str) -> Result<Option<String>> {
        let Some(rel) = self.upload_rel(id) else {
            return Ok(None);
        };
        let key = self.key(&format!("{rel}/started"));
        match self.store.get(&key).await {
            Ok(got) => {
                if got.meta.size > 4096 {
                    return Ok(None);
                }
                let bytes = got.bytes().await.map_err(store_error)?;
                Ok(String::from_utf8(bytes.to_vec()).ok())
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_error(e)),
        }
    }

    async fn upload_size(&self, id: &str) -> Result<Option<u64>> {
        Ok(self.upload_parts(id).await?.map(|(_, end)| end))
    }

    async fn upload_append(
        &self,
        id: &str,
        offset: u64,
        mut body: ByteStream,
        limit: u64,
    ) -> Result<u64> {
        let Some(have) = self.upload_size(id).await? else {
            return Err(StorageError::UploadUnknown(id.to_string()));
        };
        if have != offset {
            return Err(StorageError::OutOfOrder { have, got: offset });
        }
        let key = self.key(&format!("uploads/{id}/part-{offset:0OFFSET_WIDTH$}"));
        let mut writer =
            object_store::buffered::BufWriter::with_capacity(self.store.clone(), key, PART_SIZE);
        let mut written = 0u64;
        while let Some(chunk) = body.next().await {
            let failure = match chunk {
                Ok(chunk) if offset + written + chunk.len() as u64 <= limit => {
                    written += chunk.len() as u64;
                    match writer.put(chunk).await {
                        Ok(()) => None,
                        Err(e) => Some(store_error(e)),
                    }
                }
                Ok(_) => Some(StorageError::TooLarge { limit }),
                Err(e) => Some(StorageError::Body(e)),
            };
            if let Some(e) = failure {
                if let Err(abort) = writer.abort().await {
                    tracing::warn!(error = %abort, "could not abort an S3 chunk upload");
                }
                return Err(e);
            }
        }
        if written > 0 {
            tokio::io::AsyncWriteExt::shutdown(&mut writer)
                .await
                .map_err(|e| StorageError::ObjectStore(e.to_string()))?;
        }
        Ok(offset + written)
    }

    async fn upload_finish(&self, id: &str, digest: &Digest) -> Result<u64> {
        let digest: &str = digest.as_ref();
        let key = self.blob_key(digest)?;
        let unknown = || StorageError::UploadUnknown(id.to_string());
        let rel = self.upload_rel(id).ok_or_else(unknown)?;
        let (parts, _) = self.upload_parts(id).await?.ok_or_else(unknown)?;
        let mut put = self.verified_put(key, digest)?;
        for part in &parts {
            let streamed = async {
                let got = self.store.get(&part.location).await.map_err(store_error)?;
                let mut stream = got.into_stream();
                while let Some(chunk) = stream.next().await {
                    put.write(chunk.map_err(store_error)?).await?;
                }
                Ok::<(), StorageError>(())
            }
            .await;
            if let Err(e) = streamed {
                put.abort().await;
                return Err(e);
            }
        }
        let committed = put.commit(digest).await;
        // Committed or mismatched, the session is over.
        if let Err(e) = self.delete_prefix(&rel).await {
            tracing::warn!(upload = id, error = %e, "could not remove a finished upload's parts");
        }
        committed
    }

    async fn upload_cancel(&self, id: &str) -> Result<bool> {
        let Some(rel) = self.upload_rel(id) else {
            return Ok(false);
        };
        Ok(self.delete_prefix(&rel).await? > 0)
    }

    async fn upload_list_stale(&self, older_than: Duration) -> Result<Vec<String>> {
        let now = SystemTime::now();
        let mut latest: std::collections::BTreeMap<String, SystemTime> = Default::default();
        for meta in self.list("uploads").await? {
            let rel = self.rel(&meta.location);
            let Some(id) = rel
                .strip_prefix("uploads/")
                .and_then(|r| r.split('/').next())
            else {
                continue;
            };
            if !valid_upload_id(id) {
                continue;
            }
            let modified = SystemTime::from(meta.last_modified);
            let entry = latest.entry(id.to_string()).or_insert(modified);
            *entry = (*entry).max(modified);
        }
        Ok(latest
            .into_iter()
            .filter(|(_, t)| now.duration_since(*t).is_ok_and(|age| age >= older_than))
            .map(|(id, _)| id)
            .collect())
    }

    async fn link_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<()> {
        let digest: &str = digest.as_ref();
        let key = self.layer_key(repo, digest)?;
        self.store
            .put(&key, PutPayload::default())
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn blob_linked(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let key = self.layer_key(repo, digest)?;
        self.exists(&key).await
    }

    async fn unlink_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let key = self.layer_key(repo, digest)?;
        self.delete_existing(&key).await
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
        let rel = self.layers_rel(repo)?;
        self.list_digests(&rel).await
    }

    async fn manifest_put(&self, repo: &RepositoryName, manifest: &StoredManifest) -> Result<()> {
        let blob = self.blob_key(&manifest.digest)?;
        let link = self.manifest_key(repo, &manifest.digest)?;
        if manifest.media_type.len() as u64 > MAX_SMALL_OBJECT {
            return Err(StorageError::Invalid(format!(
                "media type of {} bytes",
                manifest.media_type.len()
            )));
        }
        let actual = digest_like(&manifest.digest, &manifest.bytes)?;
        if actual != manifest.digest {
            return Err(StorageError::DigestMismatch {
                expected: manifest.digest.clone(),
                actual,
            });
        }
        self.store
            .put(&blob, PutPayload::from(manifest.bytes.clone()))
            .await
            .map_err(store_error)?;
        let media_type = Bytes::copy_from_slice(manifest.media_type.as_bytes());
        self.store
            .put(&link, PutPayload::from(media_type))
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn manifest_get(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<StoredManifest>> {
        let digest: &str = digest.as_ref();
        let link = self.manifest_key(repo, digest)?;
        let blob = self.blob_key(digest)?;
        let Some(media_type) = self.get_small(&link, MAX_SMALL_OBJECT).await? else {
            return Ok(None);
        };
        let media_type = String::from_utf8(media_type.to_vec())
            .map_err(|_| StorageError::ObjectStore("manifest media type is not UTF-8".into()))?;
        let Some(bytes) = self.get_small(&blob, MAX_MANIFEST_BYTES).await? else {
            return Ok(None);
        };
        Ok(Some(StoredManifest {
            digest: digest.to_string(),
            media_type,
            bytes,
        }))
    }

    async fn manifest_delete(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool> {
        let digest: &str = digest.as_ref();
        let link = self.manifest_key(repo, digest)?;
        if !self.delete_existing(&link).await? {
            return Ok(false);
        }
        for meta in self.list(&self.tags_rel(repo)?).await? {
            let target = self.get_small(&meta.location, MAX_SMALL_OBJECT).await?;
            if target.is_some_and(|t| t == digest.as_bytes()) {
                match self.store.delete(&meta.location).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(store_error(e)),
                }
            }
        }
        Ok(true)
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
        let rel = self.revisions_rel(repo)?;
        self.list_digests(&rel).await
    }

    async fn tag_set(&self, repo: &RepositoryName, tag: &Tag, digest: &Digest) -> Result<()> {
        let digest: &str = digest.as_ref();
        digest_parts(digest)?;
        let key = self.tag_key(repo, tag)?;
        let payload = PutPayload::from(Bytes::copy_from_slice(digest.as_bytes()));
        self.store.put(&key, payload).await.map_err(store_error)?;
        Ok(())
    }

    async fn tag_get(&self, repo: &RepositoryName, tag: &Tag) -> Result<Option<String>> {
        let key = self.tag_key(repo, tag)?;
        let Some(bytes) = self.get_small(&key, MAX_SMALL_OBJECT).await? else {
            return Ok(None);
        };
        match String::from_utf8(bytes.to_vec()) {
            Ok(d) if digest_parts(&d).is_ok() => Ok(Some(d)),
            _ => Err(StorageError::ObjectStore(format!(
                "tag {tag} of {repo} does not hold a digest"
            ))),
        }
    }

    async fn tag_delete(&self, repo: &RepositoryName, tag: &Tag) -> Result<bool> {
        let key = self.tag_key(repo, tag)?;
        self.delete_existing(&key).await
    }

    async fn tag_list(&self, repo: &RepositoryName) -> Result<Option<Vec<String>>> {
        let rel = self.tags_rel(repo)?;
        let mut tags: Vec<String> = self
            .list(&rel)
            .await?
            .into_iter()
            .filter_map(|meta| {
                let name = meta.location.filename()?;
                check_tag(name).ok()?;
                Some(name.to_string())
            })
            .collect();
        if tags.is_empty() {
            // Tell an empty repository from an unknown one.
            let listed = self
                .store
                .list_with_delimiter(Some(&self.key(&self.repo_rel(repo)?)))
                .await
                .map_err(store_error)?;
            let exists = listed
                .common_prefixes
                .iter()
                .any(|p| p.filename().is_some_and(|n| n.starts_with('_')));
            return Ok(exists.then(Vec::new));
        }
        tags.sort_unstable();
        Ok(Some(tags))
    }

    async fn repo_list(&self) -> Result<Vec<String>> {
        // Walk "directories" level by level; a level holding `_…` is a repository.
        let mut out = Vec::new();
        let mut pending = vec![String::new()];
        while let Some(name) = pending.pop() {
            let rel = if name.is_empty() {
                "repositories".to_string()
            } else {
                format!("repositories/{name}")
            };
            let listed = self
                .store
                .list_with_delimiter(Some(&self.key(&rel)))
                .await
                .map_err(store_error)?;
            let mut is_repo = false;
            for prefix in &listed.common_prefixes {
                let Some(child) = prefix.filename() else {
                    continue;
                };
                if child.starts_with('_') {
                    is_repo = true;
                    continue;
                }
                let child_name = if name.is_empty() {
                    child.to_string()
                } else {
                    format!("{name}/{child}")
                };
                if check_repo(&child_name).is_ok() {
                    pending.push(child_name);
                }
            }
            if is_repo && !name.is_empty() {
                out.push(name);
            }
        }
        out.sort_unstable();
        Ok(out)
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
        let key = self.key(&format!(
            "{}/{alg}/{hex}",
            self.referrers_rel(repo, subject)?
        ));
        self.store
            .put(&key, PutPayload::default())
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn referrer_list(&self, repo: &RepositoryName, subject: &Digest) -> Result<Vec<String>> {
        let subject: &str = subject.as_ref();
        let rel = self.referrers_rel(repo, subject)?;
        let mut out = Vec::new();
        for link in self.list_digests(&rel).await? {
            if self.exists(&self.manifest_key(repo, &link.digest)?).await? {
                out.push(link.digest);
            }
        }
        Ok(out)
    }

    async fn gc_record_put(&self, dir: &str, name: &str) -> Result<()> {
        let key = self.gc_record_key(dir, name)?;
        self.store
            .put(&key, PutPayload::default())
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn gc_record_exists(&self, dir: &str, name: &str) -> Result<bool> {
        let key = self.gc_record_key(dir, name)?;
        self.exists(&key).await
    }

    async fn gc_record_list(&self, dir: &str) -> Result<Vec<(String, SystemTime)>> {
        check_gc_record(dir, None)?;
        let mut out: Vec<(String, SystemTime)> = self
            .list(&format!("gc/{dir}"))
            .await?
            .into_iter()
            .filter_map(|meta| {
                let name = meta.location.filename()?.to_string();
                check_gc_record(dir, Some(&name)).ok()?;
                Some((name, SystemTime::from(meta.last_modified)))
            })
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    async fn gc_record_delete(&self, dir: &str, name: &str) -> Result<bool> {
        let key = self.gc_record_key(dir, name)?;
        self.delete_existing(&key).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_from_toml_with_defaults() {
        let cfg: super::super::StorageConfig = toml::from_str(
            r#"
            type = "s3"
            bucket = "reg"
            endpoint = "http://127.0.0.1:9000"
            allow_http = true
            redirect = true
            "#,
        )
        .unwrap();
        let super::super::StorageConfig::S3(s3) = cfg else {
            panic!("not s3: {cfg:?}")
        };
        assert_eq!(s3.bucket, "reg");
        assert_eq!(s3.redirect_expiry_secs, 900);
        assert!(s3.redirect && s3.allow_http);
        assert!(
            toml::from_str::<super::super::StorageConfig>(
                "type = \"s3\"\nbucket = \"b\"\nbogus = 1"
            )
            .is_err()
        );
    }

    #[test]
    fn open_refuses_bad_settings() {
        assert!(S3Storage::open(&S3Config::default()).is_err(), "no bucket");
        let cfg = S3Config {
            bucket: "b".into(),
            prefix: "../x".into(),
            ..S3Config::default()
        };
        assert!(S3Storage::open(&cfg).is_err());
    }

    #[test]
    fn keys_follow_the_layout() {
        let s = S3Storage::open(&S3Config {
            bucket: "b".into(),
            prefix: "/reg/one/".into(),
            region: Some("us-east-1".into()),
            endpoint: Some("http://127.0.0.1:1".into()),
            allow_http: true,
            access_key_id: Some("k".into()),
            secret_access_key: Some("s".into()),
            ..S3Config::default()
        })
        .unwrap();
        let hex = "ab".repeat(32);
        let d = format!("sha256:{hex}");
        assert_eq!(
            s.blob_key(&d).unwrap().as_ref(),
            format!("reg/one/blobs/sha256/ab/{hex}")
        );
        // Names and tags are typed (parsed where they arrived), so each is one safe key
        // segment; the digest's hex is still checked here.
        let repo = RepositoryName::parse("lib/x").unwrap();
        assert_eq!(
            s.manifest_key(&repo, &d).unwrap().as_ref(),
            format!("reg/one/repositories/lib/x/_manifests/revisions/sha256/{hex}")
        );
        assert_eq!(
            s.tag_key(&repo, &Tag::parse("v1").unwrap())
                .unwrap()
                .as_ref(),
            "reg/one/repositories/lib/x/_manifests/tags/v1"
        );
        assert!(s.layer_key(&repo, "sha256:../x").is_err());
        assert_eq!(s.rel(&s.key("uploads/x")), "uploads/x");
    }
}
