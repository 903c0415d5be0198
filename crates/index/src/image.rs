//! Images as ferry reads them: a manifest's layers, each paired with the best way to
//! reach its files (ferry index, eStargz TOC, or the whole blob), stacked into a
//! [`MergedImage`]; and storing ferry index artifacts beside an image.
//!
//! Index artifacts follow the OCI 1.1 referrers model: one manifest per image manifest,
//! `artifactType` [`FERRY_INDEX_ARTIFACT`], `subject` = the image manifest, per indexed
//! layer one index blob and (for gzip layers with windows) one windows blob, each
//! annotated with the layer's digest. In an OCI layout they are found through the
//! `sha256-<hex>` tag fallback.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_oci::layout::{
    OciLayout, artifact_manifest, descriptor, digest as parse_digest, media_type,
};
use ferry_oci::media::{
    ANNOTATION_ESTARGZ_TOC, ANNOTATION_LAYER_DIGEST, ANNOTATION_SPAN_SIZE,
    ANNOTATION_ZSTD_CHUNKED_CHECKSUM, ANNOTATION_ZSTD_CHUNKED_CHECKSUM_OLD,
    ANNOTATION_ZSTD_CHUNKED_POSITION, ANNOTATION_ZSTD_CHUNKED_POSITION_OLD, FERRY_INDEX_ARTIFACT,
    FERRY_LAYER_INDEX, FERRY_LAYER_WINDOWS, LayerCompression, OCI_MANIFEST, layer_compression,
};
use ferry_oci::{Descriptor, ImageManifest};

use crate::error::{Error, Result};
use crate::estargz::EstargzLayer;
use crate::ferryidx::{LayerIndex, MAX_INDEX_BYTES};
use crate::merged::MergedImage;
use crate::reader::{LayerFormat, LayerReader};
use crate::source::{FileSource, RangeSource};
use crate::windows::{BlobWindows, WindowSource};

/// Layers smaller than this (compressed) are not indexed by default: one span of a
/// typical layer is about this size, so fetching such a layer whole costs no more than
/// a single lazy read would.
pub const DEFAULT_MIN_LAYER_SIZE: u64 = 1 << 20;

/// What `ferry inspect` reports about one layer.
#[derive(Debug, Clone)]
pub struct LayerSummary {
    /// Layer descriptor from the manifest.
    pub descriptor: Descriptor,
    /// How ferry reads it.
    pub format: String,
    /// Entries in its file table (when known without reading the layer).
    pub entries: Option<usize>,
}

/// Decodes one ferry index blob of an index artifact (`blob` is its descriptor, `bytes`
/// its verified content) and checks that the layer it indexes is the one the descriptor's
/// `dev.ferry.layer.digest` annotation names, so an artifact cannot pass one layer's index
/// off as another's. Shared by every place that reads index artifacts (layouts here,
/// registries in ferry-fs).
pub fn decode_index_blob(blob: &Descriptor, bytes: &[u8]) -> Result<LayerIndex> {
    let index = LayerIndex::decode(bytes)?;
    let claimed = blob
        .annotations()
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_LAYER_DIGEST));
    if claimed.is_some_and(|c| *c != index.layer_digest) {
        return Err(Error::Index(format!(
            "index blob {} claims layer {claimed:?} but indexes {}",
            blob.digest(),
            index.layer_digest
        )));
    }
    Ok(index)
}

/// Reads the ferry index blobs that refer to `manifest` in `layout`: layer digest → index.
pub fn layout_indexes(
    layout: &OciLayout,
    manifest: &Descriptor,
) -> Result<HashMap<String, Arc<LayerIndex>>> {
    let mut out = HashMap::new();
    for referrer in layout.referrers(manifest.digest())? {
        if referrer
            .artifact_type()
            .as_ref()
            .map(|t| t.to_string())
            .as_deref()
            != Some(FERRY_INDEX_ARTIFACT)
        {
            continue;
        }
        let bytes = layout.read_document(&referrer)?;
        let artifact: ImageManifest = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Index(format!("index artifact manifest: {e}")))?;
        if artifact.subject().as_ref().map(|s| s.digest()) != Some(manifest.digest()) {
            continue;
        }
        for blob in artifact.layers() {
            if blob.media_type().to_string() != FERRY_LAYER_INDEX {
                continue;
            }
            let bytes = layout.read_blob(blob.digest(), MAX_INDEX_BYTES as u64)?;
            let index = decode_index_blob(blob, &bytes)?;
            out.insert(index.layer_digest.clone(), Arc::new(index));
        }
    }
    Ok(out)
}

