//! [`LayerIndexes`] against an in-memory registry that counts what it is asked.

#![allow(clippy::unwrap_used)]

use std::sync::Mutex;

use ferry_index::ferryidx::Compression;
use tokio::sync::watch;

use super::*;

fn digest(c: char, i: usize) -> String {
    format!("sha256:{c}{:063x}", i)
}

fn descriptor(media: &str, digest: &str, size: u64, layer: Option<&str>) -> Descriptor {
    let mut d = serde_json::json!({ "mediaType": media, "digest": digest, "size": size });
    if let Some(l) = layer {
        d["annotations"] = serde_json::json!({ ANNOTATION_LAYER_DIGEST: l });
    }
    serde_json::from_value(d).unwrap()
}

/// An image of `n` layers, each with an index blob; index fetches wait for `open`.
struct FakeRegistry {
    manifest_digest: String,
    layers: Vec<Descriptor>,
    blobs: Vec<Descriptor>,
    /// What was asked, in order: `manifest`, `index_blobs`, `index <blob>`.
    asked: Mutex<Vec<String>>,
    /// Index blob → failures still to answer before it succeeds.
    failing: Mutex<HashMap<String, usize>>,
    open: watch::Receiver<bool>,
}

impl FakeRegistry {
    /// The registry and the switch that lets its index fetches answer.
    fn new(n: usize, annotated: bool) -> (Arc<FakeRegistry>, watch::Sender<bool>) {
        let layers: Vec<_> = (0..n)
            .map(|i| {
                descriptor(
                    "application/vnd.oci.image.layer.v1.tar+gzip",
                    &digest('a', i),
                    1000 + i as u64,
                    None,
                )
            })
            .collect();
        let blobs = (0..n)
            .map(|i| {
                let layer = digest('a', i);
                descriptor(
                    ferry_oci::media::FERRY_LAYER_INDEX,
                    &digest('b', i),
                    100,
                    annotated.then_some(layer.as_str()),
                )
            })
            .collect();
        let (tx, rx) = watch::channel(true);
        let registry = FakeRegistry {
            manifest_digest: digest('m', 0),
            layers,
            blobs,
            asked: Mutex::new(Vec::new()),
            failing: Mutex::new(HashMap::new()),
            open: rx,
        };
        (Arc::new(registry), tx)
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }

    fn index_fetches(&self) -> usize {
        self.asked()
            .iter()
            .filter(|a| a.starts_with("index "))
            .count()
    }

    fn note(&self, what: String) {
        self.asked.lock().unwrap().push(what);
    }
}

#[async_trait]
impl IndexRegistry for FakeRegistry {
    async fn manifest(
        &self,
        repo: &Repo,
        reference: &str,
    ) -> Result<(String, Vec<Descriptor>), ResolveError> {
        self.note(asked_as("manifest", repo));
        pull_right(repo)?;
        if reference != self.manifest_digest && reference != "v1" {
            return Err(ResolveError::Registry {
                reason: NotLazyReason::NotFound,
                message: format!("no manifest {reference}"),
            });
        }
        Ok((self.manifest_digest.clone(), self.layers.clone()))
    }

    async fn index_blobs(
        &self,
        repo: &Repo,
        subject: &str,
    ) -> Result<Vec<Descriptor>, ResolveError> {
        self.note(asked_as("index_blobs", repo));
        pull_right(repo)?;
        if subject != self.manifest_digest {
            return Ok(Vec::new());
        }
        Ok(self.blobs.clone())
    }

    async fn index(&self, repo: &Repo, blob: &Descriptor) -> Result<LayerIndex, ResolveError> {
        let blob_digest = blob.digest().to_string();
        self.note(format!("index {blob_digest}"));
        pull_right(repo)?;
        let mut open = self.open.clone();
        open.wait_for(|o| *o).await.unwrap();
        {
            let mut failing = self.failing.lock().unwrap();
            if let Some(left) = failing.get_mut(&blob_digest)
                && *left > 0
            {
                *left -= 1;
                return Err(ResolveError::Registry {
                    reason: NotLazyReason::Unreachable,
                    message: "503 from the fake".into(),
                });
            }
        }
        let i = self
            .blobs
            .iter()
            .position(|b| b.digest() == blob.digest())
            .unwrap();
        Ok(LayerIndex {
            layer_digest: self.layers[i].digest().to_string(),
            compression: Compression::None,
            compressed_size: self.layers[i].size(),
            uncompressed_size: self.layers[i].size(),
            span_size: 1 << 20,
            checkpoints: Vec::new(),
            span_digests: Vec::new(),
            entries: Vec::new(),
            windows: None,
            libraries: Vec::new(),
        })
    }
}

