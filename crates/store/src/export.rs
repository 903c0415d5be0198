//! Store images: [`Store::export`] copies every committed entry and the store's image
//! records into a self-describing directory, and [`Store::import`] brings one into a
//! store, verifying every object before any of it is visible.
//!
//! An export directory holds:
//! - `ferry-store.json` ([`MANIFEST_NAME`]): the [`ExportManifest`] — format version,
//!   the images and layers it covers ([`ImageRecord`]), and every object with its key
//!   and size. Written last (temp file + rename), so a directory without it is an
//!   unfinished export and import refuses it.
//! - `objects/<2 hex>/<64 hex>`: one file per object, named by its key, byte for byte
//!   the store's entry file (copied with `copy_file_range`, so a reflinking filesystem
//!   shares the blocks).
//!
//! Import reads the manifest as untrusted input ([`ExportManifest::parse`]: bounded
//! size and counts, known version only), copies each object the store lacks into the
//! store's staging directory, hashes it there, and only when every one of them matched
//! its key renames them into place; any mismatch, short file or I/O error leaves the
//! store as it was.
//!
//! Image records (`images/<hex>.json` under the store root) name what a store holds
//! for humans and for the export manifest: the store does not interpret them (they are
//! opaque strings, written by whoever fills the store, e.g. `ferry prewarm`).

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::image_meta::{
    MAX_METADATA_BLOBS, MAX_METADATA_BYTES, MetadataRecord, live_images, metadata_path, read_blob,
};
use super::{BusyGuard, Store, hash_file};
use crate::diskcache::{Durability, TempFile};
use crate::error::{Error, Result};
use crate::key::ChunkKey;

/// The export format this build writes: 2 added image metadata blobs (`metadata/`).
pub const EXPORT_FORMAT: u32 = 2;
/// The oldest export format this build reads (1: objects and image records only).
pub const OLDEST_EXPORT_FORMAT: u32 = 1;
/// The manifest's file name inside an export directory.
pub const MANIFEST_NAME: &str = "ferry-store.json";
/// What the manifest's `kind` field says.
pub const EXPORT_KIND: &str = "ferry-store-export";
/// Largest manifest import reads (about 600k objects).
pub const MAX_MANIFEST_BYTES: u64 = 128 << 20;
/// Most objects one export may list.
pub const MAX_OBJECTS: usize = 1 << 20;
/// Most image records one export (or store) may list.
pub const MAX_IMAGES: usize = 4096;
/// Most layers one image record may list.
pub const MAX_LAYERS: usize = 1024;
/// Longest string in an image record, in bytes.
pub const MAX_RECORD_STRING: usize = 1024;
/// How long a metadata blob no record lists is kept after it was last written (see
/// [`Store::sweep_metadata`]): longer than any fill takes between putting an image's
/// blobs and recording it.
pub const METADATA_GRACE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Largest image record file read from the store.
pub(crate) const MAX_RECORD_FILE: u64 = 1 << 20;

/// An image whose data a store holds (or held when it was recorded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageRecord {
    /// The image as named when it was put into the store (`oci:DIR:TAG`, `HOST/REPO:TAG`).
    pub reference: String,
    /// Its manifest digest.
    pub manifest_digest: String,
    /// Its layers, lowest first.
    #[serde(default)]
    pub layers: Vec<LayerRecord>,
    /// How it was filled (`trace`, `landmarks`, `full`, …), for humans.
    #[serde(default)]
    pub coverage: String,
    /// When it was recorded, ms since the epoch.
    #[serde(default)]
    pub recorded_ms: u64,
    /// The blobs that start it without a registry, kept by [`Store::put_metadata`]
    /// (empty in records written before they were kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metadata: Vec<MetadataRecord>,
}

/// One layer of an [`ImageRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRecord {
    /// The layer blob's digest.
    pub digest: String,
    /// Its compressed size.
    pub size: u64,
}

