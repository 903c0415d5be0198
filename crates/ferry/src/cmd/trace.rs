//! `ferry trace record|show`: record which file bytes a workload reads at startup and
//! publish them beside the image (an OCI artifact whose subject is the image manifest),
//! so every later mount prefetches them first; show the trace an image has.
//!
//! Recording mounts the image's merged root filesystem read-only at a temporary
//! directory with the recorder on and runs the command chrooted into it (`chroot DIR
//! CMD…`, as root). Nothing else is mounted inside (no /proc, /dev, /sys: the image is
//! read-only, so there is nowhere to mount them), so commands that need those record
//! only what they read before failing. The trace format, recorder and artifact code
//! live in `ferry_fs::trace`; this file only wires them to a mount and a process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_fs::trace::{find_layout_trace, publish_registry_trace, store_layout_trace};
use ferry_fs::{FerryFs, FetchConfig, ImageSource, MountOptions, MountedImage, Trace, View};
use ferry_oci::{ImageRef, OciLayout};
use ferry_registry_client::{Client, RangeRuntime, Repo};
use ferry_store::{Store, StoreConfig, StoreOptions};

/// Arguments of `ferry trace`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Run a command in the image (chrooted into a lazy mount of it) and record which
    /// file bytes it reads, in order.
    Record(RecordArgs),
    /// Show the startup trace published for an image.
    Show(ShowArgs),
}

/// Arguments of `ferry trace record`.
#[derive(Debug, clap::Args)]
struct RecordArgs {
    /// The image: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    image: String,
    /// Write the trace JSON here.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Publish the trace beside the image (registry: referrers API or tag fallback;
    /// `oci:` layout: a referrer in the layout).
    #[arg(long)]
    publish: bool,
    #[command(flatten)]
    registry: super::remote::RegistryArgs,
    /// Chunk store directory (default as for `ferry mount`).
    #[arg(long, value_name = "DIR", conflicts_with = "no_store")]
    store: Option<PathBuf>,
    /// Use no chunk store (e.g. while the daemon holds it): bytes are fetched, not kept.
    #[arg(long)]
    no_store: bool,
    /// Stop the command after this many seconds (for servers that never exit); the
    /// trace recorded until then is kept.
    #[arg(long, value_name = "SECS")]
    duration: Option<u64>,
    /// The platform to record from a multi-platform image (default: this machine's). Its
    /// manifest is mounted, and the trace recorded for it, by digest.
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    platform: Option<ferry_oci::Platform>,
    /// The command and its arguments, as seen inside the image.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// Arguments of `ferry trace show`.
#[derive(Debug, clap::Args)]
struct ShowArgs {
    /// The image: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    image: String,
    #[command(flatten)]
    registry: super::remote::RegistryArgs,
    /// Print the trace JSON instead of a summary.
    #[arg(long)]
    json: bool,
    /// The platform whose trace to show, of a multi-platform image (default: this
    /// machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    platform: Option<ferry_oci::Platform>,
}

/// Runs `ferry trace`.
pub fn run(args: Args) -> Result<()> {
    match args.command {
        Command::Record(a) => record(a),
        Command::Show(a) => show(a),
    }
}

/// Where an image's manifest lives, for finding and publishing its trace.
enum Home {
    Layout {
        layout: OciLayout,
        subject: ferry_oci::Descriptor,
    },
    Registry {
        repo: Repo,
        subject: ferry_oci::Descriptor,
    },
}

impl Home {
    fn of(image: &str, client: &Client, runtime: &RangeRuntime) -> Result<Home> {
        let parsed = ImageRef::parse(image)?;
        Ok(match &parsed {
            ImageRef::Layout { dir, reference } => {
                let layout = OciLayout::open(dir)?;
                let (subject, _) = layout.image_manifest(reference.as_str())?;
                Home::Layout { layout, subject }
            }
            ImageRef::Registry {
                registry,
                repository,
                ..
            } => {
                let repo = Repo::new(registry.clone(), repository.clone());
                let (subject, _) =
                    ferry_fs::registry_manifest(client, &repo, parsed.reference(), runtime)?;
                Home::Registry { repo, subject }
            }
        })
    }

