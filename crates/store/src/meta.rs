//! The store's metadata file (`meta.redb`): one record per entry, the persisted pins, and
//! a few settings.
//!
//! The metadata is a cache of facts the chunk files already carry (their names are their
//! hashes, their lengths their sizes) plus recency and pins, so losing it costs recency,
//! not data. That is why a metadata file that cannot be opened or read is moved aside and
//! rebuilt from the files rather than trusted or fatal, and why every record is decoded
//! defensively: a bad record is dropped, never a panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use redb::{
    Builder, Database, DatabaseError, MultimapTableDefinition, ReadableDatabase,
    ReadableMultimapTable, ReadableTable, StorageError, TableDefinition,
};

use crate::error::{Error, Result};
use crate::key::ChunkKey;

/// Entry records: raw 32-byte key → encoded [`Record`].
pub(crate) const ENTRIES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
/// Pins: owner → raw 32-byte keys.
pub(crate) const PINS: MultimapTableDefinition<&str, &[u8]> = MultimapTableDefinition::new("pins");
/// Settings: name → value.
pub(crate) const SETTINGS: TableDefinition<&str, u64> = TableDefinition::new("settings");

/// Setting: metadata format version.
pub(crate) const SETTING_FORMAT: &str = "format";
/// Setting: the bound the store was last opened with.
pub(crate) const SETTING_MAX_BYTES: &str = "max_bytes";

/// The metadata format this build writes and reads.
pub(crate) const FORMAT_VERSION: u64 = 1;

/// Memory redb may use for its page cache; the metadata is small.
const DB_CACHE_BYTES: usize = 16 << 20;

const RECORD_VERSION: u8 = 1;
const RECORD_LEN: usize = 1 + 8 * 4;

/// What the metadata knows about one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    /// Length of the chunk in bytes.
    pub size: u64,
    /// Wall time of the last access (ms since the epoch); 0 when unknown.
    pub last_access_ms: u64,
    /// Logical recency: larger is more recent.
    pub tick: u64,
    /// Wall time the content was last hashed and found good; 0 when never.
    pub verified_at_ms: u64,
}

impl Record {
    pub(crate) fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        out[0] = RECORD_VERSION;
        for (i, v) in [
            self.size,
            self.last_access_ms,
            self.tick,
            self.verified_at_ms,
        ]
        .into_iter()
        .enumerate()
        {
            out[1 + i * 8..9 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Decodes a record; `None` for anything this build did not write.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Record> {
        if bytes.len() != RECORD_LEN || bytes.first() != Some(&RECORD_VERSION) {
            return None;
        }
        let field = |i: usize| -> Option<u64> {
            let raw: [u8; 8] = bytes.get(1 + i * 8..9 + i * 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(raw))
        };
        Some(Record {
            size: field(0)?,
            last_access_ms: field(1)?,
            tick: field(2)?,
            verified_at_ms: field(3)?,
        })
    }
}

/// Everything read from the metadata at open.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    pub records: Vec<(ChunkKey, Record)>,
    /// Raw keys of records that could not be decoded (to delete).
    pub bad_records: Vec<Vec<u8>>,
    pub pins: Vec<(String, ChunkKey)>,
    /// Pins whose key could not be decoded (to delete).
    pub bad_pins: Vec<(String, Vec<u8>)>,
    pub format: Option<u64>,
    pub max_bytes: Option<u64>,
}

/// Opens (or creates) the metadata file. A file redb cannot open is moved aside and a
/// fresh one created; `true` in the result says so. Another process holding it is
/// [`Error::InUse`].
pub(crate) fn open(root: &Path, db_path: &Path) -> Result<(Database, bool)> {
    match try_open(db_path) {
        Ok(db) => Ok((db, false)),
        Err(OpenFailure::InUse) => Err(Error::InUse {
            path: root.to_path_buf(),
        }),
        Err(OpenFailure::Io(e)) => Err(Error::io(db_path, e)),
        Err(OpenFailure::Unusable(why)) => {
            let moved = quarantine(db_path)?;
            tracing::warn!(
                metadata = %db_path.display(),
                moved_to = %moved.display(),
                reason = %why,
                "store metadata unusable; rebuilding it from the chunk files"
            );
            match try_open(db_path) {
                Ok(db) => Ok((db, true)),
                Err(OpenFailure::InUse) => Err(Error::InUse {
                    path: root.to_path_buf(),
                }),
                Err(OpenFailure::Io(e)) => Err(Error::io(db_path, e)),
                Err(OpenFailure::Unusable(why)) => Err(Error::io(
                    db_path,
                    std::io::Error::other(format!("fresh metadata file unusable: {why}")),
                )),
            }
        }
    }
}

/// Moves an unusable metadata file aside (kept for inspection) and returns where.
pub(crate) fn quarantine(db_path: &Path) -> Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let mut name = db_path.as_os_str().to_owned();
    name.push(format!(".corrupt-{stamp}"));
    let moved = PathBuf::from(name);
    std::fs::rename(db_path, &moved).map_err(|e| Error::io(db_path, e))?;
    Ok(moved)
}

