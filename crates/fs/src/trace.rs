//! Startup traces: which file bytes a workload read ([`Trace`]), the JSON they are kept
//! in, and their home as an OCI artifact referring to the image (in a registry through
//! the referrers API or its tag fallback, in an OCI layout through the layout's
//! referrers tag), found the same way as ferry's index artifact; the repository's newest
//! trace also behind [`REPOSITORY_TRACE_TAG`], for a new tag of the repository.
//!
//! It must not fetch file data (prefetching a trace is [`crate::warm`]) or know a mount:
//! recording one's reads is [`crate::image::recorder`].

use ferry_oci::layout::{OciLayout, artifact_manifest, descriptor, media_type};
use ferry_oci::media::OCI_MANIFEST;
use ferry_oci::{Descriptor, ImageManifest};
use ferry_registry_client::{Client, RangeRuntime, Repo};

use crate::error::{Error, Result};

/// Media type of a published startup trace (artifactType of its manifest).
pub const TRACE_MEDIA_TYPE: &str = ferry_oci::media::FERRY_TRACE_ARTIFACT;

/// Media type of the trace JSON blob (the artifact's one layer).
pub const TRACE_BLOB_MEDIA_TYPE: &str = ferry_oci::media::FERRY_TRACE;
/// Version written into, and the only one accepted from, trace JSON.
pub const TRACE_VERSION: u32 = 1;
/// Most bytes of trace JSON accepted.
pub const MAX_TRACE_BYTES: u64 = 32 << 20;
/// Most reads in one trace (recording stops adding beyond it).
pub const MAX_TRACE_READS: usize = 200_000;
/// Longest path accepted in a trace.
pub const MAX_TRACE_PATH: usize = 4096;
/// Annotation on a trace artifact: when it was recorded (seconds since the epoch); the
/// newest of several traces of one image wins.
pub const ANNOTATION_TRACE_CREATED: &str = ferry_oci::media::ANNOTATION_TRACE_CREATED;

/// A recorded startup trace.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Trace {
    /// Reads in first-touch order.
    pub reads: Vec<TraceRead>,
}

/// One recorded read: `len` bytes at `offset` of the file at `path` in the merged tree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceRead {
    /// Absolute path in the image's root filesystem.
    pub path: String,
    /// Offset of the read within the file.
    pub offset: u64,
    /// Bytes read.
    pub len: u64,
}

/// Trace JSON as written: `{"version":1,"reads":[{"path","offset","len"}…]}`. A missing
/// version is read as 1 (what `Trace`'s own serde derive writes).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    #[serde(default = "first_version")]
    version: u32,
    reads: Vec<TraceRead>,
}

fn first_version() -> u32 {
    TRACE_VERSION
}

#[derive(serde::Serialize)]
struct WireRef<'a> {
    version: u32,
    reads: &'a [TraceRead],
}

impl Trace {
    /// Parses and checks trace JSON: at most [`MAX_TRACE_BYTES`] bytes and
    /// [`MAX_TRACE_READS`] reads, version [`TRACE_VERSION`], absolute paths of at most
    /// [`MAX_TRACE_PATH`] bytes without NUL, non-empty reads that do not overflow.
    pub fn from_json(bytes: &[u8]) -> Result<Trace> {
        let bad = |m: String| Error::Invalid(format!("startup trace: {m}"));
        if bytes.len() as u64 > MAX_TRACE_BYTES {
            return Err(bad(format!(
                "{} bytes, more than the {MAX_TRACE_BYTES} accepted",
                bytes.len()
            )));
        }
        let wire: Wire = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if wire.version != TRACE_VERSION {
            return Err(bad(format!(
                "version {} (this ferry reads version {TRACE_VERSION})",
                wire.version
            )));
        }
        if wire.reads.len() > MAX_TRACE_READS {
            return Err(bad(format!(
                "{} reads, more than the {MAX_TRACE_READS} accepted",
                wire.reads.len()
            )));
        }
        for (i, r) in wire.reads.iter().enumerate() {
            if !r.path.starts_with('/') || r.path.len() > MAX_TRACE_PATH || r.path.contains('\0') {
                return Err(bad(format!(
                    "read #{i}: path must be absolute, without NUL, at most {MAX_TRACE_PATH} bytes"
                )));
            }
            if r.len == 0 || r.offset.checked_add(r.len).is_none() {
                return Err(bad(format!(
                    "read #{i} of {}: empty or past the largest offset",
                    r.path
                )));
            }
        }
        Ok(Trace { reads: wire.reads })
    }

    /// The trace as JSON (see [`Trace::from_json`]).
    pub fn to_json(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(&WireRef {
            version: TRACE_VERSION,
            reads: &self.reads,
        })
        .map_err(|e| Error::Invalid(format!("encoding a startup trace: {e}")))
    }

