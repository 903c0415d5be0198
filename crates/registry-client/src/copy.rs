//! Image copy between registries and OCI layouts (`ferry copy`): the manifest or the
//! whole multi-arch index, configs, layers, and the image's referrers of chosen artifact
//! types (ferry's index artifacts by default), in an order that never leaves a
//! destination pointing at something it does not have: blobs before the manifest that
//! lists them, children before their index, a subject before its referrers.
//!
//! Blobs the destination already has are skipped; between repositories of one registry
//! they are mounted rather than copied; the rest stream from source to destination
//! (never whole in memory), several at once.

use std::collections::HashSet;
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use bytes::Bytes;
use ferry_oci::media::{self, FERRY_INDEX_ARTIFACT};
use ferry_oci::{Descriptor, ImageIndex, ImageManifest, ImageRef, OciLayout};
use futures_util::{StreamExt, TryStreamExt};
use sha2::Digest as _;
use tokio::io::AsyncWriteExt;

use super::{ByteStream, Client, ClientError, Manifest, Repo};

/// One end of a copy.
#[derive(Debug, Clone)]
pub enum ImageLocation {
    /// An OCI image layout and a tag (or digest, when reading) in it.
    Layout {
        layout: OciLayout,
        reference: String,
    },
    /// A registry repository and a tag or digest.
    Registry {
        client: Client,
        repo: Repo,
        reference: String,
    },
}

impl ImageLocation {
    /// The location a parsed reference names. A layout destination is created when
    /// missing (`for_write`); a layout source must exist.
    pub fn from_ref(
        image: &ImageRef,
        client: &Client,
        for_write: bool,
    ) -> Result<Self, ClientError> {
        Ok(match image {
            ImageRef::Layout { dir, reference } => ImageLocation::Layout {
                layout: if for_write {
                    OciLayout::open_or_create(dir)?
                } else {
                    OciLayout::open(dir)?
                },
                reference: reference.to_string(),
            },
            ImageRef::Registry {
                registry,
                repository,
                ..
            } => ImageLocation::Registry {
                client: client.clone(),
                repo: Repo::new(registry.clone(), repository.clone()),
                reference: image.reference().to_string(),
            },
        })
    }

    fn describe(&self) -> String {
        match self {
            ImageLocation::Layout { layout, reference } => {
                format!("oci:{}:{reference}", layout.root().display())
            }
            ImageLocation::Registry {
                repo, reference, ..
            } => {
                if reference.starts_with("sha256:") {
                    format!("{repo}@{reference}")
                } else {
                    format!("{repo}:{reference}")
                }
            }
        }
    }
}

/// What happened to one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobOutcome {
    Copied,
    /// The destination already had it.
    Existed,
    /// Mounted from another repository of the same registry.
    Mounted,
}

/// Progress events of a copy (all optional).
pub trait CopyProgress: Send + Sync {
    fn blob_started(&self, _digest: &str, _size: u64) {}
    fn blob_bytes(&self, _digest: &str, _bytes: u64) {}
    fn blob_finished(&self, _digest: &str, _outcome: BlobOutcome) {}
    fn manifest_copied(&self, _digest: &str, _media_type: &str) {}
}

/// Ignores progress.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;
impl CopyProgress for NoProgress {}

/// How to copy.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Blobs copied at once.
    pub concurrency: usize,
    /// Artifact types of referrers to copy along (ferry's index by default).
    pub referrer_types: Vec<String>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            concurrency: 4,
            referrer_types: vec![FERRY_INDEX_ARTIFACT.to_string()],
        }
    }
}

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Digest of the top-level manifest or index.
    pub digest: String,
    pub media_type: String,
    /// Manifests and indexes written (referrers included).
    pub manifests: usize,
    pub blobs_copied: usize,
    pub blobs_skipped: usize,
    pub blobs_mounted: usize,
    pub bytes_copied: u64,
    /// Referrer artifacts copied.
    pub referrers: usize,
}

#[derive(Default)]
struct Counters {
    manifests: AtomicUsize,
    copied: AtomicUsize,
    skipped: AtomicUsize,
    mounted: AtomicUsize,
    bytes: AtomicU64,
    referrers: AtomicUsize,
}

