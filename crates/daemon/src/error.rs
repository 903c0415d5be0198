//! The daemon's error type. Each variant maps to one HTTP status on the control API, so
//! a client can tell "you asked for something wrong" from "the daemon failed".

use std::path::PathBuf;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in the daemon or when talking to it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error("config: {0}")]
    Config(String),
    /// A request was malformed or named something impossible.
    #[error("{0}")]
    InvalidRequest(String),
    /// Nothing is mounted (by this daemon) at that path.
    #[error("nothing is mounted by the daemon at {}", .0.display())]
    NotMounted(PathBuf),
    /// Something is already mounted at that path.
    #[error("{} is already a ferry mount", .0.display())]
    AlreadyMounted(PathBuf),
    /// Another daemon answers on the control socket.
    #[error("another ferry daemon is already serving on {}", .0.display())]
    AlreadyRunning(PathBuf),
    /// A filesystem or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The lazy filesystem failed (image, index, mount).
    #[error(transparent)]
    Fs(#[from] ferry_fs::Error),
    /// The chunk store failed.
    #[error("chunk store: {0}")]
    Store(#[from] ferry_store::Error),
    /// The registry client failed.
    #[error(transparent)]
    Registry(#[from] ferry_registry_client::ClientError),
    /// A lazy layer could not be resolved (see [`crate::indexes`]).
    #[error(transparent)]
    Resolve(#[from] crate::indexes::ResolveError),
    /// The snapshotter failed.
    #[error("snapshotter: {0}")]
    Snapshotter(String),
    /// Talking to the daemon failed (connect, HTTP, decoding).
    #[error("control socket: {0}")]
    Control(String),
    /// The daemon answered with an error.
    #[error("{message}")]
    Remote {
        /// HTTP status code.
        status: u16,
        /// The daemon's message.
        message: String,
    },
}

impl Error {
    /// An [`Error::Io`] with context.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// The HTTP status the control API answers this error with.
    pub fn http_status(&self) -> u16 {
        match self {
            Error::Config(_)
            | Error::InvalidRequest(_)
            | Error::Resolve(crate::indexes::ResolveError::NoSuchLayer { .. }) => 400,
            Error::NotMounted(_) => 404,
            Error::AlreadyMounted(_) | Error::AlreadyRunning(_) => 409,
            Error::Remote { status, .. } => *status,
            _ => 500,
        }
    }
}
