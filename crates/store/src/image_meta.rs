//! Image metadata blobs: what a node needs besides layer bytes to start an image with no
//! registry (its manifest, the multi-platform index it was resolved from, its config, the
//! ferry index artifact and its index blobs). Whoever fills the store puts them
//! ([`Store::put_metadata`]) and lists them in the image's record
//! ([`ImageRecord::metadata`], each with an opaque role and media type); the store does
//! not parse them.
//!
//! They live apart from the chunk entries (`STORE/metadata/<64 hex>`, named by their
//! SHA-256, i.e. their OCI digest): they are small, and an image that cannot be resolved
//! is worth nothing even with every layer byte present, so they are never evicted for
//! space; one is removed only when no image record lists it any more
//! ([`Store::sweep_metadata`], after a record is replaced and by `ferry store gc`). An
//! export carries those of its image records (`DEST/metadata/<64 hex>`, listed in the
//! manifest's `metadata`), import verifies them like objects, and a seed serves them
//! read-only. Every read hashes the blob against its name (they are read rarely and are
//! small), so a damaged one is refused with [`Error::CorruptMetadata`], never served.
//!
//! [`StoreMetadata`] reads records and blobs without opening the store (no lock, nothing
//! written), so `ferry pull` can use them while the daemon holds the store.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::export::{ImageRecord, MAX_IMAGES, MAX_RECORD_FILE};
use super::{Store, Unservable, open_entry, read_entry};
use crate::diskcache::Durability;
use crate::error::{Error, Result};
use crate::key::ChunkKey;

/// Largest metadata blob kept (a ferry index blob of a very large layer fits).
pub const MAX_METADATA_BYTES: u64 = 256 << 20;
/// Most metadata blobs one image record lists (an index per layer, and a few more).
pub const MAX_METADATA_BLOBS: usize = 2 * super::export::MAX_LAYERS + 16;

/// One metadata blob of an [`ImageRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetadataRecord {
    /// Its digest (the SHA-256 of its bytes).
    pub digest: ChunkKey,
    /// Its size in bytes.
    pub size: u64,
    /// What it is to the image, as its writer names it (`manifest`, `config`, …).
    pub role: String,
    /// Its media type, as the registry gave it.
    #[serde(default)]
    pub media_type: String,
}

/// Which store a record or blob was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetadataOrigin {
    /// The live (writable) store.
    Live,
    /// The read-only seed store.
    Seed,
}

impl std::fmt::Display for MetadataOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MetadataOrigin::Live => "live store",
            MetadataOrigin::Seed => "seed store",
        })
    }
}

/// A metadata blob's file under a store root or an export directory.
pub(crate) fn metadata_path(root: &Path, key: &ChunkKey) -> PathBuf {
    root.join("metadata").join(key.hex())
}

/// What a seed's manifest says about metadata: its image records and blobs.
#[derive(Debug, Default)]
pub(crate) struct SeedMetadata {
    pub(crate) root: PathBuf,
    pub(crate) images: Vec<ImageRecord>,
    pub(crate) blobs: HashMap<ChunkKey, u64>,
}

/// Image records and metadata blobs of a store and its seed, read without opening the
/// store (see the module doc).
#[derive(Debug, Clone)]
pub struct StoreMetadata {
    live: PathBuf,
    seed: Option<Arc<SeedMetadata>>,
}

impl StoreMetadata {
    /// The metadata of the store at `live_root` (which need not exist) and of the seed
    /// export at `seed`, if any (its manifest is read and checked, as a store open does;
    /// [`Error::Seed`] if it is not a usable export).
    pub fn open(live_root: &Path, seed: Option<&Path>) -> Result<StoreMetadata> {
        let seed = seed
            .map(|root| {
                Store::read_export_manifest(root)
                    .map(|m| Arc::new(SeedMetadata::of(root, m)))
                    .map_err(|source| Error::Seed {
                        path: root.to_path_buf(),
                        source: Box::new(source),
                    })
            })
            .transpose()?;
        Ok(StoreMetadata {
            live: live_root.to_path_buf(),
            seed,
        })
    }

    pub(crate) fn with_seed(live_root: &Path, seed: Option<Arc<SeedMetadata>>) -> StoreMetadata {
        StoreMetadata {
            live: live_root.to_path_buf(),
            seed,
        }
    }

