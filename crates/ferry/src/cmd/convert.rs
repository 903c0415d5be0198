//! `ferry convert --estargz|--zstd-chunked SRC DST`: SRC and DST each an OCI layout or a
//! registry image. A registry source's layers are streamed (once per pass of the converter); a
//! registry destination gets the converted image through `ferry copy`'s push code, from
//! a temporary layout that is removed afterwards.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ferry_index::estargz::zstd_chunked::{self, ZstdChunkedOptions};
use ferry_index::estargz::{EstargzOptions, convert};
use ferry_oci::layout::{descriptor, digest};
use ferry_oci::media::{
    ANNOTATION_ESTARGZ_TOC, ANNOTATION_ESTARGZ_USIZE, ANNOTATION_ZSTD_CHUNKED_CHECKSUM,
    ANNOTATION_ZSTD_CHUNKED_POSITION, LAYER_TAR_GZIP, LAYER_TAR_ZSTD, LayerCompression,
    layer_compression,
};
use ferry_oci::{Descriptor, ImageManifest, ImageRef, OciLayout};
use ferry_registry_client::{CopyOptions, ImageLocation, NoProgress, copy_image};

use super::remote::{RegistryArgs, RemoteImage};
use super::{human, index::short, layout_platform_ref, layout_ref, output_layout, write_image};
use crate::out::outln;
use crate::progress;

/// Arguments of `ferry convert`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("format").required(true).args(["estargz", "zstd_chunked"])))]
pub struct Args {
    /// Convert to eStargz (gzip members and a TOC; stargz-snapshotter, ferry).
    #[arg(long)]
    pub estargz: bool,
    /// Convert to zstd:chunked (zstd frames and a TOC; podman, buildah, CRI-O, ferry).
    #[arg(long)]
    pub zstd_chunked: bool,
    /// Source image: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    pub src: String,
    /// Destination image: `oci:DIR:TAG` (may be the same layout with another tag) or
    /// `HOST[:PORT]/REPO:TAG` (pushed; needs push rights).
    pub dst: String,
    /// File listing paths (one per line, as in the image) to put first, behind a
    /// `.prefetch.landmark`, in that order (eStargz only).
    #[arg(long)]
    pub priority: Option<PathBuf>,
    /// Chunk size for large files.
    #[arg(long, default_value_t = EstargzOptions::default().chunk_size)]
    pub chunk_size: u64,
    /// Compression level: gzip 0-12 for eStargz (default 9), zstd 1-19 for zstd:chunked
    /// (default 3).
    #[arg(long)]
    pub level: Option<u32>,
    /// The platform to convert from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    pub platform: Option<ferry_oci::Platform>,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// Opens a layer blob as its uncompressed tar stream.
pub fn open_layer_tar(layout: &OciLayout, layer: &Descriptor) -> Result<Box<dyn Read + Send>> {
    let path = layout.blob_path(layer.digest())?;
    let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    decompress(layer, Box::new(file))
}

/// The uncompressed tar stream of `layer`, whose blob `blob` reads.
fn decompress(layer: &Descriptor, blob: Box<dyn Read + Send>) -> Result<Box<dyn Read + Send>> {
    let blob = BufReader::with_capacity(1 << 20, blob);
    let media = layer.media_type().to_string();
    Ok(match layer_compression(&media) {
        Some(LayerCompression::Gzip) => Box::new(flate2::read::MultiGzDecoder::new(blob)),
        Some(LayerCompression::Zstd) => Box::new(zstd::stream::read::Decoder::with_buffer(blob)?),
        Some(LayerCompression::None) => Box::new(blob),
        None => bail!(
            "layer {} has media type {media}, which is not a tar layer",
            layer.digest()
        ),
    })
}

/// Where the source image is read from.
enum Source {
    Layout(OciLayout),
    Registry(RemoteImage),
}

impl Source {
    fn config(&self, manifest: &ImageManifest) -> Result<Vec<u8>> {
        let max = ferry_oci::MAX_MANIFEST_BYTES;
        match self {
            Source::Layout(layout) => Ok(layout.read_blob(manifest.config().digest(), max)?),
            Source::Registry(remote) => remote.read_blob(manifest.config(), max),
        }
    }