/// Opens an image stored in an OCI layout, choosing per layer: ferry index if one
/// refers to the image, eStargz if the layer carries a TOC digest annotation,
/// zstd:chunked if it carries a manifest checksum, else the whole layer. Each layer's source is wrapped by `wrap` (for counting reads).
pub fn open_layout_image(
    layout: &OciLayout,
    reference: &str,
    wrap: &dyn Fn(Arc<dyn RangeSource>) -> Arc<dyn RangeSource>,
) -> Result<(MergedImage, Vec<LayerSummary>)> {
    let (mdesc, manifest) = layout.image_manifest(reference)?;
    let indexes = layout_indexes(layout, &mdesc)?;
    let mut readers = Vec::new();
    let mut summaries = Vec::new();
    for layer in manifest.layers() {
        let path = layout.blob_path(layer.digest())?;
        let file = FileSource::open(&path).map_err(|e| {
            Error::NotFound(format!(
                "layer blob {} ({}): {e}; is the layout complete?",
                layer.digest(),
                path.display()
            ))
        })?;
        if file.len() != layer.size() {
            return Err(Error::Index(format!(
                "layer {} is {} bytes, manifest says {}",
                layer.digest(),
                file.len(),
                layer.size()
            )));
        }
        let source = wrap(Arc::new(file));
        let reader = layer_reader(layer, &indexes, source)?;
        summaries.push(LayerSummary {
            descriptor: layer.clone(),
            format: reader.format_name().to_string(),
            entries: Some(reader.entries().len()),
        });
        readers.push(reader);
    }
    Ok((MergedImage::new(readers), summaries))
}

/// How a layer is read, from its descriptor and the ferry index referring to it (`I`:
/// the index, or `()` where only its presence is known), best way first: the one choice
/// every opener of a layer makes ([`layer_reader`] for layouts, ferry-fs's lazy mounts,
/// the daemon's report of which layers can be lazy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerWay<'a, I = ()> {
    /// Span by span, through its ferry index ([`indexed_windows`] before use).
    Indexed(I),
    /// Member by member, through the eStargz TOC whose digest is `toc`.
    Estargz {
        /// The TOC digest annotation.
        toc: &'a str,
    },
    /// Frame by frame, through the zstd:chunked TOC whose compressed bytes hash to
    /// `checksum`, found at `position` (else through the blob's footer).
    ZstdChunked {
        /// The `manifest-checksum` annotation.
        checksum: &'a str,
        /// The `manifest-position` annotation.
        position: Option<&'a str>,
    },
    /// The whole blob, fetched and inflated once ([`whole_compression`]).
    Whole,
}

