//! Registry storage: where blobs, manifests, tags, upload sessions and repository links
//! live.
//!
//! The [`Storage`] trait is the contract between the HTTP layer ([`crate::server`]) and
//! the backends: [`fs::FsStorage`] (the default, crash-safe local filesystem),
//! [`s3::S3Storage`] (any S3-compatible object store, so stateless replicas can serve one
//! registry) and [`memory::MemoryStorage`] (tests). The HTTP layer validates names,
//! digests and ranges before calling in; backends still refuse anything that could escape
//! their root.
//!
//! Invariants every backend keeps:
//! - A blob is visible only once its full content is in place and its digest verified;
//!   an interrupted upload or a crash never exposes a partial or wrong blob.
//! - Blobs are stored once, content-addressed; repositories hold *links* to them. A blob
//!   is served through a repository only if that repository links it (push, mount, or
//!   manifest reference), so knowing a digest is not enough to read it.
//! - Manifests are stored as blobs too, with their media type kept beside them, and are
//!   linked into their repository as manifests.
//! - Listing is sorted lexically (tags, repositories), so pagination is stable.

pub mod fs;
pub mod gc;
pub mod memory;
pub mod s3;

use std::fmt::Debug;
use std::ops::Range;
use std::pin::Pin;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::Stream;
use serde::{Deserialize, Serialize};

/// A stream of body bytes, as received from a client or sent to one.
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, std::io::Error>> + Send>>;

/// Errors a backend reports. The server maps them to distribution error codes.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("upload session {0} not found")]
    UploadUnknown(String),
    /// A chunk did not start where the upload currently ends.
    #[error("chunk starts at {got} but upload has {have} bytes")]
    OutOfOrder { have: u64, got: u64 },
    /// The uploaded content does not hash to the digest the client named.
    #[error("digest mismatch: client said {expected}, content is {actual}")]
    DigestMismatch { expected: String, actual: String },
    /// The upload (or manifest) exceeds the configured limit.
    #[error("content exceeds the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    /// The request body ended early or failed while streaming.
    #[error("client body failed: {0}")]
    Body(std::io::Error),
    /// A name or digest the backend refuses (should have been caught earlier).
    #[error("invalid name: {0}")]
    Invalid(String),
    #[error("storage I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("object store: {0}")]
    ObjectStore(String),
}

pub type Result<T, E = StorageError> = std::result::Result<T, E>;

/// A blob being read: its total size and the bytes of the requested range.
pub struct BlobRead {
    /// Size of the whole blob.
    pub size: u64,
    /// The bytes of the requested range (or the whole blob).
    pub body: ByteStream,
}

impl Debug for BlobRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobRead").field("size", &self.size).finish()
    }
}

/// A stored manifest (image manifest, image index, or artifact manifest).
#[derive(Debug, Clone)]
pub struct StoredManifest {
    /// `sha256:<hex>` of `bytes`.
    pub digest: String,
    /// Media type recorded at push time (the document's `mediaType`, else Content-Type).
    pub media_type: String,
    pub bytes: Bytes,
}

/// Where a storage backend lives; a section of the server's TOML config.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum StorageConfig {
    /// Local filesystem under `root` (default `./ferry-data`).
    Filesystem { root: std::path::PathBuf },
    /// S3-compatible object store.
    S3(s3::S3Config),
    /// In process memory; lost on exit (tests, benchmarks).
    Memory,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig::Filesystem {
            root: std::path::PathBuf::from("./ferry-data"),
        }
    }
}

