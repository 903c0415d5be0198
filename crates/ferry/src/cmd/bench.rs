//! `ferry bench …` — measurements that the scripts under `bench/` drive. `read` is local
//! (lazy reads through the index); `registry` is the registry load tester, whose engine
//! lives in `ferry_loadtest` (this file only maps flags onto it); `proxy` is
//! the latency-injecting TCP relay the cold-start benchmark puts before a registry.

mod proxy;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_index::entry::EntryKind;
use ferry_index::image::open_layout_image;
use ferry_loadtest::{self as loadtest, Credentials, LayerMode, LoadTestConfig};
use ferry_oci::ImageRef;

use super::{cat::counter, layout_ref};

/// Benchmarks.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

/// Which benchmark.
#[derive(Debug, clap::Subcommand)]
pub enum What {
    /// Random reads of files through the image's indexes: latency percentiles and
    /// compressed bytes fetched per read, from local blobs.
    Read(ReadArgs),
    /// Replay a fleet's node starts against a registry (token, manifest, config, layer
    /// requests) at a given concurrency: LPM (layer requests per minute), requests/s and
    /// latency percentiles per request kind, errors by kind and status.
    Registry(RegistryArgs),
    /// Relay TCP between two loopback addresses with a fixed one-way delay on every
    /// chunk (a registry "N ms away" without netem), counting the bytes each way.
    Proxy(proxy::ProxyArgs),
}

/// Arguments of `ferry bench registry`.
#[derive(Debug, clap::Args)]
pub struct RegistryArgs {
    /// The image whose start to replay, `HOST[:PORT]/REPO[:TAG|@DIGEST]` (plain HTTP).
    pub image: String,
    /// Virtual nodes, each with its own keep-alive connection (at most 10,000).
    #[arg(long, default_value_t = 256)]
    pub connections: usize,
    /// Measured duration (`30s`, `2m`; at most 1h).
    #[arg(long, default_value = "30s", value_parser = ferry_oci::units::parse_duration)]
    pub duration: Duration,
    /// Load before measuring, so connections and tokens are warm.
    #[arg(long, default_value = "5s", value_parser = ferry_oci::units::parse_duration)]
    pub warmup: Duration,
    /// How layers are requested: `get` (one GET of `--range` bytes), `head`, or
    /// `redirect` (GET following 3xx, e.g. to presigned object-store URLs).
    #[arg(long, default_value = "get")]
    pub layer_mode: LayerMode,
    /// Bytes asked of each layer GET (`Range: bytes=0-N-1`); 0 = whole blobs.
    #[arg(long, default_value_t = 4096)]
    pub range: u64,
    /// `USER:PASSWORD` (Basic, or for bearer tokens, as the registry's challenge asks).
    #[arg(long, env = "FERRY_BENCH_CREDS", hide_env_values = true)]
    pub creds: Option<Credentials>,
    /// Another host that token realms or redirects may name (repeatable); the registry
    /// and loopback are always allowed, nothing else is contacted.
    #[arg(long = "allow-host")]
    pub allow_hosts: Vec<String>,
    /// Time limit of one request, body included.
    #[arg(long, default_value = "10s", value_parser = ferry_oci::units::parse_duration)]
    pub timeout: Duration,
    /// `OS/ARCH` picked when the tag names an index (default: this machine's).
    #[arg(long)]
    pub platform: Option<String>,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `ferry bench read`.
#[derive(Debug, clap::Args)]
pub struct ReadArgs {
    /// The image, `oci:DIR[:TAG]`.
    pub image: String,
    /// Number of reads.
    #[arg(long, default_value_t = 1000)]
    pub samples: usize,
    /// Bytes per read.
    #[arg(long, default_value_t = 4096)]
    pub size: usize,
    /// Seed for the choice of files and offsets.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::Read(a) => read(a),
        What::Registry(a) => registry(a),
        What::Proxy(a) => proxy::run(a),
    }
}

