//! Lazy layers for the snapshotter: [`LazyLayers`] implements
//! [`ferry_snapshotter::RemoteLayers`] by mounting one layer of an image (the
//! overlayfs lower-layer view) into the snapshot's directory through a
//! [`MountBackend`]. It decides *whether* a layer is served lazily; it must not parse
//! layer formats or talk to FUSE itself.
//!
//! A layer is served lazily when the Prepare labels name the image and the layer
//! (ferry's `ferry.dev/*` labels, else CRI's) and the layer has a ferry index or an
//! eStargz TOC. Otherwise `Ok(None)`: containerd (or `ferry pull`) unpacks it the
//! ordinary way. The layers the labels name after this one are handed to the backend
//! too, so it can start resolving them before their Prepares arrive (see
//! [`crate::indexes`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use ferry_snapshotter::usage::Usage;
use ferry_snapshotter::{LayerLabels, RemoteError, RemoteLayers, RemoteMount};

use crate::error::Error;
use crate::mounts::{MountBackend, MountOrigin, MountRequest, canonical_mountpoint, pin_image};

/// The provider name in the snapshots' remote-mount records.
pub const PROVIDER: &str = "ferry-fs";
/// State key: the image reference, pinned to its manifest digest.
pub const STATE_IMAGE: &str = "image";
/// State key: the layer digest.
pub const STATE_LAYER: &str = "layer";
/// State key: the manifest digest.
pub const STATE_MANIFEST: &str = "manifest";

/// See the module doc.
pub struct LazyLayers {
    backend: Arc<dyn MountBackend>,
}

impl std::fmt::Debug for LazyLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyLayers").finish_non_exhaustive()
    }
}

fn failed(e: Error) -> RemoteError {
    RemoteError::Failed(e.to_string())
}

impl LazyLayers {
    /// Lazy layers mounted through `backend`.
    pub fn new(backend: Arc<dyn MountBackend>) -> LazyLayers {
        LazyLayers { backend }
    }

    fn state_of<'a>(mount: &'a RemoteMount, key: &str) -> Result<&'a str, RemoteError> {
        if mount.provider != PROVIDER {
            return Err(RemoteError::Failed(format!(
                "the mount was made by {:?}, not {PROVIDER}",
                mount.provider
            )));
        }
        mount
            .state
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| RemoteError::Failed(format!("the mount record has no {key:?}")))
    }
}

impl RemoteLayers for LazyLayers {
    fn layer_committed(&self, labels: &LayerLabels) {
        if let (Some(manifest), Some(layer)) = (&labels.manifest_digest, &labels.layer_digest) {
            self.backend.layer_unpacked(manifest, layer);
        }
    }

    fn prepare_remote(
        &self,
        labels: &HashMap<String, String>,
        target_dir: &Path,
    ) -> Result<Option<RemoteMount>, RemoteError> {
        let Some(parsed) = LayerLabels::parse(labels) else {
            return Ok(None);
        };
        let (Some(image_ref), Some(layer)) = (&parsed.image_ref, &parsed.layer_digest) else {
            tracing::debug!(
                target = parsed.target,
                "no image reference or layer digest: not lazy"
            );
            return Ok(None);
        };
        // With a manifest digest the exact image is known, whatever the tag says now.
        let image = match &parsed.manifest_digest {
            Some(m) => pin_image(image_ref, m).map_err(failed)?,
            None => image_ref.clone(),
        };
        // The layers after this one (CRI's image-layers list starts with this one):
        // their lookups start now, so their own Prepares do not wait a round trip each.
        let ahead: Vec<String> = parsed
            .image_layers
            .iter()
            .filter(|d| *d != layer)
            .cloned()
            .collect();
        let (kind, manifest) = self
            .backend
            .layer_kind(&image, layer, &ahead)
            .map_err(failed)?;
        if !kind.is_lazy() {
            tracing::info!(
                image,
                layer,
                "layer has no ferry index or eStargz TOC: unpacked normally"
            );
            return Ok(None);
        }
        let mountpoint = canonical_mountpoint(target_dir).map_err(failed)?;
        let request = MountRequest {
            image: image.clone(),
            mountpoint,
            layer: Some(layer.clone()),
        };
        self.backend
            .mount(&request, MountOrigin::Snapshotter)
            .map_err(failed)?;
        let mut state = BTreeMap::new();
        state.insert(
            STATE_IMAGE.to_owned(),
            pin_image(image_ref, &manifest).map_err(failed)?,
        );
        state.insert(STATE_LAYER.to_owned(), layer.clone());
        state.insert(STATE_MANIFEST.to_owned(), manifest);
        Ok(Some(RemoteMount {
            provider: PROVIDER.to_owned(),
            state,
            // The layer's bytes live in the shared chunk store, not in the snapshot.
            usage: Usage::default(),
        }))
    }

