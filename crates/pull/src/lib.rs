//! # ferry-pull: `ferry pull` against containerd
//!
//! Puts a registry image into containerd the way `ctr-remote image rpull` does: manifest
//! and config into containerd's content store under a lease (with the GC labels that keep
//! the layers' snapshots alive), an image record named as `ctr` names it, and every layer
//! prepared through ferry's snapshotter in chain order. A layer the snapshotter mounts
//! lazily answers AlreadyExists and costs nothing more. From the first layer it cannot
//! serve lazily on, the layers take the fast path: all downloaded at once with parallel
//! Range requests (a shared connection budget), each unpacked into the snapshotter's
//! staging directory as soon as it lands, then adopted in chain order by a staged Prepare.
//!
//! This crate does no terminal output: progress goes through [`PullProgress`].
//! Modules: [`image`] (pure rules), [`unpack`] (the safe tar unpacker), [`containerd`].

pub mod containerd;
pub mod image;
pub mod unpack;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_oci::ImageRef;
use ferry_oci::media;
use ferry_registry::client::{Client, ClientConfig, ClientError, DownloadOptions, Repo};
use ferry_snapshotter::remote::LABEL_STAGED_DIR;
use futures_util::StreamExt;
use tokio::sync::Semaphore;

use crate::containerd::Containerd;
use crate::image::{Descriptor, LayerContext};
use crate::unpack::{UnpackError, UnpackLimits, UnpackStats};

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
    /// Bytes per Range request.
    pub chunk_size: u64,
    /// Layers unpacked at once.
    pub unpack_concurrency: usize,
    /// Bounds on one layer's contents.
    pub limits: UnpackLimits,
}

/// What happened to one layer, for progress display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerEvent {
    /// The snapshot already existed: nothing to do.
    Present,
    /// The snapshotter mounted it lazily.
    Lazy,
    /// Download started (`size` bytes).
    Downloading {
        /// Blob size.
        size: u64,
    },
    /// `bytes` more landed.
    Downloaded {
        /// Delta.
        bytes: u64,
    },
    /// Unpacking started.
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
    /// Manifest digest.
    pub manifest_digest: String,
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
    /// Wall time.
    pub elapsed: Duration,
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
    if opts.concurrency == 0 || opts.chunk_size == 0 || opts.unpack_concurrency == 0 {
        return Err(PullError::Usage(
            "--concurrency, --chunk-size and --unpack-concurrency must be at least 1".into(),
        ));
    }
    let client = Client::new(opts.registry.clone())?;
    let repo = Repo::new(registry.clone(), repository.clone());
    let name = image::image_name(&registry, &repository, tag.as_deref(), digest.as_deref());
    let reference = digest
        .clone()
        .or(tag.clone())
        .unwrap_or_else(|| "latest".into());

    // Resolve: manifest (through an index when there is one), config, chain ids.
    let mut top = client.get_manifest(&repo, &reference, &[]).await?;
    if image::is_index(&top.media_type) {
        let index = image::parse_index(&top.bytes)?;
        let chosen = image::select_platform(&index, "linux", image::host_architecture())?;
        let chosen_digest = chosen.digest.clone();
        top = client.get_manifest(&repo, &chosen_digest, &[]).await?;
    }
    let manifest = image::parse_manifest(&top.bytes)?;
    let config = fetch_small_blob(&client, &repo, &manifest.config).await?;
    let diff_ids = image::diff_ids(&config, manifest.layers.len())?;
    let chain_ids = image::chain_ids(&diff_ids);
    progress.resolved(&name, &top.digest, &manifest.layers);
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
        cd.write_content(&manifest.config.digest, &config, &config_labels)
            .await?;
        let mut manifest_labels = std::collections::HashMap::new();
        manifest_labels.insert(
            "containerd.io/gc.ref.content.config".to_owned(),
            manifest.config.digest.clone(),
        );
        cd.write_content(&top.digest, &top.bytes, &manifest_labels)
            .await?;
        let ctx = LayerContext {
            image_ref: &name,
            manifest_digest: &top.digest,
            layers: &manifest.layers,
            chain_ids: &chain_ids,
        };
        let counts =
            prepare_layers(opts, &cd, &client, &repo, &ctx, &diff_ids, &id, &*progress).await?;
        cd.put_image(&name, &top.media_type, &top.digest, top.bytes.len() as u64)
            .await?;
        Ok::<_, PullError>(counts)
    }
    .await;
    // The image record (and the config's snapshot reference) now keep everything alive;
    // on failure, deleting the lease lets containerd collect what this pull wrote.
    let deleted = cd.delete_lease().await;
    let counts = result?;
    deleted?;
    Ok(PullReport {
        name,
        manifest_digest: top.digest,
        layers: manifest.layers.len(),
        present: counts.present,
        lazy: counts.lazy,
        unpacked: counts.unpacked,
        bytes_downloaded: counts.bytes,
        elapsed: started.elapsed(),
    })
}

