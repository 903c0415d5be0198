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
        if self.bits > 0 {
            self.in_offset.saturating_sub(1)
        } else {
            self.in_offset
        }
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
        Some(
            self.checkpoints
                .partition_point(|c| c.out_offset <= off)
                .saturating_sub(1),
        )
    }
}

// ---------------------------------------------------------------------------------------
// Binary encoding (see docs/formats.md for the byte-by-byte description).

use crate::entry::EntryKind;
use crate::error::{Error, Result};
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;

/// First bytes of every ferry index blob.
pub const MAGIC: &[u8; 8] = b"FERRYIDX";
/// The format version this build writes and reads.
pub const VERSION: u16 = 1;
/// Largest index blob ferry will decode.
pub const MAX_INDEX_BYTES: usize = 1 << 30;
/// Largest stored (deflated) window: a 32 KiB window never deflates to more than this.
const MAX_WINDOW_DEFLATE: usize = 40 << 10;
/// Longest path, link target or user/group name accepted.
const MAX_STRING: usize = 64 << 10;
/// Longest xattr value accepted.
const MAX_XATTR_VALUE: usize = 1 << 20;
const HEADER_LEN: usize = 80;
/// zstd level of the file table: deterministic for a given zstd, fast enough for 1M entries.
const TABLE_ZSTD_LEVEL: i32 = 9;
/// Smallest possible encoded checkpoint and entry, used to bound counts before allocating.
const MIN_CHECKPOINT_LEN: usize = 8 + 8 + 1 + 1 + 4 + 32;
const MIN_ENTRY_LEN: usize = 1 + 4 * 3 + 8 + 4 + 8 * 3 + 4 * 2 + 4 * 4 + 4;

fn compression_code(c: Compression) -> u8 {
    match c {
        Compression::None => 0,
        Compression::Gzip => 1,
    }
}

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s);
}

