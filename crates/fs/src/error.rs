//! Errors of the lazy filesystem library; FUSE replies map them to errno values.

use std::io;

/// Errors opening or serving an image.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The layer formats refused the input (bad index, digest mismatch, missing entry).
    #[error(transparent)]
    Index(#[from] ferry_index::Error),
    /// The OCI layout or reference is unusable.
    #[error(transparent)]
    Oci(#[from] ferry_oci::Error),
    /// The registry said no or could not be reached.
    #[error(transparent)]
    Registry(#[from] ferry_registry_client::ClientError),
    /// The chunk store failed.
    #[error(transparent)]
    Store(#[from] ferry_store::Error),
    /// Local I/O (mount point, FUSE device, temporary files).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        source: io::Error,
    },
    /// The request cannot be served as asked (no such layer, bad option).
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(what: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
