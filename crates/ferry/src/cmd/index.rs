//! `ferry index oci:DIR:TAG`

use std::fs::File;
use std::io::BufReader;

use anyhow::{Context, Result};
use ferry_index::ferryidx::LayerIndex;
use ferry_index::image::{DEFAULT_MIN_LAYER_SIZE, store_layout_artifact};
use ferry_index::indexer::{index_gzip, index_tar};
use ferry_index::zran::DEFAULT_SPAN;
use ferry_oci::Descriptor;
use ferry_oci::media::{ANNOTATION_ESTARGZ_TOC, LayerCompression, layer_compression};
use rayon::prelude::*;

use super::{human, layout_platform_ref, layout_ref};
use crate::progress;

/// Arguments of `ferry index`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image, `oci:DIR[:TAG]`.
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
}

/// Per-layer outcome, for the summary.
struct Done {
    layer: Descriptor,
    index: Option<LayerIndex>,
    note: String,
}

pub fn run(args: Args) -> Result<()> {
    let (layout, reference, _) = layout_ref(&args.image)?;
    let reference = layout_platform_ref(&layout, reference, args.platform.as_ref())?;
    let (mdesc, manifest) = layout.image_manifest(&reference)?;
    let multi = progress::multi();
    let results: Vec<Result<Done>> = manifest
        .layers()
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
            if layer.size() < args.min_layer_size {
                return skip("small (read whole)");
            }
            let compression = match layer_compression(&media) {
                Some(c @ (LayerCompression::Gzip | LayerCompression::None)) => c,
                Some(LayerCompression::Zstd) => return skip("zstd (read whole)"),
                None => return skip("not a layer"),
            };
            let path = layout.blob_path(layer.digest())?;
            let bar = progress::bytes_bar(&multi, &short(layer.digest().as_ref()), layer.size());
            let file = File::open(&path)
                .with_context(|| format!("opening layer blob {}", path.display()))?;
            let reader = bar.wrap_read(BufReader::with_capacity(1 << 20, file));
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
    let done: Vec<Done> = results.into_iter().collect::<Result<_>>()?;
    let indexed: Vec<(Descriptor, LayerIndex)> = done
        .iter()
        .filter_map(|d| d.index.clone().map(|i| (d.layer.clone(), i)))
        .collect();
    let artifact = if indexed.is_empty() {
        None
    } else {
        Some(store_layout_artifact(&layout, &mdesc, &indexed)?)
    };

    println!(
        "{:<20} {:>10} {:>12} {:>7} {:>10} {:>7} {:>10}  note",
        "layer", "size", "uncompressed", "spans", "index", "ratio", "windows"
    );
    let (mut total_layer, mut total_index, mut total_spans) = (0u64, 0u64, 0usize);
    let mut total_windows = 0u64;
    // Encoded index and windows blob sizes, in the order of `indexed` (the indexed
    // subset of `done`).
    let mut index_sizes = artifact
        .as_ref()
        .map(|a| a.index_sizes.clone())
        .unwrap_or_default()
        .into_iter();
    let mut windows_sizes = artifact
        .as_ref()
        .map(|a| a.windows_sizes.clone())
        .unwrap_or_default()
        .into_iter();
    for d in &done {
        let size = d.layer.size();
        total_layer += size;
        match &d.index {
            Some(i) => {
                let bytes = index_sizes.next().unwrap_or(0);
                let windows = windows_sizes.next().unwrap_or(0);
                total_index += bytes;
                total_windows += windows;
                total_spans += i.checkpoints.len();
                println!(
                    "{:<20} {:>10} {:>12} {:>7} {:>10} {:>6.2}% {:>10}  {} files",
                    short(d.layer.digest().as_ref()),
                    human(size),
                    human(i.uncompressed_size),
                    i.checkpoints.len(),
                    human(bytes),
                    100.0 * bytes as f64 / size.max(1) as f64,
                    human(windows),
                    i.entries.len()
                );
            }
            None => println!(
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
    println!(
        "{} layers, {} indexed, {} spans, index {} = {:.2}% of {} of layers \
         (windows, fetched per span on first read: {})",
        done.len(),
        indexed.len(),
        total_spans,
        human(total_index),
        100.0 * total_index as f64 / total_layer.max(1) as f64,
        human(total_layer),
        human(total_windows)
    );
    if let Some(a) = artifact {
        println!(
            "index artifact {} refers to {}",
            a.descriptor.digest(),
            mdesc.digest()
        );
    }
    Ok(())
}

/// `sha256:0123456789ab` — enough to tell layers apart in a table.
pub fn short(digest: &str) -> String {
    digest.chars().take(19).collect()
}
