//! The backend layer: where an image's manifest, indexes and layer bytes come from (an
//! OCI layout on disk or a registry over HTTP Range), and how each layer's reader is
//! wired to the device and cache layers.
//!
//! Per layer, the best way in: a ferry index referring to the image (found in a layout
//! through the `sha256-<hex>` tag fallback, in a registry through the referrers API or
//! its tag fallback) → span-by-span lazy reads through the chunk store (a version-2
//! index's windows blob is reached beside the layer blob, [`RangeSource::sibling`]: the
//! mount fetches only the index blob, windows come with the spans that need them); an eStargz TOC
//! annotation → lazy reads of the members the TOC names; neither → the whole blob,
//! fetched once (in parallel Range requests from a registry), verified against the
//! layer digest, kept in the chunk store and served from there.
//!
//! The image's startup trace ([`crate::trace`]) is found beside the index artifact, the
//! same way, by [`find_trace`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ferry_index::estargz::EstargzLayer;
use ferry_index::ferryidx::{LayerIndex, MAX_INDEX_BYTES};
use ferry_index::inflated::InflatedSpans;
use ferry_index::merged::MergedImage;
use ferry_index::reader::{LayerFormat, LayerReader};
use ferry_index::source::{FileSource, RangeSource};
use ferry_oci::media::{
    ANNOTATION_ESTARGZ_TOC, FERRY_INDEX_ARTIFACT, FERRY_LAYER_INDEX, layer_compression,
};
use ferry_oci::{Descriptor, ImageIndex, ImageManifest, ImageRef, OciLayout, Platform};
use ferry_registry_client::{Client, DownloadOptions, RangeRuntime, Repo};
use ferry_store::{ChunkKey, Store};

use crate::device::{ChunkSource, FetchConfig, LayerSource, Limiter};
use crate::error::{Error, Result};
use crate::range_source::HttpRangeSource;
use crate::stats::MountStats;
use crate::trace::Recorder;
use crate::tree::{Ino, InodeTree, Node};

/// Most bytes of a manifest or index document accepted.
const MAX_DOCUMENT_BYTES: u64 = ferry_oci::MAX_MANIFEST_BYTES;

/// One layer as the backend offers it.
pub struct LayerSpec {
    /// The manifest's descriptor of the layer.
    pub descriptor: Descriptor,
    /// Its ferry index, when one refers to the image.
    pub index: Option<Arc<LayerIndex>>,
    /// The layer blob's bytes.
    pub source: Arc<dyn RangeSource>,
    /// Set for registry layers: how to download the whole blob in parallel.
    remote: Option<RemoteBlob>,
    /// Where spans that do not verify are fetched again: the registry itself, when
    /// `source` may be served by a pull mirror.
    fallback: Option<Arc<dyn RangeSource>>,
}

impl std::fmt::Debug for LayerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerSpec")
            .field("digest", &self.descriptor.digest().to_string())
            .field("indexed", &self.index.is_some())
            .finish()
    }
}

impl LayerSpec {
    /// A layer read through `source` (a local blob, or anything else with random
    /// access), with its ferry index when one is known.
    pub fn new(
        descriptor: Descriptor,
        index: Option<Arc<LayerIndex>>,
        source: Arc<dyn RangeSource>,
    ) -> LayerSpec {
        LayerSpec {
            descriptor,
            index,
            source,
            remote: None,
            fallback: None,
        }
    }

    /// A layer of a registry image: HTTP Range reads of its blob (and of the registry
    /// itself for spans that do not verify, when a pull mirror may serve the blob), the
    /// parallel whole-blob download, and its ferry index when one is known. Nothing is
    /// asked of the registry here.
    pub fn from_registry(
        client: &Client,
        repo: &Repo,
        descriptor: Descriptor,
        index: Option<Arc<LayerIndex>>,
        runtime: &RangeRuntime,
    ) -> Result<LayerSpec> {
        let source = HttpRangeSource::with_runtime(
            client.clone(),
            repo.clone(),
            descriptor.digest().as_ref(),
            descriptor.size(),
            runtime,
        )?;
        let fallback = source
            .origin_fallback()
            .map(|f| Arc::new(f) as Arc<dyn RangeSource>);
        Ok(LayerSpec {
            descriptor,
            index,
            source: Arc::new(source),
            fallback,
            remote: Some(RemoteBlob {
                client: client.clone(),
                repo: repo.clone(),
                runtime: runtime.clone(),
            }),
        })
    }
}

