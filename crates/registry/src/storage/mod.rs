//! Registry storage: where blobs, manifests, tags, upload sessions and repository links
//! live.
//!
//! The [`Storage`] trait is the contract between the HTTP layer ([`crate::server`]) and
//! the backends: [`fs::FsStorage`] (the default, crash-safe local filesystem),
//! [`s3::S3Storage`] (any S3-compatible object store, so stateless replicas can serve one
//! registry) and [`memory::MemoryStorage`] (tests). Repository names, tags and digests
//! come in typed ([`RepositoryName`], [`Tag`], [`Digest`]: parsed once, by the HTTP layer
//! or where garbage collection reads a listing), ranges checked by the HTTP layer;
//! backends still refuse digests of algorithms they do not store under (anything but
//! sha256 and sha512) and upload ids they did not issue,
//! and skip listed entries that are not valid names.
//!
//! Invariants every backend keeps:
//! - A blob is visible only once its full content is in place and its digest verified;
//!   an interrupted upload or a crash never exposes a partial or wrong blob.
//! - Blobs are stored once, content-addressed; repositories hold *links* to them. A blob
//!   is served through a repository only if that repository links it (push, mount, or
//!   manifest reference), so knowing a digest is not enough to read it. A push is
//!   verified against the bytes received even when the blob is already stored, so naming
//!   a digest is not enough to link it either.
//! - Manifests are stored as blobs too, with their media type kept beside them, and are
//!   linked into their repository as manifests.
//! - Listing is sorted lexically (tags, repositories), so pagination is stable.

pub mod fs;
pub mod gc;
pub mod memory;
pub mod s3;

#[cfg(test)]
pub(crate) mod conformance;
#[cfg(test)]
pub(crate) mod gated;

use std::fmt::Debug;
use std::ops::Range;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_oci::{Digest, RepositoryName, Tag};
use serde::{Deserialize, Serialize};

/// A stream of body bytes, as received from a client or sent to one (the client crate's
/// type, so blobs stream from an upstream into storage and out to a client unchanged).
pub use ferry_registry_client::ByteStream;

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
        f.debug_struct("BlobRead")
            .field("size", &self.size)
            .finish()
    }
}

/// A stored manifest (image manifest, image index, or artifact manifest).
#[derive(Debug, Clone)]
pub struct StoredManifest {
    /// `<algorithm>:<hex>` of `bytes` (sha256, or sha512 when pushed under a sha512 digest).
    pub digest: String,
    /// Media type recorded at push time (the document's `mediaType`, else Content-Type).
    pub media_type: String,
    pub bytes: Bytes,
}

/// A committed blob as garbage collection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobInfo {
    /// `<algorithm>:<hex>` (sha256 or sha512).
    pub digest: String,
    pub size: u64,
    /// When the blob was last written (committed, or re-committed by a later push).
    pub modified: SystemTime,
}

/// A repository's link to a blob or manifest, as garbage collection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// `<algorithm>:<hex>` of the linked blob or manifest.
    pub digest: String,
    /// When the link was last written; `None` if the backend cannot tell.
    pub modified: Option<SystemTime>,
}

impl LinkInfo {
    fn undated(digest: String) -> LinkInfo {
        LinkInfo {
            digest,
            modified: None,
        }
    }
}

/// Opens the backend `config` describes.
pub async fn open(config: &StorageConfig) -> Result<Arc<dyn Storage>> {
    Ok(match config {
        StorageConfig::Filesystem { root } => {
            let root = root.clone();
            let fs = tokio::task::spawn_blocking(move || fs::FsStorage::open(&root))
                .await
                .map_err(|e| StorageError::Io(std::io::Error::other(e)))??;
            Arc::new(fs)
        }
        StorageConfig::S3(s3) => Arc::new(s3::S3Storage::open(s3)?),
        StorageConfig::Memory => Arc::new(memory::MemoryStorage::default()),
    })
}

