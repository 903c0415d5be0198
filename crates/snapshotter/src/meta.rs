//! Snapshot metadata in one redb file (`metadata.redb` under the root): one record per
//! (namespace, key), plus the id counter that names snapshot directories. Every change is
//! one redb write transaction, so a crash leaves either the old or the new state; a
//! directory created by a transaction that never committed is an orphan `Cleanup` removes.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::remote::RemoteMount;
use crate::usage::Usage;

/// (namespace, key or name) → JSON [`Record`].
const SNAPSHOTS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("snapshots");
/// Counters; `next_id` names the next snapshot directory.
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
const NEXT_ID: &str = "next_id";
/// Largest record accepted from the file (a record holds labels capped by the API).
const MAX_RECORD_LEN: usize = 16 << 20;

/// A snapshot's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only, made by View; never committed.
    View,
    /// Writable, made by Prepare; can be committed.
    Active,
    /// Immutable; can be a parent.
    Committed,
}

impl Kind {
    /// The name containerd's filters use (`kind==committed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// Nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp(pub u128);

impl Stamp {
    pub(crate) fn now() -> Stamp {
        Stamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        )
    }

    /// As a `SystemTime`.
    pub fn system_time(self) -> SystemTime {
        let secs = u64::try_from(self.0 / 1_000_000_000).unwrap_or(u64::MAX);
        let nanos = u32::try_from(self.0 % 1_000_000_000).unwrap_or(0);
        UNIX_EPOCH + Duration::new(secs, nanos)
    }
}

/// What is stored for one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Names the directory `snapshots/<id>`; never reused while the record exists.
    pub id: u64,
    /// State.
    pub kind: Kind,
    /// Parent's name (a committed snapshot of the same namespace), empty for none.
    pub parent: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Creation time.
    pub created: Stamp,
    /// Last change.
    pub updated: Stamp,
    /// Disk use measured when committed (active snapshots are measured on demand).
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Set when the snapshot's directory holds a remote (lazy) mount.
    #[serde(default)]
    pub remote: Option<RemoteMount>,
}

/// The metadata database.
#[derive(Debug)]
pub struct Metadata {
    db: Database,
}

/// A write transaction over the metadata; nothing is visible until [`Txn::commit`].
pub struct Txn {
    txn: redb::WriteTransaction,
}

impl std::fmt::Debug for Txn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Txn")
    }
}

impl Metadata {
    /// Opens or creates the database file.
    pub fn open(path: &Path) -> Result<Metadata> {
        let db = Database::create(path).map_err(Error::db)?;
        let txn = db.begin_write().map_err(Error::db)?;
        txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        txn.open_table(COUNTERS).map_err(Error::db)?;
        txn.commit().map_err(Error::db)?;
        Ok(Metadata { db })
    }

    /// Starts a write transaction (redb serializes writers).
    pub fn write(&self) -> Result<Txn> {
        Ok(Txn {
            txn: self.db.begin_write().map_err(Error::db)?,
        })
    }

    /// The record for `key` in `ns`.
    pub fn get(&self, ns: &str, key: &str) -> Result<Option<Record>> {
        let txn = self.db.begin_read().map_err(Error::db)?;
        let table = txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        let value = table.get((ns, key)).map_err(Error::db)?;
        value.map(|v| decode(v.value())).transpose()
    }

    /// Every record of `ns` (`None`: of every namespace), as (namespace, key, record).
    pub fn list(&self, ns: Option<&str>) -> Result<Vec<(String, String, Record)>> {
        let txn = self.db.begin_read().map_err(Error::db)?;
        let table = txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        let mut out = Vec::new();
        let iter = match ns {
            Some(ns) => table.range((ns, "")..).map_err(Error::db)?,
            None => table.iter().map_err(Error::db)?,
        };
        for item in iter {
            let (k, v) = item.map_err(Error::db)?;
            let (entry_ns, key) = k.value();
            if ns.is_some_and(|ns| ns != entry_ns) {
                break;
            }
            out.push((entry_ns.to_owned(), key.to_owned(), decode(v.value())?));
        }
        Ok(out)
    }
}

impl Txn {
    /// The record for `key` in `ns`, as this transaction sees it.
    pub fn get(&self, ns: &str, key: &str) -> Result<Option<Record>> {
        let table = self.txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        let value = table.get((ns, key)).map_err(Error::db)?;
        value.map(|v| decode(v.value())).transpose()
    }

    /// Whether any snapshot of `ns` has `parent` as its parent.
    pub fn has_children(&self, ns: &str, parent: &str) -> Result<bool> {
        let table = self.txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        for item in table.range((ns, "")..).map_err(Error::db)? {
            let (k, v) = item.map_err(Error::db)?;
            if k.value().0 != ns {
                break;
            }
            if decode(v.value())?.parent == parent {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Stores `record` under `key` in `ns`.
    pub fn put(&self, ns: &str, key: &str, record: &Record) -> Result<()> {
        let bytes = serde_json::to_vec(record).map_err(Error::db)?;
        let mut table = self.txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        table
            .insert((ns, key), bytes.as_slice())
            .map_err(Error::db)?;
        Ok(())
    }

    /// Deletes `key` in `ns`.
    pub fn delete(&self, ns: &str, key: &str) -> Result<()> {
        let mut table = self.txn.open_table(SNAPSHOTS).map_err(Error::db)?;
        table.remove((ns, key)).map_err(Error::db)?;
        Ok(())
    }

    /// Takes the next directory id.
    pub fn next_id(&self) -> Result<u64> {
        let mut table = self.txn.open_table(COUNTERS).map_err(Error::db)?;
        let id = table
            .get(NEXT_ID)
            .map_err(Error::db)?
            .map_or(1, |v| v.value());
        table
            .insert(NEXT_ID, id.saturating_add(1))
            .map_err(Error::db)?;
        Ok(id)
    }

    /// Makes the changes durable.
    pub fn commit(self) -> Result<()> {
        self.txn.commit().map_err(Error::db)
    }
}

fn decode(bytes: &[u8]) -> Result<Record> {
    if bytes.len() > MAX_RECORD_LEN {
        return Err(Error::Metadata(format!(
            "record of {} bytes is larger than {MAX_RECORD_LEN}",
            bytes.len()
        )));
    }
    serde_json::from_slice(bytes).map_err(|e| Error::Metadata(format!("bad record: {e}")))
}