#[derive(Clone)]
struct RemoteBlob {
    client: Client,
    repo: Repo,
    runtime: RangeRuntime,
}

/// An image as the backend offers it: its layers, lowest first.
#[derive(Debug)]
pub struct ImageSource {
    /// Digest of the image manifest.
    pub manifest_digest: String,
    /// The layers.
    pub layers: Vec<LayerSpec>,
}

impl ImageSource {
    /// Opens an image in an OCI layout (`reference` a tag or manifest digest).
    pub fn from_layout(dir: &Path, reference: &str) -> Result<ImageSource> {
        let layout = OciLayout::open(dir)?;
        let (mdesc, manifest) = layout.image_manifest(reference)?;
        let indexes = ferry_index::image::layout_indexes(&layout, &mdesc)?;
        let mut layers = Vec::new();
        for layer in manifest.layers() {
            let path = layout.blob_path(layer.digest())?;
            let file = FileSource::open(&path)
                .map_err(|e| Error::io(format!("opening layer blob {}", path.display()), e))?;
            if file.len() != layer.size() {
                return Err(Error::Invalid(format!(
                    "layer {} is {} bytes, the manifest says {}",
                    layer.digest(),
                    file.len(),
                    layer.size()
                )));
            }
            layers.push(LayerSpec {
                descriptor: layer.clone(),
                index: indexes.get(layer.digest().as_ref()).cloned(),
                source: Arc::new(file),
                remote: None,
                fallback: None,
            });
        }
        Ok(ImageSource {
            manifest_digest: mdesc.digest().to_string(),
            layers,
        })
    }

    /// Opens an image in a registry: the manifest (for an image index, the entry for
    /// this machine's platform), the ferry index artifact referring to it (referrers API
    /// or tag fallback), and an HTTP Range source per layer. Call from a thread that is
    /// not inside a tokio runtime.
    pub fn from_registry(
        client: &Client,
        repo: &Repo,
        reference: &str,
        runtime: &RangeRuntime,
    ) -> Result<ImageSource> {
        let (mdesc, manifest) = registry_manifest(client, repo, reference, runtime)?;
        let digest = mdesc.digest().to_string();
        let indexes = registry_indexes(client, repo, &digest, runtime)?;
        let mut layers = Vec::new();
        for layer in manifest.layers() {
            let index = indexes.get(layer.digest().as_ref()).cloned();
            layers.push(LayerSpec::from_registry(
                client,
                repo,
                layer.clone(),
                index,
                runtime,
            )?);
        }
        Ok(ImageSource {
            manifest_digest: digest,
            layers,
        })
    }

    /// Opens `image` (`oci:DIR[:TAG]` or a registry reference) with `client` for
    /// registries.
    pub fn open(image: &str, client: &Client, runtime: &RangeRuntime) -> Result<ImageSource> {
        let image = ImageRef::parse(image)?;
        match &image {
            ImageRef::Layout { dir, reference } => Self::from_layout(dir, reference.as_str()),
            ImageRef::Registry {
                registry,
                repository,
                ..
            } => Self::from_registry(
                client,
                &Repo::new(registry.clone(), repository.clone()),
                image.reference(),
                runtime,
            ),
        }
    }
}

/// The image manifest `reference` names in a registry (for an image index, the entry
/// for this machine's platform) and its descriptor. Call from a thread that is not
/// inside a tokio runtime.
pub fn registry_manifest(
    client: &Client,
    repo: &Repo,
    reference: &str,
    runtime: &RangeRuntime,
) -> Result<(Descriptor, ImageManifest)> {
    runtime
        .handle()
        .block_on(fetch_registry_manifest(client, repo, reference))
}

