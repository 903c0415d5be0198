//! The snapshotter's error type. Each variant maps to one gRPC code, because containerd
//! turns those codes back into its errdefs (NotFound, AlreadyExists, …) and decides what
//! to do next from them — AlreadyExists on Prepare is how a remote snapshot is announced.

use std::io;
use std::path::PathBuf;

/// Result alias for snapshotter operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in a snapshot operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The named snapshot does not exist in the namespace.
    #[error("snapshot {key:?} not found")]
    NotFound {
        /// Key or name looked up.
        key: String,
    },
    /// A snapshot with that key or name already exists.
    #[error("snapshot {key:?} already exists")]
    AlreadyExists {
        /// Key or name that is taken.
        key: String,
    },
    /// The snapshot is in the wrong state for the operation (e.g. removing a parent).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request itself is malformed (empty key, bad filter, bad field path…).
    #[error("{0}")]
    InvalidArgument(String),
    /// A filesystem operation on the snapshot directories failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The metadata database failed.
    #[error("snapshot metadata: {0}")]
    Metadata(String),
    /// A background task died (a panic or cancellation inside the server).
    #[error("internal: {0}")]
    Internal(String),
}

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn not_found(key: &str) -> Self {
        Error::NotFound {
            key: key.to_owned(),
        }
    }

    pub(crate) fn already_exists(key: &str) -> Self {
        Error::AlreadyExists {
            key: key.to_owned(),
        }
    }

    pub(crate) fn db(e: impl std::fmt::Display) -> Self {
        Error::Metadata(e.to_string())
    }

    /// The gRPC code containerd expects for this error.
    pub fn code(&self) -> tonic::Code {
        match self {
            Error::NotFound { .. } => tonic::Code::NotFound,
            Error::AlreadyExists { .. } => tonic::Code::AlreadyExists,
            Error::FailedPrecondition(_) => tonic::Code::FailedPrecondition,
            Error::InvalidArgument(_) => tonic::Code::InvalidArgument,
            Error::Io { .. } | Error::Metadata(_) | Error::Internal(_) => tonic::Code::Internal,
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}
