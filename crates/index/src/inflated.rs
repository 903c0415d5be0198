//! A bounded memory cache of recently inflated spans of indexed gzip layers, and of the
//! inflate windows reads passed on the way, shared by every reader of a process.
//!
//! Why: a read inside a span must inflate from the span's checkpoint up to the bytes it
//! wants. A workload that starts reads many small neighbouring files (a Python import
//! opens hundreds of `.py`/`.so` files that sit next to each other in the tar), so
//! without this each of them inflates the same span prefix again: a profile of a
//! container start through FUSE spent most of the daemon's CPU in inflate, about five
//! times the bytes served. With it, the first read of a span inflates it once, as far
//! as that read goes, and the neighbours copy or continue from there.
//!
//! The windows: a read starting at a checkpoint of a version-2 index needs that
//! checkpoint's 32 KiB window, a request to the windows blob. A read that inflated
//! through the checkpoint had exactly that history in its inflater, so it keeps it here
//! (raw: no deflate, no digest, it derives from verified bytes) and the next read along
//! the stream starts from it without a request.
//!
//! A span is inflated only as far as reads have asked (and a little beyond): the entry
//! keeps the span's verified compressed bytes and the inflater, and the next read past
//! what is inflated continues from there. The part of a span no read reaches — often
//! most of it, when one small file is wanted from a span of neighbours — is never
//! inflated.
//!
//! What it must not do: hold memory for long. It is a start-up accelerator, bounded by
//! `max_bytes` (least recently used spans go first), and [`InflatedSpans::release_idle`]
//! drops what was not used since its previous call, so a caller ticking it every few
//! seconds gives the memory back once the burst is over. It holds only bytes a reader
//! has already verified (inflated, or compressed waiting to be); it never fetches.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::zran::{Extraction, WINDOW_SIZE};

/// Identifies one reader's spans in the cache; see [`InflatedSpans::new_key`].
pub type LayerKey = u64;

#[derive(Debug)]
struct Entry {
    data: Held,
    /// Bytes the entry counts against its bound.
    size: usize,
    last_use: u64,
}

#[derive(Debug, Clone)]
enum Held {
    Span(Arc<Span>),
    Window(Arc<Vec<u8>>),
}

/// Least inflated at a time when a read continues a span, so that a run of small
/// neighbouring files does not wake the inflater once per file.
const MIN_STEP: usize = 64 << 10;

/// A span in the cache: its inflated bytes so far, and, until it is whole, what
/// continues them.
#[derive(Debug)]
pub struct Span {
    state: Mutex<SpanState>,
}

#[derive(Debug)]
struct SpanState {
    /// Inflated bytes from the span's start (all `len` once whole).
    bytes: Vec<u8>,
    /// The span's uncompressed length.
    len: usize,
    rest: Option<Continuation>,
}

#[derive(Debug)]
struct Continuation {
    extraction: Extraction,
    /// The span's compressed bytes, verified.
    compressed: Vec<u8>,
    /// Keep the inflate history at the span's end as the next checkpoint's window.
    window_at_end: bool,
}

impl Span {
    fn whole(bytes: Vec<u8>) -> Arc<Span> {
        Arc::new(Span {
            state: Mutex::new(SpanState {
                len: bytes.len(),
                bytes,
                rest: None,
            }),
        })
    }

    /// Bytes inflated so far.
    pub fn inflated(&self) -> usize {
        self.state.lock().bytes.len()
    }

    /// The span's uncompressed length.
    pub fn len(&self) -> usize {
        self.state.lock().len
    }

    /// True for an empty span (never admitted to the cache).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What an entry holds of its layer: a span's inflated bytes, or the raw inflate window
/// at a checkpoint (the 32 KiB of history a read starting there needs, taken by a read
/// that inflated its way through it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Piece {
    Span(usize),
    Window(usize),
}

impl Piece {
    fn is_window(self) -> bool {
        matches!(self, Piece::Window(_))
    }
}