    /// Distinct files the trace reads.
    pub fn files(&self) -> usize {
        let mut paths: Vec<&str> = self.reads.iter().map(|r| r.path.as_str()).collect();
        paths.sort_unstable();
        paths.dedup();
        paths.len()
    }

    /// Bytes the trace reads (sum of read lengths).
    pub fn bytes(&self) -> u64 {
        self.reads.iter().map(|r| r.len).sum()
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The artifact manifest of `trace` (whose JSON is `blob`) referring to `subject`.
fn trace_artifact(subject: &Descriptor, blob: &[u8]) -> Result<Vec<u8>> {
    let layer = descriptor(
        TRACE_BLOB_MEDIA_TYPE,
        ferry_oci::sha256_digest(blob),
        blob.len() as u64,
        &[],
    );
    Ok(artifact_manifest(
        TRACE_MEDIA_TYPE,
        &[layer],
        subject,
        &[(ANNOTATION_TRACE_CREATED, now_secs().to_string())],
    )?)
}

/// The trace blob's descriptor in an artifact manifest referring to `subject`, if the
/// manifest is a trace artifact for it.
fn trace_blob_of(bytes: &[u8], subject: &str) -> Option<(Descriptor, u64)> {
    let artifact: ImageManifest = serde_json::from_slice(bytes).ok()?;
    if artifact
        .subject()
        .as_ref()
        .map(|s| s.digest().to_string())
        .as_deref()
        != Some(subject)
    {
        return None;
    }
    let created = artifact
        .annotations()
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TRACE_CREATED))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    artifact
        .layers()
        .iter()
        .find(|l| l.media_type().to_string() == TRACE_BLOB_MEDIA_TYPE)
        .map(|l| (l.clone(), created))
}

/// Stores `trace` in `layout` as an artifact referring to image manifest `subject`
/// (replacing an earlier trace of it). Returns the artifact manifest's descriptor.
pub fn store_layout_trace(
    layout: &OciLayout,
    subject: &Descriptor,
    trace: &Trace,
) -> Result<Descriptor> {
    let json = trace.to_json()?;
    // The empty config blob the artifact manifest names, and the trace itself.
    layout.write_blob(b"{}")?;
    layout.write_blob(&json)?;
    let manifest = trace_artifact(subject, &json)?;
    let digest = layout.write_blob(&manifest)?;
    let mut desc = descriptor(OCI_MANIFEST, digest, manifest.len() as u64, &[]);
    desc.set_artifact_type(Some(media_type(TRACE_MEDIA_TYPE)));
    layout.add_referrer(subject.digest(), &desc)?;
    Ok(desc)
}

/// The trace referring to image manifest `subject` in `layout`, if any (the newest when
/// several).
pub fn find_layout_trace(layout: &OciLayout, subject: &Descriptor) -> Result<Option<Trace>> {
    let subject_digest = subject.digest().to_string();
    let mut best: Option<(Descriptor, u64)> = None;
    for referrer in layout.referrers(subject.digest())? {
        if referrer
            .artifact_type()
            .as_ref()
            .map(|t| t.to_string())
            .as_deref()
            != Some(TRACE_MEDIA_TYPE)
        {
            continue;
        }
        let bytes = layout.read_document(&referrer)?;
        if let Some((blob, created)) = trace_blob_of(&bytes, &subject_digest)
            && best.as_ref().is_none_or(|(_, c)| created >= *c)
        {
            best = Some((blob, created));
        }
    }
    let Some((blob, _)) = best else {
        return Ok(None);
    };
    if blob.size() > MAX_TRACE_BYTES {
        return Err(Error::Invalid(format!(
            "startup trace blob {} is larger than {MAX_TRACE_BYTES} bytes",
            blob.digest()
        )));
    }
    let bytes = layout.read_blob(blob.digest(), MAX_TRACE_BYTES)?;
    Trace::from_json(&bytes).map(Some)
}

/// Tag of a repository that points at its newest trace artifact (whatever image it
/// refers to): how a new tag of the repository finds the trace of the version before it
/// in one round trip, on any registry. Set by [`publish_registry_trace`] and by ferry's
/// registry when it accepts a trace from a node that may only pull.
pub const REPOSITORY_TRACE_TAG: &str = ferry_oci::media::FERRY_TRACE_TAG;

