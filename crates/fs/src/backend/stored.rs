//! An image's metadata kept in the node's store, so an image can start with its registry
//! unreachable: [`fetch_image_metadata`] fetches what a start reads from a registry
//! besides layer bytes (the multi-platform index, the platform's manifest, its config,
//! the ferry index artifacts referring to it and their index blobs), [`keep_metadata`]
//! puts it in the store for the image's record, and [`StoredImage`] / [`stored_index`]
//! read it back (verified by digest in the store; parsed here, since the store knows
//! no format).
//!
//! Which to trust when: a digest names the same bytes forever, so a digest reference
//! whose documents are local is resolved locally with no registry request; a tag is
//! mutable, so it is resolved from the store's record only when the registry cannot be
//! reached (callers decide that; [`registry_unreachable`] says which errors mean it).

use std::time::Duration;

use ferry_index::ferryidx::LayerIndex;
use ferry_oci::media::FERRY_INDEX_ARTIFACT;
use ferry_oci::{Descriptor, ImageIndex, ImageManifest, ImageRef, Platform};
use ferry_registry_client::{Client, ClientError, Manifest, Repo};
use ferry_store::{ChunkKey, ImageRecord, MetadataOrigin, MetadataRecord, Store, StoreMetadata};

use super::registry::{artifact_index_blobs, is_index};
use crate::error::{Error, Result};

/// How long a caller that holds the image's metadata waits for the registry before it
/// takes the registry for unreachable and starts from the store instead (a connect that
/// hangs, a registry that does not answer).
pub const REGISTRY_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// The roles a record's metadata blobs have (see [`MetadataRecord::role`]).
pub mod role {
    /// The multi-platform index the manifest was chosen from.
    pub const INDEX: &str = "index";
    /// The image manifest.
    pub const MANIFEST: &str = "manifest";
    /// The image config.
    pub const CONFIG: &str = "config";
    /// A ferry index artifact manifest referring to the image manifest.
    pub const INDEX_ARTIFACT: &str = "ferry-index-artifact";
    /// A ferry layer index blob.
    pub const LAYER_INDEX: &str = "ferry-layer-index";
}

/// Largest config kept.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// One fetched metadata document, to be kept with [`keep_metadata`].
#[derive(Debug, Clone)]
pub struct MetadataBlob {
    /// Its role (one of [`role`]).
    pub role: &'static str,
    /// Its media type.
    pub media_type: String,
    /// Its bytes (verified against their digest by the client).
    pub bytes: Vec<u8>,
}

/// True when `e` means the registry could not be reached at all (refused, reset, DNS,
/// connect or read timeout), as opposed to an answer: only then is a tag resolved from
/// the store.
pub fn registry_unreachable(e: &ClientError) -> bool {
    matches!(e, ClientError::Transport { .. })
}

/// Fetches the documents a start of `reference` in `repo` reads besides layer bytes
/// (see the module doc), for this machine's platform. Call on `client`'s runtime.
pub async fn fetch_image_metadata(
    client: &Client,
    repo: &Repo,
    reference: &str,
) -> Result<Vec<MetadataBlob>> {
    let mut out = Vec::new();
    let (index_doc, doc, manifest) =
        super::registry::fetch_manifest_documents(client, repo, reference).await?;
    if let Some(index_doc) = &index_doc {
        out.push(blob(role::INDEX, index_doc));
    }
    out.push(blob(role::MANIFEST, &doc));
    let config = manifest.config();
    if config.size() > MAX_CONFIG_BYTES {
        return Err(Error::Invalid(format!(
            "config {} is {} bytes (at most {MAX_CONFIG_BYTES})",
            config.digest(),
            config.size()
        )));
    }
    let config_bytes = client
        .blob_verified(repo, config.digest().as_ref(), config.size(), "config")
        .await?;
    out.push(MetadataBlob {
        role: role::CONFIG,
        media_type: config.media_type().to_string(),
        bytes: config_bytes,
    });
    let referrers = client
        .referrers(repo, &doc.digest, Some(FERRY_INDEX_ARTIFACT))
        .await?;
    for referrer in referrers.manifests() {
        let artifact = client
            .get_manifest(repo, referrer.digest().as_ref(), &[])
            .await?;
        let blobs = artifact_index_blobs(&doc.digest, &artifact.digest, &artifact.bytes)?;
        if blobs.is_empty() {
            continue;
        }
        out.push(blob(role::INDEX_ARTIFACT, &artifact));
        for index in blobs {
            let bytes = client
                .blob_verified(
                    repo,
                    index.digest().as_ref(),
                    index.size(),
                    "ferry index blob",
                )
                .await?;
            out.push(MetadataBlob {
                role: role::LAYER_INDEX,
                media_type: index.media_type().to_string(),
                bytes,
            });
        }
    }
    Ok(out)
}

