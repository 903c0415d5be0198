//! zstd:chunked, the seekable zstd layer of containers/storage (`pkg/chunked`), which
//! podman, buildah and skopeo write (`--compression-format zstd:chunked`).
//!
//! # The format
//!
//! The blob is an ordinary zstd stream of a tar (any zstd reader sees the layer), made
//! of many frames:
//!
//! * the tar headers between two files' data (with the padding after the data before
//!   them) are one frame; every non-empty regular file's data starts a new frame, and
//!   every chunk of a file (writers cut files at content-defined boundaries) is a frame
//!   of its own;
//! * after the tar stream come zstd *skippable frames* (magic `0x184D2A50`, a 4-byte
//!   little-endian length, the payload), which decoders skip: the compressed TOC (the
//!   "manifest": zstd-compressed JSON in the eStargz TOC model), then the tar-split data
//!   (what rebuilds the tar bit for bit), then a footer.
//! * The footer's payload is 64 bytes, little-endian u64s: manifest offset, compressed
//!   length, uncompressed length, manifest type (1), tar-split offset, compressed length,
//!   uncompressed length, then the magic `GNUlInUx`. Older writers wrote a 40-byte payload
//!   (the first four and the magic).
//! * TOC entries are eStargz's with `offset` and `endOffset` (the compressed extent of a
//!   file's frames), `chunkOffset`/`chunkSize`/`chunkDigest` per chunk (a chunk's frames
//!   end where the next chunk's start, the last at the file's `endOffset`), `chunkType`
//!   (`"zeros"` for a hole, whose frame still holds the zeros), and `digest`, the
//!   `sha256:` of the whole file (what verifies a file of one chunk).
//!
//! The layer descriptor carries `io.github.containers.zstd-chunked.manifest-checksum`,
//! the `sha256:` of the compressed TOC, and `...manifest-position`
//! (`offset:length:uncompressed length:type`); older writers used the
//! `io.containers.zstd-chunked.` prefix. The checksum is what makes the TOC, and through
//! it every chunk, verifiable: without it a layer is not read lazily.

use std::io::{self, Read, Write};

use ferry_oci::digest::parse_sha256_bytes;
use sha2::{Digest as _, Sha256};

use super::toc::{JToc, TocEntry, sha256_string};
use super::writer::{HashingWriter, push_header, tar_name, toc_entry};
use super::{DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MAX_TOC_COMPRESSED, MAX_TOC_JSON};
use crate::entry::EntryKind;
use crate::error::{Error, Result};
use crate::source::RangeSource;
use crate::tarwalk::TarWalker;

/// Magic of a zstd skippable frame (the first of the sixteen; what containers/storage
/// writes).
pub const SKIPPABLE_MAGIC: u32 = 0x184D_2A50;
/// Magic closing the footer's payload.
pub const FOOTER_MAGIC: &[u8; 8] = b"GNUlInUx";
/// Size of the footer frame: 8 bytes of skippable-frame header and 64 of payload.
pub const FOOTER_SIZE: u64 = 72;
/// Size of the older footer frame (a 40-byte payload, no tar-split fields).
pub const OLD_FOOTER_SIZE: u64 = 48;
/// The only manifest type there is (a CRFS/eStargz-style TOC).
pub const MANIFEST_TYPE_TOC: u64 = 1;
/// Largest zstd window a frame may ask for: 128 MiB, zstd's own default limit. Writers
/// declare large windows even for small chunks (containers/image's encoder: 32 MiB on a
/// 2 KiB chunk), and a decoder only touches as much of its window as the frame's data
/// fills, so the bound is on what a hostile frame can claim, not on what reads cost.
pub const MAX_WINDOW_LOG: u32 = 27;

fn zc(msg: impl Into<String>) -> Error {
    Error::Estargz(format!("zstd:chunked: {}", msg.into()))
}

/// Where the compressed TOC is: the `manifest-position` annotation or the footer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManifestPosition {
    /// Offset of the compressed TOC (after its skippable-frame header).
    pub offset: u64,
    /// Its compressed length.
    pub length: u64,
    /// Its uncompressed (JSON) length.
    pub uncompressed: u64,
}

impl ManifestPosition {
    /// Parses `offset:length:uncompressed length:type` (the type, when present, must be
    /// 1).
    pub fn parse(text: &str) -> Result<ManifestPosition> {
        let parts: Vec<&str> = text.split(':').collect();
        if !(parts.len() == 3 || parts.len() == 4) {
            return Err(zc(format!(
                "manifest position {text:?} is not offset:length:uncompressed:type"
            )));
        }
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| zc(format!("manifest position {text:?}: {s:?} is not a number")))
        };
        if parts.len() == 4 && num(parts[3])? != MANIFEST_TYPE_TOC {
            return Err(zc(format!(
                "manifest position {text:?}: manifest type {} is not a TOC (1)",
                parts[3]
            )));
        }
        Ok(ManifestPosition {
            offset: num(parts[0])?,
            length: num(parts[1])?,
            uncompressed: num(parts[2])?,
        })
    }

    /// The annotation's text.
    pub fn text(&self) -> String {
        format!(
            "{}:{}:{}:{MANIFEST_TYPE_TOC}",
            self.offset, self.length, self.uncompressed
        )
    }
}

