//! `ferry mount` / `ferry umount`: serve an image's root filesystem (or one layer) lazily
//! over FUSE, and take it down again.
//!
//! The filesystem itself lives in `ferry_fs` and the node daemon in `ferry_daemon`; this
//! file only picks where a mount is served:
//! * by default, by the node daemon over its control socket (started detached when none
//!   answers), so every mount shares one chunk store and shows in `ferry status`;
//! * `--foreground`: by this process, until unmounted or SIGINT/SIGTERM;
//! * `--stats-file`: by a standalone detached `ferry mount --foreground` process that
//!   keeps the file updated (what scripts did before `ferry status`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::out::outln;
use anyhow::{Context, Result, bail};
use ferry_daemon::{ControlClient, MountRequest};
use ferry_fs::{FerryFs, FetchConfig, ImageSource, MountOptions, MountedImage, View};
use ferry_registry_client::{Client, ClientConfig, RangeRuntime};
use ferry_store::{Store, StoreConfig, StoreOptions};

/// Arguments of `ferry mount`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    image: String,
    /// Where to mount it (an existing directory).
    mountpoint: PathBuf,
    /// Mount only this layer (`sha256:…`), whiteouts presented the way overlayfs
    /// expects a lower layer.
    #[arg(long, value_name = "DIGEST")]
    layer: Option<String>,
    /// Chunk store directory; default: $FERRY_STORE, else /var/lib/ferry/store for root,
    /// else $XDG_CACHE_HOME/ferry/store.
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Serve from this process until unmounted or sent SIGINT/SIGTERM (instead of the
    /// node daemon).
    #[arg(long)]
    foreground: bool,
    /// The daemon's control socket (default: the config's, else the per-user default).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Daemon config file (its control socket; passed on to a daemon this starts).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Concurrent registry requests for this image.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Largest merged fetch, in bytes (K/M/G suffixes are powers of 1024).
    #[arg(long, default_value = "8M", value_parser = ferry_oci::units::parse_nonzero_size)]
    request_size: u64,
    /// Seconds an uncached read may wait for the registry before failing with EIO.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// Speak plain HTTP to the registry (loopback registries get it automatically).
    #[arg(long)]
    plain_http: bool,
    /// containerd's registry host directory (`<DIR>/<host[:port]>/hosts.toml`: mirrors,
    /// `server`, certificates), as containerd's `config_path`; "" turns it off. A mount
    /// through the daemon uses the daemon's `[registry] config_path`.
    #[arg(long, value_name = "DIR", env = "FERRY_REGISTRY_CONFIG_PATH", default_value = ferry_registry_client::hosts::DEFAULT_CONFIG_PATH)]
    registry_config_path: PathBuf,
    // A mount through the daemon uses the daemon's `[registry]
    // credential_provider_config` instead.
    #[command(flatten)]
    credential_providers: super::CredentialProviderArgs,
    /// Keep this file updated with the mount's counters as JSON; the mount is then
    /// served by its own detached process, not the daemon (`ferry status --json` shows
    /// the daemon's mounts).
    #[arg(long, value_name = "PATH")]
    stats_file: Option<PathBuf>,
    /// Only the mounting user may use the mount (default: everyone, permissions checked
    /// by the kernel, as containers need).
    #[arg(long)]
    owner_only: bool,
    /// The platform to mount from a multi-platform image (default: this machine's). Its
    /// manifest is mounted by digest (shown as `IMAGE@sha256:…` in `ferry status`).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    platform: Option<ferry_oci::Platform>,
}

/// Arguments of `ferry umount`.
#[derive(Debug, clap::Args)]
pub struct UmountArgs {
    /// The mount point.
    mountpoint: PathBuf,
    /// The daemon's control socket (default: the config's, else the per-user default).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Daemon config file (for its control socket).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
}

/// The registry client's configuration the flags make (a foreground mount's, and the
/// one `--platform` resolves the image with).
fn client_config(args: &Args) -> Result<ClientConfig> {
    let mut cfg = ClientConfig::default();
    if args.plain_http
        && let ferry_oci::ImageRef::Registry { registry, .. } =
            ferry_oci::ImageRef::parse(&args.image)?
    {
        cfg.registry.entry(registry).or_default().plain_http = true;
    }
    cfg.max_concurrent_downloads = args.concurrency;
    cfg.config_path = super::registry_config_path(&args.registry_config_path);
    args.credential_providers.apply(&mut cfg);
    Ok(cfg)
}