fn invalid(what: &str, e: impl ToString) -> ClientError {
    ClientError::Invalid {
        what: what.to_string(),
        reason: e.to_string(),
    }
}

fn is_index(m: &Manifest) -> bool {
    m.media_type == media::OCI_INDEX
        || m.media_type == media::DOCKER_MANIFEST_LIST
        || serde_json::from_slice::<serde_json::Value>(&m.bytes)
            .ok()
            .is_some_and(|v| v.get("manifests").is_some())
}

fn parse_digest(s: &str) -> Result<ferry_oci::Digest, ClientError> {
    Ok(ferry_oci::layout::digest(s)?)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ClientError> + Send + 'static,
) -> Result<T, ClientError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ClientError::Config(format!("blocking task failed: {e}")))?
}

impl ImageLocation {
    async fn read_root(&self) -> Result<Manifest, ClientError> {
        match self {
            ImageLocation::Layout { layout, reference } => {
                let (layout, reference) = (layout.clone(), reference.clone());
                blocking(move || {
                    let desc = layout.resolve(&reference)?;
                    let bytes = layout.read_document(&desc)?;
                    Ok(manifest_of(
                        desc.digest().to_string(),
                        desc.media_type().to_string(),
                        bytes,
                    ))
                })
                .await
            }
            ImageLocation::Registry {
                client,
                repo,
                reference,
            } => client.get_manifest(repo, reference, &[]).await,
        }
    }

    async fn read_manifest(&self, desc: &Descriptor) -> Result<Manifest, ClientError> {
        match self {
            ImageLocation::Layout { layout, .. } => {
                let (layout, desc) = (layout.clone(), desc.clone());
                blocking(move || {
                    let bytes = layout.read_document(&desc)?;
                    Ok(manifest_of(
                        desc.digest().to_string(),
                        desc.media_type().to_string(),
                        bytes,
                    ))
                })
                .await
            }
            ImageLocation::Registry { client, repo, .. } => {
                let media_type = desc.media_type().to_string();
                client
                    .get_manifest(repo, desc.digest().as_ref(), &[&media_type])
                    .await
            }
        }
    }

    async fn has_blob(&self, digest: &str) -> Result<bool, ClientError> {
        match self {
            ImageLocation::Layout { layout, .. } => Ok(layout.has_blob(&parse_digest(digest)?)),
            ImageLocation::Registry { client, repo, .. } => {
                Ok(client.blob_size(repo, digest).await?.is_some())
            }
        }
    }

    async fn open_blob(&self, digest: &str) -> Result<ByteStream, ClientError> {
        match self {
            ImageLocation::Layout { layout, .. } => {
                let path = layout.blob_path(&parse_digest(digest)?)?;
                let file =
                    tokio::fs::File::open(&path)
                        .await
                        .map_err(|source| ClientError::Io {
                            path: path.display().to_string(),
                            source,
                        })?;
                Ok(Box::pin(tokio_util::io::ReaderStream::with_capacity(
                    file,
                    1 << 20,
                )))
            }
            ImageLocation::Registry { client, repo, .. } => {
                Ok(client.blob_stream(repo, digest, None).await?.body)
            }
        }
    }

    async fn write_blob(
        &self,
        digest: &str,
        size: u64,
        body: ByteStream,
    ) -> Result<(), ClientError> {
        match self {
            ImageLocation::Layout { layout, .. } => {
                write_layout_blob(layout, digest, size, body).await
            }
            ImageLocation::Registry { client, repo, .. } => {
                client.push_blob(repo, digest, size, body).await
            }
        }
    }

    /// Writes a manifest, by digest or under `tag`.
    async fn write_manifest(&self, m: &Manifest, tag: Option<&str>) -> Result<(), ClientError> {
        match self {
            ImageLocation::Layout { layout, .. } => {
                let (layout, m, tag) = (layout.clone(), m.clone(), tag.map(str::to_string));
                blocking(move || {
                    let d = layout.write_blob(&m.bytes)?;
                    if let Some(tag) = tag {
                        let desc = Descriptor::new(
                            ferry_oci::layout::media_type(&m.media_type),
                            m.bytes.len() as u64,
                            d,
                        );
                        layout.set_tag(&tag, &desc)?;
                    }
                    Ok(())
                })
                .await
            }
            ImageLocation::Registry { client, repo, .. } => {
                let reference = tag.unwrap_or(&m.digest);
                client
                    .put_manifest(repo, reference, &m.media_type, m.bytes.clone())
                    .await?;
                Ok(())
            }
        }
    }

