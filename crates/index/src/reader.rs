//! One reader API over every layer format: "give me bytes `[off, off+len)` of this file".
//!
//! A [`LayerReader`] pairs a layer's file table with a [`RangeSource`] for its blob and
//! fetches only the compressed ranges the table says are needed, verifies every fetched
//! piece against its digest before use, and merges neighbouring needs into one request.
//! Formats: a ferry index over gzip or plain tar ([`LayerIndex`]), eStargz
//! ([`EstargzLayer`]), or — for layers with neither — the whole layer decompressed once
//! (zstd, gzip without index).

use std::io::{Read, Write};
use std::ops::Range;
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};
use crate::estargz::EstargzLayer;
use crate::ferryidx::{Compression, LayerIndex};
use crate::inflated::{InflatedSpans, LayerKey};
use crate::source::RangeSource;
use crate::windows::WindowSource;

/// Most uncompressed bytes one indexed read decompresses in a single pass; larger reads
/// are split into passes that start at checkpoints, so nothing is decompressed twice.
const MAX_PASS: u64 = 16 << 20;
/// How far back (uncompressed bytes) a read may start inflating at an earlier checkpoint
/// whose window is local, rather than fetch its own checkpoint's window.
const MAX_WALK_BACK: u64 = 4 << 20;

/// How a layer's bytes are reached.
#[derive(Debug, Clone)]
pub enum LayerFormat {
    /// A ferry index over the unmodified blob.
    Indexed(Arc<LayerIndex>),
    /// An eStargz blob with its TOC.
    Estargz(Arc<EstargzLayer>),
    /// No index: the whole uncompressed tar, fetched and decompressed once.
    Whole {
        /// The uncompressed tar stream.
        tar: Arc<Vec<u8>>,
        /// Its file table.
        entries: Arc<Vec<Entry>>,
    },
}

/// Random access to the files of one layer.
#[derive(Clone)]
pub struct LayerReader {
    format: LayerFormat,
    source: Arc<dyn RangeSource>,
    /// Where the windows of a version-2 index come from.
    windows: Option<Arc<dyn WindowSource>>,
    /// Recently inflated spans, shared with other readers (indexed gzip layers only).
    inflated: Option<(Arc<InflatedSpans>, LayerKey)>,
}

impl std::fmt::Debug for LayerReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerReader")
            .field("format", &self.format_name())
            .finish()
    }
}

impl LayerReader {
    /// A reader over `source` in the given format.
    pub fn new(format: LayerFormat, source: Arc<dyn RangeSource>) -> Self {
        LayerReader {
            format,
            source,
            windows: None,
            inflated: None,
        }
    }

    /// Gives the reader the windows of its version-2 index (checkpoints whose window is
    /// in the windows blob cannot be inflated without them).
    pub fn with_windows(mut self, windows: Arc<dyn WindowSource>) -> Self {
        self.windows = Some(windows);
        self
    }

    /// Reads a layer that has no index: fetches the whole blob and decompresses it
    /// (`compression` as in the layer's media type).
    pub fn whole(
        source: Arc<dyn RangeSource>,
        compression: ferry_oci::media::LayerCompression,
    ) -> Result<Self> {
        use ferry_oci::media::LayerCompression as C;
        let blob = source.read_range(0..source.len())?;
        let mut tar = Vec::new();
        match compression {
            C::None => tar = blob,
            C::Gzip => {
                flate2::read::MultiGzDecoder::new(&blob[..])
                    .read_to_end(&mut tar)
                    .map_err(|e| Error::Gzip(e.to_string()))?;
            }
            C::Zstd => {
                zstd::stream::read::Decoder::new(&blob[..])
                    .and_then(|mut d| d.read_to_end(&mut tar))
                    .map_err(|e| Error::Zstd(e.to_string()))?;
            }
        }
        let entries = crate::tarwalk::walk(&tar[..])?;
        Ok(LayerReader {
            format: LayerFormat::Whole {
                tar: Arc::new(tar),
                entries: Arc::new(entries),
            },
            source,
            windows: None,
            inflated: None,
        })
    }

