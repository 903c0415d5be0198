//! The store's typed errors. Misses and corrupt entries are not errors (they are `None`):
//! errors are refusals the caller must act on and failures of the disk or metadata.

use std::path::PathBuf;

use crate::key::ChunkKey;

/// Errors of the chunk store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Filesystem I/O failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The metadata database failed.
    #[error("store metadata: {0}")]
    Metadata(#[from] redb::Error),
    /// Another process (normally the node daemon) has the store open.
    #[error(
        "the store at {} is in use by another process (is `ferry daemon` running?)",
        path.display()
    )]
    InUse {
        /// The store directory.
        path: PathBuf,
    },
    /// The store was written by a newer ferry with a metadata format this one cannot read.
    #[error("the store at {} has metadata format {found}; this ferry reads up to {supported}", path.display())]
    UnsupportedFormat {
        /// The store directory.
        path: PathBuf,
        /// The version found.
        found: u64,
        /// The newest version this build reads.
        supported: u64,
    },
    /// The bytes offered to `put` do not hash to the key: nothing was stored.
    #[error("chunk bytes do not match their key: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The key the caller gave.
        expected: ChunkKey,
        /// The hash of the bytes.
        actual: ChunkKey,
    },
    /// A single entry is larger than the whole store may hold.
    #[error("a chunk of {size} bytes does not fit in a store of at most {max_bytes} bytes")]
    TooLarge {
        /// Size of the entry.
        size: u64,
        /// The store's bound.
        max_bytes: u64,
    },
    /// Making room would need evicting pinned entries: nothing was stored.
    #[error(
        "store full: {needed} more bytes needed, {pinned_bytes} of the {max_bytes} allowed are pinned by live mounts"
    )]
    Full {
        /// Size of the entry that did not fit.
        needed: u64,
        /// The store's bound.
        max_bytes: u64,
        /// Bytes held by pinned entries.
        pinned_bytes: u64,
    },
    /// A string is not a `sha256:<64 lowercase hex>` key.
    #[error("invalid chunk key {0:?}: expected sha256:<64 lowercase hex>")]
    InvalidKey(String),
    /// An export is of a format version this build does not read.
    #[error(
        "{} is a store export of format {found}; this ferry reads formats {oldest} to {supported} (import it with the ferry that wrote it, or export again with this one)",
        path.display()
    )]
    ExportFormat {
        /// The manifest.
        path: PathBuf,
        /// The version found.
        found: u64,
        /// The newest version this build reads.
        supported: u32,
        /// The oldest version this build reads.
        oldest: u32,
    },
    /// An export's manifest is missing, malformed or beyond the bounds.
    #[error("{}: {reason}", path.display())]
    BadExport {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An object of an export is missing or does not match its key: nothing was imported.
    #[error("object {key} of the export ({}) is {reason}; nothing was imported (export the store again)", path.display())]
    CorruptObject {
        /// The object's key.
        key: ChunkKey,
        /// Its file in the export.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A metadata blob (manifest, config, index…) of the store or its seed is damaged:
    /// it is not served.
    #[error("metadata blob {key} ({}) is {reason}; it is not used (prewarm the image again, or rebake the seed)", path.display())]
    CorruptMetadata {
        /// The blob's digest.
        key: ChunkKey,
        /// Its file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An export cannot be written where asked.
    #[error("cannot export to {}: {reason}", path.display())]
    ExportDestination {
        /// The destination (or the entry being copied).
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// An image record is malformed or beyond the bounds.
    #[error("invalid image record: {0}")]
    InvalidRecord(String),
    /// The seed store (`[store] seed`) cannot be used: not a store export, an unfinished
    /// or unknown-format one, or the live store itself. Nothing was opened.
    #[error(
        "seed store {}: {source}; a seed must be a directory written by `ferry store export` \
         (bake one with `ferry prewarm` and `ferry store export DIR`, or remove `[store] seed`)",
        path.display()
    )]
    Seed {
        /// The seed directory given.
        path: PathBuf,
        /// What is wrong with it.
        source: Box<Error>,
    },
    /// A pin owner name is empty or longer than [`crate::MAX_OWNER_LEN`] bytes.
    #[error("invalid pin owner {0:?}: must be 1..={max} bytes", max = crate::MAX_OWNER_LEN)]
    InvalidOwner(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn db(e: impl Into<redb::Error>) -> Error {
        Error::Metadata(e.into())
    }
}

/// Result of store operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