impl Inner {
    /// The byte count `piece`'s kind is bounded by.
    fn bytes_of(&mut self, piece: Piece) -> &mut usize {
        if piece.is_window() {
            &mut self.window_bytes
        } else {
            &mut self.bytes
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<(LayerKey, Piece), Entry>,
    /// The last key handed out.
    keys: u64,
    /// Bytes of spans held (bound: `max_bytes`).
    bytes: usize,
    /// Bytes of windows held (bound: a quarter of `max_bytes`, on top of the spans: a
    /// window is needed right after the read that kept it, and must not cost a span).
    window_bytes: usize,
    /// Advances on every use; orders entries for eviction.
    tick: u64,
    /// Entries last used before this tick are idle at the next `release_idle`.
    idle_before: u64,
}

/// Counters, for status and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InflatedStats {
    /// Reads of a span served from the cache.
    pub hits: u64,
    /// Spans inflated and put in the cache.
    pub inserts: u64,
    /// Bytes inflated to fill the cache (spans as far as reads went, and any walk back to a local
    /// checkpoint before them).
    #[serde(default)]
    pub inflated_bytes: u64,
    /// Bytes held right now.
    pub bytes: u64,
    /// Raw windows kept (see [`InflatedSpans::insert_window`]).
    #[serde(default)]
    pub windows_kept: u64,
    /// Reads that started at a checkpoint with a kept window instead of fetching it.
    #[serde(default)]
    pub window_hits: u64,
}

/// The cache (see the module doc).
#[derive(Debug)]
pub struct InflatedSpans {
    max_bytes: usize,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    inserts: AtomicU64,
    inflated_bytes: AtomicU64,
    windows_kept: AtomicU64,
    window_hits: AtomicU64,
}

impl InflatedSpans {
    /// A cache holding at most `max_bytes` of inflated spans (0: it holds nothing).
    pub fn new(max_bytes: usize) -> Arc<InflatedSpans> {
        Arc::new(InflatedSpans {
            max_bytes,
            inner: Mutex::new(Inner::default()),
            hits: AtomicU64::new(0),
            inserts: AtomicU64::new(0),
            inflated_bytes: AtomicU64::new(0),
            windows_kept: AtomicU64::new(0),
            window_hits: AtomicU64::new(0),
        })
    }

    /// A key for one layer reader's spans. Spans are numbered by the reader's own index,
    /// and two indexes of one layer (other span sizes, or one that lies) must never see
    /// each other's bytes, so every reader gets its own key rather than the layer's
    /// digest.
    pub fn new_key(&self) -> LayerKey {
        let mut inner = self.inner.lock();
        inner.keys += 1;
        inner.keys
    }

    /// Whether a span of `len` inflated bytes is worth keeping: at most a quarter of
    /// the bound, so one large span cannot flush everything else.
    pub fn admits(&self, len: u64) -> bool {
        len > 0 && len <= (self.max_bytes / 4) as u64
    }

    /// Span `span` of `layer`, if cached (whole or in part: [`Self::read`] reads it).
    pub fn get(&self, layer: &LayerKey, span: usize) -> Option<Arc<Span>> {
        let got = match self.get_piece(layer, Piece::Span(span))? {
            Held::Span(s) => s,
            Held::Window(_) => return None,
        };
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(got)
    }

