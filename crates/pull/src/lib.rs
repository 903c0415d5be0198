//! # ferry-pull: `ferry pull` against containerd
//!
//! Puts a registry image into containerd the way `ctr-remote image rpull` does: manifest
//! and config (and, for a multi-platform image, the index, which becomes the image
//! record's target as with `ctr image pull`) into containerd's content store under a
//! lease, with the GC labels that keep the chosen manifest, its config and the layers'
//! snapshots alive; an image record named as `ctr` names it; and every layer prepared
//! through ferry's snapshotter in chain order. A layer the snapshotter mounts lazily
//! answers AlreadyExists and costs nothing more (the report counts it lazy only when its
//! snapshot says it was committed from a lazy mount: AlreadyExists also answers a layer
//! another pull put there meanwhile). From the first layer it cannot serve
//! lazily on, the layers take the fast path: each streamed (parallel Range requests
//! feeding an unpacker as the in-order bytes arrive, memory bounded; see [`stream`]) into
//! the snapshotter's staging directory, largest first, as many at once as unpack slots
//! allow, then adopted in chain order by a staged Prepare.
//!
//! The manifest, config and index may come from the node's store instead of the registry
//! ([`PullOptions::store`]): a digest reference the store holds is resolved without any
//! registry request, and a tag from the store's record of it when the registry cannot be
//! reached ([`MetadataSource`], [`PullReport::without_registry`]); the daemon's lazy
//! mounts read layer indexes and bytes from the same store.
//!
//! This crate does no terminal output: progress goes through [`PullProgress`]. It must
//! not mount anything (the daemon does) or read tar its own way: layers are walked by
//! `ferry_index::tarwalk`, so an unpacked layer means what the same layer mounted lazily
//! means.
//! Modules: [`image`] (pure rules), [`stream`] (download-and-unpack of one layer),
//! [`unpack`] (the safe layer unpacker, on ferry-index's tar walker), [`containerd`].

pub mod containerd;
pub mod image;
pub mod stream;
pub mod unpack;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_fs::backend::stored::{self, StoredImage};
use ferry_oci::media;
use ferry_oci::{ImageIndex, ImageRef};
use ferry_registry_client::{Client, ClientConfig, ClientError, Manifest, Repo};
use ferry_snapshotter::remote::LABEL_STAGED_DIR;
use ferry_store::{MetadataOrigin, StoreMetadata};
use tokio::sync::Semaphore;

use crate::containerd::Containerd;
use crate::image::{Descriptor, LayerContext};
use crate::stream::{BufferBudget, LayerStream, RegistryPieces};
use crate::unpack::{UnpackError, UnpackLimits};

/// Largest image config accepted.
const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// How long the pull's lease outlives a pull that died without deleting it.
const LEASE_TTL: Duration = Duration::from_secs(3600);

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// The registry failed or refused.
    #[error(transparent)]
    Registry(#[from] ClientError),
    /// The image's documents are malformed or unsupported.
    #[error("{0}")]
    Image(String),
    /// containerd's socket could not be reached.
    #[error(
        "cannot connect to containerd at {address}: {message} (is containerd running? --address)"
    )]
    Connect {
        /// The socket.
        address: String,
        /// Why.
        message: String,
    },
    /// A containerd call failed.
    #[error("containerd: {what}: {message} ({code:?})")]
    Containerd {
        /// Which call.
        what: String,
        /// gRPC code.
        code: tonic::Code,
        /// containerd's message.
        message: String,
    },
    /// A layer could not be unpacked.
    #[error("layer {digest}: {source}")]
    Unpack {
        /// The layer.
        digest: String,
        /// Why.
        #[source]
        source: UnpackError,
    },
    /// The unpacked layer is not the one the config names.
    #[error("layer {digest} unpacks to {actual}, but the image config says {expected}")]
    DiffIdMismatch {
        /// The layer.
        digest: String,
        /// From the config.
        expected: String,
        /// Measured.
        actual: String,
    },
    /// The snapshotter took a staged Prepare as an ordinary one.
    #[error(
        "snapshotter {0:?} did not adopt the staged layer: is it ferry's snapshotter, with --snapshotter-root pointing at its root?"
    )]
    StagingUnsupported(String),
    /// A local file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A worker task died.
    #[error("internal: {0}")]
    Internal(String),
}

