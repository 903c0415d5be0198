//! The remote-snapshot hook: how a lazy layer gets into a snapshot without containerd
//! downloading it. The snapshotter only knows this trait; ferry's lazy filesystem
//! implements it elsewhere, so this crate stays testable without FUSE, root or a network.
//!
//! Protocol (containerd's remote snapshotter contract): containerd calls `Prepare(key,
//! parent, labels)` with `containerd.io/snapshot.ref = <chain id>`. If an implementation
//! mounts the layer into the snapshot's directory, the snapshotter commits the snapshot
//! under that chain id and answers AlreadyExists; containerd then skips fetch and unpack.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::usage::Usage;

/// Label containerd sets on Prepare during unpack: the name (chain id) the layer's
/// committed snapshot will have.
pub const LABEL_TARGET: &str = "containerd.io/snapshot.ref";
/// CRI (with `disable_snapshot_annotations = false`): the image reference being pulled.
pub const LABEL_CRI_IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
/// CRI: the digest of the compressed layer blob being prepared.
pub const LABEL_CRI_LAYER_DIGEST: &str = "containerd.io/snapshot/cri.layer-digest";
/// CRI: comma-separated digests of this and the following layers (for prefetching).
pub const LABEL_CRI_IMAGE_LAYERS: &str = "containerd.io/snapshot/cri.image-layers";
/// CRI: the digest of the image manifest.
pub const LABEL_CRI_MANIFEST_DIGEST: &str = "containerd.io/snapshot/cri.manifest-digest";
/// ferry (set by `ferry pull`): the image reference, as for [`LABEL_CRI_IMAGE_REF`].
pub const LABEL_FERRY_IMAGE_REF: &str = "ferry.dev/image-ref";
/// ferry: the layer blob's digest.
pub const LABEL_FERRY_LAYER_DIGEST: &str = "ferry.dev/layer-digest";
/// ferry: the image manifest's digest.
pub const LABEL_FERRY_MANIFEST_DIGEST: &str = "ferry.dev/manifest-digest";
/// ferry: the digest of the layer's ferry index (or eStargz TOC) when the puller knows it,
/// so the lazy mount need not look it up again.
pub const LABEL_FERRY_INDEX_DIGEST: &str = "ferry.dev/index-digest";
/// ferry: the layer blob's media type.
pub const LABEL_FERRY_LAYER_MEDIA_TYPE: &str = "ferry.dev/layer-media-type";
/// ferry: the layer blob's size in bytes.
pub const LABEL_FERRY_LAYER_SIZE: &str = "ferry.dev/layer-size";
/// ferry (set by `ferry pull`, when calling the snapshotter directly): a directory
/// directly under the snapshotter's `staging/` directory that already holds this layer's
/// unpacked contents. The snapshotter moves it into the snapshot, commits it under
/// [`LABEL_TARGET`] and answers AlreadyExists, so layers can be unpacked in parallel
/// although Prepare follows the parent chain.
pub const LABEL_FERRY_STAGED_DIR: &str = "ferry.dev/staged-dir";
/// The same as [`LABEL_FERRY_STAGED_DIR`] under the `containerd.io/snapshot/` prefix:
/// containerd passes only labels with that prefix (and [`LABEL_TARGET`]) on to a
/// snapshotter, so this is the spelling `ferry pull` uses through containerd.
pub const LABEL_STAGED_DIR: &str = "containerd.io/snapshot/ferry.staged-dir";
/// Set by the snapshotter on snapshots it committed from a remote mount (value: the
/// provider name), so `ctr snapshots info` shows which layers are lazy.
pub const LABEL_FERRY_REMOTE: &str = "ferry.dev/remote";

/// Most digests accepted from the image-layers label (containerd caps labels at 4 KiB, so
/// a real list is far shorter; this only bounds what a hostile caller can make us hold).
const MAX_IMAGE_LAYERS: usize = 1024;

/// A lazy layer mounted into a snapshot's directory by a [`RemoteLayers`] implementation.
/// It is stored with the snapshot's metadata, so the same implementation can restore the
/// mount after a restart and release it when the snapshot is removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteMount {
    /// Which implementation made the mount (e.g. `ferry-fs`); logged and shown in labels.
    pub provider: String,
    /// Whatever the implementation needs to restore or release the mount later (image
    /// reference, layer digest, index digest…). Opaque to the snapshotter.
    pub state: BTreeMap<String, String>,
    /// Disk space the layer itself occupies on this node (not the shared chunk store);
    /// reported by `Usage` for the committed snapshot.
    pub usage: Usage,
}

/// Why a remote mount could not be made, restored or released.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A filesystem or mount operation failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Anything else the implementation wants to report (registry down, bad index…).
    #[error("{0}")]
    Failed(String),
}

