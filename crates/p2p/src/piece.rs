//! Piece identity: a blob digest and an index into the blob's fixed-size pieces.

use std::ops::Range;

use ferry_oci::Digest;
use sha2::{Digest as _, Sha256};

/// One piece of a blob: bytes `[index × piece_size, (index + 1) × piece_size)` of the
/// blob `blob` (the last piece is shorter). Keyed by digest, never by URL or repository,
/// so the same bytes are one piece whichever image or registry names them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PieceId {
    /// The blob (a layer, or an index blob) the piece is part of.
    pub blob: Digest,
    /// The piece's position in the blob, from 0.
    pub index: u32,
}

impl PieceId {
    /// The piece `index` of `blob`.
    pub fn new(blob: Digest, index: u32) -> PieceId {
        PieceId { blob, index }
    }

    /// The 64-bit key rendezvous hashing ranks members by for this piece. SHA-256 so
    /// every node, whatever its build, derives the same key (std's hashers are seeded).
    pub fn key(&self) -> u64 {
        let mut h = Sha256::new();
        h.update(self.blob.to_string().as_bytes());
        h.update([0]);
        h.update(self.index.to_be_bytes());
        first_u64(&h.finalize())
    }

    /// The key of the whole blob, for schedules that rank members once per blob.
    pub fn blob_key(&self) -> u64 {
        blob_key(&self.blob)
    }

    /// The byte range the piece covers in a blob of `blob_size` bytes, or `None` when
    /// the index lies past the end (or `piece_size` is 0).
    pub fn range(&self, piece_size: u64, blob_size: u64) -> Option<Range<u64>> {
        let start = u64::from(self.index).checked_mul(piece_size)?;
        if piece_size == 0 || start >= blob_size {
            return None;
        }
        Some(start..start.saturating_add(piece_size).min(blob_size))
    }
}

/// The rendezvous key of a blob.
pub fn blob_key(blob: &Digest) -> u64 {
    first_u64(&Sha256::digest(blob.to_string().as_bytes()))
}

/// How many pieces of `piece_size` bytes a blob of `blob_size` bytes has (0 for an
/// empty blob or a zero piece size).
pub fn piece_count(blob_size: u64, piece_size: u64) -> u64 {
    if piece_size == 0 {
        return 0;
    }
    blob_size.div_ceil(piece_size)
}

pub(crate) fn first_u64(bytes: &[u8]) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(raw)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn blob(name: &str) -> Digest {
        ferry_oci::sha256_digest(name.as_bytes())
    }

    #[test]
    fn ranges_cover_the_blob_once() {
        let size = 10 * 1024 + 7;
        let n = piece_count(size, 1024);
        assert_eq!(n, 11);
        let mut next = 0;
        for i in 0..n {
            let r = PieceId::new(blob("a"), i as u32).range(1024, size).unwrap();
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert_eq!(next, size);
        assert!(PieceId::new(blob("a"), 11).range(1024, size).is_none());
        assert!(PieceId::new(blob("a"), 0).range(0, size).is_none());
    }

    #[test]
    fn keys_differ_by_blob_and_index_and_are_stable() {
        let a0 = PieceId::new(blob("a"), 0);
        assert_eq!(a0.key(), PieceId::new(blob("a"), 0).key());
        assert_ne!(a0.key(), PieceId::new(blob("a"), 1).key());
        assert_ne!(a0.key(), PieceId::new(blob("b"), 0).key());
        assert_eq!(a0.blob_key(), PieceId::new(blob("a"), 9).blob_key());
    }
}
