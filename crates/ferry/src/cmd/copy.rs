//! `ferry copy SRC DST`: copies an image (a manifest or a whole multi-arch index) with its
//! ferry index artifacts between OCI layouts and registries. The work is in
//! `ferry_registry_client::copy`; this file owns flags, progress bars and messages.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use ferry_oci::ImageRef;
use ferry_oci::media::FERRY_INDEX_ARTIFACT;
use ferry_registry_client::copy::BlobOutcome;
use ferry_registry_client::{
    Client, ClientConfig, ClientError, CopyOptions, CopyProgress, Credentials, ImageLocation,
    copy_image,
};
use indicatif::{MultiProgress, ProgressBar};

use super::human;
use crate::out::outln;
use crate::progress;

/// Copy an image between `oci:DIR[:TAG]` layouts and `HOST[:PORT]/REPO[:TAG|@DIGEST]`
/// registries, with its ferry index artifacts (referrers).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Source image.
    pub src: String,
    /// Destination image.
    pub dst: String,
    /// Speak plain HTTP to the registries named (loopback registries without TLS are
    /// detected without this flag).
    #[arg(long)]
    pub plain_http: bool,
    /// Accept any TLS certificate from the registries named (testing only).
    #[arg(long)]
    pub skip_tls_verify: bool,
    /// Username for the registries named (with --password).
    #[arg(long, requires = "password")]
    pub username: Option<String>,
    /// Password or token for --username.
    #[arg(
        long,
        requires = "username",
        env = "FERRY_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<String>,
    /// USER:PASSWORD for the registries named (instead of --username/--password).
    #[arg(long, conflicts_with_all = ["username", "password"])]
    pub creds: Option<String>,
    /// Blobs copied at once (and parallel range requests per blob download).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Bytes per chunk for chunked pushes and parallel downloads (suffixes K, M, G).
    #[arg(long, default_value = "16M", value_parser = ferry_oci::units::parse_nonzero_size)]
    pub chunk_size: u64,
    /// Client settings as TOML (the `[client]` table's fields: timeouts, retries, and
    /// `[registry."host"]` tables with mirrors, plain_http, credentials).
    #[arg(long)]
    pub client_config: Option<std::path::PathBuf>,
    /// Copy referrers of this artifact type too (repeatable; default: ferry's index).
    #[arg(long = "referrer-type")]
    pub referrer_types: Vec<String>,
    /// Do not copy any referrers.
    #[arg(long, conflicts_with = "referrer_types")]
    pub no_referrers: bool,
}

/// Progress bars per blob, created when a blob starts streaming.
struct Bars {
    multi: MultiProgress,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

impl CopyProgress for Bars {
    fn blob_started(&self, digest: &str, size: u64) {
        let bar = progress::bytes_bar(&self.multi, &super::index::short(digest), size);
        if let Ok(mut bars) = self.bars.lock() {
            bars.insert(digest.to_string(), bar);
        }
    }
    fn blob_bytes(&self, digest: &str, bytes: u64) {
        if let Ok(bars) = self.bars.lock()
            && let Some(b) = bars.get(digest)
        {
            b.inc(bytes);
        }
    }
    fn blob_finished(&self, digest: &str, outcome: BlobOutcome) {
        if let Ok(mut bars) = self.bars.lock()
            && let Some(b) = bars.remove(digest)
        {
            b.finish_and_clear();
        }
        if outcome != BlobOutcome::Copied {
            tracing::debug!(digest, ?outcome, "blob not copied");
        }
    }
}

fn registries(refs: &[&ImageRef]) -> Vec<String> {
    refs.iter()
        .filter_map(|r| match r {
            ImageRef::Registry { registry, .. } => Some(registry.clone()),
            ImageRef::Layout { .. } => None,
        })
        .collect()
}

fn client_config(args: &Args, src: &ImageRef, dst: &ImageRef) -> Result<ClientConfig> {
    let mut cfg = match &args.client_config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
        }
        None => ClientConfig::default(),
    };
    if args.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    cfg.max_concurrent_downloads = args.concurrency;
    cfg.chunk_size = args.chunk_size;
    let creds = match (&args.creds, &args.username, &args.password) {
        (Some(c), _, _) => {
            let (u, p) = c.split_once(':').context("--creds must be USER:PASSWORD")?;
            Some(Credentials {
                username: u.to_string(),
                password: p.to_string(),
            })
        }
        (None, Some(u), Some(p)) => Some(Credentials {
            username: u.clone(),
            password: p.clone(),
        }),
        _ => None,
    };
    for registry in registries(&[src, dst]) {
        let entry = cfg.registry.entry(registry).or_default();
        entry.plain_http |= args.plain_http;
        entry.skip_tls_verify |= args.skip_tls_verify;
        if creds.is_some() {
            entry.credentials = creds.clone();
        }
    }
    Ok(cfg)
}

fn hint(e: &ClientError) -> &'static str {
    match e {
        ClientError::Unauthorized { .. } => "",
        ClientError::Denied { .. } => {
            "\nhint: the credentials work but lack access; check the account's permissions on that repository"
        }
        ClientError::NotFound { .. } => {
            "\nhint: check the name and tag (`skopeo list-tags docker://REPO` lists tags)"
        }
        ClientError::Transport { .. } => {
            "\nhint: is the registry running and reachable? For a registry without TLS pass --plain-http"
        }
        _ => "",
    }
}

pub fn run(args: Args) -> Result<()> {
    let src_ref = ImageRef::parse(&args.src)?;
    let dst_ref = ImageRef::parse(&args.dst)?;
    let cfg = client_config(&args, &src_ref, &dst_ref)?;
    let client = Client::new(cfg)?;
    let src = ImageLocation::from_ref(&src_ref, &client, false)
        .with_context(|| format!("opening {}", args.src))?;
    // A layout directory this command creates is removed again if the copy fails.
    let created_dir = match &dst_ref {
        ImageRef::Layout { dir, .. } if !dir.exists() => Some(dir.clone()),
        _ => None,
    };
    let dst = ImageLocation::from_ref(&dst_ref, &client, true)
        .with_context(|| format!("opening {}", args.dst))?;
    let opts = CopyOptions {
        concurrency: args.concurrency,
        referrer_types: if args.no_referrers {
            Vec::new()
        } else if args.referrer_types.is_empty() {
            vec![FERRY_INDEX_ARTIFACT.to_string()]
        } else {
            args.referrer_types.clone()
        },
    };
    let bars = Arc::new(Bars {
        multi: progress::multi(),
        bars: Mutex::new(HashMap::new()),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let result = runtime.block_on(copy_image(&src, &dst, &opts, bars.clone()));
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            if let Some(dir) = created_dir {
                let _ = std::fs::remove_dir_all(dir);
            }
            bail!("copying {} to {}: {e}{}", args.src, args.dst, hint(&e));
        }
    };
    outln!(
        "copied {} ({}): {} blobs ({}) copied, {} already there, {} mounted; {} manifests, {} referrers",
        report.digest,
        report.media_type,
        report.blobs_copied,
        human(report.bytes_copied),
        report.blobs_skipped,
        report.blobs_mounted,
        report.manifests,
        report.referrers
    );
    Ok(())
}