/// Mounts image layers lazily. Called from blocking threads, never from the async runtime.
pub trait RemoteLayers: Send + Sync {
    /// Mount the layer described by `labels` (see [`LayerLabels`]) at `target_dir`, an
    /// empty directory the snapshotter created. `Ok(None)` means "not a layer I can serve
    /// lazily": containerd then downloads and unpacks it the ordinary way. An error is
    /// logged and treated the same way (the pull must not fail because lazy loading did).
    fn prepare_remote(
        &self,
        labels: &HashMap<String, String>,
        target_dir: &Path,
    ) -> Result<Option<RemoteMount>, RemoteError>;

    /// Mount again, after a restart, a layer this implementation mounted before.
    fn restore(&self, _mount: &RemoteMount, _target_dir: &Path) -> Result<(), RemoteError> {
        Ok(())
    }

    /// The snapshot holding this mount is being removed: unmount and release what it
    /// holds (store pins…). Called before its directory is deleted.
    fn release(&self, _mount: &RemoteMount, _target_dir: &Path) -> Result<(), RemoteError> {
        Ok(())
    }

    /// A layer that was not served lazily (`labels`: its Prepare's) has been unpacked
    /// and committed: the image's pull has moved past it.
    fn layer_committed(&self, _labels: &LayerLabels) {}
}

/// The labels of a remote-capable Prepare, parsed once for implementations. ferry's own
/// labels win over CRI's when both are present.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerLabels {
    /// The chain id the layer is to be committed as ([`LABEL_TARGET`]).
    pub target: String,
    /// Image reference, if given.
    pub image_ref: Option<String>,
    /// Layer blob digest, if given.
    pub layer_digest: Option<String>,
    /// Manifest digest, if given.
    pub manifest_digest: Option<String>,
    /// ferry index digest, if given.
    pub index_digest: Option<String>,
    /// This and the following layers' digests (CRI's image-layers list), possibly empty.
    pub image_layers: Vec<String>,
}

impl LayerLabels {
    /// `None` when the labels carry no target, i.e. this Prepare is not an unpack.
    pub fn parse(labels: &HashMap<String, String>) -> Option<LayerLabels> {
        let target = labels.get(LABEL_TARGET)?.trim();
        if target.is_empty() {
            return None;
        }
        let pick = |ours: &str, cri: &str| {
            labels
                .get(ours)
                .or_else(|| labels.get(cri))
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let image_layers = labels
            .get(LABEL_CRI_IMAGE_LAYERS)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .take(MAX_IMAGE_LAYERS)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        Some(LayerLabels {
            target: target.to_owned(),
            image_ref: pick(LABEL_FERRY_IMAGE_REF, LABEL_CRI_IMAGE_REF),
            layer_digest: pick(LABEL_FERRY_LAYER_DIGEST, LABEL_CRI_LAYER_DIGEST),
            manifest_digest: pick(LABEL_FERRY_MANIFEST_DIGEST, LABEL_CRI_MANIFEST_DIGEST),
            index_digest: labels
                .get(LABEL_FERRY_INDEX_DIGEST)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty()),
            image_layers,
        })
    }
}

/// Serves nothing lazily: every layer takes containerd's ordinary download path.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRemoteLayers;

impl RemoteLayers for NoRemoteLayers {
    fn prepare_remote(
        &self,
        _labels: &HashMap<String, String>,
        _target_dir: &Path,
    ) -> Result<Option<RemoteMount>, RemoteError> {
        Ok(None)
    }
}

/// An in-memory stand-in for the lazy filesystem, for tests and demos: layers are known
/// by digest, and "mounting" one writes its files into the target directory. It records
/// every prepare, restore and release so tests can check the protocol.
#[derive(Debug, Default)]
pub struct MemoryRemoteLayers {
    inner: Mutex<MemoryState>,
}

#[derive(Debug, Default)]
struct MemoryState {
    layers: HashMap<String, Vec<(PathBuf, Vec<u8>)>>,
    failing: HashMap<String, String>,
    prepared: Vec<LayerLabels>,
    restored: Vec<String>,
    released: Vec<String>,
    committed: Vec<LayerLabels>,
}

/// The provider name [`MemoryRemoteLayers`] puts in its mounts.
pub const MEMORY_PROVIDER: &str = "memory";