/// The algorithms content is stored under, as they name directories and key segments
/// (`blobs/<algorithm>/…`): sha256, and sha512 (the OCI image spec's other registered one).
pub(crate) const STORED_ALGORITHMS: [&str; 2] = ["sha256", "sha512"];

/// The algorithm and hex of a digest content is stored under (`sha256:<64 lowercase
/// hex>` or `sha512:<128 lowercase hex>`); anything else is refused: both parts become
/// path components or object key segments, so they must be exactly that.
pub(crate) fn digest_parts(digest: &str) -> Result<(&str, &str)> {
    ferry_oci::digest::parse_stored(digest).map_err(|e| StorageError::Invalid(e.to_string()))?;
    digest
        .split_once(':')
        .ok_or_else(|| StorageError::Invalid(format!("digest {digest:?}")))
}

/// The hex part of a stored digest (see [`digest_parts`]).
pub(crate) fn digest_hex(digest: &str) -> Result<&str> {
    Ok(digest_parts(digest)?.1)
}

/// `<algorithm>:<name>` if that is a stored digest: how backends turn what they list
/// (file names, key segments, which a hand could have put there) back into digests.
pub(crate) fn listed_digest(algorithm: &str, name: &str) -> Option<String> {
    let digest = format!("{algorithm}:{name}");
    digest_parts(&digest).is_ok().then_some(digest)
}

/// A fresh hasher in the algorithm of `digest` (a stored one, else refused).
pub(crate) fn hasher_for(digest: &str) -> Result<ferry_oci::digest::ContentHasher> {
    let typed = ferry_oci::digest::parse_stored(digest)
        .map_err(|e| StorageError::Invalid(e.to_string()))?;
    ferry_oci::digest::ContentHasher::for_digest(&typed)
        .ok_or_else(|| StorageError::Invalid(format!("digest {digest:?}")))
}

/// `<algorithm>:<hex>` of a finished hash.
pub(crate) fn digest_string(hasher: ferry_oci::digest::ContentHasher) -> String {
    hasher.finish().to_string()
}

/// `bytes` hashed with the algorithm of the stored digest `like`, as `<algorithm>:<hex>`.
pub(crate) fn digest_like(like: &str, bytes: &[u8]) -> Result<String> {
    let mut hasher = hasher_for(like)?;
    hasher.update(bytes);
    Ok(digest_string(hasher))
}

/// Length of an upload id: 128 random bits in lowercase hex.
const UPLOAD_ID_LEN: usize = 32;

/// A fresh upload session id (URL-safe, unguessable).
pub(crate) fn new_upload_id() -> String {
    hex::encode(rand::random::<[u8; UPLOAD_ID_LEN / 2]>())
}

/// Whether `id` could be one [`new_upload_id`] issued; anything else is an unknown
/// session (and never reaches a path or key).
pub(crate) fn valid_upload_id(id: &str) -> bool {
    ferry_oci::digest::is_lower_hex(id, UPLOAD_ID_LEN)
}

/// Refuses repository names outside the distribution grammar (ferry-oci's one rule):
/// such a name could escape a backend's root (`..`), collide with its own bookkeeping
/// (`_layers`) or not be a valid key. Callers pass typed names; backends use this on
/// what they list from their own storage, which a hand could have put there.
pub(crate) fn check_repo(repo: &str) -> Result<()> {
    ferry_oci::RepositoryName::parse(repo)
        .map(|_| ())
        .map_err(|e| StorageError::Invalid(e.to_string()))
}