    /// Every image record: the live store's, then the seed's for references the live
    /// store has no record of.
    pub fn images(&self) -> Vec<(ImageRecord, MetadataOrigin)> {
        let mut out: Vec<(ImageRecord, MetadataOrigin)> = live_images(&self.live)
            .into_iter()
            .map(|r| (r, MetadataOrigin::Live))
            .collect();
        if let Some(seed) = &self.seed {
            for r in &seed.images {
                if !out.iter().any(|(l, _)| l.reference == r.reference) {
                    out.push((r.clone(), MetadataOrigin::Seed));
                }
            }
        }
        out
    }

    /// The blob `key`, verified: from the live store, else the seed. `None` when neither
    /// has it; [`Error::CorruptMetadata`] when the only copies found are damaged.
    pub fn blob(&self, key: &ChunkKey) -> Result<Option<(Vec<u8>, MetadataOrigin)>> {
        let live_path = metadata_path(&self.live, key);
        let live = read_blob(&live_path, key, None);
        let mut damaged = match live {
            Ok(Some(bytes)) => return Ok(Some((bytes, MetadataOrigin::Live))),
            Ok(None) => None,
            Err(reason) => {
                tracing::warn!(%key, path = %live_path.display(), reason, "damaged metadata blob in the live store");
                Some((live_path, reason))
            }
        };
        if let Some(seed) = &self.seed
            && let Some(&size) = seed.blobs.get(key)
        {
            let path = metadata_path(&seed.root, key);
            match read_blob(&path, key, Some(size)) {
                Ok(Some(bytes)) => return Ok(Some((bytes, MetadataOrigin::Seed))),
                Ok(None) => damaged = Some((path, "missing".into())),
                Err(reason) => {
                    tracing::warn!(%key, path = %path.display(), reason, "damaged metadata blob in the seed store");
                    damaged = Some((path, reason));
                }
            }
        }
        match damaged {
            Some((path, reason)) => Err(Error::CorruptMetadata {
                key: *key,
                path,
                reason,
            }),
            None => Ok(None),
        }
    }
}

impl SeedMetadata {
    pub(crate) fn of(root: &Path, manifest: super::export::ExportManifest) -> SeedMetadata {
        SeedMetadata {
            root: root.to_path_buf(),
            blobs: manifest.metadata.iter().map(|o| (o.key, o.size)).collect(),
            images: manifest.images,
        }
    }
}

/// Reads the blob at `path` whole and checks it is `key`'s bytes (and `size` bytes, when
/// known): `Ok(None)` when there is no file, `Err(why)` when it is not usable.
pub(crate) fn read_blob(
    path: &Path,
    key: &ChunkKey,
    size: Option<u64>,
) -> std::result::Result<Option<Vec<u8>>, String> {
    let file = match open_entry(path) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("unreadable: {e}")),
    };
    let len = match size {
        Some(s) => s,
        None => file
            .metadata()
            .map_err(|e| format!("unreadable: {e}"))?
            .len(),
    };
    if len > MAX_METADATA_BYTES {
        return Err(format!(
            "{len} bytes (a metadata blob is at most {MAX_METADATA_BYTES})"
        ));
    }
    match read_entry(&file, key, len, false) {
        Ok(Ok(bytes)) => Ok(Some(bytes)),
        Ok(Err(Unservable::Corrupt)) => {
            Err("of the wrong size or content (does not hash to its digest)".into())
        }
        Ok(Err(Unservable::Missing)) => Ok(None),
        Err(e) => Err(format!("unreadable: {e}")),
    }
}

/// The live store's image records, sorted by reference; unreadable or malformed ones
/// are skipped (logged).
pub(crate) fn live_images(root: &Path) -> Vec<ImageRecord> {
    read_live_images(root).0
}

/// [`live_images`], and whether every record file was read (none skipped as unreadable
/// or malformed, none past [`MAX_IMAGES`]).
fn read_live_images(root: &Path) -> (Vec<ImageRecord>, bool) {
    let dir = root.join("images");
    let Ok(entries) = fs::read_dir(&dir) else {
        return (Vec::new(), true);
    };
    let files: Vec<fs::DirEntry> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".json")))
        .collect();
    let mut out: Vec<ImageRecord> = files
        .iter()
        .take(MAX_IMAGES)
        .filter_map(|e| {
            let path = e.path();
            let read = File::open(&path).and_then(|f| {
                let mut buf = Vec::new();
                f.take(MAX_RECORD_FILE).read_to_end(&mut buf)?;
                Ok(buf)
            });
            let parsed = read
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<ImageRecord>(&b).map_err(|e| e.to_string()))
                .and_then(|r| r.check().map(|()| r));
            match parsed {
                Ok(r) => Some(r),
                Err(error) => {
                    tracing::warn!(path = %path.display(), error, "unreadable image record skipped");
                    None
                }
            }
        })
        .collect();
    out.sort_by(|a, b| a.reference.cmp(&b.reference));
    let all_read = out.len() == files.len();
    (out, all_read)
}

