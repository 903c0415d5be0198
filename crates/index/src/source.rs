//! Where compressed layer bytes come from.
//!
//! Every reader pulls bytes through a [`RangeSource`]: a local blob file now, an HTTP
//! Range client or a chunk store later. Readers never see the whole blob; they ask for the
//! exact ranges an index says they need, so counting what a source served is counting
//! what a read cost.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_oci::digest::is_sha256_hex;

/// Random-access, read-only bytes of one blob.
pub trait RangeSource: Send + Sync {
    /// Total size of the blob in bytes.
    fn len(&self) -> u64;

    /// True when the blob is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads exactly `range` of the blob. A range reaching past the end is an error
    /// (`UnexpectedEof`), never a short read.
    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>>;

    /// Reads several ranges; sources that can batch (HTTP) override this. Ranges are
    /// given sorted and non-overlapping.
    fn read_ranges(&self, ranges: &[Range<u64>]) -> io::Result<Vec<Vec<u8>>> {
        ranges.iter().map(|r| self.read_range(r.clone())).collect()
    }

    /// Whether [`RangeSource::read_ranges`] asks for several ranges in one request (so a
    /// caller counting requests counts one).
    fn batches_ranges(&self) -> bool {
        false
    }

    /// Whether every range this source returns of an indexed layer is made of spans it
    /// has already checked against the same index's span digests (a device-level source
    /// that verifies what it fetches and keeps), so a reader need not hash them again.
    /// Only such a source may say so.
    fn verifies_spans(&self) -> bool {
        false
    }

    /// Another blob from the same place as this one (the same registry repository, the
    /// same layout's blob directory), by `sha256:` digest and size: how a layer's reader
    /// reaches the windows blob of its index. `None` when this source cannot name one.
    fn sibling(&self, _digest: &str, _size: u64) -> Option<Arc<dyn RangeSource>> {
        None
    }
}

fn check_range(range: &Range<u64>, len: u64) -> io::Result<usize> {
    if range.start > range.end || range.end > len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "range {}..{} is outside the blob of {len} bytes",
                range.start, range.end
            ),
        ));
    }
    usize::try_from(range.end - range.start)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "range too large"))
}

/// A blob in a local file (an OCI layout's `blobs/sha256/<hex>`).
#[derive(Debug)]
pub struct FileSource {
    file: File,
    len: u64,
    path: PathBuf,
}

impl FileSource {
    /// Opens a blob file.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        Ok(FileSource {
            file,
            len,
            path: path.to_path_buf(),
        })
    }
}

impl RangeSource for FileSource {
    fn len(&self) -> u64 {
        self.len
    }

    /// For a file named by its digest (a layout blob), the file beside it named by
    /// `digest`, when it exists with `size` bytes.
    fn sibling(&self, digest: &str, size: u64) -> Option<Arc<dyn RangeSource>> {
        let hex = digest
            .strip_prefix("sha256:")
            .filter(|h| is_sha256_hex(h))?;
        let own = self.path.file_name()?.to_str()?;
        if !is_sha256_hex(own) {
            return None;
        }
        let other = FileSource::open(&self.path.with_file_name(hex)).ok()?;
        (other.len == size).then(|| Arc::new(other) as Arc<dyn RangeSource>)
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        let n = check_range(&range, self.len)?;
        let mut buf = vec![0u8; n];
        self.file.read_exact_at(&mut buf, range.start)?;
        Ok(buf)
    }
}

/// A blob held in memory (tests, small blobs).
#[derive(Debug, Clone)]
pub struct MemSource(pub Vec<u8>);

impl RangeSource for MemSource {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        check_range(&range, self.0.len() as u64)?;
        Ok(self.0[range.start as usize..range.end as usize].to_vec())
    }
}

/// Wraps a source and counts the bytes and requests it served (`ferry cat --stats`).
/// Several sources can share one pair of counters ([`CountingSource::shared`]), so an
/// image's layers add up into one total.
#[derive(Debug)]
pub struct CountingSource<S> {
    inner: S,
    bytes: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

impl<S: RangeSource> CountingSource<S> {
    /// Wraps `inner` with counters of its own.
    pub fn new(inner: S) -> Self {
        Self::shared(inner, Arc::default(), Arc::default())
    }

    /// Wraps `inner`, adding into counters other sources may share.
    pub fn shared(inner: S, bytes: Arc<AtomicU64>, requests: Arc<AtomicU64>) -> Self {
        CountingSource {
            inner,
            bytes,
            requests,
        }
    }

