//! Reading an eStargz layer through a [`RangeSource`]: footer, TOC, verified chunks.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::ops::Range;

use ferry_oci::digest::parse_sha256_bytes;
use flate2::read::{GzDecoder, MultiGzDecoder};
use sha2::{Digest as _, Sha256};

use super::footer::{FOOTER_SIZE, parse_footer_sized};
use super::toc::{JToc, TocEntry, sha256_string};
use super::{
    MAX_TOC_COMPRESSED, MAX_TOC_JSON, NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK, TOC_TAR_NAME,
};
use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};
use crate::source::{RangeSource, merge_ranges};
use crate::tarwalk::{Limits, TarWalker, normalize_path};

/// [`EstargzLayer::read_at`] fetches the members it needs in one
/// [`RangeSource::read_ranges`] call when they total at most this many bytes; larger
/// reads stream each member in [`STREAM_WINDOW`] pieces so memory stays bounded.
const FETCH_BATCH: u64 = 64 << 20;
/// Piece size when streaming a member.
const STREAM_WINDOW: u64 = 8 << 20;
/// Largest extension header body (PAX / GNU long name) accepted in front of the TOC.
const MAX_TOC_EXTENSION: u64 = 1 << 20;
/// Decode buffer for chunks.
const DECODE_BUF: u64 = 256 << 10;

/// One piece of a regular file's data: where it is in the file, which gzip member holds
/// it and where inside, and its digest.
#[derive(Debug, Clone)]
struct Chunk {
    /// Offset of the chunk in the file.
    file_off: u64,
    /// Length of the chunk (never 0).
    len: u64,
    /// Compressed offset of the gzip member holding the chunk.
    member: u64,
    /// Offset of the chunk in the member's inflated bytes (`innerOffset`).
    inner: u64,
    /// End of the member's compressed extent: the next member offset named in the TOC,
    /// or the TOC's own offset.
    end: u64,
    /// sha256 of the chunk's bytes.
    digest: [u8; 32],
}

/// The chunks of one regular file: `chunks[first..first + count]`, in file order,
/// contiguous, covering `size` bytes.
#[derive(Debug, Clone, Copy)]
struct FileData {
    size: u64,
    first: usize,
    count: usize,
}

/// How a layer's data pieces are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// gzip members (eStargz).
    Gzip,
    /// zstd frames (zstd:chunked).
    Zstd,
}

/// An opened eStargz (or zstd:chunked) layer: its TOC, parsed and checked.
///
/// Opening fetches only the footer and the TOC member. Each read then fetches the gzip
/// members holding the chunks it touches, inflates them and checks each whole chunk
/// against its `chunkDigest` before handing any byte out.
///
/// Bounds: the TOC offset must lie inside the blob; the compressed TOC member may be at
/// most [`MAX_TOC_COMPRESSED`] bytes and its JSON at most [`MAX_TOC_JSON`] bytes, with at
/// most [`super::MAX_TOC_ENTRIES`] entries; every chunk must start before the TOC, and the
/// chunks of a file must tile it exactly. Anything else is an [`Error::Estargz`] naming the
/// TOC entry.
pub struct EstargzLayer {
    codec: Codec,
    toc_digest: String,
    toc_offset: u64,
    blob_size: u64,
    entries: Vec<Entry>,
    /// Per entry: the file data it reads (regular files, and hard links to them).
    data: Vec<Option<usize>>,
    files: Vec<FileData>,
    chunks: Vec<Chunk>,
    prefetch: Option<Vec<String>>,
    prefetch_end: Option<u64>,
}

impl fmt::Debug for EstargzLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EstargzLayer")
            .field("toc_digest", &self.toc_digest)
            .field("toc_offset", &self.toc_offset)
            .field("blob_size", &self.blob_size)
            .field("entries", &self.entries.len())
            .field("chunks", &self.chunks.len())
            .field("prefetch", &self.prefetch.as_ref().map(Vec::len))
            .finish()
    }
}

fn esgz(msg: impl Into<String>) -> Error {
    Error::Estargz(msg.into())
}

fn gz_err(what: &str, e: io::Error) -> Error {
    Error::Gzip(format!("{what}: {e}"))
}