impl ImageRecord {
    /// Checks the bounds (non-empty reference, string lengths, layer count).
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.reference.is_empty() {
            return Err("an image record has an empty reference".into());
        }
        if self.layers.len() > MAX_LAYERS {
            return Err(format!(
                "image {} lists {} layers (at most {MAX_LAYERS})",
                short(&self.reference),
                self.layers.len()
            ));
        }
        if self.metadata.len() > MAX_METADATA_BLOBS {
            return Err(format!(
                "image {} lists {} metadata blobs (at most {MAX_METADATA_BLOBS})",
                short(&self.reference),
                self.metadata.len()
            ));
        }
        if let Some(m) = self.metadata.iter().find(|m| m.size > MAX_METADATA_BYTES) {
            return Err(format!(
                "metadata blob {} of {} bytes (at most {MAX_METADATA_BYTES})",
                m.digest, m.size
            ));
        }
        let strings = [&self.reference, &self.manifest_digest, &self.coverage]
            .into_iter()
            .chain(self.layers.iter().map(|l| &l.digest))
            .chain(self.metadata.iter().flat_map(|m| [&m.role, &m.media_type]));
        for s in strings {
            if s.len() > MAX_RECORD_STRING {
                return Err(format!(
                    "a string of {} bytes in an image record (at most {MAX_RECORD_STRING})",
                    s.len()
                ));
            }
        }
        Ok(())
    }

    /// The record's file name under `images/`: the hex SHA-256 of the reference.
    fn file_name(&self) -> String {
        format!(
            "{}.json",
            hex::encode(Sha256::digest(self.reference.as_bytes()))
        )
    }
}

/// Import's refusal of a metadata blob of the export that is not usable.
fn unusable_metadata(key: ChunkKey, path: &Path, why: &str) -> Error {
    Error::CorruptObject {
        key,
        path: path.to_path_buf(),
        reason: format!("a metadata blob that is {why}"),
    }
}

fn short(s: &str) -> String {
    s.chars().take(80).collect()
}

/// One object of an export: a store entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectRecord {
    /// Its key (the SHA-256 of its bytes).
    pub key: ChunkKey,
    /// Its size in bytes.
    pub size: u64,
}

/// The manifest of an export directory (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportManifest {
    /// [`EXPORT_FORMAT`] when written by this build.
    pub format: u32,
    /// [`EXPORT_KIND`].
    pub kind: String,
    /// When the export was made, ms since the epoch.
    pub created_ms: u64,
    /// The images the store held records for.
    pub images: Vec<ImageRecord>,
    /// Every object, sorted by key.
    pub objects: Vec<ObjectRecord>,
    /// The sum of the objects' sizes.
    pub total_bytes: u64,
    /// The image records' metadata blobs (`metadata/<64 hex>`), sorted by key; none in
    /// format 1.
    #[serde(default)]
    pub metadata: Vec<ObjectRecord>,
}

/// Only the version, read first so a newer format is named as such rather than as a
/// parse error of fields this build does not know.
#[derive(Deserialize)]
struct VersionProbe {
    format: Option<u64>,
    kind: Option<String>,
}

