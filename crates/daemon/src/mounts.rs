//! Every lazy mount of the node, made and taken down in this process: one chunk store,
//! one registry client and one I/O runtime shared by all of them.
//!
//! [`MountBackend`] is the narrow interface the control API and the snapshotter hook
//! use, so they can be tested with an in-memory backend. [`MountManager`] is the real
//! one. Its methods block (registry round trips, FUSE mount/unmount): call them from
//! plain threads or `spawn_blocking`, never from an async task, and never while holding
//! a lock a FUSE callback needs (FUSE callbacks run on fuser's own threads).
//!
//! With an fd holder ([`MountManager::with_fd_holder`], see [`crate::fdstore`]) every
//! mount's `/dev/fuse` descriptor is also kept by the holder process, with a
//! [`KeptMount`] record, so the kernel connection outlives this process.
//! [`MountManager::resume_kept`] (first thing after a restart) serves those connections
//! again; a normal unmount (control API, snapshot removal, unmounted from outside) and
//! the SIGTERM shutdown of control mounts release the held copy, so no connection is
//! kept alive for nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_fs::{
    FerryFs, FileCache, ImageSource, LayerSpec, MountOptions, MountedImage, StatsSnapshot, View,
    WarmHandle,
};
use ferry_index::ferryidx::LayerIndex;
use ferry_index::image::LayerWay;
use ferry_index::source::RangeSource;
use ferry_oci::media::LayerCompression;
use ferry_oci::{Descriptor, ImageRef};
use ferry_registry_client::{Client, RangeRuntime, Repo};
use ferry_store::Store;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::autotrace::{
    FoundTrace, ImageTraceMap, ImageTraces, NodeTraces, RegistryTraces, RemoteTraces, StopReason,
    StopRule, TraceSource, TraceUse,
};
use crate::config::DaemonConfig;
use crate::error::{Error, Result};
use crate::fallback::FallbackLog;
use crate::fdstore::FdHolderClient;
use crate::indexes::{ClientIndexRegistry, LayerIndexes, ResolvedLayer, StoreFirstRegistry};

#[path = "prewarm.rs"]
pub mod prewarm;
pub use prewarm::{PrewarmEvent, PrewarmOutcome, PrewarmRequest};

/// How long an opened OCI layout image's manifest and indexes are reused for further
/// mounts of the same reference (the snapshotter mounts an image's layers one Prepare at
/// a time; registry images are resolved through [`LayerIndexes`] instead).
const IMAGE_CACHE_TTL: Duration = Duration::from_secs(60);
/// Most images remembered at once.
const IMAGE_CACHE_ENTRIES: usize = 32;
/// Longest a mount's warm-up waits for its image's trace lookup before it starts
/// without a trace (the lookup runs in the background; the mount never waits for it).
const TRACE_LOOKUP_WAIT: Duration = Duration::from_secs(10);
/// Longest a mount's trace prefetch waits for its image's pull to mount the image's
/// other lazy layers ([`crate::settle`]): a pull's mounts follow each other within
/// tens of milliseconds; an image whose pull stops short (a layer mounted some other
/// way) loses at most this much of its prefetch.
const PULL_SETTLE_WAIT: Duration = Duration::from_secs(2);
/// Longest it then waits for the image's unindexed layers to be unpacked (a small top
/// layer takes ~0.1 s; one unpacked for an earlier image is never announced).
const UNPACK_SETTLE_WAIT: Duration = Duration::from_millis(500);

/// Ask for a mount (`POST /v1/mounts`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountRequest {
    /// `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    pub image: String,
    /// An existing directory, absolute.
    pub mountpoint: PathBuf,
    /// Mount only this layer (overlayfs lower-layer view).
    #[serde(default)]
    pub layer: Option<String>,
}

/// Who asked for a mount; decides what happens to it when the daemon stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MountOrigin {
    /// `ferry mount` over the control socket: unmounted when the daemon stops.
    Control,
    /// The snapshotter's lazy layers: left for the next start to restore.
    Snapshotter,
}

/// A mount that was made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountInfo {
    /// Canonical mount point.
    pub mountpoint: PathBuf,
    /// The image as requested.
    pub image: String,
    /// The layer, for a single-layer mount.
    pub layer: Option<String>,
    /// The image manifest's digest.
    pub manifest_digest: String,
}

/// A live mount and its counters (`GET /v1/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountStatus {
    /// What was mounted.
    #[serde(flatten)]
    pub info: MountInfo,
    /// Who asked.
    pub origin: MountOrigin,
    /// Its counters.
    pub stats: StatsSnapshot,
    /// The startup trace its prefetch uses, once looked up (`None`: none, or not yet).
    #[serde(default)]
    pub trace: Option<TraceUse>,
    /// True while its reads are recorded into a startup trace.
    #[serde(default)]
    pub recording: bool,
}

/// The chunk store as status reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStatus {
    /// Its directory.
    pub path: PathBuf,
    /// Committed entries.
    pub entries: u64,
    /// Bytes stored.
    pub bytes: u64,
    /// The bound.
    pub max_bytes: u64,
    /// The read-only seed store under it (`[store] seed`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<ferry_store::SeedStats>,
}

/// How a layer can be served lazily.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayerKind {
    /// A ferry index refers to the image for this layer.
    FerryIndex,
    /// The layer is eStargz (TOC digest annotation).
    Estargz,
    /// The layer is zstd:chunked (manifest checksum annotation).
    ZstdChunked,
    /// Neither: it would have to be fetched whole (an index would make it lazy).
    Plain,
    /// Neither, and its format cannot be indexed (zstd, an unknown media type).
    Unsupported,
}

impl LayerKind {
    /// True when reads can start before the layer is downloaded.
    pub fn is_lazy(self) -> bool {
        !matches!(self, LayerKind::Plain | LayerKind::Unsupported)
    }
}

/// The mount operations the control API and the snapshotter hook need.
pub trait MountBackend: Send + Sync {
    /// Mounts `request` (see [`MountManager::mount`]).
    fn mount(&self, request: &MountRequest, origin: MountOrigin) -> Result<MountInfo>;
    /// Unmounts what this backend mounted at `mountpoint`.
    fn unmount(&self, mountpoint: &Path) -> Result<()>;
    /// Detaches a mount at `mountpoint` that this backend does not serve (a previous
    /// daemon's leftover); nothing there is not an error.
    fn detach_stale(&self, mountpoint: &Path) -> Result<()>;
    /// Every live mount.
    fn list(&self) -> Vec<MountStatus>;
    /// The chunk store, if there is one.
    fn store_status(&self) -> Option<StoreStatus>;
    /// The file cache's counters, if there is one.
    fn file_cache_status(&self) -> Option<ferry_fs::FileCacheSnapshot> {
        None
    }
    /// The peer counters, when `[p2p]` is on.
    fn p2p_status(&self) -> Option<crate::p2p::P2pSnapshot> {
        None
    }
    /// How `layer` of `image` can be served, and the image's manifest digest. `ahead`
    /// names the layers to be prepared after this one (CRI's image-layers label): their
    /// lookups may start now, so their own calls find them done or in flight.
    fn layer_kind(&self, image: &str, layer: &str, ahead: &[String])
    -> Result<(LayerKind, String)>;
    /// `layer` of the image with manifest `manifest` was unpacked the ordinary way and
    /// committed: its pull has moved past it ([`crate::settle`]).
    fn layer_unpacked(&self, _manifest: &str, _layer: &str) {}
    /// The record of layers not served lazily, when this backend keeps one.
    fn fallbacks(&self) -> Option<&FallbackLog> {
        None
    }
    /// Makes an image's hot set (or all of it) local ([`MountManager::prewarm`]).
    fn prewarm(
        &self,
        _request: &PrewarmRequest,
        _progress: &dyn ferry_fs::warm::prewarm::PrewarmProgress,
    ) -> Result<PrewarmOutcome> {
        Err(Error::InvalidRequest(
            "this daemon cannot prewarm images".into(),
        ))
    }
}

