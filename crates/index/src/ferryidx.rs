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
//! Version 2 (what `ferry index` writes) keeps the 32 KiB windows out of the index blob:
//! they are concatenated, in checkpoint order, into a separate *windows blob*, and each
//! checkpoint names its window by offset, length and SHA-256 there. The index blob that a
//! mount fetches and decodes whole then holds only the file table, checkpoints and span
//! digests; a window is fetched when its span is first read. Version 1 (windows inline)
//! is still decoded so old indexes keep mounting.
//!
//! Version 3 is version 2 plus, after the file table, each ELF file's libraries
//! ([`Library`]): what its loader will open, found while the layer streamed past, so a
//! mount fetches a program's whole library chain at its first read instead of reading
//! each library's `.dynamic` in turn, a round trip per link. An index without any is
//! written as version 2.
//!
//! This module owns the model and the bytes; it must not fetch anything (readers ask a
//! [`crate::windows::WindowSource`]). The byte layout is documented in
//! `docs/formats.md`; encoding is deterministic.

use crate::elf::Dependencies;
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
    /// deflate, when it is held inline (fresh from the indexer, or a version-1 index).
    /// Empty for member starts and for windows kept in the windows blob.
    pub window_deflate: Vec<u8>,
    /// Where the window lives in the layer's windows blob (version 2); `None` when the
    /// checkpoint needs no window or holds it inline.
    pub window: Option<WindowRef>,
}

/// Where one checkpoint's deflated window lies in the windows blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowRef {
    /// Offset in the windows blob.
    pub offset: u64,
    /// Length in bytes (never 0: checkpoints without a window have no `WindowRef`).
    pub len: u32,
    /// SHA-256 of those bytes: what a fetched window is verified against, and its key in
    /// the node chunk store.
    pub sha256: [u8; 32],
}

impl WindowRef {
    /// The byte range in the windows blob.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + u64::from(self.len)
    }
}

/// The windows blob a version-2 index refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowsBlob {
    /// `sha256:<hex>` of the whole windows blob.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
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
    /// The windows blob the checkpoints' [`WindowRef`]s point into; `None` when the
    /// windows are inline or no checkpoint needs one.
    pub windows: Option<WindowsBlob>,
    /// The ELF files' libraries, in entry order, at most one per entry (version 3; empty
    /// in an older index).
    pub libraries: Vec<Library>,
}

