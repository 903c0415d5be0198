//! Which blobs this node can serve pieces of, and how a blob's byte ranges map to the
//! chunk store's entries.
//!
//! The store knows spans and inflate windows by their SHA-256 only; a peer asks for
//! bytes of a blob. The catalog keeps, per layer blob the node has mounted lazily (and
//! per windows blob of such a layer's version-2 index), the table of its verified pieces
//! and the registries it was resolved from (a peer's pull right is checked against one
//! of those, never against a registry the peer names freely).

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Arc;

use ferry_index::ferryidx::LayerIndex;
use ferry_oci::Digest;
use ferry_store::ChunkKey;
use parking_lot::Mutex;

/// Most registries remembered per blob.
const MAX_REGISTRIES_PER_BLOB: usize = 8;

/// What a blob served to and fetched from peers is, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobKind {
    /// A layer blob; its pieces are the index's compressed spans.
    Layer,
    /// The windows blob of a version-2 index; its pieces are the inflate windows.
    Windows,
}

/// A blob's spans (a layer's compressed spans, or a windows blob's windows): sorted
/// ranges and the SHA-256 of each, the digest the chunk store keeps the piece under.
/// Neighbours may share one byte: a gzip checkpoint that starts mid-byte starts its
/// span at the byte the previous span ends with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanTable {
    kind: BlobKind,
    size: u64,
    ranges: Vec<Range<u64>>,
    keys: Vec<ChunkKey>,
}

impl SpanTable {
    /// A table of `spans` in a blob of `size` bytes; `None` unless the spans are
    /// non-empty, sorted, inside the blob, and overlap their neighbours by one byte at
    /// most.
    pub fn new(size: u64, spans: Vec<(Range<u64>, ChunkKey)>) -> Option<SpanTable> {
        let mut prev: Option<&Range<u64>> = None;
        for (r, _) in &spans {
            let follows = prev.is_none_or(|p| {
                r.start > p.start && r.end > p.end && r.start.saturating_add(1) >= p.end
            });
            if !follows || r.end <= r.start || r.end > size {
                return None;
            }
            prev = Some(r);
        }
        let (ranges, keys) = spans.into_iter().unzip();
        Some(SpanTable {
            kind: BlobKind::Layer,
            size,
            ranges,
            keys,
        })
    }

    /// The table of a ferry index's spans over a blob of `size` bytes.
    pub fn of_index(index: &LayerIndex, size: u64) -> Option<SpanTable> {
        let spans = (0..index.span_digests.len())
            .map(|i| {
                let r = index.span_range(i)?;
                Some((r, ChunkKey::from_raw(index.span_digests[i])))
            })
            .collect::<Option<Vec<_>>>()?;
        SpanTable::new(size, spans)
    }

    /// The windows blob of a version-2 index and the table of its windows (each window's
    /// range and SHA-256, as the index names them: what the device verifies a window
    /// against and keys it by in the store); `None` when the index keeps no windows blob
    /// or its windows do not lie inside it in order.
    pub fn of_windows(index: &LayerIndex) -> Option<(Digest, SpanTable)> {
        let blob = index.windows.as_ref()?;
        let digest = ferry_oci::digest::parse_sha256(&blob.digest).ok()?;
        let spans = index
            .checkpoints
            .iter()
            .filter_map(|cp| cp.window.as_ref())
            .map(|w| (w.range(), ChunkKey::from_raw(w.sha256)))
            .collect();
        let mut table = SpanTable::new(blob.size, spans)?;
        table.kind = BlobKind::Windows;
        Some((digest, table))
    }

    /// What the blob is.
    pub fn kind(&self) -> BlobKind {
        self.kind
    }

    /// The blob's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The fewest consecutive spans that hold `range`'s bytes, as far as spans do
    /// (empty when none overlap it): a byte two spans share is taken from the later one
    /// at the start and from the earlier one at the end, so a range that is exactly a
    /// span is that span alone. Starts and ends are both strictly increasing
    /// ([`Self::new`]), which the searches rely on.
    pub fn covering(&self, range: &Range<u64>) -> Range<usize> {
        let n = self.ranges.len();
        let mut first = self
            .ranges
            .partition_point(|r| r.start <= range.start)
            .saturating_sub(1);
        if self.ranges.get(first).is_some_and(|r| r.end <= range.start) {
            first += 1;
        }
        if range.start >= range.end || self.ranges.get(first).is_none_or(|r| r.start >= range.end) {
            return first.min(n)..first.min(n);
        }
        let last = (self.ranges.partition_point(|r| r.end < range.end) + 1).min(n);
        first..last.max(first + 1)
    }

    /// The spans that make up exactly `range` (its ends on span boundaries, no gap
    /// between them, a byte two of them share counted once); `None` otherwise. Only such
    /// a range can be verified span by span.
    pub fn exactly(&self, range: &Range<u64>) -> Option<Range<usize>> {
        let ks = self.covering(range);
        if ks.is_empty()
            || self.ranges[ks.start].start != range.start
            || self.ranges[ks.end - 1].end != range.end
        {
            return None;
        }
        let contiguous = self.ranges[ks.clone()]
            .windows(2)
            .all(|w| w[1].start <= w[0].end);
        contiguous.then_some(ks)
    }

    /// Span `k`'s range and key.
    pub fn span(&self, k: usize) -> (&Range<u64>, &ChunkKey) {
        (&self.ranges[k], &self.keys[k])
    }
}

#[derive(Debug)]
struct Entry {
    table: Arc<SpanTable>,
    registries: BTreeSet<String>,
    touched: u64,
}

/// Layer blobs this node serves pieces of, bounded in entries (the least recently
/// registered or served go first).
#[derive(Debug)]
pub struct BlobCatalog {
    max_entries: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<Digest, Entry>,
    clock: u64,
}

impl BlobCatalog {
    /// A catalog of at most `max_entries` blobs (at least 1).
    pub fn new(max_entries: usize) -> BlobCatalog {
        BlobCatalog {
            max_entries: max_entries.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Records that `blob`, laid out as `table`, was resolved from `registry`.
    pub fn register(&self, blob: Digest, registry: &str, table: Arc<SpanTable>) {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let now = inner.clock;
        if !inner.entries.contains_key(&blob) && inner.entries.len() >= self.max_entries {
            // O(entries), only when a new blob arrives at a full catalog.
            if let Some(oldest) = inner
                .entries
                .iter()
                .min_by_key(|(_, e)| e.touched)
                .map(|(d, _)| d.clone())
            {
                inner.entries.remove(&oldest);
            }
        }
        let entry = inner.entries.entry(blob).or_insert_with(|| Entry {
            table: table.clone(),
            registries: BTreeSet::new(),
            touched: now,
        });
        entry.table = table;
        entry.touched = now;
        if entry.registries.len() < MAX_REGISTRIES_PER_BLOB {
            entry.registries.insert(registry.to_owned());
        }
    }

    /// The span table of `blob`, when `registry` is one it was resolved from.
    pub fn lookup(&self, blob: &Digest, registry: &str) -> Lookup {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let now = inner.clock;
        match inner.entries.get_mut(blob) {
            None => Lookup::Unknown,
            Some(e) if !e.registries.contains(registry) => Lookup::OtherRegistry,
            Some(e) => {
                e.touched = now;
                Lookup::Found(e.table.clone())
            }
        }
    }

    /// How many blobs are known.
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`BlobCatalog::lookup`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The blob is not one this node serves.
    Unknown,
    /// It is, but not as a blob of that registry.
    OtherRegistry,
    /// Its spans.
    Found(Arc<SpanTable>),
}
