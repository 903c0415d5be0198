//! Serving the Snapshots API on a unix socket, as containerd's proxy plugins expect, with
//! a clean shutdown that removes the socket. Also the `[snapshotter]` config file shape.

use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;

use crate::error::{Error, Result};
use crate::service::SnapshotService;
use crate::snapshotter::Snapshotter;

/// Default socket path (`[proxy_plugins.ferry] address`).
pub const DEFAULT_SOCKET: &str = "/run/ferry/snapshotter.sock";
/// Default root directory (metadata and snapshot directories).
pub const DEFAULT_ROOT: &str = "/var/lib/ferry/snapshotter";

/// The snapshotter's configuration file (TOML). Every field is optional; command-line
/// flags override it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Unix socket to serve on.
    pub socket: Option<PathBuf>,
    /// Root directory.
    pub root: Option<PathBuf>,
}

impl Config {
    /// Parses a TOML config (`[snapshotter]` table or top-level keys).
    pub fn from_toml(text: &str) -> Result<Config> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct File {
            snapshotter: Option<Config>,
            #[serde(flatten)]
            top: Config,
        }
        let file: File = toml::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("snapshotter config: {e}")))?;
        Ok(file.snapshotter.unwrap_or(file.top))
    }
}

/// Binds `socket` (creating its directory; replacing a stale socket file nobody listens
/// on, refusing one that is alive or any other kind of file), mode 0660.
pub async fn bind(socket: &Path) -> Result<UnixListener> {
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("create", parent, e))?;
    }
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(socket).await.is_ok() {
                return Err(Error::FailedPrecondition(format!(
                    "{} is in use by another running snapshotter",
                    socket.display()
                )));
            }
            std::fs::remove_file(socket).map_err(|e| Error::io("remove stale", socket, e))?;
        }
        Ok(_) => {
            return Err(Error::FailedPrecondition(format!(
                "{} exists and is not a socket",
                socket.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("stat", socket, e)),
    }
    let listener = UnixListener::bind(socket).map_err(|e| Error::io("bind", socket, e))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| Error::io("chmod", socket, e))?;
    Ok(listener)
}

/// Serves `snapshotter` on `listener` until `shutdown` resolves, then removes `socket`.
pub async fn serve(
    snapshotter: Arc<Snapshotter>,
    listener: UnixListener,
    socket: &Path,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let service = SnapshotService::new(snapshotter).into_server();
    let served = tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await;
    if let Err(e) = std::fs::remove_file(socket)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(socket = %socket.display(), error = %e, "removing socket");
    }
    served.map_err(|e| Error::Internal(format!("gRPC server: {e}")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn config_at_top_level_or_in_a_table() {
        let top = Config::from_toml("socket = \"/s.sock\"\nroot = \"/r\"\n").unwrap();
        assert_eq!(top.socket.as_deref(), Some(Path::new("/s.sock")));
        assert_eq!(top.root.as_deref(), Some(Path::new("/r")));
        let table = Config::from_toml("[snapshotter]\nroot = \"/r2\"\n").unwrap();
        assert_eq!(table.root.as_deref(), Some(Path::new("/r2")));
        assert_eq!(table.socket, None);
        assert_eq!(Config::from_toml("").unwrap(), Config::default());
        let err = Config::from_toml("sockets = \"/typo\"").unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test]
    async fn bind_replaces_a_stale_socket_and_refuses_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("a/b/snap.sock");
        drop(bind(&socket).await.unwrap());
        // The listener is gone but the file stays: a stale socket, replaced.
        assert!(socket.exists());
        let listener = bind(&socket).await.unwrap();
        drop(listener);
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert!(bind(&file).await.is_err());
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }
}