/// What an ELF file of the layer asks its loader for, recorded by `ferry index`
/// ([`crate::elf::dependencies`]): names as the file gives them, resolved at mount time
/// in the whole image (a library may be in another layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Library {
    /// The file: its position in [`LayerIndex::entries`], a regular file.
    pub entry: u32,
    /// Its interpreter, `DT_NEEDED` names and run path.
    pub deps: Dependencies,
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

    /// Moves every inline window into a windows blob (concatenated in checkpoint order)
    /// and points the checkpoints at it, so [`LayerIndex::encode`] writes version 2.
    /// Returns the windows blob; empty (and `windows` stays `None`) when no checkpoint
    /// has a window. Deterministic. An index whose windows are already external is left
    /// alone and gives an empty blob.
    pub fn split_windows(&mut self) -> Vec<u8> {
        if self.windows.is_some() {
            return Vec::new();
        }
        let total: usize = self
            .checkpoints
            .iter()
            .map(|c| c.window_deflate.len())
            .sum();
        let mut blob = Vec::with_capacity(total);
        for cp in &mut self.checkpoints {
            let window = std::mem::take(&mut cp.window_deflate);
            if window.is_empty() {
                continue;
            }
            cp.window = Some(WindowRef {
                offset: blob.len() as u64,
                len: window.len() as u32,
                sha256: Sha256::digest(&window).into(),
            });
            blob.extend_from_slice(&window);
        }
        if !blob.is_empty() {
            self.windows = Some(WindowsBlob {
                digest: format!("sha256:{}", hex::encode(Sha256::digest(&blob))),
                size: blob.len() as u64,
            });
        }
        blob
    }

    /// Checkpoint `k`'s window in the windows blob, when it has one there.
    pub fn window_ref(&self, k: usize) -> Option<&WindowRef> {
        self.checkpoints.get(k)?.window.as_ref()
    }

    /// True when some checkpoint keeps its window inline (a version-1 index).
    fn has_inline_windows(&self) -> bool {
        self.checkpoints
            .iter()
            .any(|c| !c.window_deflate.is_empty())
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
/// The format version this build writes (windows in a separate blob), for an index
/// without [`Library`] records.
pub const VERSION: u16 = 2;
/// Version 2 plus the [`Library`] records after the file table.
pub const VERSION_LIBRARIES: u16 = 3;
/// The older version, windows inline, still decoded (and written for an index whose
/// windows were never split out).
pub const VERSION_INLINE_WINDOWS: u16 = 1;
/// Largest index blob ferry will decode.
pub const MAX_INDEX_BYTES: usize = 1 << 30;
/// Largest windows blob an index may name (a window per checkpoint, each at most
/// [`MAX_WINDOW_DEFLATE`], for far more checkpoints than a layer has).
pub const MAX_WINDOWS_BYTES: u64 = 1 << 36;
/// Largest stored (deflated) window: a 32 KiB window never deflates to more than this.
pub const MAX_WINDOW_DEFLATE: usize = 40 << 10;
/// Longest path, link target or user/group name accepted.
const MAX_STRING: usize = 64 << 10;
/// Longest xattr value accepted.
const MAX_XATTR_VALUE: usize = 1 << 20;
const HEADER_LEN: usize = 80;
/// Version 2 adds the windows blob's size and SHA-256.
const HEADER_LEN_V2: usize = HEADER_LEN + 8 + 32;
/// zstd level of the file table: deterministic for a given zstd, fast enough for 1M entries.
const TABLE_ZSTD_LEVEL: i32 = 9;
/// Smallest possible encoded checkpoint and entry, used to bound counts before allocating
/// (the same for both versions: a window-less v2 record is as long as an empty v1 one).
const MIN_CHECKPOINT_LEN: usize = 8 + 8 + 1 + 1 + 4 + 32;
const MIN_ENTRY_LEN: usize = 1 + 4 * 3 + 8 + 4 + 8 * 3 + 4 * 2 + 4 * 4 + 4;
/// Smallest encoded [`Library`]: entry, machine, class, empty interpreter, no names.
const MIN_LIBRARY_LEN: usize = 4 + 2 + 1 + 4 + 4 + 4;
/// Longest interpreter, library name or run-path directory accepted (as the ELF reader's).
const MAX_LIBRARY_STRING: usize = 4096;
/// Run-path directories kept per file, at most.
pub const MAX_SEARCH_DIRS: usize = 64;

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
    /// Encodes the index in the versioned binary format: version 2 when the windows are
    /// in a windows blob (after [`LayerIndex::split_windows`]) or there are none, version
    /// 3 when it also has [`Library`] records, version 1 when the windows are inline (an
    /// index with libraries must split its windows first). Deterministic: the same index
    /// always gives the same bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let raw_digest = parse_digest_raw(&self.layer_digest)?;
        if self.span_digests.len() != self.checkpoints.len() {
            return Err(Error::Index(
                "one span digest per checkpoint is required".into(),
            ));
        }
        let inline = self.has_inline_windows();
        let external =
            self.windows.is_some() || self.checkpoints.iter().any(|c| c.window.is_some());
        if inline && external {
            return Err(Error::Index(
                "windows are both inline and in a windows blob".into(),
            ));
        }
        if inline && !self.libraries.is_empty() {
            return Err(Error::Index(
                "an index with library records keeps its windows in a windows blob".into(),
            ));
        }
        let version = if inline {
            VERSION_INLINE_WINDOWS
        } else if self.libraries.is_empty() {
            VERSION
        } else {
            VERSION_LIBRARIES
        };
        let per_checkpoint = if inline { 16_000 } else { 100 };
        let mut out = Vec::with_capacity(
            HEADER_LEN_V2 + self.checkpoints.len() * per_checkpoint + self.entries.len() * 96,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.push(compression_code(self.compression));
        out.push(0);
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&raw_digest);
        out.extend_from_slice(&self.compressed_size.to_le_bytes());
        out.extend_from_slice(&self.uncompressed_size.to_le_bytes());
        out.extend_from_slice(&self.span_size.to_le_bytes());
        out.extend_from_slice(&(self.checkpoints.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        if version != VERSION_INLINE_WINDOWS {
            let (size, digest) = match &self.windows {
                Some(w) => (w.size, parse_digest_raw(&w.digest)?),
                None => (0, Sha256::digest([]).into()),
            };
            out.extend_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&digest);
        }
        for (cp, digest) in self.checkpoints.iter().zip(&self.span_digests) {
            out.extend_from_slice(&cp.in_offset.to_le_bytes());
            out.extend_from_slice(&cp.out_offset.to_le_bytes());
            out.push(cp.bits);
            out.push(u8::from(cp.member_start));
            if version != VERSION_INLINE_WINDOWS {
                // Offsets are implied: windows lie in checkpoint order, back to back.
                match &cp.window {
                    Some(w) => {
                        out.extend_from_slice(&w.len.to_le_bytes());
                        out.extend_from_slice(&w.sha256);
                    }
                    None => out.extend_from_slice(&0u32.to_le_bytes()),
                }
            } else {
                put_str(&mut out, &cp.window_deflate);
            }
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
        if version == VERSION_LIBRARIES {
            table.extend_from_slice(&(self.libraries.len() as u32).to_le_bytes());
            for lib in &self.libraries {
                let d = &lib.deps;
                table.extend_from_slice(&lib.entry.to_le_bytes());
                table.extend_from_slice(&d.machine.to_le_bytes());
                table.push(u8::from(d.wide));
                put_str(
                    &mut table,
                    d.interpreter.as_deref().unwrap_or("").as_bytes(),
                );
                for names in [&d.needed, &d.search] {
                    table.extend_from_slice(&(names.len() as u32).to_le_bytes());
                    for n in names {
                        put_str(&mut table, n.as_bytes());
                    }
                }
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
        if !(VERSION_INLINE_WINDOWS..=VERSION_LIBRARIES).contains(&version) {
            return Err(Error::Index(format!(
                "format version {version} is not supported (this ferry reads \
                 {VERSION_INLINE_WINDOWS} to {VERSION_LIBRARIES}; a newer ferry wrote it)"
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
        let n_checkpoints_raw = r.u32()?;
        let n_entries = r.u32()? as usize;
        let windows = if version != VERSION_INLINE_WINDOWS {
            let size = r.u64()?;
            let digest: [u8; 32] = r.array()?;
            if size > MAX_WINDOWS_BYTES {
                return Err(Error::Index(format!(
                    "windows blob of {size} bytes is larger than {MAX_WINDOWS_BYTES}"
                )));
            }
            if size == 0 {
                if digest != <[u8; 32]>::from(Sha256::digest([])) {
                    return Err(Error::Index(
                        "an empty windows blob must carry the empty digest".into(),
                    ));
                }
                None
            } else {
                Some(WindowsBlob {
                    digest: format!("sha256:{}", hex::encode(digest)),
                    size,
                })
            }
        } else {
            None
        };
        let n_checkpoints = n_checkpoints_raw as usize;
        if n_checkpoints > r.remaining() / MIN_CHECKPOINT_LEN {
            return Err(Error::Index(format!(
                "{n_checkpoints} checkpoints cannot fit in {} bytes",
                r.remaining()
            )));
        }
        let mut checkpoints = Vec::with_capacity(n_checkpoints);
        let mut span_digests = Vec::with_capacity(n_checkpoints);
        let mut window_offset = 0u64;
        for i in 0..n_checkpoints {
            let in_offset = r.u64()?;
            let out_offset = r.u64()?;
            let bits = r.u8()?;
            let member_start = match r.u8()? {
                0 => false,
                1 => true,
                f => return Err(Error::Index(format!("checkpoint {i}: bad flags {f}"))),
            };
            let (window_deflate, window) = if version != VERSION_INLINE_WINDOWS {
                let len = r.u32()?;
                if len as usize > MAX_WINDOW_DEFLATE {
                    return Err(Error::Index(format!(
                        "checkpoint {i}: window of {len} bytes is longer than \
                         {MAX_WINDOW_DEFLATE}"
                    )));
                }
                let window = if len == 0 {
                    None
                } else {
                    let w = WindowRef {
                        offset: window_offset,
                        len,
                        sha256: r.array()?,
                    };
                    window_offset += u64::from(len);
                    Some(w)
                };
                (Vec::new(), window)
            } else {
                (r.bytes(MAX_WINDOW_DEFLATE, "window")?.to_vec(), None)
            };
            let mut digest = [0u8; 32];
            digest.copy_from_slice(r.take(32)?);
            checkpoints.push(Checkpoint {
                in_offset,
                bits,
                out_offset,
                member_start,
                window_deflate,
                window,
            });
            span_digests.push(digest);
        }
        if window_offset != windows.as_ref().map_or(0, |w| w.size) {
            return Err(Error::Index(format!(
                "the checkpoints' windows add up to {window_offset} bytes, the header says {}",
                windows.as_ref().map_or(0, |w| w.size)
            )));
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
        let mut libraries = Vec::new();
        if version == VERSION_LIBRARIES {
            let n = r.count(MIN_LIBRARY_LEN, "library records")?;
            libraries.reserve(n);
            for _ in 0..n {
                let entry = r.u32()?;
                let machine = r.u16()?;
                let wide = match r.u8()? {
                    0 => false,
                    1 => true,
                    c => {
                        return Err(Error::Index(format!(
                            "library record of entry {entry}: bad class {c}"
                        )));
                    }
                };
                let interpreter = r.string(MAX_LIBRARY_STRING, "interpreter")?;
                let mut lists = [Vec::new(), Vec::new()];
                for (list, (max, what)) in lists.iter_mut().zip([
                    (crate::elf::MAX_NEEDED, "library names"),
                    (MAX_SEARCH_DIRS, "run-path directories"),
                ]) {
                    let k = r.count(4, what)?;
                    if k > max {
                        return Err(Error::Index(format!(
                            "library record of entry {entry}: {k} {what}, more than {max}"
                        )));
                    }
                    for _ in 0..k {
                        list.push(r.string(MAX_LIBRARY_STRING, what)?);
                    }
                }
                let [needed, search] = lists;
                libraries.push(Library {
                    entry,
                    deps: Dependencies {
                        interpreter: (!interpreter.is_empty()).then_some(interpreter),
                        needed,
                        search,
                        machine,
                        wide,
                    },
                });
            }
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
            windows,
            libraries,
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
            let has_window = !c.window_deflate.is_empty() || c.window.is_some();
            if has_window && (c.member_start || self.compression == Compression::None) {
                return bad(format!("checkpoint {i} has a window it cannot use"));
            }
        }
        // External windows lie back to back, in checkpoint order, filling the blob.
        let mut end = 0u64;
        for (i, c) in self.checkpoints.iter().enumerate() {
            if let Some(w) = &c.window {
                if w.offset != end || w.len == 0 || w.len as usize > MAX_WINDOW_DEFLATE {
                    return bad(format!("checkpoint {i}: window reference out of place"));
                }
                end += u64::from(w.len);
            }
        }
        if end != self.windows.as_ref().map_or(0, |w| w.size) {
            return bad("window references do not fill the windows blob".into());
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
        let mut last = None;
        for lib in &self.libraries {
            if last.is_some_and(|l| lib.entry <= l) {
                return bad(format!(
                    "library record of entry {} out of order",
                    lib.entry
                ));
            }
            last = Some(lib.entry);
            let d = &lib.deps;
            let file = self
                .entries
                .get(lib.entry as usize)
                .is_some_and(|e| e.kind == EntryKind::File);
            if !file
                || d.interpreter.as_ref().is_some_and(|i| !i.starts_with('/'))
                || d.needed.iter().any(|n| n.is_empty() || n.contains('/'))
                || d.needed.len() > crate::elf::MAX_NEEDED
                || d.search.len() > MAX_SEARCH_DIRS
            {
                return bad(format!(
                    "library record of entry {} is not one a file could have",
                    lib.entry
                ));
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
    ferry_oci::digest::parse_sha256_bytes(d).map_err(|e| Error::Index(e.to_string()))
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
                    window: None,
                },
                Checkpoint {
                    in_offset: 400,
                    bits: 3,
                    out_offset: 2100,
                    member_start: false,
                    window_deflate: vec![1, 2, 3],
                    window: None,
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
            windows: None,
            libraries: Vec::new(),
        }
    }

    #[test]
    fn layer_digest_is_checked_by_the_one_validator() {
        for bad in [
            format!("sha256:{}", "AB".repeat(32)),
            format!("sha256:{}", "ab".repeat(31)),
            format!("sha512:{}", "ab".repeat(64)),
        ] {
            let idx = LayerIndex {
                layer_digest: bad.clone(),
                ..sample()
            };
            assert!(
                matches!(idx.encode(), Err(Error::Index(_))),
                "{bad} was encoded"
            );
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
        let mut v3 = bytes.clone();
        v3[8] = 4;
        let n = v3.len();
        let sum = Sha256::digest(&v3[..n - 32]);
        v3[n - 32..].copy_from_slice(&sum);
        match LayerIndex::decode(&v3) {
            Err(Error::Index(m)) => assert!(m.contains("version 4"), "{m}"),
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

    /// A three-checkpoint gzip index: member start, then two with windows.
    fn sample_with_windows() -> LayerIndex {
        let mut idx = sample();
        idx.uncompressed_size = 9000;
        idx.compressed_size = 2000;
        idx.checkpoints.push(Checkpoint {
            in_offset: 900,
            bits: 0,
            out_offset: 6000,
            member_start: false,
            window_deflate: vec![4; 400],
            window: None,
        });
        idx.span_digests.push([11u8; 32]);
        idx
    }

    #[test]
    fn version_1_with_inline_windows_still_decodes() -> Result<()> {
        let idx = sample_with_windows();
        let bytes = idx.encode()?;
        assert_eq!(
            u16::from_le_bytes([bytes[8], bytes[9]]),
            VERSION_INLINE_WINDOWS
        );
        let back = LayerIndex::decode(&bytes)?;
        assert_eq!(back, idx);
        assert_eq!(back.checkpoints[2].window_deflate, vec![4; 400]);
        assert!(back.windows.is_none());
        Ok(())
    }

    #[test]
    fn split_windows_writes_version_2_and_round_trips() -> Result<()> {
        let mut idx = sample_with_windows();
        let v1_len = idx.encode()?.len();
        let blob = idx.split_windows();
        // Windows back to back in checkpoint order; none for the member start.
        assert_eq!(blob, [&[1u8, 2, 3][..], &[4; 400][..]].concat());
        assert_eq!(idx.checkpoints[0].window, None);
        let w1 = idx.checkpoints[1].window.expect("window 1");
        let w2 = idx.checkpoints[2].window.expect("window 2");
        assert_eq!((w1.offset, w1.len), (0, 3));
        assert_eq!((w2.offset, w2.len), (3, 400));
        assert_eq!(w2.sha256, <[u8; 32]>::from(Sha256::digest([4u8; 400])));
        assert!(idx.checkpoints.iter().all(|c| c.window_deflate.is_empty()));
        let windows = idx.windows.clone().expect("windows blob");
        assert_eq!(windows.size, 403);
        assert_eq!(
            windows.digest,
            format!("sha256:{}", hex::encode(Sha256::digest(&blob)))
        );
        let bytes = idx.encode()?;
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), VERSION);
        assert!(
            bytes.len() < v1_len,
            "the index must shrink without its windows"
        );
        assert_eq!(bytes, idx.clone().encode()?, "deterministic");
        assert_eq!(LayerIndex::decode(&bytes)?, idx);
        // Splitting again is a no-op.
        let mut again = idx.clone();
        assert!(again.split_windows().is_empty());
        assert_eq!(again, idx);
        Ok(())
    }

    #[test]
    fn version_2_without_windows_round_trips() -> Result<()> {
        let mut idx = sample();
        idx.checkpoints[1].window_deflate.clear();
        assert!(idx.split_windows().is_empty());
        assert!(idx.windows.is_none());
        let bytes = idx.encode()?;
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), VERSION);
        assert_eq!(LayerIndex::decode(&bytes)?, idx);
        Ok(())
    }

    #[test]
    fn version_2_refuses_inconsistent_windows() -> Result<()> {
        let mut idx = sample_with_windows();
        idx.split_windows();
        let bytes = idx.encode()?;
        let body = &bytes[..bytes.len() - 32];
        // Windows blob size in the header disagreeing with the references.
        let mut b = body.to_vec();
        b[80..88].copy_from_slice(&44u64.to_le_bytes());
        assert!(
            matches!(LayerIndex::decode(&resign(b)), Err(Error::Index(m)) if m.contains("add up"))
        );
        // A huge window length.
        let mut b = body.to_vec();
        let first_window_len = HEADER_LEN_V2 + (8 + 8 + 1 + 1 + 4 + 32) + (8 + 8 + 1 + 1);
        b[first_window_len..first_window_len + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(LayerIndex::decode(&resign(b)).is_err());
        // A huge windows blob.
        let mut b = body.to_vec();
        b[80..88].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(LayerIndex::decode(&resign(b)).is_err());
        // A window on a member start.
        let mut bad = idx.clone();
        bad.checkpoints[0].window = bad.checkpoints[1].window;
        assert!(bad.validate().is_err());
        // Inline and external at once cannot be encoded.
        let mut mixed = idx.clone();
        mixed.checkpoints[1].window_deflate = vec![1];
        assert!(mixed.encode().is_err());
        // Truncations anywhere.
        for cut in [0, 90, 119, 150, bytes.len() - 33, bytes.len() - 1] {
            assert!(LayerIndex::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
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

    /// [`sample`] with its windows in a blob and library records for its one file.
    fn sample_with_libraries() -> LayerIndex {
        let mut idx = sample();
        idx.split_windows();
        let file = idx
            .entries
            .iter()
            .position(|e| e.kind == EntryKind::File)
            .expect("a file");
        idx.libraries = vec![Library {
            entry: file as u32,
            deps: Dependencies {
                interpreter: Some("/lib64/ld-linux-x86-64.so.2".into()),
                needed: vec!["libm.so.6".into(), "libc.so.6".into()],
                search: vec!["$ORIGIN/../lib".into()],
                machine: 62,
                wide: true,
            },
        }];
        idx
    }

    #[test]
    fn library_records_write_version_3_and_round_trip() -> Result<()> {
        let idx = sample_with_libraries();
        let bytes = idx.encode()?;
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), VERSION_LIBRARIES);
        assert_eq!(bytes, idx.clone().encode()?, "deterministic");
        assert_eq!(LayerIndex::decode(&bytes)?, idx);
        // Without records the same index is version 2, which every ferry reads.
        let mut plain = idx.clone();
        plain.libraries.clear();
        let v2 = plain.encode()?;
        assert_eq!(u16::from_le_bytes([v2[8], v2[9]]), VERSION);
        assert_eq!(LayerIndex::decode(&v2)?, plain);
        // Every cut and a flipped byte are refused.
        for cut in 0..bytes.len() {
            assert!(LayerIndex::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        // Records need the windows out of the index.
        let mut inline = sample_with_windows();
        inline.libraries = idx.libraries.clone();
        assert!(inline.encode().is_err());
        Ok(())
    }

    #[test]
    fn library_records_a_file_could_not_have_are_refused() -> Result<()> {
        let dir = sample()
            .entries
            .iter()
            .position(|e| e.kind == EntryKind::Dir)
            .expect("a dir") as u32;
        type Mutation = Box<dyn Fn(&mut LayerIndex)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("a directory", Box::new(move |i| i.libraries[0].entry = dir)),
            ("no such entry", Box::new(|i| i.libraries[0].entry = 999)),
            (
                "a relative interpreter",
                Box::new(|i| i.libraries[0].deps.interpreter = Some("ld.so".into())),
            ),
            (
                "a path as a name",
                Box::new(|i| i.libraries[0].deps.needed.push("../x/libc.so".into())),
            ),
            (
                "an empty name",
                Box::new(|i| i.libraries[0].deps.needed.push(String::new())),
            ),
            (
                "too many names",
                Box::new(|i| {
                    i.libraries[0].deps.needed = vec!["l.so".into(); crate::elf::MAX_NEEDED + 1]
                }),
            ),
            (
                "two records for one file",
                Box::new(|i| i.libraries.push(i.libraries[0].clone())),
            ),
        ];
        for (what, mutate) in cases {
            let mut idx = sample_with_libraries();
            mutate(&mut idx);
            assert!(idx.validate().is_err(), "{what} was accepted");
            assert!(
                LayerIndex::decode(&idx.encode()?).is_err(),
                "{what} was decoded"
            );
        }
        Ok(())
    }
}