    /// Keeps the spans this reader inflates in `cache` (shared with other readers, under
    /// a key of this reader's own), so reads inside a span inflated moments ago copy
    /// instead of inflating again. Only an indexed gzip layer uses it.
    pub fn with_inflated_cache(mut self, cache: Arc<InflatedSpans>) -> Self {
        if let LayerFormat::Indexed(index) = &self.format
            && index.compression == Compression::Gzip
        {
            let key = cache.new_key();
            self.inflated = Some((cache, key));
        }
        self
    }

    /// Short name of the format, for `ferry inspect`.
    pub fn format_name(&self) -> &'static str {
        match &self.format {
            LayerFormat::Indexed(i) if i.compression == Compression::Gzip => "gzip+ferry-index",
            LayerFormat::Indexed(_) => "tar+ferry-index",
            LayerFormat::Estargz(e) => e.format_name(),
            LayerFormat::Whole { .. } => "whole",
        }
    }

    /// What `ferry index` recorded of the libraries of entry `entry` (a regular file):
    /// `Some(Some(deps))` for a dynamically linked ELF file, `Some(None)` for a file it
    /// found none in (not ELF, static, or malformed), and `None` when the index has no
    /// records to say (an older index, another format, a file larger than
    /// [`crate::indexer::MAX_ELF_BYTES`]): then only the file's bytes tell.
    pub fn recorded_libraries(&self, entry: usize) -> Option<Option<&crate::elf::Dependencies>> {
        let LayerFormat::Indexed(index) = &self.format else {
            return None;
        };
        let file = index.entries.get(entry)?;
        if index.libraries.is_empty()
            || file.kind != crate::entry::EntryKind::File
            || file.size > crate::indexer::MAX_ELF_BYTES
        {
            return None;
        }
        let at = u32::try_from(entry).ok()?;
        Some(
            index
                .libraries
                .binary_search_by_key(&at, |l| l.entry)
                .ok()
                .map(|k| &index.libraries[k].deps),
        )
    }

    /// The format.
    pub fn format(&self) -> &LayerFormat {
        &self.format
    }

    /// The layer's file table.
    pub fn entries(&self) -> &[Entry] {
        match &self.format {
            LayerFormat::Indexed(i) => &i.entries,
            LayerFormat::Estargz(e) => e.entries(),
            LayerFormat::Whole { entries, .. } => entries,
        }
    }

    /// Reads bytes `[off, off + buf.len())` of regular-file entry `idx` into `buf`;
    /// returns how many were read (fewer only at the end of the file).
    pub fn read_at(&self, idx: usize, off: u64, buf: &mut [u8]) -> Result<usize> {
        let entry = self
            .entries()
            .get(idx)
            .ok_or_else(|| Error::NotFound(format!("entry #{idx}")))?;
        if entry.kind != EntryKind::File {
            return Err(Error::NotAFile {
                path: entry.path.clone(),
                reason: "not a regular file".into(),
            });
        }
        if off >= entry.size || buf.is_empty() {
            return Ok(0);
        }
        let len = (entry.size - off).min(buf.len() as u64) as usize;
        let buf = &mut buf[..len];
        match &self.format {
            LayerFormat::Indexed(index) => {
                read_indexed_with(
                    index,
                    self.source.as_ref(),
                    self.windows.as_deref(),
                    self.inflated.as_ref().map(|(c, k)| (c.as_ref(), k)),
                    entry.offset + off,
                    buf,
                )?;
                Ok(len)
            }
            LayerFormat::Estargz(layer) => layer.read_at(self.source.as_ref(), idx, off, buf),
            LayerFormat::Whole { tar, .. } => {
                let start = (entry.offset + off) as usize;
                let src = tar
                    .get(start..start + len)
                    .ok_or_else(|| Error::Index("file data outside the layer".into()))?;
                buf.copy_from_slice(src);
                Ok(len)
            }
        }
    }

    /// Streams the whole of file entry `idx` to `out`, in passes of at most 16 MiB.
    pub fn copy_file(&self, idx: usize, out: &mut dyn Write) -> Result<u64> {
        let size = self.entries().get(idx).map(|e| e.size).unwrap_or(0);
        let mut buf = vec![0u8; size.min(MAX_PASS) as usize];
        let mut off = 0u64;
        while off < size {
            let n = self.read_at(idx, off, &mut buf)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])?;
            off += n as u64;
        }
        Ok(off)
    }

    /// Compressed ranges a read of `[off, off+len)` of entry `idx` would fetch.
    pub fn ranges_for(&self, idx: usize, off: u64, len: u64) -> Vec<Range<u64>> {
        let Some(entry) = self.entries().get(idx) else {
            return Vec::new();
        };
        let len = len.min(entry.size.saturating_sub(off));
        if len == 0 {
            return Vec::new();
        }
        match &self.format {
            LayerFormat::Indexed(index) => {
                let u = entry.offset + off;
                match (index.span_for(u), index.span_for(u + len - 1)) {
                    (Some(i), Some(j)) => spans_range(index, i, j).into_iter().collect(),
                    _ => Vec::new(),
                }
            }
            LayerFormat::Estargz(layer) => layer.ranges_for(idx, off, len),
            LayerFormat::Whole { .. } => std::iter::once(0..self.source.len()).collect(),
        }
    }
}

