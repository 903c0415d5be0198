//! `ferry prewarm` in the daemon: [`MountManager::prewarm`] opens an image the way a
//! mount does (same client, store, file cache and trace lookup: node traces, then the
//! registry's), runs [`ferry_fs::warm::prewarm::prewarm`] over it without mounting
//! anything, and records the image in the store ([`ferry_store::Store::record_image`])
//! so `ferry store export` can say what the store covers. For a registry image the record
//! also keeps its metadata (index, manifest, config, ferry index artifact and blobs; see
//! [`ferry_fs::backend::stored`]), so the node can start it with the registry down.
//!
//! Over the control socket (`POST /v1/prewarm`, [`PrewarmRequest`]) the answer is a
//! stream of JSON lines ([`PrewarmEvent`]): the plan, progress, then the outcome or an
//! error. A client that goes away stops the prewarm between requests; what was fetched
//! stays in the store. Without a daemon, `ferry prewarm` builds a [`MountManager`] over
//! the store the daemon would use and calls the same method.

use std::sync::Arc;

use ferry_fs::backend::stored;
use ferry_fs::warm::prewarm::{PrewarmProgress, PrewarmReport};
use ferry_fs::{ImageSource, MountedImage, View};
use ferry_oci::ImageRef;
use ferry_registry_client::Repo;
use ferry_store::{ImageRecord, LayerRecord};
use serde::{Deserialize, Serialize};

use super::MountManager;
use crate::error::{Error, Result};

/// Body of `POST /v1/prewarm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrewarmRequest {
    /// `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    pub image: String,
    /// Every layer whole, not only the hot set.
    #[serde(default)]
    pub full: bool,
}

/// What a prewarm of one image did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrewarmOutcome {
    /// The image as asked.
    pub image: String,
    /// Its manifest digest.
    pub manifest_digest: String,
    /// Where its trace came from, when it had one (`node`, `registry`, …).
    #[serde(default)]
    pub trace_source: Option<String>,
    /// The numbers.
    pub report: PrewarmReport,
}

/// One line of the `POST /v1/prewarm` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum PrewarmEvent {
    /// The plan: bytes it covers and bytes already local.
    Planned {
        /// Compressed bytes planned.
        planned_bytes: u64,
        /// Of those, already in the store.
        present_bytes: u64,
    },
    /// More bytes were fetched.
    Fetched {
        /// How many.
        bytes: u64,
    },
    /// Finished (or stopped).
    Done {
        /// What was done.
        outcome: PrewarmOutcome,
    },
    /// Failed.
    Error {
        /// Why, for a human.
        error: String,
    },
}

impl MountManager {
    /// Makes `request.image`'s hot set (or, with `full`, all of it) local in this
    /// manager's store and file cache; see the module doc. Blocks.
    pub fn prewarm(
        &self,
        request: &PrewarmRequest,
        progress: &dyn PrewarmProgress,
    ) -> Result<PrewarmOutcome> {
        if request.image.trim().is_empty() {
            return Err(Error::InvalidRequest("no image given".into()));
        }
        let source = ImageSource::open(&request.image, &self.client, &self.runtime)?;
        let layers: Vec<LayerRecord> = source
            .layers
            .iter()
            .map(|l| LayerRecord {
                digest: l.descriptor.digest().to_string(),
                size: l.descriptor.size(),
            })
            .collect();
        let image = Arc::new(MountedImage::new(
            source,
            Some(self.store.clone()),
            self.config.fetch_config(),
            &View::Merged,
        )?);
        let manifest = image.manifest_digest.clone();
        let found = crate::autotrace::lookup(
            &*self.remote,
            self.node_traces.as_deref(),
            &request.image,
            &manifest,
        );
        let trace_source = found
            .as_ref()
            .and_then(|f| serde_json::to_value(f.info.source).ok())
            .and_then(|v| v.as_str().map(str::to_owned));
        let report = ferry_fs::warm::prewarm::prewarm(
            &image,
            &self.store,
            found.as_ref().map(|f| &f.trace),
            request.full,
            self.file_cache.as_deref(),
            self.config.fetch_config().concurrency.max(1),
            progress,
        );
        if !report.stopped {
            let record = ImageRecord {
                reference: request.image.clone(),
                manifest_digest: manifest.clone(),
                layers,
                coverage: report.coverage.as_str().into(),
                recorded_ms: now_ms(),
                metadata: self.keep_metadata(&request.image, &manifest),
            };
            if let Err(e) = self.store.record_image(&record) {
                tracing::warn!(image = %request.image, error = %e, "cannot record the prewarmed image in the store");
            }
        }
        tracing::info!(image = %request.image, ?report, "prewarm");
        Ok(PrewarmOutcome {
            image: request.image.clone(),
            manifest_digest: manifest,
            trace_source,
            report,
        })
    }
}

impl MountManager {
    /// Fetches the metadata of registry image `image` (pinned to `manifest`, the one
    /// just prewarmed) and keeps it in the store; nothing for an OCI layout. A failure
    /// is logged, not fatal: the layers are warm, only a start without the registry is
    /// not possible.
    fn keep_metadata(&self, image: &str, manifest: &str) -> Vec<ferry_store::MetadataRecord> {
        let Ok(ImageRef::Registry {
            registry,
            repository,
            tag,
            digest,
        }) = ImageRef::parse(image)
        else {
            return Vec::new();
        };
        let repo = Repo::new(registry, repository);
        // The reference as asked (a tag keeps its index, if any), unless it has moved
        // since: then the manifest itself.
        let reference = digest
            .map(|d| d.to_string())
            .or(tag.map(String::from))
            .unwrap_or_else(|| "latest".into());
        let kept = self
            .runtime
            .handle()
            .block_on(stored::fetch_image_metadata(
                &self.client,
                &repo,
                &reference,
            ))
            .and_then(|blobs| {
                let moved = !blobs
                    .iter()
                    .any(|b| b.role == stored::role::MANIFEST && sha256(&b.bytes) == manifest);
                if moved {
                    self.runtime.handle().block_on(stored::fetch_image_metadata(
                        &self.client,
                        &repo,
                        manifest,
                    ))
                } else {
                    Ok(blobs)
                }
            })
            .and_then(|blobs| stored::keep_metadata(&self.store, &blobs));
        match kept {
            Ok(records) => records,
            Err(e) => {
                tracing::warn!(image, error = %e, "cannot keep the image's metadata in the store: it cannot start without its registry");
                Vec::new()
            }
        }
    }
}

fn sha256(bytes: &[u8]) -> String {
    ferry_store::ChunkKey::of(bytes).to_string()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