impl ExportManifest {
    /// Parses and checks a manifest read from `path` (untrusted: it comes from a volume).
    /// Refuses an unknown version with [`Error::ExportFormat`] and anything malformed or
    /// beyond the bounds with [`Error::BadExport`].
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<ExportManifest> {
        let bad = |reason: String| Error::BadExport {
            path: path.to_path_buf(),
            reason,
        };
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "manifest of {} bytes (at most {MAX_MANIFEST_BYTES})",
                bytes.len()
            )));
        }
        let probe: VersionProbe =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not a manifest: {e}")))?;
        if probe.kind.as_deref() != Some(EXPORT_KIND) {
            return Err(bad(format!("kind is not {EXPORT_KIND:?}")));
        }
        match probe.format {
            Some(f)
                if (u64::from(OLDEST_EXPORT_FORMAT)..=u64::from(EXPORT_FORMAT)).contains(&f) => {}
            Some(f) => {
                return Err(Error::ExportFormat {
                    path: path.to_path_buf(),
                    found: f,
                    supported: EXPORT_FORMAT,
                    oldest: OLDEST_EXPORT_FORMAT,
                });
            }
            None => return Err(bad("no format version".into())),
        }
        let m: ExportManifest =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("malformed manifest: {e}")))?;
        if m.objects.len() > MAX_OBJECTS {
            return Err(bad(format!(
                "{} objects (at most {MAX_OBJECTS})",
                m.objects.len()
            )));
        }
        if m.images.len() > MAX_IMAGES {
            return Err(bad(format!(
                "{} images (at most {MAX_IMAGES})",
                m.images.len()
            )));
        }
        for image in &m.images {
            image.check().map_err(&bad)?;
        }
        let mut seen = HashSet::with_capacity(m.objects.len());
        let mut total = 0u64;
        for o in &m.objects {
            if !seen.insert(o.key) {
                return Err(bad(format!("object {} listed twice", o.key)));
            }
            total = total
                .checked_add(o.size)
                .ok_or_else(|| bad("object sizes overflow".into()))?;
        }
        if m.metadata.len() > MAX_OBJECTS {
            return Err(bad(format!(
                "{} metadata blobs (at most {MAX_OBJECTS})",
                m.metadata.len()
            )));
        }
        let mut seen_metadata = HashSet::with_capacity(m.metadata.len());
        for o in &m.metadata {
            if !seen_metadata.insert(o.key) {
                return Err(bad(format!("metadata blob {} listed twice", o.key)));
            }
            if o.size > MAX_METADATA_BYTES {
                return Err(bad(format!(
                    "metadata blob {} of {} bytes (at most {MAX_METADATA_BYTES})",
                    o.key, o.size
                )));
            }
        }
        if total != m.total_bytes {
            return Err(bad(format!(
                "objects add up to {total} bytes, the manifest says {}",
                m.total_bytes
            )));
        }
        Ok(m)
    }
}

/// What [`Store::export`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ExportReport {
    /// The export directory.
    pub dest: PathBuf,
    /// Objects written.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Image records included.
    pub images: u64,
    /// Metadata blobs written.
    pub metadata: u64,
    /// Entries listed but gone before they could be copied (evicted meanwhile).
    pub skipped: u64,
}

/// What [`Store::import`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ImportReport {
    /// Objects verified and added.
    pub imported: u64,
    /// Their bytes.
    pub imported_bytes: u64,
    /// Objects the store already held (not copied).
    pub present: u64,
    /// Their bytes.
    pub present_bytes: u64,
    /// Image records added or replaced.
    pub images: u64,
    /// Metadata blobs verified and kept.
    pub metadata: u64,
}

/// An object's file in the export (or seed) at `root`.
pub(crate) fn object_path(root: &Path, key: &ChunkKey) -> PathBuf {
    let hex = key.hex();
    root.join("objects").join(&hex[..2]).join(hex)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Threads used to copy or hash objects.
fn workers() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 8)
}

