//! The mounted image: an image's layers wired through the device and cache layers (per
//! layer the best way in), their merged table, the inode tree a mount shows
//! ([`tree`]), the reads a recording notes ([`recorder`]), and the guesses a read that
//! misses makes of the reads to come ([`nearby`], with [`elf`] for a library's loader).
//!
//! Per layer, the best way in: a ferry index referring to the image (found by
//! [`crate::backend`]) → span-by-span lazy reads through the chunk store (a version-2
//! index's windows blob is reached beside the layer blob, [`RangeSource::sibling`]: the
//! mount fetches only the index blob, windows come with the spans that need them); an eStargz TOC
//! annotation → lazy reads of the members the TOC names; neither → the whole blob,
//! fetched once (in parallel Range requests from a registry), verified against the
//! layer digest, kept in the chunk store and served from there.
//!
//! It must not speak to a registry or a layout itself (that is [`crate::backend`]) nor
//! know the transport ([`crate::fuse`] sits on top of it).

pub use ferry_index::elf;
mod imports;
mod interpreter;
pub mod nearby;
mod needed;
pub mod pyc;
pub mod recorder;
pub mod tree;

use std::sync::Arc;

use ferry_index::image::{
    LayerWay, indexed_reader, indexed_windows, toc_reader, whole_compression,
};
use ferry_index::inflated::InflatedSpans;
use ferry_index::merged::{Location, MergedImage};
use ferry_index::reader::LayerReader;
use ferry_index::source::{FileSource, RangeSource};
use ferry_registry_client::{Client, RangeRuntime};
use ferry_store::{ChunkKey, Store};

