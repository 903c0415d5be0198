//! Building a ferry index from a layer blob in one streaming pass.
//!
//! The blob is read once: the gzip indexer inflates it, placing checkpoints and hashing
//! spans, while the tar walker reads the uncompressed stream it yields and records the
//! file table. Nothing is written to disk and memory stays at a few buffers plus the
//! index itself (and, while an ELF file streams past, as much of it as its `.dynamic`
//! and names lie into, at most [`MAX_ELF_BYTES`]).
//!
//! Each ELF file's libraries ([`crate::ferryidx::Library`]) are read on the way: a mount
//! uses them to fetch a program's whole library chain at once.

use std::io::Read;

use sha2::{Digest as _, Sha256};

use crate::elf::Dependencies;
use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};
use crate::ferryidx::{Checkpoint, Compression, LayerIndex, Library};
use crate::tarwalk::TarWalker;
use crate::zran::GzipIndexer;

/// Indexes a gzip layer blob read from `blob`, with checkpoints every `span` bytes of
/// uncompressed output. `expected_digest` (`sha256:<hex>`), when given, is checked
/// against the blob as read.
pub fn index_gzip(blob: impl Read, span: u64, expected_digest: Option<&str>) -> Result<LayerIndex> {
    check_span(span)?;
    let mut walker = TarWalker::new(GzipIndexer::new(blob, span));
    let (entries, libraries) = walk(&mut walker)?;
    let gz = walker.into_inner().finish()?;
    let layer_digest = format!("sha256:{}", hex::encode(gz.blob_sha256));
    check_digest(expected_digest, &layer_digest)?;
    let index = LayerIndex {
        layer_digest,
        compression: Compression::Gzip,
        compressed_size: gz.compressed_size,
        uncompressed_size: gz.uncompressed_size,
        span_size: span,
        checkpoints: gz.checkpoints,
        span_digests: gz.span_digests,
        entries,
        windows: None,
        libraries,
    };
    index.validate()?;
    Ok(index)
}

/// Indexes an uncompressed tar layer: spans are plain `span`-byte slices of the blob.
pub fn index_tar(blob: impl Read, span: u64, expected_digest: Option<&str>) -> Result<LayerIndex> {
    check_span(span)?;
    let mut walker = TarWalker::new(SpanHasher::new(blob, span));
    let (entries, libraries) = walk(&mut walker)?;
    let mut hasher = walker.into_inner();
    std::io::copy(&mut hasher, &mut std::io::sink())?;
    let (size, blob_digest, span_digests) = hasher.finish();
    let layer_digest = format!("sha256:{}", hex::encode(blob_digest));
    check_digest(expected_digest, &layer_digest)?;
    let checkpoints = (0..span_digests.len() as u64)
        .map(|k| Checkpoint {
            in_offset: k * span,
            out_offset: k * span,
            ..Default::default()
        })
        .collect();
    let index = LayerIndex {
        layer_digest,
        compression: Compression::None,
        compressed_size: size,
        uncompressed_size: size,
        span_size: span,
        checkpoints,
        span_digests,
        entries,
        windows: None,
        libraries,
    };
    index.validate()?;
    Ok(index)
}

/// ELF files longer than this are not looked into: a mount reads such a file's
/// libraries from its bytes when it loads (the largest libraries of an ML image).
pub const MAX_ELF_BYTES: u64 = 256 << 20;
/// Bytes read from a file's start for its ELF header and program headers.
const ELF_HEAD_BYTES: u64 = 16 << 10;

/// Every entry of the tar, and the libraries of its ELF files.
fn walk<R: Read>(walker: &mut TarWalker<R>) -> Result<(Vec<Entry>, Vec<Library>)> {
    let (mut entries, mut libraries) = (Vec::new(), Vec::new());
    while let Some(e) = walker.next_entry()? {
        if let Some(deps) = elf_dependencies(walker, &e)? {
            libraries.push(Library {
                entry: entries.len() as u32,
                deps,
            });
        }
        entries.push(e);
    }
    Ok((entries, libraries))
}