    async fn referrers(
        &self,
        subject: &str,
        types: &[String],
    ) -> Result<Vec<Descriptor>, ClientError> {
        let all = match self {
            ImageLocation::Layout { layout, .. } => layout.referrers(&parse_digest(subject)?)?,
            ImageLocation::Registry { client, repo, .. } => {
                let t = match types {
                    [one] => Some(one.as_str()),
                    _ => None,
                };
                client
                    .referrers(repo, subject, t)
                    .await?
                    .manifests()
                    .clone()
            }
        };
        Ok(all
            .into_iter()
            .filter(|d| {
                d.artifact_type()
                    .as_ref()
                    .is_some_and(|a| types.iter().any(|t| *t == a.to_string()))
            })
            .collect())
    }

    async fn add_referrer(
        &self,
        subject: &str,
        desc: &Descriptor,
        m: &Manifest,
    ) -> Result<(), ClientError> {
        match self {
            ImageLocation::Layout { layout, .. } => {
                let (layout, desc, m) = (layout.clone(), desc.clone(), m.clone());
                let subject = parse_digest(subject)?;
                blocking(move || {
                    layout.write_blob(&m.bytes)?;
                    layout.add_referrer(&subject, &desc)?;
                    Ok(())
                })
                .await
            }
            ImageLocation::Registry { client, repo, .. } => {
                client
                    .push_referrer(repo, subject, desc, m.bytes.clone())
                    .await
            }
        }
    }
}

fn manifest_of(digest: String, desc_media_type: String, bytes: Vec<u8>) -> Manifest {
    let media_type = super::document_media_type(&bytes).unwrap_or(desc_media_type);
    Manifest {
        digest,
        media_type,
        bytes: Bytes::from(bytes),
    }
}

/// Streams a blob into a layout: temp file beside the blobs, verified, synced, renamed.
async fn write_layout_blob(
    layout: &OciLayout,
    digest: &str,
    size: u64,
    mut body: ByteStream,
) -> Result<(), ClientError> {
    let path = layout.blob_path(&parse_digest(digest)?)?;
    let dir = path
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    let io = |source| ClientError::Io {
        path: path.display().to_string(),
        source,
    };
    let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io)?;
    let mut file = tokio::fs::File::from_std(tmp.reopen().map_err(io)?);
    let mut hasher = sha2::Sha256::new();
    let mut written = 0u64;
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(io)?;
        written += piece.len() as u64;
        if written > size {
            return Err(invalid(
                &format!("blob {digest}"),
                format!("longer than its {size} bytes"),
            ));
        }
        hasher.update(&piece);
        file.write_all(&piece).await.map_err(io)?;
    }
    if written != size {
        return Err(invalid(
            &format!("blob {digest}"),
            format!("{written} bytes, descriptor says {size}"),
        ));
    }
    let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
    if actual != digest {
        return Err(ClientError::DigestMismatch {
            expected: digest.to_string(),
            actual,
        });
    }
    file.flush().await.map_err(io)?;
    file.sync_all().await.map_err(io)?;
    drop(file);
    blocking(move || {
        use std::os::unix::fs::PermissionsExt;
        let io = |source| ClientError::Io {
            path: path.display().to_string(),
            source,
        };
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(io)?;
        tmp.as_file().flush().map_err(io)?;
        tmp.persist(&path).map_err(|e| io(e.error))?;
        Ok(())
    })
    .await
}

struct Copier<'a> {
    src: &'a ImageLocation,
    dst: &'a ImageLocation,
    opts: &'a CopyOptions,
    progress: Arc<dyn CopyProgress>,
    counters: Counters,
}

