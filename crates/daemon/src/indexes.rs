//! Resolving the layers of registry images for the snapshotter's lazy mounts, with the
//! round trips of one image made at once instead of one layer after another.
//!
//! containerd prepares an image's layers one Prepare at a time, in chain order (the
//! parent must exist first); `ferry pull` and CRI's unpacker (containerd 1.6) alike.
//! Each lazy layer needs the image's manifest, the ferry index artifact that refers to
//! it (referrers API or tag fallback, then the artifact's manifest) and the layer's own
//! index blob. [`LayerIndexes`] makes those requests once per image and layer and
//! shares them:
//!
//! - the image-level lookups (manifest, index artifacts) are single-flighted per
//!   (repository, reference) and kept for [`RESOLVED_TTL`]; with a pinned reference
//!   (the Prepare labels carry the manifest digest) the manifest and the referrers
//!   lookup run at the same time;
//! - at a Prepare whose labels name the following layers (CRI's
//!   `containerd.io/snapshot/cri.image-layers`, also sent by `ferry pull`), the index
//!   blobs of all of them are fetched at once ([`INDEX_FETCHES`] at most in flight),
//!   single-flighted per (repository, index blob); the Prepare waits only for its own
//!   layer, and the next layers' Prepares find their index fetched or join its fetch.
//!
//! Results are bounded in memory ([`MemoryCache`], by bytes); a layer's index is
//! dropped once its mount has taken it ([`LayerIndexes::taken`]), anything else after
//! [`RESOLVED_TTL`]. Failures are not kept, so a later Prepare asks again. Every
//! registry call is bounded by the daemon's fetch timeout. The registry is reached
//! through [`IndexRegistry`], so this is tested with an in-memory one; the daemon's is a
//! [`StoreFirstRegistry`], which answers from the node's store what it holds (an image
//! prewarmed or baked into a seed starts with the registry down).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry_fs::backend::stored;
use ferry_index::ferryidx::LayerIndex;
use ferry_oci::Descriptor;
use ferry_oci::media::ANNOTATION_LAYER_DIGEST;
use ferry_registry_client::cache::flight::SingleFlight;
use ferry_registry_client::cache::memory::MemoryCache;
use ferry_registry_client::{Client, Repo};
use ferry_snapshotter::NotLazyReason;
use tokio::sync::Semaphore;

/// How long a resolved image and its fetched indexes are reused (an image's Prepares
/// follow each other within seconds; a later pull asks again).
pub const RESOLVED_TTL: Duration = Duration::from_secs(60);
/// Most index blob fetches in flight at once, over all images.
pub const INDEX_FETCHES: usize = 6;
/// Bytes of resolved images kept (manifest layer lists and index blob lists).
const IMAGE_CACHE_BYTES: u64 = 4 << 20;
/// Bytes of fetched layer indexes kept until their mounts take them (counted by blob
/// size): the indexes of a few large images being prepared at once.
const INDEX_CACHE_BYTES: u64 = 64 << 20;
/// Bookkeeping charged per layer of a resolved image.
const LAYER_WEIGHT: u64 = 512;

/// Why a layer could not be resolved. Cloneable: one outcome is shared by every
/// Prepare that waited for the same request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The registry failed or answered something unusable; `reason` is what that means
    /// for a lazy layer (decided from the typed error, see [`crate::fallback`]).
    #[error("{message}")]
    Registry {
        /// Unreachable, refused, not found, invalid…
        reason: NotLazyReason,
        /// The error, for a human.
        message: String,
    },
    /// The registry did not answer within the fetch timeout.
    #[error("{what}: no answer within {timeout:?}")]
    TimedOut {
        /// What was asked.
        what: String,
        /// The bound.
        timeout: Duration,
    },
    /// The image has no such layer.
    #[error("image {image} has no layer {layer}")]
    NoSuchLayer {
        /// The image.
        image: String,
        /// The layer asked for.
        layer: String,
    },
    /// The shared request ended without a result (its task died).
    #[error("the shared registry request ended without a result")]
    Aborted,
}

impl From<ferry_fs::Error> for ResolveError {
    fn from(e: ferry_fs::Error) -> ResolveError {
        ResolveError::Registry {
            reason: crate::fallback::fs_reason(&e, NotLazyReason::Other),
            message: e.to_string(),
        }
    }
}