/// One layer as last opened: descriptor, ferry index, range source.
type TemplateLayer = (Descriptor, Option<Arc<LayerIndex>>, Arc<dyn RangeSource>);

/// A registry image's layers with their indexes (if any), in manifest order.
type SiblingLayers = Arc<Vec<(Descriptor, Option<Arc<LayerIndex>>)>>;

/// An image's layers as last opened.
struct ImageTemplate {
    opened: Instant,
    manifest_digest: String,
    layers: Vec<TemplateLayer>,
}

impl ImageTemplate {
    fn of(source: &ImageSource) -> ImageTemplate {
        ImageTemplate {
            opened: Instant::now(),
            manifest_digest: source.manifest_digest.clone(),
            layers: source
                .layers
                .iter()
                .map(|l| (l.descriptor.clone(), l.index.clone(), l.source.clone()))
                .collect(),
        }
    }

    fn kind(&self, layer: &str) -> Option<LayerKind> {
        let (desc, index, _) = self
            .layers
            .iter()
            .find(|(d, _, _)| d.digest().as_ref() == layer)?;
        Some(layer_kind_of(desc, index.is_some()))
    }
}

/// What a layer's descriptor and index say about lazy serving.
pub fn layer_kind_of(descriptor: &Descriptor, has_index: bool) -> LayerKind {
    match LayerWay::of(descriptor, has_index.then_some(())) {
        LayerWay::Indexed(()) => LayerKind::FerryIndex,
        LayerWay::Estargz { .. } => LayerKind::Estargz,
        LayerWay::ZstdChunked { .. } => LayerKind::ZstdChunked,
        // `ferry index` indexes gzip and plain tar layers only.
        LayerWay::Whole => {
            match ferry_oci::media::layer_compression(descriptor.media_type().as_ref()) {
                Some(LayerCompression::Gzip | LayerCompression::None) => LayerKind::Plain,
                Some(LayerCompression::Zstd) | None => LayerKind::Unsupported,
            }
        }
    }
}

struct ActiveMount {
    info: MountInfo,
    origin: MountOrigin,
    image: Arc<MountedImage>,
    session: fuser::BackgroundSession,
    warm: WarmCell,
}

/// A mount's warm-up, started in the background once its trace lookup answered.
#[derive(Default)]
struct WarmSlot {
    handle: Option<WarmHandle>,
    trace: Option<TraceUse>,
    /// The mount went away (or was handed over): a late warm-up is not started.
    closed: bool,
}

/// The mount's [`WarmSlot`]; dropping it stops the warm-up (and releases its pins).
struct WarmCell(Arc<Mutex<WarmSlot>>);

impl WarmCell {
    /// Leaves the hot set pinned for the next daemon (see [`WarmHandle::keep_pins`]).
    fn keep_pins(&self) {
        let handle = {
            let mut slot = self.0.lock();
            slot.closed = true;
            slot.handle.take()
        };
        if let Some(h) = handle {
            h.keep_pins();
        }
    }

    fn trace(&self) -> Option<TraceUse> {
        self.0.lock().trace.clone()
    }
}

impl Drop for WarmCell {
    fn drop(&mut self) {
        let handle = {
            let mut slot = self.0.lock();
            slot.closed = true;
            slot.handle.take()
        };
        drop(handle);
    }
}

/// Version of the [`KeptMount`] record; a record of another version is not resumed.
pub const KEPT_FORMAT: u32 = 1;

/// What the fd holder keeps beside a mount's `/dev/fuse` descriptor: enough to serve
/// the same connection again from a new process — the same image (pinned to its
/// manifest, so the inode numbers the kernel holds mean the same files) and view, and
/// the connection's negotiated INIT data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeptMount {
    /// [`KEPT_FORMAT`].
    pub format: u32,
    /// The mount as made (image as requested, layer, manifest digest, mount point).
    pub info: MountInfo,
    /// Who asked for it.
    pub origin: MountOrigin,
    /// The connection's negotiated FUSE ABI version.
    pub init: ferry_fs::fuse::InitRecord,
    /// How often the connection was resumed (0: served by the process that mounted it).
    pub generation: u16,
}

impl KeptMount {
    /// The record as the holder stores it.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self)
            .map_err(|e| Error::InvalidRequest(format!("encoding a kept mount: {e}")))
    }

    /// Parses and checks a record from the holder, kept under `key`.
    pub fn from_json(key: &str, text: &str) -> Result<KeptMount> {
        let record: KeptMount = serde_json::from_str(text)
            .map_err(|e| Error::InvalidRequest(format!("kept mount record: {e}")))?;
        if record.format != KEPT_FORMAT {
            return Err(Error::InvalidRequest(format!(
                "kept mount record format {} (this daemon reads {KEPT_FORMAT})",
                record.format
            )));
        }
        if record.info.mountpoint.as_os_str() != key {
            return Err(Error::InvalidRequest(format!(
                "kept mount record for {} held under {key:?}",
                record.info.mountpoint.display()
            )));
        }
        if let Some(layer) = &record.info.layer {
            check_layer_digest(layer)?;
        }
        Ok(record)
    }

    /// The image to open again: the one mounted, pinned to its manifest.
    pub fn pinned_image(&self) -> Result<String> {
        pin_image(&self.info.image, &self.info.manifest_digest)
    }
}

/// How [`MountManager::resume_kept`] went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResumeReport {
    /// Connections served again.
    pub resumed: Vec<PathBuf>,
    /// Held descriptors dropped: connection ended, nothing mounted there any more, or a
    /// record this daemon cannot use.
    pub dropped: Vec<PathBuf>,
    /// Connections that could not be resumed, released (the snapshotter's restore
    /// detaches and mounts those layers afresh).
    pub failed: Vec<PathBuf>,
}

/// Mount points this process serves; [`detach_stale_mount`] never detaches them.
static SERVED_HERE: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

fn mark_served(mountpoint: &Path, served: bool) {
    let mut set = SERVED_HERE.lock();
    if served {
        set.insert(mountpoint.to_path_buf());
    } else {
        set.remove(mountpoint);
    }
}

fn served_here(mountpoint: &Path) -> bool {
    SERVED_HERE.lock().contains(mountpoint)
}

/// True when the FUSE connection behind `device` is still up (a connection whose mount
/// is gone reports an error on poll). Never reads from it: a read would take a request.
pub fn connection_alive(device: BorrowedFd<'_>) -> bool {
    crate::fdstore::fd_alive(device)
}

/// The node's mounts, served by this process.
pub struct MountManager {
    store: Arc<Store>,
    client: Client,
    runtime: RangeRuntime,
    config: DaemonConfig,
    mounts: Mutex<BTreeMap<PathBuf, ActiveMount>>,
    /// Mount points with a mount in progress (so two requests cannot race for one).
    pending: Mutex<HashSet<PathBuf>>,
    /// OCI layout images opened for single-layer mounts.
    images: Mutex<HashMap<String, Arc<ImageTemplate>>>,
    /// Registry images' layers and indexes, resolved once per image and shared by the
    /// Prepares of its layers.
    indexes: LayerIndexes,
    /// Per registry image (repository and manifest digest), its layers with their
    /// indexes, resolved at the first of its layers' mounts and given to every
    /// one of them (see [`Self::with_siblings`]); kept [`IMAGE_CACHE_TTL`].
    siblings: Mutex<HashMap<(Repo, String), (Instant, SiblingLayers)>>,
    /// Startup traces looked up (and recorded) per image manifest, kept as long as
    /// opened images (longer while recording), so the layers of one image (one mount
    /// each under the snapshotter) ask once and record into one trace.
    traces: Mutex<ImageTraceMap>,
    /// Where traces are looked up and shared beyond this node.
    remote: Arc<dyn RemoteTraces>,
    /// The node's own traces (`traces/` in the store directory).
    node_traces: Option<Arc<NodeTraces>>,
    /// Decompressed copies of fully local files, shared by every mount.
    file_cache: Option<Arc<FileCache>>,
    /// The process keeping every mount's `/dev/fuse` descriptor across restarts.
    holder: Option<FdHolderClient>,
    /// Peers: the blobs served to them and the fetcher lazy layers ask first.
    p2p: Option<PeerWiring>,
    /// Layers the snapshotter did not serve lazily, per image.
    fallbacks: FallbackLog,
}

