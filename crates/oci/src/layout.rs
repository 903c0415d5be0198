//! OCI image layout directories (`oci-layout`, `index.json`, `blobs/sha256/…`).
//!
//! Writes are crash-safe: every blob and every `index.json` is written to a temporary
//! file in the same directory, synced, and renamed into place, so a reader never sees a
//! partial file. Reads verify digests and refuse documents larger than
//! [`crate::MAX_MANIFEST_BYTES`].
//!
//! Referrers (artifacts whose `subject` is a manifest, like ferry's index) are kept with
//! the OCI 1.1 tag fallback: the tag `sha256-<subject hex>` names an image index listing
//! every referrer of that subject, exactly as on a registry without the referrers API.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use oci_spec::image::{Descriptor, Digest, ImageIndex, ImageManifest, MediaType};

use crate::digest::{Sha256Writer, parse_sha256, sha256_digest};
use crate::media::{ANNOTATION_REF_NAME, OCI_INDEX};
use crate::platform::{Platform, choose_manifest};
use crate::{Error, MAX_MANIFEST_BYTES, Result};

/// An OCI image layout directory.
#[derive(Debug, Clone)]
pub struct OciLayout {
    root: PathBuf,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Whether `d` points at an image index (OCI, or Docker's manifest list).
fn is_index_type(d: &Descriptor) -> bool {
    let m = d.media_type().to_string();
    m == crate::media::OCI_INDEX || m == crate::media::DOCKER_MANIFEST_LIST
}

fn invalid(what: &str, reason: impl ToString) -> Error {
    Error::Invalid {
        what: what.to_string(),
        reason: reason.to_string(),
    }
}

/// Serializes a document with sorted keys, so the same document always has the same
/// bytes (oci-spec keeps annotations in a HashMap).
pub fn canonical_json<T: serde::Serialize>(doc: &T) -> Result<Vec<u8>> {
    let value = serde_json::to_value(doc).map_err(|e| invalid("document", e))?;
    serde_json::to_vec(&value).map_err(|e| invalid("document", e))
}

impl OciLayout {
    /// Opens an existing layout.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        let marker = root.join("oci-layout");
        if !marker.is_file() {
            return Err(Error::NotFound(format!(
                "{} is not an OCI image layout (no oci-layout file); create one with `ferry pack` or `skopeo copy … oci:DIR:TAG`",
                root.display()
            )));
        }
        Ok(OciLayout { root })
    }

    /// Opens a layout, creating an empty one if the directory has none.
    pub fn open_or_create(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        fs::create_dir_all(root.join("blobs/sha256")).map_err(io_err(&root))?;
        let marker = root.join("oci-layout");
        if !marker.exists() {
            atomic_write(&marker, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        }
        let layout = OciLayout { root };
        if !layout.root.join("index.json").exists() {
            let empty =
                serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []});
            atomic_write(&layout.root.join("index.json"), &canonical_json(&empty)?)?;
        }
        Ok(layout)
    }

    /// The layout's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Path of a blob (the digest is validated, so it cannot escape the layout).
    pub fn blob_path(&self, digest: &Digest) -> Result<PathBuf> {
        let d = parse_sha256(digest.as_ref())?;
        Ok(self.root.join("blobs/sha256").join(d.digest()))
    }

    /// True when the blob is present.
    pub fn has_blob(&self, digest: &Digest) -> bool {
        self.blob_path(digest).map(|p| p.is_file()).unwrap_or(false)
    }