impl EstargzLayer {
    /// Reads the footer and the TOC through `source` (only those two ranges) and parses
    /// them. When `toc_digest` is given (`sha256:<hex>`, the layer descriptor's
    /// `containerd.io/snapshot/stargz/toc.digest` annotation) the TOC JSON must match it
    /// ([`Error::DigestMismatch`] otherwise); without it the TOC is trusted as found, and
    /// only the chunk digests it lists protect reads.
    pub fn open(source: &dyn RangeSource, toc_digest: Option<&str>) -> Result<Self> {
        let expected = match toc_digest {
            Some(d) => Some(parse_sha256_bytes(d).map_err(|e| esgz(format!("TOC digest: {e}")))?),
            None => None,
        };
        let blob_size = source.len();
        let tail_len = blob_size.min(FOOTER_SIZE);
        let tail = source.read_range(blob_size - tail_len..blob_size)?;
        if tail.len() as u64 != tail_len {
            return Err(esgz("source returned a short footer"));
        }
        let (toc_offset, footer_size) = parse_footer_sized(&tail)?;
        let toc_end = blob_size - footer_size;
        if toc_offset >= toc_end {
            return Err(esgz(format!(
                "TOC offset {toc_offset} is not inside the blob of {blob_size} bytes"
            )));
        }
        if toc_end - toc_offset > MAX_TOC_COMPRESSED {
            return Err(esgz(format!(
                "compressed TOC of {} bytes is larger than the {MAX_TOC_COMPRESSED}-byte limit",
                toc_end - toc_offset
            )));
        }
        let toc_gz = source.read_range(toc_offset..toc_end)?;
        if toc_gz.len() as u64 != toc_end - toc_offset {
            return Err(esgz("source returned a short TOC member"));
        }
        let json = extract_toc_json(&toc_gz)?;
        drop(toc_gz);
        let actual: [u8; 32] = Sha256::digest(&json).into();
        if let Some(expected) = expected.filter(|e| *e != actual) {
            return Err(Error::DigestMismatch {
                what: "eStargz TOC".into(),
                expected: sha256_string(&expected),
                actual: sha256_string(&actual),
            });
        }
        let toc: JToc = serde_json::from_slice(&json)
            .map_err(|e| esgz(format!("TOC is not valid TOC JSON: {e}")))?;
        drop(json);
        build(
            toc,
            sha256_string(&actual),
            toc_offset,
            blob_size,
            Codec::Gzip,
        )
    }

    /// Opens a zstd:chunked layer ([`super::zstd_chunked`]): fetches its TOC where
    /// `position` (the `manifest-position` annotation) says, or else where the footer
    /// says, checks it against `checksum` (the `manifest-checksum` annotation, required:
    /// it is what makes every chunk verifiable) and parses it.
    /// [`EstargzLayer::toc_digest`] is then `checksum`.
    pub fn open_zstd_chunked(
        source: &dyn RangeSource,
        checksum: &str,
        position: Option<&str>,
    ) -> Result<Self> {
        let position = position
            .map(super::zstd_chunked::ManifestPosition::parse)
            .transpose()?;
        let (json, toc_offset) = super::zstd_chunked::read_manifest(source, checksum, position)?;
        let toc: JToc = serde_json::from_slice(&json)
            .map_err(|e| esgz(format!("zstd:chunked TOC is not valid TOC JSON: {e}")))?;
        drop(json);
        let digest = checksum.to_ascii_lowercase();
        build(toc, digest, toc_offset, source.len(), Codec::Zstd)
    }