/// What a lazy layer needs to be served to peers and read from them.
#[derive(Debug, Clone)]
pub struct PeerWiring {
    /// The blobs this node serves to peers.
    pub catalog: Arc<crate::p2p::BlobCatalog>,
    /// Where layers ask peers.
    pub fetcher: Arc<crate::p2p::fetch::PeerFetcher>,
}

impl std::fmt::Debug for MountManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountManager")
            .field("store", &self.store.root())
            .field("mounts", &self.mounts.lock().keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// The absolute path of `path` with its parent resolved, without touching `path`
/// itself (a dead FUSE mount there cannot be stat'ed).
pub fn canonical_mountpoint(path: &Path) -> Result<PathBuf> {
    if !path.is_absolute() {
        return Err(Error::InvalidRequest(format!(
            "mount point {} is not an absolute path",
            path.display()
        )));
    }
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(Error::InvalidRequest(format!(
            "cannot mount on {}",
            path.display()
        )));
    };
    let parent = parent
        .canonicalize()
        .map_err(|e| Error::InvalidRequest(format!("mount point {}: {e}", path.display())))?;
    Ok(parent.join(name))
}

/// Checks a layer digest's shape before it goes anywhere.
fn check_layer_digest(layer: &str) -> Result<()> {
    ferry_oci::digest::parse_sha256(layer)
        .map(|_| ())
        .map_err(|e| Error::InvalidRequest(format!("not a layer digest: {e}")))
}

/// `image` pinned to `manifest_digest` (so a moved tag cannot change a restored layer).
pub fn pin_image(image: &str, manifest_digest: &str) -> Result<String> {
    let digest = ferry_oci::digest::parse_sha256(manifest_digest)
        .map_err(|e| Error::InvalidRequest(format!("manifest digest: {e}")))?;
    let pinned = match ImageRef::parse(image)
        .map_err(|e| Error::InvalidRequest(format!("image {image:?}: {e}")))?
    {
        ImageRef::Layout { dir, .. } => ImageRef::Layout {
            dir,
            reference: ferry_oci::Reference::Digest(digest),
        },
        ImageRef::Registry {
            registry,
            repository,
            tag,
            ..
        } => ImageRef::Registry {
            registry,
            repository,
            tag,
            digest: Some(digest),
        },
    };
    Ok(pinned.to_string())
}

/// Detaches whatever FUSE mount is at `mountpoint` (a leftover of a previous daemon),
/// lazily so a busy one goes too. Nothing there is not an error, and neither is a mount
/// this process serves (e.g. one resumed from the fd holder): that one is not stale and
/// is left alone.
pub fn detach_stale_mount(mountpoint: &Path) -> Result<()> {
    use nix::errno::Errno;
    use nix::mount::{MntFlags, umount2};
    if !ferry_fs::is_mounted(mountpoint) {
        return Ok(());
    }
    if served_here(mountpoint) {
        tracing::debug!(mountpoint = %mountpoint.display(), "served by this daemon: not detached");
        return Ok(());
    }
    match umount2(mountpoint, MntFlags::MNT_DETACH) {
        Ok(()) => {
            tracing::info!(mountpoint = %mountpoint.display(), "detached a stale mount");
            return Ok(());
        }
        Err(Errno::EPERM) => {}
        // A path with a NUL byte cannot name a mount point.
        Err(Errno::EINVAL) if mountpoint.as_os_str().as_encoded_bytes().contains(&0) => {
            return Err(Error::InvalidRequest(format!(
                "{} contains a NUL byte",
                mountpoint.display()
            )));
        }
        Err(e) => {
            return Err(Error::io(
                format!("detaching the stale mount at {}", mountpoint.display()),
                e.into(),
            ));
        }
    }
    let status = std::process::Command::new("fusermount3")
        .arg("-uz")
        .arg(mountpoint)
        .status()
        .map_err(|e| Error::io("running fusermount3 -uz", e))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::InvalidRequest(format!(
            "fusermount3 -uz {} failed ({status})",
            mountpoint.display()
        )))
    }
}

/// A ferry FUSE mount found dead when the daemon started (see [`clean_dead_mounts`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadMount {
    /// Where it was mounted.
    pub mountpoint: PathBuf,
    /// Detached (lazily); false when that failed (see `error`).
    pub detached: bool,
    /// Why it could not be detached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How long the start-up sweep waits for one mount's answer before leaving it alone.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Detaches every ferry FUSE mount of this mount namespace whose connection ended
/// (`ENOTCONN`: its server and every copy of its descriptor died, e.g. the daemon and
/// the fd holder both killed -9): such a mount answers nothing ever again and blocks a
/// new mount at its mount point. Mounts this process serves, connections still open
/// (answering, or kept by a holder whose daemon is away) and other filesystems are left
/// alone. Call at start, after [`MountManager::resume_kept`].
pub fn clean_dead_mounts() -> Vec<DeadMount> {
    let mut seen = BTreeSet::new();
    let mut found = Vec::new();
    for mountpoint in ferry_fs::fuse::ferry_mountpoints() {
        if served_here(&mountpoint) || !seen.insert(mountpoint.clone()) {
            continue;
        }
        if ferry_fs::fuse::probe_connection(&mountpoint, PROBE_TIMEOUT)
            != ferry_fs::fuse::ConnectionProbe::Dead
        {
            continue;
        }
        let detached = detach_stale_mount(&mountpoint);
        match &detached {
            Ok(()) => {
                tracing::info!(mountpoint = %mountpoint.display(), "detached a dead ferry mount (connection ended)")
            }
            Err(e) => {
                tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "cannot detach a dead ferry mount")
            }
        }
        found.push(DeadMount {
            mountpoint,
            detached: detached.is_ok(),
            error: detached.err().map(|e| e.to_string()),
        });
    }
    found
}

impl MountManager {
    /// A manager over `store`, with a registry client and I/O runtime built from `config`.
    pub fn new(store: Arc<Store>, config: DaemonConfig) -> Result<MountManager> {
        let client = Client::new(config.client_config())?;
        let runtime = RangeRuntime::new()?;
        let file_cache = if config.file_cache.enabled {
            match FileCache::open(&config.file_cache, Some(store.clone())) {
                Ok(cache) => Some(Arc::new(cache)),
                Err(e) => {
                    // Reads still work, only slower: not a reason to refuse to start.
                    tracing::warn!(error = %e, "file cache unavailable; cached files are served through FUSE");
                    None
                }
            }
        } else {
            None
        };
        let remote: Arc<dyn RemoteTraces> = Arc::new(RegistryTraces {
            client: client.clone(),
            runtime: runtime.clone(),
            timeout: config.fetch.timeout,
        });
        let traces_dir = store.root().join("traces");
        let node_traces = match NodeTraces::open(
            &traces_dir,
            config.trace.store_entries,
            config.trace.store_bytes,
        ) {
            Ok(t) => Some(Arc::new(t)),
            Err(e) => {
                tracing::warn!(error = %e, "node trace store unavailable; traces are not kept on this node");
                None
            }
        };
        let indexes = LayerIndexes::new(
            Arc::new(StoreFirstRegistry {
                registry: Arc::new(ClientIndexRegistry {
                    client: client.clone(),
                }),
                store: store.clone(),
            }),
            config.fetch.timeout,
        );
        Ok(MountManager {
            store,
            indexes,
            client,
            runtime,
            config,
            remote,
            node_traces,
            mounts: Mutex::new(BTreeMap::new()),
            pending: Mutex::new(HashSet::new()),
            images: Mutex::new(HashMap::new()),
            siblings: Mutex::new(HashMap::new()),
            traces: Mutex::new(HashMap::new()),
            file_cache,
            holder: None,
            p2p: None,
            fallbacks: FallbackLog::new(),
        })
    }

