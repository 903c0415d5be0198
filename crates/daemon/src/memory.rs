//! An in-memory [`MountBackend`]: it knows images and layers it was told about and
//! "mounts" by recording. It lets the control API and the snapshotter hook be tested
//! (and demonstrated) without FUSE, root or a registry; it must never touch the disk.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_fs::StatsSnapshot;
use parking_lot::{Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::fallback::FallbackLog;
use crate::mounts::{
    LayerKind, MountBackend, MountInfo, MountOrigin, MountRequest, MountStatus, StoreStatus,
};

/// See the module doc.
#[derive(Debug, Default)]
pub struct MemoryBackend {
    state: Mutex<State>,
    fallbacks: FallbackLog,
}

/// Makes the error a failing call returns (errors are not `Clone`).
#[derive(Clone)]
struct Failure(Arc<dyn Fn() -> Error + Send + Sync>);

impl std::fmt::Debug for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Failure")
    }
}

#[derive(Debug, Default)]
struct State {
    /// image → (manifest digest, layers with their kind).
    images: HashMap<String, (String, Vec<(String, LayerKind)>)>,
    mounts: BTreeMap<PathBuf, MountStatus>,
    unmounted: Vec<PathBuf>,
    /// Every `detach_stale` call, in order.
    detached: Vec<PathBuf>,
    /// Every `layer_kind` call: (image, layer, the layers named ahead of it).
    asked: Vec<(String, String, Vec<String>)>,
    /// Images whose lookups fail, with what.
    failing_lookups: HashMap<String, Failure>,
    /// Images whose mounts fail, with what.
    failing_mounts: HashMap<String, Failure>,
    /// What `store_status` answers.
    store: Option<StoreStatus>,
}

impl MemoryBackend {
    /// A backend that knows no images.
    pub fn new() -> MemoryBackend {
        MemoryBackend::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Makes `image` known with this manifest digest and layers.
    pub fn add_image(&self, image: &str, manifest_digest: &str, layers: &[(&str, LayerKind)]) {
        self.state().images.insert(
            image.to_owned(),
            (
                manifest_digest.to_owned(),
                layers.iter().map(|(d, k)| ((*d).to_owned(), *k)).collect(),
            ),
        );
    }

    /// Makes every `layer_kind` of `image` fail with what `error` makes (a registry that
    /// refuses, times out…).
    pub fn fail_lookups(&self, image: &str, error: impl Fn() -> Error + Send + Sync + 'static) {
        self.state()
            .failing_lookups
            .insert(image.to_owned(), Failure(Arc::new(error)));
    }

    /// Makes every mount of `image` fail with what `error` makes.
    pub fn fail_mounts(&self, image: &str, error: impl Fn() -> Error + Send + Sync + 'static) {
        self.state()
            .failing_mounts
            .insert(image.to_owned(), Failure(Arc::new(error)));
    }

    /// Sets what the store status reports (`None`: no store, the default).
    pub fn set_store(&self, store: Option<StoreStatus>) {
        self.state().store = store;
    }

    /// Sets the counters a mount reports.
    pub fn set_stats(&self, mountpoint: &Path, stats: StatsSnapshot) {
        if let Some(m) = self.state().mounts.get_mut(mountpoint) {
            m.stats = stats;
        }
    }

    /// Every layer asked about through `layer_kind` so far, in order: image, layer and
    /// the layers named ahead of it.
    pub fn asked(&self) -> Vec<(String, String, Vec<String>)> {
        self.state().asked.clone()
    }

    /// Mount points unmounted so far, in order.
    pub fn unmounted(&self) -> Vec<PathBuf> {
        self.state().unmounted.clone()
    }

    /// Mount points asked to be detached as stale so far, in order.
    pub fn detached(&self) -> Vec<PathBuf> {
        self.state().detached.clone()
    }
}

impl MountBackend for MemoryBackend {
    fn mount(&self, request: &MountRequest, origin: MountOrigin) -> Result<MountInfo> {
        if !request.mountpoint.is_absolute() {
            return Err(Error::InvalidRequest(format!(
                "mount point {} is not an absolute path",
                request.mountpoint.display()
            )));
        }
        let mut state = self.state();
        if let Some(failure) = state.failing_mounts.get(&request.image) {
            return Err((failure.0)());
        }
        if state.mounts.contains_key(&request.mountpoint) {
            return Err(Error::AlreadyMounted(request.mountpoint.clone()));
        }
        let (manifest, layers) = state
            .images
            .get(&request.image)
            .ok_or_else(|| Error::InvalidRequest(format!("no such image {}", request.image)))?;
        if let Some(layer) = &request.layer
            && !layers.iter().any(|(d, _)| d == layer)
        {
            return Err(Error::InvalidRequest(format!(
                "image {} has no layer {layer}",
                request.image
            )));
        }
        let info = MountInfo {
            mountpoint: request.mountpoint.clone(),
            image: request.image.clone(),
            layer: request.layer.clone(),
            manifest_digest: manifest.clone(),
        };
        state.mounts.insert(
            request.mountpoint.clone(),
            MountStatus {
                info: info.clone(),
                origin,
                stats: StatsSnapshot::default(),
                trace: None,
                recording: false,
            },
        );
        Ok(info)
    }

    fn unmount(&self, mountpoint: &Path) -> Result<()> {
        let mut state = self.state();
        if state.mounts.remove(mountpoint).is_none() {
            return Err(Error::NotMounted(mountpoint.to_path_buf()));
        }
        state.unmounted.push(mountpoint.to_path_buf());
        Ok(())
    }

    /// Records the call; nothing is stale in memory (a mount it serves stays).
    fn detach_stale(&self, mountpoint: &Path) -> Result<()> {
        self.state().detached.push(mountpoint.to_path_buf());
        Ok(())
    }

    fn list(&self) -> Vec<MountStatus> {
        self.state().mounts.values().cloned().collect()
    }

    fn store_status(&self) -> Option<StoreStatus> {
        self.state().store.clone()
    }

    fn layer_kind(
        &self,
        image: &str,
        layer: &str,
        ahead: &[String],
    ) -> Result<(LayerKind, String)> {
        let mut state = self.state();
        state
            .asked
            .push((image.to_owned(), layer.to_owned(), ahead.to_vec()));
        if let Some(failure) = state.failing_lookups.get(image) {
            return Err((failure.0)());
        }
        let (manifest, layers) = state
            .images
            .get(image)
            .ok_or_else(|| Error::InvalidRequest(format!("no such image {image}")))?;
        let kind = layers
            .iter()
            .find(|(d, _)| d == layer)
            .map(|(_, k)| *k)
            .ok_or_else(|| Error::InvalidRequest(format!("image {image} has no layer {layer}")))?;
        Ok((kind, manifest.clone()))
    }

    fn fallbacks(&self) -> Option<&FallbackLog> {
        Some(&self.fallbacks)
    }
}