enum OpenFailure {
    InUse,
    Io(std::io::Error),
    Unusable(String),
}

fn try_open(db_path: &Path) -> std::result::Result<Database, OpenFailure> {
    let opened = catch_unwind(AssertUnwindSafe(|| {
        Builder::new()
            .set_cache_size(DB_CACHE_BYTES)
            // Verifies page checksums instead of trusting (and possibly panicking on) a
            // file altered behind redb's back; the metadata is small, so this is cheap.
            .set_check_integrity_on_open(true)
            .create(db_path)
    }));
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(DatabaseError::DatabaseAlreadyOpen)) => Err(OpenFailure::InUse),
        // redb reports a file that is not a redb database as InvalidData.
        Ok(Err(DatabaseError::Storage(StorageError::Io(e))))
            if e.kind() != std::io::ErrorKind::InvalidData =>
        {
            Err(OpenFailure::Io(e))
        }
        Ok(Err(e)) => Err(OpenFailure::Unusable(e.to_string())),
        Err(_) => Err(OpenFailure::Unusable("redb panicked opening it".into())),
    }
}

/// Creates the tables if missing and reads everything. A storage error here means the
/// file is damaged in a way the open did not notice: the caller rebuilds.
pub(crate) fn load(db: &Database) -> Result<Loaded> {
    catch_unwind(AssertUnwindSafe(|| load_inner(db))).unwrap_or_else(|_| {
        Err(Error::Metadata(redb::Error::Corrupted(
            "redb panicked reading the metadata".into(),
        )))
    })
}

fn load_inner(db: &Database) -> Result<Loaded> {
    let txn = db.begin_write().map_err(Error::db)?;
    {
        txn.open_table(ENTRIES).map_err(Error::db)?;
        txn.open_multimap_table(PINS).map_err(Error::db)?;
        txn.open_table(SETTINGS).map_err(Error::db)?;
    }
    txn.commit().map_err(Error::db)?;

    let mut loaded = Loaded::default();
    let txn = db.begin_read().map_err(Error::db)?;
    let entries = txn.open_table(ENTRIES).map_err(Error::db)?;
    for item in entries.iter().map_err(Error::db)? {
        let (k, v) = item.map_err(Error::db)?;
        match (ChunkKey::from_slice(k.value()), Record::decode(v.value())) {
            (Some(key), Some(rec)) => loaded.records.push((key, rec)),
            _ => loaded.bad_records.push(k.value().to_vec()),
        }
    }
    let pins = txn.open_multimap_table(PINS).map_err(Error::db)?;
    for item in pins.iter().map_err(Error::db)? {
        let (owner, values) = item.map_err(Error::db)?;
        let owner = owner.value().to_string();
        for v in values {
            let v = v.map_err(Error::db)?;
            match ChunkKey::from_slice(v.value()) {
                Some(key) if crate::valid_owner(&owner) => loaded.pins.push((owner.clone(), key)),
                _ => loaded.bad_pins.push((owner.clone(), v.value().to_vec())),
            }
        }
    }
    let settings = txn.open_table(SETTINGS).map_err(Error::db)?;
    loaded.format = settings
        .get(SETTING_FORMAT)
        .map_err(Error::db)?
        .map(|v| v.value());
    loaded.max_bytes = settings
        .get(SETTING_MAX_BYTES)
        .map_err(Error::db)?
        .map(|v| v.value());
    Ok(loaded)
}

/// True when a metadata error means the file is damaged (rebuild) rather than the disk
/// failing (report).
pub(crate) fn is_corruption(e: &Error) -> bool {
    matches!(
        e,
        Error::Metadata(
            redb::Error::Corrupted(_)
                | redb::Error::TableTypeMismatch { .. }
                | redb::Error::TypeDefinitionChanged { .. }
                | redb::Error::TableIsMultimap(_)
                | redb::Error::TableIsNotMultimap(_)
                | redb::Error::ValueTooLarge(_)
        )
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_rejects_foreign_bytes() {
        let r = Record {
            size: 1 << 40,
            last_access_ms: 7,
            tick: u64::MAX,
            verified_at_ms: 0,
        };
        assert_eq!(Record::decode(&r.encode()), Some(r));
        let mut wrong_version = r.encode();
        wrong_version[0] = 9;
        assert_eq!(Record::decode(&wrong_version), None);
        assert_eq!(Record::decode(&r.encode()[..RECORD_LEN - 1]), None);
        assert_eq!(Record::decode(&[]), None);
    }
}