    /// Lazy registry layers mounted from now on are served to peers and read from them
    /// first (`[p2p]`).
    pub fn with_p2p(mut self, wiring: PeerWiring) -> MountManager {
        self.p2p = Some(wiring);
        self
    }

    /// The registry client (shared pool and tokens).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The layer of `repo` through peers: its spans (and its index's windows, when the
    /// index keeps them in a windows blob) registered for serving, its reads asked of
    /// peers first. Layers without a ferry index (no span digests to verify a peer's
    /// bytes against) are left alone.
    fn through_peers(&self, repo: &Repo, spec: LayerSpec) -> LayerSpec {
        let (Some(p2p), Some(index)) = (&self.p2p, &spec.index) else {
            return spec;
        };
        let blob = spec.descriptor.digest().clone();
        let Some(table) = crate::p2p::SpanTable::of_index(index, spec.descriptor.size()) else {
            return spec;
        };
        let table = Arc::new(table);
        p2p.catalog
            .register(blob.clone(), &repo.registry, table.clone());
        let windows = crate::p2p::SpanTable::of_windows(index).map(|(blob, table)| {
            let table = Arc::new(table);
            p2p.catalog
                .register(blob.clone(), &repo.registry, table.clone());
            (blob, table)
        });
        let (fetcher, repo) = (p2p.fetcher.clone(), repo.clone());
        spec.route_through(move |origin| {
            let source =
                crate::p2p::fetch::PeerRangeSource::new(origin, fetcher, repo, blob, table);
            Arc::new(match windows {
                Some((blob, table)) => source.with_windows(blob, table),
                None => source,
            })
        })
    }

    /// Keeps every mount's `/dev/fuse` descriptor in the holder `client` talks to (see
    /// the module doc). Call before the first mount and before [`Self::resume_kept`].
    pub fn with_fd_holder(mut self, client: FdHolderClient) -> MountManager {
        self.holder = Some(client);
        self
    }

    /// True when mounts are kept by an fd holder.
    pub fn keeps_connections(&self) -> bool {
        self.holder.is_some()
    }