/// What `ferry pull` is to do.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Registry reference (`host[:port]/repo[:tag|@digest]`).
    pub image: String,
    /// containerd's socket.
    pub address: PathBuf,
    /// containerd namespace.
    pub namespace: String,
    /// Snapshotter name in containerd (the proxy plugin's name).
    pub snapshotter: String,
    /// That snapshotter's root directory (its `staging/` receives unpacked layers).
    pub snapshotter_root: PathBuf,
    /// Registry client settings (plain HTTP, credentials, retries).
    pub registry: ClientConfig,
    /// Concurrent Range requests across all layers being downloaded.
    pub concurrency: usize,
    /// Bytes per Range request (at most [`stream::MAX_CHUNK_SIZE`]).
    pub chunk_size: u64,
    /// Layers downloaded-and-unpacked at once.
    pub unpack_concurrency: usize,
    /// Most layer bytes held in memory at once, across layers (at least `chunk_size`).
    pub max_buffer: u64,
    /// Bounds on one layer's contents.
    pub limits: UnpackLimits,
    /// The platform whose manifest is pulled from an index (default: this machine's).
    pub platform: ferry_oci::Platform,
    /// The node store's image records and metadata (its seed included), for a start
    /// without the registry (see [`resolve`]); `None`: the registry only.
    pub store: Option<StoreMetadata>,
}

/// Where a pull's manifest and config came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataSource {
    /// The registry.
    Registry,
    /// The node's store: a digest reference whose documents are all there (no registry
    /// request was made), or a tag resolved from the store's record of it because the
    /// registry could not be reached (`tag_record`: the record's reference, and why).
    Store {
        /// Live store or seed.
        origin: MetadataOrigin,
        /// For a tag: the record it was resolved through and the registry's failure.
        tag_record: Option<(String, String)>,
    },
}

/// What happened to one layer, for progress display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerEvent {
    /// The snapshot already existed: nothing to do.
    Present,
    /// The snapshotter mounted it lazily.
    Lazy,
    /// Download started (`size` bytes); unpacking starts with it.
    Downloading {
        /// Blob size.
        size: u64,
    },
    /// `bytes` more landed.
    Downloaded {
        /// Delta.
        bytes: u64,
    },
    /// Unpacking started (it consumes the download as it lands).
    Unpacking,
    /// Unpacked into staging.
    Unpacked {
        /// Entries.
        entries: u64,
    },
    /// Committed in containerd (adopted by the snapshotter).
    Done,
}

/// Receives progress. Called from async tasks; must not block.
pub trait PullProgress: Send + Sync {
    /// The image was resolved: its name and its layers (base first).
    fn resolved(&self, name: &str, manifest_digest: &str, layers: &[Descriptor]);
    /// Layer `index` changed state.
    fn layer(&self, index: usize, event: LayerEvent);
}

/// Progress that goes nowhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl PullProgress for NoProgress {
    fn resolved(&self, _: &str, _: &str, _: &[Descriptor]) {}
    fn layer(&self, _: usize, _: LayerEvent) {}
}

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReport {
    /// The image record's name.
    pub name: String,
    /// The platform manifest's digest.
    pub manifest_digest: String,
    /// The image record's target: the index's digest for a multi-platform image, else
    /// the manifest's (what `ctr image ls` shows).
    pub target_digest: String,
    /// Layers.
    pub layers: usize,
    /// Layers already present.
    pub present: usize,
    /// Layers mounted lazily.
    pub lazy: usize,
    /// Layers downloaded and unpacked.
    pub unpacked: usize,
    /// Layer bytes downloaded.
    pub bytes_downloaded: u64,
    /// Most layer bytes held in memory at once.
    pub peak_buffered: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Where the manifest and config came from.
    pub metadata: MetadataSource,
}

impl PullReport {
    /// True when nothing of the pull came from the registry: the manifest and config
    /// from the node's store and every layer already present or served lazily (whose
    /// bytes and index the daemon reads from its store for an image it holds).
    pub fn without_registry(&self) -> bool {
        matches!(self.metadata, MetadataSource::Store { .. })
            && self.unpacked == 0
            && self.bytes_downloaded == 0
    }
}