/// [`registry_manifest`], for callers already in an async context (on `client`'s
/// runtime).
pub async fn fetch_registry_manifest(
    client: &Client,
    repo: &Repo,
    reference: &str,
) -> Result<(Descriptor, ImageManifest)> {
    let mut doc = client.get_manifest(repo, reference, &[]).await?;
    if is_index(&doc.bytes) {
        let index: ImageIndex = serde_json::from_slice(&doc.bytes)
            .map_err(|e| Error::Invalid(format!("image index {}: {e}", doc.digest)))?;
        // Never "the first manifest": a mount of another architecture would fail later
        // and obscurely; the error names the platforms the index has.
        let pick = ferry_oci::choose_manifest(&index, &Platform::host())
            .map_err(|e| Error::Invalid(format!("image index {}: {e}", doc.digest)))?
            .digest()
            .to_string();
        doc = client.get_manifest(repo, &pick, &[]).await?;
    }
    let manifest: ImageManifest = serde_json::from_slice(&doc.bytes)
        .map_err(|e| Error::Invalid(format!("image manifest {}: {e}", doc.digest)))?;
    let digest = ferry_oci::layout::digest(&doc.digest)?;
    let media = if doc.media_type.is_empty() {
        ferry_oci::media::OCI_MANIFEST
    } else {
        doc.media_type.as_str()
    };
    let desc = ferry_oci::layout::descriptor(media, digest, doc.bytes.len() as u64, &[]);
    Ok((desc, manifest))
}

/// The startup trace published for the image manifest `manifest_digest` of `image`
/// (`oci:DIR[:TAG]` or a registry reference), found like its ferry index (layout
/// referrers tag; registry referrers API or tag fallback). `None` when there is none.
pub fn find_trace(
    image: &str,
    manifest_digest: &str,
    client: &Client,
    runtime: &RangeRuntime,
) -> Result<Option<crate::trace::Trace>> {
    match ImageRef::parse(image)? {
        ImageRef::Layout { dir, .. } => {
            let layout = OciLayout::open(&dir)?;
            let digest = ferry_oci::layout::digest(manifest_digest)?;
            let subject =
                ferry_oci::layout::descriptor(ferry_oci::media::OCI_MANIFEST, digest, 0, &[]);
            crate::trace::find_layout_trace(&layout, &subject)
        }
        ImageRef::Registry {
            registry,
            repository,
            ..
        } => crate::trace::find_registry_trace(
            client,
            &Repo::new(registry, repository),
            manifest_digest,
            runtime,
        ),
    }
}

fn is_index(bytes: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(default)]
        manifests: Option<serde_json::Value>,
    }
    serde_json::from_slice::<Probe>(bytes).is_ok_and(|p| p.manifests.is_some())
}

/// Most index blobs [`registry_indexes`] fetches at once.
const INDEX_FETCHES: usize = 8;

/// The ferry indexes referring to manifest `subject` in a registry: layer digest → index.
/// The index blobs are fetched at once (they are independent), so opening an image
/// costs the same round trips however many layers it has.
fn registry_indexes(
    client: &Client,
    repo: &Repo,
    subject: &str,
    runtime: &RangeRuntime,
) -> Result<HashMap<String, Arc<LayerIndex>>> {
    use futures_util::{StreamExt, TryStreamExt};
    runtime.handle().block_on(async {
        let blobs = registry_index_blobs(client, repo, subject).await?;
        futures_util::stream::iter(
            blobs
                .iter()
                .map(|blob| fetch_index_blob(client, repo, blob)),
        )
        .buffer_unordered(INDEX_FETCHES)
        .map_ok(|index| (index.layer_digest.clone(), Arc::new(index)))
        .try_collect()
        .await
    })
}

/// The ferry index blobs of the index artifacts that refer to manifest `subject` in a
/// registry (referrers API or its tag fallback, then each artifact's manifest), each
/// checked for size. Fetch one with [`fetch_index_blob`].
pub async fn registry_index_blobs(
    client: &Client,
    repo: &Repo,
    subject: &str,
) -> Result<Vec<Descriptor>> {
    let referrers = client
        .referrers(repo, subject, Some(FERRY_INDEX_ARTIFACT))
        .await?;
    let mut out = Vec::new();
    for referrer in referrers.manifests() {
        let doc = client
            .get_manifest(repo, referrer.digest().as_ref(), &[])
            .await?;
        if doc.bytes.len() as u64 > MAX_DOCUMENT_BYTES {
            continue;
        }
        let artifact: ImageManifest = serde_json::from_slice(&doc.bytes)
            .map_err(|e| Error::Invalid(format!("index artifact {}: {e}", doc.digest)))?;
        if artifact
            .subject()
            .as_ref()
            .map(|s| s.digest().to_string())
            .as_deref()
            != Some(subject)
        {
            continue;
        }
        for blob in artifact.layers() {
            if blob.media_type().to_string() != FERRY_LAYER_INDEX {
                continue;
            }
            if blob.size() > MAX_INDEX_BYTES as u64 {
                return Err(Error::Invalid(format!(
                    "index blob {} is larger than {MAX_INDEX_BYTES} bytes",
                    blob.digest()
                )));
            }
            out.push(blob.clone());
        }
    }
    Ok(out)
}