    /// Hands a copy of a mount's descriptor to the holder; false (logged) if it failed:
    /// the mount works, it just will not survive a restart.
    fn keep(&self, record: &KeptMount, device: BorrowedFd<'_>) -> bool {
        let Some(holder) = &self.holder else {
            return false;
        };
        let key = record.info.mountpoint.to_string_lossy();
        let kept = record.to_json().and_then(|meta| {
            holder
                .put(&key, &meta, device)
                .map_err(|e| Error::Control(e.to_string()))
        });
        match kept {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(mountpoint = %key, error = %e, "fd holder did not take the mount; it will not survive a daemon restart");
                false
            }
        }
    }

    /// Tells the holder to close its copy of the descriptor of the mount at `mountpoint`.
    fn release_kept(&self, mountpoint: &Path) {
        mark_served(mountpoint, false);
        let Some(holder) = &self.holder else {
            return;
        };
        if let Err(e) = holder.remove(&mountpoint.to_string_lossy()) {
            tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "fd holder did not release the mount's connection");
        }
    }

    /// Serves again every connection the fd holder kept from an earlier daemon whose
    /// mount is still in place (the same image and view, pinned to its manifest, from
    /// the record). Call once at start, before the snapshotter restores its layers (they
    /// are then already served; see [`detach_stale_mount`]). A held connection that has
    /// ended, or whose mount point no longer shows a ferry mount, is released; one that
    /// cannot be resumed is released too (its connection then ends), so the snapshotter's
    /// restore mounts the layer afresh (today's path).
    pub fn resume_kept(&self) -> ResumeReport {
        let mut report = ResumeReport::default();
        let Some(holder) = &self.holder else {
            return report;
        };
        let entries = match holder.get_all() {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "fd holder: cannot list kept mounts; none resumed");
                return report;
            }
        };
        for entry in entries {
            let mountpoint = PathBuf::from(&entry.key);
            let record = match KeptMount::from_json(&entry.key, &entry.meta) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(mountpoint = %entry.key, error = %e, "kept mount record unusable; released");
                    self.release_kept(&mountpoint);
                    report.dropped.push(mountpoint);
                    continue;
                }
            };
            if !connection_alive(entry.fd.as_fd()) || !ferry_fs::is_mounted(&mountpoint) {
                tracing::info!(mountpoint = %mountpoint.display(), "kept connection ended or unmounted; released");
                self.release_kept(&mountpoint);
                report.dropped.push(mountpoint);
                continue;
            }
            match self.resume_one(record, entry.fd) {
                Ok(()) => report.resumed.push(mountpoint),
                Err(e) => {
                    // Released, the connection ends (no server, no holder): the
                    // snapshotter's restore detaches and remounts its layers; a
                    // `ferry mount` mount stays dead, as after a crash without a holder.
                    tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "cannot resume the kept connection; released");
                    self.release_kept(&mountpoint);
                    report.failed.push(mountpoint);
                }
            }
        }
        report
    }

    /// Serves the kept connection `device` of `record`'s mount from this process.
    fn resume_one(&self, mut record: KeptMount, device: OwnedFd) -> Result<()> {
        let mountpoint = record.info.mountpoint.clone();
        if self.mounts.lock().contains_key(&mountpoint) {
            return Err(Error::AlreadyMounted(mountpoint));
        }
        let image_ref = record.pinned_image()?;
        let source = self.source_for(&image_ref, record.info.layer.as_deref())?;
        if source.manifest_digest != record.info.manifest_digest {
            return Err(Error::InvalidRequest(format!(
                "image {image_ref} now has manifest {}, the kept mount served {}",
                source.manifest_digest, record.info.manifest_digest
            )));
        }
        let (image, traces) =
            self.mounted_image(&record.info.image, record.info.layer.as_deref(), source)?;
        record.generation = record.generation.checked_add(1).unwrap_or(1);
        let fs = FerryFs::with_file_cache(image.clone(), self.file_cache.clone())
            .resumed(record.generation);
        let opts = self.mount_options(&image);
        // The holder's copy is refreshed with the new generation (same connection).
        let kept_copy = device
            .try_clone()
            .map_err(|e| Error::io("duplicating the kept descriptor", e))?;
        let session = ferry_fs::fuse::resume(fs, device, &record.init, &opts)?;
        self.keep(&record, kept_copy.as_fd());
        drop(kept_copy);
        let warm = self.start_warm(&image, &mountpoint, traces);
        tracing::info!(
            mountpoint = %mountpoint.display(),
            image = %record.info.image,
            layer = record.info.layer.as_deref().unwrap_or("-"),
            origin = ?record.origin,
            generation = record.generation,
            "resumed the kept FUSE connection"
        );
        mark_served(&mountpoint, true);
        self.mounts.lock().insert(
            mountpoint,
            ActiveMount {
                info: record.info,
                origin: record.origin,
                image,
                session,
                warm,
            },
        );
        Ok(())
    }

    /// The image a mount serves: `layer` alone or the merged view, over the node store
    /// (fresh mounts and resumed connections alike), and its image's trace state. While
    /// the image's first start is recorded, its reads go into the image's shared
    /// recorder.
    fn mounted_image(
        &self,
        image: &str,
        layer: Option<&str>,
        source: ImageSource,
    ) -> Result<(Arc<MountedImage>, Arc<ImageTraces>)> {
        let view = match layer {
            Some(d) => View::Layer(d.to_string()),
            None => View::Merged,
        };
        let mut mounted = MountedImage::new(
            source,
            Some(self.store.clone()),
            self.config.fetch_config(),
            &view,
        )?;
        let traces = self.image_traces(image, &mounted.manifest_digest);
        if let Some(recorder) = self.recorder_for(image, &mounted.manifest_digest, &traces) {
            mounted.share_recorder(recorder);
        }
        Ok((Arc::new(mounted), traces))
    }

    fn mount_options(&self, image: &MountedImage) -> MountOptions {
        MountOptions {
            threads: self.config.fuse.threads,
            allow_other: self.config.fuse.allow_other,
            fsname: format!("ferry:{}", image.manifest_digest),
        }
    }

    /// The trace state of manifest `manifest` of `image`: looked up once per
    /// [`IMAGE_CACHE_TTL`] on a background thread (see [`crate::autotrace::lookup`]);
    /// with prefetch off, no trace. A state whose image is being recorded is kept.
    fn image_traces(&self, image: &str, manifest: &str) -> Arc<ImageTraces> {
        let mut map = self.traces.lock();
        let recording = |t: &ImageTraces| t.recorder.lock().is_some();
        if let Some((at, t)) = map.get(manifest)
            && (at.elapsed() < IMAGE_CACHE_TTL || recording(t))
        {
            return t.clone();
        }
        map.retain(|_, (at, t)| at.elapsed() < IMAGE_CACHE_TTL || recording(t));
        let traces = Arc::new(ImageTraces::default());
        map.insert(manifest.to_owned(), (Instant::now(), traces.clone()));
        drop(map);
        if !self.config.warm.prefetch {
            traces.set(None);
            return traces;
        }
        let (remote, node) = (self.remote.clone(), self.node_traces.clone());
        let (image, manifest) = (image.to_owned(), manifest.to_owned());
        let answer = traces.clone();
        let spawned = std::thread::Builder::new()
            .name("ferry-trace-lookup".into())
            .spawn(move || {
                let found = crate::autotrace::lookup(&*remote, node.as_deref(), &image, &manifest);
                match &found {
                    Some(f) => tracing::info!(image = %image, source = ?f.info.source, recorded_for = %f.info.recorded_for, reads = f.info.reads, "startup trace found"),
                    None => tracing::info!(image = %image, "no startup trace"),
                }
                if let Some(f) = &found
                    && f.info.source != TraceSource::PreviousVersion
                    && let Some(recorder) = answer.recorder.lock().take()
                {
                    // The image has its own trace after all: no need to record one.
                    recorder.take();
                }
                answer.set(found);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot look up the startup trace");
            traces.set(None);
        }
        traces
    }

    /// The recorder a new mount of manifest `manifest` notes its reads into: the image's
    /// shared one while its first start is recorded (started by its first mount), none
    /// when automatic recording is off or the image has its own trace.
    fn recorder_for(
        &self,
        image: &str,
        manifest: &str,
        traces: &Arc<ImageTraces>,
    ) -> Option<Arc<ferry_fs::image::recorder::Recorder>> {
        if !self.config.trace.auto_record || traces.has_own_trace() {
            return None;
        }
        let mut slot = traces.recorder.lock();
        if let Some(r) = &*slot {
            return Some(r.clone());
        }
        let recorder = Arc::new(ferry_fs::image::recorder::Recorder::default());
        recorder.start_passive();
        let rule = StopRule {
            quiet: self.config.trace.quiet,
            max_duration: self.config.trace.max_duration,
        };
        let watched = recorder.clone();
        let (remote, node, state) = (
            self.remote.clone(),
            self.node_traces.clone(),
            traces.clone(),
        );
        let image_name = image.to_owned();
        let (image, manifest) = (image.to_owned(), manifest.to_owned());
        // In the slot before the watcher looks at who holds the recorder.
        *slot = Some(recorder.clone());
        let spawned = std::thread::Builder::new()
            .name("ferry-trace-record".into())
            .spawn(move || {
                // Held here, in the image's slot and by each mount recording into it.
                let alive = || Arc::strong_count(&watched) > 2;
                let reason =
                    crate::autotrace::watch(&watched, &rule, &crate::autotrace::SystemClock, &alive);
                let trace = watched.take();
                if reason == StopReason::Cancelled || trace.reads.is_empty() {
                    state.recorder.lock().take();
                    return;
                }
                tracing::info!(image = %image, ?reason, reads = trace.reads.len(), files = trace.files(), bytes = trace.bytes(), "recorded a startup trace");
                state.set(Some(FoundTrace {
                    info: TraceUse {
                        source: TraceSource::Node,
                        recorded_for: manifest.clone(),
                        reads: trace.reads.len(),
                        bytes: trace.bytes(),
                    },
                    trace: trace.clone(),
                }));
                // After the answer: a mount made meanwhile sees the trace, not a gap.
                state.recorder.lock().take();
                let shared =
                    crate::autotrace::share(&*remote, node.as_deref(), &image, &manifest, &trace);
                tracing::info!(image = %image, ?shared, "shared the startup trace");
            });
        match spawned {
            Ok(_) => {
                tracing::info!(image = %image_name, "recording a startup trace during the first start");
                Some(recorder)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot record a startup trace");
                slot.take();
                recorder.take();
                None
            }
        }
    }

    /// The chunk store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Layer `layer` of `image` when `image` is in a registry (`None` for an OCI layout),
    /// through [`LayerIndexes`]: the lookups of `ahead` layers start too.
    fn registry_layer(
        &self,
        image: &str,
        layer: &str,
        ahead: &[String],
    ) -> Result<Option<(Repo, ResolvedLayer)>> {
        let parsed = ImageRef::parse(image)
            .map_err(|e| Error::InvalidRequest(format!("image {image:?}: {e}")))?;
        let ferry_oci::ImageRef::Registry {
            registry,
            repository,
            ..
        } = &parsed
        else {
            return Ok(None);
        };
        let repo = Repo::new(registry.clone(), repository.clone());
        let resolved = self.runtime.handle().block_on(self.indexes.resolve(
            &repo,
            parsed.reference(),
            layer,
            ahead,
        ))?;
        Ok(Some((repo, resolved)))
    }

    /// Opens the OCI layout image `image` afresh and remembers its layers for
    /// [`IMAGE_CACHE_TTL`].
    fn open_image(&self, image: &str) -> Result<ImageSource> {
        let source = ImageSource::open(image, &self.client, &self.runtime)?;
        let mut images = self.images.lock();
        images.retain(|_, t| t.opened.elapsed() < IMAGE_CACHE_TTL);
        if images.len() >= IMAGE_CACHE_ENTRIES
            && let Some(oldest) = images
                .iter()
                .min_by_key(|(_, t)| t.opened)
                .map(|(k, _)| k.clone())
        {
            images.remove(&oldest);
        }
        images.insert(image.to_owned(), Arc::new(ImageTemplate::of(&source)));
        Ok(source)
    }

    fn cached(&self, image: &str) -> Option<Arc<ImageTemplate>> {
        self.images
            .lock()
            .get(image)
            .filter(|t| t.opened.elapsed() < IMAGE_CACHE_TTL)
            .cloned()
    }

    /// The pull of manifest `manifest` of `image` brings in its `layers` (digest, and
    /// whether it is mounted lazily), but for the lazy ones this node serves already
    /// (shared with an image pulled before): its prefetch waits for them
    /// ([`crate::settle`]).
    fn expect_layers(&self, image: &str, manifest: &str, layers: &[(String, bool)]) {
        let served: HashSet<String> = self
            .mounts
            .lock()
            .values()
            .filter_map(|m| m.info.layer.clone())
            .collect();
        let lazy = layers
            .iter()
            .filter(|(l, lazy)| *lazy && !served.contains(l))
            .map(|(l, _)| l.clone());
        let unpacked = layers
            .iter()
            .filter(|(_, lazy)| !*lazy)
            .map(|(l, _)| l.clone());
        self.image_traces(image, manifest)
            .settle
            .expect(lazy, unpacked);
    }

    /// `spec` (a layer of registry image `image` in `repo`, manifest `manifest`) with
    /// the image's other indexed layers around it, in manifest order, for a mount that
    /// shows `spec`'s layer only. The mount reads nothing of the others by itself: its
    /// followers resolve a program's libraries and a Python import in the whole image
    /// and fetch them through these (containerd mounts each layer on its own, and
    /// `libc` or the standard library is rarely in the layer of the program that loads
    /// it). Resolved once per image, at its first layer's mount, from the indexes its
    /// Prepares fetch anyway; when that fails the mount has its own layer only.
    fn with_siblings(
        &self,
        image: &str,
        repo: &Repo,
        manifest: &str,
        spec: LayerSpec,
    ) -> Vec<LayerSpec> {
        let key = (repo.clone(), manifest.to_owned());
        let known = {
            let mut siblings = self.siblings.lock();
            siblings.retain(|_, (at, _)| at.elapsed() < IMAGE_CACHE_TTL);
            siblings.get(&key).map(|(_, s)| s.clone())
        };
        let siblings = match known {
            Some(s) => s,
            None => {
                let resolved = self
                    .runtime
                    .handle()
                    .block_on(self.indexes.layers_with_indexes(repo, manifest));
                match resolved {
                    Ok(found) => {
                        let found = Arc::new(found);
                        let mut siblings = self.siblings.lock();
                        if siblings.len() < IMAGE_CACHE_ENTRIES {
                            siblings.insert(key, (Instant::now(), found.clone()));
                        }
                        found
                    }
                    Err(e) => {
                        tracing::debug!(image, error = %e, "a layer mounted without the image's other layers");
                        return vec![spec];
                    }
                }
            }
        };
        let mut layers = Vec::with_capacity(siblings.len());
        let mut own = Some(spec);
        for (desc, index) in siblings.iter() {
            if let Some(spec) = own.take_if(|s| s.descriptor.digest() == desc.digest()) {
                layers.push(spec);
                continue;
            }
            let Some(index) = index else { continue };
            match LayerSpec::from_registry(
                &self.client,
                repo,
                desc.clone(),
                Some(index.clone()),
                &self.runtime,
            ) {
                Ok(s) => layers.push(self.through_peers(repo, s)),
                Err(e) => tracing::debug!(image, error = %e, "a sibling layer left out"),
            }
        }
        // Not in the manifest resolved (cannot happen for a layer resolved from it):
        // the layer alone.
        match own {
            Some(spec) => vec![spec],
            None => layers,
        }
    }

    /// The source to mount: the whole image for a merged view; for one layer that layer
    /// and the image's other indexed layers, which the mount shows nothing of and reads
    /// only for its followers (see [`Self::with_siblings`]); resolved once per image.
    fn source_for(&self, image: &str, layer: Option<&str>) -> Result<ImageSource> {
        let Some(layer) = layer else {
            return Ok(ImageSource::open(image, &self.client, &self.runtime)?);
        };
        if let Some((repo, resolved)) = self.registry_layer(image, layer, &[])? {
            self.expect_layers(image, &resolved.manifest_digest, &resolved.layers);
            let spec = LayerSpec::from_registry(
                &self.client,
                &repo,
                resolved.descriptor.clone(),
                resolved.index.clone(),
                &self.runtime,
            )?;
            let spec = self.through_peers(&repo, spec);
            // The siblings are looked up while the cache still holds this layer's
            // index, so it is not fetched a second time; then the cache lets go of it.
            let layers = self.with_siblings(image, &repo, &resolved.manifest_digest, spec);
            self.indexes.taken(&repo, &resolved);
            return Ok(ImageSource {
                manifest_digest: resolved.manifest_digest,
                layers,
            });
        }
        if let Some(template) = self.cached(image)
            && let Some((desc, index, _)) = template
                .layers
                .iter()
                .find(|(d, _, _)| d.digest().as_ref() == layer)
            && layer_kind_of(desc, index.is_some()).is_lazy()
        {
            let layers: Vec<(String, bool)> = template
                .layers
                .iter()
                .map(|(d, i, _)| {
                    (
                        d.digest().to_string(),
                        layer_kind_of(d, i.is_some()).is_lazy(),
                    )
                })
                .collect();
            self.expect_layers(image, &template.manifest_digest, &layers);
            // The layer, and the image's other indexed layers for its followers (see
            // `with_siblings`).
            let layers = template
                .layers
                .iter()
                .filter(|(d, i, _)| d.digest().as_ref() == layer || i.is_some())
                .map(|(d, i, s)| LayerSpec::new(d.clone(), i.clone(), s.clone()))
                .collect();
            return Ok(ImageSource {
                manifest_digest: template.manifest_digest.clone(),
                layers,
            });
        }
        let mut source = self.open_image(image)?;
        source
            .layers
            .retain(|l| l.descriptor.digest().as_ref() == layer || l.index.is_some());
        if !source
            .layers
            .iter()
            .any(|l| l.descriptor.digest().as_ref() == layer)
        {
            return Err(Error::InvalidRequest(format!(
                "image {image} has no layer {layer}"
            )));
        }
        Ok(source)
    }

    fn mount_reserved(
        &self,
        request: &MountRequest,
        mountpoint: &Path,
        origin: MountOrigin,
    ) -> Result<MountInfo> {
        if self.mounts.lock().contains_key(mountpoint) || ferry_fs::is_mounted(mountpoint) {
            return Err(Error::AlreadyMounted(mountpoint.to_path_buf()));
        }
        if !mountpoint.is_dir() {
            return Err(Error::InvalidRequest(format!(
                "mount point {} is not a directory",
                mountpoint.display()
            )));
        }
        let source = self.source_for(&request.image, request.layer.as_deref())?;
        let (image, traces) =
            self.mounted_image(&request.image, request.layer.as_deref(), source)?;
        let opts = self.mount_options(&image);
        let fs = FerryFs::with_file_cache(image.clone(), self.file_cache.clone());
        let info = MountInfo {
            mountpoint: mountpoint.to_path_buf(),
            image: request.image.clone(),
            layer: request.layer.clone(),
            manifest_digest: image.manifest_digest.clone(),
        };
        let session = if self.holder.is_some() {
            let mounted = ferry_fs::fuse::mount_keepable(fs, mountpoint, &opts)?;
            let record = KeptMount {
                format: KEPT_FORMAT,
                info: info.clone(),
                origin,
                init: mounted.init,
                generation: 0,
            };
            self.keep(&record, mounted.device.as_fd());
            // Our duplicate closes here; the session and the holder have theirs.
            mounted.session
        } else {
            ferry_fs::mount(fs, mountpoint, &opts)?
        };
        mark_served(mountpoint, true);
        if let Some(layer) = &request.layer {
            traces.settle.arrived(layer);
        }
        let warm = self.start_warm(&image, mountpoint, traces);
        tracing::info!(
            mountpoint = %mountpoint.display(),
            image = %request.image,
            layer = request.layer.as_deref().unwrap_or("-"),
            ?origin,
            "mounted"
        );
        self.mounts.lock().insert(
            mountpoint.to_path_buf(),
            ActiveMount {
                info: info.clone(),
                origin,
                image,
                session,
                warm,
            },
        );
        Ok(info)
    }

    /// Forgets mounts whose FUSE session ended (unmounted from outside, e.g. `umount`
    /// or `fusermount3 -u`), so status and new mounts see the truth.
    fn reap(&self) {
        let mut mounts = self.mounts.lock();
        let ended: Vec<PathBuf> = mounts
            .iter()
            .filter(|(_, m)| m.session.guard.is_finished())
            .map(|(p, _)| p.clone())
            .collect();
        for mountpoint in ended {
            if let Some(m) = mounts.remove(&mountpoint) {
                tracing::info!(mountpoint = %mountpoint.display(), "unmounted from outside");
                self.release_kept(&mountpoint);
                if let Err(e) = m.session.join() {
                    tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "FUSE session ended with an error");
                }
            }
        }
    }

    /// Starts warm-up for a live mount; its hot set (trace and landmark spans) stays
    /// pinned in the store under an owner named after the mountpoint until it goes away,
    /// and large files whose data the trace prefetches entirely go to the file cache as
    /// soon as it lands.
    ///
    /// It starts in the background once the image's trace lookup answered (at most
    /// [`TRACE_LOOKUP_WAIT`]), so neither the mount nor its first reads wait for it.
    fn start_warm(
        &self,
        image: &Arc<MountedImage>,
        mountpoint: &Path,
        traces: Arc<ImageTraces>,
    ) -> WarmCell {
        let slot = Arc::new(Mutex::new(WarmSlot::default()));
        let pins = ferry_fs::warm::PinTarget::for_mount(self.store.clone(), mountpoint);
        let (image, config, files) = (
            image.clone(),
            self.config.warm.clone(),
            self.file_cache.clone(),
        );
        let mountpoint = mountpoint.to_path_buf();
        let filled = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("ferry-warm-start".into())
            .spawn(move || {
                let found = traces.wait(TRACE_LOOKUP_WAIT);
                if found.is_some() && !traces.settle.wait(PULL_SETTLE_WAIT, UNPACK_SETTLE_WAIT) {
                    tracing::debug!(mountpoint = %mountpoint.display(), "prefetch starts before the image's pull brought in all its layers");
                }
                if filled.lock().closed {
                    return;
                }
                if let Some(f) = &found {
                    tracing::info!(mountpoint = %mountpoint.display(), source = ?f.info.source, recorded_for = %f.info.recorded_for, reads = f.info.reads, "prefetching with a startup trace");
                }
                let info = found.as_ref().map(|f| f.info.clone());
                let handle = ferry_fs::warm::start_with_files(
                    &image,
                    &config,
                    found.map(|f| f.trace),
                    Some(pins),
                    files,
                );
                let mut slot = filled.lock();
                if slot.closed {
                    drop(slot);
                    drop(handle);
                    return;
                }
                slot.trace = info;
                slot.handle = Some(handle);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start warm-up");
        }
        WarmCell(slot)
    }

    /// Stops serving every mount. Control mounts are unmounted (and released from the fd
    /// holder); snapshotter mounts are left in place: with an fd holder their connection
    /// stays up and the next start resumes it, without one it dies with the process and
    /// the next start's restore detaches and remounts them.
    pub fn shutdown(&self) {
        self.reap();
        let all = std::mem::take(&mut *self.mounts.lock());
        for (mountpoint, mount) in all {
            match mount.origin {
                MountOrigin::Control => {
                    self.release_kept(&mountpoint);
                    if let Err(failed) = finish(&mountpoint, mount) {
                        let (e, mount) = *failed;
                        tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "unmount failed; detaching");
                        if let Err(e) = detach_stale_mount(&mountpoint) {
                            tracing::error!(mountpoint = %mountpoint.display(), error = %e, "cannot detach");
                        }
                        // Its FUSE threads end when the last user of the mount leaves.
                        drop(mount);
                    }
                }
                MountOrigin::Snapshotter => {
                    tracing::info!(mountpoint = %mountpoint.display(), "leaving the lazy layer for restore");
                    // Dropping the session would unmount it under running containers,
                    // and the next daemon re-registers the hot set under the same owner.
                    std::mem::forget(mount.session);
                    mount.warm.keep_pins();
                }
            }
        }
    }
}