/// The registry requests resolving a layer needs.
#[async_trait]
pub trait IndexRegistry: Send + Sync + 'static {
    /// The image manifest `reference` names (for an image index, this platform's):
    /// its digest and its layers.
    async fn manifest(
        &self,
        repo: &Repo,
        reference: &str,
    ) -> Result<(String, Vec<Descriptor>), ResolveError>;
    /// The ferry index blobs of the index artifacts that refer to manifest `subject`.
    async fn index_blobs(
        &self,
        repo: &Repo,
        subject: &str,
    ) -> Result<Vec<Descriptor>, ResolveError>;
    /// One index blob, fetched, verified and decoded.
    async fn index(&self, repo: &Repo, blob: &Descriptor) -> Result<LayerIndex, ResolveError>;
}

/// [`IndexRegistry`] over the daemon's registry client.
#[derive(Debug, Clone)]
pub struct ClientIndexRegistry {
    /// The daemon's client (credentials, mirrors, retries).
    pub client: Client,
}

#[async_trait]
impl IndexRegistry for ClientIndexRegistry {
    async fn manifest(
        &self,
        repo: &Repo,
        reference: &str,
    ) -> Result<(String, Vec<Descriptor>), ResolveError> {
        let (desc, manifest) =
            ferry_fs::backend::fetch_registry_manifest(&self.client, repo, reference).await?;
        Ok((desc.digest().to_string(), manifest.layers().clone()))
    }

    async fn index_blobs(
        &self,
        repo: &Repo,
        subject: &str,
    ) -> Result<Vec<Descriptor>, ResolveError> {
        Ok(ferry_fs::backend::registry_index_blobs(&self.client, repo, subject).await?)
    }

    async fn index(&self, repo: &Repo, blob: &Descriptor) -> Result<LayerIndex, ResolveError> {
        Ok(ferry_fs::backend::fetch_index_blob(&self.client, repo, blob).await?)
    }
}

/// [`IndexRegistry`] that reads the node's store first (see
/// [`ferry_fs::backend::stored`]): a digest reference whose manifest is in the store, the
/// index blobs of a manifest whose record kept its artifacts, and index blobs the store
/// holds are answered with no registry request; a tag is resolved from the store's
/// record only when the registry cannot be reached (refused, timed out, 429/5xx) or does
/// not answer within [`stored::REGISTRY_ANSWER_TIMEOUT`].
pub struct StoreFirstRegistry {
    /// Asked for what the store does not hold.
    pub registry: Arc<dyn IndexRegistry>,
    /// The node's store (its seed included).
    pub store: Arc<ferry_store::Store>,
}

impl std::fmt::Debug for StoreFirstRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreFirstRegistry")
            .field("store", &self.store.root())
            .finish_non_exhaustive()
    }
}

impl StoreFirstRegistry {
    fn stored_manifest(
        &self,
        repo: &Repo,
        reference: &str,
    ) -> Result<Option<stored::StoredImage>, ResolveError> {
        let meta = self.store.metadata();
        let platform = ferry_oci::Platform::host();
        let found = if ferry_oci::digest::parse_sha256(reference).is_ok() {
            stored::StoredImage::by_digest(&meta, reference, &platform)?
        } else {
            let image = format!("{}/{}:{reference}", repo.registry, repo.repository);
            stored::StoredImage::by_record(&meta, &image, &platform)?
        };
        Ok(found)
    }
}

fn stored_answer(image: stored::StoredImage) -> (String, Vec<Descriptor>) {
    (image.manifest.digest, image.parsed.layers().clone())
}

/// `registry`'s answer, for a lookup the store could not make (`local`: why, when it
/// failed rather than missed; said in the error if the registry fails too).
async fn or_registry<T>(
    local: Option<ResolveError>,
    registry: impl std::future::Future<Output = Result<T, ResolveError>>,
) -> Result<T, ResolveError> {
    let answer = registry.await;
    match (answer, local) {
        (Err(ResolveError::Registry { reason, message }), Some(local)) => {
            Err(ResolveError::Registry {
                reason,
                message: format!("{message} (and the node's store: {local})"),
            })
        }
        (answer, _) => answer,
    }
}

/// A store lookup's answer: `Ok(Some)` found, `Ok(None)` not there, `Err` damaged
/// (logged; the registry is asked instead).
fn from_store<T>(
    what: &str,
    found: Result<Option<T>, ferry_fs::Error>,
) -> Result<Option<T>, ResolveError> {
    found.map_err(|e| {
        tracing::warn!(what, error = %e, "the node's store cannot answer; asking the registry");
        ResolveError::from(e)
    })
}