/// The compressed range covering spans `i..=j`.
fn spans_range(index: &LayerIndex, i: usize, j: usize) -> Option<Range<u64>> {
    Some(index.span_range(i)?.start..index.span_range(j)?.end)
}

/// Reads uncompressed bytes `[u, u + out.len())` of an indexed layer: fetches the spans
/// that hold them in one request, verifies each span's digest, and inflates from the
/// checkpoint that starts the first one. When that checkpoint's window is in the
/// windows blob it is asked of `windows` alongside the span fetch (in a second thread
/// unless the window source says it is local).
pub fn read_indexed(
    index: &LayerIndex,
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    u: u64,
    out: &mut [u8],
) -> Result<()> {
    read_indexed_with(index, source, windows, None, u, out)
}

/// Reads of at most this many bytes go through the inflated-span cache; larger ones
/// (whole-file copies) stream past it in [`MAX_PASS`] passes and would only flush it.
const CACHED_READ_MAX: u64 = 1 << 20;

/// [`read_indexed`], with spans kept inflated in `cache` (gzip layers, reads up to
/// [`CACHED_READ_MAX`]): a read inside a cached span copies (inflating it further when
/// the span is not inflated that far yet); a miss inside one span starts it and inflates
/// only as far as the read goes; a miss across spans inflates them whole and keeps them.
fn read_indexed_with(
    index: &LayerIndex,
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    cache: Option<(&InflatedSpans, &LayerKey)>,
    u: u64,
    out: &mut [u8],
) -> Result<()> {
    // Windows are kept for reads of any size; spans only for small reads.
    let kept = cache.filter(|_| index.compression == Compression::Gzip);
    let cache = kept.filter(|_| out.len() as u64 <= CACHED_READ_MAX);
    let want_end = u + out.len() as u64;
    let mut done = 0usize;
    while done < out.len() {
        let pos = u + done as u64;
        let k = index.span_for(pos).ok_or_else(|| {
            Error::Index(format!(
                "offset {pos} is outside the layer's {} bytes",
                index.uncompressed_size
            ))
        })?;
        let dst = &mut out[done..];
        let cached = match cache {
            Some((c, key)) => cached_pass(index, source, windows, (c, key), k, pos, want_end, dst)?,
            None => None,
        };
        done += match cached {
            Some(n) => n,
            None => plain_pass(index, source, windows, kept, k, pos, want_end, dst)?,
        };
    }
    Ok(())
}

/// Where span `k`'s uncompressed bytes end.
fn span_out_end(index: &LayerIndex, k: usize) -> u64 {
    index
        .checkpoints
        .get(k + 1)
        .map(|c| c.out_offset)
        .unwrap_or(index.uncompressed_size)
}

