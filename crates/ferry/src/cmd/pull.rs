//! `ferry pull`: flags and environment into [`ferry_pull::PullOptions`], progress bars
//! (one per layer; log lines instead when stderr is not a terminal) and the summary. The
//! pull itself lives in `ferry_pull`; nothing about containerd or tar belongs here.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use ferry_pull::image::Descriptor;
use ferry_pull::unpack::UnpackLimits;
use ferry_pull::{LayerEvent, PullOptions, PullProgress};
use ferry_registry::client::{ClientConfig, Credentials, RegistryConfig};
use indicatif::{MultiProgress, ProgressBar};

/// Arguments of `ferry pull`.
#[derive(Debug, clap::Args)]
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
    /// The snapshotter's name in containerd.
    #[arg(long, default_value = "ferry")]
    snapshotter: String,
    /// Root directory of the running `ferry snapshotter` (layers are unpacked into its
    /// staging directory).
    #[arg(long, value_name = "DIR", default_value = ferry_snapshotter::server::DEFAULT_ROOT)]
    snapshotter_root: PathBuf,
    /// Concurrent Range requests across all layers.
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    /// Bytes per Range request (suffixes K, M, G).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    chunk_size: u64,
    /// Layers unpacked at once (default: the number of CPUs).
    #[arg(long)]
    unpack_concurrency: Option<usize>,
    /// Registry credentials, user:password.
    #[arg(long, value_name = "USER:PASS")]
    creds: Option<String>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a size"))?;
    let mult: u64 = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown unit {unit:?}")),
    };
    n.checked_mul(mult)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("{s:?} is zero or too large"))
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
        ..ClientConfig::default()
    };
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
        limits: UnpackLimits::default(),
    };
    let progress = Arc::new(Bars::new(std::io::stderr().is_terminal()));
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let report = runtime
        .block_on(ferry_pull::pull(&opts, progress.clone()))
        .with_context(|| format!("ferry pull {}", args.image))?;
    progress.finish();
    println!(
        "{}: {} layers ({} lazy, {} unpacked, {} already present), {} downloaded, {:.1}s",
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, ProgressBar)>> {
        self.layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
            let label = short(&layer.digest);
            let bar = match &self.multi {
                Some(multi) => {
                    let bar = crate::progress::bytes_bar(multi, &label, layer.size);
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