/// A unique-enough suffix for keys and staging names of this pull.
fn pull_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("{}-{nanos:x}", std::process::id())
}

/// Pulls `opts.image` into containerd.
pub async fn pull(
    opts: &PullOptions,
    progress: Arc<dyn PullProgress>,
) -> Result<PullReport, PullError> {
    let started = Instant::now();
    let ImageRef::Registry {
        registry,
        repository,
        tag,
        digest,
    } = ImageRef::parse(&opts.image).map_err(|e| PullError::Usage(e.to_string()))?
    else {
        return Err(PullError::Usage(format!(
            "{}: ferry pull takes a registry reference (HOST[:PORT]/REPO[:TAG|@DIGEST])",
            opts.image
        )));
    };
    check_options(opts)?;
    let client = Client::new(opts.registry.clone())?;
    let repo = Repo::new(registry.clone(), repository.clone());
    let digest = digest.map(|d| d.to_string());
    let name = image::image_name(
        &registry,
        &repository,
        tag.as_ref().map(|t| t.as_str()),
        digest.as_deref(),
    );
    let reference = digest
        .or(tag.map(String::from))
        .unwrap_or_else(|| "latest".into());

    // Resolve: manifest (through an index when there is one), config, chain ids.
    let (top, index_doc, metadata) = resolve(opts, &client, &repo, &reference).await?;
    if image::is_index(&top.media_type) {
        return Err(PullError::Image(format!(
            "{}: the index's platform entry is itself an index (nested indexes are not supported)",
            top.digest
        )));
    }
    let manifest = image::parse_manifest(&top.bytes)?;
    // The config is content-addressed: the store's verified copy is as good as the
    // registry's.
    let stored_config = match (&opts.store, &metadata) {
        (Some(meta), MetadataSource::Registry) => stored_blob(meta, manifest.config())
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "config not usable from the node's store; asking the registry");
                None
            }),
        (Some(meta), MetadataSource::Store { .. }) => stored_blob(meta, manifest.config())?,
        (None, _) => None,
    };
    let config = match stored_config {
        Some(bytes) => bytes,
        None if matches!(metadata, MetadataSource::Store { .. }) => {
            return Err(PullError::Image(format!(
                "config {} of {} is not in the node's store, and the registry is not used for this pull",
                manifest.config().digest(),
                top.digest
            )));
        }
        None => fetch_small_blob(&client, &repo, manifest.config()).await?,
    };
    let diff_ids = image::diff_ids(&config, manifest.layers().len())?;
    let chain_ids = image::chain_ids(&diff_ids);
    progress.resolved(&name, &top.digest, manifest.layers());
    let Some(top_chain) = chain_ids.last().cloned() else {
        return Err(PullError::Image("the image has no layers".into()));
    };

    let mut cd = Containerd::connect(&opts.address, &opts.namespace).await?;
    let id = pull_id();
    cd.create_lease(&format!("ferry-pull-{id}"), LEASE_TTL)
        .await?;
    let result = async {
        let mut config_labels = std::collections::HashMap::new();
        config_labels.insert(
            format!("containerd.io/gc.ref.snapshot.{}", opts.snapshotter),
            top_chain.clone(),
        );
        cd.write_content(manifest.config().digest().as_ref(), &config, &config_labels)
            .await?;
        let mut manifest_labels = std::collections::HashMap::new();
        manifest_labels.insert(
            "containerd.io/gc.ref.content.config".to_owned(),
            manifest.config().digest().to_string(),
        );
        cd.write_content(&top.digest, &top.bytes, &manifest_labels)
            .await?;
        if let Some((index, parsed)) = &index_doc {
            cd.write_content(&index.digest, &index.bytes, &image::index_labels(parsed))
                .await?;
        }
        let ctx = LayerContext {
            image_ref: &name,
            manifest_digest: &top.digest,
            layers: manifest.layers(),
            chain_ids: &chain_ids,
        };
        let counts =
            prepare_layers(opts, &cd, &client, &repo, &ctx, &diff_ids, &id, &*progress).await?;
        // Like `ctr image pull`, the record names what the reference named: the index.
        let target = index_doc.as_ref().map_or(&top, |(index, _)| index);
        cd.put_image(
            &name,
            &target.media_type,
            &target.digest,
            target.bytes.len() as u64,
        )
        .await?;
        Ok::<_, PullError>(counts)
    }
    .await;
    // The image record (and the config's snapshot reference) now keep everything alive;
    // on failure, deleting the lease lets containerd collect what this pull wrote.
    let deleted = cd.delete_lease().await;
    let counts = result?;
    deleted?;
    let target_digest = index_doc.map_or_else(|| top.digest.clone(), |(index, _)| index.digest);
    Ok(PullReport {
        name,
        manifest_digest: top.digest,
        target_digest,
        layers: manifest.layers().len(),
        present: counts.present,
        lazy: counts.lazy,
        unpacked: counts.unpacked,
        bytes_downloaded: counts.bytes,
        peak_buffered: counts.peak_buffered,
        elapsed: started.elapsed(),
        metadata,
    })
}