impl LayerIndex {
    /// Encodes the index in the versioned binary format. Deterministic: the same index
    /// always gives the same bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let raw_digest = parse_digest_raw(&self.layer_digest)?;
        if self.span_digests.len() != self.checkpoints.len() {
            return Err(Error::Index(
                "one span digest per checkpoint is required".into(),
            ));
        }
        let mut out = Vec::with_capacity(
            HEADER_LEN + self.checkpoints.len() * 16_000 + self.entries.len() * 96,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(compression_code(self.compression));
        out.push(0);
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&raw_digest);
        out.extend_from_slice(&self.compressed_size.to_le_bytes());
        out.extend_from_slice(&self.uncompressed_size.to_le_bytes());
        out.extend_from_slice(&self.span_size.to_le_bytes());
        out.extend_from_slice(&(self.checkpoints.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (cp, digest) in self.checkpoints.iter().zip(&self.span_digests) {
            out.extend_from_slice(&cp.in_offset.to_le_bytes());
            out.extend_from_slice(&cp.out_offset.to_le_bytes());
            out.push(cp.bits);
            out.push(u8::from(cp.member_start));
            put_str(&mut out, &cp.window_deflate);
            out.extend_from_slice(digest);
        }
        // The file table compresses well (paths share prefixes); windows do not.
        let mut table = Vec::with_capacity(self.entries.len() * 96);
        for e in &self.entries {
            table.push(e.kind.code());
            table.extend_from_slice(&e.mode.to_le_bytes());
            table.extend_from_slice(&e.uid.to_le_bytes());
            table.extend_from_slice(&e.gid.to_le_bytes());
            table.extend_from_slice(&e.mtime.to_le_bytes());
            table.extend_from_slice(&e.mtime_nsec.to_le_bytes());
            table.extend_from_slice(&e.size.to_le_bytes());
            table.extend_from_slice(&e.offset.to_le_bytes());
            table.extend_from_slice(&e.header_offset.to_le_bytes());
            table.extend_from_slice(&e.dev_major.to_le_bytes());
            table.extend_from_slice(&e.dev_minor.to_le_bytes());
            put_str(&mut table, e.path.as_bytes());
            put_str(&mut table, e.link_target.as_bytes());
            put_str(&mut table, e.uname.as_bytes());
            put_str(&mut table, e.gname.as_bytes());
            table.extend_from_slice(&(e.xattrs.len() as u32).to_le_bytes());
            for (k, v) in &e.xattrs {
                put_str(&mut table, k.as_bytes());
                put_str(&mut table, v);
            }
        }
        let packed = zstd::bulk::compress(&table, TABLE_ZSTD_LEVEL)
            .map_err(|e| Error::Index(format!("compressing the file table: {e}")))?;
        out.extend_from_slice(&(table.len() as u64).to_le_bytes());
        out.extend_from_slice(&(packed.len() as u64).to_le_bytes());
        out.extend_from_slice(&packed);
        let trailer = Sha256::digest(&out);
        out.extend_from_slice(&trailer);
        Ok(out)
    }

    /// Decodes and validates an index blob. Every count and length is checked against the
    /// bytes actually present before anything is allocated, and the structure is checked
    /// for consistency (monotonic checkpoints, file data inside the stream, clean paths).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > MAX_INDEX_BYTES {
            return Err(Error::Index(format!(
                "index is {} bytes, more than the {MAX_INDEX_BYTES} allowed",
                bytes.len()
            )));
        }
        if bytes.len() < HEADER_LEN + 32 || &bytes[..8] != MAGIC {
            return Err(Error::Index(
                "not a ferry index (bad magic or too short)".into(),
            ));
        }
        let (body, trailer) = bytes.split_at(bytes.len() - 32);
        if Sha256::digest(body).as_slice() != trailer {
            return Err(Error::Index(
                "checksum mismatch: the index is corrupt or truncated".into(),
            ));
        }
        let mut r = Cursor { buf: body, pos: 8 };
        let version = r.u16()?;
        if version != VERSION {
            return Err(Error::Index(format!(
                "format version {version} is not supported (this ferry reads {VERSION})"
            )));
        }
        let compression = match r.u8()? {
            0 => Compression::None,
            1 => Compression::Gzip,
            c => return Err(Error::Index(format!("unknown compression code {c}"))),
        };
        let _reserved = r.u8()?;
        let _flags = r.u32()?;
        let digest_raw = r.take(32)?;
        let layer_digest = format!("sha256:{}", hex::encode(digest_raw));
        let compressed_size = r.u64()?;
        let uncompressed_size = r.u64()?;
        let span_size = r.u64()?;
        let n_checkpoints = r.count(MIN_CHECKPOINT_LEN, "checkpoints")?;
        let n_entries = r.u32()? as usize;
        let mut checkpoints = Vec::with_capacity(n_checkpoints);
        let mut span_digests = Vec::with_capacity(n_checkpoints);
        for i in 0..n_checkpoints {
            let in_offset = r.u64()?;
            let out_offset = r.u64()?;
            let bits = r.u8()?;
            let member_start = match r.u8()? {
                0 => false,
                1 => true,
                f => return Err(Error::Index(format!("checkpoint {i}: bad flags {f}"))),
            };
            let window = r.bytes(MAX_WINDOW_DEFLATE, "window")?.to_vec();
            let mut digest = [0u8; 32];
            digest.copy_from_slice(r.take(32)?);
            checkpoints.push(Checkpoint {
                in_offset,
                bits,
                out_offset,
                member_start,
                window_deflate: window,
            });
            span_digests.push(digest);
        }
        let table_len = r.u64()?;
        let packed_len = r.u64()?;
        if table_len > MAX_INDEX_BYTES as u64 || packed_len > r.remaining() as u64 {
            return Err(Error::Index(format!(
                "file table of {table_len} bytes ({packed_len} compressed) cannot be right"
            )));
        }
        let packed = r.take(packed_len as usize)?;
        if r.remaining() != 0 {
            return Err(Error::Index(format!(
                "{} unexpected bytes after the file table",
                r.remaining()
            )));
        }
        let table = inflate_table(packed, table_len as usize)?;
        let mut r = Cursor {
            buf: &table,
            pos: 0,
        };
        if n_entries > r.remaining() / MIN_ENTRY_LEN {
            return Err(Error::Index(format!(
                "{n_entries} entries cannot fit in {} bytes",
                r.remaining()
            )));
        }
        let mut entries = Vec::with_capacity(n_entries);
        for i in 0..n_entries {
            let kind_code = r.u8()?;
            let kind = EntryKind::from_code(kind_code)
                .ok_or_else(|| Error::Index(format!("entry {i}: unknown kind {kind_code}")))?;
            let mode = r.u32()?;
            let uid = r.u32()?;
            let gid = r.u32()?;
            let mtime = r.u64()? as i64;
            let mtime_nsec = r.u32()?;
            let size = r.u64()?;
            let offset = r.u64()?;
            let header_offset = r.u64()?;
            let dev_major = r.u32()?;
            let dev_minor = r.u32()?;
            let path = r.string(MAX_STRING, "path")?;
            let link_target = r.string(MAX_STRING, "link target")?;
            let uname = r.string(MAX_STRING, "user name")?;
            let gname = r.string(MAX_STRING, "group name")?;
            let n_xattrs = r.count(8, "xattrs")?;
            let mut xattrs = BTreeMap::new();
            for _ in 0..n_xattrs {
                let k = r.string(MAX_STRING, "xattr name")?;
                let v = r.bytes(MAX_XATTR_VALUE, "xattr value")?.to_vec();
                xattrs.insert(k, v);
            }
            entries.push(Entry {
                path,
                kind,
                mode,
                uid,
                gid,
                uname,
                gname,
                mtime,
                mtime_nsec,
                size,
                offset,
                header_offset,
                link_target,
                dev_major,
                dev_minor,
                xattrs,
            });
        }
        if r.remaining() != 0 {
            return Err(Error::Index(format!(
                "{} unexpected bytes inside the file table",
                r.remaining()
            )));
        }
        let index = LayerIndex {
            layer_digest,
            compression,
            compressed_size,
            uncompressed_size,
            span_size,
            checkpoints,
            span_digests,
            entries,
        };
        index.validate()?;
        Ok(index)
    }

    /// Checks the structural rules every reader relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Index(m));
        if self.checkpoints.len() != self.span_digests.len() {
            return bad("span digest count differs from checkpoint count".into());
        }
        if self.uncompressed_size > 0 {
            match self.checkpoints.first() {
                Some(c) if c.out_offset == 0 => {}
                _ => return bad("the first checkpoint must be at uncompressed offset 0".into()),
            }
        }
        for (i, pair) in self.checkpoints.windows(2).enumerate() {
            if pair[1].out_offset <= pair[0].out_offset || pair[1].in_offset < pair[0].in_offset {
                return bad(format!("checkpoint {} is not after checkpoint {i}", i + 1));
            }
        }
        for (i, c) in self.checkpoints.iter().enumerate() {
            if c.bits > 7
                || c.in_offset > self.compressed_size
                || c.out_offset >= self.uncompressed_size.max(1)
            {
                return bad(format!("checkpoint {i} lies outside the layer"));
            }
            if (c.bits > 0 && c.in_offset == 0) || (c.member_start && c.bits != 0) {
                return bad(format!("checkpoint {i} has an impossible bit position"));
            }
        }
        for e in &self.entries {
            if !crate::entry::is_clean_path(&e.path) {
                return bad(format!(
                    "entry path {:?} is not a clean relative path",
                    e.path
                ));
            }
            if e.kind == EntryKind::File
                && e.offset
                    .checked_add(e.size)
                    .is_none_or(|end| end > self.uncompressed_size)
            {
                return bad(format!("data of {:?} lies outside the layer", e.path));
            }
        }
        Ok(())
    }
}

