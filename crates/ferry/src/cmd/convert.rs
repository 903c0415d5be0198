//! `ferry convert --estargz SRC DST`

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ferry_index::estargz::{EstargzOptions, convert};
use ferry_oci::layout::{descriptor, digest};
use ferry_oci::media::{
    ANNOTATION_ESTARGZ_TOC, ANNOTATION_ESTARGZ_USIZE, LAYER_TAR_GZIP, LayerCompression,
    layer_compression,
};
use ferry_oci::{Descriptor, OciLayout};

use super::{human, index::short, layout_platform_ref, layout_ref, output_layout, write_image};
use crate::progress;

/// Arguments of `ferry convert`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Convert to eStargz (the only target format so far).
    #[arg(long, required = true)]
    pub estargz: bool,
    /// Source image, `oci:DIR[:TAG]`.
    pub src: String,
    /// Destination image, `oci:DIR:TAG` (may be the same layout with another tag).
    pub dst: String,
    /// File listing paths (one per line, as in the image) to put first, behind a
    /// `.prefetch.landmark`, in that order.
    #[arg(long)]
    pub priority: Option<PathBuf>,
    /// Chunk size for large files.
    #[arg(long, default_value_t = EstargzOptions::default().chunk_size)]
    pub chunk_size: u64,
    /// gzip level.
    #[arg(long, default_value_t = EstargzOptions::default().level)]
    pub level: u32,
    /// The platform to convert from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    pub platform: Option<ferry_oci::Platform>,
}

/// Opens a layer blob as its uncompressed tar stream.
pub fn open_layer_tar(layout: &OciLayout, layer: &Descriptor) -> Result<Box<dyn Read + Send>> {
    let path = layout.blob_path(layer.digest())?;
    let file = BufReader::with_capacity(
        1 << 20,
        File::open(&path).with_context(|| format!("opening {}", path.display()))?,
    );
    let media = layer.media_type().to_string();
    Ok(match layer_compression(&media) {
        Some(LayerCompression::Gzip) => Box::new(flate2::read::MultiGzDecoder::new(file)),
        Some(LayerCompression::Zstd) => Box::new(zstd::stream::read::Decoder::with_buffer(file)?),
        Some(LayerCompression::None) => Box::new(file),
        None => bail!(
            "layer {} has media type {media}, which is not a tar layer",
            layer.digest()
        ),
    })
}

pub fn run(args: Args) -> Result<()> {
    let (src, reference, _) = layout_ref(&args.src)?;
    let reference = layout_platform_ref(&src, reference, args.platform.as_ref())?;
    let (dst, tag) = output_layout(&args.dst)?;
    let (_, manifest) = src.image_manifest(&reference)?;
    let priority: Vec<String> = match &args.priority {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading priority list {}", p.display()))?
            .lines()
            .map(|l| l.trim().trim_start_matches('/').to_string())
            .filter(|l| !l.is_empty())
            .collect(),
        None => Vec::new(),
    };
    let opts = EstargzOptions {
        chunk_size: args.chunk_size,
        level: args.level,
        priority,
    };
    let config: serde_json::Value = serde_json::from_slice(
        &src.read_blob(manifest.config().digest(), ferry_oci::MAX_MANIFEST_BYTES)?,
    )
    .context("source image config is not JSON")?;
    let multi = progress::multi();
    let start = std::time::Instant::now();
    let mut layers = Vec::new();
    let (mut in_total, mut out_total) = (0u64, 0u64);
    for layer in manifest.layers() {
        let bar = progress::bytes_bar(&multi, &short(layer.digest().as_ref()), layer.size());
        let mut open = || -> ferry_index::Result<Box<dyn Read + Send>> {
            bar.set_position(0);
            let r = open_layer_tar(&src, layer)
                .map_err(|e| ferry_index::Error::Io(std::io::Error::other(format!("{e:#}"))))?;
            Ok(Box::new(bar.wrap_read(r)) as Box<dyn Read + Send>)
        };
        let mut blob = dst.blob_writer()?;
        let out = convert(&mut open, &mut blob, &opts)
            .with_context(|| format!("converting layer {}", layer.digest()))?;
        let (d, size) = blob.commit()?;
        bar.finish_and_clear();
        if d.to_string() != out.digest {
            bail!(
                "internal error: eStargz blob digest {d} differs from the writer's {}",
                out.digest
            );
        }
        in_total += layer.size();
        out_total += size;
        let desc = descriptor(
            LAYER_TAR_GZIP,
            digest(&out.digest)?,
            size,
            &[
                (ANNOTATION_ESTARGZ_TOC, out.toc_digest.clone()),
                (ANNOTATION_ESTARGZ_USIZE, out.uncompressed_size.to_string()),
            ],
        );
        layers.push((desc, out.diff_id));
    }
    let m = write_image(&dst, &tag, layers, Some(config))?;
    println!(
        "converted {} layers ({} -> {}) to eStargz in {:.2}s: {} manifest {}",
        manifest.layers().len(),
        human(in_total),
        human(out_total),
        start.elapsed().as_secs_f64(),
        args.dst,
        m.digest()
    );
    Ok(())
}
