//! `ferry index IMAGE`: an OCI layout's layers are read from its blobs, a registry
//! image's are streamed once each (no copy of the image is kept); either way the index
//! is built as the bytes pass, checked against the layer digest, and stored as the
//! image's referrer (in the layout, or pushed to the registry), the image untouched.

use std::fs::File;
use std::io::{BufReader, Read};

use anyhow::{Context, Result};
use ferry_index::ferryidx::LayerIndex;
use ferry_index::image::{DEFAULT_MIN_LAYER_SIZE, build_artifact, store_layout_artifact};
use ferry_index::indexer::{index_gzip, index_tar};
use ferry_index::zran::DEFAULT_SPAN;
use ferry_oci::media::{ANNOTATION_ESTARGZ_TOC, LayerCompression, layer_compression};
use ferry_oci::{Descriptor, ImageRef};
use ferry_registry_client::ByteStream;
use rayon::prelude::*;

use super::remote::{RegistryArgs, RemoteImage};
use super::{human, layout_platform_ref, layout_ref};
use crate::out::outln;
use crate::progress;

/// Arguments of `ferry index`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image: `oci:DIR[:TAG]`, or `HOST[:PORT]/REPO[:TAG|@DIGEST]` (each layer
    /// streamed once; the index is pushed as the image's referrer, which needs push
    /// rights on the repository).
    pub image: String,
    /// Uncompressed bytes between inflate checkpoints (smaller: less wasted per random
    /// read, bigger index).
    #[arg(long, default_value_t = DEFAULT_SPAN)]
    pub span: u64,
    /// Layers smaller than this many compressed bytes are left unindexed (read whole).
    #[arg(long, default_value_t = DEFAULT_MIN_LAYER_SIZE)]
    pub min_layer_size: u64,
    /// The platform to index from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    pub platform: Option<ferry_oci::Platform>,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// Per-layer outcome, for the summary.
struct Done {
    layer: Descriptor,
    index: Option<LayerIndex>,
    note: String,
}

/// Opens a layer's blob as the compressed stream the indexer reads.
type OpenBlob<'a> = dyn Fn(&Descriptor) -> Result<Box<dyn Read + Send>> + Sync + 'a;

pub fn run(args: Args) -> Result<()> {
    let parsed = ImageRef::parse(&args.image)?;
    if let ImageRef::Registry { .. } = parsed {
        let client = args.registry.client(&[&parsed])?;
        let remote = RemoteImage::open(&parsed, &client)?.context("a registry image")?;
        return run_registry(&args, &remote);
    }
    let (layout, reference, _) = layout_ref(&args.image)?;
    let reference = layout_platform_ref(&layout, reference, args.platform.as_ref())?;
    let (mdesc, manifest) = layout.image_manifest(&reference)?;
    let open = |layer: &Descriptor| -> Result<Box<dyn Read + Send>> {
        let path = layout.blob_path(layer.digest())?;
        let file =
            File::open(&path).with_context(|| format!("opening layer blob {}", path.display()))?;
        Ok(Box::new(file))
    };
    let done = index_layers(&args, manifest.layers(), &open)?;
    let indexed = indexed(&done);
    let artifact = if indexed.is_empty() {
        None
    } else {
        Some(store_layout_artifact(&layout, &mdesc, &indexed)?)
    };
    let sizes = artifact
        .as_ref()
        .map(|a| (a.index_sizes.clone(), a.windows_sizes.clone()))
        .unwrap_or_default();
    print_summary(&done, sizes)?;
    if let Some(a) = artifact {
        outln!(
            "index artifact {} refers to {}",
            a.descriptor.digest(),
            mdesc.digest()
        );
    }
    Ok(())
}

/// `ferry index HOST/REPO:TAG`: every layer streamed once from the registry into the
/// indexer, the artifact pushed as a referrer of the image manifest (the referrers API
/// where the registry has it, else the `sha256-<hex>` tag: where mounts and pulls look).
fn run_registry(args: &Args, remote: &RemoteImage) -> Result<()> {
    let (mdesc, manifest) = remote.manifest(args.platform.as_ref())?;
    // The indexer checks the digest of the bytes it reads against the layer's.
    let open = |layer: &Descriptor| -> Result<Box<dyn Read + Send>> {
        Ok(Box::new(remote.stream_blob(layer, false)?))
    };
    let done = index_layers(args, manifest.layers(), &open)?;
    let indexed = indexed(&done);
    if indexed.is_empty() {
        print_summary(&done, Default::default())?;
        outln!("no layer indexed; nothing pushed");
        return Ok(());
    }
    let parts = build_artifact(&mdesc, &indexed)?;
    let (client, repo) = (&remote.client, &remote.repo);
    remote
        .runtime
        .handle()
        .block_on(async {
            for blob in &parts.blobs {
                let digest = blob.descriptor.digest().to_string();
                let size = blob.descriptor.size();
                if client.blob_size(repo, &digest).await? == Some(size) {
                    continue;
                }
                let Some(bytes) = blob.bytes.clone() else {
                    return Err(ferry_registry_client::ClientError::Invalid {
                        what: format!("index artifact blob {digest}"),
                        reason: "its bytes are not at hand".into(),
                    });
                };
                let body: ByteStream =
                    Box::pin(futures_util::stream::once(async move { Ok(bytes.into()) }));
                client.push_blob(repo, &digest, size, body).await?;
            }
            client
                .push_referrer(
                    repo,
                    mdesc.digest().as_ref(),
                    &parts.descriptor,
                    parts.manifest.clone().into(),
                )
                .await
        })
        .with_context(|| {
            format!(
                "pushing the index artifact to {repo} (it needs push rights on the \
                 repository: log in with `docker login` or give credentials in docker's \
                 config; for a registry without TLS pass --plain-http)"
            )
        })?;
    print_summary(&done, (parts.index_sizes, parts.windows_sizes))?;
    outln!(
        "index artifact {} pushed to {repo} as a referrer of {} (the image is unchanged)",
        parts.descriptor.digest(),
        mdesc.digest()
    );
    Ok(())
}