/// A document the pull works from, and the index it was chosen from (with its parsed
/// form), if any.
type Resolved = (Manifest, Option<(Manifest, ImageIndex)>, MetadataSource);

/// The image's manifest (through its index, if any): from the node's store for a digest
/// reference it holds, without asking the registry; else from the registry, and for a
/// tag the store's record of it when the registry cannot be reached (refused, reset,
/// timed out: [`stored::registry_unreachable`]) or does not answer within
/// [`stored::REGISTRY_ANSWER_TIMEOUT`].
async fn resolve(
    opts: &PullOptions,
    client: &Client,
    repo: &Repo,
    reference: &str,
) -> Result<Resolved, PullError> {
    let is_digest = ferry_oci::digest::parse_sha256(reference).is_ok();
    let found = match &opts.store {
        Some(meta) if is_digest => StoredImage::by_digest(meta, reference, &opts.platform),
        Some(meta) => StoredImage::by_record(meta, &opts.image, &opts.platform),
        None => Ok(None),
    };
    let local = match found {
        Ok(Some(local)) => local,
        Ok(None) => return from_registry(opts, client, repo, reference).await,
        Err(local) => {
            // Damaged in the store: the registry may still answer; say both if not.
            tracing::warn!(error = %local, "the node's store cannot resolve the image; asking the registry");
            return from_registry(opts, client, repo, reference)
                .await
                .map_err(|e| PullError::Image(format!("{e} (and the node's store: {local})")));
        }
    };
    if local.record.is_none() {
        let origin = local.origin;
        return Ok(from_store(local, origin, None));
    }
    let why = match tokio::time::timeout(
        stored::REGISTRY_ANSWER_TIMEOUT,
        from_registry(opts, client, repo, reference),
    )
    .await
    {
        Ok(Ok(resolved)) => return Ok(resolved),
        Ok(Err(PullError::Registry(e))) if stored::registry_unreachable(&e) => e.to_string(),
        Ok(Err(e)) => return Err(e),
        Err(_) => format!("no answer within {:?}", stored::REGISTRY_ANSWER_TIMEOUT),
    };
    let origin = local.origin;
    let record = local.record.clone().unwrap_or_default();
    Ok(from_store(local, origin, Some((record, why))))
}

fn from_store(
    local: StoredImage,
    origin: MetadataOrigin,
    tag_record: Option<(String, String)>,
) -> Resolved {
    let index = local.index.and_then(|doc| {
        image::parse_index(&doc.bytes)
            .ok()
            .map(|parsed| (doc, parsed))
    });
    (
        local.manifest,
        index,
        MetadataSource::Store { origin, tag_record },
    )
}

async fn from_registry(
    opts: &PullOptions,
    client: &Client,
    repo: &Repo,
    reference: &str,
) -> Result<Resolved, PullError> {
    let mut top = client.get_manifest(repo, reference, &[]).await?;
    let mut index_doc = None;
    if image::is_index(&top.media_type) {
        let index = image::parse_index(&top.bytes)?;
        let chosen_digest = image::select_platform(&index, &opts.platform)?;
        let platform_manifest = client.get_manifest(repo, &chosen_digest, &[]).await?;
        index_doc = Some((std::mem::replace(&mut top, platform_manifest), index));
    }
    Ok((top, index_doc, MetadataSource::Registry))
}

