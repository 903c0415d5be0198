//! `ferry snapshotter`: run ferry as containerd's snapshotter (a proxy plugin on a unix
//! socket). The snapshotter lives in `ferry_snapshotter`; this file turns flags and the
//! config file into a running server and stops it cleanly on SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use ferry_snapshotter::server::{self, Config, DEFAULT_ROOT, DEFAULT_SOCKET};
use ferry_snapshotter::{NoRemoteLayers, Snapshotter};

/// Arguments of `ferry snapshotter`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Unix socket containerd connects to (`[proxy_plugins.ferry] address`).
    /// Default: the config's `socket`, else /run/ferry/snapshotter.sock.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Directory for metadata and snapshot contents.
    /// Default: the config's `root`, else /var/lib/ferry/snapshotter.
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
    /// TOML configuration file (`socket`, `root`, at the top or under `[snapshotter]`).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Config::from_toml(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => Config::default(),
    };
    let socket = args
        .socket
        .or(config.socket)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    let root = args
        .root
        .or(config.root)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_ROOT));
    let snapshotter = Snapshotter::open(&root, Arc::new(NoRemoteLayers))
        .with_context(|| format!("opening the snapshotter at {}", root.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = server::bind(&socket)
            .await
            .with_context(|| format!("listening on {}", socket.display()))?;
        tracing::info!(socket = %socket.display(), root = %root.display(), "snapshotter serving");
        eprintln!(
            "ferry snapshotter: serving on {} (root {})",
            socket.display(),
            root.display()
        );
        server::serve(Arc::new(snapshotter), listener, &socket, shutdown_signal())
            .await
            .context("serving the Snapshots API")?;
        tracing::info!("snapshotter stopped");
        Ok(())
    })
}

/// Resolves on SIGTERM or SIGINT. If the handlers cannot be installed the server runs
/// until killed (and the next start replaces the stale socket).
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}