/// The layers that were indexed, with their indexes.
fn indexed(done: &[Done]) -> Vec<(Descriptor, LayerIndex)> {
    done.iter()
        .filter_map(|d| d.index.clone().map(|i| (d.layer.clone(), i)))
        .collect()
}

/// Indexes `layers` in parallel, each read once through `open`, with a progress bar per
/// layer; layers that are not indexed say why.
fn index_layers(args: &Args, layers: &[Descriptor], open: &OpenBlob<'_>) -> Result<Vec<Done>> {
    let multi = progress::multi();
    let results: Vec<Result<Done>> = layers
        .par_iter()
        .map(|layer| {
            let media = layer.media_type().to_string();
            let skip = |note: &str| {
                Ok(Done {
                    layer: layer.clone(),
                    index: None,
                    note: note.to_string(),
                })
            };
            if layer
                .annotations()
                .as_ref()
                .is_some_and(|a| a.contains_key(ANNOTATION_ESTARGZ_TOC))
            {
                return skip("estargz (has its own TOC)");
            }
            if matches!(
                ferry_index::image::LayerWay::<()>::of(layer, None),
                ferry_index::image::LayerWay::ZstdChunked { .. }
            ) {
                return skip("zstd:chunked (has its own TOC)");
            }
            if layer.size() < args.min_layer_size {
                return skip("small (read whole)");
            }
            let compression = match layer_compression(&media) {
                Some(c @ (LayerCompression::Gzip | LayerCompression::None)) => c,
                Some(LayerCompression::Zstd) => return skip("zstd (read whole)"),
                None => return skip("not a layer"),
            };
            let bar = progress::bytes_bar(&multi, &short(layer.digest().as_ref()), layer.size());
            let reader = bar.wrap_read(BufReader::with_capacity(1 << 20, open(layer)?));
            let expected = Some(layer.digest().as_ref());
            let index = match compression {
                LayerCompression::Gzip => index_gzip(reader, args.span, expected),
                _ => index_tar(reader, args.span, expected),
            }
            .with_context(|| format!("indexing layer {}", layer.digest()))?;
            bar.finish_and_clear();
            Ok(Done {
                layer: layer.clone(),
                index: Some(index),
                note: String::new(),
            })
        })
        .collect();
    results.into_iter().collect()
}

/// The table of layers and the totals; `sizes`: the encoded index and windows blob
/// sizes, in the order of the indexed layers.
fn print_summary(done: &[Done], sizes: (Vec<u64>, Vec<u64>)) -> Result<()> {
    let indexed = done.iter().filter(|d| d.index.is_some()).count();
    outln!(
        "{:<20} {:>10} {:>12} {:>7} {:>10} {:>7} {:>10}  note",
        "layer",
        "size",
        "uncompressed",
        "spans",
        "index",
        "ratio",
        "windows"
    );
    let (mut total_layer, mut total_index, mut total_spans) = (0u64, 0u64, 0usize);
    let mut total_windows = 0u64;
    let mut index_sizes = sizes.0.into_iter();
    let mut windows_sizes = sizes.1.into_iter();
    for d in done {
        let size = d.layer.size();
        total_layer += size;
        match &d.index {
            Some(i) => {
                let bytes = index_sizes.next().unwrap_or(0);
                let windows = windows_sizes.next().unwrap_or(0);
                total_index += bytes;
                total_windows += windows;
                total_spans += i.checkpoints.len();
                outln!(
                    "{:<20} {:>10} {:>12} {:>7} {:>10} {:>6.2}% {:>10}  {} files, {} with libraries",
                    short(d.layer.digest().as_ref()),
                    human(size),
                    human(i.uncompressed_size),
                    i.checkpoints.len(),
                    human(bytes),
                    100.0 * bytes as f64 / size.max(1) as f64,
                    human(windows),
                    i.entries.len(),
                    i.libraries.len()
                );
            }
            None => outln!(
                "{:<20} {:>10} {:>12} {:>7} {:>10} {:>7} {:>10}  {}",
                short(d.layer.digest().as_ref()),
                human(size),
                "-",
                "-",
                "-",
                "-",
                "-",
                d.note
            ),
        }
    }
    outln!(
        "{} layers, {} indexed, {} spans, index {} = {:.2}% of {} of layers \
         (windows, fetched per span on first read: {})",
        done.len(),
        indexed,
        total_spans,
        human(total_index),
        100.0 * total_index as f64 / total_layer.max(1) as f64,
        human(total_layer),
        human(total_windows)
    );
    Ok(())
}

/// `sha256:0123456789ab` — enough to tell layers apart in a table.
pub fn short(digest: &str) -> String {
    digest.chars().take(19).collect()
}
