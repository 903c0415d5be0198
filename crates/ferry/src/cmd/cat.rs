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
    let mut out = std::io::BufWriter::with_capacity(
        1 << 20,
        Watched {
            inner: stdout.lock(),
            closed: false,
        },
    );
    let copied = image.cat(&args.path, &mut out);
    let flushed = out.flush();
    if out.get_ref().closed {
        return Err(anyhow::Error::new(crate::out::StdoutClosed));
    }
    copied.with_context(|| format!("reading {} from {}", args.path, args.image))?;
    flushed.map_err(crate::out::stdout_error)?;
    if args.stats {
        eprintln!("compressed_bytes_read={}", total.load(Ordering::Relaxed));
    }
    Ok(())
}

/// Standard output that remembers whether its reader went away (the file's bytes and the
/// layer's reads fail alike with I/O errors; only this one ends `cat` quietly).
struct Watched<W> {
    inner: W,
    closed: bool,
}

impl<W: Write> Write for Watched<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf).inspect_err(|e| {
            self.closed |= e.kind() == std::io::ErrorKind::BrokenPipe;
        })
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush().inspect_err(|e| {
            self.closed |= e.kind() == std::io::ErrorKind::BrokenPipe;
        })
    }
}