fn repo() -> Repo {
    Repo::parse("reg.local:5000", "app").unwrap()
}

/// How the fake records a request: by its kind, with the repository when it is not
/// `app` (the one every other test uses).
fn asked_as(what: &str, repo: &Repo) -> String {
    if repo.repository == "app" {
        what.to_owned()
    } else {
        format!("{what} {}", repo.repository)
    }
}

/// The node may pull `app` only (what the registry would answer for any other
/// repository, whose content the node has no right to).
fn pull_right(repo: &Repo) -> Result<(), ResolveError> {
    if repo.repository == "app" {
        Ok(())
    } else {
        Err(ResolveError::Registry {
            reason: NotLazyReason::Unauthorized,
            message: format!("denied: {}", repo.repository),
        })
    }
}

fn layer_digests(n: usize) -> Vec<String> {
    (0..n).map(|i| digest('a', i)).collect()
}

/// Waits (bounded) until `cond` holds; yields to the runtime in between.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "never happened: {what}");
}

/// The labels' layers after layer `i`, as `LazyLayers` hands them over.
fn ahead(layers: &[String], i: usize) -> Vec<String> {
    layers[i + 1..].to_vec()
}

/// A registry of `n` annotated layers and a node's index cache after the first layer's
/// Prepare fetched every index.
struct Resolved {
    registry: Arc<FakeRegistry>,
    _open: watch::Sender<bool>,
    indexes: LayerIndexes,
    layers: Vec<String>,
    manifest: String,
}

async fn resolved(n: usize) -> Resolved {
    let (registry, _open) = FakeRegistry::new(n, true);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_secs(30));
    let layers = layer_digests(n);
    let manifest = registry.manifest_digest.clone();
    indexes
        .resolve(&repo(), &manifest, &layers[0], &ahead(&layers, 0))
        .await
        .unwrap();
    eventually("every index fetched", || registry.index_fetches() == n).await;
    Resolved {
        registry,
        _open,
        indexes,
        layers,
        manifest,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_prepare_fetches_every_layer_and_the_others_ask_nothing_more() {
    let n = 5;
    let (registry, _open) = FakeRegistry::new(n, true);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_secs(30));
    let layers = layer_digests(n);
    let manifest = registry.manifest_digest.clone();

    let first = indexes
        .resolve(&repo(), &manifest, &layers[0], &ahead(&layers, 0))
        .await
        .unwrap();
    assert_eq!(first.manifest_digest, manifest);
    assert_eq!(first.descriptor.digest().as_ref(), layers[0]);
    assert_eq!(first.index.unwrap().layer_digest, layers[0]);
    // Every other layer's index was started by the first Prepare.
    eventually("every index fetched", || registry.index_fetches() == n).await;
    let before = registry.asked();
    // Pinned reference: manifest and referrers once, at the same time.
    assert_eq!(before.iter().filter(|a| *a == "manifest").count(), 1);
    assert_eq!(before.iter().filter(|a| *a == "index_blobs").count(), 1);

    for i in 1..n {
        let layer = indexes
            .resolve(&repo(), &manifest, &layers[i], &ahead(&layers, i))
            .await
            .unwrap();
        assert_eq!(layer.index.unwrap().layer_digest, layers[i]);
    }
    assert_eq!(
        registry.asked(),
        before,
        "layers 1..n asked the registry again"
    );
}