#[async_trait]
impl IndexRegistry for StoreFirstRegistry {
    async fn manifest(
        &self,
        repo: &Repo,
        reference: &str,
    ) -> Result<(String, Vec<Descriptor>), ResolveError> {
        let local = match self.stored_manifest(repo, reference) {
            Ok(Some(local)) => local,
            Ok(None) => return self.registry.manifest(repo, reference).await,
            Err(e) => {
                tracing::warn!(reference, error = %e, "the node's store cannot answer; asking the registry");
                return or_registry(Some(e), self.registry.manifest(repo, reference)).await;
            }
        };
        if local.record.is_none() {
            tracing::debug!(repository = %repo.repository, reference, origin = %local.origin, "manifest from the node's store");
            return Ok(stored_answer(local));
        }
        // A tag: the registry says what it names now, unless it cannot be reached.
        let asked = tokio::time::timeout(
            stored::REGISTRY_ANSWER_TIMEOUT,
            self.registry.manifest(repo, reference),
        )
        .await;
        let why = match asked {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(e)) if crate::fallback::resolve_reason(&e) == NotLazyReason::Unreachable => {
                e.to_string()
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => format!("no answer within {:?}", stored::REGISTRY_ANSWER_TIMEOUT),
        };
        tracing::warn!(
            repository = %repo.repository,
            tag = reference,
            manifest = %local.manifest.digest,
            origin = %local.origin,
            registry_error = why,
            "registry unreachable: tag resolved from the node store's record (tags are mutable: the registry may name another image now)"
        );
        Ok(stored_answer(local))
    }

    async fn index_blobs(
        &self,
        repo: &Repo,
        subject: &str,
    ) -> Result<Vec<Descriptor>, ResolveError> {
        let found = stored::stored_index_blobs(&self.store.metadata(), subject);
        match from_store("index artifacts", found) {
            Ok(Some(blobs)) => Ok(blobs),
            Ok(None) => self.registry.index_blobs(repo, subject).await,
            Err(e) => or_registry(Some(e), self.registry.index_blobs(repo, subject)).await,
        }
    }

    async fn index(&self, repo: &Repo, blob: &Descriptor) -> Result<LayerIndex, ResolveError> {
        let found = stored::stored_index(&self.store.metadata(), blob);
        match from_store("index blob", found) {
            Ok(Some(index)) => Ok(index),
            Ok(None) => self.registry.index(repo, blob).await,
            Err(e) => or_registry(Some(e), self.registry.index(repo, blob)).await,
        }
    }
}

/// An image's manifest digest and layers, and where each layer's index is.
#[derive(Debug)]
struct ResolvedImage {
    manifest_digest: String,
    layers: Vec<Descriptor>,
    /// Layer digest → its index blob (as the artifact's annotation names it).
    index_blobs: HashMap<String, Descriptor>,
}

/// One layer as a lazy mount needs it.
#[derive(Debug, Clone)]
pub struct ResolvedLayer {
    /// The image manifest's digest.
    pub manifest_digest: String,
    /// The layer's descriptor in the manifest.
    pub descriptor: Descriptor,
    /// Its ferry index, when one refers to the image.
    pub index: Option<Arc<LayerIndex>>,
    /// The index blob it came from.
    index_blob: Option<String>,
    /// Digests of the image's layers, in manifest order, each with whether a lazy
    /// mount serves it (indexed or eStargz) or it is unpacked: what its pull brings in.
    pub layers: Vec<(String, bool)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ImageKey {
    repo: Repo,
    reference: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BlobKey {
    repo: Repo,
    blob: String,
}

type Shared<T> = Result<Arc<T>, ResolveError>;

/// See the module doc.
pub struct LayerIndexes {
    inner: Arc<Inner>,
}

/// What the shared requests' tasks hold.
struct Inner {
    registry: Arc<dyn IndexRegistry>,
    timeout: Duration,
    /// Bounds index blob fetches in flight.
    fetches: Semaphore,
    image_flight: SingleFlight<ImageKey, Shared<ResolvedImage>>,
    images: MemoryCache<ImageKey, Arc<ResolvedImage>>,
    index_flight: SingleFlight<BlobKey, Shared<LayerIndex>>,
    indexes: MemoryCache<BlobKey, Arc<LayerIndex>>,
}

impl std::fmt::Debug for LayerIndexes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerIndexes")
            .field("images", &self.inner.images.len())
            .field("indexes", &self.inner.indexes.len())
            .finish_non_exhaustive()
    }
}

/// The value of `cache` at `key` while younger than [`RESOLVED_TTL`].
fn fresh<K: Eq + std::hash::Hash + Clone, V: Clone>(
    cache: &MemoryCache<K, V>,
    key: &K,
) -> Option<V> {
    match cache.get(key) {
        Some((v, at)) if at.elapsed() < RESOLVED_TTL => Some(v),
        Some(_) => {
            cache.remove(key);
            None
        }
        None => None,
    }
}