/// One pass without the cache: spans from span `k` (or an earlier local start) on, up
/// to [`MAX_PASS`] or the read's end; fills the start of `dst` (the read from `pos` on)
/// and returns how many bytes it filled.
#[allow(clippy::too_many_arguments)]
fn plain_pass(
    index: &LayerIndex,
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    kept: Option<(&InflatedSpans, &LayerKey)>,
    k: usize,
    pos: u64,
    want_end: u64,
    dst: &mut [u8],
) -> Result<usize> {
    let first = local_start(index, windows, kept, k, pos);
    // Take spans until the pass covers what is left or reaches MAX_PASS.
    let mut last = first;
    while let Some(next) = index.checkpoints.get(last + 1) {
        if next.out_offset >= want_end
            || next.out_offset - index.checkpoints[first].out_offset >= MAX_PASS
        {
            break;
        }
        last += 1;
    }
    let take = (want_end.min(span_out_end(index, last)) - pos) as usize;
    let dst = dst
        .get_mut(..take)
        .ok_or_else(|| Error::Index("read pass beyond its buffer".into()))?;
    inflate_spans(index, source, windows, kept, first, last, pos, dst)?;
    Ok(take)
}

/// One pass through the cache: copies from span `k` when it is cached (inflated as far
/// as the read needs); otherwise, for a read inside span `k` that starts at its own
/// checkpoint, keeps the span with its inflater and inflates it only as far as the
/// read goes; else inflates spans `k..=last` whole (the last one the read touches; from
/// an earlier local start if [`local_start`] says so), keeps them and copies. `None`
/// when a span is too large to keep (the caller reads without the cache).
#[allow(clippy::too_many_arguments)]
fn cached_pass(
    index: &LayerIndex,
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    (cache, key): (&InflatedSpans, &LayerKey),
    k: usize,
    pos: u64,
    want_end: u64,
    dst: &mut [u8],
) -> Result<Option<usize>> {
    let span_start = index.checkpoints[k].out_offset;
    let from = (pos - span_start) as usize;
    let in_span = (want_end.min(span_out_end(index, k)) - pos) as usize;
    if let Some(span) = cache.get(key, k) {
        let out = dst
            .get_mut(..in_span)
            .ok_or_else(|| Error::Index("read pass beyond its buffer".into()))?;
        cache.read(key, k, &span, from, out)?;
        return Ok(Some(in_span));
    }
    let mut last = k;
    while index
        .checkpoints
        .get(last + 1)
        .is_some_and(|next| next.out_offset < want_end)
    {
        last += 1;
    }
    if (k..=last).any(|j| !cache.admits(span_out_end(index, j) - index.checkpoints[j].out_offset)) {
        return Ok(None);
    }
    let first = local_start(index, windows, Some((cache, key)), k, pos);
    if first == k && last == k {
        // The read is inside one span: inflate it only as far as the read goes, and
        // keep the inflater for the reads after it.
        let (data, window) = fetch_verified(index, source, windows, Some((cache, key)), k, k)?;
        let cp = &index.checkpoints[k];
        let extraction = crate::zran::Extraction::start(cp, window.as_window(cp), &data)?;
        let window_at_end = windows.is_some_and(|w| {
            index.checkpoints.get(k + 1).is_some_and(|next| {
                next.window
                    .as_ref()
                    .is_some_and(|at| !w.is_local(k + 1, at) && !cache.has_window(key, k + 1))
            })
        });
        let len = (span_out_end(index, k) - span_start) as usize;
        let span = cache.insert_partial(key, k, len, extraction, data, window_at_end);
        let out = dst
            .get_mut(..in_span)
            .ok_or_else(|| Error::Index("read pass beyond its buffer".into()))?;
        cache.read(key, k, &span, from, out)?;
        return Ok(Some(in_span));
    }
    let from = index.checkpoints[first].out_offset;
    let end = span_out_end(index, last);
    // At most MAX_WALK_BACK + CACHED_READ_MAX + one admitted span.
    let mut all = vec![0u8; (end - from) as usize];
    inflate_spans(
        index,
        source,
        windows,
        Some((cache, key)),
        first,
        last,
        from,
        &mut all,
    )?;
    cache.note_inflated(all.len() as u64);
    let take = (want_end.min(end) - pos) as usize;
    let at = (pos - from) as usize;
    dst.get_mut(..take)
        .ok_or_else(|| Error::Index("read pass beyond its buffer".into()))?
        .copy_from_slice(&all[at..at + take]);
    // Spans walked back over were inflated too: keep them, a reader moving around the
    // stream may come back to them.
    for j in first..=last {
        let a = (index.checkpoints[j].out_offset - from) as usize;
        let b = (span_out_end(index, j) - from) as usize;
        if cache.admits((b - a) as u64) {
            cache.insert(key, j, all[a..b].to_vec());
        }
    }
    Ok(Some(take))
}