/// What one repository resolved is never an answer for another: the same manifest and
/// layer named under a repository the node may not pull go to the registry, which
/// refuses, instead of being served from the first repository's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_repository_is_not_answered_from_this_ones_cache() {
    let n = 3;
    let Resolved {
        registry,
        _open,
        indexes,
        layers,
        manifest,
    } = resolved(n).await;
    let other = Repo::parse("reg.local:5000", "private").unwrap();
    for layer in &layers {
        let denied = indexes.resolve(&other, &manifest, layer, &[]).await;
        assert!(
            denied.is_err(),
            "{layer} of another repository came from the cache"
        );
    }
    assert!(registry.asked().iter().any(|a| a == "manifest private"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_taken_by_its_mount_is_dropped() {
    let (registry, _open) = FakeRegistry::new(2, true);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_secs(30));
    let layers = layer_digests(2);
    let manifest = registry.manifest_digest.clone();
    let first = indexes
        .resolve(&repo(), &manifest, &layers[0], &ahead(&layers, 0))
        .await
        .unwrap();
    eventually("both indexes fetched", || indexes.inner.indexes.len() == 2).await;
    indexes.taken(&repo(), &first);
    assert_eq!(indexes.inner.indexes.len(), 1, "the other layer's stays");
    // Asked again (a second pull), the layer is fetched again; the image is not.
    indexes
        .resolve(&repo(), &manifest, &layers[0], &[])
        .await
        .unwrap();
    assert_eq!(registry.index_fetches(), 3);
    assert_eq!(
        registry.asked().iter().filter(|a| *a == "manifest").count(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_joins_the_fetch_its_predecessor_started() {
    let (registry, open) = FakeRegistry::new(3, true);
    open.send_replace(false);
    let indexes = Arc::new(LayerIndexes::new(registry.clone(), Duration::from_secs(30)));
    let layers = layer_digests(3);
    let manifest = registry.manifest_digest.clone();
    // Layer 0's Prepare waits for its index; the other two fetches are started.
    let first = {
        let (indexes, layers, manifest) = (indexes.clone(), layers.clone(), manifest.clone());
        tokio::spawn(async move {
            indexes
                .resolve(&repo(), &manifest, &layers[0], &ahead(&layers, 0))
                .await
        })
    };
    eventually("three fetches in flight", || registry.index_fetches() == 3).await;
    // Layer 1's Prepare arrives while its fetch is still in flight: it joins it.
    let second = {
        let (indexes, layers, manifest) = (indexes.clone(), layers.clone(), manifest.clone());
        tokio::spawn(async move {
            indexes
                .resolve(&repo(), &manifest, &layers[1], &ahead(&layers, 1))
                .await
        })
    };
    open.send_replace(true);
    first.await.unwrap().unwrap();
    assert_eq!(
        second.await.unwrap().unwrap().index.unwrap().layer_digest,
        layers[1]
    );
    assert_eq!(registry.index_fetches(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_prepares_of_one_layer_fetch_once() {
    let (registry, open) = FakeRegistry::new(2, true);
    open.send_replace(false);
    let indexes = Arc::new(LayerIndexes::new(registry.clone(), Duration::from_secs(30)));
    let layers = layer_digests(2);
    let mut prepares = Vec::new();
    for _ in 0..8 {
        let (indexes, layer) = (indexes.clone(), layers[1].clone());
        // By tag: the image-level lookups are shared too.
        prepares.push(tokio::spawn(async move {
            indexes.resolve(&repo(), "v1", &layer, &[]).await
        }));
    }
    eventually("the fetch in flight", || registry.index_fetches() == 1).await;
    open.send_replace(true);
    for p in prepares {
        assert_eq!(
            p.await.unwrap().unwrap().index.unwrap().layer_digest,
            layers[1]
        );
    }
    let asked = registry.asked();
    assert_eq!(
        asked,
        vec![
            "manifest".to_owned(),
            "index_blobs".to_owned(),
            format!("index {}", digest('b', 1)),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefetch_is_not_kept_and_the_prepare_retries() {
    let (registry, _open) = FakeRegistry::new(3, true);
    registry.failing.lock().unwrap().insert(digest('b', 2), 1);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_secs(30));
    let layers = layer_digests(3);
    let manifest = registry.manifest_digest.clone();
    indexes
        .resolve(&repo(), &manifest, &layers[0], &ahead(&layers, 0))
        .await
        .unwrap();
    // The prefetch of layer 2 failed once (and nobody waited for it)…
    eventually("the failed prefetch", || registry.index_fetches() == 3).await;
    eventually("the failed flight landed", || {
        registry.failing.lock().unwrap()[&digest('b', 2)] == 0
            && indexes.inner.index_flight.running() == 0
    })
    .await;
    indexes
        .resolve(&repo(), &manifest, &layers[1], &ahead(&layers, 1))
        .await
        .unwrap();
    // …so layer 2's own Prepare asks again and gets it.
    let third = indexes
        .resolve(&repo(), &manifest, &layers[2], &[])
        .await
        .unwrap();
    assert_eq!(third.index.unwrap().layer_digest, layers[2]);
    assert_eq!(registry.index_fetches(), 4);
    // The image-level lookups were not repeated.
    assert_eq!(
        registry.asked().iter().filter(|a| *a == "manifest").count(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_image_lookup_is_retried_by_the_next_prepare() {
    let (registry, _open) = FakeRegistry::new(2, true);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_secs(30));
    let layers = layer_digests(2);
    // A reference the fake does not know fails…
    let err = indexes
        .resolve(&repo(), &digest('x', 0), &layers[0], &[])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ResolveError::Registry {
                reason: NotLazyReason::NotFound,
                ..
            }
        ),
        "{err}"
    );
    // …and is not remembered: the right one works, an unknown layer is named.
    let manifest = registry.manifest_digest.clone();
    indexes
        .resolve(&repo(), &manifest, &layers[0], &[])
        .await
        .unwrap();
    let missing = indexes
        .resolve(&repo(), &manifest, &digest('c', 9), &[])
        .await
        .unwrap_err();
    assert!(
        matches!(missing, ResolveError::NoSuchLayer { .. }),
        "{missing}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_blobs_without_a_layer_annotation_are_fetched_to_find_their_layer() {
    let (registry, _open) = FakeRegistry::new(2, false);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_secs(30));
    let layers = layer_digests(2);
    let manifest = registry.manifest_digest.clone();
    for layer in &layers {
        let resolved = indexes
            .resolve(&repo(), &manifest, layer, &[])
            .await
            .unwrap();
        assert_eq!(resolved.index.unwrap().layer_digest, *layer);
    }
    assert_eq!(registry.index_fetches(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_never_answers_times_out() {
    let (registry, open) = FakeRegistry::new(1, true);
    open.send_replace(false);
    let indexes = LayerIndexes::new(registry.clone(), Duration::from_millis(200));
    let layers = layer_digests(1);
    let manifest = registry.manifest_digest.clone();
    let err = indexes
        .resolve(&repo(), &manifest, &layers[0], &[])
        .await
        .unwrap_err();
    assert!(matches!(err, ResolveError::TimedOut { .. }), "{err}");
    // Not remembered: once the registry answers, the same layer resolves.
    open.send_replace(true);
    indexes
        .resolve(&repo(), &manifest, &layers[0], &[])
        .await
        .unwrap();
}

/// A registry that cannot be reached, counting what it is asked.
#[derive(Default)]
struct DownRegistry {
    asked: Mutex<Vec<String>>,
}

impl DownRegistry {
    fn down(&self, what: &str) -> ResolveError {
        self.asked.lock().unwrap().push(what.to_owned());
        ResolveError::Registry {
            reason: NotLazyReason::Unreachable,
            message: "cannot reach reg.local:5000: connection refused".into(),
        }
    }
}

#[async_trait]
impl IndexRegistry for DownRegistry {
    async fn manifest(&self, _: &Repo, _: &str) -> Result<(String, Vec<Descriptor>), ResolveError> {
        Err(self.down("manifest"))
    }
    async fn index_blobs(&self, _: &Repo, _: &str) -> Result<Vec<Descriptor>, ResolveError> {
        Err(self.down("index_blobs"))
    }
    async fn index(&self, _: &Repo, _: &Descriptor) -> Result<LayerIndex, ResolveError> {
        Err(self.down("index"))
    }
}

/// A store holding the metadata of a one-layer indexed image `reg.local:5000/app:v1`,
/// recorded the way prewarm records it; returns the manifest digest and the layer.
fn store_with_image(dir: &std::path::Path) -> (Arc<ferry_store::Store>, String, String) {
    use ferry_fs::backend::stored::{MetadataBlob, keep_metadata, role};
    let store = Arc::new(
        ferry_store::Store::open_with(
            dir,
            ferry_store::StoreOptions {
                flush_interval: None,
                ..ferry_store::StoreOptions::default()
            },
        )
        .unwrap(),
    );
    let layer = digest('a', 0);
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:00"]}}"#;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": ferry_oci::media::OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": ferry_store::ChunkKey::of(config).to_string(), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer, "size": 1000}],
    });
    let manifest = serde_json::to_vec(&manifest).unwrap();
    let manifest_digest = ferry_store::ChunkKey::of(&manifest).to_string();
    let index = LayerIndex {
        layer_digest: layer.clone(),
        compression: Compression::None,
        compressed_size: 1000,
        // Empty: a valid index needs no checkpoint then.
        uncompressed_size: 0,
        span_size: 1 << 20,
        checkpoints: Vec::new(),
        span_digests: Vec::new(),
        entries: Vec::new(),
        windows: None,
        libraries: Vec::new(),
    }
    .encode()
    .unwrap();
    let artifact = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": ferry_oci::media::OCI_MANIFEST,
        "artifactType": ferry_oci::media::FERRY_INDEX_ARTIFACT,
        "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                   "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2},
        "layers": [{"mediaType": ferry_oci::media::FERRY_LAYER_INDEX,
                    "digest": ferry_store::ChunkKey::of(&index).to_string(), "size": index.len(),
                    "annotations": {ANNOTATION_LAYER_DIGEST: layer}}],
        "subject": {"mediaType": ferry_oci::media::OCI_MANIFEST, "digest": manifest_digest, "size": manifest.len()},
    });
    let blobs = [
        (role::MANIFEST, manifest.clone()),
        (role::CONFIG, config.to_vec()),
        (role::INDEX_ARTIFACT, serde_json::to_vec(&artifact).unwrap()),
        (role::LAYER_INDEX, index),
    ]
    .map(|(role, bytes)| MetadataBlob {
        role,
        media_type: String::new(),
        bytes,
    });
    let metadata = keep_metadata(&store, &blobs).unwrap();
    store
        .record_image(&ferry_store::ImageRecord {
            reference: "reg.local:5000/app:v1".into(),
            manifest_digest: manifest_digest.clone(),
            layers: Vec::new(),
            coverage: "full".into(),
            recorded_ms: 1,
            metadata,
        })
        .unwrap();
    (store, manifest_digest, layer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_the_store_holds_resolves_with_no_registry_request() {
    let dir = tempfile::tempdir().unwrap();
    let (store, manifest, layer) = store_with_image(dir.path());
    let down = Arc::new(DownRegistry::default());
    let registry = Arc::new(StoreFirstRegistry {
        registry: down.clone(),
        store,
    });
    let indexes = LayerIndexes::new(registry, Duration::from_secs(30));
    let resolved = indexes
        .resolve(&repo(), &manifest, &layer, &[])
        .await
        .unwrap();
    assert_eq!(resolved.manifest_digest, manifest);
    assert_eq!(resolved.index.unwrap().layer_digest, layer);
    assert_eq!(resolved.layers, vec![(layer.clone(), true)]);
    assert!(
        down.asked.lock().unwrap().is_empty(),
        "the registry was asked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_is_resolved_from_the_record_only_when_the_registry_is_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let (store, manifest, layer) = store_with_image(dir.path());
    // Down: the record answers, after the registry was asked.
    let down = Arc::new(DownRegistry::default());
    let registry = StoreFirstRegistry {
        registry: down.clone(),
        store: store.clone(),
    };
    let (digest, layers) = registry.manifest(&repo(), "v1").await.unwrap();
    assert_eq!(digest, manifest);
    assert_eq!(layers[0].digest().as_ref(), layer);
    assert_eq!(*down.asked.lock().unwrap(), vec!["manifest".to_owned()]);
    // Up: the registry's answer wins (the tag may have moved).
    let (up, _open) = FakeRegistry::new(2, true);
    let registry = StoreFirstRegistry {
        registry: up.clone(),
        store: store.clone(),
    };
    let (digest, layers) = registry.manifest(&repo(), "v1").await.unwrap();
    assert_eq!(digest, up.manifest_digest);
    assert_eq!(layers.len(), 2);
    // A tag with no record is the registry's to answer (here: not reachable).
    let registry = StoreFirstRegistry {
        registry: down.clone(),
        store,
    };
    assert!(registry.manifest(&repo(), "v2").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_metadata_blob_is_not_used_and_the_error_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (store, manifest, _) = store_with_image(dir.path());
    let key = ferry_store::ChunkKey::parse(&manifest).unwrap();
    let path = dir.path().join("metadata").join(key.hex());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[5] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let down = Arc::new(DownRegistry::default());
    let registry = StoreFirstRegistry {
        registry: down.clone(),
        store,
    };
    let err = registry.manifest(&repo(), &manifest).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("connection refused"), "{text}");
    assert!(
        text.contains(&format!("metadata blob {manifest}")),
        "{text}"
    );
    assert!(text.contains("does not hash"), "{text}");
    // The registry was asked instead, and nothing in the store was changed.
    assert_eq!(*down.asked.lock().unwrap(), vec!["manifest".to_owned()]);
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

/// A layer's mount gets the image's other layers with their indexes (to follow a
/// program's libraries into them): every layer in manifest order, from the lookups the
/// Prepares made, with no new registry request; another repository gets nothing from
/// this one's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_mount_gets_every_layer_with_its_index_without_asking_again() {
    let n = 4;
    let Resolved {
        registry,
        _open,
        indexes,
        layers,
        manifest,
    } = resolved(n).await;
    let before = registry.asked();
    let all = indexes
        .layers_with_indexes(&repo(), &manifest)
        .await
        .unwrap();
    assert_eq!(all.len(), n);
    for ((desc, index), digest) in all.iter().zip(&layers) {
        assert_eq!(desc.digest().as_ref(), digest.as_str());
        assert_eq!(&index.as_ref().unwrap().layer_digest, digest);
    }
    assert_eq!(registry.asked(), before, "the registry was asked again");
    let other = Repo::parse("reg.local:5000", "private").unwrap();
    assert!(
        indexes
            .layers_with_indexes(&other, &manifest)
            .await
            .is_err(),
        "another repository's mount got this one's layers"
    );
}