/// Runs `work` over `items` on a few threads; the first error stops the rest.
fn parallel<T: Sync, R: Send>(
    items: &[T],
    work: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let out: Mutex<Vec<R>> = Mutex::new(Vec::with_capacity(items.len()));
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers().min(items.len().max(1)) {
            s.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else {
                        return;
                    };
                    match work(item) {
                        Ok(r) => out.lock().unwrap_or_else(|p| p.into_inner()).push(r),
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            first_error
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(out.into_inner().unwrap_or_else(|p| p.into_inner()))
}

impl Store {
    /// Records that the store holds (part of) an image, for [`Store::images`] and the
    /// export manifest. Replaces an earlier record of the same reference.
    pub fn record_image(&self, record: &ImageRecord) -> Result<()> {
        record.check().map_err(Error::InvalidRecord)?;
        let dir = self.inner.root.join("images");
        crate::private_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        let bytes = serde_json::to_vec_pretty(record)
            .map_err(|e| Error::InvalidRecord(format!("encoding the image record: {e}")))?;
        let path = dir.join(record.file_name());
        let (temp, ()) = self
            .inner
            .write_temp(|f| std::io::Write::write_all(f, &bytes))?;
        let replaced = path.exists();
        temp.commit(&path, Durability::Synced)
            .map_err(|e| Error::io(&path, e))?;
        if replaced {
            // What the record it replaced listed may be listed by nothing now.
            match self.sweep_metadata(METADATA_GRACE) {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    removed = n,
                    reference = %record.reference,
                    "metadata no image record lists any more removed"
                ),
                Err(e) => tracing::warn!(error = %e, "sweeping unlisted metadata failed"),
            }
        }
        Ok(())
    }

    /// The live store's image records, sorted by reference; unreadable or malformed
    /// ones are skipped (logged). [`Store::metadata`] adds the seed's.
    pub fn images(&self) -> Vec<ImageRecord> {
        live_images(&self.inner.root)
    }

    /// Copies every committed entry and the image records into `dest` (a new or empty
    /// directory), then writes its manifest (see the module doc). Entries are copied with
    /// `copy_file_range` on several threads, not re-hashed: import verifies them.
    pub fn export(&self, dest: &Path) -> Result<ExportReport> {
        match fs::read_dir(dest) {
            Ok(mut it) => {
                if it.next().is_some() {
                    return Err(Error::ExportDestination {
                        path: dest.to_path_buf(),
                        reason: "exists and is not empty; give a new directory".into(),
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(dest, e)),
        }
        let objects_dir = dest.join("objects");
        crate::private_dir(&objects_dir).map_err(|e| Error::io(&objects_dir, e))?;
        for b in 0..=255u8 {
            let d = objects_dir.join(hex::encode([b]));
            crate::private_dir(&d).map_err(|e| Error::io(&d, e))?;
        }
        let entries = self.list();
        let copied = parallel(&entries, |e| {
            let from = self.inner.entry_path(&e.key);
            let to = object_path(dest, &e.key);
            match fs::copy(&from, &to) {
                Ok(n) if n == e.size => Ok(Some(ObjectRecord {
                    key: e.key,
                    size: e.size,
                })),
                Ok(n) => Err(Error::ExportDestination {
                    path: from,
                    reason: format!(
                        "entry is {n} bytes, its record says {}; run `ferry store verify` first",
                        e.size
                    ),
                }),
                // Evicted since it was listed.
                Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(err) => Err(Error::io(&to, err)),
            }
        })?;
        let skipped = copied.iter().filter(|c| c.is_none()).count() as u64;
        let mut objects: Vec<ObjectRecord> = copied.into_iter().flatten().collect();
        objects.sort_by_key(|o| o.key);
        let images = self.images();
        let metadata = self.export_metadata(&images, dest)?;
        let manifest = ExportManifest {
            format: EXPORT_FORMAT,
            kind: EXPORT_KIND.into(),
            created_ms: now_ms(),
            total_bytes: objects.iter().map(|o| o.size).sum(),
            images,
            objects,
            metadata,
        };
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::ExportDestination {
            path: dest.to_path_buf(),
            reason: format!("encoding the manifest: {e}"),
        })?;
        let temp = dest.join(format!(".{MANIFEST_NAME}.part"));
        let path = dest.join(MANIFEST_NAME);
        (|| -> io::Result<()> {
            let mut f = crate::new_private_file().open(&temp)?;
            std::io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()?;
            crate::diskcache::place(&temp, &path, Durability::Synced)
        })()
        .map_err(|e| Error::io(&path, e))?;
        Ok(ExportReport {
            dest: dest.to_path_buf(),
            objects: manifest.objects.len() as u64,
            bytes: manifest.total_bytes,
            images: manifest.images.len() as u64,
            metadata: manifest.metadata.len() as u64,
            skipped,
        })
    }

    /// Copies the metadata blobs `images` list into `dest/metadata/`, each read back
    /// verified (a damaged or missing one is left out, logged: the record still names
    /// it, and a reader of the export finds it missing rather than wrong).
    fn export_metadata(&self, images: &[ImageRecord], dest: &Path) -> Result<Vec<ObjectRecord>> {
        let mut keys: Vec<ChunkKey> = images
            .iter()
            .flat_map(|i| i.metadata.iter().map(|m| m.digest))
            .collect();
        keys.sort();
        keys.dedup();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let dir = dest.join("metadata");
        crate::private_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let from = metadata_path(&self.inner.root, &key);
            let bytes = match read_blob(&from, &key, None) {
                Ok(Some(bytes)) => bytes,
                Ok(None) => {
                    tracing::warn!(%key, "metadata blob of an image record missing; not exported");
                    continue;
                }
                Err(reason) => {
                    tracing::warn!(%key, reason, "damaged metadata blob not exported");
                    continue;
                }
            };
            let to = metadata_path(dest, &key);
            (|| -> io::Result<()> {
                let mut f = crate::new_private_file().open(&to)?;
                std::io::Write::write_all(&mut f, &bytes)?;
                f.sync_all()
            })()
            .map_err(|e| Error::io(&to, e))?;
            out.push(ObjectRecord {
                key,
                size: bytes.len() as u64,
            });
        }
        Ok(out)
    }

    /// Reads and checks the manifest of the export at `src`.
    pub fn read_export_manifest(src: &Path) -> Result<ExportManifest> {
        let path = src.join(MANIFEST_NAME);
        let file = File::open(&path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                Error::BadExport {
                    path: path.clone(),
                    reason:
                        "missing: not a ferry store export, or an unfinished one (export again)"
                            .into(),
                }
            } else {
                Error::io(&path, e)
            }
        })?;
        let mut bytes = Vec::new();
        file.take(MAX_MANIFEST_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(&path, e))?;
        ExportManifest::parse(&path, &bytes)
    }

    /// Imports the export at `src` (see the module doc): every object the store lacks is
    /// copied into staging and hashed; only if all match their keys are they renamed into
    /// place and the image records written. On any error nothing was added.
    pub fn import(&self, src: &Path) -> Result<ImportReport> {
        let manifest = Store::read_export_manifest(src)?;
        let inner = &*self.inner;
        inner.expire_restored_pins()?;
        let mut report = ImportReport::default();
        let mut wanted = Vec::new();
        for o in &manifest.objects {
            // The live store's: what a seed holds is not this store's to keep.
            if inner.contains_live(&o.key) {
                report.present += 1;
                report.present_bytes += o.size;
            } else {
                wanted.push(*o);
            }
        }
        let wanted_bytes: u64 = wanted.iter().map(|o| o.size).sum();
        {
            let st = inner.lock_state();
            if !st.index.has_room(wanted_bytes, inner.max_bytes) {
                return Err(Error::Full {
                    needed: wanted_bytes,
                    max_bytes: inner.max_bytes,
                    pinned_bytes: st.pinned_bytes(),
                });
            }
        }
        // Stage and verify everything first; temp files are removed if any fails.
        let staged: Vec<(ObjectRecord, TempFile)> = parallel(&wanted, |o| {
            let from = object_path(src, &o.key);
            let mut input = File::open(&from).map_err(|e| {
                if e.kind() == io::ErrorKind::NotFound {
                    Error::CorruptObject {
                        key: o.key,
                        path: from.clone(),
                        reason: "missing".into(),
                    }
                } else {
                    Error::io(&from, e)
                }
            })?;
            let (temp, copied) =
                inner.write_temp(|f| io::copy(&mut (&mut input).take(o.size + 1), f))?;
            if copied != o.size {
                return Err(Error::CorruptObject {
                    key: o.key,
                    path: from,
                    reason: format!("{copied} bytes where the manifest says {}", o.size),
                });
            }
            // The temp file is open for writing only: hash what landed on disk.
            let hashed = File::open(temp.path())
                .and_then(|f| hash_file(&f, o.size))
                .map_err(|e| Error::io(temp.path(), e))?;
            if hashed != Some(o.key) {
                return Err(Error::CorruptObject {
                    key: o.key,
                    path: from,
                    reason: "content does not hash to its key".into(),
                });
            }
            Ok((*o, temp))
        })?;
        // Metadata blobs: verified into staging too, before anything is placed.
        let mut staged_metadata = Vec::with_capacity(manifest.metadata.len());
        for o in &manifest.metadata {
            let from = metadata_path(src, &o.key);
            let bytes = match read_blob(&from, &o.key, Some(o.size)) {
                Ok(Some(bytes)) => bytes,
                Ok(None) => return Err(unusable_metadata(o.key, &from, "missing")),
                Err(why) => return Err(unusable_metadata(o.key, &from, &why)),
            };
            let (temp, ()) = inner.write_temp(|f| std::io::Write::write_all(f, &bytes))?;
            staged_metadata.push((o.key, temp));
        }
        for (o, temp) in staged {
            let Some(guard): Option<BusyGuard<'_>> = inner.claim(&o.key) else {
                report.present += 1;
                report.present_bytes += o.size;
                continue;
            };
            inner.commit(guard, temp, o.size)?;
            report.imported += 1;
            report.imported_bytes += o.size;
        }
        inner.flush()?;
        if !staged_metadata.is_empty() {
            let dir = inner.root.join("metadata");
            crate::private_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        }
        for (key, temp) in staged_metadata {
            let path = metadata_path(&inner.root, &key);
            temp.commit(&path, Durability::Synced)
                .map_err(|e| Error::io(&path, e))?;
            report.metadata += 1;
        }
        for image in &manifest.images {
            self.record_image(image)?;
            report.images += 1;
        }
        Ok(report)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::StoreOptions;

    fn open(dir: &Path) -> Store {
        Store::open_with(
            dir,
            StoreOptions {
                max_bytes: Some(64 << 20),
                flush_interval: None,
                pin_grace: Duration::from_secs(60),
                ..StoreOptions::default()
            },
        )
        .unwrap()
    }

    fn chunk(seed: u8, size: usize) -> (ChunkKey, Vec<u8>) {
        let bytes: Vec<u8> = (0..size)
            .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
            .collect();
        (ChunkKey::of(&bytes), bytes)
    }

    fn record() -> ImageRecord {
        ImageRecord {
            reference: "reg.local/app:v1".into(),
            manifest_digest: format!("sha256:{}", "ab".repeat(32)),
            layers: vec![LayerRecord {
                digest: format!("sha256:{}", "cd".repeat(32)),
                size: 1234,
            }],
            coverage: "trace".into(),
            recorded_ms: 1,
            metadata: Vec::new(),
        }
    }

    /// A store with a few entries and an image record, exported to `dir/export`.
    fn exported(dir: &Path) -> (Vec<(ChunkKey, Vec<u8>)>, PathBuf) {
        let store = open(&dir.join("a"));
        let chunks: Vec<_> = (0..20u8)
            .map(|i| chunk(i, 1000 + 977 * i as usize))
            .collect();
        for (k, b) in &chunks {
            store.put(k, b).unwrap();
        }
        store.record_image(&record()).unwrap();
        let dest = dir.join("export");
        let report = store.export(&dest).unwrap();
        assert_eq!(report.objects, 20);
        assert_eq!(report.images, 1);
        assert_eq!(
            report.bytes,
            chunks.iter().map(|(_, b)| b.len() as u64).sum::<u64>()
        );
        (chunks, dest)
    }

    #[test]
    fn export_then_import_into_a_fresh_root_reads_back_every_object() {
        let dir = tempfile::tempdir().unwrap();
        let (chunks, dest) = exported(dir.path());
        let manifest = Store::read_export_manifest(&dest).unwrap();
        assert_eq!(manifest.format, EXPORT_FORMAT);
        assert_eq!(manifest.images, vec![record()]);

        let fresh = open(&dir.path().join("b"));
        let report = fresh.import(&dest).unwrap();
        assert_eq!(report.imported, 20);
        assert_eq!(report.present, 0);
        assert_eq!(report.images, 1);
        for (k, b) in &chunks {
            assert_eq!(fresh.get(k).unwrap().as_deref(), Some(b.as_slice()));
        }
        assert_eq!(fresh.images(), vec![record()]);
        let verified = fresh.verify_all().unwrap();
        assert_eq!(verified.good_entries, 20);
        assert!(verified.dropped.is_empty());
        // Again: nothing to copy.
        let again = fresh.import(&dest).unwrap();
        assert_eq!((again.imported, again.present), (0, 20));
        // And it survives a reopen.
        drop(fresh);
        let reopened = open(&dir.path().join("b"));
        assert_eq!(reopened.stats().entries, 20);
        for (k, b) in &chunks {
            assert_eq!(reopened.get(k).unwrap().as_deref(), Some(b.as_slice()));
        }
    }

    #[test]
    fn a_corrupt_object_is_refused_and_nothing_is_imported() {
        let dir = tempfile::tempdir().unwrap();
        let (chunks, dest) = exported(dir.path());
        let victim = object_path(&dest, &chunks[7].0);
        let mut bytes = fs::read(&victim).unwrap();
        bytes[10] ^= 0xff;
        fs::write(&victim, &bytes).unwrap();

        let root = dir.path().join("b");
        let fresh = open(&root);
        let err = fresh.import(&dest).unwrap_err();
        assert!(
            matches!(&err, Error::CorruptObject { key, .. } if *key == chunks[7].0),
            "{err}"
        );
        assert!(err.to_string().contains("nothing was imported"), "{err}");
        assert_eq!(fresh.stats().entries, 0);
        assert!(fresh.images().is_empty());
        assert_eq!(fs::read_dir(root.join("tmp")).unwrap().count(), 0);

        // A missing object is refused the same way.
        fs::write(&victim, &chunks[7].1).unwrap();
        fs::remove_file(object_path(&dest, &chunks[3].0)).unwrap();
        let err = fresh.import(&dest).unwrap_err();
        assert!(matches!(&err, Error::CorruptObject { .. }), "{err}");
        assert_eq!(fresh.stats().entries, 0);
    }

    #[test]
    fn an_unknown_version_or_a_bad_manifest_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, dest) = exported(dir.path());
        let path = dest.join(MANIFEST_NAME);
        let text = fs::read_to_string(&path).unwrap();
        fs::write(&path, text.replace("\"format\": 2", "\"format\": 3")).unwrap();
        let fresh = open(&dir.path().join("b"));
        let err = fresh.import(&dest).unwrap_err();
        assert!(matches!(err, Error::ExportFormat { found: 3, .. }), "{err}");
        assert!(err.to_string().contains("reads formats 1 to 2"), "{err}");

        for bad in [
            "{}".to_string(),
            "not json".into(),
            text.replace("\"total_bytes\"", "\"total_bytes_x\""),
            text.replace(EXPORT_KIND, "something-else"),
        ] {
            fs::write(&path, bad).unwrap();
            let err = fresh.import(&dest).unwrap_err();
            assert!(matches!(err, Error::BadExport { .. }), "{err}");
        }
        fs::remove_file(&path).unwrap();
        let err = fresh.import(&dest).unwrap_err();
        assert!(err.to_string().contains("unfinished"), "{err}");
        assert_eq!(fresh.stats().entries, 0);
    }

    #[test]
    fn export_refuses_a_non_empty_destination() {
        let dir = tempfile::tempdir().unwrap();
        let (_, dest) = exported(dir.path());
        let store = open(&dir.path().join("c"));
        let err = store.export(&dest).unwrap_err();
        assert!(matches!(err, Error::ExportDestination { .. }), "{err}");
    }

    #[test]
    fn manifest_parse_bounds_hold() {
        let p = Path::new("m.json");
        let dup = format!(
            r#"{{"format":1,"kind":"{EXPORT_KIND}","created_ms":0,"images":[],"objects":[{{"key":"{k}","size":1}},{{"key":"{k}","size":1}}],"total_bytes":2}}"#,
            k = ChunkKey::of(b"x")
        );
        assert!(matches!(
            ExportManifest::parse(p, dup.as_bytes()),
            Err(Error::BadExport { .. })
        ));
        let long = format!(
            r#"{{"format":1,"kind":"{EXPORT_KIND}","created_ms":0,"images":[{{"reference":"{}","manifest_digest":""}}],"objects":[],"total_bytes":0}}"#,
            "a".repeat(MAX_RECORD_STRING + 1)
        );
        assert!(matches!(
            ExportManifest::parse(p, long.as_bytes()),
            Err(Error::BadExport { .. })
        ));
    }
}