    fn subject(&self) -> &ferry_oci::Descriptor {
        match self {
            Home::Layout { subject, .. } | Home::Registry { subject, .. } => subject,
        }
    }
}

fn summary(trace: &Trace) -> String {
    format!(
        "{} files, {} reads, {} bytes",
        trace.files(),
        trace.reads.len(),
        trace.bytes()
    )
}

fn open_store(args: &RecordArgs) -> Result<Option<Arc<Store>>> {
    if args.no_store {
        return Ok(None);
    }
    let path = match &args.store {
        Some(p) => p.clone(),
        None => StoreConfig::default().resolve_path(),
    };
    match Store::open_with(&path, StoreOptions::default()) {
        Ok(s) => Ok(Some(Arc::new(s))),
        Err(ferry_store::Error::InUse { .. }) => bail!(
            "the chunk store at {} is in use by another process (the ferry daemon?); \
             pass --store DIR for another store or --no-store",
            path.display()
        ),
        Err(e) => Err(e).with_context(|| format!("opening the chunk store at {}", path.display())),
    }
}

fn record(mut args: RecordArgs) -> Result<()> {
    if !args.publish && args.output.is_none() {
        bail!("nothing to do with the trace: pass --output FILE and/or --publish");
    }
    let image = ImageRef::parse(&args.image)?;
    if let Some(platform) = args.platform.take() {
        let cfg = args.registry.client_config(&[&image]);
        args.image = super::platform_image(&args.image, &platform, cfg)?;
    }
    let client = args.registry.client(&[&image])?;
    let runtime = RangeRuntime::new()?;
    let store = open_store(&args)?;
    let source = ImageSource::open(&args.image, &client, &runtime)
        .with_context(|| format!("opening {}", args.image))?;
    let image = Arc::new(
        MountedImage::new(source, store, FetchConfig::default(), &View::Merged)
            .with_context(|| format!("preparing {}", args.image))?,
    );
    let dir = MountDir::create()?;
    let opts = MountOptions {
        threads: 4,
        // The command may switch to another user inside the image.
        allow_other: is_root(),
        fsname: format!("ferry-trace:{}", image.manifest_digest),
    };
    image.start_recording();
    let session = ferry_fs::mount(FerryFs::new(image.clone()), dir.path(), &opts)
        .with_context(|| format!("mounting {} at {}", args.image, dir.path().display()))?;
    let outcome = wait_mounted(dir.path()).and_then(|()| run_chrooted(dir.path(), &args));
    let trace = image.take_trace();
    drop(session);
    let status = outcome?;
    eprintln!("ferry: recorded {}", summary(&trace));
    if let Some(path) = &args.output {
        std::fs::write(path, trace.to_json()?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("ferry: trace written to {}", path.display());
    }
    if !status.success() {
        bail!("the command failed ({status}); the trace was not published");
    }
    if args.publish {
        if trace.reads.is_empty() {
            bail!("the command read no file data; nothing to publish");
        }
        let home = Home::of(&args.image, &client, &runtime)?;
        if home.subject().digest().to_string() != image.manifest_digest {
            bail!(
                "{} now names manifest {}, not the {} that was traced; not publishing",
                args.image,
                home.subject().digest(),
                image.manifest_digest
            );
        }
        match &home {
            Home::Layout { layout, subject } => {
                let desc = store_layout_trace(layout, subject, &trace)?;
                eprintln!("ferry: trace stored in the layout as {}", desc.digest());
            }
            Home::Registry { repo, subject } => {
                let digest = runtime
                    .handle()
                    .block_on(publish_registry_trace(&client, repo, subject, &trace))?;
                eprintln!("ferry: trace published as {repo}@{digest}");
            }
        }
    }
    Ok(())
}

/// A temporary, empty mount point, removed again on drop (after the unmount).
struct MountDir(PathBuf);

impl MountDir {
    fn create() -> Result<MountDir> {
        let base = std::env::temp_dir();
        for attempt in 0..100u32 {
            let path = base.join(format!("ferry-trace-{}-{attempt}", std::process::id()));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(MountDir(path)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(e).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
        bail!(
            "cannot create a temporary mount point in {}",
            base.display()
        )
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for MountDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

fn wait_mounted(mountpoint: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ferry_fs::is_mounted(mountpoint) {
        if Instant::now() > deadline {
            bail!("the mount at {} did not come up", mountpoint.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Runs the command chrooted into `root`; with `--duration`, kills it when the time is up
/// (and reports success: the startup was recorded).
fn run_chrooted(root: &Path, args: &RecordArgs) -> Result<std::process::ExitStatus> {
    let mut cmd = std::process::Command::new("chroot");
    cmd.arg(root).args(&args.command).current_dir("/");
    let mut child = cmd
        .spawn()
        .context("running the command with chroot (needs root and chroot(8))")?;
    let Some(secs) = args.duration else {
        return Ok(child.wait()?);
    };
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            child.kill().context("stopping the command")?;
            child.wait()?;
            eprintln!("ferry: stopped the command after {secs} s");
            return Ok(std::os::unix::process::ExitStatusExt::from_raw(0));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn show(mut args: ShowArgs) -> Result<()> {
    let image = ImageRef::parse(&args.image)?;
    if let Some(platform) = args.platform.take() {
        let cfg = args.registry.client_config(&[&image]);
        args.image = super::platform_image(&args.image, &platform, cfg)?;
    }
    let client = args.registry.client(&[&image])?;
    let runtime = RangeRuntime::new()?;
    let home = Home::of(&args.image, &client, &runtime)?;
    let trace = match &home {
        Home::Layout { layout, subject } => find_layout_trace(layout, subject)?,
        Home::Registry { repo, subject } => ferry_fs::trace::find_registry_trace(
            &client,
            repo,
            subject.digest().as_ref(),
            &runtime,
        )?,
    };
    let Some(trace) = trace else {
        bail!(
            "{} ({}) has no startup trace",
            args.image,
            home.subject().digest()
        );
    };
    let mut text = String::new();
    if args.json {
        text.push_str(&String::from_utf8_lossy(&trace.to_json()?));
        text.push('\n');
    } else {
        use std::fmt::Write as _;
        let _ = writeln!(text, "{} ({})", args.image, home.subject().digest());
        let _ = writeln!(text, "startup trace: {}", summary(&trace));
        let mut per_file: Vec<(&str, u64)> = Vec::new();
        let mut index: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for read in &trace.reads {
            let i = *index.entry(read.path.as_str()).or_insert_with(|| {
                per_file.push((read.path.as_str(), 0));
                per_file.len() - 1
            });
            per_file[i].1 += read.len;
        }
        for (path, bytes) in per_file {
            let _ = writeln!(text, "  {bytes:>12}  {path}");
        }
    }
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