    /// How the layer's pieces are compressed.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// The layer's format, as `ferry inspect` names it.
    pub fn format_name(&self) -> &'static str {
        match self.codec {
            Codec::Gzip => "estargz",
            Codec::Zstd => "zstd:chunked",
        }
    }

    /// Digest of the TOC JSON, `sha256:<hex>` (of the compressed TOC for zstd:chunked).
    pub fn toc_digest(&self) -> &str {
        &self.toc_digest
    }

    /// Compressed offset of the TOC member (from the footer).
    pub fn toc_offset(&self) -> u64 {
        self.toc_offset
    }

    /// Size of the blob the layer was opened from.
    pub fn blob_size(&self) -> u64 {
        self.blob_size
    }

    /// The file table in TOC order, paths normalized like [`crate::tarwalk`] does. The
    /// landmark files and the TOC itself are not listed. [`Entry::offset`] and
    /// [`Entry::header_offset`] are 0 (the TOC does not say where tar headers are).
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The prioritized regular files (those before `.prefetch.landmark`), in layer order;
    /// `None` when the layer has no prefetch landmark.
    pub fn prefetch_paths(&self) -> Option<&[String]> {
        self.prefetch.as_deref()
    }

    /// The compressed range holding the prioritized files, `0..offset of the prefetch
    /// landmark's data`: what stargz-snapshotter prefetches with one request.
    pub fn prefetch_range(&self) -> Option<Range<u64>> {
        self.prefetch_end.map(|end| 0..end)
    }

    fn file_of(&self, idx: usize) -> Result<Option<FileData>> {
        let entry = self
            .entries
            .get(idx)
            .ok_or_else(|| Error::NotFound(format!("entry #{idx} of an eStargz layer")))?;
        match entry.kind {
            EntryKind::File | EntryKind::Hardlink => Ok(self.data[idx].map(|f| self.files[f])),
            _ => Err(Error::NotAFile {
                path: entry.path.clone(),
                reason: "not a regular file".into(),
            }),
        }
    }

    /// The chunks of `f` overlapping file bytes `[off, end)`.
    fn chunks_in(&self, f: FileData, off: u64, end: u64) -> &[Chunk] {
        let all = &self.chunks[f.first..f.first + f.count];
        let start = all.partition_point(|c| c.file_off + c.len <= off);
        let stop = all.partition_point(|c| c.file_off < end);
        &all[start..stop.max(start)]
    }

    /// Compressed offset of the gzip member holding the first byte of entry `idx`'s data:
    /// what tells two files of one layer apart (every file's data starts a member of its
    /// own; a hard link names its target's). `None` for entries without data.
    pub fn data_member(&self, idx: usize) -> Option<u64> {
        let f = self.file_of(idx).ok()??;
        self.chunks[f.first..f.first + f.count]
            .first()
            .map(|c| c.member)
    }

    /// The compressed ranges (merged, sorted) a read of `[off, off + len)` of entry `idx`
    /// needs. Empty for entries without data, empty reads and reads past the end.
    pub fn ranges_for(&self, idx: usize, off: u64, len: u64) -> Vec<Range<u64>> {
        let Ok(Some(f)) = self.file_of(idx) else {
            return Vec::new();
        };
        if len == 0 || off >= f.size {
            return Vec::new();
        }
        let end = off.saturating_add(len).min(f.size);
        let ranges = self
            .chunks_in(f, off, end)
            .iter()
            .map(|c| c.member..c.end)
            .collect();
        merge_ranges(ranges, 0)
    }

    /// Reads bytes `[off, off + buf.len())` of entry `idx` (a regular file or a hard link
    /// to one) into `buf`, clamped at the end of the file; returns the number of bytes
    /// read. Fetches only the members holding the chunks touched and verifies each of
    /// those chunks whole against its `chunkDigest` ([`Error::DigestMismatch`]); on error
    /// the contents of `buf` are unspecified.
    pub fn read_at(
        &self,
        source: &dyn RangeSource,
        idx: usize,
        off: u64,
        buf: &mut [u8],
    ) -> Result<usize> {
        let Some(f) = self.file_of(idx)? else {
            return Ok(0);
        };
        if off >= f.size || buf.is_empty() {
            return Ok(0);
        }
        let n = (f.size - off).min(buf.len() as u64);
        let end = off + n;
        let want = off..end;
        let out = &mut buf[..n as usize];
        let path = &self.entries[idx].path;
        let chunks = self.chunks_in(f, off, end);
        let merged = merge_ranges(chunks.iter().map(|c| c.member..c.end).collect(), 0);
        let total: u64 = merged.iter().map(|r| r.end - r.start).sum();
        if total <= FETCH_BATCH {
            let bufs = source.read_ranges(&merged)?;
            if bufs.len() != merged.len()
                || bufs
                    .iter()
                    .zip(&merged)
                    .any(|(b, r)| b.len() as u64 != r.end - r.start)
            {
                return Err(esgz("source returned short ranges"));
            }
            for c in chunks {
                let k = merged.partition_point(|r| r.end <= c.member);
                let r = &merged[k];
                let data = &bufs[k][(c.member - r.start) as usize..(c.end - r.start) as usize];
                read_chunk(self.codec, data, c, path, &want, out)?;
            }
        } else {
            for c in chunks {
                let reader = WindowReader {
                    source,
                    pos: c.member,
                    end: c.end,
                    buf: Vec::new(),
                    at: 0,
                };
                read_chunk(self.codec, io::BufReader::new(reader), c, path, &want, out)?;
            }
        }
        Ok(n as usize)
    }
}