    /// Reads a whole blob of at most `max` bytes and verifies its digest.
    pub fn read_blob(&self, digest: &Digest, max: u64) -> Result<Vec<u8>> {
        let path = self.blob_path(digest)?;
        let file = File::open(&path).map_err(io_err(&path))?;
        let len = file.metadata().map_err(io_err(&path))?.len();
        if len > max {
            return Err(invalid(
                "blob",
                format!("{digest} is {len} bytes, more than the {max} allowed here"),
            ));
        }
        let mut buf = Vec::with_capacity(len as usize);
        file.take(max + 1)
            .read_to_end(&mut buf)
            .map_err(io_err(&path))?;
        let actual = sha256_digest(&buf);
        if &actual != digest {
            return Err(Error::Mismatch {
                digest: digest.to_string(),
                reason: format!("blob file hashes to {actual}"),
            });
        }
        Ok(buf)
    }

    /// Stores bytes as a blob; returns its digest.
    pub fn write_blob(&self, bytes: &[u8]) -> Result<Digest> {
        let mut w = self.blob_writer()?;
        w.write_all(bytes).map_err(io_err(&self.root))?;
        Ok(w.commit()?.0)
    }

    /// Starts streaming a blob of not-yet-known digest into the layout.
    pub fn blob_writer(&self) -> Result<BlobWriter> {
        let dir = self.root.join("blobs/sha256");
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io_err(&dir))?;
        Ok(BlobWriter {
            inner: Sha256Writer::new(io::BufWriter::with_capacity(1 << 20, tmp)),
            dir,
        })
    }

    /// Reads and parses `index.json`.
    pub fn index(&self) -> Result<ImageIndex> {
        let path = self.root.join("index.json");
        let bytes = read_bounded(&path, MAX_MANIFEST_BYTES)?;
        serde_json::from_slice(&bytes).map_err(|e| invalid("index.json", e))
    }

    fn write_index(&self, index: &ImageIndex) -> Result<()> {
        atomic_write(&self.root.join("index.json"), &canonical_json(index)?)
    }

    /// Finds the descriptor a tag or `sha256:` digest names in `index.json`; a digest may
    /// also name an entry of an image index that `index.json` lists (a platform's manifest
    /// of a multi-platform image, which is how `--platform` names it).
    pub fn resolve(&self, reference: &str) -> Result<Descriptor> {
        let index = self.index()?;
        let is_digest = reference.starts_with("sha256:");
        let found = index.manifests().iter().find(|d| {
            if is_digest {
                d.digest().as_ref() == reference
            } else {
                d.annotations()
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION_REF_NAME))
                    .is_some_and(|t| t == reference)
            }
        });
        if let Some(found) = found {
            return Ok(found.clone());
        }
        if is_digest {
            for top in index.manifests().iter().filter(|d| is_index_type(d)) {
                let bytes = self.read_document(top)?;
                let nested: ImageIndex =
                    serde_json::from_slice(&bytes).map_err(|e| invalid("image index", e))?;
                if let Some(d) = nested
                    .manifests()
                    .iter()
                    .find(|d| d.digest().as_ref() == reference)
                {
                    return Ok(d.clone());
                }
            }
        }
        Err(Error::NotFound(format!(
            "{reference} in {} (see its index.json for the tags it has)",
            self.root.display()
        )))
    }

    /// Reads a manifest or index document by descriptor (bounded, digest-verified).
    pub fn read_document(&self, desc: &Descriptor) -> Result<Vec<u8>> {
        if desc.size() > MAX_MANIFEST_BYTES {
            return Err(invalid(
                "manifest",
                format!("{} claims {} bytes", desc.digest(), desc.size()),
            ));
        }
        self.read_blob(desc.digest(), MAX_MANIFEST_BYTES)
    }

    /// Resolves a reference to a single image manifest; for an image index picks this
    /// machine's platform ([`crate::platform::choose_manifest`]).
    pub fn image_manifest(&self, reference: &str) -> Result<(Descriptor, ImageManifest)> {
        self.image_manifest_for(reference, &Platform::host())
    }

    /// [`OciLayout::image_manifest`] for the platform `want`.
    pub fn image_manifest_for(
        &self,
        reference: &str,
        want: &Platform,
    ) -> Result<(Descriptor, ImageManifest)> {
        let mut desc = self.resolve(reference)?;
        for _ in 0..4 {
            let bytes = self.read_document(&desc)?;
            let value: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| invalid("manifest", e))?;
            if value.get("manifests").is_some() {
                let index: ImageIndex =
                    serde_json::from_value(value).map_err(|e| invalid("image index", e))?;
                desc = choose_manifest(&index, want)?.clone();
                continue;
            }
            let manifest: ImageManifest =
                serde_json::from_value(value).map_err(|e| invalid("image manifest", e))?;
            return Ok((desc, manifest));
        }
        Err(invalid("image index", "nested more than 4 levels deep"))
    }

    /// Adds or replaces `tag` in `index.json` to point at `desc`.
    pub fn set_tag(&self, tag: &str, desc: &Descriptor) -> Result<()> {
        crate::reference::Tag::parse(tag)?;
        let mut index = self.index()?;
        let mut manifests: Vec<Descriptor> = index
            .manifests()
            .iter()
            .filter(|d| {
                d.annotations()
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION_REF_NAME))
                    .is_none_or(|t| t != tag)
            })
            .cloned()
            .collect();
        let mut tagged = desc.clone();
        let mut ann = tagged.annotations().clone().unwrap_or_default();
        ann.insert(ANNOTATION_REF_NAME.to_string(), tag.to_string());
        tagged.set_annotations(Some(ann));
        manifests.push(tagged);
        index.set_manifests(manifests);
        self.write_index(&index)
    }

    /// Records `referrer` (a manifest descriptor with `artifactType`) as a referrer of
    /// `subject`, through the `sha256-<hex>` tag fallback. Replaces an earlier referrer
    /// with the same artifact type and the same digest.
    pub fn add_referrer(&self, subject: &Digest, referrer: &Descriptor) -> Result<()> {
        let tag = fallback_tag(subject)?;
        let mut list = self.referrers(subject)?;
        list.retain(|d| {
            d.digest() != referrer.digest() && d.artifact_type() != referrer.artifact_type()
        });
        list.push(referrer.clone());
        let doc =
            serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list});
        let bytes = canonical_json(&doc)?;
        let digest = self.write_blob(&bytes)?;
        let desc = Descriptor::new(MediaType::ImageIndex, bytes.len() as u64, digest);
        self.set_tag(&tag, &desc)
    }

    /// Referrers of `subject` recorded in this layout.
    pub fn referrers(&self, subject: &Digest) -> Result<Vec<Descriptor>> {
        let tag = fallback_tag(subject)?;
        let desc = match self.resolve(&tag) {
            Ok(d) => d,
            Err(Error::NotFound(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let bytes = self.read_document(&desc)?;
        let index: ImageIndex =
            serde_json::from_slice(&bytes).map_err(|e| invalid("referrers index", e))?;
        Ok(index.manifests().clone())
    }
}

/// The OCI 1.1 referrers tag fallback for a subject digest: `sha256-<hex>`.
pub fn fallback_tag(subject: &Digest) -> Result<String> {
    let d = parse_sha256(subject.as_ref())?;
    Ok(format!("sha256-{}", d.digest()))
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let file = File::open(path).map_err(io_err(path))?;
    let mut buf = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut buf)
        .map_err(io_err(path))?;
    if buf.len() as u64 > max {
        return Err(invalid(
            &path.display().to_string(),
            format!("larger than {max} bytes"),
        ));
    }
    Ok(buf)
}

/// Temp files are created 0600; layout content is world-readable like skopeo's (0644),
/// so a registry or a non-root reader can serve it.
fn make_readable(file: &File, path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(fs::Permissions::from_mode(0o644))
        .map_err(io_err(path))
}

/// Writes a file atomically: temp file in the same directory, fsync, rename.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io_err(dir))?;
    tmp.write_all(bytes).map_err(io_err(path))?;
    make_readable(tmp.as_file(), path)?;
    tmp.as_file().sync_all().map_err(io_err(path))?;
    tmp.persist(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        source: e.error,
    })?;
    Ok(())
}