fn registry(args: RegistryArgs) -> Result<()> {
    let image = ImageRef::parse(&args.image)?;
    let ImageRef::Registry {
        registry,
        repository,
        ..
    } = &image
    else {
        bail!(
            "{} is an OCI layout; ferry bench registry needs HOST[:PORT]/REPO[:TAG]",
            args.image
        );
    };
    let cfg = LoadTestConfig {
        registry: registry.clone(),
        repository: repository.to_string(),
        reference: image.reference().to_string(),
        connections: args.connections,
        duration: args.duration,
        warmup: args.warmup,
        layer_mode: args.layer_mode,
        range_bytes: (args.range > 0).then_some(args.range),
        credentials: args.creds,
        allowed_hosts: args.allow_hosts,
        request_timeout: args.timeout,
        platform: args.platform.unwrap_or_else(loadtest::default_platform),
    };
    cfg.validate()?;
    let threads = match args.threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) => n.min(1024),
        None => std::thread::available_parallelism().map_or(2, |n| n.get()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let report = runtime
        .block_on(loadtest::run(&cfg))
        .with_context(|| format!("benchmarking {}", args.image))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}

fn read(args: ReadArgs) -> Result<()> {
    let (layout, reference, _) = layout_ref(&args.image)?;
    let total = Arc::new(AtomicU64::new(0));
    let (image, layers) = open_layout_image(&layout, &reference, &counter(total.clone()))
        .with_context(|| format!("opening {}", args.image))?;
    // Files that a read can land in, weighted by size so every byte is equally likely.
    let mut files = Vec::new();
    let mut weight = 0u64;
    for (li, layer) in image.layers().iter().enumerate() {
        for (ei, e) in layer.entries().iter().enumerate() {
            if e.kind == EntryKind::File && e.size > 0 {
                weight += e.size;
                files.push((weight, li, ei, e.size));
            }
        }
    }
    if files.is_empty() {
        bail!("{} has no regular files", args.image);
    }
    let mut rng = args.seed.max(1);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut lat = Vec::with_capacity(args.samples);
    let mut bytes = Vec::with_capacity(args.samples);
    let mut buf = vec![0u8; args.size];
    for _ in 0..args.samples {
        let pick = next() % weight;
        let i = files.partition_point(|f| f.0 <= pick);
        let (_, li, ei, size) = files[i.min(files.len() - 1)];
        let off = next() % size;
        let before = total.load(Ordering::Relaxed);
        let t = Instant::now();
        image.layers()[li].read_at(ei, off, &mut buf)?;
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        bytes.push(total.load(Ordering::Relaxed) - before);
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    bytes.sort_unstable();
    let pct = |v: &[f64], p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    let pctb = |v: &[u64], p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    let mean_bytes = bytes.iter().sum::<u64>() as f64 / bytes.len() as f64;
    let layer_bytes: u64 = layers.iter().map(|l| l.descriptor.size()).sum();
    let formats: Vec<&str> = layers.iter().map(|l| l.format.as_str()).collect();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "samples": args.samples, "size": args.size, "formats": formats,
                "p50_ms": pct(&lat, 0.5), "p99_ms": pct(&lat, 0.99), "max_ms": pct(&lat, 1.0),
                "bytes_p50": pctb(&bytes, 0.5), "bytes_p99": pctb(&bytes, 0.99), "bytes_max": pctb(&bytes, 1.0),
                "bytes_mean": mean_bytes, "layer_bytes": layer_bytes,
            })
        );
    } else {
        println!(
            "{} random {}-byte reads over {} files ({:?}): latency p50 {:.2} ms p99 {:.2} ms max {:.2} ms; compressed bytes per read p50 {} p99 {} max {} mean {:.0}",
            args.samples,
            args.size,
            files.len(),
            formats,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            pct(&lat, 1.0),
            pctb(&bytes, 0.5),
            pctb(&bytes, 0.99),
            pctb(&bytes, 1.0),
            mean_bytes
        );
    }
    Ok(())
}
