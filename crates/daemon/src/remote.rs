//! Lazy layers for the snapshotter: [`LazyLayers`] implements
//! [`ferry_snapshotter::RemoteLayers`] by mounting one layer of an image (the
//! overlayfs lower-layer view) into the snapshot's directory through a
//! [`MountBackend`]. It decides *whether* a layer is served lazily; it must not parse
//! layer formats or talk to FUSE itself.
//!
//! A layer is served lazily when the Prepare labels name the image and the layer
//! (ferry's `ferry.dev/*` labels, else CRI's) and the layer has a ferry index or an
//! eStargz TOC. Otherwise a typed [`NotLazy`] says why (no index, registry unreachable,
//! credentials refused, mount failed…; see [`crate::fallback`]), the backend's record
//! keeps it for `ferry status`, and containerd (or `ferry pull`) unpacks the layer the
//! ordinary way. The layers the labels name after this one are handed to the backend
//! too, so it can start resolving them before their Prepares arrive (see
//! [`crate::indexes`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use ferry_snapshotter::usage::Usage;
use ferry_snapshotter::{
    LayerLabels, NotLazy, NotLazyReason, RemoteError, RemoteLayers, RemoteMount,
};

use crate::error::Error;
use crate::fallback::reason_of;
use crate::mounts::{
    LayerKind, MountBackend, MountOrigin, MountRequest, canonical_mountpoint, pin_image,
};

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

impl LazyLayers {
    /// The lazy mount of the layer `parsed` names, or why not (with the manifest digest
    /// when the lookup got that far).
    fn try_prepare(
        &self,
        parsed: &LayerLabels,
        target_dir: &Path,
    ) -> Result<RemoteMount, (NotLazy, Option<String>)> {
        let (Some(image_ref), Some(layer)) = (&parsed.image_ref, &parsed.layer_digest) else {
            let what = if parsed.image_ref.is_none() {
                "no image reference"
            } else {
                "no layer digest"
            };
            return Err((
                NotLazy::new(
                    NotLazyReason::NoImageLabels,
                    format!("the Prepare's labels carry {what}"),
                ),
                parsed.manifest_digest.clone(),
            ));
        };
        let known = parsed.manifest_digest.clone();
        let lookup = |e: Error| declined(&e, NotLazyReason::Other, known.clone());
        // With a manifest digest the exact image is known, whatever the tag says now.
        let image = match &parsed.manifest_digest {
            Some(m) => pin_image(image_ref, m).map_err(lookup)?,
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
            .map_err(lookup)?;
        let not_lazy = match kind {
            LayerKind::FerryIndex | LayerKind::Estargz | LayerKind::ZstdChunked => None,
            LayerKind::Plain => Some(NotLazy::new(
                NotLazyReason::NoIndex,
                "no ferry index refers to the image for this layer and it is neither eStargz nor \
                 zstd:chunked",
            )),
            LayerKind::Unsupported => Some(NotLazy::new(
                NotLazyReason::UnsupportedFormat,
                "the layer is neither indexed, eStargz nor zstd:chunked, and its media type \
                 cannot be indexed",
            )),
        };
        if let Some(not_lazy) = not_lazy {
            return Err((not_lazy, Some(manifest)));
        }
        let mounting = |e: Error| declined(&e, NotLazyReason::MountFailed, Some(manifest.clone()));
        let mountpoint = canonical_mountpoint(target_dir).map_err(mounting)?;
        let request = MountRequest {
            image: image.clone(),
            mountpoint,
            layer: Some(layer.clone()),
        };
        self.backend
            .mount(&request, MountOrigin::Snapshotter)
            .map_err(mounting)?;
        let mut state = BTreeMap::new();
        state.insert(
            STATE_IMAGE.to_owned(),
            pin_image(image_ref, &manifest).map_err(mounting)?,
        );
        state.insert(STATE_LAYER.to_owned(), layer.clone());
        state.insert(STATE_MANIFEST.to_owned(), manifest);
        Ok(RemoteMount {
            provider: PROVIDER.to_owned(),
            state,
            // The layer's bytes live in the shared chunk store, not in the snapshot.
            usage: Usage::default(),
        })
    }
}

/// `e` as a declined layer: its reason from its type (`otherwise` for errors that say
/// nothing about the registry or the index).
fn declined(
    e: &Error,
    otherwise: NotLazyReason,
    manifest: Option<String>,
) -> (NotLazy, Option<String>) {
    (
        NotLazy::new(reason_of(e, otherwise), e.to_string()),
        manifest,
    )
}

impl RemoteLayers for LazyLayers {
    fn layer_committed(&self, labels: &LayerLabels) {
        if let (Some(manifest), Some(layer)) = (&labels.manifest_digest, &labels.layer_digest) {
            self.backend.layer_unpacked(manifest, layer);
        }
        if let (Some(log), Some(layer)) = (self.backend.fallbacks(), &labels.layer_digest) {
            log.unpacked(labels.image_ref.as_deref(), layer);
        }
    }