/// Refuses tags outside the distribution grammar (ferry-oci's one rule), so a tag is
/// always a single safe path component.
pub(crate) fn check_tag(tag: &str) -> Result<()> {
    ferry_oci::Tag::parse(tag)
        .map(|_| ())
        .map_err(|e| StorageError::Invalid(e.to_string()))
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

/// The storage contract. Names, tags and digests arrive typed, parsed once where they
/// entered (the HTTP layer, garbage collection's listings, tools), so a backend never
/// sees one outside its grammar; backends still refuse digests of algorithms other than
/// sha256 and sha512 (the ones they store under, each in its own `<algorithm>/` directory
/// or key prefix) and upload ids they did not issue.
#[async_trait]
pub trait Storage: Send + Sync + Debug + 'static {
    // ---- blobs (global, content-addressed) ----

    /// Size of a committed blob, or `None` if absent.
    async fn blob_size(&self, digest: &Digest) -> Result<Option<u64>>;

    /// Read a committed blob, or the byte `range` of it (already checked against its size
    /// by the caller). `None` if absent.
    async fn blob_read(
        &self,
        digest: &Digest,
        range: Option<Range<u64>>,
    ) -> Result<Option<BlobRead>>;

    /// A presigned URL clients can GET the blob from directly, when the backend is
    /// configured to redirect (S3); `None` means serve the bytes.
    async fn blob_redirect(&self, _digest: &Digest) -> Result<Option<String>> {
        Ok(None)
    }

    /// Delete a blob's content. Returns whether it existed. Only garbage collection calls
    /// this; the API deletes links.
    async fn blob_delete(&self, digest: &Digest) -> Result<bool>;

    /// Every committed blob with its size and when it was last written (for garbage
    /// collection, whose grace period protects young blobs).
    async fn blob_list(&self) -> Result<Vec<BlobInfo>>;

    /// Store a whole blob from a stream, verifying it hashes to `digest`; at most `limit`
    /// bytes. Returns its size. Idempotent if the blob already exists, but the body is
    /// read and verified even then: a push proves possession of the bytes, never just of
    /// the digest.
    async fn blob_put(&self, digest: &Digest, body: ByteStream, limit: u64) -> Result<u64>;

    // ---- upload sessions ----

    /// Start an upload session for `repo`; returns its opaque id (URL-safe). The session
    /// belongs to that repository: the server refuses it under any other name, so push
    /// rights on one repository never reach another repository's uploads.
    async fn upload_start(&self, repo: &RepositoryName) -> Result<String>;

    /// The repository an upload session was started for, or `None` for an unknown session.
    async fn upload_repo(&self, id: &str) -> Result<Option<String>>;

    /// Bytes received so far, or `None` for an unknown session.
    async fn upload_size(&self, id: &str) -> Result<Option<u64>>;

    /// Append `body` at `offset`, which must equal the current size (else
    /// [`StorageError::OutOfOrder`]); the session may hold at most `limit` bytes in total.
    /// Returns the new size.
    async fn upload_append(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        limit: u64,
    ) -> Result<u64>;

    /// Finish: verify the content hashes to `digest`, make it a committed blob atomically,
    /// and drop the session. On mismatch the session is dropped and nothing is committed.
    /// Returns the blob size.
    async fn upload_finish(&self, id: &str, digest: &Digest) -> Result<u64>;

    /// Cancel a session; returns whether it existed.
    async fn upload_cancel(&self, id: &str) -> Result<bool>;

    /// Upload sessions not touched for `older_than` (abandoned; GC removes them).
    async fn upload_list_stale(&self, older_than: std::time::Duration) -> Result<Vec<String>>;

    // ---- repository links ----

    /// Record that `repo` holds blob `digest` (push, mount, or manifest reference).
    async fn link_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<()>;

    /// Whether `repo` links blob `digest`.
    async fn blob_linked(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool>;

    /// Remove `repo`'s link to blob `digest`; returns whether it existed.
    async fn unlink_blob(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool>;

    /// Every blob digest `repo` links (for garbage collection).
    async fn repo_blobs(&self, repo: &RepositoryName) -> Result<Vec<String>>;

    /// Every blob link of `repo` with when it was last written (garbage collection never
    /// removes a link younger than its grace period). The default reports no times, which
    /// garbage collection treats as "too young to remove".
    async fn repo_blob_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        Ok(self
            .repo_blobs(repo)
            .await?
            .into_iter()
            .map(LinkInfo::undated)
            .collect())
    }

    // ---- manifests and tags ----

    /// Store manifest bytes (as a blob) and link it into `repo` as a manifest.
    async fn manifest_put(&self, repo: &RepositoryName, manifest: &StoredManifest) -> Result<()>;

    /// A manifest of `repo` by digest, or `None`.
    async fn manifest_get(
        &self,
        repo: &RepositoryName,
        digest: &Digest,
    ) -> Result<Option<StoredManifest>>;

    /// Unlink a manifest from `repo` (and any tags pointing at it). Returns whether it
    /// existed.
    async fn manifest_delete(&self, repo: &RepositoryName, digest: &Digest) -> Result<bool>;

    /// Every manifest digest linked into `repo`.
    async fn manifest_list(&self, repo: &RepositoryName) -> Result<Vec<String>>;

    /// Every manifest link of `repo` with when it was last written (see
    /// [`Storage::repo_blob_links`]).
    async fn manifest_links(&self, repo: &RepositoryName) -> Result<Vec<LinkInfo>> {
        Ok(self
            .manifest_list(repo)
            .await?
            .into_iter()
            .map(LinkInfo::undated)
            .collect())
    }

    /// Point `tag` of `repo` at manifest `digest` (atomic replace).
    async fn tag_set(&self, repo: &RepositoryName, tag: &Tag, digest: &Digest) -> Result<()>;

    /// The manifest digest `tag` points at.
    async fn tag_get(&self, repo: &RepositoryName, tag: &Tag) -> Result<Option<String>>;

    /// Remove a tag; returns whether it existed.
    async fn tag_delete(&self, repo: &RepositoryName, tag: &Tag) -> Result<bool>;

    /// Tags of `repo`, sorted lexically; `None` if the repository does not exist.
    async fn tag_list(&self, repo: &RepositoryName) -> Result<Option<Vec<String>>>;

    /// Every repository, sorted lexically.
    async fn repo_list(&self) -> Result<Vec<String>>;

    // ---- referrers ----

    /// Record that manifest `referrer` in `repo` has `subject` as its subject.
    async fn referrer_add(
        &self,
        repo: &RepositoryName,
        subject: &Digest,
        referrer: &Digest,
    ) -> Result<()>;

    /// Manifests in `repo` whose subject is `subject` (digests; the server reads each to
    /// build descriptors). Referrers whose manifest was deleted are skipped.
    async fn referrer_list(&self, repo: &RepositoryName, subject: &Digest) -> Result<Vec<String>>;

    // ---- garbage collection's coordination records (see [`gc`]) ----

    /// Writes the empty record `name` in `dir` (one of [`gc::RECORD_DIRS`]), or refreshes
    /// its time if it exists. Once this returns, every process using the store sees it:
    /// collections and manifest pushes agree through these records, never through memory.
    async fn gc_record_put(&self, dir: &str, name: &str) -> Result<()>;

    /// Whether record `name` exists in `dir`.
    async fn gc_record_exists(&self, dir: &str, name: &str) -> Result<bool>;

    /// Every record in `dir` with when it was last written, sorted by name.
    async fn gc_record_list(&self, dir: &str) -> Result<Vec<(String, SystemTime)>>;

    /// Removes record `name` from `dir`; whether it existed.
    async fn gc_record_delete(&self, dir: &str, name: &str) -> Result<bool>;
}

/// Refuses a coordination record outside [`gc::RECORD_DIRS`] or whose name is not 1-200
/// characters of `[a-z0-9-]` (so it is one safe path component or key segment).
pub(crate) fn check_gc_record(dir: &str, name: Option<&str>) -> Result<()> {
    let dir_ok = gc::RECORD_DIRS.contains(&dir);
    let name_ok = name.is_none_or(|n| {
        (1..=200).contains(&n.len())
            && n.bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-')
    });
    if dir_ok && name_ok {
        Ok(())
    } else {
        Err(StorageError::Invalid(format!(
            "garbage collection record {dir:?}/{name:?}"
        )))
    }
}