/// Blob `desc` from the node's store, verified; `None` when it is not there.
fn stored_blob(meta: &StoreMetadata, desc: &Descriptor) -> Result<Option<Vec<u8>>, PullError> {
    let Ok(key) = ferry_store::ChunkKey::parse(desc.digest().as_ref()) else {
        return Ok(None);
    };
    meta.blob(&key)
        .map(|found| found.map(|(bytes, _)| bytes))
        .map_err(|e| PullError::Image(format!("the node's store: {e}")))
}

/// Refuses option values the pull cannot work with, before any network call.
fn check_options(opts: &PullOptions) -> Result<(), PullError> {
    if opts.concurrency == 0 || opts.chunk_size == 0 || opts.unpack_concurrency == 0 {
        return Err(PullError::Usage(
            "--concurrency, --chunk-size and --unpack-concurrency must be at least 1".into(),
        ));
    }
    if opts.chunk_size > stream::MAX_CHUNK_SIZE {
        return Err(PullError::Usage(format!(
            "--chunk-size {} is larger than the {} allowed",
            opts.chunk_size,
            stream::MAX_CHUNK_SIZE
        )));
    }
    if opts.max_buffer < opts.chunk_size {
        return Err(PullError::Usage(format!(
            "--max-buffer ({} bytes) must hold at least one --chunk-size piece ({} bytes)",
            opts.max_buffer, opts.chunk_size
        )));
    }
    Ok(())
}

async fn fetch_small_blob(
    client: &Client,
    repo: &Repo,
    desc: &Descriptor,
) -> Result<Vec<u8>, PullError> {
    let (digest, size): (&str, u64) = (desc.digest().as_ref(), desc.size());
    if size > MAX_CONFIG_BYTES {
        return Err(PullError::Image(format!(
            "config {digest} is {size} bytes, more than the {MAX_CONFIG_BYTES} allowed"
        )));
    }
    // Verified by the client, which asks the registry itself when a mirror's bytes fail.
    let out = client
        .blob_verified(repo, digest, size, &format!("config {digest}"))
        .await?;
    Ok(out)
}

#[derive(Debug, Default)]
struct Counts {
    present: usize,
    lazy: usize,
    unpacked: usize,
    bytes: u64,
    peak_buffered: u64,
}

/// Removes the pull's staging leftovers (blob files, directories not adopted) on drop.
struct StagingGuard {
    paths: parking_lot::Mutex<Vec<PathBuf>>,
}