/// A blob being streamed into a layout; [`BlobWriter::commit`] moves it into place under
/// its digest. Dropped without commit, it leaves nothing behind.
#[derive(Debug)]
pub struct BlobWriter {
    inner: Sha256Writer<io::BufWriter<tempfile::NamedTempFile>>,
    dir: PathBuf,
}

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl BlobWriter {
    /// Syncs and renames the blob into place; returns its digest and size.
    pub fn commit(self) -> Result<(Digest, u64)> {
        let (buf, digest, size) = self.inner.finish();
        let tmp = buf.into_inner().map_err(|e| Error::Io {
            path: self.dir.display().to_string(),
            source: e.into_error(),
        })?;
        let path = self.dir.join(digest.digest());
        make_readable(tmp.as_file(), &path)?;
        tmp.as_file().sync_all().map_err(io_err(&self.dir))?;
        tmp.persist(&path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e.error,
        })?;
        Ok((digest, size))
    }
}

/// The canonical JSON of an OCI 1.1 artifact manifest of `artifact_type` holding
/// `layers` and referring to `subject` (the empty config, as the spec recommends), with
/// `annotations` when any. Deterministic: the same arguments give the same bytes.
pub fn artifact_manifest(
    artifact_type: &str,
    layers: &[Descriptor],
    subject: &Descriptor,
    annotations: &[(&str, String)],
) -> Result<Vec<u8>> {
    let empty = crate::digest::sha256_digest(b"{}");
    let subject = descriptor(
        subject.media_type().as_ref(),
        subject.digest().clone(),
        subject.size(),
        &[],
    );
    let mut doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": crate::media::OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": descriptor(crate::media::OCI_EMPTY, empty, 2, &[]),
        "layers": layers,
        "subject": subject,
    });
    if !annotations.is_empty()
        && let Some(obj) = doc.as_object_mut()
    {
        let map: serde_json::Map<String, serde_json::Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::String(v.clone())))
            .collect();
        obj.insert("annotations".into(), serde_json::Value::Object(map));
    }
    canonical_json(&doc)
}

