//! The ferry index: the in-memory model and the versioned binary format.
//!
//! A ferry index describes one unmodified layer blob (gzip or plain tar) so that any
//! byte range of any file can be read by fetching only a few compressed ranges:
//!
//! * the file table: every tar entry with its metadata and uncompressed data offset;
//! * inflate checkpoints roughly every `span_size` bytes of uncompressed output, each
//!   able to restart decompression (bit offset + 32 KiB window);
//! * one SHA-256 per span over the span's compressed bytes, so every fetched piece is
//!   verified on its own.
//!
//! The byte layout is documented in `docs/formats.md`; encoding is deterministic.

use crate::entry::Entry;

/// How the indexed layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain tar: uncompressed offsets are blob offsets; no checkpoints are needed.
    None,
    /// gzip, single- or multi-member.
    Gzip,
}

/// A point where inflation can restart.
///
/// Span `i` runs from checkpoint `i` to checkpoint `i + 1` (the last one to the end of
/// the blob). Its compressed bytes are `[start_byte(i), in_offset(i + 1))`, or to the end
/// of the blob for the last span; two neighbouring spans may share one byte when the
/// later checkpoint starts mid-byte.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Checkpoint {
    /// Offset in the compressed blob where inflation resumes. For a member-start
    /// checkpoint this is the first byte of the gzip member *header*; otherwise it is the
    /// first whole byte of deflate data after the bit position.
    pub in_offset: u64,
    /// Bits (0..=7) of the byte at `in_offset - 1` that still belong to the next block;
    /// 0 means inflation starts exactly at `in_offset`.
    pub bits: u8,
    /// Offset in the uncompressed stream that this checkpoint resumes at.
    pub out_offset: u64,
    /// True when `in_offset` is the start of a gzip member: inflation parses the header
    /// and needs no window.
    pub member_start: bool,
    /// The (up to) 32 KiB of uncompressed history before `out_offset`, compressed as raw
    /// deflate. Empty for member starts.
    pub window_deflate: Vec<u8>,
}

impl Checkpoint {
    /// First compressed byte a reader must fetch to resume here.
    pub fn start_byte(&self) -> u64 {
        if self.bits > 0 { self.in_offset.saturating_sub(1) } else { self.in_offset }
    }
}

/// A ferry index of one layer blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerIndex {
    /// Digest of the indexed blob, `sha256:<hex>`.
    pub layer_digest: String,
    /// Compression of the blob.
    pub compression: Compression,
    /// Size of the blob in bytes.
    pub compressed_size: u64,
    /// Size of the uncompressed tar stream in bytes.
    pub uncompressed_size: u64,
    /// Target span size in uncompressed bytes the checkpoints were placed by.
    pub span_size: u64,
    /// Checkpoints in increasing `out_offset` order; the first is at offset 0.
    /// Empty for `Compression::None`.
    pub checkpoints: Vec<Checkpoint>,
    /// SHA-256 of each span's compressed bytes, one per checkpoint.
    pub span_digests: Vec<[u8; 32]>,
    /// The file table in tar order.
    pub entries: Vec<Entry>,
}

impl LayerIndex {
    /// Compressed byte range of span `i`.
    pub fn span_range(&self, i: usize) -> Option<std::ops::Range<u64>> {
        let cp = self.checkpoints.get(i)?;
        let end = match self.checkpoints.get(i + 1) {
            Some(next) => next.in_offset,
            None => self.compressed_size,
        };
        Some(cp.start_byte()..end)
    }

    /// Index of the span holding uncompressed offset `off`.
    pub fn span_for(&self, off: u64) -> Option<usize> {
        if self.checkpoints.is_empty() || off >= self.uncompressed_size {
            return None;
        }
        Some(self.checkpoints.partition_point(|c| c.out_offset <= off).saturating_sub(1))
    }
}