/// `call`, or [`ResolveError::TimedOut`] once `timeout` has passed.
async fn bounded<T>(
    timeout: Duration,
    what: impl FnOnce() -> String,
    call: impl std::future::Future<Output = Result<T, ResolveError>>,
) -> Result<T, ResolveError> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(ResolveError::TimedOut {
                what: what(),
                timeout,
            })
        })
}

impl LayerIndexes {
    /// Resolves through `registry`, each request bounded by `timeout`.
    pub fn new(registry: Arc<dyn IndexRegistry>, timeout: Duration) -> LayerIndexes {
        LayerIndexes {
            inner: Arc::new(Inner {
                registry,
                timeout,
                fetches: Semaphore::new(INDEX_FETCHES),
                image_flight: SingleFlight::new(),
                images: MemoryCache::new(IMAGE_CACHE_BYTES),
                index_flight: SingleFlight::new(),
                indexes: MemoryCache::new(INDEX_CACHE_BYTES),
            }),
        }
    }

    /// Layer `layer` of the image `reference` names in `repo`, with its index. The
    /// indexes of the `ahead` layers (the layers still to be prepared, e.g. from CRI's
    /// image-layers label) start downloading too, without being waited for. Call on a
    /// tokio runtime (the shared requests run as tasks of it).
    pub async fn resolve(
        &self,
        repo: &Repo,
        reference: &str,
        layer: &str,
        ahead: &[String],
    ) -> Result<ResolvedLayer, ResolveError> {
        let image = image(&self.inner, repo, reference).await?;
        let started: Vec<&Descriptor> = ahead
            .iter()
            .filter(|d| d.as_str() != layer)
            .filter_map(|d| image.index_blobs.get(d))
            .collect();
        if !started.is_empty() {
            tracing::debug!(
                repository = %repo.repository,
                layer,
                ahead = started.len(),
                "fetching the indexes of the layers to be prepared next"
            );
        }
        for blob in started {
            {
                let fetch = fetch_index(self.inner.clone(), repo.clone(), blob.clone());
                // Only to have it ready: the Prepare that needs it sees any failure.
                tokio::spawn(fetch);
            }
        }
        let descriptor = image
            .layers
            .iter()
            .find(|d| d.digest().as_ref() == layer)
            .cloned()
            .ok_or_else(|| ResolveError::NoSuchLayer {
                image: format!("{}/{}:{reference}", repo.registry, repo.repository),
                layer: layer.to_owned(),
            })?;
        let blob = image.index_blobs.get(layer);
        let index = match blob {
            Some(blob) => Some(fetch_index(self.inner.clone(), repo.clone(), blob.clone()).await?),
            None => None,
        };
        let layers = image
            .layers
            .iter()
            .map(|d| {
                let has_index = image.index_blobs.contains_key(d.digest().as_ref());
                let lazy = crate::mounts::layer_kind_of(d, has_index).is_lazy();
                (d.digest().to_string(), lazy)
            })
            .collect();
        Ok(ResolvedLayer {
            manifest_digest: image.manifest_digest.clone(),
            descriptor,
            index,
            index_blob: blob.map(|b| b.digest().to_string()),
            layers,
        })
    }

    /// Every layer of the image in manifest order, each with its index when it has one
    /// (fetched at once, or taken from the cache and the flights already under way).
    /// What a layer's mount needs to follow a program's libraries or a Python import
    /// into the layers below and above it: containerd mounts each layer on its own, and
    /// the loader's `libc` is rarely in the layer of the program it loads.
    pub async fn layers_with_indexes(
        &self,
        repo: &Repo,
        reference: &str,
    ) -> Result<Vec<(Descriptor, Option<Arc<LayerIndex>>)>, ResolveError> {
        let image = image(&self.inner, repo, reference).await?;
        let fetched = futures_util::future::join_all(image.layers.iter().map(|d| {
            let blob = image.index_blobs.get(d.digest().as_ref()).cloned();
            let (inner, repo) = (self.inner.clone(), repo.clone());
            async move {
                match blob {
                    Some(blob) => fetch_index(inner, repo, blob).await.map(Some),
                    None => Ok(None),
                }
            }
        }))
        .await;
        image
            .layers
            .iter()
            .zip(fetched)
            .map(|(layer, index)| Ok((layer.clone(), index?)))
            .collect()
    }

