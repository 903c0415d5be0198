//! Errors of the format crate. Each variant says what was wrong and where, so a user can
//! tell a corrupt layer from a bug.

use std::io;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong reading or writing a layer format.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing the underlying bytes failed.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// The tar stream is malformed or uses something ferry refuses (named entry, offset).
    #[error("tar: entry {entry:?} at offset {offset}: {reason}")]
    Tar {
        /// Path of the entry as far as it is known (may be empty).
        entry: String,
        /// Offset of the entry's header in the uncompressed stream.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The gzip stream is malformed.
    #[error("gzip: {0}")]
    Gzip(String),
    /// The zstd stream is malformed.
    #[error("zstd: {0}")]
    Zstd(String),
    /// A ferry index blob is malformed or of an unknown version.
    #[error("ferry index: {0}")]
    Index(String),
    /// An eStargz footer or TOC is malformed.
    #[error("estargz: {0}")]
    Estargz(String),
    /// A SOCI zTOC (or its checkpoints blob) is malformed, or uses something ferry
    /// cannot represent.
    #[error("soci ztoc: {0}")]
    Soci(String),
    /// Bytes did not match the digest that vouches for them.
    #[error("digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch {
        /// What was being verified (span 3 of layer X, chunk of file Y, TOC).
        what: String,
        /// The digest the index or manifest promised.
        expected: String,
        /// The digest of the bytes received.
        actual: String,
    },
    /// An OCI document or layout problem.
    #[error(transparent)]
    Oci(Box<ferry_oci::Error>),
    /// A path was asked for that the layer or image does not have.
    #[error("no such file in the image: {0}")]
    NotFound(String),
    /// The entry exists but is not a regular file (or symlink loop, etc.).
    #[error("{path}: {reason}")]
    NotAFile {
        /// The path asked for.
        path: String,
        /// Why it cannot be read as a file.
        reason: String,
    },
}

impl From<ferry_oci::Error> for Error {
    fn from(e: ferry_oci::Error) -> Self {
        Error::Oci(Box::new(e))
    }
}
