//! The backend layer: where an image's manifest, indexes and layer bytes come from (an
//! OCI layout on disk or a registry over HTTP Range, [`range_source::HttpRangeSource`]),
//! and where its startup trace is found ([`find_trace`]: beside the index artifact, the
//! same way), and an image's metadata kept in the node's store for a start without the
//! registry ([`stored`]). The mounted image ([`crate::image`]) wires what it offers through the
//! device and cache layers.
//!
//! It must not know the device, the tree or the mount: nothing here imports them.

pub mod range_source;
mod registry;
pub mod stored;

use std::path::Path;
use std::sync::Arc;

use ferry_index::ferryidx::LayerIndex;
use ferry_index::source::{FileSource, RangeSource};
use ferry_oci::{Descriptor, ImageRef, OciLayout};
use ferry_registry_client::{Client, DownloadOptions, RangeRuntime, Repo};

pub use registry::{
    fetch_index_blob, fetch_registry_manifest, registry_index_blobs, registry_manifest,
};

use crate::error::{Error, Result};
use range_source::HttpRangeSource;
use registry::registry_indexes;

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
    pub(crate) fallback: Option<Arc<dyn RangeSource>>,
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

    /// Range reads of the layer go through `route(source)` instead (the daemon's peers
    /// before the registry); spans that do not verify are fetched again from the
    /// fallback the layer had, else from the source it had before, so bytes from the
    /// routed source get the same verification and the same second chance as any.
    pub fn route_through(
        mut self,
        route: impl FnOnce(Arc<dyn RangeSource>) -> Arc<dyn RangeSource>,
    ) -> LayerSpec {
        let before = self.source.clone();
        self.source = route(before.clone());
        if self.fallback.is_none() {
            self.fallback = Some(before);
        }
        self
    }

    /// True for a registry layer, whose whole blob [`Self::download_whole`] fetches; a
    /// layout blob is already on this machine and read in place.
    pub(crate) fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Downloads the whole blob of a registry layer to `path` (in parallel Range
    /// requests), verified against the layer digest; nothing for a layout layer.
    pub(crate) fn download_whole(&self, path: &Path) -> Result<()> {
        let Some(remote) = &self.remote else {
            return Ok(());
        };
        let opts = DownloadOptions::from_config(remote.client.config());
        remote
            .runtime
            .handle()
            .block_on(remote.client.download_blob(
                &remote.repo,
                self.descriptor.digest().as_ref(),
                self.descriptor.size(),
                path,
                &opts,
            ))?;
        Ok(())
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