fn le64(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i * 8..i * 8 + 8]);
    u64::from_le_bytes(a)
}

/// Parses the footer out of the tail of a blob (at least its last [`OLD_FOOTER_SIZE`]
/// bytes, normally its last [`FOOTER_SIZE`]): the current footer first, then the older
/// one.
pub fn parse_footer(tail: &[u8]) -> Result<ManifestPosition> {
    let try_size = |size: u64, payload: u32| -> Option<ManifestPosition> {
        let size = size as usize;
        let f = tail.get(tail.len().checked_sub(size)?..)?;
        let magic = u32::from_le_bytes([f[0], f[1], f[2], f[3]]);
        let len = u32::from_le_bytes([f[4], f[5], f[6], f[7]]);
        let p = &f[8..];
        (magic == SKIPPABLE_MAGIC
            && len == payload
            && &p[p.len() - 8..] == FOOTER_MAGIC
            && le64(p, 3) == MANIFEST_TYPE_TOC)
            .then(|| ManifestPosition {
                offset: le64(p, 0),
                length: le64(p, 1),
                uncompressed: le64(p, 2),
            })
    };
    try_size(FOOTER_SIZE, 64)
        .or_else(|| try_size(OLD_FOOTER_SIZE, 40))
        .ok_or_else(|| zc("no zstd:chunked footer at the end of the blob"))
}

/// The 72-byte footer frame for a TOC at `manifest` (no tar-split data: its fields are 0).
pub fn footer_bytes(manifest: &ManifestPosition) -> [u8; FOOTER_SIZE as usize] {
    let mut f = [0u8; FOOTER_SIZE as usize];
    f[..4].copy_from_slice(&SKIPPABLE_MAGIC.to_le_bytes());
    f[4..8].copy_from_slice(&64u32.to_le_bytes());
    for (i, v) in [
        manifest.offset,
        manifest.length,
        manifest.uncompressed,
        MANIFEST_TYPE_TOC,
    ]
    .into_iter()
    .enumerate()
    {
        f[8 + i * 8..16 + i * 8].copy_from_slice(&v.to_le_bytes());
    }
    f[64..72].copy_from_slice(FOOTER_MAGIC);
    f
}

/// Fetches and checks the compressed TOC of a zstd:chunked blob: located by `position`
/// (the annotation) or else by the footer, its bytes must hash to `checksum`
/// (`sha256:<hex>`, the `manifest-checksum` annotation); then decompressed (at most
/// [`MAX_TOC_JSON`] bytes). Returns the TOC JSON and the offset where the TOC's frame
/// begins (every chunk lies before it).
pub(crate) fn read_manifest(
    source: &dyn RangeSource,
    checksum: &str,
    position: Option<ManifestPosition>,
) -> Result<(Vec<u8>, u64)> {
    let expected =
        parse_sha256_bytes(checksum).map_err(|e| zc(format!("manifest checksum: {e}")))?;
    let blob_size = source.len();
    let pos = match position {
        Some(p) => p,
        None => {
            let n = blob_size.min(FOOTER_SIZE);
            let tail = source.read_range(blob_size - n..blob_size)?;
            if tail.len() as u64 != n {
                return Err(zc("source returned a short footer"));
            }
            parse_footer(&tail)?
        }
    };
    if pos.offset < 8 || pos.offset.saturating_add(pos.length) > blob_size {
        return Err(zc(format!(
            "TOC at {}..+{} is not inside the blob of {blob_size} bytes",
            pos.offset, pos.length
        )));
    }
    if pos.length > MAX_TOC_COMPRESSED || pos.uncompressed > MAX_TOC_JSON {
        return Err(zc(format!(
            "TOC of {} bytes ({} uncompressed) is larger than the limits ({MAX_TOC_COMPRESSED}, {MAX_TOC_JSON})",
            pos.length, pos.uncompressed
        )));
    }
    let compressed = source.read_range(pos.offset..pos.offset + pos.length)?;
    if compressed.len() as u64 != pos.length {
        return Err(zc("source returned a short TOC"));
    }
    let actual: [u8; 32] = Sha256::digest(&compressed).into();
    if actual != expected {
        return Err(Error::DigestMismatch {
            what: "zstd:chunked TOC".into(),
            expected: sha256_string(&expected),
            actual: sha256_string(&actual),
        });
    }
    let mut decoder = decoder(&compressed[..])?;
    let mut json = Vec::with_capacity(pos.uncompressed.min(16 << 20) as usize);
    (&mut decoder)
        .take(MAX_TOC_JSON + 1)
        .read_to_end(&mut json)
        .map_err(|e| zc(format!("TOC does not decompress: {e}")))?;
    if json.len() as u64 > MAX_TOC_JSON {
        return Err(zc(format!(
            "TOC JSON is larger than the {MAX_TOC_JSON}-byte limit"
        )));
    }
    Ok((json, pos.offset - 8))
}