/// Fetches one ferry index blob (as [`registry_index_blobs`] lists it), checks it against
/// its digest and decodes it.
pub async fn fetch_index_blob(
    client: &Client,
    repo: &Repo,
    blob: &Descriptor,
) -> Result<LayerIndex> {
    if blob.size() > MAX_INDEX_BYTES as u64 {
        return Err(Error::Invalid(format!(
            "index blob {} is larger than {MAX_INDEX_BYTES} bytes",
            blob.digest()
        )));
    }
    let digest = blob.digest().to_string();
    let stream = client.blob_stream(repo, &digest, None).await?;
    let bytes = stream.collect_body("index blob", blob.size()).await?;
    if ferry_oci::sha256_digest(&bytes).to_string() != digest {
        return Err(Error::Invalid(format!(
            "index blob {digest} does not match its digest"
        )));
    }
    Ok(ferry_index::image::decode_index_blob(blob, &bytes)?)
}

/// Which tree a mount shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum View {
    /// Every layer merged, whiteouts applied.
    Merged,
    /// One layer (by digest), whiteouts presented for overlayfs.
    Layer(String),
}

/// An image wired for serving: the merged view over cached, verified sources, its inode
/// tree and its counters.
#[derive(Debug)]
pub struct MountedImage {
    /// The layers and their merged table.
    pub image: MergedImage,
    /// The tree the mount shows.
    pub tree: InodeTree,
    /// Live counters.
    pub stats: Arc<MountStats>,
    /// Digest of the image manifest.
    pub manifest_digest: String,
    /// The image's published startup trace, when one was found (prefetched first).
    pub trace: Option<crate::trace::Trace>,
    /// The layer a single-layer mount shows (`None`: merged).
    pub view_layer: Option<usize>,
    /// Per layer, its device-level source when it has one (indexed and eStargz
    /// layers), for warm-up.
    pub(crate) sources: Vec<Option<Arc<LayerSource>>>,
    /// Records reads while a trace is being recorded; shared with the other mounts of
    /// the same image when they record into one trace ([`MountedImage::share_recorder`]).
    pub(crate) recorder: Arc<Recorder>,
    /// This mount's id in a shared recorder ([`Recorder::note`]'s `view`).
    pub(crate) recorder_view: u64,
    /// What this mount's misses have asked of [`crate::nearby`] already.
    pub(crate) nearby: crate::nearby::Nearby,
}