/// Inflates chunk `c` from its member's compressed bytes, copies the part of it inside
/// `want` (file offsets; `out[0]` is file offset `want.start`) and verifies the digest
/// of the whole chunk.
fn read_chunk<R: io::BufRead>(
    codec: Codec,
    compressed: R,
    c: &Chunk,
    path: &str,
    want: &Range<u64>,
    out: &mut [u8],
) -> Result<()> {
    let what = || format!("chunk at offset {} of {path:?}", c.file_off);
    let decode_err = |what: &str, e: io::Error| match codec {
        Codec::Gzip => gz_err(what, e),
        Codec::Zstd => esgz(format!("zstd: {what}: {e}")),
    };
    let mut dec: Box<dyn Read + '_> = match codec {
        Codec::Gzip => Box::new(MultiGzDecoder::new(compressed)),
        Codec::Zstd => Box::new(super::zstd_chunked::decoder(compressed)?),
    };
    let skipped = io::copy(&mut (&mut dec).take(c.inner), &mut io::sink())
        .map_err(|e| decode_err(&what(), e))?;
    if skipped != c.inner {
        return Err(esgz(format!(
            "{}: member ends before innerOffset {}",
            what(),
            c.inner
        )));
    }
    let mut hasher = Sha256::new();
    let mut tmp = vec![0u8; c.len.min(DECODE_BUF) as usize];
    let mut pos = c.file_off;
    let end = c.file_off + c.len;
    while pos < end {
        let n = (end - pos).min(tmp.len() as u64) as usize;
        let got = match dec.read(&mut tmp[..n]) {
            Ok(0) => {
                return Err(esgz(format!(
                    "{}: member ends after {} of {} bytes",
                    what(),
                    pos - c.file_off,
                    c.len
                )));
            }
            Ok(got) => got.min(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(decode_err(&what(), e)),
        };
        hasher.update(&tmp[..got]);
        let lo = pos.max(want.start);
        let hi = (pos + got as u64).min(want.end);
        if lo < hi {
            out[(lo - want.start) as usize..(hi - want.start) as usize]
                .copy_from_slice(&tmp[(lo - pos) as usize..(hi - pos) as usize]);
        }
        pos += got as u64;
    }
    let actual: [u8; 32] = hasher.finalize().into();
    if actual != c.digest {
        return Err(Error::DigestMismatch {
            what: what(),
            expected: sha256_string(&c.digest),
            actual: sha256_string(&actual),
        });
    }
    Ok(())
}

/// Reads `[pos, end)` of a source in [`STREAM_WINDOW`]-sized requests.
struct WindowReader<'a> {
    source: &'a dyn RangeSource,
    pos: u64,
    end: u64,
    buf: Vec<u8>,
    at: usize,
}

impl Read for WindowReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.at == self.buf.len() {
            if self.pos >= self.end {
                return Ok(0);
            }
            let n = (self.end - self.pos).min(STREAM_WINDOW);
            self.buf = self.source.read_range(self.pos..self.pos + n)?;
            if self.buf.len() as u64 != n {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "source returned a short range",
                ));
            }
            self.pos += n;
            self.at = 0;
        }
        let k = out.len().min(self.buf.len() - self.at);
        out[..k].copy_from_slice(&self.buf[self.at..self.at + k]);
        self.at += k;
        Ok(k)
    }
}