/// The storage contract. All names passed in are already validated by the server
/// (`repo` matches the distribution name grammar, digests are `sha256:<64 hex>`, tags match
/// the tag grammar, upload ids are ones the backend issued or garbage it must reject).
#[async_trait]
pub trait Storage: Send + Sync + Debug + 'static {
    // ---- blobs (global, content-addressed) ----

    /// Size of a committed blob, or `None` if absent.
    async fn blob_size(&self, digest: &str) -> Result<Option<u64>>;

    /// Read a committed blob, or the byte `range` of it (already checked against its size
    /// by the caller). `None` if absent.
    async fn blob_read(&self, digest: &str, range: Option<Range<u64>>) -> Result<Option<BlobRead>>;

    /// A presigned URL clients can GET the blob from directly, when the backend is
    /// configured to redirect (S3); `None` means serve the bytes.
    async fn blob_redirect(&self, _digest: &str) -> Result<Option<String>> {
        Ok(None)
    }

    /// Delete a blob's content. Returns whether it existed. Only garbage collection calls
    /// this; the API deletes links.
    async fn blob_delete(&self, digest: &str) -> Result<bool>;

    /// Every committed blob digest (for garbage collection).
    async fn blob_list(&self) -> Result<Vec<String>>;

    /// Store a whole blob from a stream, verifying it hashes to `digest`; at most `limit`
    /// bytes. Returns its size. Idempotent if the blob already exists.
    async fn blob_put(&self, digest: &str, body: ByteStream, limit: u64) -> Result<u64>;

    // ---- upload sessions ----

    /// Start an upload session; returns its opaque id (URL-safe).
    async fn upload_start(&self) -> Result<String>;

    /// Bytes received so far, or `None` for an unknown session.
    async fn upload_size(&self, id: &str) -> Result<Option<u64>>;

    /// Append `body` at `offset`, which must equal the current size (else
    /// [`StorageError::OutOfOrder`]); the session may hold at most `limit` bytes in total.
    /// Returns the new size.
    async fn upload_append(&self, id: &str, offset: u64, body: ByteStream, limit: u64)
    -> Result<u64>;

    /// Finish: verify the content hashes to `digest`, make it a committed blob atomically,
    /// and drop the session. On mismatch the session is dropped and nothing is committed.
    /// Returns the blob size.
    async fn upload_finish(&self, id: &str, digest: &str) -> Result<u64>;

    /// Cancel a session; returns whether it existed.
    async fn upload_cancel(&self, id: &str) -> Result<bool>;

    /// Upload sessions not touched for `older_than` (abandoned; GC removes them).
    async fn upload_list_stale(&self, older_than: std::time::Duration) -> Result<Vec<String>>;

    // ---- repository links ----

    /// Record that `repo` holds blob `digest` (push, mount, or manifest reference).
    async fn link_blob(&self, repo: &str, digest: &str) -> Result<()>;

    /// Whether `repo` links blob `digest`.
    async fn blob_linked(&self, repo: &str, digest: &str) -> Result<bool>;

    /// Remove `repo`'s link to blob `digest`; returns whether it existed.
    async fn unlink_blob(&self, repo: &str, digest: &str) -> Result<bool>;

    /// Every blob digest `repo` links (for garbage collection).
    async fn repo_blobs(&self, repo: &str) -> Result<Vec<String>>;

    // ---- manifests and tags ----

    /// Store manifest bytes (as a blob) and link it into `repo` as a manifest.
    async fn manifest_put(&self, repo: &str, manifest: &StoredManifest) -> Result<()>;

    /// A manifest of `repo` by digest, or `None`.
    async fn manifest_get(&self, repo: &str, digest: &str) -> Result<Option<StoredManifest>>;

    /// Unlink a manifest from `repo` (and any tags pointing at it). Returns whether it
    /// existed.
    async fn manifest_delete(&self, repo: &str, digest: &str) -> Result<bool>;

    /// Every manifest digest linked into `repo`.
    async fn manifest_list(&self, repo: &str) -> Result<Vec<String>>;

    /// Point `tag` of `repo` at manifest `digest` (atomic replace).
    async fn tag_set(&self, repo: &str, tag: &str, digest: &str) -> Result<()>;

    /// The manifest digest `tag` points at.
    async fn tag_get(&self, repo: &str, tag: &str) -> Result<Option<String>>;

    /// Remove a tag; returns whether it existed.
    async fn tag_delete(&self, repo: &str, tag: &str) -> Result<bool>;

    /// Tags of `repo`, sorted lexically; `None` if the repository does not exist.
    async fn tag_list(&self, repo: &str) -> Result<Option<Vec<String>>>;

    /// Every repository, sorted lexically.
    async fn repo_list(&self) -> Result<Vec<String>>;

    // ---- referrers ----

    /// Record that manifest `referrer` in `repo` has `subject` as its subject.
    async fn referrer_add(&self, repo: &str, subject: &str, referrer: &str) -> Result<()>;

    /// Manifests in `repo` whose subject is `subject` (digests; the server reads each to
    /// build descriptors). Referrers whose manifest was deleted are skipped.
    async fn referrer_list(&self, repo: &str, subject: &str) -> Result<Vec<String>>;
}