/// Source of [`MountedImage::recorder_view`] ids (unique in the process).
static NEXT_RECORDER_VIEW: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl MountedImage {
    /// Wires every layer of `source` through the chunk store (`store`, when given) with
    /// `config`, and builds the tree of `view`.
    pub fn new(
        source: ImageSource,
        store: Option<Arc<Store>>,
        config: FetchConfig,
        view: &View,
    ) -> Result<MountedImage> {
        let stats = Arc::new(MountStats::default());
        let limiter = Limiter::new(config.concurrency);
        let mut readers = Vec::new();
        let mut sources = Vec::new();
        let mut chosen = None;
        for (i, layer) in source.layers.into_iter().enumerate() {
            if let View::Layer(d) = view
                && layer.descriptor.digest().as_ref() == d.as_str()
            {
                chosen = Some(i);
            }
            MountStats::add(&stats.bytes_total, layer.descriptor.size());
            let (reader, source) =
                layer_reader(layer, store.clone(), limiter.clone(), config, stats.clone())?;
            readers.push(reader);
            sources.push(source);
        }
        let image = MergedImage::new(readers);
        let tree = match view {
            View::Merged => InodeTree::merged(&image),
            View::Layer(d) => {
                let i =
                    chosen.ok_or_else(|| Error::Invalid(format!("the image has no layer {d}")))?;
                InodeTree::single_layer(&image, i)
                    .ok_or_else(|| Error::Invalid(format!("layer {d} cannot be read")))?
            }
        };
        Ok(MountedImage {
            image,
            tree,
            stats,
            manifest_digest: source.manifest_digest,
            trace: None,
            view_layer: chosen.filter(|_| matches!(view, View::Layer(_))),
            sources,
            recorder: Arc::default(),
            recorder_view: NEXT_RECORDER_VIEW.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            nearby: crate::nearby::Nearby::new(&config),
        })
    }

    /// Opens `image` (`oci:DIR[:TAG]` or a registry reference) with
    /// [`ImageSource::open`], wires it with [`MountedImage::new`] and fills
    /// [`MountedImage::trace`] with its published startup trace ([`find_trace`]); a
    /// trace that cannot be read is logged and skipped (it only makes startup faster).
    /// Call from a thread that is not inside a tokio runtime.
    pub fn open(
        image: &str,
        client: &Client,
        runtime: &RangeRuntime,
        store: Option<Arc<Store>>,
        config: FetchConfig,
        view: &View,
    ) -> Result<MountedImage> {
        let source = ImageSource::open(image, client, runtime)?;
        let mut mounted = MountedImage::new(source, store, config, view)?;
        match find_trace(image, &mounted.manifest_digest, client, runtime) {
            Ok(trace) => mounted.trace = trace,
            Err(e) => tracing::warn!(image, error = %e, "startup trace not usable; ignored"),
        }
        Ok(mounted)
    }

    /// Starts recording reads into a startup trace (discarding an earlier recording).
    pub fn start_recording(&self) {
        self.recorder.start();
    }

    /// Stops recording and returns the reads recorded, in first-touch order.
    pub fn take_trace(&self) -> crate::trace::Trace {
        self.recorder.take()
    }

    /// Records this mount's reads into `recorder` (shared with other mounts, e.g. the
    /// layer mounts of one image) instead of its own. Call before serving.
    pub fn share_recorder(&mut self, recorder: Arc<Recorder>) {
        self.recorder = recorder;
    }

    /// The recorder this mount notes its reads into.
    pub fn recorder(&self) -> &Arc<Recorder> {
        &self.recorder
    }

    /// The mount's layers as [`crate::nearby`]'s planner sees them.
    pub(crate) fn nearby_layers(&self) -> crate::nearby::MountLayers<'_> {
        crate::nearby::MountLayers {
            image: &self.image,
            sources: &self.sources,
        }
    }

    /// Whether `[offset, offset + len)` of file `node` is all local: a read of it would
    /// not wait for the network.
    pub(crate) fn read_is_local(&self, node: &Node, offset: u64, len: u64) -> bool {
        use crate::nearby::Layers as _;
        let Some(loc) = node.data else {
            return true;
        };
        let layers = self.nearby_layers();
        layers
            .ranges(loc, offset, len)
            .iter()
            .all(|r| layers.local(loc.layer, r))
    }

    /// After a read of file `ino` at `offset` that waited returned `data`: what its bytes tell of
    /// reads to come. An ELF header of a file too large to come whole: its loader's
    /// segments go to the background ([`crate::nearby::Nearby::plan_loader`]).
    pub(crate) fn read_landed(&self, ino: Ino, node: &Node, offset: u64, data: &[u8]) {
        if offset != 0 || !data.starts_with(b"\x7fELF") {
            return;
        }
        let Some(source) = node.data.and_then(|loc| self.layer_source(loc.layer)) else {
            return;
        };
        let read = crate::nearby::Read {
            ino,
            node,
            offset,
            len: data.len() as u64,
        };
        let spent = crate::nearby::Spent::of(&self.stats);
        let ranges = self
            .nearby
            .plan_loader(&self.nearby_layers(), &read, data, spent);
        if ranges.is_empty() {
            return;
        }
        tracing::debug!(
            path = self.tree.path_of(ino).unwrap_or_default(),
            bytes = ranges.iter().map(|r| r.end - r.start).sum::<u64>(),
            "nearby: loader segments asked"
        );
        crate::nearby::submit(source, &self.stats, ranges, crate::stats::Guess::Rest);
    }

    /// Asks [`crate::nearby`] for what belongs with a read of `[offset, offset + len)` of
    /// file `ino` (nothing unless the read misses): its neighbours go to the background,
    /// its whole file is fetched here, as the read's own request, before it reads.
    pub(crate) fn read_nearby(&self, ino: Ino, node: &Node, offset: u64, len: u64) {
        let Some(source) = node.data.and_then(|loc| self.layer_source(loc.layer)) else {
            return;
        };
        let spent = crate::nearby::Spent::of(&self.stats);
        let read = crate::nearby::Read {
            ino,
            node,
            offset,
            len,
        };
        let asks = self.nearby.plan(&self.nearby_layers(), &read, spent);
        if asks == crate::nearby::Asks::default() {
            return;
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                path = self.tree.path_of(ino).unwrap_or_default(),
                whole = asks.whole.as_ref().map_or(0, |r| r.end - r.start),
                neighbours = asks.neighbours.iter().map(|r| r.end - r.start).sum::<u64>(),
                fetched = spent.fetched,
                served = spent.served,
                rest_unused = spent.rest_unused,
                neighbours_unused = spent.neighbours_unused,
                "nearby: asked"
            );
        }
        // The neighbours first, so they travel while the read waits for its file.
        crate::nearby::submit(
            source,
            &self.stats,
            asks.neighbours,
            crate::stats::Guess::Neighbours,
        );
        if let Some(range) = asks.whole {
            match source.fetch_for_read(range.clone()) {
                Ok(n) => MountStats::add(&self.stats.bytes_nearby, n),
                // The read fetches what it needs itself (and reports what fails).
                Err(e) => tracing::debug!(
                    start = range.start,
                    end = range.end,
                    error = %e,
                    "fetching the file whole failed"
                ),
            }
        }
    }

    /// The device-level source of layer `layer`, when it has one.
    pub fn layer_source(&self, layer: usize) -> Option<&Arc<LayerSource>> {
        self.sources.get(layer)?.as_ref()
    }
}