/// Builds a descriptor with optional annotations (sorted on output by [`canonical_json`]).
pub fn descriptor(
    media_type: &str,
    digest: Digest,
    size: u64,
    annotations: &[(&str, String)],
) -> Descriptor {
    let mut d = Descriptor::new(MediaType::from(media_type), size, digest);
    if !annotations.is_empty() {
        let map: HashMap<String, String> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        d.set_annotations(Some(map));
    }
    d
}

/// Parses a media type string into oci-spec's type.
pub fn media_type(s: &str) -> MediaType {
    MediaType::from(s)
}

/// Parses a digest that must be sha256 (what a layout stores blobs under).
pub fn digest(s: &str) -> Result<Digest> {
    parse_sha256(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::{FERRY_INDEX_ARTIFACT, OCI_MANIFEST};

    #[test]
    fn blobs_round_trip_and_verify() -> Result<()> {
        let dir = tempfile::tempdir().map_err(io_err(Path::new("tmp")))?;
        let layout = OciLayout::open_or_create(dir.path())?;
        let d = layout.write_blob(b"hello")?;
        assert_eq!(layout.read_blob(&d, 100)?, b"hello");
        assert!(layout.read_blob(&d, 2).is_err());
        fs::write(layout.blob_path(&d)?, b"HELLO").map_err(io_err(dir.path()))?;
        assert!(matches!(
            layout.read_blob(&d, 100),
            Err(Error::Mismatch { .. })
        ));
        Ok(())
    }

    #[test]
    fn tags_and_referrers() -> Result<()> {
        let dir = tempfile::tempdir().map_err(io_err(Path::new("tmp")))?;
        let layout = OciLayout::open_or_create(dir.path())?;
        let m = layout.write_blob(b"{}")?;
        let desc = descriptor(OCI_MANIFEST, m.clone(), 2, &[]);
        layout.set_tag("v1", &desc)?;
        layout.set_tag("v1", &desc)?;
        assert_eq!(layout.index()?.manifests().len(), 1);
        assert_eq!(layout.resolve("v1")?.digest(), &m);
        assert!(layout.resolve("v2").is_err());

        assert!(layout.referrers(&m)?.is_empty());
        let a = layout.write_blob(b"{\"a\":1}")?;
        let mut rd = descriptor(OCI_MANIFEST, a.clone(), 7, &[]);
        rd.set_artifact_type(Some(media_type(FERRY_INDEX_ARTIFACT)));
        layout.add_referrer(&m, &rd)?;
        layout.add_referrer(&m, &rd)?;
        let refs = layout.referrers(&m)?;
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].digest(), &a);
        assert!(layout.resolve(&fallback_tag(&m)?).is_ok());
        Ok(())
    }

    #[test]
    fn platform_manifests_of_an_index_resolve_by_digest() -> Result<()> {
        let dir = tempfile::tempdir().map_err(io_err(Path::new("tmp")))?;
        let layout = OciLayout::open_or_create(dir.path())?;
        let config = layout.write_blob(b"{}")?;
        let manifest = |which: &str| -> Result<Descriptor> {
            let doc = serde_json::json!({
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": descriptor(crate::media::OCI_EMPTY, config.clone(), 2, &[]),
                "layers": [],
                "annotations": {"which": which},
            });
            let bytes = canonical_json(&doc)?;
            let d = layout.write_blob(&bytes)?;
            Ok(descriptor(OCI_MANIFEST, d, bytes.len() as u64, &[]))
        };
        let (s390x, arm) = (manifest("s390x")?, manifest("arm64")?);
        let entry = |d: &Descriptor, arch: &str| {
            let mut v = serde_json::to_value(d).unwrap_or_default();
            v["platform"] = serde_json::json!({"os": "linux", "architecture": arch});
            v
        };
        let index = serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX,
            "manifests": [entry(&s390x, "s390x"), entry(&arm, "arm64")]});
        let bytes = canonical_json(&index)?;
        let index_digest = layout.write_blob(&bytes)?;
        layout.set_tag(
            "multi",
            &descriptor(OCI_INDEX, index_digest, bytes.len() as u64, &[]),
        )?;
        let want = Platform::parse("linux/arm64")?;
        let (chosen, _) = layout.image_manifest_for("multi", &want)?;
        assert_eq!(chosen.digest(), arm.digest());
        // The chosen manifest is not in index.json, yet its digest names it.
        assert_eq!(
            layout.resolve(arm.digest().as_ref())?.digest(),
            arm.digest()
        );
        let (by_digest, _) = layout.image_manifest(s390x.digest().as_ref())?;
        assert_eq!(by_digest.digest(), s390x.digest());
        let absent = format!("sha256:{}", "0".repeat(64));
        assert!(matches!(layout.resolve(&absent), Err(Error::NotFound(_))));
        Ok(())
    }

    #[test]
    fn written_blobs_are_world_readable() -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().map_err(io_err(Path::new("tmp")))?;
        let layout = OciLayout::open_or_create(dir.path())?;
        let d = layout.write_blob(b"x")?;
        let mode = fs::metadata(layout.blob_path(&d)?)
            .map_err(io_err(dir.path()))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
        let mode = fs::metadata(dir.path().join("index.json"))
            .map_err(io_err(dir.path()))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
        Ok(())
    }

    #[test]
    fn open_requires_marker() {
        let dir = tempfile::tempdir().ok();
        let p = dir
            .as_ref()
            .map(|d| d.path().to_path_buf())
            .unwrap_or_default();
        assert!(matches!(OciLayout::open(&p), Err(Error::NotFound(_))));
    }
}