    fn restore(&self, mount: &RemoteMount, target_dir: &Path) -> Result<(), RemoteError> {
        let image = Self::state_of(mount, STATE_IMAGE)?;
        let layer = Self::state_of(mount, STATE_LAYER)?;
        let mountpoint = canonical_mountpoint(target_dir).map_err(failed)?;
        // A previous daemon's mount is dead once its process is gone; replace it.
        self.backend.detach_stale(&mountpoint).map_err(failed)?;
        let request = MountRequest {
            image: image.to_owned(),
            mountpoint,
            layer: Some(layer.to_owned()),
        };
        match self.backend.mount(&request, MountOrigin::Snapshotter) {
            Ok(_) | Err(Error::AlreadyMounted(_)) => Ok(()),
            Err(e) => Err(failed(e)),
        }
    }

    fn release(&self, mount: &RemoteMount, target_dir: &Path) -> Result<(), RemoteError> {
        Self::state_of(mount, STATE_LAYER)?;
        let mountpoint = canonical_mountpoint(target_dir).map_err(failed)?;
        match self.backend.unmount(&mountpoint) {
            Ok(()) => Ok(()),
            // Not ours (restore failed, or a dead leftover): make sure nothing stays.
            Err(Error::NotMounted(_)) => self.backend.detach_stale(&mountpoint).map_err(failed),
            Err(e) => Err(failed(e)),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use ferry_snapshotter::remote::{
        LABEL_CRI_IMAGE_LAYERS, LABEL_CRI_IMAGE_REF, LABEL_CRI_LAYER_DIGEST, LABEL_FERRY_IMAGE_REF,
        LABEL_FERRY_LAYER_DIGEST, LABEL_FERRY_MANIFEST_DIGEST, LABEL_TARGET,
    };

    use super::*;
    use crate::memory::MemoryBackend;
    use crate::mounts::LayerKind;

    fn digest(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn setup() -> (Arc<MemoryBackend>, LazyLayers, tempfile::TempDir) {
        let backend = Arc::new(MemoryBackend::new());
        let manifest = digest('e');
        backend.add_image(
            "reg.local/app:v1",
            &manifest,
            &[
                (&digest('a'), LayerKind::FerryIndex),
                (&digest('b'), LayerKind::Estargz),
                (&digest('c'), LayerKind::Plain),
            ],
        );
        backend.add_image(
            &format!("reg.local/app:v1@{manifest}"),
            &manifest,
            &[(&digest('a'), LayerKind::FerryIndex)],
        );
        let lazy = LazyLayers::new(backend.clone());
        (backend, lazy, tempfile::tempdir().unwrap())
    }

    #[test]
    fn indexed_and_estargz_layers_are_mounted_with_a_restorable_record() {
        let (backend, lazy, dir) = setup();
        for (c, kind) in [('a', "ferry"), ('b', "cri")] {
            let target = dir.path().join(c.to_string());
            let layer = digest(c);
            let l = if kind == "ferry" {
                labels(&[
                    (LABEL_TARGET, "chain"),
                    (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
                    (LABEL_FERRY_LAYER_DIGEST, &layer),
                ])
            } else {
                labels(&[
                    (LABEL_TARGET, "chain"),
                    (LABEL_CRI_IMAGE_REF, "reg.local/app:v1"),
                    (LABEL_CRI_LAYER_DIGEST, &layer),
                ])
            };
            let mount = lazy.prepare_remote(&l, &target).unwrap().unwrap();
            assert_eq!(mount.provider, PROVIDER);
            assert_eq!(
                mount.state[STATE_IMAGE],
                format!("reg.local/app:v1@{}", digest('e'))
            );
            assert_eq!(mount.state[STATE_LAYER], layer);
            assert_eq!(mount.state[STATE_MANIFEST], digest('e'));
        }
        let list = backend.list();
        assert_eq!(list.len(), 2);
        assert!(list.iter().all(|m| m.origin == MountOrigin::Snapshotter));
        assert_eq!(list[0].info.layer.as_deref(), Some(digest('a').as_str()));
    }

    #[test]
    fn layers_without_index_or_labels_are_declined() {
        let (backend, lazy, dir) = setup();
        let t = dir.path().join("t");
        // A plain layer: containerd unpacks it.
        let plain = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('c')),
        ]);
        assert!(lazy.prepare_remote(&plain, &t).unwrap().is_none());
        // No target: not an unpack.
        let no_target = labels(&[
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert!(lazy.prepare_remote(&no_target, &t).unwrap().is_none());
        // No image reference.
        let no_image = labels(&[
            (LABEL_TARGET, "c"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert!(lazy.prepare_remote(&no_image, &t).unwrap().is_none());
        assert!(backend.list().is_empty());
        // An unknown image is an error (the snapshotter logs it and falls back).
        let unknown = labels(&[
            (LABEL_TARGET, "c"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/other:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert!(lazy.prepare_remote(&unknown, &t).is_err());
    }

    #[test]
    fn the_layers_named_after_this_one_are_handed_on() {
        let (backend, lazy, dir) = setup();
        let following = format!("{},{},{}", digest('a'), digest('b'), digest('c'));
        let l = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_CRI_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_CRI_LAYER_DIGEST, &digest('a')),
            (LABEL_CRI_IMAGE_LAYERS, &following),
        ]);
        lazy.prepare_remote(&l, &dir.path().join("a"))
            .unwrap()
            .unwrap();
        assert_eq!(
            backend.asked(),
            vec![(
                "reg.local/app:v1".to_owned(),
                digest('a'),
                vec![digest('b'), digest('c')]
            )]
        );
    }

    #[test]
    fn a_manifest_label_pins_the_image() {
        let (backend, lazy, dir) = setup();
        let l = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
            (LABEL_FERRY_MANIFEST_DIGEST, &digest('e')),
        ]);
        lazy.prepare_remote(&l, &dir.path().join("p"))
            .unwrap()
            .unwrap();
        assert_eq!(
            backend.list()[0].info.image,
            format!("reg.local/app:v1@{}", digest('e'))
        );
    }

    #[test]
    fn restore_remounts_and_release_unmounts() {
        let (backend, lazy, dir) = setup();
        let target = dir.path().join("r");
        let l = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        let mount = lazy.prepare_remote(&l, &target).unwrap().unwrap();
        // Already mounted in this process: restore is a no-op.
        lazy.restore(&mount, &target).unwrap();
        lazy.release(&mount, &target).unwrap();
        assert!(backend.list().is_empty());
        let canonical = canonical_mountpoint(&target).unwrap();
        assert_eq!(backend.unmounted(), vec![canonical.clone()]);
        // A fresh daemon: restore mounts from the record alone (pinned image).
        lazy.restore(&mount, &target).unwrap();
        let list = backend.list();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].info.mountpoint, canonical);
        assert_eq!(list[0].info.image, mount.state[STATE_IMAGE]);
        // Releasing twice is fine.
        lazy.release(&mount, &target).unwrap();
        lazy.release(&mount, &target).unwrap();
        // Each restore, and the release of a mount not served, went through the
        // backend's detach of a stale mount (never the host's, in memory).
        assert_eq!(backend.detached(), vec![canonical.clone(); 3]);
        // Someone else's record is refused.
        let foreign = RemoteMount {
            provider: "other".into(),
            ..mount
        };
        assert!(lazy.restore(&foreign, &target).is_err());
    }
}