/// Unmounts one mount and waits for its FUSE threads.
fn finish(
    mountpoint: &Path,
    mount: ActiveMount,
) -> std::result::Result<(), Box<(Error, ActiveMount)>> {
    if let Err(e) = ferry_fs::unmount(mountpoint) {
        return Err(Box::new((e.into(), mount)));
    }
    let ActiveMount { session, .. } = mount;
    if let Err(e) = session.join() {
        tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "FUSE session ended with an error");
    }
    tracing::info!(mountpoint = %mountpoint.display(), "unmounted");
    Ok(())
}

impl MountBackend for MountManager {
    fn prewarm(
        &self,
        request: &PrewarmRequest,
        progress: &dyn ferry_fs::warm::prewarm::PrewarmProgress,
    ) -> Result<PrewarmOutcome> {
        MountManager::prewarm(self, request, progress)
    }

    /// Opens the image (or one layer of it), mounts it at the request's mount point and
    /// starts warming it.
    fn mount(&self, request: &MountRequest, origin: MountOrigin) -> Result<MountInfo> {
        if let Some(layer) = &request.layer {
            check_layer_digest(layer)?;
        }
        let mountpoint = canonical_mountpoint(&request.mountpoint)?;
        self.reap();
        if !self.pending.lock().insert(mountpoint.clone()) {
            return Err(Error::AlreadyMounted(mountpoint));
        }
        let result = self.mount_reserved(request, &mountpoint, origin);
        self.pending.lock().remove(&mountpoint);
        result
    }