/// Copies the image `src` names to `dst`, with its referrers of `opts.referrer_types`.
pub async fn copy_image(
    src: &ImageLocation,
    dst: &ImageLocation,
    opts: &CopyOptions,
    progress: Arc<dyn CopyProgress>,
) -> Result<CopyReport, ClientError> {
    let root = src.read_root().await?;
    let tag = match dst {
        ImageLocation::Layout { reference, .. } if reference.starts_with("sha256:") => {
            return Err(ClientError::Config(format!(
                "{}: an OCI layout destination needs a tag (oci:DIR:TAG), not a digest",
                dst.describe()
            )));
        }
        ImageLocation::Layout { reference, .. } => Some(reference.clone()),
        ImageLocation::Registry { reference, .. } if reference.starts_with("sha256:") => {
            if *reference != root.digest {
                return Err(ClientError::Config(format!(
                    "destination {} names digest {reference}, but the source is {}",
                    dst.describe(),
                    root.digest
                )));
            }
            None
        }
        ImageLocation::Registry { reference, .. } => Some(reference.clone()),
    };
    let copier = Copier {
        src,
        dst,
        opts,
        progress,
        counters: Counters::default(),
    };
    copier.copy_manifest(&root, tag.as_deref(), 0).await?;
    let c = &copier.counters;
    Ok(CopyReport {
        digest: root.digest.clone(),
        media_type: root.media_type.clone(),
        manifests: c.manifests.load(Ordering::Relaxed),
        blobs_copied: c.copied.load(Ordering::Relaxed),
        blobs_skipped: c.skipped.load(Ordering::Relaxed),
        blobs_mounted: c.mounted.load(Ordering::Relaxed),
        bytes_copied: c.bytes.load(Ordering::Relaxed),
        referrers: c.referrers.load(Ordering::Relaxed),
    })
}

const MAX_DEPTH: usize = 4;

