//! Building a ferry index from a layer blob in one streaming pass.
//!
//! The blob is read once: the gzip indexer inflates it, placing checkpoints and hashing
//! spans, while the tar walker reads the uncompressed stream it yields and records the
//! file table. Nothing is written to disk and memory stays at a few buffers plus the
//! index itself.

use std::io::Read;

use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};
use crate::ferryidx::{Checkpoint, Compression, LayerIndex};
use crate::tarwalk::TarWalker;
use crate::zran::GzipIndexer;

/// Indexes a gzip layer blob read from `blob`, with checkpoints every `span` bytes of
/// uncompressed output. `expected_digest` (`sha256:<hex>`), when given, is checked
/// against the blob as read.
pub fn index_gzip(blob: impl Read, span: u64, expected_digest: Option<&str>) -> Result<LayerIndex> {
    check_span(span)?;
    let mut walker = TarWalker::new(GzipIndexer::new(blob, span));
    let mut entries = Vec::new();
    while let Some(e) = walker.next_entry()? {
        entries.push(e);
    }
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
    };
    index.validate()?;
    Ok(index)
}

/// Indexes an uncompressed tar layer: spans are plain `span`-byte slices of the blob.
pub fn index_tar(blob: impl Read, span: u64, expected_digest: Option<&str>) -> Result<LayerIndex> {
    check_span(span)?;
    let mut walker = TarWalker::new(SpanHasher::new(blob, span));
    let mut entries = Vec::new();
    while let Some(e) = walker.next_entry()? {
        entries.push(e);
    }
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
    };
    index.validate()?;
    Ok(index)
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
