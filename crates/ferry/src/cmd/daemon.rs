//! `ferry daemon`: run the node daemon in the foreground (`ferry_daemon::Daemon`). This
//! file turns flags and the config file into a `DaemonConfig`; it must not implement any
//! of the daemon's parts.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ferry_daemon::{Daemon, DaemonConfig};

/// Arguments of `ferry daemon`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// TOML configuration file (see `--print-config` for every setting).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Control socket (default: the config's `[control] socket`, else
    /// /run/ferry/daemon.sock for root, $XDG_RUNTIME_DIR/ferry/daemon.sock otherwise).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Chunk store directory (wins over $FERRY_STORE and the config).
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Do not serve containerd's snapshotter, whatever the config says.
    #[arg(long)]
    no_snapshotter: bool,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Run the FUSE descriptor holder on SOCKET instead of the daemon (the daemon
    /// starts it itself; see `[fuse] keep_connections`).
    #[arg(long, value_name = "SOCKET", hide = true)]
    fd_holder: Option<PathBuf>,
    /// With --fd-holder: keep running when idle (a holder run by a service manager or
    /// as a pod's second container, not started by the daemon).
    #[arg(long, requires = "fd_holder", hide = true)]
    persistent: bool,
}

/// Reads `path` as a daemon config, or the embedded defaults without one.
pub fn load_config(path: Option<&Path>) -> Result<DaemonConfig> {
    match path {
        Some(p) => DaemonConfig::load(p).with_context(|| format!("loading {}", p.display())),
        None => Ok(DaemonConfig::default()),
    }
}

/// Runs `ferry daemon`.
pub fn run(args: Args) -> Result<()> {
    if let Some(socket) = &args.fd_holder {
        return ferry_daemon::fdstore::run_holder(socket, args.persistent)
            .with_context(|| format!("fd holder on {}", socket.display()));
    }
    let mut config = load_config(args.config.as_deref())?;
    if let Some(socket) = args.socket {
        config.control.socket = Some(socket);
    }
    if args.store.is_some() {
        config.store_path_flag = args.store;
    }
    if args.no_snapshotter {
        config.snapshotter.enabled = false;
    }
    if args.print_config {
        print!("{}", config.resolved().to_toml()?);
        return Ok(());
    }
    run_daemon(config, "ferry daemon")
}

/// Runs the daemon with `config` until SIGTERM/SIGINT, telling the user where it serves.
pub fn run_daemon(mut config: DaemonConfig, name: &str) -> Result<()> {
    // The holder is this same executable (`ferry daemon --fd-holder SOCKET`).
    config.holder_program = std::env::current_exe().ok();
    let store = config.store_path();
    Daemon::run(config, ferry_daemon::stop_signal(), |info| {
        eprintln!(
            "{name}: serving on {} (store {}, pid {})",
            info.control_socket.display(),
            store.display(),
            info.pid
        );
        if let Some(s) = &info.snapshotter_socket {
            eprintln!("{name}: containerd snapshotter on {}", s.display());
        }
        if let Some(a) = &info.metrics_addr {
            eprintln!("{name}: metrics on http://{a}/metrics");
        }
    })
    .with_context(|| format!("{name} failed"))?;
    eprintln!("{name}: stopped");
    Ok(())
}
