//! `ferry pack DIR oci:DST:TAG`

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ferry_index::image::store_layout_artifact;
use ferry_index::pack::{PackOptions, pack_dir};
use ferry_oci::layout::{descriptor, digest};
use ferry_oci::media::LAYER_TAR_GZIP;

use super::{human, output_layout, write_image};
use crate::out::outln;
use crate::progress;

/// Arguments of `ferry pack`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The directory to pack (becomes the layer's root).
    pub dir: PathBuf,
    /// Destination image, `oci:DIR:TAG` (the layout is created if missing).
    pub dest: String,
    /// Uncompressed bytes per independently compressed gzip member (= index span).
    #[arg(long, default_value_t = ferry_index::pack::DEFAULT_SPAN)]
    pub span: u64,
    /// gzip level, 1 (fast) to 9 (small).
    #[arg(long, default_value_t = PackOptions::default().level)]
    pub level: u32,
    /// Compression threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(args: Args) -> Result<()> {
    if !args.dir.is_dir() {
        bail!("{} is not a directory", args.dir.display());
    }
    let (layout, tag) = output_layout(&args.dest)?;
    let multi = progress::multi();
    let total = dir_size(&args.dir);
    let bar = progress::bytes_bar(&multi, "packing", total);
    let opts = PackOptions {
        span: args.span,
        level: args.level,
        threads: args.threads,
    };
    let start = std::time::Instant::now();
    let mut blob = layout.blob_writer()?;
    let out = pack_dir(&args.dir, &mut blob, &opts, &|n| bar.set_position(n))
        .with_context(|| format!("packing {}", args.dir.display()))?;
    let (layer_digest, size) = blob.commit()?;
    bar.finish_and_clear();
    if layer_digest.to_string() != out.digest {
        bail!(
            "internal error: packed blob digest {layer_digest} differs from the packer's {}",
            out.digest
        );
    }
    let layer = descriptor(LAYER_TAR_GZIP, digest(&out.digest)?, size, &[]);
    let manifest = write_image(
        &layout,
        &tag,
        vec![(layer.clone(), out.diff_id.clone())],
        None,
    )?;
    store_layout_artifact(&layout, &manifest, &[(layer, out.index.clone())])?;
    let secs = start.elapsed().as_secs_f64();
    outln!(
        "packed {} ({} files, {} uncompressed) into {} layer {} in {:.2}s ({}/s); index {} spans",
        args.dir.display(),
        out.index.entries.len(),
        human(out.index.uncompressed_size),
        human(size),
        out.digest,
        secs,
        human((out.index.uncompressed_size as f64 / secs.max(1e-9)) as u64),
        out.index.checkpoints.len()
    );
    outln!("image {} manifest {}", args.dest, manifest.digest());
    Ok(())
}

/// Sum of regular file sizes under `dir` (for the progress bar; errors count as 0).
fn dir_size(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}