impl StagingGuard {
    fn add(&self, path: PathBuf) {
        self.paths.lock().push(path);
    }
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        let paths = std::mem::take(&mut *self.paths.lock());
        for path in paths {
            let removed = match std::fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
                Ok(_) => std::fs::remove_file(&path),
                Err(_) => Ok(()),
            };
            if let Err(e) = removed {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove staging leftover");
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn prepare_layers(
    opts: &PullOptions,
    cd: &Containerd,
    client: &Client,
    repo: &Repo,
    ctx: &LayerContext<'_>,
    diff_ids: &[String],
    id: &str,
    progress: &dyn PullProgress,
) -> Result<Counts, PullError> {
    let n = ctx.layers.len();
    let sn = opts.snapshotter.as_str();
    let mut counts = Counts::default();
    // Layers already there: the longest present prefix of the chain.
    let mut present = 0;
    for i in (0..n).rev() {
        if cd.snapshot_exists(sn, &ctx.chain_ids[i]).await? {
            present = i + 1;
            break;
        }
    }
    for i in 0..present {
        progress.layer(i, LayerEvent::Present);
    }
    counts.present = present;
    let parent_of = |i: usize| {
        if i == 0 {
            String::new()
        } else {
            ctx.chain_ids[i - 1].clone()
        }
    };

    // Lazy layers, in chain order, until the first one the snapshotter cannot serve.
    let mut first_fast = n;
    for i in present..n {
        let key = format!("ferry-pull-{id}-probe-{i}");
        if cd
            .prepare(sn, &key, &parent_of(i), image::layer_labels(ctx, i))
            .await?
        {
            // AlreadyExists also answers a layer another pull committed meanwhile, maybe
            // downloaded: only a snapshot committed from a lazy mount counts as lazy.
            if cd.snapshot_is_lazy(sn, &ctx.chain_ids[i]).await? {
                progress.layer(i, LayerEvent::Lazy);
                counts.lazy += 1;
            } else {
                progress.layer(i, LayerEvent::Present);
                counts.present += 1;
            }
        } else {
            cd.remove_snapshot(sn, &key).await?;
            first_fast = i;
            break;
        }
    }
    if first_fast == n {
        return Ok(counts);
    }

    // The fast path: every layer left is downloaded and unpacked at once, largest first.
    let staging = opts.snapshotter_root.join("staging");
    if !staging.is_dir() {
        return Err(PullError::Usage(format!(
            "{} does not exist: --snapshotter-root must be the root of the running ferry snapshotter",
            staging.display()
        )));
    }
    let guard = StagingGuard {
        paths: parking_lot::Mutex::new(Vec::new()),
    };
    let shared = Arc::new(FastPath {
        client: client.clone(),
        repo: repo.clone(),
        connections: Arc::new(Semaphore::new(opts.concurrency)),
        unpackers: Arc::new(Semaphore::new(opts.unpack_concurrency)),
        budget: BufferBudget::new(opts.max_buffer),
        chunk_size: opts.chunk_size,
        limits: opts.limits,
        downloaded: std::sync::atomic::AtomicU64::new(0),
        events: parking_lot::Mutex::new(Vec::new()),
    });
    let mut jobs = Vec::new();
    for (i, (layer, diff_id)) in ctx.layers.iter().zip(diff_ids).enumerate().skip(first_fast) {
        let dir = staging.join(format!("pull-{id}-{i}"));
        guard.add(dir.clone());
        jobs.push(LayerJob {
            layer: layer.clone(),
            diff_id: diff_id.clone(),
            dir,
            index: i,
        });
    }
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let scheduler = tokio::spawn(schedule(shared.clone(), jobs, done_tx));
    let mut result = Ok(());
    let mut ready = std::collections::HashMap::new();
    let mut next = first_fast;
    'adopt: while next < n {
        // Forward progress while waiting for the next finished layer.
        let finished = tokio::select! {
            finished = done_rx.recv() => finished,
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                shared.drain_events(progress);
                continue;
            }
        };
        shared.drain_events(progress);
        match finished {
            Some((i, Ok(dir))) => {
                ready.insert(i, dir);
            }
            Some((_, Err(e))) => {
                result = Err(e);
                break;
            }
            None => {
                result = Err(PullError::Internal(
                    "a layer task ended without a result".into(),
                ));
                break;
            }
        }
        // Adopt, in chain order, every layer whose predecessors are adopted.
        while let Some(dir) = ready.remove(&next) {
            let key = format!("ferry-pull-{id}-extract-{next}");
            let mut labels = image::layer_labels(ctx, next);
            labels.insert(LABEL_STAGED_DIR.to_owned(), dir.display().to_string());
            match cd.prepare(sn, &key, &parent_of(next), labels).await {
                Ok(true) => {
                    progress.layer(next, LayerEvent::Done);
                    counts.unpacked += 1;
                    next += 1;
                }
                Ok(false) => {
                    let _ = cd.remove_snapshot(sn, &key).await;
                    result = Err(PullError::StagingUnsupported(sn.to_owned()));
                    break 'adopt;
                }
                Err(e) => {
                    result = Err(e);
                    break 'adopt;
                }
            }
        }
    }
    // Stop whatever still runs (after a failure), then wait until no unpack thread holds
    // a slot, i.e. nothing writes into staging any more, before the guard removes the
    // pull's leftovers.
    scheduler.abort();
    let _ = scheduler.await;
    let slots = u32::try_from(opts.unpack_concurrency).unwrap_or(u32::MAX);
    let idle = shared.unpackers.acquire_many(slots).await;
    drop(idle);
    counts.bytes = shared.downloaded.load(std::sync::atomic::Ordering::Relaxed);
    counts.peak_buffered = shared.budget.peak();
    drop(guard);
    result.map(|()| counts)
}

/// What the fast path's layer jobs share.
struct FastPath {
    client: Client,
    repo: Repo,
    /// Range requests in flight, across layers.
    connections: Arc<Semaphore>,
    /// Layers being unpacked; a layer downloads only while it holds one (see [`stream`]).
    unpackers: Arc<Semaphore>,
    /// Layer bytes held in memory, across layers.
    budget: Arc<BufferBudget>,
    chunk_size: u64,
    limits: UnpackLimits,
    downloaded: std::sync::atomic::AtomicU64,
    events: parking_lot::Mutex<Vec<(usize, LayerEvent)>>,
}