async fn fetch_small_blob(
    client: &Client,
    repo: &Repo,
    desc: &Descriptor,
) -> Result<Vec<u8>, PullError> {
    if desc.size > MAX_CONFIG_BYTES {
        return Err(PullError::Image(format!(
            "config {} is {} bytes, more than the {MAX_CONFIG_BYTES} allowed",
            desc.digest, desc.size
        )));
    }
    let mut stream = client.blob_stream(repo, &desc.digest, None).await?;
    let mut out = Vec::with_capacity(desc.size as usize);
    while let Some(chunk) = stream.body.next().await {
        let chunk = chunk.map_err(|e| PullError::Image(format!("config {}: {e}", desc.digest)))?;
        if out.len() as u64 + chunk.len() as u64 > desc.size {
            return Err(PullError::Image(format!(
                "config {} is larger than its descriptor's {} bytes",
                desc.digest, desc.size
            )));
        }
        out.extend_from_slice(&chunk);
    }
    let actual = format!(
        "sha256:{}",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&out))
    );
    if actual != desc.digest {
        return Err(PullError::Registry(ClientError::DigestMismatch {
            expected: desc.digest.clone(),
            actual,
        }));
    }
    Ok(out)
}

#[derive(Debug, Default)]
struct Counts {
    present: usize,
    lazy: usize,
    unpacked: usize,
    bytes: u64,
}

/// Removes the pull's staging leftovers (blob files, directories not adopted) on drop.
struct StagingGuard {
    paths: std::sync::Mutex<Vec<PathBuf>>,
}