use crate::backend::{ImageSource, LayerSpec, find_trace};
use crate::device::{ChunkSource, FetchConfig, LayerSource, Limiter};
use crate::error::{Error, Result};
use crate::stats::MountStats;
use recorder::Recorder;
use tree::{Ino, InodeTree, Node};

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
    /// What this mount's misses have asked of [`nearby`] already.
    pub(crate) nearby: nearby::Nearby,
    /// The file cache the mount's FUSE server reads from, when it has one (set once by
    /// [`crate::fuse::FerryFs::with_file_cache`]): guesses that read a small file whole
    /// keep it in its small-file pack ([`imports`]).
    pub(crate) files: std::sync::OnceLock<Arc<crate::filecache::FileCache>>,
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
        let limiter = Limiter::with_per_blob(config.concurrency, config.layer_concurrency);
        let mut readers = Vec::new();
        let mut sources = Vec::new();
        let mut chosen = None;
        let mut key = Vec::new();
        for (i, layer) in source.layers.into_iter().enumerate() {
            let shown = match view {
                View::Layer(d) => layer.descriptor.digest().as_ref() == d.as_str(),
                View::Merged => true,
            };
            if shown && matches!(view, View::Layer(_)) {
                chosen = Some(i);
            }
            if shown {
                MountStats::add(&stats.bytes_total, layer.descriptor.size());
            }
            key.push(layer.descriptor.digest().to_string());
            let (reader, source) =
                layer_reader(layer, store.clone(), limiter.clone(), config, stats.clone())?;
            readers.push(reader);
            sources.push(source);
        }
        let image = match view {
            View::Layer(_) if readers.len() > 1 => shared_merged(key, readers),
            _ => MergedImage::new(readers),
        };
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
            nearby: nearby::Nearby::new(&config),
            files: std::sync::OnceLock::new(),
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

    /// The mount's layers as [`nearby`]'s planner sees them.
    pub(crate) fn nearby_layers(&self) -> nearby::MountLayers<'_> {
        nearby::MountLayers {
            image: &self.image,
            sources: &self.sources,
        }
    }

    /// Whether `[offset, offset + len)` of file `node` is all local: a read of it would
    /// not wait for the network.
    pub(crate) fn read_is_local(&self, node: &Node, offset: u64, len: u64) -> bool {
        use nearby::Layers as _;
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
    /// reads to come. An ELF header: the libraries it names are followed
    /// ([`needed`]); of a file too large to come whole, its loader's segments go to
    /// the background too ([`nearby::Nearby::plan_loader`]). A compiled Python module:
    /// the modules it imports are followed ([`imports`]). A Python interpreter's binary,
    /// read by process `pid` (0: unknown) as it `exec`s it: the interpreter's start and
    /// its command line are followed ([`interpreter`]).
    pub(crate) fn read_landed(
        self: &Arc<Self>,
        ino: Ino,
        node: &Node,
        offset: u64,
        data: &[u8],
        pid: u32,
    ) {
        if offset != 0 {
            return;
        }
        if data.get(2..4) == Some(b"\r\n") {
            self.module_landed(node, data);
            return;
        }
        if !data.starts_with(b"\x7fELF") {
            return;
        }
        self.read_landed_loader(ino, node, offset, data);
        if let Some(loc) = node.data {
            self.follow_libraries(loc);
        }
        self.interpreter_landed(ino, node, data, pid);
    }

    /// A read at the start of file `ino` returned `data`, whether it waited or not (a
    /// header may come local with a neighbour's span): an interpreter's binary is being
    /// `exec`ed, and its start is followed ([`interpreter`]; once per binary per mount).
    pub(crate) fn interpreter_landed(
        self: &Arc<Self>,
        ino: Ino,
        node: &Node,
        data: &[u8],
        pid: u32,
    ) {
        if data.starts_with(b"\x7fELF")
            && self.nearby.follows_headers()
            && let Some(loc) = node.data
            && let Some(path) = self.tree.path_of(ino)
            && interpreter::is_interpreter(&path)
        {
            self.follow_interpreter(loc, &path, pid);
        }
    }

    /// A read at the start of a file returned `data`, whether it waited or not: a
    /// compiled Python module read whole has its imports followed ([`imports`]) — the
    /// interpreter runs it next — and theirs in turn, ahead of the interpreter.
    pub(crate) fn module_landed(self: &Arc<Self>, node: &Node, data: &[u8]) {
        if data.get(2..4) == Some(b"\r\n")
            && self.nearby.follows_headers()
            && let Some(loc) = node.data
        {
            self.follow_imports(loc, data);
        }
    }

    /// A read of `[offset, offset + len)` of the file at `loc` was served without its
    /// layer (from the small-file pack): the guesses that fetched those bytes were used.
    pub(crate) fn note_guess_used(&self, loc: Location, offset: u64, len: u64) {
        let (Some(source), Some(layer)) = (
            self.layer_source(loc.layer),
            self.image.layers().get(loc.layer),
        ) else {
            return;
        };
        for r in layer.ranges_for(loc.entry, offset, len) {
            source.note_used_range(&r);
        }
    }

    fn read_landed_loader(&self, ino: Ino, node: &Node, offset: u64, data: &[u8]) {
        let Some(source) = node.data.and_then(|loc| self.layer_source(loc.layer)) else {
            return;
        };
        let read = nearby::Read {
            ino,
            node,
            offset,
            len: data.len() as u64,
        };
        let spent = nearby::Spent::of(&self.stats);
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
        nearby::submit(
            source,
            &self.stats,
            ranges,
            crate::stats::Guess::Rest,
            nearby::Urgency::Now,
        );
    }

    /// Asks [`nearby`] for what belongs with a read of `[offset, offset + len)` of
    /// file `ino` (nothing unless the read misses): its neighbours go to the background,
    /// its whole file is fetched here, as the read's own request, before it reads.
    pub(crate) fn read_nearby(&self, ino: Ino, node: &Node, offset: u64, len: u64) {
        let Some(source) = node.data.and_then(|loc| self.layer_source(loc.layer)) else {
            return;
        };
        let spent = nearby::Spent::of(&self.stats);
        let read = nearby::Read {
            ino,
            node,
            offset,
            len,
        };
        let asks = self.nearby.plan(&self.nearby_layers(), &read, spent);
        if asks == nearby::Asks::default() {
            return;
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                path = self.tree.path_of(ino).unwrap_or_default(),
                whole = asks.whole.as_ref().map_or(0, |r| r.end - r.start),
                neighbours = asks.neighbours.iter().map(|r| r.end - r.start).sum::<u64>(),
                inits = asks.inits.iter().map(|r| r.end - r.start).sum::<u64>(),
                fetched = spent.fetched,
                served = spent.served,
                rest_unused = spent.rest_unused,
                neighbours_unused = spent.neighbours_unused,
                "nearby: asked"
            );
        }
        // The subpackages' inits and the neighbours first, so they travel while the read
        // waits for its file.
        nearby::submit(
            source,
            &self.stats,
            asks.inits,
            crate::stats::Guess::Rest,
            nearby::Urgency::Later,
        );
        nearby::submit(
            source,
            &self.stats,
            asks.neighbours,
            crate::stats::Guess::Neighbours,
            nearby::Urgency::Later,
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

/// A layer stack's merged table, keyed by its layers' digests and entry counts.
type TableKey = Vec<(String, usize)>;

/// A merged table, as mounts share it.
type SharedTable = std::sync::Weak<std::collections::BTreeMap<String, Location>>;

/// Merged tables of layer stacks, each kept while a mount holds it.
static MERGED_TABLES: std::sync::LazyLock<
    parking_lot::Mutex<std::collections::HashMap<TableKey, SharedTable>>,
> = std::sync::LazyLock::new(Default::default);

/// `readers` (layers `digests`, lowest first) merged over one table shared by every
/// mount of the same stack: each layer's mount of an image holds the image's other
/// layers too (for its followers), and the table of a 40,000-path image is several MB
/// and tens of milliseconds to build, which five mounts need not repeat.
fn shared_merged(digests: Vec<String>, readers: Vec<LayerReader>) -> MergedImage {
    let key: TableKey = digests
        .into_iter()
        .zip(readers.iter().map(|r| r.entries().len()))
        .collect();
    let mut tables = MERGED_TABLES.lock();
    if let Some(table) = tables.get(&key).and_then(std::sync::Weak::upgrade) {
        return MergedImage::with_table(readers, table);
    }
    tables.retain(|_, t| t.strong_count() > 0);
    let image = MergedImage::new(readers);
    tables.insert(key, Arc::downgrade(image.shared_table()));
    image
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
    match LayerWay::of(&layer.descriptor, layer.index.clone()) {
        LayerWay::Indexed(index) => {
            // The windows blob beside the layer, and beside its fallback when it has one.
            let windows =
                indexed_windows(&layer.descriptor, &index, layer.source.as_ref())?.map(|backend| {
                    let fallback = match (&index.windows, &layer.fallback) {
                        (Some(w), Some(f)) => f.sibling(&w.digest, w.size),
                        _ => None,
                    };
                    (backend, fallback)
                });
            let mut source =
                LayerSource::indexed(layer.source, &index, store, limiter, config, stats);
            if let Some(fallback) = layer.fallback {
                source = source.with_fallback(fallback);
            }
            if let Some((backend, fallback)) = windows {
                source = source.with_windows(backend, fallback);
            }
            let source = source.into_shared();
            let reader = indexed_reader(index, source.clone(), Some(source.clone()))
                .with_inflated_cache(inflated_spans().clone());
            Ok((reader, Some(source)))
        }
        way @ (LayerWay::Estargz { .. } | LayerWay::ZstdChunked { .. }) => {
            let mut source = LayerSource::passthrough(layer.source, limiter, config, stats);
            if let Some(store) = store {
                source = source.with_whole_blob(store, &digest);
            }
            let source = Arc::new(source);
            let reader = toc_reader(&way, source.clone())?;
            Ok((reader, Some(source)))
        }
        LayerWay::Whole => {
            let compression = whole_compression(&layer.descriptor)?;
            let whole = whole_blob(&layer, store.as_deref(), &stats)?;
            Ok((LayerReader::whole(whole, compression)?, None))
        }
    }
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
    if !layer.is_remote() {
        // A local layout blob: already on this machine, read it in place.
        return Ok(layer.source.clone());
    }
    let tmp_dir = store
        .map(|s| s.root().to_path_buf())
        .unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::NamedTempFile::new_in(&tmp_dir)
        .or_else(|_| tempfile::NamedTempFile::new())
        .map_err(|e| Error::io("creating a temporary file for a whole layer", e))?;
    layer.download_whole(tmp.path())?;
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
