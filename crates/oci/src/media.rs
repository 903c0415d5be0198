//! Media types and annotation keys ferry reads and writes.

/// OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Docker schema 2 manifest.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list.
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// OCI image config.
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI empty descriptor (artifact configs).
pub const OCI_EMPTY: &str = "application/vnd.oci.empty.v1+json";
/// Uncompressed tar layer.
pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// gzip tar layer.
pub const LAYER_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// zstd tar layer.
pub const LAYER_TAR_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// Docker gzip layer.
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// Docker uncompressed layer.
pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// Artifact type of a ferry index manifest (one per image manifest).
pub const FERRY_INDEX_ARTIFACT: &str = "application/vnd.ferry.index.v1";
/// Media type of one layer's ferry index blob.
pub const FERRY_LAYER_INDEX: &str = "application/vnd.ferry.layer.index.v1";
/// Media type of one layer's windows blob: the inflate windows of a version-2 ferry
/// index, fetched by Range when a span is first read.
pub const FERRY_LAYER_WINDOWS: &str = "application/vnd.ferry.layer.windows.v1";
/// Annotation on a ferry layer index (and windows) blob naming the layer it indexes.
pub const ANNOTATION_LAYER_DIGEST: &str = "dev.ferry.layer.digest";
/// Annotation recording the span size an index was built with.
pub const ANNOTATION_SPAN_SIZE: &str = "dev.ferry.span-size";

/// Artifact type of a ferry startup trace artifact manifest (which files an image's
/// first start read, referring to the image).
pub const FERRY_TRACE_ARTIFACT: &str = "application/vnd.ferry.trace.v1+json";
/// Media type of the trace JSON blob (a trace artifact's one layer, and the body of ferry
/// registry's `PUT /v2/<name>/ferry-traces/<subject>`).
pub const FERRY_TRACE: &str = "application/vnd.ferry.trace.v1+json";
/// Tag that points at the newest trace artifact of a repository, whatever its subject.
pub const FERRY_TRACE_TAG: &str = "ferry.trace";
/// Annotation on a trace artifact: when the trace was recorded or accepted (seconds since
/// the epoch).
pub const ANNOTATION_TRACE_CREATED: &str = "dev.ferry.trace.created";

/// eStargz TOC digest annotation on a layer descriptor.
pub const ANNOTATION_ESTARGZ_TOC: &str = "containerd.io/snapshot/stargz/toc.digest";
/// eStargz uncompressed size annotation on a layer descriptor.
pub const ANNOTATION_ESTARGZ_USIZE: &str = "io.containers.estargz.uncompressed-size";
/// zstd:chunked: `sha256:<hex>` of the layer's compressed TOC (manifest), on its
/// descriptor (containers/storage `pkg/chunked`).
pub const ANNOTATION_ZSTD_CHUNKED_CHECKSUM: &str =
    "io.github.containers.zstd-chunked.manifest-checksum";
/// zstd:chunked: where the compressed TOC is, `offset:length:uncompressed length:type`.
pub const ANNOTATION_ZSTD_CHUNKED_POSITION: &str =
    "io.github.containers.zstd-chunked.manifest-position";
/// zstd:chunked: where the tar-split data is, `offset:length:uncompressed length`.
pub const ANNOTATION_ZSTD_CHUNKED_TARSPLIT: &str =
    "io.github.containers.zstd-chunked.tarsplit-position";
/// [`ANNOTATION_ZSTD_CHUNKED_CHECKSUM`] as older writers named it.
pub const ANNOTATION_ZSTD_CHUNKED_CHECKSUM_OLD: &str =
    "io.containers.zstd-chunked.manifest-checksum";
/// [`ANNOTATION_ZSTD_CHUNKED_POSITION`] as older writers named it.
pub const ANNOTATION_ZSTD_CHUNKED_POSITION_OLD: &str =
    "io.containers.zstd-chunked.manifest-position";
/// Tag name of a manifest in an OCI layout's index.json.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// The compression a layer media type implies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerCompression {
    /// Plain tar.
    None,
    /// gzip.
    Gzip,
    /// zstd.
    Zstd,
}

/// Classifies a layer media type; `None` for types that are not layers ferry knows.
pub fn layer_compression(media_type: &str) -> Option<LayerCompression> {
    match media_type {
        LAYER_TAR | DOCKER_LAYER_TAR => Some(LayerCompression::None),
        LAYER_TAR_GZIP | DOCKER_LAYER_GZIP => Some(LayerCompression::Gzip),
        LAYER_TAR_ZSTD => Some(LayerCompression::Zstd),
        _ if media_type.ends_with("+gzip") || media_type.ends_with(".tar.gzip") => {
            Some(LayerCompression::Gzip)
        }
        _ if media_type.ends_with("+zstd") => Some(LayerCompression::Zstd),
        _ if media_type.ends_with(".tar") => Some(LayerCompression::None),
        _ => None,
    }
}