/// Inflates the TOC member and returns the bytes of its `stargz.index.json` tar entry:
/// the member's first entry, read by the one tar reader (so headers, extension headers
/// and their bounds follow the rules every layer does).
fn extract_toc_json(gz: &[u8]) -> Result<Vec<u8>> {
    let limits = Limits {
        max_extension_bytes: MAX_TOC_EXTENSION,
        max_entries: 1,
    };
    let mut walker = TarWalker::with_limits(GzDecoder::new(gz), limits);
    let entry = walker
        .next_entry()
        .map_err(|e| esgz(format!("TOC member: {e}")))?
        .ok_or_else(|| esgz("TOC member holds no tar entry"))?;
    if entry.kind != EntryKind::File || entry.path != TOC_TAR_NAME {
        return Err(esgz(format!(
            "TOC member holds {:?} ({:?}), not the file {TOC_TAR_NAME}",
            entry.path, entry.kind
        )));
    }
    let size = entry.size;
    if size > MAX_TOC_JSON {
        return Err(esgz(format!(
            "TOC JSON of {size} bytes is larger than the {MAX_TOC_JSON}-byte limit"
        )));
    }
    let mut json = Vec::with_capacity(size.min(16 << 20) as usize);
    walker
        .read_to_end(&mut json)
        .map_err(|e| gz_err("TOC member", e))?;
    Ok(json)
}

fn entry_err(i: usize, t: &TocEntry, msg: impl fmt::Display) -> Error {
    esgz(format!("TOC entry {i} ({:?}): {msg}", t.name))
}

fn nonneg(i: usize, t: &TocEntry, v: i64, field: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| entry_err(i, t, format!("negative {field} {v}")))
}

fn id32(i: usize, t: &TocEntry, v: i64, field: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| entry_err(i, t, format!("{field} {v} out of range")))
}

/// Length of a chunk from its `chunkSize` (0 = the rest of the file).
fn chunk_len(i: usize, t: &TocEntry, remaining: u64) -> Result<u64> {
    let cs = nonneg(i, t, t.chunk_size, "chunkSize")?;
    if cs == 0 {
        Ok(remaining)
    } else if cs > remaining {
        Err(entry_err(
            i,
            t,
            format!("chunkSize {cs} runs past the end of the file ({remaining} bytes left)"),
        ))
    } else {
        Ok(cs)
    }
}

/// The chunk described by data entry `t`, starting at `file_off` in its file.
fn make_chunk(
    i: usize,
    t: &TocEntry,
    file_off: u64,
    len: u64,
    toc_offset: u64,
    whole_file: bool,
) -> Result<Chunk> {
    let member = nonneg(i, t, t.offset, "offset")?;
    if member >= toc_offset {
        return Err(entry_err(
            i,
            t,
            format!("offset {member} is not before the TOC at {toc_offset}"),
        ));
    }
    let inner = nonneg(i, t, t.inner_offset, "innerOffset")?;
    let digest = if !t.chunk_digest.is_empty() {
        parse_sha256_bytes(&t.chunk_digest)
            .map_err(|e| entry_err(i, t, format!("unsupported chunkDigest: {e}")))?
    } else if whole_file && !t.digest.is_empty() {
        // Legacy stargz TOCs have only the file digest; for an unchunked file it is the
        // chunk's digest.
        parse_sha256_bytes(&t.digest)
            .map_err(|e| entry_err(i, t, format!("unsupported digest: {e}")))?
    } else {
        return Err(entry_err(
            i,
            t,
            "no chunkDigest: its data cannot be verified",
        ));
    };
    Ok(Chunk {
        file_off,
        len,
        member,
        inner,
        end: 0,
        digest,
    })
}