impl<'a, I> LayerWay<'a, I> {
    /// The way into `layer`, given the ferry index that refers to the image for it, if
    /// one does.
    pub fn of(layer: &'a Descriptor, index: Option<I>) -> LayerWay<'a, I> {
        if let Some(index) = index {
            return LayerWay::Indexed(index);
        }
        let Some(annotations) = layer.annotations().as_ref() else {
            return LayerWay::Whole;
        };
        if let Some(toc) = annotations.get(ANNOTATION_ESTARGZ_TOC) {
            return LayerWay::Estargz { toc };
        }
        // zstd:chunked needs its checksum: a TOC nobody vouches for makes no chunk
        // verifiable, so such a layer is read whole (and checked against its digest).
        let zstd = layer_compression(layer.media_type().as_ref()) == Some(LayerCompression::Zstd);
        let checksum = annotations
            .get(ANNOTATION_ZSTD_CHUNKED_CHECKSUM)
            .or_else(|| annotations.get(ANNOTATION_ZSTD_CHUNKED_CHECKSUM_OLD));
        match checksum {
            Some(checksum) if zstd => LayerWay::ZstdChunked {
                checksum,
                position: annotations
                    .get(ANNOTATION_ZSTD_CHUNKED_POSITION)
                    .or_else(|| annotations.get(ANNOTATION_ZSTD_CHUNKED_POSITION_OLD))
                    .map(String::as_str),
            },
            _ => LayerWay::Whole,
        }
    }
}

/// Refuses an index that is not for `layer`'s blob (another compressed size).
pub fn check_index_size(layer: &Descriptor, index: &LayerIndex) -> Result<()> {
    if index.compressed_size != layer.size() {
        return Err(Error::Index(format!(
            "index of {} is for a {}-byte blob",
            layer.digest(),
            index.compressed_size
        )));
    }
    Ok(())
}

/// The compression of a layer read whole; refused when its media type is not a layer
/// ferry can read.
pub fn whole_compression(layer: &Descriptor) -> Result<LayerCompression> {
    let media = layer.media_type().to_string();
    layer_compression(&media).ok_or_else(|| {
        Error::Index(format!(
            "layer {} has media type {media}, which is not a layer ferry can read",
            layer.digest()
        ))
    })
}

/// Checks that `index` is for `layer`'s blob and finds the blob a version-2 index keeps
/// its windows in, beside the layer blob `source` ([`RangeSource::sibling`], so a
/// counting wrapper counts it too); `None` when the index keeps its windows inline. What
/// every opener of an indexed layer does first (layouts here, ferry-fs's lazy mounts).
pub fn indexed_windows(
    layer: &Descriptor,
    index: &LayerIndex,
    source: &dyn RangeSource,
) -> Result<Option<Arc<dyn RangeSource>>> {
    check_index_size(layer, index)?;
    let Some(w) = &index.windows else {
        return Ok(None);
    };
    source.sibling(&w.digest, w.size).map(Some).ok_or_else(|| {
        Error::NotFound(format!(
            "windows blob {} ({} bytes) of the index of layer {} cannot be reached beside \
             the layer blob; is the layout or repository complete?",
            w.digest,
            w.size,
            layer.digest()
        ))
    })
}

/// The reader of an indexed layer: its spans read through `source`, its windows from
/// `windows` (else from the index itself, which then keeps them inline).
pub fn indexed_reader(
    index: Arc<LayerIndex>,
    source: Arc<dyn RangeSource>,
    windows: Option<Arc<dyn WindowSource>>,
) -> LayerReader {
    let reader = LayerReader::new(LayerFormat::Indexed(index), source);
    match windows {
        Some(w) => reader.with_windows(w),
        None => reader,
    }
}

/// The reader of a layer read through its own TOC (eStargz, zstd:chunked), its TOC and
/// pieces read through `source`: what layouts and ferry-fs's lazy mounts both build for
/// [`LayerWay::Estargz`] and [`LayerWay::ZstdChunked`]. Any other way is an error: it has
/// no TOC.
pub fn toc_reader<I>(way: &LayerWay<'_, I>, source: Arc<dyn RangeSource>) -> Result<LayerReader> {
    let layer = match *way {
        LayerWay::Estargz { toc } => EstargzLayer::open(source.as_ref(), Some(toc))?,
        LayerWay::ZstdChunked { checksum, position } => {
            EstargzLayer::open_zstd_chunked(source.as_ref(), checksum, position)?
        }
        LayerWay::Indexed(_) | LayerWay::Whole => {
            return Err(Error::Index(
                "the layer has no TOC (neither eStargz nor zstd:chunked)".into(),
            ));
        }
    };
    Ok(LayerReader::new(
        LayerFormat::Estargz(Arc::new(layer)),
        source,
    ))
}

/// Picks the reader for one layer of a layout, the blobs read straight from `source`.
pub fn layer_reader(
    layer: &Descriptor,
    indexes: &HashMap<String, Arc<LayerIndex>>,
    source: Arc<dyn RangeSource>,
) -> Result<LayerReader> {
    match LayerWay::of(layer, indexes.get(layer.digest().as_ref())) {
        LayerWay::Indexed(index) => {
            let windows = indexed_windows(layer, index, source.as_ref())?
                .map(|w| Arc::new(BlobWindows::new(w, true)) as Arc<dyn WindowSource>);
            Ok(indexed_reader(index.clone(), source, windows))
        }
        way @ (LayerWay::Estargz { .. } | LayerWay::ZstdChunked { .. }) => toc_reader(&way, source),
        LayerWay::Whole => LayerReader::whole(source, whole_compression(layer)?),
    }
}

/// One blob of an index artifact: its descriptor and, where this process has them, its
/// bytes (`None`: a windows blob of an index that was split before, to be found where
/// the artifact is stored).
#[derive(Debug, Clone)]
pub struct ArtifactBlob {
    /// The blob's descriptor.
    pub descriptor: Descriptor,
    /// Its bytes.
    pub bytes: Option<Vec<u8>>,
}

/// An index artifact as bytes, before it is stored anywhere: what
/// [`store_layout_artifact`] writes into a layout and `ferry index HOST/REPO:TAG` pushes
/// to a registry, so both store exactly the same artifact.
#[derive(Debug, Clone)]
pub struct ArtifactParts {
    /// The empty config blob (`{}`) first, then per index its index blob and (when it has
    /// one) its windows blob.
    pub blobs: Vec<ArtifactBlob>,
    /// The artifact manifest.
    pub manifest: Vec<u8>,
    /// The manifest's descriptor, with its `artifactType` (as listed among referrers).
    pub descriptor: Descriptor,
    /// The encoded size of each index, in the order given.
    pub index_sizes: Vec<u64>,
    /// The size of each index's windows blob (0: none), in the order given.
    pub windows_sizes: Vec<u64>,
}

/// Builds the artifact that stores `indexes` (layer descriptor, index) and refers to the
/// image manifest `subject`: one manifest, `artifactType` [`FERRY_INDEX_ARTIFACT`], each
/// index written in version 2 with its windows in a windows blob listed right after its
/// index blob. Deterministic: the same indexes give the same bytes.
pub fn build_artifact(
    subject: &Descriptor,
    indexes: &[(Descriptor, LayerIndex)],
) -> Result<ArtifactParts> {
    let empty = b"{}".to_vec();
    let mut blobs = vec![ArtifactBlob {
        descriptor: descriptor(
            ferry_oci::media::OCI_EMPTY,
            ferry_oci::sha256_digest(&empty),
            empty.len() as u64,
            &[],
        ),
        bytes: Some(empty),
    }];
    let mut index_sizes = Vec::with_capacity(indexes.len());
    let mut windows_sizes = Vec::with_capacity(indexes.len());
    for (layer, index) in indexes {
        let mut index = index.clone();
        let windows = index.split_windows();
        let bytes = index.encode()?;
        index_sizes.push(bytes.len() as u64);
        blobs.push(ArtifactBlob {
            descriptor: descriptor(
                FERRY_LAYER_INDEX,
                ferry_oci::sha256_digest(&bytes),
                bytes.len() as u64,
                &[
                    (ANNOTATION_LAYER_DIGEST, layer.digest().to_string()),
                    (ANNOTATION_SPAN_SIZE, index.span_size.to_string()),
                ],
            ),
            bytes: Some(bytes),
        });
        match &index.windows {
            Some(w) => {
                windows_sizes.push(w.size);
                blobs.push(ArtifactBlob {
                    descriptor: descriptor(
                        FERRY_LAYER_WINDOWS,
                        parse_digest(&w.digest)?,
                        w.size,
                        &[(ANNOTATION_LAYER_DIGEST, layer.digest().to_string())],
                    ),
                    bytes: (!windows.is_empty()).then_some(windows),
                });
            }
            None => windows_sizes.push(0),
        }
    }
    let layers: Vec<Descriptor> = blobs[1..].iter().map(|b| b.descriptor.clone()).collect();
    let manifest = artifact_manifest(FERRY_INDEX_ARTIFACT, &layers, subject, &[])?;
    let mut desc = descriptor(
        OCI_MANIFEST,
        ferry_oci::sha256_digest(&manifest),
        manifest.len() as u64,
        &[],
    );
    desc.set_artifact_type(Some(media_type(FERRY_INDEX_ARTIFACT)));
    Ok(ArtifactParts {
        blobs,
        manifest,
        descriptor: desc,
        index_sizes,
        windows_sizes,
    })
}

/// Stores `indexes` (layer descriptor, index) as one artifact referring to the image
/// manifest `subject` ([`build_artifact`]), and records it in the layout's referrers (an
/// index already split must find its windows blob in the layout).
pub fn store_layout_artifact(
    layout: &OciLayout,
    subject: &Descriptor,
    indexes: &[(Descriptor, LayerIndex)],
) -> Result<StoredArtifact> {
    let parts = build_artifact(subject, indexes)?;
    for blob in &parts.blobs {
        match &blob.bytes {
            Some(bytes) => {
                layout.write_blob(bytes)?;
            }
            None => {
                let path = layout.blob_path(blob.descriptor.digest())?;
                let on_disk = std::fs::metadata(&path).map(|m| m.len()).ok();
                if on_disk != Some(blob.descriptor.size()) {
                    return Err(Error::NotFound(format!(
                        "windows blob {} of an index is not in the layout",
                        blob.descriptor.digest(),
                    )));
                }
            }
        }
    }
    let digest = layout.write_blob(&parts.manifest)?;
    debug_assert_eq!(&digest, parts.descriptor.digest());
    layout.add_referrer(subject.digest(), &parts.descriptor)?;
    Ok(StoredArtifact {
        descriptor: parts.descriptor,
        index_sizes: parts.index_sizes,
        windows_sizes: parts.windows_sizes,
    })
}

/// What [`store_layout_artifact`] wrote.
#[derive(Debug, Clone)]
pub struct StoredArtifact {
    /// The artifact manifest's descriptor (as listed in the layout's referrers).
    pub descriptor: Descriptor,
    /// The encoded size of each index, in the order given.
    pub index_sizes: Vec<u64>,
    /// The size of each index's windows blob (0: none), in the order given.
    pub windows_sizes: Vec<u64>,
}

/// Parses a `sha256:` digest string into oci-spec's type.
pub fn digest(s: &str) -> Result<ferry_oci::Digest> {
    Ok(parse_digest(s)?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ferry_oci::media::LAYER_TAR_GZIP;

    /// A one-file gzip layer, its descriptor and its index.
    fn layer() -> (Descriptor, LayerIndex) {
        let mut tar = tar::Builder::new(Vec::new());
        let data = vec![7u8; 300_000];
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        tar.append_data(&mut h, "f", &data[..]).unwrap();
        let tar = tar.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        let gz = gz.finish().unwrap();
        let d = ferry_oci::sha256_digest(&gz);
        let index = crate::indexer::index_gzip(&gz[..], 64 << 10, Some(d.as_ref())).unwrap();
        (descriptor(LAYER_TAR_GZIP, d, gz.len() as u64, &[]), index)
    }

    #[test]
    fn the_artifact_built_for_a_registry_is_the_one_stored_in_a_layout() {
        let (l, index) = layer();
        let subject = descriptor(OCI_MANIFEST, ferry_oci::sha256_digest(b"m"), 1, &[]);
        let parts = build_artifact(&subject, &[(l.clone(), index.clone())]).unwrap();
        // config, index, windows: every blob's bytes hash to its descriptor
        assert_eq!(parts.blobs.len(), 3);
        for b in &parts.blobs {
            let bytes = b.bytes.as_ref().expect("fresh indexes carry their windows");
            assert_eq!(&ferry_oci::sha256_digest(bytes), b.descriptor.digest());
            assert_eq!(bytes.len() as u64, b.descriptor.size());
        }
        assert_eq!(
            &ferry_oci::sha256_digest(&parts.manifest),
            parts.descriptor.digest()
        );
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path()).unwrap();
        let stored =
            store_layout_artifact(&layout, &subject, &[(l.clone(), index.clone())]).unwrap();
        assert_eq!(stored.descriptor, parts.descriptor);
        assert_eq!(stored.index_sizes, parts.index_sizes);
        assert_eq!(
            layout.referrers(subject.digest()).unwrap(),
            vec![parts.descriptor.clone()]
        );
        // deterministic
        let again = build_artifact(&subject, &[(l, index)]).unwrap();
        assert_eq!(again.manifest, parts.manifest);
    }
}
