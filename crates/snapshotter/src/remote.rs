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

/// Why a layer was not served lazily, so containerd (or `ferry pull`) downloads and
/// unpacks it instead. Decided by the [`RemoteLayers`] implementation where the fact is
/// known, logged by the snapshotter with [`NotLazyReason::hint`], and counted by the
/// daemon per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NotLazyReason {
    /// No ferry index refers to the image for this layer, and it is neither eStargz nor zstd:chunked.
    NoIndex,
    /// The layer's format cannot be read lazily (zstd, an unknown media type).
    UnsupportedFormat,
    /// The Prepare's labels name no image or no layer (containerd passes none).
    NoImageLabels,
    /// The registry could not be reached, answered 429/5xx, or not in time.
    Unreachable,
    /// The registry refused the credentials (401/403).
    Unauthorized,
    /// The image, its manifest or the layer is not where the lazy path looks (404).
    NotFound,
    /// The registry's answer or the index was unusable (did not parse or verify).
    Invalid,
    /// The layer could not be mounted on this node (FUSE, mount point).
    MountFailed,
    /// This snapshotter serves no layer lazily.
    Disabled,
    /// Anything else (see the detail).
    Other,
}

impl NotLazyReason {
    /// Every reason, for metrics that list each one.
    pub const ALL: [NotLazyReason; 10] = [
        NotLazyReason::NoIndex,
        NotLazyReason::UnsupportedFormat,
        NotLazyReason::NoImageLabels,
        NotLazyReason::Unreachable,
        NotLazyReason::Unauthorized,
        NotLazyReason::NotFound,
        NotLazyReason::Invalid,
        NotLazyReason::MountFailed,
        NotLazyReason::Disabled,
        NotLazyReason::Other,
    ];

    /// The name in logs, status and metrics (as serialized).
    pub fn name(self) -> &'static str {
        match self {
            NotLazyReason::NoIndex => "no-index",
            NotLazyReason::UnsupportedFormat => "unsupported-format",
            NotLazyReason::NoImageLabels => "no-image-labels",
            NotLazyReason::Unreachable => "unreachable",
            NotLazyReason::Unauthorized => "unauthorized",
            NotLazyReason::NotFound => "not-found",
            NotLazyReason::Invalid => "invalid",
            NotLazyReason::MountFailed => "mount-failed",
            NotLazyReason::Disabled => "disabled",
            NotLazyReason::Other => "other",
        }
    }

    /// False for what an image simply is (no index, a format, missing labels), true for
    /// a failure worth a warning (the registry, credentials, the mount).
    pub fn is_failure(self) -> bool {
        !matches!(
            self,
            NotLazyReason::NoIndex
                | NotLazyReason::UnsupportedFormat
                | NotLazyReason::NoImageLabels
                | NotLazyReason::Disabled
        )
    }

    /// What the user can do so `image` (as containerd named it, if it did) is served
    /// lazily next time.
    pub fn hint(self, image: Option<&str>) -> String {
        let repo = image.map(repository_of);
        let registry = repo
            .as_deref()
            .map(|r| r.split_once('/').map_or(r, |(host, _)| host).to_owned());
        let or = |v: Option<String>, what: &str| v.unwrap_or_else(|| what.to_owned());
        match self {
            NotLazyReason::NoIndex => "index it with `ferry index` and push the index with the \
                image (`ferry copy`), or convert it with `ferry convert --estargz`"
                .to_owned(),
            NotLazyReason::UnsupportedFormat => "ferry reads gzip, plain tar and zstd:chunked \
                layers lazily: rewrite the image with `ferry convert --estargz` or \
                `--zstd-chunked`"
                .to_owned(),
            NotLazyReason::NoImageLabels => "containerd passed no image reference or layer \
                digest: set `disable_snapshot_annotations = false` for CRI (on containerd 2.x \
                also `enable_remote_snapshot_annotations` on the proxy plugin), or pull with \
                `ferry pull`"
                .to_owned(),
            NotLazyReason::Unreachable => format!(
                "check that this node reaches {} (network, proxy, hosts.toml mirrors) and the \
                 daemon's `[fetch] timeout`",
                or(registry, "the registry")
            ),
            NotLazyReason::Unauthorized => format!(
                "check credentials for {} (docker config, pull secrets through ferry's CRI \
                 proxy, a credential provider)",
                or(repo, "the repository")
            ),
            NotLazyReason::NotFound => format!(
                "check that ferry finds {} where containerd pulled it from (hosts.toml, \
                 `[registry] config_path`)",
                or(image.map(str::to_owned), "the image")
            ),
            NotLazyReason::Invalid => "the index or the registry's answer did not parse or \
                verify: index the image again (`ferry index`) and push it"
                .to_owned(),
            NotLazyReason::MountFailed => {
                "check /dev/fuse and the daemon's log for the mount error".to_owned()
            }
            NotLazyReason::Disabled => {
                "run the snapshotter in `ferry daemon` to serve layers lazily".to_owned()
            }
            NotLazyReason::Other => "see the snapshotter's log for the error".to_owned(),
        }
    }
}

impl std::fmt::Display for NotLazyReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `host/repo:tag@digest` → `host/repo` (the tag is the last `:` after the last `/`).
fn repository_of(image: &str) -> String {
    let name = image.split_once('@').map_or(image, |(n, _)| n);
    match name.rfind(':') {
        Some(colon) if colon > name.rfind('/').unwrap_or(0) => name[..colon].to_owned(),
        _ => name.to_owned(),
    }
}