/// Default bound of the process's inflated-span cache ([`inflated_spans`]).
pub const DEFAULT_INFLATED_SPANS_BYTES: usize = 16 << 20;

static INFLATED_SPANS: std::sync::OnceLock<Arc<InflatedSpans>> = std::sync::OnceLock::new();

/// The process's cache of recently inflated spans, shared by every mount's indexed gzip
/// layers (see [`ferry_index::inflated`]): bounded memory that spares a start the
/// repeated inflating of spans whose neighbouring files it reads one after another.
/// Whoever keeps mounts should tick [`InflatedSpans::release_idle`] every few seconds.
pub fn inflated_spans() -> &'static Arc<InflatedSpans> {
    INFLATED_SPANS.get_or_init(|| InflatedSpans::new(DEFAULT_INFLATED_SPANS_BYTES))
}

/// Sets the bound of [`inflated_spans`] (0: off). Only before the first mount: false
/// (and no change) once the cache exists.
pub fn configure_inflated_spans(max_bytes: usize) -> bool {
    INFLATED_SPANS.set(InflatedSpans::new(max_bytes)).is_ok()
}

/// How often [`release_idle_inflated_spans`] drops what was not used since its last
/// tick: a burst's memory is back within two ticks of its end.
pub const INFLATED_IDLE_TICK: std::time::Duration = std::time::Duration::from_secs(5);