    fn detach_stale(&self, mountpoint: &Path) -> Result<()> {
        detach_stale_mount(mountpoint)
    }

    fn unmount(&self, mountpoint: &Path) -> Result<()> {
        let mountpoint = canonical_mountpoint(mountpoint)?;
        self.reap();
        let Some(mount) = self.mounts.lock().remove(&mountpoint) else {
            return Err(Error::NotMounted(mountpoint));
        };
        match finish(&mountpoint, mount) {
            Ok(()) => {
                self.release_kept(&mountpoint);
                Ok(())
            }
            Err(failed) => {
                let (e, mount) = *failed;
                // Still mounted (busy): keep serving it.
                self.mounts.lock().insert(mountpoint, mount);
                Err(e)
            }
        }
    }

    fn list(&self) -> Vec<MountStatus> {
        self.reap();
        self.mounts
            .lock()
            .values()
            .map(|m| MountStatus {
                info: m.info.clone(),
                origin: m.origin,
                stats: m.image.stats.snapshot(),
                trace: m.warm.trace(),
                recording: m.image.is_recording(),
            })
            .collect()
    }

    fn file_cache_status(&self) -> Option<ferry_fs::FileCacheSnapshot> {
        self.file_cache.as_ref().map(|c| c.snapshot())
    }

    fn p2p_status(&self) -> Option<crate::p2p::P2pSnapshot> {
        self.p2p.as_ref().map(|p| {
            let mut s = p.fetcher.stats().snapshot();
            s.members = p.fetcher.members().into_iter().map(|m| m.0).collect();
            s
        })
    }

    fn store_status(&self) -> Option<StoreStatus> {
        let stats = self.store.stats();
        Some(StoreStatus {
            path: self.store.root().to_path_buf(),
            entries: stats.entries,
            bytes: stats.bytes,
            max_bytes: stats.max_bytes,
            seed: self.store.seed_stats(),
        })
    }

    fn layer_kind(
        &self,
        image: &str,
        layer: &str,
        ahead: &[String],
    ) -> Result<(LayerKind, String)> {
        check_layer_digest(layer)?;
        if let Some((_, resolved)) = self.registry_layer(image, layer, ahead)? {
            let kind = layer_kind_of(&resolved.descriptor, resolved.index.is_some());
            return Ok((kind, resolved.manifest_digest));
        }
        let template = match self.cached(image) {
            Some(t) => t,
            None => {
                self.open_image(image)?;
                self.cached(image).ok_or_else(|| {
                    Error::InvalidRequest(format!("image {image} could not be remembered"))
                })?
            }
        };
        let kind = template
            .kind(layer)
            .ok_or_else(|| Error::InvalidRequest(format!("image {image} has no layer {layer}")))?;
        Ok((kind, template.manifest_digest.clone()))
    }

    fn layer_unpacked(&self, manifest: &str, layer: &str) {
        if let Some((_, traces)) = self.traces.lock().get(manifest) {
            traces.settle.arrived(layer);
        }
    }

