//! A registry's side of an image: its manifest (the host's platform picked from an image
//! index) and the ferry indexes that refer to it.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_index::ferryidx::{LayerIndex, MAX_INDEX_BYTES};
use ferry_oci::media::{FERRY_INDEX_ARTIFACT, FERRY_LAYER_INDEX};
use ferry_oci::{Descriptor, ImageIndex, ImageManifest, Platform};
use ferry_registry_client::{Client, Manifest, RangeRuntime, Repo};

use crate::error::{Error, Result};

/// Most bytes of a manifest or index document accepted.
const MAX_DOCUMENT_BYTES: u64 = ferry_oci::MAX_MANIFEST_BYTES;

/// The image manifest `reference` names in a registry (for an image index, the entry
/// for this machine's platform) and its descriptor. Call from a thread that is not
/// inside a tokio runtime.
pub fn registry_manifest(
    client: &Client,
    repo: &Repo,
    reference: &str,
    runtime: &RangeRuntime,
) -> Result<(Descriptor, ImageManifest)> {
    runtime
        .handle()
        .block_on(fetch_registry_manifest(client, repo, reference))
}

/// The documents `reference` in `repo` resolves to for this machine's platform: the
/// image index when it names one (`None` for a plain manifest), the manifest as fetched,
/// and the manifest parsed. Call on `client`'s runtime.
pub(crate) async fn fetch_manifest_documents(
    client: &Client,
    repo: &Repo,
    reference: &str,
) -> Result<(Option<Manifest>, Manifest, ImageManifest)> {
    let mut doc = client.get_manifest(repo, reference, &[]).await?;
    let mut index_doc = None;
    if is_index(&doc.bytes) {
        let index: ImageIndex = serde_json::from_slice(&doc.bytes)
            .map_err(|e| Error::Invalid(format!("image index {}: {e}", doc.digest)))?;
        // Never "the first manifest": a mount of another architecture would fail later
        // and obscurely; the error names the platforms the index has.
        let pick = ferry_oci::choose_manifest(&index, &Platform::host())
            .map_err(|e| Error::Invalid(format!("image index {}: {e}", doc.digest)))?
            .digest()
            .to_string();
        let manifest_doc = client.get_manifest(repo, &pick, &[]).await?;
        index_doc = Some(std::mem::replace(&mut doc, manifest_doc));
    }
    let manifest: ImageManifest = serde_json::from_slice(&doc.bytes)
        .map_err(|e| Error::Invalid(format!("image manifest {}: {e}", doc.digest)))?;
    Ok((index_doc, doc, manifest))
}

/// [`registry_manifest`], for callers already in an async context (on `client`'s
/// runtime).
pub async fn fetch_registry_manifest(
    client: &Client,
    repo: &Repo,
    reference: &str,
) -> Result<(Descriptor, ImageManifest)> {
    let (_, doc, manifest) = fetch_manifest_documents(client, repo, reference).await?;
    let digest = ferry_oci::layout::digest(&doc.digest)?;
    let media = if doc.media_type.is_empty() {
        ferry_oci::media::OCI_MANIFEST
    } else {
        doc.media_type.as_str()
    };
    let desc = ferry_oci::layout::descriptor(media, digest, doc.bytes.len() as u64, &[]);
    Ok((desc, manifest))
}

pub(crate) fn is_index(bytes: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(default)]
        manifests: Option<serde_json::Value>,
    }
    serde_json::from_slice::<Probe>(bytes).is_ok_and(|p| p.manifests.is_some())
}

/// Most index blobs [`registry_indexes`] fetches at once.
const INDEX_FETCHES: usize = 8;

/// The ferry indexes referring to manifest `subject` in a registry: layer digest → index.
/// The index blobs are fetched at once (they are independent), so opening an image
/// costs the same round trips however many layers it has.
pub(super) fn registry_indexes(
    client: &Client,
    repo: &Repo,
    subject: &str,
    runtime: &RangeRuntime,
) -> Result<HashMap<String, Arc<LayerIndex>>> {
    use futures_util::{StreamExt, TryStreamExt};
    runtime.handle().block_on(async {
        let blobs = registry_index_blobs(client, repo, subject).await?;
        futures_util::stream::iter(
            blobs
                .iter()
                .map(|blob| fetch_index_blob(client, repo, blob)),
        )
        .buffer_unordered(INDEX_FETCHES)
        .map_ok(|index| (index.layer_digest.clone(), Arc::new(index)))
        .try_collect()
        .await
    })
}

/// The ferry index blobs of the index artifacts that refer to manifest `subject` in a
/// registry (referrers API or its tag fallback, then each artifact's manifest), each
/// checked for size. Fetch one with [`fetch_index_blob`].
pub async fn registry_index_blobs(
    client: &Client,
    repo: &Repo,
    subject: &str,
) -> Result<Vec<Descriptor>> {
    let referrers = client
        .referrers(repo, subject, Some(FERRY_INDEX_ARTIFACT))
        .await?;
    let mut out = Vec::new();
    for referrer in referrers.manifests() {
        let doc = client
            .get_manifest(repo, referrer.digest().as_ref(), &[])
            .await?;
        out.extend(artifact_index_blobs(subject, &doc.digest, &doc.bytes)?);
    }
    Ok(out)
}

/// The ferry index blobs an index artifact manifest (`bytes`, of digest `digest`) lists
/// for manifest `subject`; none when it is too large or refers to another subject.
/// Shared by the registry's and the node store's lookups, so both read an artifact the
/// same way.
pub(crate) fn artifact_index_blobs(
    subject: &str,
    digest: &str,
    bytes: &[u8],
) -> Result<Vec<Descriptor>> {
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Ok(Vec::new());
    }
    let artifact: ImageManifest = serde_json::from_slice(bytes)
        .map_err(|e| Error::Invalid(format!("index artifact {digest}: {e}")))?;
    if artifact
        .subject()
        .as_ref()
        .map(|s| s.digest().to_string())
        .as_deref()
        != Some(subject)
    {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for blob in artifact.layers() {
        if blob.media_type().to_string() != FERRY_LAYER_INDEX {
            continue;
        }
        if blob.size() > MAX_INDEX_BYTES as u64 {
            return Err(Error::Invalid(format!(
                "index blob {} is larger than {MAX_INDEX_BYTES} bytes",
                blob.digest()
            )));
        }
        out.push(blob.clone());
    }
    Ok(out)
}

/// Fetches one ferry index blob (as [`registry_index_blobs`] lists it), checks it against
/// its digest and decodes it.
pub async fn fetch_index_blob(
    client: &Client,
    repo: &Repo,
    blob: &Descriptor,
) -> Result<LayerIndex> {
    if blob.size() > MAX_INDEX_BYTES as u64 {
        return Err(Error::Invalid(format!(
            "index blob {} is larger than {MAX_INDEX_BYTES} bytes",
            blob.digest()
        )));
    }
    let digest = blob.digest().to_string();
    // Verified by the client, which asks the registry itself when a mirror's bytes fail.
    let bytes = client
        .blob_verified(repo, &digest, blob.size(), "index blob")
        .await?;
    Ok(ferry_index::image::decode_index_blob(blob, &bytes)?)
}
