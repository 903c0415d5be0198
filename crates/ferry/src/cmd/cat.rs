//! `ferry cat [--stats] IMAGE PATH`

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use ferry_index::source::{CountingSource, RangeSource};

/// Arguments of `ferry cat`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print `compressed_bytes_read=N` on stderr afterwards.
    #[arg(long)]
    pub stats: bool,
    /// The image: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]` (read lazily with
    /// HTTP Range requests, as a mount reads it).
    pub image: String,
    /// Path inside the image's root filesystem (symlinks are followed).
    pub path: String,
    /// The platform to read from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    pub platform: Option<ferry_oci::Platform>,
    #[command(flatten)]
    pub registry: super::remote::RegistryArgs,
}

/// Returns a wrapper that counts the bytes every wrapped source serves into `total`.
pub fn counter(total: Arc<AtomicU64>) -> impl Fn(Arc<dyn RangeSource>) -> Arc<dyn RangeSource> {
    move |inner| {
        Arc::new(CountingSource::shared(inner, total.clone(), Arc::default()))
            as Arc<dyn RangeSource>
    }
}

pub fn run(args: Args) -> Result<()> {
    let total = Arc::new(AtomicU64::new(0));
    let (image, _, _) = super::open_image(
        &args.image,
        &args.registry,
        args.platform.as_ref(),
        &counter(total.clone()),
    )?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
    image
        .cat(&args.path, &mut out)
        .with_context(|| format!("reading {} from {}", args.path, args.image))?;
    out.flush()?;
    if args.stats {
        eprintln!("compressed_bytes_read={}", total.load(Ordering::Relaxed));
    }
    Ok(())
}