impl MemoryRemoteLayers {
    /// An implementation that knows no layers.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> parking_lot::MutexGuard<'_, MemoryState> {
        // A panic while holding this lock is a test failure already; keep going.
        self.inner.lock()
    }

    /// Make the layer with `digest` lazily available with these files (relative paths).
    pub fn add_layer(&self, digest: &str, files: Vec<(PathBuf, Vec<u8>)>) {
        self.state().layers.insert(digest.to_owned(), files);
    }

    /// Make preparing `digest` fail with `message` (to test the fallback).
    pub fn fail_layer(&self, digest: &str, message: &str) {
        self.state()
            .failing
            .insert(digest.to_owned(), message.to_owned());
    }

    /// Every Prepare that reached this implementation, in order.
    pub fn prepared(&self) -> Vec<LayerLabels> {
        self.state().prepared.clone()
    }

    /// Layer digests restored after a restart, in order.
    pub fn restored(&self) -> Vec<String> {
        self.state().restored.clone()
    }

    /// Layer digests released by Remove, in order.
    pub fn released(&self) -> Vec<String> {
        self.state().released.clone()
    }

    /// The labels of every unpacked layer committed, in order.
    pub fn committed(&self) -> Vec<LayerLabels> {
        self.state().committed.clone()
    }
}

impl RemoteLayers for MemoryRemoteLayers {
    fn prepare_remote(
        &self,
        labels: &HashMap<String, String>,
        target_dir: &Path,
    ) -> Result<Option<RemoteMount>, RemoteError> {
        let Some(parsed) = LayerLabels::parse(labels) else {
            return Ok(None);
        };
        let mut state = self.state();
        state.prepared.push(parsed.clone());
        let Some(digest) = parsed.layer_digest else {
            return Ok(None);
        };
        if let Some(message) = state.failing.get(&digest) {
            return Err(RemoteError::Failed(message.clone()));
        }
        let Some(files) = state.layers.get(&digest) else {
            return Ok(None);
        };
        let mut usage = Usage::default();
        for (rel, content) in files {
            let path = target_dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&path, content)?;
            usage.size += content.len() as u64;
            usage.inodes += 1;
        }
        let mut mount_state = BTreeMap::new();
        mount_state.insert("layer-digest".to_owned(), digest);
        Ok(Some(RemoteMount {
            provider: MEMORY_PROVIDER.to_owned(),
            state: mount_state,
            usage,
        }))
    }

    fn restore(&self, mount: &RemoteMount, _target_dir: &Path) -> Result<(), RemoteError> {
        let digest = mount.state.get("layer-digest").cloned().unwrap_or_default();
        self.state().restored.push(digest);
        Ok(())
    }

    fn release(&self, mount: &RemoteMount, _target_dir: &Path) -> Result<(), RemoteError> {
        let digest = mount.state.get("layer-digest").cloned().unwrap_or_default();
        self.state().released.push(digest);
        Ok(())
    }

    fn layer_committed(&self, labels: &LayerLabels) {
        self.state().committed.push(labels.clone());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn layer_labels_need_a_target_and_prefer_ferry_labels() {
        assert_eq!(
            LayerLabels::parse(&map(&[(LABEL_CRI_LAYER_DIGEST, "sha256:a")])),
            None
        );
        assert_eq!(LayerLabels::parse(&map(&[(LABEL_TARGET, " ")])), None);
        let parsed = LayerLabels::parse(&map(&[
            (LABEL_TARGET, "chain"),
            (LABEL_CRI_IMAGE_REF, "cri/ref:1"),
            (LABEL_CRI_LAYER_DIGEST, "sha256:cri"),
            (LABEL_FERRY_LAYER_DIGEST, "sha256:ferry"),
            (LABEL_FERRY_INDEX_DIGEST, "sha256:index"),
            (LABEL_CRI_IMAGE_LAYERS, "sha256:a, sha256:b,,"),
        ]))
        .unwrap();
        assert_eq!(parsed.target, "chain");
        assert_eq!(parsed.image_ref.as_deref(), Some("cri/ref:1"));
        assert_eq!(parsed.layer_digest.as_deref(), Some("sha256:ferry"));
        assert_eq!(parsed.index_digest.as_deref(), Some("sha256:index"));
        assert_eq!(parsed.manifest_digest, None);
        assert_eq!(parsed.image_layers, vec!["sha256:a", "sha256:b"]);
    }

    #[test]
    fn image_layers_are_bounded() {
        let long = vec!["sha256:x"; MAX_IMAGE_LAYERS + 10].join(",");
        let parsed = LayerLabels::parse(&map(&[
            (LABEL_TARGET, "t"),
            (LABEL_CRI_IMAGE_LAYERS, &long),
        ]))
        .unwrap();
        assert_eq!(parsed.image_layers.len(), MAX_IMAGE_LAYERS);
    }

    #[test]
    fn no_remote_layers_declines() {
        let dir = tempfile::tempdir().unwrap();
        let labels = map(&[(LABEL_TARGET, "t"), (LABEL_CRI_LAYER_DIGEST, "sha256:a")]);
        assert!(
            NoRemoteLayers
                .prepare_remote(&labels, dir.path())
                .unwrap()
                .is_none()
        );
    }
}