/// Runs `ferry mount`.
pub fn run(mut args: Args) -> Result<()> {
    if let Some(platform) = args.platform.take() {
        args.image = super::platform_image(&args.image, &platform, client_config(&args)?)?;
    }
    let mountpoint = args
        .mountpoint
        .canonicalize()
        .with_context(|| format!("mount point {}", args.mountpoint.display()))?;
    if !mountpoint.is_dir() {
        bail!("mount point {} is not a directory", mountpoint.display());
    }
    if args.threads == 0 || args.concurrency == 0 {
        bail!("--threads and --concurrency must be at least 1");
    }
    if !args.foreground {
        if args.stats_file.is_some() {
            return run_detached(&args, &mountpoint);
        }
        return run_via_daemon(&args, &mountpoint);
    }
    // Before any thread exists, so that every thread inherits the mask.
    ferry_fs::block_stop_signals()?;

    let store_path = match &args.store {
        Some(p) => p.clone(),
        None => StoreConfig::default().resolve_path(),
    };
    let store = Store::open_with(&store_path, StoreOptions::default()).with_context(|| {
        format!(
            "opening the chunk store at {} (if a ferry daemon uses it, mount without \
             --foreground to go through the daemon, or give --store another directory)",
            store_path.display()
        )
    })?;
    let client = Client::new(client_config(&args)?)?;
    let runtime = RangeRuntime::new()?;
    let source = ImageSource::open(&args.image, &client, &runtime)
        .with_context(|| format!("opening {}", args.image))?;
    let view = match &args.layer {
        Some(d) => View::Layer(d.clone()),
        None => View::Merged,
    };
    let fetch = FetchConfig {
        concurrency: args.concurrency,
        max_request_bytes: args.request_size,
        timeout: Duration::from_secs(args.timeout.max(1)),
        ..FetchConfig::default()
    };
    let image = Arc::new(
        MountedImage::new(source, Some(Arc::new(store)), fetch, &view)
            .with_context(|| format!("preparing {}", args.image))?,
    );
    let opts = MountOptions {
        threads: args.threads,
        allow_other: !args.owner_only,
        fsname: format!("ferry:{}", image.manifest_digest),
    };
    let stats = image.stats.clone();
    let stats_file = args.stats_file.clone();
    let mut last = None;
    let mut publish = move || {
        let Some(path) = &stats_file else { return };
        let snap = stats.snapshot();
        if last == Some(snap) {
            return;
        }
        last = Some(snap);
        if let Err(e) = write_stats(path, &snap) {
            tracing::warn!(error = %e, "cannot write the stats file");
        }
    };
    let shown = mountpoint.display().to_string();
    ferry_fs::release_idle_inflated_spans();
    ferry_fs::mount_foreground(
        FerryFs::new(image),
        &mountpoint,
        &opts,
        || eprintln!("ferry: {} mounted at {shown}", args.image),
        &mut publish,
    )?;
    publish();
    Ok(())
}