    /// The mount of `layer` (of `repo`) holds its index now: the cache lets go of it
    /// (a later Prepare of the same layer fetches it again).
    pub fn taken(&self, repo: &Repo, layer: &ResolvedLayer) {
        if let Some(blob) = &layer.index_blob {
            self.inner.indexes.remove(&BlobKey {
                repo: repo.clone(),
                blob: blob.clone(),
            });
        }
    }
}

/// The image-level lookups of `reference` in `repo`, once per image while fresh.
async fn image(inner: &Arc<Inner>, repo: &Repo, reference: &str) -> Shared<ResolvedImage> {
    let key = ImageKey {
        repo: repo.clone(),
        reference: reference.to_owned(),
    };
    if let Some(image) = fresh(&inner.images, &key) {
        return Ok(image);
    }
    let shared = inner.clone();
    inner
        .image_flight
        .run(key.clone(), move || async move {
            // A flight that just landed filled the cache.
            if let Some(image) = fresh(&shared.images, &key) {
                return Ok(image);
            }
            let what = || {
                format!(
                    "resolving {}/{}:{}",
                    key.repo.registry, key.repo.repository, key.reference
                )
            };
            let image = bounded(shared.timeout, what, lookup_image(&shared, &key)).await?;
            let image = Arc::new(image);
            let weight = LAYER_WEIGHT * (image.layers.len() + image.index_blobs.len()) as u64;
            shared
                .images
                .insert(key, image.clone(), weight, Instant::now());
            Ok(image)
        })
        .await
        .unwrap_or(Err(ResolveError::Aborted))
}

/// Index blob `blob` of `repo`: from the cache, else one fetch shared with every other
/// caller asking for it meanwhile.
async fn fetch_index(inner: Arc<Inner>, repo: Repo, blob: Descriptor) -> Shared<LayerIndex> {
    let key = BlobKey {
        repo,
        blob: blob.digest().to_string(),
    };
    if let Some(index) = fresh(&inner.indexes, &key) {
        return Ok(index);
    }
    let shared = inner.clone();
    inner
        .index_flight
        .run(key.clone(), move || async move {
            if let Some(index) = fresh(&shared.indexes, &key) {
                return Ok(index);
            }
            let what = || format!("index blob {} of {}", key.blob, key.repo.repository);
            let index = bounded(shared.timeout, what, async {
                // Never closed: the semaphore lives as long as `shared`.
                let _permit = shared
                    .fetches
                    .acquire()
                    .await
                    .map_err(|_| ResolveError::Aborted)?;
                shared.registry.index(&key.repo, &blob).await
            })
            .await?;
            let index = Arc::new(index);
            shared
                .indexes
                .insert(key, index.clone(), blob.size(), Instant::now());
            Ok(index)
        })
        .await
        .unwrap_or(Err(ResolveError::Aborted))
}

/// Manifest and index artifacts of one image. An index blob that does not say which
/// layer it indexes is fetched here to find out (ferry's own artifacts always say).
async fn lookup_image(inner: &Arc<Inner>, key: &ImageKey) -> Result<ResolvedImage, ResolveError> {
    let (registry, repo) = (&inner.registry, &key.repo);
    let (manifest_digest, layers, blobs) = if key.reference.starts_with("sha256:") {
        // The referrers' subject is known already: ask both at once.
        let (manifest, blobs) = tokio::join!(
            registry.manifest(repo, &key.reference),
            registry.index_blobs(repo, &key.reference)
        );
        let (digest, layers) = manifest?;
        let blobs = if digest == key.reference {
            blobs?
        } else {
            // The digest named an image index: the platform's manifest is the subject.
            registry.index_blobs(repo, &digest).await?
        };
        (digest, layers, blobs)
    } else {
        let (digest, layers) = registry.manifest(repo, &key.reference).await?;
        let blobs = registry.index_blobs(repo, &digest).await?;
        (digest, layers, blobs)
    };
    let mut index_blobs = HashMap::new();
    let mut unnamed = Vec::new();
    for blob in blobs {
        let named = blob
            .annotations()
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_LAYER_DIGEST))
            .cloned();
        match named {
            Some(layer) => {
                index_blobs.entry(layer).or_insert(blob);
            }
            None => unnamed.push(blob),
        }
    }
    let fetched = futures_util::future::join_all(
        unnamed
            .iter()
            .map(|blob| fetch_index(inner.clone(), repo.clone(), blob.clone())),
    )
    .await;
    for (blob, index) in unnamed.into_iter().zip(fetched) {
        index_blobs
            .entry(index?.layer_digest.clone())
            .or_insert(blob);
    }
    Ok(ResolvedImage {
        manifest_digest,
        layers,
        index_blobs,
    })
}

#[cfg(test)]
#[path = "indexes_tests.rs"]
mod tests;