/// The libraries of `entry` when it is a dynamically linked ELF file, from its data,
/// which the walker is at. A file that is not ELF, or whose headers are malformed, has
/// none (it is data, not the index's error); a broken stream is an error.
fn elf_dependencies<R: Read>(
    walker: &mut TarWalker<R>,
    entry: &Entry,
) -> Result<Option<Dependencies>> {
    if entry.kind != EntryKind::File || entry.size < 64 || entry.size > MAX_ELF_BYTES {
        return Ok(None);
    }
    let mut file = StreamedFile {
        walker,
        bytes: Vec::new(),
        size: entry.size,
        error: None,
    };
    file.fill_to(4);
    if !file.bytes.starts_with(b"\x7fELF") {
        return file.finish(None);
    }
    file.fill_to(ELF_HEAD_BYTES);
    let head = file.bytes.clone();
    let deps = crate::elf::dependencies(&head, entry.size, &mut |off, len| file.read(off, len));
    let deps = deps
        .ok()
        .filter(|d| d.interpreter.is_some() || !d.needed.is_empty());
    file.finish(deps)
}

/// The data of the walker's current file, read forward as far as asked and kept.
struct StreamedFile<'a, R> {
    walker: &'a mut TarWalker<R>,
    bytes: Vec<u8>,
    size: u64,
    error: Option<std::io::Error>,
}

impl<R: Read> StreamedFile<'_, R> {
    /// Reads on until `end` bytes (at most the file) are held; grows as bytes arrive, not
    /// by what the header claims.
    fn fill_to(&mut self, end: u64) {
        let end = end.min(self.size) as usize;
        while self.bytes.len() < end && self.error.is_none() {
            let at = self.bytes.len();
            let step = (end - at).min(1 << 20);
            self.bytes.resize(at + step, 0);
            match self.walker.read_data(&mut self.bytes[at..]) {
                Ok(0) => {
                    self.bytes.truncate(at);
                    return;
                }
                Ok(n) => self.bytes.truncate(at + n),
                Err(e) => {
                    self.bytes.truncate(at);
                    self.error = Some(e);
                }
            }
        }
    }

    fn read(&mut self, off: u64, len: usize) -> Option<Vec<u8>> {
        self.fill_to(off.saturating_add(len as u64));
        let start = usize::try_from(off).ok()?;
        let end = start.saturating_add(len).min(self.bytes.len());
        self.bytes.get(start..end).map(<[u8]>::to_vec)
    }

    fn finish(self, deps: Option<Dependencies>) -> Result<Option<Dependencies>> {
        match self.error {
            Some(e) => Err(e.into()),
            None => Ok(deps),
        }
    }
}

fn check_span(span: u64) -> Result<()> {
    if !(64 << 10..=1 << 30).contains(&span) {
        return Err(Error::Index(format!(
            "span {span} is outside 64 KiB ..= 1 GiB"
        )));
    }
    Ok(())
}

fn check_digest(expected: Option<&str>, actual: &str) -> Result<()> {
    match expected {
        Some(e) if e != actual => Err(Error::DigestMismatch {
            what: "layer blob".into(),
            expected: e.to_string(),
            actual: actual.to_string(),
        }),
        _ => Ok(()),
    }
}

/// Passes bytes through, hashing the whole stream and each fixed-size span.
struct SpanHasher<R> {
    inner: R,
    span: u64,
    pos: u64,
    whole: Sha256,
    current: Sha256,
    digests: Vec<[u8; 32]>,
}

impl<R: Read> SpanHasher<R> {
    fn new(inner: R, span: u64) -> Self {
        SpanHasher {
            inner,
            span,
            pos: 0,
            whole: Sha256::new(),
            current: Sha256::new(),
            digests: Vec::new(),
        }
    }

    fn finish(mut self) -> (u64, [u8; 32], Vec<[u8; 32]>) {
        if !self.pos.is_multiple_of(self.span) {
            let d = std::mem::take(&mut self.current).finalize().into();
            self.digests.push(d);
        }
        (self.pos, self.whole.finalize().into(), self.digests)
    }
}

impl<R: Read> Read for SpanHasher<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.whole.update(&buf[..n]);
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let room = (self.span - self.pos % self.span) as usize;
            let take = room.min(rest.len());
            self.current.update(&rest[..take]);
            self.pos += take as u64;
            rest = &rest[take..];
            if self.pos.is_multiple_of(self.span) {
                let d = std::mem::take(&mut self.current).finalize().into();
                self.digests.push(d);
            }
        }
        Ok(n)
    }
}
