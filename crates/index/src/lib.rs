//! # ferry-index: seekable layer formats
//!
//! This crate owns everything about the bytes of a layer: walking tar streams
//! ([`tarwalk`], the one tar reader: `ferry pull`'s unpacker uses it too), building and reading the ferry index over an unmodified gzip layer
//! ([`zran`] checkpoints + [`ferryidx`] file format), reading and writing eStargz
//! ([`estargz`]), reading SOCI zTOCs into ferry indexes (and writing them for tests,
//! [`soci`]), answering "bytes `[off, off+len)` of file F" over any of them while
//! fetching only the compressed ranges needed ([`reader`]), the merged view of an image's
//! layers with whiteouts applied ([`merged`]), packing a directory straight into a
//! lazy-loadable layer ([`pack`]), and reading what an ELF file's loader needs
//! ([`elf`]: the indexer records each file's libraries with it, ferry-fs follows them).
//!
//! It must not touch the network or mounts, or keep global state; its file I/O is only
//! on paths a caller names (blob files of an OCI layout through [`source::FileSource`]
//! and [`image`], the directory [`pack`] reads). Everything parsed here comes from
//! strangers, so every parser is bounded and returns [`Error`], never panics.
//!
//! [`inflated`] keeps its own small LRU rather than the cache crate the registry uses
//! (quick_cache): it needs two bounds of its own (spans and windows, a window never
//! costing a span), an idle release that drops what a burst stopped using, and strict
//! recency; the crate offers one weight bound and its own eviction order, and the map
//! holds tens of entries behind one short lock, so a port would add no speed.

pub mod elf;
pub mod entry;
pub mod error;
pub mod estargz;
pub mod ferryidx;
pub mod image;
pub mod indexer;
pub mod inflated;
pub mod merged;
pub mod pack;
pub mod reader;
mod rfc3339;
pub mod soci;
pub mod source;
pub mod tarwalk;
pub mod windows;
pub mod zran;

pub use entry::{Entry, EntryKind, Whiteout};
pub use error::{Error, Result};
