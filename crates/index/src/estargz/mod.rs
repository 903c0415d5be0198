//! eStargz: reading and writing the seekable tar.gz of stargz-snapshotter.
//!
//! # The format (stargz-snapshotter `docs/estargz.md`, `estargz/types.go`)
//!
//! An eStargz blob is an ordinary `tar.gz` made of many concatenated gzip members, so any
//! gzip reader sees one tar stream. Member boundaries are placed so that every piece of
//! regular-file data can be inflated on its own:
//!
//! * a member starts at offset 0, at the first byte of each non-empty regular file's data,
//!   and at every `chunk_size` bytes inside a large file (default 4 MiB);
//! * the data member of a file also carries the tar padding after the data and the tar
//!   headers of the entries that follow, up to and including the header of the next
//!   non-empty regular file (this is what stargz's own writer does: it closes the current
//!   member just before a file's data, never before a header);
//! * the last tar entry, `stargz.index.json` (the *TOC*), is in a member of its own
//!   together with the tar end-of-archive blocks;
//! * the blob ends with a 51-byte *footer*: an empty gzip member whose header has an
//!   `FEXTRA` subfield `'S','G'` holding `"%016x" (TOC offset) + "STARGZ"` (the legacy
//!   stargz footer is 47 bytes: the same string as the whole extra field).
//!
//! The TOC is `{"version":1,"entries":[...]}`: one entry per tar member (`dir`, `reg`,
//! `symlink`, `hardlink`, `char`, `block`, `fifo`) plus one `chunk` entry for every chunk
//! of a file after its first. Data entries carry `offset` (compressed offset of the member
//! holding the chunk), `innerOffset` (where the chunk starts in that member's inflated
//! bytes; lets several chunks share a member), `chunkOffset`, `chunkSize` (0 = to the end
//! of the file) and `chunkDigest` (sha256 of the chunk). The layer descriptor carries
//! `containerd.io/snapshot/stargz/toc.digest` (sha256 of the TOC JSON bytes), which makes
//! the TOC, and through it every chunk, verifiable.
//!
//! Prioritized files come first, followed by a `.prefetch.landmark` regular file (one
//! byte `0xf`); without priorities the layer starts with `.no.prefetch.landmark`.
//!
//! # In this module
//!
//! * [`EstargzLayer`]: the reader. It fetches only the footer and the TOC to open a
//!   layer, then, per read, only the members holding the chunks asked for, and verifies
//!   every chunk against its `chunkDigest`.
//! * [`convert`]: the writer, one uncompressed tar stream in, one eStargz blob out,
//!   compressing members in parallel with a bounded pipeline.
//! * [`zstd_chunked`]: the same TOC model over zstd frames (containers/storage's
//!   zstd:chunked), read by [`EstargzLayer::open_zstd_chunked`] and written by
//!   [`zstd_chunked::convert`].

mod footer;
mod reader;
mod toc;
mod writer;
pub mod zstd_chunked;

#[cfg(test)]
mod tests;

pub use footer::{FOOTER_SIZE, LEGACY_FOOTER_SIZE, footer_bytes, parse_footer};
pub use reader::{Codec, EstargzLayer};
pub use writer::{
    DEFAULT_LEVEL, EstargzOptions, EstargzOutput, MAX_CHUNK_SIZE, PRIORITY_BUFFER_MAX, convert,
};

/// Name of the TOC tar entry.
pub const TOC_TAR_NAME: &str = "stargz.index.json";
/// Name of the landmark that ends the prioritized files.
pub const PREFETCH_LANDMARK: &str = ".prefetch.landmark";
/// Name of the landmark of a layer without prioritized files.
pub const NO_PREFETCH_LANDMARK: &str = ".no.prefetch.landmark";
/// Content of a landmark file.
pub const LANDMARK_CONTENTS: u8 = 0xf;
/// Layer descriptor annotation holding the TOC digest.
pub const TOC_DIGEST_ANNOTATION: &str = "containerd.io/snapshot/stargz/toc.digest";
/// Layer descriptor annotation holding the uncompressed size of the layer.
pub const UNCOMPRESSED_SIZE_ANNOTATION: &str = "io.containers.estargz.uncompressed-size";
/// Default chunk size for large files (stargz's default).
pub const DEFAULT_CHUNK_SIZE: u64 = 4 << 20;

/// Largest compressed TOC member [`EstargzLayer::open`] will fetch.
pub const MAX_TOC_COMPRESSED: u64 = 256 << 20;
/// Largest TOC JSON [`EstargzLayer::open`] will inflate (256 MiB, roughly a million
/// files).
pub const MAX_TOC_JSON: u64 = 256 << 20;
/// Most TOC entries (files, directories, links and chunks) [`EstargzLayer::open`] accepts.
pub const MAX_TOC_ENTRIES: usize = 2_000_000;
