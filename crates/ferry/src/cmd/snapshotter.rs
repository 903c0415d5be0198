//! `ferry snapshotter`: the node daemon with containerd's snapshotter enabled and lazy
//! layers (`ferry_daemon`). Kept as its own command for its flags: `--socket` and
//! `--root` are the snapshotter's. The config file is the daemon's; the older
//! snapshotter-only file (`socket`/`root` at the top or under `[snapshotter]`) is still
//! read.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ferry_daemon::DaemonConfig;

/// Arguments of `ferry snapshotter`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Unix socket containerd connects to (`[proxy_plugins.ferry] address`).
    /// Default: the config's `[snapshotter] socket`, else /run/ferry/snapshotter.sock.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Directory for metadata and snapshot contents.
    /// Default: the config's `[snapshotter] root`, else /var/lib/ferry/snapshotter.
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
    /// TOML configuration file (the daemon's; see `ferry daemon --print-config`).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// The daemon's control socket (for `ferry status`/`ferry mount`); default: the
    /// config's, else /run/ferry/daemon.sock for root.
    #[arg(long, value_name = "PATH")]
    control_socket: Option<PathBuf>,
    /// Chunk store directory (wins over $FERRY_STORE and the config).
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
}

fn load(path: &std::path::Path) -> Result<DaemonConfig> {
    let daemon_err = match DaemonConfig::load(path) {
        Ok(c) => return Ok(c),
        Err(e) => e,
    };
    // The snapshotter-only format of earlier releases.
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let legacy = ferry_snapshotter::server::Config::from_toml(&text)
        .map_err(|_| daemon_err)
        .with_context(|| format!("loading {}", path.display()))?;
    let mut config = DaemonConfig::default();
    if let Some(s) = legacy.socket {
        config.snapshotter.socket = s;
    }
    if let Some(r) = legacy.root {
        config.snapshotter.root = r;
    }
    Ok(config)
}

/// Runs `ferry snapshotter`.
pub fn run(args: Args) -> Result<()> {
    let mut config = match &args.config {
        Some(path) => load(path)?,
        None => DaemonConfig::default(),
    };
    config.snapshotter.enabled = true;
    if let Some(s) = args.socket {
        config.snapshotter.socket = s;
    }
    if let Some(r) = args.root {
        config.snapshotter.root = r;
    }
    if let Some(c) = args.control_socket {
        config.control.socket = Some(c);
    }
    if args.store.is_some() {
        config.store_path_flag = args.store;
    }
    super::daemon::run_daemon(config, "ferry snapshotter")
}
