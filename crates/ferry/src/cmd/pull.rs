//! `ferry pull`: flags and environment into [`ferry_pull::PullOptions`], progress bars
//! (one per layer; log lines instead when stderr is not a terminal) and the summary. The
//! pull itself lives in `ferry_pull`; nothing about containerd or tar belongs here.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use crate::out::outln;
use anyhow::{Context, Result, bail};
use ferry_pull::image::Descriptor;
use ferry_pull::unpack::UnpackLimits;
use ferry_pull::{LayerEvent, MetadataSource, PullOptions, PullProgress};
use ferry_registry_client::{ClientConfig, Credentials, RegistryConfig};
use ferry_store::StoreMetadata;
use indicatif::{MultiProgress, ProgressBar};
use parking_lot::Mutex;

/// How the layers that cannot be lazy are pulled, for `ferry pull --help`.
const AFTER_HELP: &str = "\
Layers the snapshotter cannot mount lazily are downloaded and unpacked at the same time:
each layer's blob is fetched as --chunk-size Range requests (at most --concurrency in
flight across all layers), and the unpacker consumes the bytes in order while later
pieces are still arriving. --unpack-concurrency layers stream at once, largest first.
At most --max-buffer bytes of layer data are held in memory; when the unpackers fall
behind, downloading waits. Each layer's digest and diff id are checked at the end; a
mismatch removes what was unpacked and fails the pull.

For a multi-platform image the index becomes the image record's target (as with
`ctr image pull`), and the manifest for this machine's platform (or --platform's) is
pulled, chosen by containerd's rules: os and architecture must match; the variant must
too, except that an older arm or amd64 variant runs on a newer CPU (arm64 means arm64/v8).";

/// Arguments of `ferry pull`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// Image to pull: HOST[:PORT]/REPO[:TAG|@DIGEST].
    image: String,
    /// containerd's socket (default: $CONTAINERD_ADDRESS, else /run/containerd/containerd.sock).
    #[arg(
        long,
        env = "CONTAINERD_ADDRESS",
        default_value = "/run/containerd/containerd.sock"
    )]
    address: PathBuf,
    /// containerd namespace (default: $CONTAINERD_NAMESPACE, else `default`).
    #[arg(long, env = "CONTAINERD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Talk plain HTTP to the registry.
    #[arg(long)]
    plain_http: bool,
    /// containerd's registry host directory (`<DIR>/<host[:port]>/hosts.toml`: mirrors,
    /// `server`, certificates), as containerd's `config_path`; "" turns it off.
    #[arg(long, value_name = "DIR", env = "FERRY_REGISTRY_CONFIG_PATH", default_value = ferry_registry_client::hosts::DEFAULT_CONFIG_PATH)]
    registry_config_path: PathBuf,
    #[command(flatten)]
    credential_providers: super::CredentialProviderArgs,
    /// The snapshotter's name in containerd.
    #[arg(long, default_value = "ferry")]
    snapshotter: String,
    /// Root directory of the running `ferry snapshotter` (layers are unpacked into its
    /// staging directory).
    #[arg(long, value_name = "DIR", default_value = ferry_snapshotter::server::DEFAULT_ROOT)]
    snapshotter_root: PathBuf,
    /// Download concurrency: Range requests in flight across all layers.
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    /// Bytes per Range request (suffixes K, M, G; at most 1G).
    #[arg(long, default_value = "16M", value_parser = ferry_oci::units::parse_nonzero_size)]
    chunk_size: u64,
    /// Unpack concurrency: layers downloaded-and-unpacked at once (default: the number of
    /// CPUs).
    #[arg(long)]
    unpack_concurrency: Option<usize>,
    /// Most layer bytes held in memory at once, across layers (suffixes K, M, G; at least
    /// --chunk-size).
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = ferry_oci::units::parse_nonzero_size)]
    max_buffer: u64,
    /// Registry credentials, user:password.
    #[arg(long, value_name = "USER:PASS")]
    creds: Option<String>,
    /// The platform to pull from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    platform: Option<ferry_oci::Platform>,
    /// The node daemon's config file: its store (`[store] path`, `seed`) holds image
    /// metadata a pull uses without the registry (default: the daemon's default store).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The node's store directory, instead of the config's.
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Never use the node's store: manifest and config come from the registry.
    #[arg(long)]
    no_store: bool,
}