    /// Keeps span `span` of `layer` (its whole inflated bytes), evicting the least
    /// recently used entries to stay within the bound. Spans [`Self::admits`] refuses
    /// are ignored.
    pub fn insert(&self, layer: &LayerKey, span: usize, data: Vec<u8>) {
        let size = data.len();
        if self.insert_piece(
            layer,
            Piece::Span(span),
            Held::Span(Span::whole(data)),
            size,
        ) {
            self.inserts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Span `span` of `layer` (`len` bytes once inflated), to be inflated on demand by
    /// `extraction` (started at the span's checkpoint) from `compressed`, the span's
    /// verified compressed bytes. Kept (counting `len` and the compressed bytes until
    /// it is whole) when [`Self::admits`] its length; returned either way, for the
    /// caller's read. `window_at_end`: keep the history at the span's end as the raw
    /// window of checkpoint `span + 1` (see [`Self::insert_window`]).
    pub fn insert_partial(
        &self,
        layer: &LayerKey,
        span: usize,
        len: usize,
        extraction: Extraction,
        compressed: Vec<u8>,
        window_at_end: bool,
    ) -> Arc<Span> {
        let size = len + compressed.len();
        let cell = Arc::new(Span {
            state: Mutex::new(SpanState {
                bytes: Vec::with_capacity(len),
                len,
                rest: Some(Continuation {
                    extraction,
                    compressed,
                    window_at_end,
                }),
            }),
        });
        if self.admits(len as u64)
            && self.insert_piece(layer, Piece::Span(span), Held::Span(cell.clone()), size)
        {
            self.inserts.fetch_add(1, Ordering::Relaxed);
        }
        cell
    }

    /// Copies bytes `[from, from + out.len())` of span `k` of `layer` (`span`, from
    /// [`Self::get`] or [`Self::insert_partial`]) into `out`, inflating it further first
    /// when they are not inflated yet (to their end, and at least [`MIN_STEP`] on).
    pub fn read(
        &self,
        layer: &LayerKey,
        k: usize,
        span: &Arc<Span>,
        from: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let mut guard = span.state.lock();
        let st = &mut *guard;
        let need = from + out.len();
        if need > st.len {
            return Err(Error::Index(format!(
                "read to byte {need} of a span of {} bytes",
                st.len
            )));
        }
        if need > st.bytes.len() {
            let Some(rest) = st.rest.as_mut() else {
                return Err(Error::Index(
                    "a span's inflation failed earlier; read it again".into(),
                ));
            };
            let old = st.bytes.len();
            let target = need.max(old + MIN_STEP).min(st.len);
            st.bytes.resize(target, 0);
            let filled = rest.extraction.fill(
                &rest.compressed,
                &mut st.bytes[old..target],
                &[],
                &mut |_, _| {},
            );
            if let Err(e) = filled {
                st.bytes.truncate(old);
                st.rest = None;
                self.forget(layer, k, span);
                return Err(e);
            }
            self.note_inflated((target - old) as u64);
            if target == st.len {
                if rest.window_at_end {
                    let mut buf = Box::new([0u8; WINDOW_SIZE]);
                    if let Ok(n) = rest.extraction.window(&mut buf) {
                        self.insert_window(layer, k + 1, &buf[..n]);
                    }
                }
                let freed = rest.compressed.len();
                st.rest = None;
                self.shrink(layer, k, span, freed);
            }
        }
        out.copy_from_slice(&st.bytes[from..need]);
        Ok(())
    }

    /// `span`, now whole, no longer holds `freed` compressed bytes.
    fn shrink(&self, layer: &LayerKey, k: usize, span: &Arc<Span>, freed: usize) {
        let mut inner = self.inner.lock();
        let Some(e) = inner.map.get_mut(&(*layer, Piece::Span(k))) else {
            return;
        };
        if !matches!(&e.data, Held::Span(s) if Arc::ptr_eq(s, span)) {
            return;
        }
        let by = freed.min(e.size);
        e.size -= by;
        inner.bytes -= by;
    }

    /// Drops `span` from the cache (its inflation failed).
    fn forget(&self, layer: &LayerKey, k: usize, span: &Arc<Span>) {
        let mut inner = self.inner.lock();
        let key = (*layer, Piece::Span(k));
        if matches!(inner.map.get(&key), Some(Entry { data: Held::Span(s), .. }) if Arc::ptr_eq(s, span))
            && let Some(e) = inner.map.remove(&key)
        {
            inner.bytes -= e.size;
        }
    }

    /// The raw inflate window at checkpoint `k` of `layer`, if kept.
    pub fn get_window(&self, layer: &LayerKey, k: usize) -> Option<Arc<Vec<u8>>> {
        let got = match self.get_piece(layer, Piece::Window(k))? {
            Held::Window(w) => w,
            Held::Span(_) => return None,
        };
        self.window_hits.fetch_add(1, Ordering::Relaxed);
        Some(got)
    }

    /// True when the window at checkpoint `k` of `layer` is kept (not counted as a use).
    pub fn has_window(&self, layer: &LayerKey, k: usize) -> bool {
        self.inner
            .lock()
            .map
            .contains_key(&(*layer, Piece::Window(k)))
    }

    /// Keeps the raw inflate window at checkpoint `k` of `layer`, as a read inflating
    /// through that checkpoint found it: bytes derived from verified spans and a verified
    /// window, so they need no digest of their own. Windows have a quarter of the bound,
    /// on top of the spans' (see `Inner::window_bytes`).
    pub fn insert_window(&self, layer: &LayerKey, k: usize, raw: &[u8]) {
        let held = Held::Window(Arc::new(raw.to_vec()));
        if self.insert_piece(layer, Piece::Window(k), held, raw.len()) {
            self.windows_kept.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn get_piece(&self, layer: &LayerKey, piece: Piece) -> Option<Held> {
        let mut inner = self.inner.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let entry = inner.map.get_mut(&(*layer, piece))?;
        entry.last_use = tick;
        Some(entry.data.clone())
    }

    fn insert_piece(&self, layer: &LayerKey, piece: Piece, data: Held, len: usize) -> bool {
        if len == 0 || (piece.is_window() && !self.admits(len as u64)) {
            return false;
        }
        if let Held::Span(s) = &data
            && !self.admits(s.len() as u64)
        {
            return false;
        }
        let mut inner = self.inner.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(old) = inner.map.insert(
            (*layer, piece),
            Entry {
                data,
                size: len,
                last_use: tick,
            },
        ) {
            *inner.bytes_of(piece) -= old.size;
        }
        *inner.bytes_of(piece) += len;
        let bound = if piece.is_window() {
            self.max_bytes / 4
        } else {
            self.max_bytes
        };
        while *inner.bytes_of(piece) > bound {
            // A linear scan: the cache holds tens of entries, and eviction is rare next
            // to the inflate it saves.
            let Some(oldest) = inner
                .map
                .iter()
                .filter(|((_, p), _)| p.is_window() == piece.is_window())
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k)
            else {
                break;
            };
            if let Some(e) = inner.map.remove(&oldest) {
                *inner.bytes_of(piece) -= e.size;
            }
        }
        true
    }

    /// Drops the spans not used since the previous call (the first call drops the ones
    /// not used since the cache was made). Tick it every few seconds: memory held for a
    /// burst of reads is returned within two ticks of the burst's end.
    pub fn release_idle(&self) -> usize {
        let mut inner = self.inner.lock();
        let before = inner.idle_before;
        let (mut spans, mut windows) = (0, 0);
        inner.map.retain(|(_, piece), e| {
            let keep = e.last_use >= before;
            if !keep {
                match piece {
                    Piece::Span(_) => spans += e.size,
                    Piece::Window(_) => windows += e.size,
                }
            }
            keep
        });
        inner.bytes -= spans;
        inner.window_bytes -= windows;
        let freed = spans + windows;
        inner.idle_before = inner.tick + 1;
        freed
    }

    /// Counts `n` bytes inflated to fill the cache.
    pub fn note_inflated(&self, n: u64) {
        self.inflated_bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// Hits, inserts and bytes held.
    pub fn stats(&self) -> InflatedStats {
        InflatedStats {
            hits: self.hits.load(Ordering::Relaxed),
            inserts: self.inserts.load(Ordering::Relaxed),
            inflated_bytes: self.inflated_bytes.load(Ordering::Relaxed),
            bytes: {
                let inner = self.inner.lock();
                (inner.bytes + inner.window_bytes) as u64
            },
            windows_kept: self.windows_kept.load(Ordering::Relaxed),
            window_hits: self.window_hits.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(n: usize, fill: u8) -> Vec<u8> {
        vec![fill; n]
    }

    /// The whole bytes of a cached span.
    fn bytes(cache: &InflatedSpans, layer: LayerKey, k: usize) -> Option<Vec<u8>> {
        let s = cache.get(&layer, k)?;
        let mut out = vec![0u8; s.len()];
        cache.read(&layer, k, &s, 0, &mut out).ok()?;
        Some(out)
    }

    #[test]
    fn every_reader_gets_its_own_key() {
        let cache = InflatedSpans::new(100);
        let (a, b) = (cache.new_key(), cache.new_key());
        assert_ne!(a, b);
        cache.insert(&a, 0, span(10, 1));
        assert!(cache.get(&b, 0).is_none());
    }

    #[test]
    fn spans_are_kept_per_layer_and_evicted_least_recently_used_first() {
        let cache = InflatedSpans::new(400);
        let (a, b) = (1, 2);
        cache.insert(&a, 0, span(100, 1));
        cache.insert(&b, 0, span(100, 2));
        cache.insert(&a, 1, span(100, 3));
        assert_eq!(bytes(&cache, a, 0), Some(vec![1u8; 100]));
        assert_eq!(bytes(&cache, b, 0), Some(vec![2u8; 100]));
        assert!(cache.get(&b, 1).is_none());
        // Full at 400: a fifth span evicts the least recently used, (a, 1).
        cache.insert(&b, 1, span(100, 4));
        cache.insert(&b, 2, span(100, 5));
        assert!(cache.get(&a, 1).is_none());
        assert!(cache.get(&a, 0).is_some());
        assert_eq!(cache.stats().bytes, 400);
        assert_eq!(cache.stats().inserts, 5);
        assert_eq!(cache.stats().hits, 3);
    }

    #[test]
    fn windows_are_kept_apart_from_spans_under_the_same_bound() {
        let cache = InflatedSpans::new(400);
        cache.insert(&1, 3, span(100, 1));
        cache.insert_window(&1, 3, &[7u8; 50]);
        assert!(cache.has_window(&1, 3));
        assert!(!cache.has_window(&1, 4) && !cache.has_window(&2, 3));
        assert_eq!(bytes(&cache, 1, 3), Some(vec![1u8; 100]));
        assert_eq!(cache.get_window(&1, 3).as_deref(), Some(&vec![7u8; 50]));
        let stats = cache.stats();
        assert_eq!(
            (stats.bytes, stats.windows_kept, stats.window_hits),
            (150, 1, 1)
        );
        // Spans do not evict windows (they have a quarter of the bound of their own)...
        for i in 0..4 {
            cache.insert(&2, i, span(100, 2));
        }
        assert!(cache.get(&1, 3).is_none(), "the oldest span went");
        assert!(cache.has_window(&1, 3));
        assert_eq!(cache.stats().bytes, 450);
        // ...and windows evict only windows, the least recently used first.
        cache.insert_window(&1, 4, &[8u8; 60]);
        assert!(!cache.has_window(&1, 3) && cache.has_window(&1, 4));
        assert_eq!(cache.stats().bytes, 460);
        assert_eq!(cache.release_idle() + cache.release_idle(), 460);
        assert!(!cache.has_window(&1, 4));
        assert_eq!(cache.stats().bytes, 0);
    }

    #[test]
    fn large_and_empty_spans_are_not_admitted() {
        let cache = InflatedSpans::new(400);
        cache.insert(&0, 0, span(101, 0));
        cache.insert(&0, 1, span(0, 0));
        assert!(cache.get(&0, 0).is_none());
        assert!(cache.get(&0, 1).is_none());
        assert_eq!(cache.stats().bytes, 0);
        let off = InflatedSpans::new(0);
        off.insert(&0, 0, span(1, 0));
        assert!(off.get(&0, 0).is_none());
    }

    #[test]
    fn replacing_a_span_counts_its_bytes_once() {
        let cache = InflatedSpans::new(400);
        cache.insert(&0, 0, span(50, 0));
        cache.insert(&0, 0, span(80, 1));
        assert_eq!(cache.stats().bytes, 80);
        assert_eq!(bytes(&cache, 0, 0).map(|d| d[0]), Some(1));
    }

    #[test]
    fn idle_spans_are_released_within_two_ticks() {
        let cache = InflatedSpans::new(1000);
        let l = 7;
        cache.insert(&l, 0, span(10, 0));
        cache.insert(&l, 1, span(10, 1));
        // Both were used since the cache was made.
        assert_eq!(cache.release_idle(), 0);
        assert!(cache.get(&l, 1).is_some());
        // Span 0 was not used since the previous tick; span 1 was.
        assert_eq!(cache.release_idle(), 10);
        assert!(cache.get(&l, 0).is_none());
        assert_eq!(cache.stats().bytes, 10);
        // Span 1 was last used before that tick.
        assert_eq!(cache.release_idle(), 10);
        assert_eq!(cache.stats().bytes, 0);
        assert!(cache.get(&l, 1).is_none());
    }
}