/// The trailer checksum of an index body (exposed for tools and the fuzzer).
pub fn checksum(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

/// Decompresses the file table, refusing anything but exactly `len` bytes (never more:
/// the output is capped, so a zstd bomb costs at most `len` + 1 bytes).
fn inflate_table(packed: &[u8], len: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let bad = |m: String| Error::Index(format!("file table: {m}"));
    let decoder =
        zstd::stream::read::Decoder::with_buffer(packed).map_err(|e| bad(e.to_string()))?;
    let mut table = Vec::with_capacity(len.min(packed.len().saturating_mul(64)));
    decoder
        .take(len as u64 + 1)
        .read_to_end(&mut table)
        .map_err(|e| bad(e.to_string()))?;
    if table.len() != len {
        return Err(bad(format!(
            "decompressed to {} bytes, header says {len}",
            table.len()
        )));
    }
    Ok(table)
}

fn parse_digest_raw(d: &str) -> Result<[u8; 32]> {
    let hex_part = d
        .strip_prefix("sha256:")
        .ok_or_else(|| Error::Index(format!("layer digest {d:?} is not sha256")))?;
    let mut raw = [0u8; 32];
    hex::decode_to_slice(hex_part, &mut raw)
        .map_err(|_| Error::Index(format!("layer digest {d:?} is not sha256")))?;
    Ok(raw)
}

/// A bounds-checked little-endian reader.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Index(format!(
                "truncated: wanted {n} bytes at offset {}",
                self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A u32 count of records each at least `min_len` bytes long, bounded by what is left.
    fn count(&mut self, min_len: usize, what: &str) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > self.remaining() / min_len {
            return Err(Error::Index(format!(
                "{n} {what} cannot fit in {} bytes",
                self.remaining()
            )));
        }
        Ok(n)
    }
    fn bytes(&mut self, max: usize, what: &str) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(Error::Index(format!(
                "{what} of {n} bytes is longer than {max}"
            )));
        }
        self.take(n)
    }
    fn string(&mut self, max: usize, what: &str) -> Result<String> {
        let b = self.bytes(max, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| Error::Index(format!("{what} is not UTF-8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LayerIndex {
        let mut xattrs = BTreeMap::new();
        xattrs.insert("user.k".to_string(), vec![0, 1, 2, 255]);
        LayerIndex {
            layer_digest: format!("sha256:{}", "ab".repeat(32)),
            compression: Compression::Gzip,
            compressed_size: 1000,
            uncompressed_size: 5000,
            span_size: 2000,
            checkpoints: vec![
                Checkpoint {
                    in_offset: 0,
                    bits: 0,
                    out_offset: 0,
                    member_start: true,
                    window_deflate: vec![],
                },
                Checkpoint {
                    in_offset: 400,
                    bits: 3,
                    out_offset: 2100,
                    member_start: false,
                    window_deflate: vec![1, 2, 3],
                },
            ],
            span_digests: vec![[7u8; 32], [9u8; 32]],
            entries: vec![
                Entry {
                    path: "etc".into(),
                    kind: EntryKind::Dir,
                    mode: 0o755,
                    ..Default::default()
                },
                Entry {
                    path: "etc/passwd".into(),
                    kind: EntryKind::File,
                    mode: 0o644,
                    uid: 1,
                    gid: 2,
                    uname: "u".into(),
                    gname: "g".into(),
                    mtime: -5,
                    mtime_nsec: 123,
                    size: 10,
                    offset: 1536,
                    header_offset: 1024,
                    xattrs,
                    ..Default::default()
                },
                Entry {
                    path: "dev/null".into(),
                    kind: EntryKind::Char,
                    dev_major: 1,
                    dev_minor: 3,
                    ..Default::default()
                },
            ],
        }
    }

    #[test]
    fn round_trips_and_is_deterministic() -> Result<()> {
        let idx = sample();
        let a = idx.encode()?;
        let b = idx.clone().encode()?;
        assert_eq!(a, b);
        assert_eq!(LayerIndex::decode(&a)?, idx);
        Ok(())
    }

    #[test]
    fn rejects_corruption_truncation_and_versions() -> Result<()> {
        let bytes = sample().encode()?;
        for cut in [0, 10, 80, bytes.len() / 2, bytes.len() - 1] {
            assert!(LayerIndex::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = bytes.clone();
        flipped[100] ^= 1;
        assert!(LayerIndex::decode(&flipped).is_err());
        let mut v2 = bytes.clone();
        v2[8] = 2;
        let n = v2.len();
        let sum = Sha256::digest(&v2[..n - 32]);
        v2[n - 32..].copy_from_slice(&sum);
        match LayerIndex::decode(&v2) {
            Err(Error::Index(m)) => assert!(m.contains("version 2"), "{m}"),
            other => panic!("expected a version error, got {other:?}"),
        }
        Ok(())
    }

    /// Re-signs a mutated body so the structural checks (not the checksum) are exercised.
    fn resign(mut body: Vec<u8>) -> Vec<u8> {
        let sum = Sha256::digest(&body);
        body.extend_from_slice(&sum);
        body
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() -> Result<()> {
        let bytes = sample().encode()?;
        let mut body = bytes[..bytes.len() - 32].to_vec();
        body[72..76].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            matches!(LayerIndex::decode(&resign(body)), Err(Error::Index(m)) if m.contains("cannot fit"))
        );
        let mut body = bytes[..bytes.len() - 32].to_vec();
        body[76..80].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(LayerIndex::decode(&resign(body)).is_err());
        Ok(())
    }

    #[test]
    fn refuses_unclean_paths_and_data_outside_the_layer() -> Result<()> {
        let mut idx = sample();
        idx.entries[1].path = "etc/../../x".into();
        assert!(LayerIndex::decode(&idx.encode()?).is_err());
        let mut idx = sample();
        idx.entries[1].offset = 4995;
        assert!(LayerIndex::decode(&idx.encode()?).is_err());
        let mut idx = sample();
        idx.checkpoints[1].out_offset = 0;
        assert!(LayerIndex::decode(&idx.encode()?).is_err());
        Ok(())
    }

    #[test]
    fn span_lookup() {
        let idx = sample();
        assert_eq!(idx.span_for(0), Some(0));
        assert_eq!(idx.span_for(2099), Some(0));
        assert_eq!(idx.span_for(2100), Some(1));
        assert_eq!(idx.span_for(4999), Some(1));
        assert_eq!(idx.span_for(5000), None);
        assert_eq!(idx.span_range(0), Some(0..400));
        assert_eq!(idx.span_range(1), Some(399..1000));
    }
}
