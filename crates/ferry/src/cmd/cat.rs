//! `ferry cat [--stats] IMAGE PATH`

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use ferry_index::image::open_layout_image;
use ferry_index::source::RangeSource;

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
}

/// Counts bytes served by every layer source of an image.
pub struct Counted {
    inner: Arc<dyn RangeSource>,
    total: Arc<AtomicU64>,
}

impl RangeSource for Counted {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_range(&self, range: std::ops::Range<u64>) -> std::io::Result<Vec<u8>> {
        let out = self.inner.read_range(range)?;
        self.total.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }
}

impl std::fmt::Debug for Counted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Counted({} bytes)", self.inner.len())
    }
}

/// Returns a wrapper that counts into `total`.
pub fn counter(total: Arc<AtomicU64>) -> impl Fn(Arc<dyn RangeSource>) -> Arc<dyn RangeSource> {
    move |inner| {
        Arc::new(Counted {
            inner,
            total: total.clone(),
        }) as Arc<dyn RangeSource>
    }
}

pub fn run(args: Args) -> Result<()> {
    let (layout, reference, _) = layout_ref(&args.image)?;
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