/// A zstd decoder over `r` that reads frame after frame (skipping skippable ones) and
/// refuses windows over 2^[`MAX_WINDOW_LOG`].
pub(crate) fn decoder<'a, R: io::BufRead + 'a>(r: R) -> Result<zstd::stream::read::Decoder<'a, R>> {
    let mut d = zstd::stream::read::Decoder::with_buffer(r).map_err(Error::Io)?;
    d.window_log_max(MAX_WINDOW_LOG).map_err(Error::Io)?;
    Ok(d)
}

/// Options of [`convert`].
#[derive(Debug, Clone)]
pub struct ZstdChunkedOptions {
    /// Regular files larger than this are cut into chunks of this size, each its own
    /// frame with its own digest (1 ..= [`MAX_CHUNK_SIZE`]; default 4 MiB).
    pub chunk_size: u64,
    /// zstd level (1 ..= 19; default 3).
    pub level: i32,
}

impl Default for ZstdChunkedOptions {
    fn default() -> Self {
        ZstdChunkedOptions {
            chunk_size: DEFAULT_CHUNK_SIZE,
            level: 3,
        }
    }
}

/// What [`convert`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZstdChunkedOutput {
    /// Digest of the blob, `sha256:<hex>`.
    pub digest: String,
    /// Size of the blob in bytes.
    pub size: u64,
    /// Digest of the uncompressed tar stream (the layer's diff ID), `sha256:<hex>`.
    pub diff_id: String,
    /// `sha256:` of the compressed TOC (the `manifest-checksum` annotation).
    pub manifest_checksum: String,
    /// Where the TOC is (the `manifest-position` annotation: [`ManifestPosition::text`]).
    pub manifest_position: ManifestPosition,
}

/// Raw bytes gathered before a batch of frames is compressed (in parallel) and written:
/// bounds the converter's memory to about twice this.
const BATCH_BYTES: usize = 32 << 20;

/// One frame to be: its raw bytes, and the TOC entries whose offsets it sets.
struct Frame {
    raw: Vec<u8>,
    /// The TOC entry of the chunk this frame holds (its `offset` is the frame's start).
    chunk_entry: Option<usize>,
    /// The file's first TOC entry, when this frame is the file's last (its `endOffset`
    /// is the frame's end).
    ends_file: Option<usize>,
}

/// Frames waiting to be compressed and written, in order.
struct Batch<'a, W: Write> {
    blob: HashingWriter<W>,
    diff: Sha256,
    frames: Vec<Frame>,
    raw: usize,
    level: i32,
    pool: &'a rayon::ThreadPool,
}

impl<W: Write> Batch<'_, W> {
    fn push(&mut self, frame: Frame, entries: &mut [TocEntry]) -> Result<()> {
        self.raw += frame.raw.len();
        self.frames.push(frame);
        if self.raw >= BATCH_BYTES {
            self.flush(entries)?;
        }
        Ok(())
    }

    /// Compresses the frames gathered so far in parallel, writes them in order and sets
    /// the offsets of the TOC entries they hold.
    fn flush(&mut self, entries: &mut [TocEntry]) -> Result<()> {
        use rayon::prelude::*;
        let frames = std::mem::take(&mut self.frames);
        self.raw = 0;
        let level = self.level;
        let compressed: Vec<std::io::Result<Vec<u8>>> = self.pool.install(|| {
            frames
                .par_iter()
                .map(|f| zstd::bulk::compress(&f.raw, level))
                .collect()
        });
        for (f, z) in frames.iter().zip(compressed) {
            let z = z.map_err(Error::Io)?;
            self.diff.update(&f.raw);
            let start = self.blob.n;
            self.blob.put(&z)?;
            if let Some(e) = f.chunk_entry {
                entries[e].offset = start as i64;
            }
            if let Some(e) = f.ends_file {
                entries[e].end_offset = self.blob.n as i64;
            }
        }
        Ok(())
    }
}