/// A layer not served lazily: why, and the error or fact behind it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct NotLazy {
    /// Why.
    pub reason: NotLazyReason,
    /// The error or fact, for a human.
    pub detail: String,
}

impl NotLazy {
    /// A [`NotLazy`] for `reason`.
    pub fn new(reason: NotLazyReason, detail: impl Into<String>) -> NotLazy {
        NotLazy {
            reason,
            detail: detail.into(),
        }
    }
}

/// Mounts image layers lazily. Called from blocking threads, never from the async runtime.
pub trait RemoteLayers: Send + Sync {
    /// Mount the layer described by `labels` (see [`LayerLabels`]; the snapshotter calls
    /// only when they name a target) at `target_dir`, an empty directory the snapshotter
    /// created. [`NotLazy`] says why not: containerd then downloads and unpacks the layer
    /// the ordinary way (the pull must not fail because lazy loading did).
    fn prepare_remote(
        &self,
        labels: &HashMap<String, String>,
        target_dir: &Path,
    ) -> Result<RemoteMount, NotLazy>;

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
    ) -> Result<RemoteMount, NotLazy> {
        Err(NotLazy::new(
            NotLazyReason::Disabled,
            "no lazy layer provider",
        ))
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
    failing: HashMap<String, NotLazy>,
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

    /// Make preparing `digest` fail for `reason` with `message` (to test the fallback).
    pub fn fail_layer(&self, digest: &str, reason: NotLazyReason, message: &str) {
        self.state()
            .failing
            .insert(digest.to_owned(), NotLazy::new(reason, message));
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
    ) -> Result<RemoteMount, NotLazy> {
        let no_labels = || NotLazy::new(NotLazyReason::NoImageLabels, "no target or layer digest");
        let parsed = LayerLabels::parse(labels).ok_or_else(no_labels)?;
        let mut state = self.state();
        state.prepared.push(parsed.clone());
        let digest = parsed.layer_digest.ok_or_else(no_labels)?;
        if let Some(not_lazy) = state.failing.get(&digest) {
            return Err(not_lazy.clone());
        }
        let Some(files) = state.layers.get(&digest) else {
            return Err(NotLazy::new(
                NotLazyReason::NoIndex,
                format!("layer {digest} is not known in memory"),
            ));
        };
        let mount_failed = |e: io::Error| NotLazy::new(NotLazyReason::MountFailed, e.to_string());
        let mut usage = Usage::default();
        for (rel, content) in files {
            let path = target_dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(mount_failed)?;
            }
            std::fs::write(&path, content).map_err(mount_failed)?;
            usage.size += content.len() as u64;
            usage.inodes += 1;
        }
        let mut mount_state = BTreeMap::new();
        mount_state.insert("layer-digest".to_owned(), digest);
        Ok(RemoteMount {
            provider: MEMORY_PROVIDER.to_owned(),
            state: mount_state,
            usage,
        })
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
        let not_lazy = NoRemoteLayers
            .prepare_remote(&labels, dir.path())
            .unwrap_err();
        assert_eq!(not_lazy.reason, NotLazyReason::Disabled);
    }

    #[test]
    fn the_memory_implementation_says_why_it_declines() {
        let dir = tempfile::tempdir().unwrap();
        let remote = MemoryRemoteLayers::new();
        remote.fail_layer(
            "sha256:down",
            NotLazyReason::Unreachable,
            "connection refused",
        );
        let prepare = |pairs: &[(&str, &str)]| {
            remote
                .prepare_remote(&map(pairs), dir.path())
                .unwrap_err()
                .reason
        };
        assert_eq!(
            prepare(&[(LABEL_TARGET, "t")]),
            NotLazyReason::NoImageLabels
        );
        assert_eq!(
            prepare(&[(LABEL_TARGET, "t"), (LABEL_CRI_LAYER_DIGEST, "sha256:x")]),
            NotLazyReason::NoIndex
        );
        assert_eq!(
            prepare(&[(LABEL_TARGET, "t"), (LABEL_CRI_LAYER_DIGEST, "sha256:down")]),
            NotLazyReason::Unreachable
        );
    }

    #[test]
    fn reasons_have_stable_names_and_hints_that_name_the_repository() {
        for reason in NotLazyReason::ALL {
            // The serialized name is the one logs and metrics use.
            let json = serde_json::to_string(&reason).unwrap();
            assert_eq!(json, format!("\"{}\"", reason.name()));
            let back: NotLazyReason = serde_json::from_str(&json).unwrap();
            assert_eq!(back, reason);
            assert!(!reason.hint(None).is_empty());
        }
        let image = Some("reg.local:5000/team/app:v1@sha256:abc");
        assert!(
            NotLazyReason::Unauthorized
                .hint(image)
                .contains("reg.local:5000/team/app ")
        );
        assert!(
            NotLazyReason::Unreachable
                .hint(image)
                .contains("reaches reg.local:5000 ")
        );
        assert!(NotLazyReason::NoIndex.hint(image).contains("ferry index"));
        assert_eq!(repository_of("reg.local:5000/app"), "reg.local:5000/app");
        assert_eq!(repository_of("app:v1"), "app");
        assert!(!NotLazyReason::NoIndex.is_failure() && NotLazyReason::Unauthorized.is_failure());
    }
}