/// Publishes `trace` to a registry as an artifact referring to image manifest `subject`
/// (referrers API, with the tag fallback when the registry does not index subjects), and
/// points the repository's [`REPOSITORY_TRACE_TAG`] at it. Returns the artifact
/// manifest's digest.
pub async fn publish_registry_trace(
    client: &Client,
    repo: &Repo,
    subject: &Descriptor,
    trace: &Trace,
) -> Result<String> {
    let json = trace.to_json()?;
    let empty: &[u8] = b"{}";
    for blob in [empty, &json[..]] {
        let digest = ferry_oci::sha256_digest(blob).to_string();
        let data = blob.to_vec();
        let body = Box::pin(futures_util::stream::once(async move { Ok(data.into()) }));
        client
            .push_blob(repo, &digest, blob.len() as u64, body)
            .await?;
    }
    let manifest = trace_artifact(subject, &json)?;
    let digest = ferry_oci::sha256_digest(&manifest);
    let mut desc = descriptor(OCI_MANIFEST, digest.clone(), manifest.len() as u64, &[]);
    desc.set_artifact_type(Some(media_type(TRACE_MEDIA_TYPE)));
    client
        .push_referrer(
            repo,
            subject.digest().as_ref(),
            &desc,
            manifest.clone().into(),
        )
        .await?;
    client
        .put_manifest(repo, REPOSITORY_TRACE_TAG, OCI_MANIFEST, manifest.into())
        .await?;
    Ok(digest.to_string())
}

/// Sends `trace` of image manifest `subject` to ferry's registry endpoint for nodes that
/// may only pull (see `ferry_registry::server::traces`). Returns the artifact's digest.
pub async fn send_registry_trace(
    client: &Client,
    repo: &Repo,
    subject: &str,
    trace: &Trace,
) -> Result<String> {
    let json = trace.to_json()?;
    Ok(client.push_trace(repo, subject, json.into()).await?)
}

/// The trace referring to image manifest `subject` in a registry, if any (the newest
/// when several). Call from a thread that is not inside a tokio runtime.
pub fn find_registry_trace(
    client: &Client,
    repo: &Repo,
    subject: &str,
    runtime: &RangeRuntime,
) -> Result<Option<Trace>> {
    let rt = runtime.handle();
    let referrers = rt.block_on(client.referrers(repo, subject, Some(TRACE_MEDIA_TYPE)))?;
    let mut best: Option<(Descriptor, u64)> = None;
    for referrer in referrers.manifests() {
        let doc = rt.block_on(client.get_manifest(repo, referrer.digest().as_ref(), &[]))?;
        if let Some((blob, created)) = trace_blob_of(&doc.bytes, subject)
            && best.as_ref().is_none_or(|(_, c)| created >= *c)
        {
            best = Some((blob, created));
        }
    }
    let Some((blob, _)) = best else {
        return Ok(None);
    };
    fetch_trace_blob(client, repo, &blob, runtime).map(Some)
}

/// The repository's newest trace ([`REPOSITORY_TRACE_TAG`]) and the image manifest it
/// was recorded for, if any. Call from a thread that is not inside a tokio runtime.
pub fn find_repository_trace(
    client: &Client,
    repo: &Repo,
    runtime: &RangeRuntime,
) -> Result<Option<(String, Trace)>> {
    let rt = runtime.handle();
    let doc = match rt.block_on(client.get_manifest(repo, REPOSITORY_TRACE_TAG, &[OCI_MANIFEST])) {
        Ok(doc) => doc,
        Err(ferry_registry_client::ClientError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let artifact: ImageManifest = serde_json::from_slice(&doc.bytes)
        .map_err(|e| Error::Invalid(format!("{REPOSITORY_TRACE_TAG} of {repo}: {e}")))?;
    let Some(subject) = artifact.subject().as_ref().map(|s| s.digest().to_string()) else {
        return Ok(None);
    };
    let Some((blob, _)) = trace_blob_of(&doc.bytes, &subject) else {
        return Ok(None);
    };
    let trace = fetch_trace_blob(client, repo, &blob, runtime)?;
    Ok(Some((subject, trace)))
}

/// Fetches, verifies and parses the trace blob `blob` (bounded by [`MAX_TRACE_BYTES`]).
fn fetch_trace_blob(
    client: &Client,
    repo: &Repo,
    blob: &Descriptor,
    runtime: &RangeRuntime,
) -> Result<Trace> {
    if blob.size() > MAX_TRACE_BYTES {
        return Err(Error::Invalid(format!(
            "startup trace blob {} is larger than {MAX_TRACE_BYTES} bytes",
            blob.digest()
        )));
    }
    let digest = blob.digest().to_string();
    // Verified by the client, which asks the registry itself when a mirror's bytes fail.
    let bytes = runtime.handle().block_on(client.blob_verified(
        repo,
        &digest,
        blob.size(),
        "trace blob",
    ))?;
    Trace::from_json(&bytes)
}

#[cfg(test)]
#[path = "trace_tests.rs"]
pub(crate) mod tests;