fn write_stats(path: &Path, snap: &ferry_fs::StatsSnapshot) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(snap)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Starts `ferry mount --foreground` detached and waits until the mount is live (or the
/// child fails).
fn run_detached(args: &Args, mountpoint: &Path) -> Result<()> {
    let exe = std::env::current_exe().context("finding the ferry binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount")
        .arg(&args.image)
        .arg(mountpoint)
        .arg("--foreground")
        .arg("--threads")
        .arg(args.threads.to_string())
        .arg("--concurrency")
        .arg(args.concurrency.to_string())
        .arg("--request-size")
        .arg(args.request_size.to_string())
        .arg("--timeout")
        .arg(args.timeout.to_string());
    if let Some(l) = &args.layer {
        cmd.arg("--layer").arg(l);
    }
    if let Some(s) = &args.store {
        cmd.arg("--store").arg(s);
    }
    if let Some(s) = &args.stats_file {
        cmd.arg("--stats-file").arg(s);
    }
    if args.plain_http {
        cmd.arg("--plain-http");
    }
    cmd.arg("--registry-config-path")
        .arg(&args.registry_config_path);
    cmd.args(args.credential_providers.to_args());
    if args.owner_only {
        cmd.arg("--owner-only");
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    ferry_fs::fuse::detach_on_spawn(&mut cmd);
    let mut child = cmd.spawn().context("starting the mount process")?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout.max(1) + 60);
    loop {
        if ferry_fs::is_mounted(mountpoint) {
            eprintln!("ferry: served by process {}", child.id());
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("the mount process exited ({status}) before the mount was ready");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("the mount was not ready in time");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn control_socket(socket: Option<&Path>, config: Option<&Path>) -> Result<PathBuf> {
    Ok(match socket {
        Some(s) => s.to_path_buf(),
        None => super::daemon::load_config(config)?.control_socket(),
    })
}

/// Asks the node daemon for the mount, starting the daemon first when none answers.
fn run_via_daemon(args: &Args, mountpoint: &Path) -> Result<()> {
    let ignored: Vec<&str> = [
        (args.threads != 4, "--threads"),
        (args.concurrency != 8, "--concurrency"),
        (args.request_size != 8 << 20, "--request-size"),
        (args.timeout != 30, "--timeout"),
        (args.plain_http, "--plain-http"),
        (
            args.registry_config_path
                != Path::new(ferry_registry_client::hosts::DEFAULT_CONFIG_PATH),
            "--registry-config-path",
        ),
        (
            args.credential_providers.is_set(),
            "--image-credential-provider-config",
        ),
        (args.owner_only, "--owner-only"),
    ]
    .into_iter()
    .filter_map(|(set, name)| set.then_some(name))
    .collect();
    if !ignored.is_empty() {
        eprintln!(
            "ferry: warning: {} apply to --foreground mounts only; the daemon uses its config \
             ([fetch], [fuse], [registry] plain_http, config_path and credential_provider_config)",
            ignored.join(", ")
        );
    }
    let socket = control_socket(args.socket.as_deref(), args.config.as_deref())?;
    let client = ControlClient::new(&socket);
    let runtime = super::current_thread_runtime()?;
    let health = client.clone().with_timeout(Duration::from_secs(5));
    if runtime.block_on(health.health()).is_err() {
        start_daemon(args, &socket, &health, &runtime)?;
    } else if let Some(wanted) = &args.store {
        // A running daemon keeps its own store; say so rather than ignore --store.
        let daemon_store = runtime
            .block_on(health.status())
            .ok()
            .and_then(|s| s.store)
            .map(|s| s.path);
        let same = |p: &Path| p.canonicalize().ok() == wanted.canonicalize().ok();
        if let Some(p) = daemon_store.filter(|p| !same(p)) {
            eprintln!(
                "ferry: warning: the daemon on {} uses the store {}, not {}",
                socket.display(),
                p.display(),
                wanted.display()
            );
        }
    }
    let request = MountRequest {
        image: args.image.clone(),
        mountpoint: mountpoint.to_path_buf(),
        layer: args.layer.clone(),
    };
    let info = runtime.block_on(client.mount(&request)).with_context(|| {
        format!(
            "mounting {} through the daemon at {}",
            args.image,
            socket.display()
        )
    })?;
    outln!("{}", info.mountpoint.display());
    Ok(())
}

/// Starts `ferry daemon` detached (logging next to its socket) and waits until it
/// answers on `socket`.
fn start_daemon(
    args: &Args,
    socket: &Path,
    client: &ControlClient,
    runtime: &tokio::runtime::Runtime,
) -> Result<()> {
    let dir = socket.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let log_path = dir.join("daemon.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding the ferry binary")?;
    let mut cmd = std::process::Command::new(exe);
    let log_filter = std::env::var("FERRY_LOG").unwrap_or_else(|_| "info".into());
    cmd.arg("--log")
        .arg(log_filter)
        .arg("daemon")
        .arg("--socket")
        .arg(socket)
        // A daemon started on demand does not take over containerd's snapshotter.
        .arg("--no-snapshotter");
    if let Some(s) = &args.store {
        cmd.arg("--store").arg(s);
    }
    if let Some(c) = &args.config {
        cmd.arg("--config").arg(c);
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(log.try_clone().context("duplicating the log file")?)
        .stderr(log);
    ferry_fs::fuse::detach_on_spawn(&mut cmd);
    let mut child = cmd.spawn().context("starting ferry daemon")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if runtime.block_on(client.health()).is_ok() {
            eprintln!(
                "ferry: started the node daemon (pid {}, socket {}, log {})",
                child.id(),
                socket.display(),
                log_path.display()
            );
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "ferry daemon exited ({status}) before answering on {}; see {}",
                socket.display(),
                log_path.display()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "ferry daemon (pid {}) did not answer on {} within 30 s; see {}",
                child.id(),
                socket.display(),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `ferry umount`: asks the daemon, else unmounts directly (a standalone or
/// foreground mount, or one left by a daemon that is gone).
pub fn run_umount(args: UmountArgs) -> Result<()> {
    let absolute = if args.mountpoint.is_absolute() {
        args.mountpoint.clone()
    } else {
        std::env::current_dir()
            .context("finding the current directory")?
            .join(&args.mountpoint)
    };
    // The mount point itself may be a dead mount: resolve only its parent.
    let mountpoint = ferry_daemon::mounts::canonical_mountpoint(&absolute)
        .with_context(|| format!("mount point {}", args.mountpoint.display()))?;
    let socket = control_socket(args.socket.as_deref(), args.config.as_deref())?;
    let client = ControlClient::new(&socket).with_timeout(Duration::from_secs(120));
    let runtime = super::current_thread_runtime()?;
    match runtime.block_on(client.unmount(&mountpoint)) {
        Ok(()) => return Ok(()),
        Err(ferry_daemon::Error::Remote { status: 404, .. }) => {}
        Err(e @ ferry_daemon::Error::Remote { .. }) => {
            return Err(e).with_context(|| format!("unmounting {}", mountpoint.display()));
        }
        Err(e) => tracing::debug!(error = %e, "no daemon; unmounting directly"),
    }
    ferry_fs::unmount(&mountpoint)
        .with_context(|| format!("unmounting {}", mountpoint.display()))?;
    Ok(())
}