/// Turns a parsed TOC into an [`EstargzLayer`], checking it.
fn build(
    toc: JToc,
    toc_digest: String,
    toc_offset: u64,
    blob_size: u64,
    codec: Codec,
) -> Result<EstargzLayer> {
    if toc.version != 1 {
        return Err(esgz(format!(
            "TOC version {} (only 1 is known)",
            toc.version
        )));
    }
    // Every member offset named by the TOC, plus the TOC's: a member's compressed extent
    // runs to the next one.
    let mut bounds: Vec<u64> = toc
        .entries
        .iter()
        .filter(|t| (t.typ == "reg" && t.size > 0) || t.typ == "chunk")
        .filter_map(|t| u64::try_from(t.offset).ok())
        .filter(|&o| o < toc_offset)
        .collect();
    bounds.push(toc_offset);
    bounds.sort_unstable();
    bounds.dedup();

    let n = toc.entries.len();
    let mut entries: Vec<Entry> = Vec::with_capacity(n);
    let mut data: Vec<Option<usize>> = Vec::with_capacity(n);
    let mut files: Vec<FileData> = Vec::new();
    // Per file: where its frames end (`endOffset`, zstd:chunked), 0 when not given.
    let mut file_ends: Vec<u64> = Vec::new();
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut by_path: HashMap<String, usize> = HashMap::with_capacity(n);
    let mut unames: HashMap<i64, String> = HashMap::new();
    let mut gnames: HashMap<i64, String> = HashMap::new();
    // The file whose chunks are being read: (index in `files`, bytes covered so far).
    let mut open: Option<(usize, u64)> = None;
    let mut landmark_seen = false;
    let mut prefetch = None;
    let mut prefetch_end = None;

    for (i, t) in toc.entries.iter().enumerate() {
        if t.typ == "chunk" {
            let Some((fi, next)) = open else {
                return Err(entry_err(
                    i,
                    t,
                    "chunk entry does not follow a regular file with data left",
                ));
            };
            let size = files[fi].size;
            let co = nonneg(i, t, t.chunk_offset, "chunkOffset")?;
            if co != next {
                return Err(entry_err(
                    i,
                    t,
                    format!("chunkOffset {co}, expected {next}"),
                ));
            }
            let len = chunk_len(i, t, size - next)?;
            chunks.push(make_chunk(i, t, next, len, toc_offset, false)?);
            files[fi].count += 1;
            open = if next + len == size {
                None
            } else {
                Some((fi, next + len))
            };
            continue;
        }
        if let Some((fi, next)) = open {
            return Err(entry_err(
                i,
                t,
                format!(
                    "the regular file before it is incomplete: its chunks cover {next} of {} bytes",
                    files[fi].size
                ),
            ));
        }
        let path =
            normalize_path(&t.name).ok_or_else(|| entry_err(i, t, "path has a '..' component"))?;
        if path.contains('\0') {
            return Err(entry_err(i, t, "path contains NUL"));
        }
        let kind = match t.typ.as_str() {
            "dir" => EntryKind::Dir,
            "reg" => EntryKind::File,
            "symlink" => EntryKind::Symlink,
            "hardlink" => EntryKind::Hardlink,
            "char" => EntryKind::Char,
            "block" => EntryKind::Block,
            "fifo" => EntryKind::Fifo,
            other => return Err(entry_err(i, t, format!("unknown type {other:?}"))),
        };
        if path.is_empty() && kind != EntryKind::Dir {
            return Err(entry_err(i, t, "the layer root is not a directory"));
        }
        let mode = nonneg(i, t, t.mode, "mode")? as u32 & 0o7777;
        let uid = id32(i, t, t.uid, "uid")?;
        let gid = id32(i, t, t.gid, "gid")?;
        // stargz writes a user/group name only when it changes for an id.
        let uname = if t.uname.is_empty() {
            unames.get(&t.uid).cloned().unwrap_or_default()
        } else {
            unames.insert(t.uid, t.uname.clone());
            t.uname.clone()
        };
        let gname = if t.gname.is_empty() {
            gnames.get(&t.gid).cloned().unwrap_or_default()
        } else {
            gnames.insert(t.gid, t.gname.clone());
            t.gname.clone()
        };
        // Like stargz, an unparsable time reads as unknown.
        let (mtime, mtime_nsec) = if t.modtime.is_empty() {
            (0, 0)
        } else {
            crate::rfc3339::parse(&t.modtime).unwrap_or((0, 0))
        };
        let size = if kind == EntryKind::File {
            nonneg(i, t, t.size, "size")?
        } else {
            0
        };
        let mut file_idx = None;
        let mut link_target = String::new();
        match kind {
            EntryKind::Symlink => {
                if t.link_name.contains('\0') {
                    return Err(entry_err(i, t, "link target contains NUL"));
                }
                link_target = t.link_name.clone();
            }
            EntryKind::Hardlink => {
                let target = normalize_path(&t.link_name)
                    .filter(|p| !p.is_empty() && !p.contains('\0'))
                    .ok_or_else(|| {
                        entry_err(i, t, format!("bad hard link target {:?}", t.link_name))
                    })?;
                let &ti = by_path.get(&target).ok_or_else(|| {
                    entry_err(
                        i,
                        t,
                        format!("hard link target {target:?} is not an earlier entry"),
                    )
                })?;
                if entries[ti].kind == EntryKind::Dir {
                    return Err(entry_err(
                        i,
                        t,
                        format!("hard link to directory {target:?}"),
                    ));
                }
                file_idx = data[ti];
                link_target = target;
            }
            EntryKind::File if size > 0 => {
                let co = nonneg(i, t, t.chunk_offset, "chunkOffset")?;
                if co != 0 {
                    return Err(entry_err(i, t, format!("first chunk has chunkOffset {co}")));
                }
                let len = chunk_len(i, t, size)?;
                let chunk = make_chunk(i, t, 0, len, toc_offset, len == size)?;
                files.push(FileData {
                    size,
                    first: chunks.len(),
                    count: 1,
                });
                file_ends.push(if codec == Codec::Zstd {
                    nonneg(i, t, t.end_offset, "endOffset")?
                } else {
                    0
                });
                chunks.push(chunk);
                file_idx = Some(files.len() - 1);
                if len < size {
                    open = Some((files.len() - 1, len));
                }
            }
            _ => {}
        }
        let (dev_major, dev_minor) = if matches!(kind, EntryKind::Char | EntryKind::Block) {
            (
                id32(i, t, t.dev_major, "devMajor")?,
                id32(i, t, t.dev_minor, "devMinor")?,
            )
        } else {
            (0, 0)
        };
        if kind == EntryKind::File
            && (path == PREFETCH_LANDMARK || path == NO_PREFETCH_LANDMARK || path == TOC_TAR_NAME)
        {
            if path != TOC_TAR_NAME && !landmark_seen {
                landmark_seen = true;
                if path == PREFETCH_LANDMARK {
                    prefetch = Some(
                        entries
                            .iter()
                            .filter(|e| e.kind == EntryKind::File)
                            .map(|e| e.path.clone())
                            .collect(),
                    );
                    prefetch_end = file_idx.map(|f| chunks[files[f].first].member);
                }
            }
            continue;
        }
        let xattrs = t
            .xattrs
            .iter()
            .map(|(k, v)| (k.clone(), v.0.clone()))
            .collect();
        by_path.insert(path.clone(), entries.len());
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
            offset: 0,
            header_offset: 0,
            link_target,
            dev_major,
            dev_minor,
            xattrs,
        });
        data.push(file_idx);
    }
    if let Some((fi, next)) = open {
        return Err(esgz(format!(
            "the last regular file is incomplete: its chunks cover {next} of {} bytes",
            files[fi].size
        )));
    }
    for c in &mut chunks {
        // `bounds` holds every chunk's member offset and ends with the TOC offset, which
        // is larger than all of them.
        let k = bounds.partition_point(|&b| b <= c.member);
        c.end = bounds.get(k).copied().unwrap_or(toc_offset);
    }
    if codec == Codec::Zstd {
        // A chunk's frames end where the file's next chunk starts, the last chunk's at
        // the file's `endOffset`: exact, where the next member named in the TOC would
        // also take the next entries' header frame. Used only where they make sense.
        for (f, &file_end) in files.iter().zip(&file_ends) {
            for j in f.first..f.first + f.count {
                let end = match chunks.get(j + 1) {
                    Some(next) if j + 1 < f.first + f.count => next.member,
                    _ => file_end,
                };
                if end > chunks[j].member && end <= chunks[j].end {
                    chunks[j].end = end;
                }
            }
        }
    }
    Ok(EstargzLayer {
        codec,
        toc_digest,
        toc_offset,
        blob_size,
        entries,
        data,
        files,
        chunks,
        prefetch,
        prefetch_end,
    })
}