    fn open_tar(&self, layer: &Descriptor) -> Result<Box<dyn Read + Send>> {
        match self {
            Source::Layout(layout) => open_layer_tar(layout, layer),
            Source::Registry(remote) => {
                decompress(layer, Box::new(remote.stream_blob(layer, true)?))
            }
        }
    }
}

/// A directory removed when dropped (the temporary layout a registry destination is
/// pushed from).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let dir =
            std::env::temp_dir().join(format!("ferry-convert-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| {
            format!(
                "creating {} for the converted image (set TMPDIR to a directory with room)",
                dir.display()
            )
        })?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(args: Args) -> Result<()> {
    let src_ref = ImageRef::parse(&args.src)?;
    let dst_ref = ImageRef::parse(&args.dst)?;
    let client = args.registry.client(&[&src_ref, &dst_ref])?;
    let (src, manifest) = match RemoteImage::open(&src_ref, &client)? {
        Some(remote) => {
            let (_, manifest) = remote.manifest(args.platform.as_ref())?;
            (Source::Registry(remote), manifest)
        }
        None => {
            let (layout, reference, _) = layout_ref(&args.src)?;
            let reference = layout_platform_ref(&layout, reference, args.platform.as_ref())?;
            let (_, manifest) = layout.image_manifest(&reference)?;
            (Source::Layout(layout), manifest)
        }
    };
    let (dst, tag, staging) = match &dst_ref {
        ImageRef::Layout { .. } => {
            let (dst, tag) = output_layout(&args.dst)?;
            (dst, tag, None)
        }
        ImageRef::Registry { tag: None, .. } => {
            bail!(
                "{}: a registry destination needs a tag (HOST/REPO:TAG)",
                args.dst
            )
        }
        ImageRef::Registry { .. } => {
            let dir = TempDir::new()?;
            let layout = OciLayout::open_or_create(&dir.0)
                .with_context(|| format!("creating {}", dir.0.display()))?;
            (layout, "converted".to_string(), Some(dir))
        }
    };
    let priority: Vec<String> = match &args.priority {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading priority list {}", p.display()))?
            .lines()
            .map(|l| l.trim().trim_start_matches('/').to_string())
            .filter(|l| !l.is_empty())
            .collect(),
        None => Vec::new(),
    };
    if args.zstd_chunked && !priority.is_empty() {
        bail!("--priority orders eStargz layers; zstd:chunked has no prefetch landmark");
    }
    let opts = EstargzOptions {
        chunk_size: args.chunk_size,
        level: args.level.unwrap_or(EstargzOptions::default().level),
        priority,
    };
    let zopts = ZstdChunkedOptions {
        chunk_size: args.chunk_size,
        level: args.level.map_or(ZstdChunkedOptions::default().level, |l| {
            i32::try_from(l).unwrap_or(i32::MAX)
        }),
    };
    let format = if args.zstd_chunked {
        "zstd:chunked"
    } else {
        "eStargz"
    };
    let config: serde_json::Value = serde_json::from_slice(&src.config(&manifest)?)
        .context("source image config is not JSON")?;
    let multi = progress::multi();
    let start = std::time::Instant::now();
    let mut layers = Vec::new();
    let (mut in_total, mut out_total) = (0u64, 0u64);
    for layer in manifest.layers() {
        let bar = progress::bytes_bar(&multi, &short(layer.digest().as_ref()), layer.size());
        let mut open = || -> ferry_index::Result<Box<dyn Read + Send>> {
            bar.set_position(0);
            let r = src
                .open_tar(layer)
                .map_err(|e| ferry_index::Error::Io(std::io::Error::other(format!("{e:#}"))))?;
            Ok(Box::new(bar.wrap_read(r)) as Box<dyn Read + Send>)
        };
        let mut blob = dst.blob_writer()?;
        let (out_digest, desc_of, diff_id) = if args.zstd_chunked {
            let mut input = open()?;
            let out = zstd_chunked::convert(&mut input, &mut blob, &zopts)
                .with_context(|| format!("converting layer {}", layer.digest()))?;
            let annotations = vec![
                (
                    ANNOTATION_ZSTD_CHUNKED_CHECKSUM,
                    out.manifest_checksum.clone(),
                ),
                (
                    ANNOTATION_ZSTD_CHUNKED_POSITION,
                    out.manifest_position.text(),
                ),
            ];
            (out.digest, (LAYER_TAR_ZSTD, annotations), out.diff_id)
        } else {
            let out = convert(&mut open, &mut blob, &opts)
                .with_context(|| format!("converting layer {}", layer.digest()))?;
            let annotations = vec![
                (ANNOTATION_ESTARGZ_TOC, out.toc_digest.clone()),
                (ANNOTATION_ESTARGZ_USIZE, out.uncompressed_size.to_string()),
            ];
            (out.digest, (LAYER_TAR_GZIP, annotations), out.diff_id)
        };
        let (d, size) = blob.commit()?;
        bar.finish_and_clear();
        if d.to_string() != out_digest {
            bail!(
                "internal error: {format} blob digest {d} differs from the writer's {out_digest}"
            );
        }
        in_total += layer.size();
        out_total += size;
        let (media, annotations) = desc_of;
        let desc = descriptor(media, digest(&out_digest)?, size, &annotations);
        layers.push((desc, diff_id));
    }
    let m = write_image(&dst, &tag, layers, Some(config))?;
    if staging.is_some() {
        push(&dst, &tag, &dst_ref, &client)
            .with_context(|| format!("pushing the converted image to {}", args.dst))?;
    }
    outln!(
        "converted {} layers ({} -> {}) to {format} in {:.2}s: {} manifest {}",
        manifest.layers().len(),
        human(in_total),
        human(out_total),
        start.elapsed().as_secs_f64(),
        args.dst,
        m.digest()
    );
    Ok(())
}

/// Pushes image `tag` of `layout` to `dst` with `ferry copy`'s code (blobs the registry
/// has are skipped).
fn push(
    layout: &OciLayout,
    tag: &str,
    dst: &ImageRef,
    client: &ferry_registry_client::Client,
) -> Result<()> {
    let from = ImageLocation::Layout {
        layout: layout.clone(),
        reference: tag.to_string(),
    };
    let to = ImageLocation::from_ref(dst, client, true)?;
    let opts = CopyOptions {
        referrer_types: Vec::new(),
        ..CopyOptions::default()
    };
    super::current_thread_runtime()?
        .block_on(copy_image(
            &from,
            &to,
            &opts,
            std::sync::Arc::new(NoProgress),
        ))
        .map_err(|e| {
            anyhow::anyhow!(
                "{e} (the push needs push rights: log in with `docker login` or put \
                 credentials in docker's config; for a registry without TLS pass --plain-http)"
            )
        })?;
    Ok(())
}