    fn fallbacks(&self) -> Option<&FallbackLog> {
        Some(&self.fallbacks)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn mountpoints_must_be_absolute_and_have_a_real_parent() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        assert_eq!(
            canonical_mountpoint(&dir.path().join("x")).unwrap(),
            real.join("x")
        );
        assert!(matches!(
            canonical_mountpoint(Path::new("relative/x")),
            Err(Error::InvalidRequest(_))
        ));
        assert!(canonical_mountpoint(&dir.path().join("missing/x")).is_err());
        assert!(canonical_mountpoint(Path::new("/")).is_err());
    }

    #[test]
    fn layer_digests_are_checked() {
        check_layer_digest(&format!("sha256:{}", "a".repeat(64))).unwrap();
        assert!(check_layer_digest("sha256:abc").is_err());
        assert!(check_layer_digest(&format!("md5:{}", "a".repeat(64))).is_err());
        assert!(check_layer_digest(&format!("sha256:{}", "z".repeat(64))).is_err());
    }

    #[test]
    fn images_are_pinned_to_their_manifest() {
        let d = format!("sha256:{}", "1".repeat(64));
        assert_eq!(
            pin_image("reg.local:5000/a/b:v1", &d).unwrap(),
            format!("reg.local:5000/a/b:v1@{d}")
        );
        assert_eq!(
            pin_image("oci:/tmp/img:small", &d).unwrap(),
            format!("oci:/tmp/img@{d}")
        );
        assert!(pin_image("", &d).is_err());
        // The digest comes from a snapshot label: a malformed one is refused, not pinned.
        let bad = format!("sha256:{}", "m".repeat(64));
        assert!(pin_image("reg.local:5000/a/b:v1", &bad).is_err());
        assert!(pin_image("reg.local:5000/a/b:v1", &d.to_uppercase()).is_err());
    }

    fn kept(mountpoint: &str, layer: Option<String>) -> KeptMount {
        KeptMount {
            format: KEPT_FORMAT,
            info: MountInfo {
                mountpoint: mountpoint.into(),
                image: "reg.local:5000/app:v1".into(),
                layer,
                manifest_digest: format!("sha256:{}", "1".repeat(64)),
            },
            origin: MountOrigin::Control,
            init: ferry_fs::fuse::InitRecord {
                proto_major: 7,
                proto_minor: 41,
            },
            generation: 3,
        }
    }

    #[test]
    fn kept_mount_records_round_trip_and_bad_ones_are_refused() {
        let record = kept("/mnt/x", Some(format!("sha256:{}", "a".repeat(64))));
        let text = record.to_json().unwrap();
        assert_eq!(KeptMount::from_json("/mnt/x", &text).unwrap(), record);
        // Resumed from the image pinned to the manifest it served (a moved tag cannot
        // change the inode numbers under the kernel).
        assert_eq!(
            record.pinned_image().unwrap(),
            format!("reg.local:5000/app:v1@sha256:{}", "1".repeat(64))
        );
        // Held under another key: not ours to resume there.
        assert!(KeptMount::from_json("/mnt/y", &text).is_err());
        // Another format version.
        let mut v2 = record.clone();
        v2.format = KEPT_FORMAT + 1;
        assert!(KeptMount::from_json("/mnt/x", &v2.to_json().unwrap()).is_err());
        // A layer that is no digest.
        let bad = kept("/mnt/x", Some("sha256:zz".into()));
        assert!(KeptMount::from_json("/mnt/x", &bad.to_json().unwrap()).is_err());
        // Unknown fields and garbage.
        let extra = text.replacen('{', "{\"surprise\":1,", 1);
        assert!(KeptMount::from_json("/mnt/x", &extra).is_err());
        assert!(KeptMount::from_json("/mnt/x", "not json").is_err());
    }

    #[test]
    fn mounts_served_here_are_never_detached_as_stale() {
        // A mount point this process serves is left alone even when mounted; the
        // check happens before anything is touched (so this needs no root).
        let dir = tempfile::tempdir().unwrap();
        let mp = dir.path().join("m");
        mark_served(&mp, true);
        assert!(served_here(&mp));
        detach_stale_mount(&mp).unwrap();
        mark_served(&mp, false);
        assert!(!served_here(&mp));
        // Nothing mounted there: nothing to do either way.
        detach_stale_mount(&mp).unwrap();
    }

    #[test]
    fn a_connection_whose_peer_is_gone_is_not_alive() {
        let (a, b) = crate::fdstore::seqpacket_pair().unwrap();
        assert!(connection_alive(a.as_fd()), "idle and connected");
        drop(b);
        assert!(!connection_alive(a.as_fd()), "hung up");
    }

    #[test]
    fn layer_kind_follows_index_then_toc_annotation() {
        use ferry_oci::media::ANNOTATION_ESTARGZ_TOC;

        let plain: Descriptor = serde_json::from_value(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": format!("sha256:{}", "2".repeat(64)),
            "size": 10
        }))
        .unwrap();
        assert_eq!(layer_kind_of(&plain, false), LayerKind::Plain);
        assert_eq!(layer_kind_of(&plain, true), LayerKind::FerryIndex);
        let mut esgz = plain.clone();
        esgz.set_annotations(Some(
            [(ANNOTATION_ESTARGZ_TOC.to_owned(), "sha256:toc".to_owned())].into(),
        ));
        assert_eq!(layer_kind_of(&esgz, false), LayerKind::Estargz);
        assert!(!LayerKind::Plain.is_lazy() && LayerKind::Estargz.is_lazy());
        // zstd and unknown media types cannot be indexed; plain tar can.
        for (media, kind) in [
            (
                "application/vnd.oci.image.layer.v1.tar+zstd",
                LayerKind::Unsupported,
            ),
            ("application/vnd.example.unknown", LayerKind::Unsupported),
            ("application/vnd.oci.image.layer.v1.tar", LayerKind::Plain),
        ] {
            let mut d = serde_json::to_value(&plain).unwrap();
            d["mediaType"] = media.into();
            let d: Descriptor = serde_json::from_value(d).unwrap();
            assert_eq!(layer_kind_of(&d, false), kind, "{media}");
            assert_eq!(layer_kind_of(&d, true), LayerKind::FerryIndex, "{media}");
        }
        assert!(!LayerKind::Unsupported.is_lazy());
        // zstd:chunked: a zstd layer with its TOC checksum (either prefix) is lazy; the
        // position alone vouches for nothing, and a gzip layer is not zstd:chunked.
        use ferry_oci::media::{
            ANNOTATION_ZSTD_CHUNKED_CHECKSUM, ANNOTATION_ZSTD_CHUNKED_CHECKSUM_OLD,
            ANNOTATION_ZSTD_CHUNKED_POSITION,
        };
        let zstd = |annotations: &[(&str, &str)], media: &str| {
            let mut d = serde_json::to_value(&plain).unwrap();
            d["mediaType"] = media.into();
            let mut d: Descriptor = serde_json::from_value(d).unwrap();
            d.set_annotations(Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ));
            layer_kind_of(&d, false)
        };
        let media = "application/vnd.oci.image.layer.v1.tar+zstd";
        for key in [
            ANNOTATION_ZSTD_CHUNKED_CHECKSUM,
            ANNOTATION_ZSTD_CHUNKED_CHECKSUM_OLD,
        ] {
            assert_eq!(zstd(&[(key, "sha256:toc")], media), LayerKind::ZstdChunked);
        }
        assert!(LayerKind::ZstdChunked.is_lazy());
        assert_eq!(
            zstd(&[(ANNOTATION_ZSTD_CHUNKED_POSITION, "8:1:1:1")], media),
            LayerKind::Unsupported
        );
        assert_eq!(
            zstd(
                &[(ANNOTATION_ZSTD_CHUNKED_CHECKSUM, "sha256:toc")],
                "application/vnd.oci.image.layer.v1.tar+gzip"
            ),
            LayerKind::Plain
        );
    }
}