impl FastPath {
    fn event(&self, index: usize, e: LayerEvent) {
        self.events.lock().push((index, e));
    }

    fn drain_events(&self, progress: &dyn PullProgress) {
        let taken = std::mem::take(&mut *self.events.lock());
        for (i, e) in taken {
            progress.layer(i, e);
        }
    }
}

/// The order layers start in: largest first (the longest unpack starts earliest, which
/// shortens the whole), ties in chain order.
fn start_order(sizes: &[u64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    order
}

/// Starts each layer job as an unpack slot frees up, in [`start_order`]; each sends its
/// result on `done`. Aborting this task aborts the jobs it started.
async fn schedule(
    shared: Arc<FastPath>,
    jobs: Vec<LayerJob>,
    done: tokio::sync::mpsc::UnboundedSender<(usize, Result<PathBuf, PullError>)>,
) {
    let sizes: Vec<u64> = jobs.iter().map(|j| j.layer.size()).collect();
    let mut jobs: Vec<Option<LayerJob>> = jobs.into_iter().map(Some).collect();
    let mut running = tokio::task::JoinSet::new();
    for at in start_order(&sizes) {
        let Some(job) = jobs.get_mut(at).and_then(Option::take) else {
            continue;
        };
        let slot = match shared.unpackers.clone().acquire_owned().await {
            Ok(slot) => slot,
            Err(e) => {
                let _ = done.send((job.index, Err(PullError::Internal(e.to_string()))));
                return;
            }
        };
        let (shared, done) = (shared.clone(), done.clone());
        running.spawn(async move {
            let index = job.index;
            let result = job.run(&shared, slot).await;
            let _ = done.send((index, result));
        });
    }
    drop(done);
    while let Some(joined) = running.join_next().await {
        if let Err(e) = joined {
            tracing::warn!(error = %e, "layer task failed");
        }
    }
}

/// One layer of the fast path: streamed into its own staging directory (download and
/// unpack together), then checked against the config's diff id.
struct LayerJob {
    layer: Descriptor,
    diff_id: String,
    dir: PathBuf,
    index: usize,
}

impl LayerJob {
    async fn run(
        self,
        shared: &FastPath,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<PathBuf, PullError> {
        let media_type = self.layer.media_type().to_string();
        let compression = media::layer_compression(&media_type)
            .ok_or_else(|| PullError::Image(format!("layer media type {media_type:?}")))?;
        shared.event(
            self.index,
            LayerEvent::Downloading {
                size: self.layer.size(),
            },
        );
        shared.event(self.index, LayerEvent::Unpacking);
        let source = RegistryPieces::new(
            shared.client.clone(),
            shared.repo.clone(),
            self.layer.digest().to_string(),
        );
        let spec = LayerStream {
            digest: self.layer.digest().to_string(),
            size: self.layer.size(),
            compression,
            dest: self.dir.clone(),
            chunk_size: shared.chunk_size,
            limits: shared.limits,
        };
        let index = self.index;
        let on_landed = |bytes: u64| {
            shared
                .downloaded
                .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
            shared.event(index, LayerEvent::Downloaded { bytes });
        };
        let stats = stream::stream_layer(
            &source,
            &spec,
            &shared.budget,
            &shared.connections,
            slot,
            &on_landed,
        )
        .await?;
        if stats.diff_id != self.diff_id {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove a mismatched layer");
            }
            return Err(PullError::DiffIdMismatch {
                digest: self.layer.digest().to_string(),
                expected: self.diff_id.clone(),
                actual: stats.diff_id,
            });
        }
        shared.event(
            self.index,
            LayerEvent::Unpacked {
                entries: stats.entries,
            },
        );
        Ok(self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_start_largest_first_ties_in_chain_order() {
        assert_eq!(start_order(&[49, 94, 136, 153, 1]), vec![3, 2, 1, 0, 4]);
        assert_eq!(start_order(&[5, 7, 5, 7]), vec![1, 3, 0, 2]);
        assert!(start_order(&[]).is_empty());
    }
}
