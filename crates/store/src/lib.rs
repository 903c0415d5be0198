//! # ferry-store: the node's chunk store
//!
//! Owns the durable, verified chunk bytes on one node: content-addressed (an entry's key
//! is the SHA-256 of its bytes, so the same bytes are stored once and shared by every
//! layer and image), bounded by `max_bytes` with least-recently-used eviction of entries
//! no live mount pins, crash-safe without fsync on the put path (an entry is written to a
//! temp file and renamed into place, its record follows with the next flush; a process
//! opening the store adopts files without records, drops records without files, and
//! hashes each entry on its first read, so after a kill -9 or a power cut at any moment
//! nothing corrupt is ever served: a damaged entry is dropped and reads as a miss), and
//! reused across daemon restarts. Metadata (sizes, recency, pins) lives in a redb file
//! beside the chunks and is rebuilt from the chunk files if it is lost.
//!
//! It must not fetch anything (no network: ferry-fs fetches and then `put`s) and must not know any format (tar, gzip, indexes): a chunk is opaque bytes and
//! a key. The only bytes it parses are its own metadata, which it treats as possibly
//! damaged: bad records are dropped, never a panic.
//!
//! Pins: a mount pins its hot set with [`Store::pin`] and releases it with
//! [`Store::unpin_owner`]. Pins are persisted; after a restart they stay in force for
//! [`StoreOptions::pin_grace`] so a daemon that re-registers its mounts (calling `pin`
//! again, e.g. after reading [`Store::pinned_keys`]) loses nothing, while pins of mounts
//! that did not come back are dropped once the grace period ends.
//!
//! It also owns the one disk-cache primitive of the node ([`diskcache`]: staging
//! directory, temp files, durability policy, LRU index with pins and reservations),
//! which the chunk store, ferry-fs's file cache and the registry's blob cache are built
//! on; it stays free of any cache's naming, verification or format.
//!
//! Privacy: the store's directories are 0700 and its files 0600 (see [`private_dir`]);
//! a store made with wider modes is tightened when opened.
//!
//! Store images: [`Store::export`] writes every entry, the store's image records
//! ([`Store::record_image`]: opaque names of what filled it) and their metadata blobs to
//! a versioned, self-describing directory, and [`Store::import`] brings one in, every
//! object and blob hashed in staging before any is renamed into place (see `export.rs`).
//!
//! Image metadata ([`Store::put_metadata`], `image_meta.rs`): the manifest, config and
//! index documents an image needs to start without its registry, kept as opaque blobs
//! named by their SHA-256, never evicted, hashed on every read (a damaged one is
//! [`Error::CorruptMetadata`]); [`StoreMetadata`] reads records and blobs (the seed's
//! too) without opening the store, for processes other than the one holding it.
//!
//! Seed store: [`StoreOptions::seed`] (`[store] seed = PATH`) puts a read-only store
//! export under the live store, used in place (see `seed.rs`): reads the live store cannot
//! serve are served from it, each object hashed on its first read, a bad one a counted
//! miss; writes, eviction, gc, verify and export touch only the live store; nothing in
//! the seed's directory is ever written ([`Store::seed_stats`] counts what it served).
//! Its image records and metadata blobs are served read-only the same way.
//!
//! Trust: an entry is hashed on its first read after the store is opened by a process,
//! and trusted for the rest of that process's life (entries it wrote itself are trusted
//! from the start). [`Store::verify_all`] re-hashes everything.

mod clock;
mod config;
pub mod diskcache;
mod error;
mod key;
mod meta;
mod private;
mod store;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{DEFAULT_MAX_BYTES, STORE_ENV, SYSTEM_STORE_PATH, StoreConfig};
pub use error::{Error, Result};
pub use key::{ChunkKey, Hashed};
pub use private::{PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, new_private_file, private_dir, tighten};
pub use store::export::{
    EXPORT_FORMAT, ExportManifest, ExportReport, ImageRecord, ImportReport, LayerRecord,
    MANIFEST_NAME, METADATA_GRACE, OLDEST_EXPORT_FORMAT, ObjectRecord,
};
pub use store::image_meta::{
    MAX_METADATA_BLOBS, MAX_METADATA_BYTES, MetadataOrigin, MetadataRecord, StoreMetadata,
};
pub use store::seed::SeedStats;
pub use store::{
    ChunkFile, EntryInfo, GcReport, OpenReport, OwnerInfo, PutOutcome, Store, StoreOptions,
    StoreStats, VerifyReport,
};

/// Longest pin owner name, in bytes.
pub const MAX_OWNER_LEN: usize = 256;

/// True when `owner` can name a pin owner: not empty and at most [`MAX_OWNER_LEN`]
/// bytes. Callers deriving owner names from longer identifiers must shorten them (e.g.
/// hash them) deterministically, so that a restarted process re-registers the same name.
pub fn valid_owner(owner: &str) -> bool {
    !owner.is_empty() && owner.len() <= MAX_OWNER_LEN
}