/// Starts a thread that ticks [`InflatedSpans::release_idle`] of [`inflated_spans`]
/// every [`INFLATED_IDLE_TICK`] for the life of the process; for processes that keep
/// mounts (the daemon, `ferry mount`).
pub fn release_idle_inflated_spans() {
    let spawned = std::thread::Builder::new()
        .name("ferry-inflated-idle".into())
        .spawn(|| {
            loop {
                std::thread::sleep(INFLATED_IDLE_TICK);
                inflated_spans().release_idle();
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the inflated-span cache's idle release; it stays at most full");
    }
}

/// The reader of one layer, wired through the device and cache layers, and its
/// device-level source when it has one.
fn layer_reader(
    layer: LayerSpec,
    store: Option<Arc<Store>>,
    limiter: Arc<Limiter>,
    config: FetchConfig,
    stats: Arc<MountStats>,
) -> Result<(LayerReader, Option<Arc<LayerSource>>)> {
    let digest = layer.descriptor.digest().to_string();
    if let Some(index) = layer.index {
        if index.compressed_size != layer.descriptor.size() {
            return Err(Error::Invalid(format!(
                "the index of {digest} is for a {}-byte blob",
                index.compressed_size
            )));
        }
        let windows = match &index.windows {
            Some(w) => {
                let backend = layer.source.sibling(&w.digest, w.size).ok_or_else(|| {
                    Error::Invalid(format!(
                        "the index of {digest} keeps its windows in blob {}, which cannot be \
                         reached beside the layer",
                        w.digest
                    ))
                })?;
                let fallback = layer
                    .fallback
                    .as_ref()
                    .and_then(|f| f.sibling(&w.digest, w.size));
                Some((backend, fallback))
            }
            None => None,
        };
        let mut source = LayerSource::indexed(layer.source, &index, store, limiter, config, stats);
        if let Some(fallback) = layer.fallback {
            source = source.with_fallback(fallback);
        }
        if let Some((backend, fallback)) = windows {
            source = source.with_windows(backend, fallback);
        }
        let source = source.into_shared();
        let reader = LayerReader::new(LayerFormat::Indexed(index), source.clone())
            .with_windows(source.clone())
            .with_inflated_cache(inflated_spans().clone());
        return Ok((reader, Some(source)));
    }
    let toc = layer
        .descriptor
        .annotations()
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_ESTARGZ_TOC))
        .cloned();
    if let Some(toc) = toc {
        let mut source = LayerSource::passthrough(layer.source, limiter, config, stats);
        if let Some(store) = store {
            source = source.with_whole_blob(store, &digest);
        }
        let source = Arc::new(source);
        let esgz = EstargzLayer::open(source.as_ref(), Some(&toc))?;
        let reader = LayerReader::new(LayerFormat::Estargz(Arc::new(esgz)), source.clone());
        return Ok((reader, Some(source)));
    }
    let media = layer.descriptor.media_type().to_string();
    let compression = layer_compression(&media).ok_or_else(|| {
        Error::Invalid(format!(
            "layer {digest} has media type {media}, which is not a layer ferry can read"
        ))
    })?;
    let whole = whole_blob(&layer, store.as_deref(), &stats)?;
    Ok((LayerReader::whole(whole, compression)?, None))
}

/// The whole blob of an unindexed layer: from the chunk store when there, else fetched
/// (in parallel Range requests from a registry), verified against the layer digest and
/// stored.
fn whole_blob(
    layer: &LayerSpec,
    store: Option<&Store>,
    stats: &MountStats,
) -> Result<Arc<dyn RangeSource>> {
    let digest = layer.descriptor.digest().to_string();
    let key = ChunkKey::parse(&digest)?;
    if let Some(store) = store
        && let Some(chunk) = store.open_chunk(&key)?
    {
        MountStats::add(&stats.cache_hits, 1);
        return Ok(Arc::new(ChunkSource(chunk)));
    }
    MountStats::add(&stats.cache_misses, 1);
    let Some(remote) = &layer.remote else {
        // A local layout blob: already on this machine, read it in place.
        return Ok(layer.source.clone());
    };
    let tmp_dir = store
        .map(|s| s.root().to_path_buf())
        .unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::NamedTempFile::new_in(&tmp_dir)
        .or_else(|_| tempfile::NamedTempFile::new())
        .map_err(|e| Error::io("creating a temporary file for a whole layer", e))?;
    let opts = DownloadOptions::from_config(remote.client.config());
    remote
        .runtime
        .handle()
        .block_on(remote.client.download_blob(
            &remote.repo,
            &digest,
            layer.descriptor.size(),
            tmp.path(),
            &opts,
        ))?;
    MountStats::add(&stats.bytes_fetched, layer.descriptor.size());
    if let Some(store) = store {
        let mut file = std::fs::File::open(tmp.path())
            .map_err(|e| Error::io("reopening a downloaded layer", e))?;
        match store.put_reader(&key, &mut file) {
            Ok(_) => {
                if let Some(chunk) = store.open_chunk(&key)? {
                    return Ok(Arc::new(ChunkSource(chunk)));
                }
            }
            Err(e) => tracing::warn!(error = %e, layer = %digest, "whole layer not stored"),
        }
    }
    // download_blob verified the digest; serve from the (unlinked) temporary file.
    let source =
        FileSource::open(tmp.path()).map_err(|e| Error::io("opening a downloaded layer", e))?;
    drop(tmp);
    Ok(Arc::new(source))
}