impl Copier<'_> {
    /// Copies a manifest or index with everything below it, then its referrers.
    fn copy_manifest<'s>(
        &'s self,
        m: &'s Manifest,
        tag: Option<&'s str>,
        depth: usize,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ClientError>> + Send + 's>>
    {
        Box::pin(async move {
            if depth > MAX_DEPTH {
                return Err(invalid("image index", "nested more than 4 levels deep"));
            }
            if is_index(m) {
                let index: ImageIndex = serde_json::from_slice(&m.bytes)
                    .map_err(|e| invalid(&format!("image index {}", m.digest), e))?;
                for child in index.manifests() {
                    let cm = self.src.read_manifest(child).await?;
                    self.copy_manifest(&cm, None, depth + 1).await?;
                }
            } else {
                let manifest: ImageManifest = serde_json::from_slice(&m.bytes)
                    .map_err(|e| invalid(&format!("image manifest {}", m.digest), e))?;
                self.copy_blobs(&manifest).await?;
            }
            self.dst.write_manifest(m, tag).await?;
            self.counters.manifests.fetch_add(1, Ordering::Relaxed);
            self.progress.manifest_copied(&m.digest, &m.media_type);
            self.copy_referrers(m).await
        })
    }

    async fn copy_referrers(&self, subject: &Manifest) -> Result<(), ClientError> {
        if self.opts.referrer_types.is_empty() {
            return Ok(());
        }
        let found = self
            .src
            .referrers(&subject.digest, &self.opts.referrer_types)
            .await?;
        for desc in found {
            let rm = self.src.read_manifest(&desc).await?;
            let manifest: ImageManifest = serde_json::from_slice(&rm.bytes)
                .map_err(|e| invalid(&format!("referrer {}", rm.digest), e))?;
            self.copy_blobs(&manifest).await?;
            self.dst.add_referrer(&subject.digest, &desc, &rm).await?;
            self.counters.manifests.fetch_add(1, Ordering::Relaxed);
            self.counters.referrers.fetch_add(1, Ordering::Relaxed);
            self.progress.manifest_copied(&rm.digest, &rm.media_type);
        }
        Ok(())
    }

    async fn copy_blobs(&self, manifest: &ImageManifest) -> Result<(), ClientError> {
        let mut seen = HashSet::new();
        let blobs: Vec<Descriptor> = std::iter::once(manifest.config())
            .chain(manifest.layers().iter())
            .filter(|d| d.urls().as_ref().is_none_or(|u| u.is_empty())) // foreign layers stay put
            .filter(|d| seen.insert(d.digest().to_string()))
            .cloned()
            .collect();
        futures_util::stream::iter(blobs)
            .map(|d| async move { self.copy_blob(&d).await })
            .buffer_unordered(self.opts.concurrency.max(1))
            .try_collect::<()>()
            .await
    }

    async fn download_into_layout(
        &self,
        client: &Client,
        repo: &Repo,
        layout: &OciLayout,
        digest: &str,
        size: u64,
    ) -> Result<(), ClientError> {
        let path = layout.blob_path(&parse_digest(digest)?)?;
        let dir = path
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_default();
        let io = |source| ClientError::Io {
            path: dir.display().to_string(),
            source,
        };
        let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io)?;
        let progress = self.progress.clone();
        let d2 = digest.to_string();
        let mut opts = super::DownloadOptions::from_config(client.config());
        opts.progress = Some(Arc::new(move |n| progress.blob_bytes(&d2, n)));
        client
            .download_blob(repo, digest, size, tmp.path(), &opts)
            .await?;
        blocking(move || {
            use std::os::unix::fs::PermissionsExt;
            let io = |source| ClientError::Io {
                path: path.display().to_string(),
                source,
            };
            tmp.as_file()
                .set_permissions(std::fs::Permissions::from_mode(0o644))
                .map_err(io)?;
            tmp.as_file().sync_all().map_err(io)?;
            tmp.persist(&path).map_err(|e| io(e.error))?;
            Ok(())
        })
        .await
    }

    async fn copy_blob(&self, desc: &Descriptor) -> Result<(), ClientError> {
        let digest = desc.digest().to_string();
        let size = desc.size();
        if self.dst.has_blob(&digest).await? {
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
            self.progress.blob_finished(&digest, BlobOutcome::Existed);
            return Ok(());
        }
        if let (
            ImageLocation::Registry {
                client: sc,
                repo: src_repo,
                ..
            },
            ImageLocation::Registry { client, repo, .. },
        ) = (self.src, self.dst)
            && src_repo.registry == repo.registry
            && src_repo.repository != repo.repository
            && Arc::ptr_eq(&sc.inner, &client.inner)
        {
            match client.mount_blob(repo, &digest, &src_repo.repository).await {
                Ok(true) => {
                    self.counters.mounted.fetch_add(1, Ordering::Relaxed);
                    self.progress.blob_finished(&digest, BlobOutcome::Mounted);
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => tracing::debug!(%digest, error = %e, "mount failed; copying"),
            }
        }
        self.progress.blob_started(&digest, size);
        if let (ImageLocation::Registry { client, repo, .. }, ImageLocation::Layout { layout, .. }) =
            (self.src, self.dst)
            && size > client.config().chunk_size
        {
            // Big layer into a layout: parallel Range requests straight into the file.
            self.download_into_layout(client, repo, layout, &digest, size)
                .await?;
            self.counters.copied.fetch_add(1, Ordering::Relaxed);
            self.counters.bytes.fetch_add(size, Ordering::Relaxed);
            self.progress.blob_finished(&digest, BlobOutcome::Copied);
            return Ok(());
        }
        let body = self.src.open_blob(&digest).await?;
        let progress = self.progress.clone();
        let d2 = digest.clone();
        let counted: ByteStream = Box::pin(body.inspect(move |item| {
            if let Ok(b) = item {
                progress.blob_bytes(&d2, b.len() as u64);
            }
        }));
        self.dst
            .write_blob(&digest, size, counted)
            .await
            .map_err(|e| match e {
                ClientError::Transport { registry, message } => ClientError::Transport {
                    registry,
                    message: format!("copying blob {digest}: {message}"),
                },
                other => other,
            })?;
        self.counters.copied.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes.fetch_add(size, Ordering::Relaxed);
        self.progress.blob_finished(&digest, BlobOutcome::Copied);
        Ok(())
    }
}