impl Store {
    /// Keeps `bytes` as a metadata blob (see the module doc) and returns its key (its
    /// digest). Writing the same bytes again replaces the file with an identical one.
    pub fn put_metadata(&self, bytes: &[u8]) -> Result<ChunkKey> {
        if bytes.len() as u64 > MAX_METADATA_BYTES {
            return Err(Error::InvalidRecord(format!(
                "a metadata blob of {} bytes (at most {MAX_METADATA_BYTES})",
                bytes.len()
            )));
        }
        let key = ChunkKey::of(bytes);
        let dir = self.inner.root.join("metadata");
        crate::private_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        let path = metadata_path(&self.inner.root, &key);
        let (temp, ()) = self
            .inner
            .write_temp(|f| std::io::Write::write_all(f, bytes))?;
        temp.commit(&path, Durability::Synced)
            .map_err(|e| Error::io(&path, e))?;
        Ok(key)
    }

    /// Removes the live store's metadata blobs that no image record lists and that were
    /// last written more than `grace` ago; returns how many it removed. Run after a record
    /// is replaced ([`Store::record_image`]): a new tag's manifest and config would
    /// otherwise stay forever (metadata is never evicted). The grace keeps the blobs of a
    /// record still being written: a filler puts them before it records the image, and
    /// putting a blob again rewrites it, so a blob in use by a writer is always recent.
    pub fn sweep_metadata(&self, grace: Duration) -> Result<usize> {
        let dir = self.inner.root.join("metadata");
        let entries = match fs::read_dir(&dir) {
            Ok(it) => it,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(Error::io(&dir, e)),
        };
        let (records, all_read) = read_live_images(&self.inner.root);
        if !all_read {
            // A record that did not parse (or one past the count read) may list blobs:
            // removing nothing is the safe answer.
            tracing::debug!("metadata sweep skipped: not every image record could be read");
            return Ok(0);
        }
        let listed: HashSet<ChunkKey> = records
            .into_iter()
            .flat_map(|r| r.metadata.into_iter().map(|m| m.digest))
            .collect();
        let now = SystemTime::now();
        let mut removed = 0;
        for entry in entries.filter_map(|e| e.ok()) {
            let Some(key) = entry.file_name().to_str().and_then(ChunkKey::from_hex) else {
                continue;
            };
            if listed.contains(&key) {
                continue;
            }
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > grace);
            if !old {
                continue;
            }
            match fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(entry.path(), e)),
            }
        }
        Ok(removed)
    }

    /// The store's image records and metadata blobs, the seed's included.
    pub fn metadata(&self) -> StoreMetadata {
        StoreMetadata::with_seed(
            &self.inner.root,
            self.inner.seed.as_ref().map(|s| s.metadata.clone()),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{LayerRecord, StoreOptions};

    fn options(seed: Option<&Path>) -> StoreOptions {
        StoreOptions {
            max_bytes: Some(64 << 20),
            flush_interval: None,
            pin_grace: Duration::from_secs(60),
            seed: seed.map(Path::to_path_buf),
            ..StoreOptions::default()
        }
    }

    const MANIFEST: &[u8] = br#"{"schemaVersion":2,"layers":[]}"#;
    const CONFIG: &[u8] = br#"{"rootfs":{"diff_ids":[]}}"#;

    /// A store at `dir/a` with one chunk, two metadata blobs and a record listing them.
    fn filled(dir: &Path) -> (Store, ImageRecord) {
        let store = Store::open_with(&dir.join("a"), options(None)).unwrap();
        let chunk = b"layer bytes".to_vec();
        store.put(&ChunkKey::of(&chunk), &chunk).unwrap();
        let manifest = store.put_metadata(MANIFEST).unwrap();
        let config = store.put_metadata(CONFIG).unwrap();
        let record = ImageRecord {
            reference: "reg.local/app:v1".into(),
            manifest_digest: manifest.to_string(),
            layers: vec![LayerRecord {
                digest: ChunkKey::of(&chunk).to_string(),
                size: chunk.len() as u64,
            }],
            coverage: "full".into(),
            recorded_ms: 1,
            metadata: vec![
                MetadataRecord {
                    digest: manifest,
                    size: MANIFEST.len() as u64,
                    role: "manifest".into(),
                    media_type: "application/vnd.oci.image.manifest.v1+json".into(),
                },
                MetadataRecord {
                    digest: config,
                    size: CONFIG.len() as u64,
                    role: "config".into(),
                    media_type: String::new(),
                },
            ],
        };
        store.record_image(&record).unwrap();
        (store, record)
    }

    /// Sets `key`'s blob's modification time `age` into the past.
    fn age_blob(store: &Store, key: &ChunkKey, age: Duration) {
        let f = File::options()
            .write(true)
            .open(metadata_path(store.root(), key))
            .unwrap();
        f.set_modified(SystemTime::now() - age).unwrap();
    }

    #[test]
    fn replacing_a_record_removes_the_old_blobs_nothing_lists() {
        let dir = tempfile::tempdir().unwrap();
        let (store, v1) = filled(dir.path());
        let (old_manifest, config) = (v1.metadata[0].digest, v1.metadata[1].digest);
        // Another image shares the config.
        let mut other = v1.clone();
        other.reference = "reg.local/other:v1".into();
        other.metadata.truncate(1);
        other.metadata[0] = v1.metadata[1].clone();
        store.record_image(&other).unwrap();
        // A blob a filler has put but not yet recorded, and one nothing lists, old.
        let pending = store.put_metadata(b"being recorded").unwrap();
        let stale = store.put_metadata(b"left over").unwrap();
        let hour = Duration::from_secs(2 * 3600);
        for key in [old_manifest, config, stale] {
            age_blob(&store, &key, hour);
        }
        // v2 of the tag: a new manifest, the same config.
        let new_manifest = store.put_metadata(br#"{"schemaVersion":2,"v":2}"#).unwrap();
        let mut v2 = v1.clone();
        v2.metadata[0].digest = new_manifest;
        store.record_image(&v2).unwrap();
        let meta = store.metadata();
        let has = |k: &ChunkKey| meta.blob(k).unwrap().is_some();
        assert!(
            !has(&old_manifest),
            "the replaced manifest is listed by nothing"
        );
        assert!(!has(&stale), "an old blob nothing lists");
        assert!(has(&new_manifest) && has(&config), "listed blobs stay");
        assert!(has(&pending), "a recent blob may be a record being written");
        // A record that does not parse may list anything: nothing is removed then.
        age_blob(&store, &pending, hour);
        fs::write(store.root().join("images").join("damaged.json"), b"{").unwrap();
        store.record_image(&v2).unwrap();
        assert!(has(&pending));
    }

    #[test]
    fn metadata_is_kept_read_back_verified_and_survives_a_reopen_and_gc() {
        let dir = tempfile::tempdir().unwrap();
        let (store, record) = filled(dir.path());
        let key = record.metadata[0].digest;
        assert_eq!(
            store.metadata().blob(&key).unwrap(),
            Some((MANIFEST.to_vec(), MetadataOrigin::Live))
        );
        // Not a chunk entry: eviction cannot take it.
        store.gc_to(0).unwrap();
        assert_eq!(store.stats().entries, 0);
        drop(store);
        let view = StoreMetadata::open(&dir.path().join("a"), None).unwrap();
        assert_eq!(view.images(), vec![(record.clone(), MetadataOrigin::Live)]);
        assert_eq!(view.blob(&key).unwrap().unwrap().0, MANIFEST);
        assert_eq!(view.blob(&ChunkKey::of(b"absent")).unwrap(), None);
        // Too large a blob is refused before anything is written.
        let store = Store::open_with(&dir.path().join("a"), options(None)).unwrap();
        let huge = vec![0u8; usize::try_from(MAX_METADATA_BYTES).unwrap() + 1];
        assert!(matches!(
            store.put_metadata(&huge),
            Err(Error::InvalidRecord(_))
        ));
    }

    #[test]
    fn a_damaged_live_blob_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (store, record) = filled(dir.path());
        let key = record.metadata[1].digest;
        let path = metadata_path(store.root(), &key);
        fs::write(&path, b"{\"rootfs\":{\"diff_ids\":[\"x\"]}}").unwrap();
        let err = store.metadata().blob(&key).unwrap_err();
        assert!(
            matches!(&err, Error::CorruptMetadata { key: k, .. } if *k == key),
            "{err}"
        );
        assert!(err.to_string().contains("does not hash"), "{err}");
        // Putting the right bytes again repairs it.
        store.put_metadata(CONFIG).unwrap();
        assert_eq!(store.metadata().blob(&key).unwrap().unwrap().0, CONFIG);
    }

    #[test]
    fn export_import_and_seed_carry_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let (store, record) = filled(dir.path());
        let export = dir.path().join("export");
        store.export(&export).unwrap();
        let manifest = Store::read_export_manifest(&export).unwrap();
        assert_eq!(manifest.metadata.len(), 2);
        assert_eq!(manifest.images, vec![record.clone()]);

        // Import: the blobs land in the live store, verified.
        let b = Store::open_with(&dir.path().join("b"), options(None)).unwrap();
        let report = b.import(&export).unwrap();
        assert_eq!((report.imported, report.metadata, report.images), (1, 2, 1));
        for m in &record.metadata {
            assert_eq!(
                b.metadata().blob(&m.digest).unwrap().unwrap().1,
                MetadataOrigin::Live
            );
        }

        // Seed: the records and blobs are served from it, read-only.
        let c = Store::open_with(&dir.path().join("c"), options(Some(&export))).unwrap();
        let meta = c.metadata();
        assert_eq!(meta.images(), vec![(record.clone(), MetadataOrigin::Seed)]);
        assert_eq!(
            meta.blob(&record.metadata[0].digest).unwrap(),
            Some((MANIFEST.to_vec(), MetadataOrigin::Seed))
        );
        let view = StoreMetadata::open(&dir.path().join("c"), Some(&export)).unwrap();
        assert_eq!(view.images()[0].1, MetadataOrigin::Seed);
        // A live record of the same reference shadows the seed's.
        c.record_image(&record).unwrap();
        assert_eq!(c.metadata().images()[0].1, MetadataOrigin::Live);
    }

    #[test]
    fn a_corrupt_metadata_blob_refuses_the_import_and_is_refused_from_a_seed() {
        let dir = tempfile::tempdir().unwrap();
        let (store, record) = filled(dir.path());
        let export = dir.path().join("export");
        store.export(&export).unwrap();
        let key = record.metadata[0].digest;
        let victim = metadata_path(&export, &key);
        let mut bytes = fs::read(&victim).unwrap();
        bytes[3] ^= 0xff;
        fs::write(&victim, &bytes).unwrap();

        let root = dir.path().join("b");
        let b = Store::open_with(&root, options(None)).unwrap();
        let err = b.import(&export).unwrap_err();
        assert!(
            matches!(&err, Error::CorruptObject { key: k, .. } if *k == key),
            "{err}"
        );
        assert!(err.to_string().contains("metadata blob"), "{err}");
        assert!(err.to_string().contains("nothing was imported"), "{err}");
        assert_eq!(b.stats().entries, 0);
        assert!(b.images().is_empty());
        assert!(!root.join("metadata").join(key.hex()).exists());

        // As a seed: refused by name, the other blob still served, the seed unchanged.
        let c = Store::open_with(&dir.path().join("c"), options(Some(&export))).unwrap();
        let err = c.metadata().blob(&key).unwrap_err();
        assert!(matches!(&err, Error::CorruptMetadata { .. }), "{err}");
        assert!(err.to_string().contains(&key.to_string()), "{err}");
        assert!(
            c.metadata()
                .blob(&record.metadata[1].digest)
                .unwrap()
                .is_some()
        );
        assert_eq!(fs::read(&victim).unwrap(), bytes);
    }

    #[test]
    fn a_format_1_export_still_reads() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = filled(dir.path());
        let export = dir.path().join("export");
        store.export(&export).unwrap();
        let path = export.join(crate::MANIFEST_NAME);
        let mut doc: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        doc["format"] = 1.into();
        doc.as_object_mut().unwrap().remove("metadata");
        for image in doc["images"].as_array_mut().unwrap() {
            image.as_object_mut().unwrap().remove("metadata");
        }
        fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let b = Store::open_with(&dir.path().join("b"), options(None)).unwrap();
        let report = b.import(&export).unwrap();
        assert_eq!((report.imported, report.metadata, report.images), (1, 0, 1));
        assert!(b.images()[0].metadata.is_empty());
    }
}