fn blob(role: &'static str, doc: &Manifest) -> MetadataBlob {
    MetadataBlob {
        role,
        media_type: doc.media_type.clone(),
        bytes: doc.bytes.to_vec(),
    }
}

/// Puts `blobs` in `store` and returns the records naming them, for the image's
/// [`ImageRecord::metadata`].
pub fn keep_metadata(store: &Store, blobs: &[MetadataBlob]) -> Result<Vec<MetadataRecord>> {
    let mut out: Vec<MetadataRecord> = Vec::with_capacity(blobs.len());
    for b in blobs {
        let digest = store.put_metadata(&b.bytes)?;
        if out.iter().any(|m| m.digest == digest && m.role == b.role) {
            continue;
        }
        out.push(MetadataRecord {
            digest,
            size: b.bytes.len() as u64,
            role: b.role.into(),
            media_type: b.media_type.clone(),
        });
    }
    Ok(out)
}

/// An image manifest resolved from the node's store.
#[derive(Debug, Clone)]
pub struct StoredImage {
    /// The multi-platform index it was chosen from, when the reference named one.
    pub index: Option<Manifest>,
    /// The image manifest.
    pub manifest: Manifest,
    /// Its parsed form.
    pub parsed: ImageManifest,
    /// Where the manifest came from.
    pub origin: MetadataOrigin,
    /// The record a tag was resolved through (`None` for a digest).
    pub record: Option<String>,
}

/// The blob `digest` from the store, verified; `None` when it is not there.
fn stored_blob(meta: &StoreMetadata, digest: &str) -> Result<Option<(Vec<u8>, MetadataOrigin)>> {
    let Ok(key) = ChunkKey::parse(digest) else {
        return Ok(None);
    };
    Ok(meta.blob(&key)?)
}

/// The media type a record gave blob `digest`, else the document's own `mediaType`.
fn media_type_of(meta: &StoreMetadata, digest: &str, bytes: &[u8]) -> String {
    let recorded = meta
        .images()
        .into_iter()
        .flat_map(|(r, _)| r.metadata)
        .find(|m| m.digest.to_string() == digest && !m.media_type.is_empty())
        .map(|m| m.media_type);
    recorded.unwrap_or_else(|| {
        #[derive(serde::Deserialize)]
        struct Probe {
            #[serde(default, rename = "mediaType")]
            media_type: String,
        }
        serde_json::from_slice::<Probe>(bytes)
            .map(|p| p.media_type)
            .unwrap_or_default()
    })
}

impl StoredImage {
    /// The image `digest` names, from the store alone (for an index, `platform`'s
    /// manifest); `None` unless every document it needs is there.
    pub fn by_digest(
        meta: &StoreMetadata,
        digest: &str,
        platform: &Platform,
    ) -> Result<Option<StoredImage>> {
        let Some((bytes, origin)) = stored_blob(meta, digest)? else {
            return Ok(None);
        };
        let top = Manifest {
            digest: digest.to_owned(),
            media_type: media_type_of(meta, digest, &bytes),
            bytes: bytes.into(),
        };
        let (index, manifest, origin) = if is_index(&top.bytes) {
            let parsed: ImageIndex = serde_json::from_slice(&top.bytes)
                .map_err(|e| Error::Invalid(format!("image index {digest}: {e}")))?;
            let pick = ferry_oci::choose_manifest(&parsed, platform)
                .map_err(|e| Error::Invalid(format!("image index {digest}: {e}")))?
                .digest()
                .to_string();
            let Some((bytes, origin)) = stored_blob(meta, &pick)? else {
                return Ok(None);
            };
            let manifest = Manifest {
                media_type: media_type_of(meta, &pick, &bytes),
                digest: pick,
                bytes: bytes.into(),
            };
            (Some(top), manifest, origin)
        } else {
            (None, top, origin)
        };
        let parsed: ImageManifest = serde_json::from_slice(&manifest.bytes)
            .map_err(|e| Error::Invalid(format!("image manifest {}: {e}", manifest.digest)))?;
        Ok(Some(StoredImage {
            index,
            manifest,
            parsed,
            origin,
            record: None,
        }))
    }

