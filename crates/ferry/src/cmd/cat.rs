//! `ferry cat [--stats] IMAGE PATH`

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use ferry_index::image::open_layout_image;
use ferry_index::source::{CountingSource, RangeSource};

use super::layout_ref;

/// Arguments of `ferry cat`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print `compressed_bytes_read=N` on stderr afterwards.
    #[arg(long)]
    pub stats: bool,
    /// The image, `oci:DIR[:TAG]`.
    pub image: String,
    /// Path inside the image's root filesystem (symlinks are followed).
    pub path: String,
    /// The platform to read from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    pub platform: Option<ferry_oci::Platform>,
}

/// Returns a wrapper that counts the bytes every wrapped source serves into `total`.
pub fn counter(total: Arc<AtomicU64>) -> impl Fn(Arc<dyn RangeSource>) -> Arc<dyn RangeSource> {
    move |inner| {
        Arc::new(CountingSource::shared(inner, total.clone(), Arc::default()))
            as Arc<dyn RangeSource>
    }
}

pub fn run(args: Args) -> Result<()> {
    let (layout, reference, _) = layout_ref(&args.image)?;
    let reference = super::layout_platform_ref(&layout, reference, args.platform.as_ref())?;
    let total = Arc::new(AtomicU64::new(0));
    let (image, _) = open_layout_image(&layout, &reference, &counter(total.clone()))
        .with_context(|| format!("opening {}", args.image))?;
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