/// Runs `ferry pull`.
pub fn run(args: Args) -> Result<()> {
    let host = match ferry_oci::ImageRef::parse(&args.image) {
        Ok(ferry_oci::ImageRef::Registry { registry, .. }) => registry,
        Ok(_) => bail!("ferry pull takes a registry reference, not {}", args.image),
        Err(e) => return Err(e).context("image reference"),
    };
    let mut registry = ClientConfig {
        max_concurrent_downloads: args.concurrency.max(1),
        chunk_size: args.chunk_size,
        config_path: super::registry_config_path(&args.registry_config_path),
        ..ClientConfig::default()
    };
    args.credential_providers.apply(&mut registry);
    let credentials = match &args.creds {
        Some(c) => {
            let (username, password) =
                c.split_once(':').context("--creds must be user:password")?;
            Some(Credentials {
                username: username.to_owned(),
                password: password.to_owned(),
            })
        }
        None => None,
    };
    if args.plain_http || credentials.is_some() {
        registry.registry.insert(
            host,
            RegistryConfig {
                plain_http: args.plain_http,
                credentials,
                ..RegistryConfig::default()
            },
        );
    }
    let store = node_store(&args)?;
    let opts = PullOptions {
        image: args.image.clone(),
        address: args.address,
        namespace: args.namespace,
        snapshotter: args.snapshotter,
        snapshotter_root: args.snapshotter_root,
        registry,
        concurrency: args.concurrency,
        chunk_size: args.chunk_size,
        unpack_concurrency: args
            .unpack_concurrency
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
        max_buffer: args.max_buffer,
        limits: UnpackLimits::default(),
        platform: args.platform.unwrap_or_else(ferry_oci::Platform::host),
        store,
    };
    let progress = Arc::new(Bars::new(std::io::stderr().is_terminal()));
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let report = runtime
        .block_on(ferry_pull::pull(&opts, progress.clone()))
        .with_context(|| format!("ferry pull {}", args.image))?;
    progress.finish();
    if report.target_digest != report.manifest_digest {
        eprintln!(
            "{}: index {} (the image record's target)",
            report.name, report.target_digest
        );
    }
    let buffered = if report.unpacked > 0 {
        format!(
            " (at most {} buffered)",
            indicatif::HumanBytes(report.peak_buffered)
        )
    } else {
        String::new()
    };
    if let MetadataSource::Store { origin, tag_record } = &report.metadata {
        if let Some((record, why)) = tag_record {
            eprintln!(
                "ferry pull: warning: the registry could not be reached ({why}); tag resolved from \
                 the node's {origin} record of {record} to {} (tags are mutable: the registry \
                 may name another image now)",
                report.manifest_digest
            );
        }
        if report.without_registry() {
            outln!(
                "{}: from the node's {origin}: manifest, config, indexes and layers local, no registry traffic",
                report.name
            );
        } else {
            outln!(
                "{}: manifest and config from the node's {origin}; {} layers came from the registry",
                report.name,
                report.unpacked
            );
        }
    }
    outln!(
        "{}: {} layers ({} lazy, {} unpacked, {} already present), {} downloaded{buffered}, {:.1}s",
        report.name,
        report.layers,
        report.lazy,
        report.unpacked,
        report.present,
        indicatif::HumanBytes(report.bytes_downloaded),
        report.elapsed.as_secs_f64()
    );
    Ok(())
}

/// The node store's metadata (its seed included), as the daemon's config names the store;
/// read without opening the store, so a running daemon does not stand in the way.
fn node_store(args: &Args) -> Result<Option<StoreMetadata>> {
    if args.no_store {
        return Ok(None);
    }
    let mut config = super::daemon::load_config(args.config.as_deref())?;
    if args.store.is_some() {
        config.store_path_flag = args.store.clone();
    }
    let root = config.store_path();
    let meta = StoreMetadata::open(&root, config.store.seed.as_deref()).with_context(|| {
        format!(
            "reading the node store's image records ({})",
            root.display()
        )
    })?;
    Ok(Some(meta))
}

/// One bar per layer on a terminal; otherwise one log line per state change.
struct Bars {
    multi: Option<MultiProgress>,
    layers: Mutex<Vec<(String, ProgressBar)>>,
}

impl Bars {
    fn new(terminal: bool) -> Bars {
        Bars {
            multi: terminal.then(crate::progress::multi),
            layers: Mutex::new(Vec::new()),
        }
    }

    fn finish(&self) {
        for (_, bar) in self.lock().iter() {
            bar.finish();
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Vec<(String, ProgressBar)>> {
        self.layers.lock()
    }
}

fn short(digest: &str) -> String {
    digest
        .trim_start_matches("sha256:")
        .chars()
        .take(12)
        .collect()
}

impl PullProgress for Bars {
    fn resolved(&self, name: &str, manifest_digest: &str, layers: &[Descriptor]) {
        eprintln!(
            "{name}: manifest {manifest_digest}, {} layers",
            layers.len()
        );
        let mut bars = self.lock();
        for layer in layers {
            let label = short(layer.digest().as_ref());
            let bar = match &self.multi {
                Some(multi) => {
                    let bar = crate::progress::bytes_bar(multi, &label, layer.size());
                    bar.set_message(format!("{label} resolved"));
                    bar
                }
                None => ProgressBar::hidden(),
            };
            bars.push((label, bar));
        }
    }

    fn layer(&self, index: usize, event: LayerEvent) {
        let bars = self.lock();
        let Some((label, bar)) = bars.get(index) else {
            return;
        };
        let state = match &event {
            LayerEvent::Present => "present",
            LayerEvent::Lazy => "lazy",
            LayerEvent::Downloading { .. } => "downloading",
            // Unpacking follows the download as it lands.
            LayerEvent::Unpacking if self.multi.is_some() => "downloading + unpacking",
            LayerEvent::Downloaded { bytes } => {
                bar.inc(*bytes);
                return;
            }
            LayerEvent::Unpacking => "unpacking",
            LayerEvent::Unpacked { .. } => "unpacked",
            LayerEvent::Done => "done",
        };
        if self.multi.is_some() {
            bar.set_message(format!("{label} {state}"));
            if matches!(
                event,
                LayerEvent::Present | LayerEvent::Lazy | LayerEvent::Done
            ) {
                bar.set_position(bar.length().unwrap_or(0));
                bar.finish();
            }
        } else {
            eprintln!("layer {index} {label}: {state}");
        }
    }
}