/// Fetches spans `first..=last` (and the first one's window, unless `kept` has it),
/// verifies them and inflates from the first checkpoint: `dst` receives the bytes from
/// `pos` on. The window of the last checkpoint the pass reaches goes into `kept` on the
/// way, when it is neither local nor kept already: a read moving on starts there next
/// and needs no request for its window.
#[allow(clippy::too_many_arguments)]
fn inflate_spans(
    index: &LayerIndex,
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    kept: Option<(&InflatedSpans, &LayerKey)>,
    first: usize,
    last: usize,
    pos: u64,
    dst: &mut [u8],
) -> Result<()> {
    let cp = &index.checkpoints[first];
    let (data, window) = fetch_verified(index, source, windows, kept, first, last)?;
    match index.compression {
        Compression::Gzip => {
            let window = window.as_window(cp);
            // The last checkpoint the pass reaches: where a reader moving on starts next
            // (the ones before it are inside spans the pass leaves in the span cache).
            let end = pos + dst.len() as u64;
            let keep = match (windows, kept) {
                (Some(w), Some((c, key))) => (first + 1..index.checkpoints.len())
                    .take_while(|&j| index.checkpoints[j].out_offset <= end)
                    .last()
                    .filter(|&j| {
                        index.checkpoints[j]
                            .window
                            .as_ref()
                            .is_some_and(|at| !w.is_local(j, at) && !c.has_window(key, j))
                    })
                    .map(|j| (c, key, j)),
                _ => None,
            };
            let at = keep.map(|(_, _, j)| index.checkpoints[j].out_offset - cp.out_offset);
            crate::zran::extract_capturing(
                cp,
                window,
                &data,
                pos - cp.out_offset,
                dst,
                at.as_slice(),
                &mut |_, raw| {
                    if let Some((c, key, j)) = keep {
                        c.insert_window(key, j, raw);
                    }
                },
            )
        }
        Compression::None => {
            let skip = (pos - cp.out_offset) as usize;
            let src = data
                .get(skip..skip + dst.len())
                .ok_or_else(|| Error::Index("plain span too short".into()))?;
            dst.copy_from_slice(src);
            Ok(())
        }
    }
}

/// The window a pass starts its inflater with.
enum StartWindow {
    /// Raw, kept by an earlier read that inflated through the checkpoint.
    Kept(Arc<Vec<u8>>),
    /// Deflated, fetched from the windows blob (and verified).
    Fetched(Vec<u8>),
    /// The one in the index (or none needed).
    InIndex,
}

impl StartWindow {
    fn as_window<'a>(&'a self, cp: &'a crate::ferryidx::Checkpoint) -> crate::zran::Window<'a> {
        match self {
            StartWindow::Kept(raw) => crate::zran::Window::Raw(raw),
            StartWindow::Fetched(deflated) => crate::zran::Window::Deflated(deflated),
            StartWindow::InIndex => crate::zran::Window::Deflated(&cp.window_deflate),
        }
    }
}

/// Fetches spans `first..=last` and, unless `kept` has it, the first one's window;
/// verifies the spans.
fn fetch_verified(
    index: &LayerIndex,
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    kept: Option<(&InflatedSpans, &LayerKey)>,
    first: usize,
    last: usize,
) -> Result<(Vec<u8>, StartWindow)> {
    let range = spans_range(index, first, last)
        .ok_or_else(|| Error::Index("span outside the index".into()))?;
    let cp = &index.checkpoints[first];
    let kept_window = match (&cp.window, kept) {
        (Some(_), Some((c, key))) => c.get_window(key, first),
        _ => None,
    };
    let (data, window) = match kept_window {
        Some(raw) => (source.read_range(range.clone())?, StartWindow::Kept(raw)),
        None => match fetch_span_and_window(source, windows, range.clone(), first, cp)? {
            (data, Some(deflated)) => (data, StartWindow::Fetched(deflated)),
            (data, None) => (data, StartWindow::InIndex),
        },
    };
    if !source.verifies_spans() {
        verify_spans(index, first, last, range.start, &data)?;
    }
    Ok((data, window))
}