    /// The image the store's record of `image` (a registry reference by tag) names: its
    /// index or manifest as recorded when the store was filled. `None` without such a
    /// record or without its documents.
    pub fn by_record(
        meta: &StoreMetadata,
        image: &str,
        platform: &Platform,
    ) -> Result<Option<StoredImage>> {
        let Some(record) = record_of(meta, image) else {
            return Ok(None);
        };
        let top = record
            .metadata
            .iter()
            .find(|m| m.role == role::INDEX)
            .map(|m| m.digest.to_string())
            .unwrap_or_else(|| record.manifest_digest.clone());
        Ok(Self::by_digest(meta, &top, platform)?.map(|mut found| {
            found.record = Some(record.reference.clone());
            found
        }))
    }

    /// The image's config from the store, verified; `None` when it is not there.
    pub fn config(&self, meta: &StoreMetadata) -> Result<Option<Vec<u8>>> {
        Ok(stored_blob(meta, self.parsed.config().digest().as_ref())?.map(|(b, _)| b))
    }
}

/// The record of `image` (a registry reference): the same registry, repository and tag,
/// however it was spelled when recorded.
pub fn record_of(meta: &StoreMetadata, image: &str) -> Option<ImageRecord> {
    let wanted = ImageRef::parse(image).ok()?;
    meta.images()
        .into_iter()
        .map(|(r, _)| r)
        .find(|r| ImageRef::parse(&r.reference).is_ok_and(|got| got == wanted))
}

/// The ferry index blobs referring to manifest `subject`, from the index artifacts the
/// store's records of it kept; `None` when no record of it kept metadata (unknown here:
/// ask the registry), an empty list when it has no index.
pub fn stored_index_blobs(meta: &StoreMetadata, subject: &str) -> Result<Option<Vec<Descriptor>>> {
    let records: Vec<ImageRecord> = meta
        .images()
        .into_iter()
        .map(|(r, _)| r)
        .filter(|r| {
            r.metadata
                .iter()
                .any(|m| m.role == role::MANIFEST && m.digest.to_string() == subject)
        })
        .collect();
    if records.is_empty() {
        return Ok(None);
    }
    let mut out: Vec<Descriptor> = Vec::new();
    for m in records
        .iter()
        .flat_map(|r| &r.metadata)
        .filter(|m| m.role == role::INDEX_ARTIFACT)
    {
        let digest = m.digest.to_string();
        let Some((bytes, _)) = meta.blob(&m.digest)? else {
            // Recorded but gone: the list would be incomplete, so it is not answered here.
            return Ok(None);
        };
        for blob in artifact_index_blobs(subject, &digest, &bytes)? {
            if !out.iter().any(|b| b.digest() == blob.digest()) {
                out.push(blob);
            }
        }
    }
    Ok(Some(out))
}

/// The ferry layer index `blob` (as an artifact lists it) from the store, verified and
/// decoded; `None` when it is not there.
pub fn stored_index(meta: &StoreMetadata, blob: &Descriptor) -> Result<Option<LayerIndex>> {
    match stored_blob(meta, blob.digest().as_ref())? {
        Some((bytes, _)) => Ok(Some(ferry_index::image::decode_index_blob(blob, &bytes)?)),
        None => Ok(None),
    }
}