impl StagingGuard {
    fn add(&self, path: PathBuf) {
        self.paths
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(path);
    }
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        let paths = std::mem::take(
            &mut *self
                .paths
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
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
            progress.layer(i, LayerEvent::Lazy);
            counts.lazy += 1;
        } else {
            cd.remove_snapshot(sn, &key).await?;
            first_fast = i;
            break;
        }
    }
    if first_fast == n {
        return Ok(counts);
    }

    // The fast path: download everything left at once, unpack each as it lands.
    let staging = opts.snapshotter_root.join("staging");
    if !staging.is_dir() {
        return Err(PullError::Usage(format!(
            "{} does not exist: --snapshotter-root must be the root of the running ferry snapshotter",
            staging.display()
        )));
    }
    let guard = Arc::new(StagingGuard {
        paths: std::sync::Mutex::new(Vec::new()),
    });
    let connections = Arc::new(Semaphore::new(opts.concurrency));
    let unpackers = Arc::new(Semaphore::new(opts.unpack_concurrency));
    let downloaded = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    let progress_events = Arc::new(std::sync::Mutex::new(Vec::<(usize, LayerEvent)>::new()));
    for (i, (layer, diff_id)) in ctx.layers.iter().zip(diff_ids).enumerate().skip(first_fast) {
        let (layer, diff_id) = (layer.clone(), diff_id.clone());
        let base = staging.join(format!("pull-{id}-{i}"));
        let blob = staging.join(format!("pull-{id}-{i}.blob"));
        guard.add(base.clone());
        guard.add(blob.clone());
        let job = LayerJob {
            client: client.clone(),
            repo: repo.clone(),
            layer,
            diff_id,
            dir: base,
            blob,
            connections: connections.clone(),
            unpackers: unpackers.clone(),
            concurrency: opts.concurrency,
            chunk_size: opts.chunk_size,
            limits: opts.limits,
            downloaded: downloaded.clone(),
            events: progress_events.clone(),
            index: i,
        };
        tasks.push(tokio::spawn(job.run()));
    }
    let mut result = Ok(());
    let mut pending = tasks.into_iter();
    for i in first_fast..n {
        let Some(task) = pending.next() else { break };
        let mut task = std::pin::pin!(task);
        // Forward progress while waiting for this layer.
        let joined = loop {
            tokio::select! {
                joined = &mut task => break joined,
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    drain(&progress_events, progress);
                }
            }
        };
        drain(&progress_events, progress);
        let dir = match joined {
            Ok(Ok(dir)) => dir,
            Ok(Err(e)) => {
                result = Err(e);
                break;
            }
            Err(e) => {
                result = Err(PullError::Internal(format!("layer task: {e}")));
                break;
            }
        };
        let key = format!("ferry-pull-{id}-extract-{i}");
        let mut labels = image::layer_labels(ctx, i);
        labels.insert(LABEL_STAGED_DIR.to_owned(), dir.display().to_string());
        match cd.prepare(sn, &key, &parent_of(i), labels).await {
            Ok(true) => {
                progress.layer(i, LayerEvent::Done);
                counts.unpacked += 1;
            }
            Ok(false) => {
                let _ = cd.remove_snapshot(sn, &key).await;
                result = Err(PullError::StagingUnsupported(sn.to_owned()));
                break;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    // After a failure, stop the other layers and wait for them to let go of their
    // staging paths before the guard removes them (an unpack already running on a
    // blocking thread finishes its current entry and then fails on the removed dir).
    let rest: Vec<_> = pending.collect();
    for task in &rest {
        task.abort();
    }
    for task in rest {
        let _ = task.await;
    }
    counts.bytes = downloaded.load(std::sync::atomic::Ordering::Relaxed);
    drop(guard);
    result.map(|()| counts)
}

fn drain(events: &std::sync::Mutex<Vec<(usize, LayerEvent)>>, progress: &dyn PullProgress) {
    let taken = std::mem::take(
        &mut *events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    for (i, e) in taken {
        progress.layer(i, e);
    }
}

/// One layer of the fast path: download (parallel Range requests, digest-verified), then
/// unpack into its own staging directory and check the diff id.
struct LayerJob {
    client: Client,
    repo: Repo,
    layer: Descriptor,
    diff_id: String,
    dir: PathBuf,
    blob: PathBuf,
    connections: Arc<Semaphore>,
    unpackers: Arc<Semaphore>,
    concurrency: usize,
    chunk_size: u64,
    limits: UnpackLimits,
    downloaded: Arc<std::sync::atomic::AtomicU64>,
    events: Arc<std::sync::Mutex<Vec<(usize, LayerEvent)>>>,
    index: usize,
}

impl LayerJob {
    fn event(&self, e: LayerEvent) {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((self.index, e));
    }

    async fn run(self) -> Result<PathBuf, PullError> {
        let compression = media::layer_compression(&self.layer.media_type).ok_or_else(|| {
            PullError::Image(format!("layer media type {:?}", self.layer.media_type))
        })?;
        // A small layer takes one connection, a large one up to the whole budget.
        let chunks = self.layer.size.div_ceil(self.chunk_size).max(1);
        let want = usize::try_from(chunks)
            .unwrap_or(usize::MAX)
            .min(self.concurrency);
        let permits = u32::try_from(want).unwrap_or(1);
        {
            let _permits = self
                .connections
                .acquire_many(permits)
                .await
                .map_err(|e| PullError::Internal(e.to_string()))?;
            self.event(LayerEvent::Downloading {
                size: self.layer.size,
            });
            let events = self.events.clone();
            let downloaded = self.downloaded.clone();
            let index = self.index;
            let opts = DownloadOptions {
                concurrency: want,
                chunk_size: self.chunk_size,
                progress: Some(Arc::new(move |bytes| {
                    downloaded.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                    events
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((index, LayerEvent::Downloaded { bytes }));
                })),
            };
            self.client
                .download_blob(
                    &self.repo,
                    &self.layer.digest,
                    self.layer.size,
                    &self.blob,
                    &opts,
                )
                .await?;
        }
        let _unpacker = self
            .unpackers
            .acquire()
            .await
            .map_err(|e| PullError::Internal(e.to_string()))?;
        self.event(LayerEvent::Unpacking);
        let (dir, blob, limits) = (self.dir.clone(), self.blob.clone(), self.limits);
        let stats =
            tokio::task::spawn_blocking(move || unpack_into(&blob, compression, &dir, &limits))
                .await
                .map_err(|e| PullError::Internal(format!("unpack task: {e}")))?
                .map_err(|source| PullError::Unpack {
                    digest: self.layer.digest.clone(),
                    source,
                })?;
        if let Err(e) = std::fs::remove_file(&self.blob) {
            tracing::warn!(blob = %self.blob.display(), error = %e, "cannot remove downloaded blob");
        }
        if stats.diff_id != self.diff_id {
            return Err(PullError::DiffIdMismatch {
                digest: self.layer.digest.clone(),
                expected: self.diff_id.clone(),
                actual: stats.diff_id,
            });
        }
        self.event(LayerEvent::Unpacked {
            entries: stats.entries,
        });
        Ok(self.dir)
    }
}

fn unpack_into(
    blob: &Path,
    compression: media::LayerCompression,
    dir: &Path,
    limits: &UnpackLimits,
) -> Result<UnpackStats, UnpackError> {
    std::fs::create_dir(dir).map_err(|source| UnpackError::Io {
        op: "mkdir",
        path: dir.to_path_buf(),
        source,
    })?;
    unpack::unpack_layer_file(blob, compression, dir, limits)
}