    fn prepare_remote(
        &self,
        labels: &HashMap<String, String>,
        target_dir: &Path,
    ) -> Result<RemoteMount, NotLazy> {
        let Some(parsed) = LayerLabels::parse(labels) else {
            return Err(NotLazy::new(
                NotLazyReason::NoImageLabels,
                "the Prepare names no target snapshot: not an unpack",
            ));
        };
        self.try_prepare(&parsed, target_dir)
            .map_err(|(not_lazy, manifest)| {
                // The snapshotter logs it; the daemon keeps it for `ferry status`.
                if let Some(log) = self.backend.fallbacks() {
                    log.declined(
                        parsed.image_ref.as_deref(),
                        manifest.as_deref(),
                        parsed.layer_digest.as_deref(),
                        &not_lazy,
                    );
                }
                not_lazy
            })
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
            let mount = lazy.prepare_remote(&l, &target).unwrap();
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

    /// The reason `lazy` gives for `labels`.
    fn reason(lazy: &LazyLayers, labels: &HashMap<String, String>, dir: &Path) -> NotLazyReason {
        lazy.prepare_remote(labels, &dir.join("t"))
            .unwrap_err()
            .reason
    }

    #[test]
    fn layers_without_index_or_labels_are_declined_with_their_reason() {
        let (backend, lazy, dir) = setup();
        let d = dir.path();
        // A plain layer: containerd unpacks it.
        let plain = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('c')),
        ]);
        assert_eq!(reason(&lazy, &plain, d), NotLazyReason::NoIndex);
        // No target: not an unpack.
        let no_target = labels(&[
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert_eq!(reason(&lazy, &no_target, d), NotLazyReason::NoImageLabels);
        // No image reference (containerd not told to pass it).
        let no_image = labels(&[
            (LABEL_TARGET, "c"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert_eq!(reason(&lazy, &no_image, d), NotLazyReason::NoImageLabels);
        assert!(backend.list().is_empty());
        // An image the backend cannot look up (its error says nothing about why).
        let unknown = labels(&[
            (LABEL_TARGET, "c"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/other:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert_eq!(reason(&lazy, &unknown, d), NotLazyReason::Other);
        // Recorded per image, the plain layer with the manifest its lookup found.
        let status = backend.fallbacks().unwrap().status();
        let names: Vec<Option<&str>> = status.images.iter().map(|i| i.image.as_deref()).collect();
        assert_eq!(
            names,
            [Some("reg.local/other:v1"), None, Some("reg.local/app:v1")]
        );
        let app = &status.images[2];
        assert_eq!(app.reason, NotLazyReason::NoIndex);
        assert_eq!(app.manifest_digest.as_deref(), Some(digest('e').as_str()));
        assert_eq!(app.layers, 1);
        assert!(app.hint.contains("ferry index"), "{}", app.hint);
    }

    #[test]
    fn an_unsupported_format_is_its_own_reason() {
        let (backend, lazy, dir) = setup();
        backend.add_image(
            "reg.local/zstd:v1",
            &digest('f'),
            &[(&digest('z'), LayerKind::Unsupported)],
        );
        let l = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/zstd:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('z')),
        ]);
        assert_eq!(
            reason(&lazy, &l, dir.path()),
            NotLazyReason::UnsupportedFormat
        );
    }

    #[test]
    fn registry_and_mount_failures_are_declined_by_their_type() {
        use ferry_registry_client::ClientError;

        /// Makes the error a mount of that image fails with.
        type MakeError = Box<dyn Fn() -> Error + Send + Sync>;
        let (backend, lazy, dir) = setup();
        let cases: [(&str, NotLazyReason, MakeError); 5] = [
            (
                "reg.local/private:v1",
                NotLazyReason::Unauthorized,
                Box::new(|| {
                    Error::Registry(ClientError::Unauthorized {
                        registry: "reg.local".into(),
                        message: "authentication required".into(),
                    })
                }),
            ),
            (
                "reg.local/down:v1",
                NotLazyReason::Unreachable,
                Box::new(|| {
                    Error::Fs(ferry_fs::Error::Registry(ClientError::Transport {
                        registry: "reg.local".into(),
                        message: "connection refused".into(),
                    }))
                }),
            ),
            (
                "reg.local/slow:v1",
                NotLazyReason::Unreachable,
                Box::new(|| {
                    Error::Resolve(crate::indexes::ResolveError::TimedOut {
                        what: "resolving reg.local/slow:v1".into(),
                        timeout: std::time::Duration::from_secs(30),
                    })
                }),
            ),
            (
                "reg.local/gone:v1",
                NotLazyReason::NotFound,
                Box::new(|| {
                    Error::Registry(ClientError::NotFound {
                        what: "manifest v1".into(),
                    })
                }),
            ),
            (
                "reg.local/bad:v1",
                NotLazyReason::Invalid,
                Box::new(|| {
                    Error::Registry(ClientError::DigestMismatch {
                        expected: "sha256:a".into(),
                        actual: "sha256:b".into(),
                    })
                }),
            ),
        ];
        for (image, want, error) in cases {
            backend.fail_lookups(image, error);
            let l = labels(&[
                (LABEL_TARGET, "chain"),
                (LABEL_CRI_IMAGE_REF, image),
                (LABEL_CRI_LAYER_DIGEST, &digest('a')),
            ]);
            let not_lazy = lazy.prepare_remote(&l, &dir.path().join("t")).unwrap_err();
            assert_eq!(not_lazy.reason, want, "{image}: {}", not_lazy.detail);
        }
        // A lookup that works and a mount that does not.
        backend.fail_mounts("reg.local/app:v1", || {
            Error::Fs(ferry_fs::Error::io(
                "opening /dev/fuse",
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ))
        });
        let l = labels(&[
            (LABEL_TARGET, "chain"),
            (LABEL_CRI_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_CRI_LAYER_DIGEST, &digest('a')),
        ]);
        assert_eq!(reason(&lazy, &l, dir.path()), NotLazyReason::MountFailed);
        let status = backend.fallbacks().unwrap().status();
        assert_eq!(status.images.len(), 6);
        let private = status
            .images
            .iter()
            .find(|i| i.image.as_deref() == Some("reg.local/private:v1"))
            .unwrap();
        assert_eq!(private.reason, NotLazyReason::Unauthorized);
        assert!(
            private.hint.contains("credentials for reg.local/private"),
            "{}",
            private.hint
        );
        assert!(private.detail.contains("authentication required"));
        assert_eq!(status.layers_by_reason[&NotLazyReason::Unreachable], 2);
    }

    #[test]
    fn only_the_image_that_cannot_be_lazy_falls_back() {
        let (backend, lazy, dir) = setup();
        backend.fail_lookups("reg.local/private:v1", || {
            Error::Registry(ferry_registry_client::ClientError::Denied {
                registry: "reg.local".into(),
                message: "no pull rights".into(),
            })
        });
        let private = labels(&[
            (LABEL_TARGET, "p"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/private:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        assert_eq!(
            reason(&lazy, &private, dir.path()),
            NotLazyReason::Unauthorized
        );
        // The other image, same layer digest, in the same run: mounted lazily.
        let app = labels(&[
            (LABEL_TARGET, "a"),
            (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
            (LABEL_FERRY_LAYER_DIGEST, &digest('a')),
        ]);
        lazy.prepare_remote(&app, &dir.path().join("a")).unwrap();
        assert_eq!(backend.list().len(), 1);
        let status = backend.fallbacks().unwrap().status();
        assert_eq!(status.images.len(), 1);
        assert_eq!(
            status.images[0].image.as_deref(),
            Some("reg.local/private:v1")
        );
        // Its unpacked layer is counted once; the lazy image's commits are not news.
        let parsed = LayerLabels::parse(&private).unwrap();
        lazy.layer_committed(&parsed);
        lazy.layer_committed(&LayerLabels::parse(&app).unwrap());
        let status = backend.fallbacks().unwrap().status();
        assert_eq!((status.images.len(), status.images[0].layers), (1, 1));
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
        lazy.prepare_remote(&l, &dir.path().join("a")).unwrap();
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
        lazy.prepare_remote(&l, &dir.path().join("p")).unwrap();
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
        let mount = lazy.prepare_remote(&l, &target).unwrap();
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