    /// Bytes served so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Requests served so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

impl<S: RangeSource> RangeSource for CountingSource<S> {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        let out = self.inner.read_range(range)?;
        self.bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    fn read_ranges(&self, ranges: &[Range<u64>]) -> io::Result<Vec<Vec<u8>>> {
        let out = self.inner.read_ranges(ranges)?;
        let total: u64 = out.iter().map(|b| b.len() as u64).sum();
        self.bytes.fetch_add(total, Ordering::Relaxed);
        // A batching source asks for a call's ranges in one request.
        let requests = if self.inner.batches_ranges() {
            1
        } else {
            ranges.len() as u64
        };
        self.requests.fetch_add(requests, Ordering::Relaxed);
        Ok(out)
    }

    fn batches_ranges(&self) -> bool {
        self.inner.batches_ranges()
    }

    /// The sibling, counted into the same counters.
    fn sibling(&self, digest: &str, size: u64) -> Option<Arc<dyn RangeSource>> {
        let other = self.inner.sibling(digest, size)?;
        Some(Arc::new(CountingSource::shared(
            other,
            self.bytes.clone(),
            self.requests.clone(),
        )))
    }
}

impl<T: RangeSource + ?Sized> RangeSource for Arc<T> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        (**self).read_range(range)
    }
    fn read_ranges(&self, ranges: &[Range<u64>]) -> io::Result<Vec<Vec<u8>>> {
        (**self).read_ranges(ranges)
    }
    fn batches_ranges(&self) -> bool {
        (**self).batches_ranges()
    }
    fn sibling(&self, digest: &str, size: u64) -> Option<Arc<dyn RangeSource>> {
        (**self).sibling(digest, size)
    }
}

/// Merges sorted ranges whose gap is at most `max_gap` bytes, so that neighbouring
/// needs become one request. Returns the merged ranges, sorted.
pub fn merge_ranges(mut ranges: Vec<Range<u64>>, max_gap: u64) -> Vec<Range<u64>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_by_key(|r| (r.start, r.end));
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end.saturating_add(max_gap) => {
                last.end = last.end.max(r.end);
            }
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_blob_reaches_its_siblings_by_digest() {
        let dir = tempfile::tempdir().unwrap();
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        std::fs::write(dir.path().join(&a), b"layer").unwrap();
        std::fs::write(dir.path().join(&b), b"windows").unwrap();
        let layer = FileSource::open(&dir.path().join(&a)).unwrap();
        let sib = layer.sibling(&format!("sha256:{b}"), 7).expect("sibling");
        assert_eq!(sib.read_range(0..7).unwrap(), b"windows");
        // Wrong size, missing blob, bad digest: none.
        assert!(layer.sibling(&format!("sha256:{b}"), 8).is_none());
        assert!(
            layer
                .sibling(&format!("sha256:{}", "c".repeat(64)), 7)
                .is_none()
        );
        assert!(layer.sibling("sha256:../../etc/passwd", 7).is_none());
        // A file not named by a digest has no siblings.
        std::fs::write(dir.path().join("plain"), b"x").unwrap();
        let plain = FileSource::open(&dir.path().join("plain")).unwrap();
        assert!(plain.sibling(&format!("sha256:{b}"), 7).is_none());
        // Counting wrappers count the sibling's reads too.
        let counted = CountingSource::new(layer);
        let sib = counted.sibling(&format!("sha256:{b}"), 7).unwrap();
        sib.read_range(0..3).unwrap();
        assert_eq!(counted.bytes_read(), 3);
    }

    #[test]
    fn merge_joins_touching_and_near_ranges() {
        let merged = merge_ranges(vec![10..20, 0..5, 5..8, 30..40, 21..22], 1);
        assert_eq!(merged, vec![0..8, 10..22, 30..40]);
    }

    #[test]
    fn mem_source_rejects_out_of_bounds() {
        let s = MemSource(vec![1, 2, 3]);
        assert_eq!(s.read_range(1..3).unwrap_or_default(), vec![2, 3]);
        assert!(s.read_range(2..4).is_err());
    }

    #[test]
    fn counting_source_counts() {
        let s = CountingSource::new(MemSource(vec![0; 100]));
        let _ = s.read_range(0..10);
        let _ = s.read_ranges(&[10..20, 50..55]);
        assert_eq!(s.bytes_read(), 25);
        assert_eq!(s.requests(), 3);
    }
}