/// Converts one uncompressed tar stream into a zstd:chunked blob written to `out`: every
/// file's data in frames of its own (one per chunk of at most `chunk_size`), the headers
/// between them in frames of their own, then the TOC and the footer in skippable frames.
/// Frames are compressed in parallel, in batches of about 32 MiB. Tar headers are
/// written anew from the parsed entries (as `ferry convert --estargz` does), so the diff
/// ID is that of the tar the blob decompresses to. No tar-split data is written: readers
/// that rebuild the original tar from it fetch the layer whole.
pub fn convert<W: Write>(
    input: &mut dyn Read,
    out: W,
    opts: &ZstdChunkedOptions,
) -> Result<ZstdChunkedOutput> {
    if opts.chunk_size == 0 || opts.chunk_size > MAX_CHUNK_SIZE {
        return Err(zc(format!(
            "chunk size {} is outside 1..={MAX_CHUNK_SIZE}",
            opts.chunk_size
        )));
    }
    if !(1..=19).contains(&opts.level) {
        return Err(zc(format!("zstd level {} is outside 1..=19", opts.level)));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("zstd-chunked-{i}"))
        .build()
        .map_err(|e| zc(format!("starting compression threads: {e}")))?;
    let mut batch = Batch {
        blob: HashingWriter::new(out),
        diff: Sha256::new(),
        frames: Vec::new(),
        raw: 0,
        level: opts.level,
        pool: &pool,
    };
    let mut walker = TarWalker::new(io::BufReader::with_capacity(1 << 20, input));
    let mut entries: Vec<TocEntry> = Vec::new();
    let mut headers: Vec<u8> = Vec::new();
    while let Some(e) = walker.next_entry()? {
        let name = tar_name(&e);
        push_header(&mut headers, &e, &name)?;
        let toc = toc_entry(&e, name, e.uname.clone(), e.gname.clone());
        if e.kind != EntryKind::File || e.size == 0 {
            entries.push(toc);
            continue;
        }
        // The headers so far close their frame; the data starts a new one.
        let raw = std::mem::take(&mut headers);
        batch.push(
            Frame {
                raw,
                chunk_entry: None,
                ends_file: None,
            },
            &mut entries,
        )?;
        let first = entries.len();
        let chunked = e.size > opts.chunk_size;
        let name = toc.name.clone();
        entries.push(toc);
        let mut file_hash = Sha256::new();
        let mut off = 0u64;
        while off < e.size {
            let n = (e.size - off).min(opts.chunk_size);
            let mut data = vec![0u8; n as usize];
            walker
                .read_exact(&mut data)
                .map_err(|err| match err.kind() {
                    io::ErrorKind::UnexpectedEof => Error::Tar {
                        entry: e.path.clone(),
                        offset: e.header_offset,
                        reason: format!("data ends after {off} of {} bytes", e.size),
                    },
                    _ => Error::Io(err),
                })?;
            file_hash.update(&data);
            let entry = if off == 0 {
                first
            } else {
                entries.push(TocEntry {
                    name: name.clone(),
                    typ: "chunk".into(),
                    ..TocEntry::default()
                });
                entries.len() - 1
            };
            if chunked {
                let t = &mut entries[entry];
                t.chunk_offset = off as i64;
                t.chunk_size = n as i64;
                t.chunk_digest = sha256_string(&Sha256::digest(&data).into());
            }
            off += n;
            batch.push(
                Frame {
                    raw: data,
                    chunk_entry: Some(entry),
                    ends_file: (off == e.size).then_some(first),
                },
                &mut entries,
            )?;
        }
        entries[first].digest = sha256_string(&file_hash.finalize().into());
        // The padding after the data opens the next headers' frame.
        headers.resize(((512 - e.size % 512) % 512) as usize, 0);
    }
    // The end-of-archive blocks close the tar stream.
    headers.extend_from_slice(&[0u8; 1024]);
    batch.push(
        Frame {
            raw: headers,
            chunk_entry: None,
            ends_file: None,
        },
        &mut entries,
    )?;
    batch.flush(&mut entries)?;
    let Batch { mut blob, diff, .. } = batch;
    let json = serde_json::to_vec(&JToc {
        version: 1,
        entries,
    })
    .map_err(|e| zc(format!("encoding the TOC: {e}")))?;
    let manifest = zstd::bulk::compress(&json, opts.level).map_err(Error::Io)?;
    let position = ManifestPosition {
        offset: blob.n + 8,
        length: manifest.len() as u64,
        uncompressed: json.len() as u64,
    };
    let len32 = u32::try_from(manifest.len()).map_err(|_| zc("TOC over 4 GiB"))?;
    blob.put(&SKIPPABLE_MAGIC.to_le_bytes())?;
    blob.put(&len32.to_le_bytes())?;
    blob.put(&manifest)?;
    blob.put(&footer_bytes(&position))?;
    blob.inner.flush()?;
    Ok(ZstdChunkedOutput {
        digest: sha256_string(&blob.hasher.finalize().into()),
        size: blob.n,
        diff_id: sha256_string(&diff.finalize().into()),
        manifest_checksum: sha256_string(&Sha256::digest(&manifest).into()),
        manifest_position: position,
    })
}