/// Where a pass reading from `pos` (in span `k`) should start inflating. Normally `k`.
/// But a pass stores every span it reads while fetching only its first checkpoint's
/// window, so span `k` may be local without its window: then start at the nearest
/// earlier checkpoint (within [`MAX_WALK_BACK`]) that needs no fetch — its window local
/// or not needed, every span from it to `k` local. That costs some inflating instead of
/// a round trip, and keeps cached data readable while the registry is unreachable.
fn local_start(
    index: &LayerIndex,
    windows: Option<&dyn WindowSource>,
    kept: Option<(&InflatedSpans, &LayerKey)>,
    k: usize,
    pos: u64,
) -> usize {
    let Some(w) = windows else { return k };
    let Some(at) = &index.checkpoints[k].window else {
        return k;
    };
    let has = |j: usize, at: &crate::ferryidx::WindowRef| {
        w.is_local(j, at) || kept.is_some_and(|(c, key)| c.has_window(key, j))
    };
    if has(k, at) || !w.span_is_local(k) {
        return k;
    }
    let mut j = k;
    while j > 0 {
        j -= 1;
        let cp = &index.checkpoints[j];
        if pos.saturating_sub(cp.out_offset) > MAX_WALK_BACK || !w.span_is_local(j) {
            return k;
        }
        match &cp.window {
            None => return j,
            Some(at) if has(j, at) => return j,
            Some(_) => {}
        }
    }
    k
}

/// The compressed bytes of `range` and, when checkpoint `k` keeps its window in the
/// windows blob, that window: fetched at the same time when the window is not local.
fn fetch_span_and_window(
    source: &dyn RangeSource,
    windows: Option<&dyn WindowSource>,
    range: Range<u64>,
    k: usize,
    cp: &crate::ferryidx::Checkpoint,
) -> Result<(Vec<u8>, Option<Vec<u8>>)> {
    let Some(at) = &cp.window else {
        return Ok((source.read_range(range)?, None));
    };
    let windows = windows.ok_or_else(|| {
        Error::Index(format!(
            "checkpoint {k} keeps its window in the windows blob, and this reader has no \
             source for it"
        ))
    })?;
    if windows.is_local(k, at) {
        let window = windows.window(k, at)?;
        return Ok((source.read_range(range)?, Some(window)));
    }
    std::thread::scope(|s| {
        let fetching = std::thread::Builder::new()
            .name("ferry-window".into())
            .spawn_scoped(s, || windows.window(k, at))?;
        let span = source.read_range(range);
        let window = fetching
            .join()
            .map_err(|_| Error::Index(format!("fetching the window of checkpoint {k} panicked")))?;
        Ok((span?, Some(window?)))
    })
}

/// Checks the digest of every span in `first..=last` within `data`, which starts at blob
/// offset `base`.
fn verify_spans(
    index: &LayerIndex,
    first: usize,
    last: usize,
    base: u64,
    data: &[u8],
) -> Result<()> {
    for k in first..=last {
        let r = index
            .span_range(k)
            .ok_or_else(|| Error::Index("span outside the index".into()))?;
        let piece = data
            .get((r.start - base) as usize..(r.end - base) as usize)
            .ok_or_else(|| {
                Error::Index("fetched range shorter than the spans it should hold".into())
            })?;
        let actual: [u8; 32] = Sha256::digest(piece).into();
        if actual != index.span_digests[k] {
            return Err(Error::DigestMismatch {
                what: format!("span {k} of layer {}", index.layer_digest),
                expected: hex::encode(index.span_digests[k]),
                actual: hex::encode(actual),
            });
        }
    }
    Ok(())
}
