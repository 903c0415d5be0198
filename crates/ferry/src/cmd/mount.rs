//! `ferry mount` / `ferry umount`: serve an image's root filesystem (or one layer) lazily
//! over FUSE, and take it down again.
//!
//! The filesystem itself lives in `ferry_fs`; this file picks the image, the store and
//! the knobs, and runs the mount. Until the node daemon exists, each mount is served by
//! its own `ferry mount --foreground` process: without `--foreground` that process is
//! started detached and `ferry mount` returns once the mount point is live.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_fs::{FerryFs, FetchConfig, ImageSource, MountOptions, MountedImage, View};
use ferry_registry::client::{Client, ClientConfig, RangeRuntime};
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
    /// Serve from this process until unmounted or sent SIGINT/SIGTERM.
    #[arg(long)]
    foreground: bool,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Concurrent registry requests for this image.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Largest merged fetch, in bytes (K/M/G suffixes are powers of 1024).
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    request_size: u64,
    /// Seconds an uncached read may wait for the registry before failing with EIO.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// Speak plain HTTP to the registry (loopback registries get it automatically).
    #[arg(long)]
    plain_http: bool,
    /// Keep this file updated with the mount's counters as JSON (for scripts, until
    /// `ferry status` exists).
    #[arg(long, value_name = "PATH")]
    stats_file: Option<PathBuf>,
    /// Only the mounting user may use the mount (default: everyone, permissions checked
    /// by the kernel, as containers need).
    #[arg(long)]
    owner_only: bool,
}

/// Arguments of `ferry umount`.
#[derive(Debug, clap::Args)]
pub struct UmountArgs {
    /// The mount point.
    mountpoint: PathBuf,
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (num, shift) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size"))?;
    n.checked_mul(1u64 << shift)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("{s:?} is out of range"))
}

/// Runs `ferry mount`.
pub fn run(args: Args) -> Result<()> {
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
        return run_detached(&args, &mountpoint);
    }
    // Before any thread exists, so that every thread inherits the mask.
    ferry_fs::block_stop_signals()?;

    let store_path = match &args.store {
        Some(p) => p.clone(),
        None => StoreConfig::default().resolve_path(),
    };
    let store = Store::open_with(&store_path, StoreOptions::default())
        .with_context(|| format!("opening the chunk store at {}", store_path.display()))?;
    let mut cfg = ClientConfig::default();
    if args.plain_http
        && let ferry_oci::ImageRef::Registry { registry, .. } =
            ferry_oci::ImageRef::parse(&args.image)?
    {
        cfg.registry.entry(registry).or_default().plain_http = true;
    }
    cfg.max_concurrent_downloads = args.concurrency;
    let client = Client::new(cfg)?;
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

/// Runs `ferry umount`.
pub fn run_umount(args: UmountArgs) -> Result<()> {
    ferry_fs::unmount(&args.mountpoint)
        .with_context(|| format!("unmounting {}", args.mountpoint.display()))?;
    Ok(())
}
