//! The device and cache layers: the [`RangeSource`] a layer's reader pulls compressed
//! bytes through.
//!
//! For a layer with a ferry index the source knows every span's compressed range and
//! SHA-256, so it works span by span: a span in the node chunk store is read from there
//! (keyed by its digest: the same bytes are stored once for every layer and image that
//! has them); missing spans are fetched from the backend, neighbours merged into one
//! request up to [`FetchConfig::max_request_bytes`], each checked against its digest
//! before it is stored or handed out. Concurrent reads of one span share a single fetch
//! (the first reader fetches, the others wait for its result). The reader above checks
//! the digests again before inflating, so wrong bytes never reach a process.
//!
//! Reads of an indexed layer with a store read ahead along the layer's stream
//! ([`readahead`]): a miss extends its request by a window of the spans after it,
//! and a read reaching a window's first span starts the next window in the background,
//! so a start moving through the stream waits for few round trips. Readahead fetches
//! spans only: the miss fetches its own checkpoint's inflate window, and reads moving on
//! keep the windows of the checkpoints they inflate through (in the process's inflated
//! cache, `ferry_index::inflated`), so the next read along needs no request for its own.
//! Readahead goes through the same single flight, verification and
//! store as every fetch, and counts in `bytes_readahead`.
//!
//! Layers without span digests (eStargz, whose chunk digests are over uncompressed
//! bytes that only the format reader sees) get the same single-flight, timeout and
//! accounting per requested range, but nothing is stored: the format reader verifies.
//!
//! A version-2 index keeps its inflate windows in a separate windows blob. The source
//! is then also the layer's [`WindowSource`]: a window a read needs is served from the
//! chunk store (keyed by its SHA-256, so layers sharing a window share the entry) or
//! fetched by Range from the windows blob with the same single flight, deadline,
//! verification, fallback and accounting as spans (window bytes count in
//! `bytes_fetched`); warm-up and fill fetch the windows of the spans they fetch, at the
//! same time and merged into as few requests as the spans.
//!
//! Warm-up ([`crate::warm`]) goes through the same paths: [`LayerSource::warm_range`]
//! makes a range local ahead of the reads (spans into the store; for eStargz, bytes held
//! in memory up to a bound), and [`LayerSource::fill`] fetches what is still missing
//! (spans not in the store; an eStargz blob whole into the store, verified against the
//! layer digest, after which reads are served from it).
//!
//! Requests go out through the image's [`Limiter`] ([`limiter`]): at most
//! [`FetchConfig::concurrency`] in flight per image and
//! [`FetchConfig::layer_concurrency`] per blob; a fetch that finds its blob busy queues,
//! and the next request to that blob carries every queued fetch along as ranges of one
//! multi-range request (a registry pays per request). A process's read
//! ([`for_a_reader`]) is never held by the per-blob bound.
//!
//! Failure is bounded: every fetch runs against a deadline of [`FetchConfig::timeout`]
//! (waiting for a concurrency slot included) and fails with `TimedOut` after it; a
//! backend that never answers holds one slot, never a reader.

mod limiter;
pub(crate) mod readahead;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use ferry_index::ferryidx::{LayerIndex, WindowRef};
use ferry_index::source::RangeSource;
use ferry_index::windows::WindowSource;
use ferry_registry_client::cache::flight;
use ferry_store::{ChunkKey, Store};
use parking_lot::Mutex;

use crate::ranges::merge_ranges;
use crate::stats::{Guess, MountStats};
pub use limiter::{JOIN_MAX_RANGES, Limiter};
use limiter::{Turn, copy_error, share_of};
use readahead::{Readahead, SpanMap};

thread_local! {
    /// Set while this thread does background work ([`in_background`]).
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set while this thread serves a process's read ([`for_a_reader`]).
    static READER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with `flag` set on this thread, restored however `f` ends.
fn with_flag<T>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore(&'static std::thread::LocalKey<std::cell::Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.with(|b| b.set(self.1));
        }
    }
    let _restore = Restore(flag, flag.with(|b| b.replace(true)));
    f()
}

/// Runs `f` as a process's read (the FUSE read handler): its fetches are the start's
/// critical path, so they never wait for a layer's requests in flight
/// ([`FetchConfig::layer_concurrency`]), only for the image's slots, and take the
/// queued guesses of the same layer along.
pub fn for_a_reader<T>(f: impl FnOnce() -> T) -> T {
    with_flag(&READER, f)
}

fn is_reader() -> bool {
    READER.with(|b| b.get()) && !is_background()
}

/// Runs `f` as background work: reads inside it (prefetch writing a file to the file
/// cache or the small-file pack, the cache's own materializations) are not a process's
/// reads, so they neither count as reads that waited (the start's critical path, and
/// what background fill waits to be quiet) nor start readahead or mark guesses used.
pub(crate) fn in_background<T>(f: impl FnOnce() -> T) -> T {
    with_flag(&BACKGROUND, f)
}

fn is_background() -> bool {
    BACKGROUND.with(|b| b.get())
}

/// How long a failed span fetch is remembered: reads of it meanwhile fail at once. Short,
/// so service resumes promptly when the registry is back. Each further failure of the
/// same piece doubles it, up to [`MAX_FAILURE_MEMORY`]: a source that keeps answering
/// wrong bytes is asked for a piece a few times a minute, not once per read (the kernel
/// retries every failed read), so persistent corruption cannot multiply the bytes moved.
pub const FAILURE_MEMORY: Duration = Duration::from_secs(2);
/// Longest a piece's repeated failures keep it from being fetched again.
pub const MAX_FAILURE_MEMORY: Duration = Duration::from_secs(64);

/// A piece's recent failures: when the last was, and how many in a row.
#[derive(Debug, Clone, Copy)]
struct Failure {
    at: Instant,
    count: u32,
}

impl Failure {
    /// How long after `at` the piece is not fetched again.
    fn memory(&self) -> Duration {
        let doublings = self.count.saturating_sub(1).min(16);
        FAILURE_MEMORY
            .saturating_mul(1 << doublings)
            .min(MAX_FAILURE_MEMORY)
    }
}

/// The knobs users tune per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchConfig {
    /// Concurrent backend requests per image.
    pub concurrency: usize,
    /// Concurrent backend requests to one blob (a layer, or its windows blob), at most
    /// `concurrency`. Fetches that find them all busy queue and go out together, in one
    /// multi-range request, when one returns ([`limiter`]).
    pub layer_concurrency: usize,
    /// Largest merged request, in compressed bytes (a single span larger than this is
    /// still fetched whole: it cannot be verified in pieces).
    pub max_request_bytes: u64,
    /// Longest a read waits for bytes that are not cached before failing with EIO.
    pub timeout: Duration,
    /// Largest readahead window along a layer's compressed stream, in compressed bytes
    /// (0: no readahead). Windows start at [`READAHEAD_START_DIVISOR`]'s share of it and
    /// double while reads keep landing in them.
    pub readahead_bytes: u64,
    /// A file at most this large (uncompressed) is fetched whole at its first read that
    /// misses (0: off); see [`crate::image::nearby`].
    pub whole_file_bytes: u64,
    /// The first miss in a directory fetches the directory's other small files, up to
    /// this many compressed bytes (0: off); see [`crate::image::nearby`].
    pub nearby_bytes: u64,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            concurrency: 8,
            layer_concurrency: DEFAULT_LAYER_CONCURRENCY,
            max_request_bytes: 8 << 20,
            timeout: Duration::from_secs(30),
            readahead_bytes: DEFAULT_READAHEAD_BYTES,
            whole_file_bytes: DEFAULT_WHOLE_FILE_BYTES,
            nearby_bytes: DEFAULT_NEARBY_BYTES,
        }
    }
}

/// Default [`FetchConfig::readahead_bytes`]. Measured on a pandas + numpy + scipy start
/// from a 1.1 GB image (59 MB read): 2 MiB took the reads that waited for the registry
/// from 297 to 130 for 1.07x the bytes read; 4 MiB to 103, but for 1.53x.
pub const DEFAULT_READAHEAD_BYTES: u64 = 2 << 20;
/// Default [`FetchConfig::layer_concurrency`]. Measured on a pandas + numpy + scipy
/// start without a trace against Debian's registry: 2 took its Range requests from ~180
/// to ~160 with reads waiting no more often; 1 to ~130, but with more reads waiting at
/// 10 ms (a layer's guesses then go one request per round trip). docs/benchmarks.md.
pub const DEFAULT_LAYER_CONCURRENCY: usize = 2;
/// Default [`FetchConfig::whole_file_bytes`]: most shared libraries and every module of
/// an interpreter's start; a start reads nearly all of such a file.
pub const DEFAULT_WHOLE_FILE_BYTES: u64 = 8 << 20;
/// Default [`FetchConfig::nearby_bytes`].
pub const DEFAULT_NEARBY_BYTES: u64 = 4 << 20;
/// A first readahead window (after a miss far from the last one) is this share (1/N) of
/// [`FetchConfig::readahead_bytes`].
pub const READAHEAD_START_DIVISOR: u64 = 8;
/// Most runs of spans one backend request asks for (see
/// [`ferry_index::source::RangeSource::batches_ranges`]): a read's spans and readahead
/// with local spans between them, a stretch's missing windows.
pub const MAX_RANGES_PER_REQUEST: usize = 32;
/// Windows are fetched in aligned blocks of this many (about 180 KB compressed, for
/// checkpoints covering about 1.7 MB of a layer's stream), as far as the block's windows
/// around the wanted ones are missing: a start's fetches cluster in the same stretches
/// of a layer (a package's modules and libraries), and each needs its first
/// checkpoint's window, so without blocks half of a pandas start's ~220 requests were
/// for ~12 KB of windows each, and a registry pays per request (Debian's ~4 ms of CPU).
/// Over the windows that start fetched, blocks of 16 take their requests from ~100 to
/// ~45 for ~4 MB more (a simulation over its fetch log).
pub const WINDOW_BLOCK: usize = 16;

/// The node's registry link as its fetches see it: bytes delivered per second of time
/// during which at least one fetch was in flight (so concurrent requests add up and idle
/// time does not count). Background fill paces itself to a share of it. Halved when its
/// busy time passes [`LINK_WINDOW`], so it follows a link that changes.
#[derive(Debug, Default)]
pub struct LinkMeter {
    state: Mutex<LinkState>,
}

#[derive(Debug, Default)]
struct LinkState {
    in_flight: usize,
    busy_since: Option<Instant>,
    busy: Duration,
    bytes: u64,
}

/// Busy time after which the link meter halves what it has seen.
pub const LINK_WINDOW: Duration = Duration::from_secs(20);
/// Busy time below which the link meter has no estimate yet.
const LINK_MIN_BUSY: Duration = Duration::from_millis(50);

impl LinkMeter {
    /// A fetch starts at `now`.
    pub fn begin(&self, now: Instant) {
        let mut s = self.state.lock();
        if s.in_flight == 0 {
            s.busy_since = Some(now);
        }
        s.in_flight += 1;
    }

    /// A fetch that began earlier ends at `now` having delivered `bytes`.
    pub fn end(&self, now: Instant, bytes: u64) {
        let mut s = self.state.lock();
        s.bytes = s.bytes.saturating_add(bytes);
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0
            && let Some(since) = s.busy_since.take()
        {
            s.busy += now.saturating_duration_since(since);
            if s.busy > LINK_WINDOW {
                s.busy /= 2;
                s.bytes /= 2;
            }
        }
    }

    /// Bytes per second of busy time, once enough has been seen.
    pub fn bytes_per_sec(&self) -> Option<u64> {
        let s = self.state.lock();
        (s.busy >= LINK_MIN_BUSY).then(|| (s.bytes as f64 / s.busy.as_secs_f64()) as u64)
    }
}

/// The process's link meter: every fetch of every mount goes over the same link.
fn link() -> &'static LinkMeter {
    static LINK: OnceLock<LinkMeter> = OnceLock::new();
    LINK.get_or_init(LinkMeter::default)
}

/// The registry link's measured throughput in bytes per second (see [`LinkMeter`]),
/// once fetches have measured it.
pub fn link_bytes_per_sec() -> Option<u64> {
    link().bytes_per_sec()
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("{what}: timed out"))
}

/// What a fetch ended with, shareable between the threads waiting for it.
type FlightOutcome = Result<Arc<Vec<u8>>, (io::ErrorKind, String)>;

/// One fetch in progress, led by the reader that claimed it; followers wait for its
/// outcome.
type Flight = flight::Flight<FlightOutcome>;
type Lead = flight::Lead<FlightKey, FlightOutcome>;

/// Waits for another reader's fetch until `deadline`.
fn follow(flight: &Flight, deadline: Instant) -> io::Result<Arc<Vec<u8>>> {
    match flight.wait(deadline) {
        Some(Ok(outcome)) => outcome.map_err(|(k, m)| io::Error::new(k, m)),
        Some(Err(aborted)) => Err(io::Error::other(aborted)),
        None => Err(timed_out("waiting for another reader's fetch")),
    }
}

/// What a verified piece of an indexed layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PieceKind {
    /// A span of the layer blob.
    Span,
    /// An inflate window in the index's windows blob.
    Window,
}

impl PieceKind {
    fn name(self) -> &'static str {
        match self {
            PieceKind::Span => "span",
            PieceKind::Window => "window",
        }
    }
}

/// A table of verified pieces of one blob: the spans of an indexed layer, or the
/// windows in its windows blob (ranges sorted, back to back for windows).
#[derive(Debug)]
struct Spans {
    kind: PieceKind,
    ranges: Vec<Range<u64>>,
    digests: Vec<[u8; 32]>,
}

impl Spans {
    /// The pieces overlapping `range` of the blob (empty when none do).
    fn covering(&self, range: &Range<u64>) -> Range<usize> {
        let first = self.ranges.partition_point(|r| r.end <= range.start);
        let last = self.ranges.partition_point(|r| r.start < range.end);
        first..last.max(first)
    }
}

/// The windows blob of a version-2 index, as pieces.
struct Windows {
    /// One piece per window, in checkpoint order.
    pieces: Spans,
    /// `first[k]`: windows before checkpoint `k` (`first.len()` = checkpoints + 1), so
    /// the windows of checkpoints `k..l` are pieces `first[k]..first[l]`.
    first: Vec<usize>,
    /// Where windows are fetched; `None` until [`LayerSource::with_windows`].
    backend: Option<Arc<dyn RangeSource>>,
    fallback: Option<Arc<dyn RangeSource>>,
}

impl std::fmt::Debug for Windows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Windows")
            .field("windows", &self.pieces.ranges.len())
            .field("reachable", &self.backend.is_some())
            .finish()
    }
}

impl Windows {
    fn of(index: &LayerIndex) -> Option<Windows> {
        index.windows.as_ref()?;
        let mut first = Vec::with_capacity(index.checkpoints.len() + 1);
        let mut ranges = Vec::new();
        let mut digests = Vec::new();
        for cp in &index.checkpoints {
            first.push(ranges.len());
            if let Some(w) = &cp.window {
                ranges.push(w.range());
                digests.push(w.sha256);
            }
        }
        first.push(ranges.len());
        Some(Windows {
            pieces: Spans {
                kind: PieceKind::Window,
                ranges,
                digests,
            },
            first,
            backend: None,
            fallback: None,
        })
    }

    /// Window pieces of checkpoints `ks` (clamped to the table).
    fn of_checkpoints(&self, ks: Range<usize>) -> Range<usize> {
        let last = self.first.len() - 1;
        let lo = self.first[ks.start.min(last)];
        let hi = self.first[ks.end.min(last)];
        lo..hi.max(lo)
    }

    /// Pieces `ws` widened within their [`WINDOW_BLOCK`]s over the pieces next to them
    /// that `missing` says are missing, so that the whole stays one request. Not in a
    /// layer of fewer than four blocks of windows: there a block is a guess at most of
    /// the layer, and a start of a small image would fetch more than its layers.
    fn widened(&self, ws: Range<usize>, missing: impl Fn(usize) -> bool) -> Range<usize> {
        if ws.is_empty() || self.pieces.ranges.len() < 4 * WINDOW_BLOCK {
            return ws;
        }
        let floor = ws.start - ws.start % WINDOW_BLOCK;
        let ceil = (ws.end.div_ceil(WINDOW_BLOCK) * WINDOW_BLOCK).min(self.pieces.ranges.len());
        let mut lo = ws.start;
        while lo > floor && missing(lo - 1) {
            lo -= 1;
        }
        let mut hi = ws.end;
        while hi < ceil && missing(hi) {
            hi += 1;
        }
        lo..hi
    }
}

/// Where a flight is filed: a piece number, or an exact range for unindexed layers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum FlightKey {
    Piece(PieceKind, usize),
    Range(u64, u64),
}

/// Most bytes a passthrough source holds in memory from warm-up (eStargz prefetch).
pub const MAX_HELD_BYTES: u64 = 256 << 20;
/// Of those, most bytes held from on-demand reads (see `LayerSource::hold_read`).
pub const MAX_HELD_READ_BYTES: u64 = 32 << 20;

/// The whole blob of a passthrough layer, once it is in the chunk store.
#[derive(Debug)]
struct WholeBlob {
    key: ChunkKey,
    local: OnceLock<ChunkSource>,
}

/// Ranges fetched by warm-up for a passthrough layer, by start offset.
#[derive(Debug, Default)]
struct Held {
    ranges: BTreeMap<u64, Arc<Vec<u8>>>,
    bytes: u64,
}

impl Held {
    /// The bytes of `range` when one held range contains it.
    fn get(&self, range: &Range<u64>) -> Option<Vec<u8>> {
        let (start, data) = self.ranges.range(..=range.start).next_back()?;
        let end = start + data.len() as u64;
        (range.end <= end)
            .then(|| data[(range.start - start) as usize..(range.end - start) as usize].to_vec())
    }

    /// A held range containing byte `at`: its start and bytes. Looks back over a bounded
    /// number of starts (held ranges may overlap; a longer one may start earlier).
    fn containing(&self, at: u64) -> Option<(u64, &Arc<Vec<u8>>)> {
        self.ranges
            .range(..=at)
            .rev()
            .take(HELD_LOOKBACK)
            .find(|(start, data)| at < *start + data.len() as u64)
            .map(|(start, data)| (*start, data))
    }

    /// What is held of `range` at its two ends: the bytes held contiguously from its
    /// start, and the bytes held contiguously up to its end (from one range); either may
    /// be empty, and they may overlap.
    fn ends(&self, range: &Range<u64>) -> (Vec<u8>, (u64, Vec<u8>)) {
        let mut head = Vec::new();
        let mut pos = range.start;
        while pos < range.end
            && let Some((start, data)) = self.containing(pos)
        {
            let end = (start + data.len() as u64).min(range.end);
            head.extend_from_slice(&data[(pos - start) as usize..(end - start) as usize]);
            pos = end;
        }
        let tail = match self.containing(range.end - 1) {
            Some((start, data)) if pos < range.end => {
                let from = start.max(range.start);
                let to = range.end - start;
                (from, data[(from - start) as usize..to as usize].to_vec())
            }
            _ => (range.end, Vec::new()),
        };
        (head, tail)
    }
}

/// How many held ranges [`Held::containing`] looks back over.
const HELD_LOOKBACK: usize = 16;

/// One piece of background fill work for a layer (see [`LayerSource::fill_work`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FillWork {
    /// Spans `k..l` of an indexed layer: neighbours, one request.
    Spans(Range<usize>),
    /// The whole blob of a passthrough layer, into the store under the layer digest.
    Whole,
}

/// The [`RangeSource`] one layer's reader uses: cache first, then one verified,
/// deadline-bounded, shared fetch from the backend.
pub struct LayerSource {
    backend: Arc<dyn RangeSource>,
    /// Where a span that did not verify is fetched again (the registry itself when the
    /// backend may be a pull mirror); `None`: a mismatch fails the read.
    fallback: Option<Arc<dyn RangeSource>>,
    /// Spans whose fetch just failed, and when: a read of one of them within
    /// [`FAILURE_MEMORY`] fails at once instead of waiting out another timeout (the
    /// kernel retries a failed readahead with a synchronous read right away).
    recent_failures: Mutex<HashMap<(PieceKind, usize), Failure>>,
    spans: Option<Spans>,
    /// The windows blob of a version-2 index.
    windows: Option<Windows>,
    store: Option<Arc<Store>>,
    limiter: Arc<Limiter>,
    config: FetchConfig,
    stats: Arc<MountStats>,
    flights: flight::Flights<FlightKey, FlightOutcome>,
    whole: Option<WholeBlob>,
    held: Mutex<Held>,
    readahead: Mutex<Readahead>,
    /// A background readahead is running (at most one per layer).
    readahead_running: AtomicBool,
    /// Per span of an indexed layer: the [`Guess`] it was fetched as
    /// ([`Guess::flag`]), until a read uses it; 0 when no guess is pending
    /// ([`MountStats::bytes_guessed`]). Empty for other layers.
    guessed: Vec<AtomicU8>,
    /// This source, once shared ([`LayerSource::into_shared`]): background readahead
    /// holds it while it runs. Empty for a source never shared that way (no background
    /// readahead then).
    me: Weak<LayerSource>,
}

/// What a fetch of pieces did, for the caller's accounting.
#[derive(Debug, Default, Clone)]
struct Fetched {
    /// Bytes fetched from the backend.
    bytes: u64,
    /// The caller waited for the network: a fetch of its own or one in flight it joined.
    waited: bool,
    /// The spans (of a layer's stream, not windows) this call fetched itself.
    led: Vec<usize>,
}

impl std::fmt::Debug for LayerSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerSource")
            .field("len", &self.backend.len())
            .field("spans", &self.spans.as_ref().map(|s| s.ranges.len()))
            .field(
                "store",
                &self.store.as_ref().map(|s| s.root().to_path_buf()),
            )
            .field("config", &self.config)
            .finish()
    }
}

impl LayerSource {
    /// A source for a layer with a ferry index: span by span, through `store`.
    pub fn indexed(
        backend: Arc<dyn RangeSource>,
        index: &LayerIndex,
        store: Option<Arc<Store>>,
        limiter: Arc<Limiter>,
        config: FetchConfig,
        stats: Arc<MountStats>,
    ) -> LayerSource {
        let n = index.span_digests.len();
        let ranges: Vec<Range<u64>> = (0..n).filter_map(|i| index.span_range(i)).collect();
        let spans = (ranges.len() == n).then(|| Spans {
            kind: PieceKind::Span,
            ranges,
            digests: index.span_digests.clone(),
        });
        LayerSource {
            backend,
            fallback: None,
            recent_failures: Mutex::new(HashMap::new()),
            spans,
            windows: Windows::of(index),
            store,
            limiter,
            config,
            stats,
            flights: flight::Flights::new(),
            whole: None,
            held: Mutex::new(Held::default()),
            readahead: Mutex::new(Readahead::default()),
            readahead_running: AtomicBool::new(false),
            guessed: (0..n).map(|_| AtomicU8::new(0)).collect(),
            me: Weak::new(),
        }
    }

    /// A source for a layer whose format verifies its own reads (eStargz): shared,
    /// bounded fetches of exactly the ranges asked for, nothing stored.
    pub fn passthrough(
        backend: Arc<dyn RangeSource>,
        limiter: Arc<Limiter>,
        config: FetchConfig,
        stats: Arc<MountStats>,
    ) -> LayerSource {
        LayerSource {
            backend,
            fallback: None,
            recent_failures: Mutex::new(HashMap::new()),
            spans: None,
            windows: None,
            store: None,
            limiter,
            config,
            stats,
            flights: flight::Flights::new(),
            whole: None,
            held: Mutex::new(Held::default()),
            readahead: Mutex::new(Readahead::default()),
            readahead_running: AtomicBool::new(false),
            guessed: Vec::new(),
            me: Weak::new(),
        }
    }

    /// Lets a passthrough source keep its whole blob in `store` under `layer_digest`
    /// (verified against it by the store): served from there when already stored, and
    /// stored by [`LayerSource::fill`]. Ignored for indexed sources and bad digests.
    /// Spans that do not verify are fetched once more from `fallback` (e.g. the
    /// registry itself, when `backend` may be a pull mirror) before the read fails.
    pub fn with_fallback(mut self, fallback: Arc<dyn RangeSource>) -> LayerSource {
        self.fallback = Some(fallback);
        self
    }

    /// Where the windows of a version-2 index are fetched: `backend` reads the index's
    /// windows blob; windows that do not verify are fetched once more from `fallback`.
    /// Ignored when the index keeps no windows in a windows blob.
    pub fn with_windows(
        mut self,
        backend: Arc<dyn RangeSource>,
        fallback: Option<Arc<dyn RangeSource>>,
    ) -> LayerSource {
        if let Some(w) = &mut self.windows {
            w.backend = Some(backend);
            w.fallback = fallback;
        }
        self
    }

    /// True when the layer's index keeps its windows in a windows blob.
    pub fn has_window_blob(&self) -> bool {
        self.windows.is_some()
    }

    /// True when this source fetches windows into its store (a windows blob with a
    /// source, and a store): what [`Self::warm_windows`] works on.
    pub fn stores_windows(&self) -> bool {
        self.store.is_some() && self.windows.as_ref().is_some_and(|w| w.backend.is_some())
    }

    pub fn with_whole_blob(mut self, store: Arc<Store>, layer_digest: &str) -> LayerSource {
        if self.spans.is_some() {
            return self;
        }
        let Ok(key) = ChunkKey::parse(layer_digest) else {
            return self;
        };
        let whole = WholeBlob {
            key,
            local: OnceLock::new(),
        };
        match store.open_chunk(&whole.key) {
            Ok(Some(chunk)) if chunk.len() == self.backend.len() => {
                let _ = whole.local.set(ChunkSource(chunk));
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "chunk store lookup of a whole layer failed"),
        }
        self.whole = Some(whole);
        self.store = Some(store);
        self
    }

    /// Shares the source; only a source shared this way reads ahead in the background
    /// (the background fetch holds it while it runs).
    pub fn into_shared(mut self) -> Arc<LayerSource> {
        Arc::new_cyclic(|me| {
            self.me = me.clone();
            self
        })
    }

    /// True while a background readahead of this source runs (tests wait on it to model
    /// a reader slower than the link).
    #[cfg(test)]
    pub(crate) fn reading_ahead(&self) -> bool {
        self.readahead_running.load(Ordering::Acquire)
    }

    /// The limiter this source's fetches take slots from.
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.limiter
    }

    /// True when every byte of the layer can be read without the backend.
    pub fn is_local(&self) -> bool {
        match (&self.spans, &self.whole) {
            (Some(spans), _) => match &self.store {
                Some(store) => spans
                    .digests
                    .iter()
                    .chain(self.windows.iter().flat_map(|w| &w.pieces.digests))
                    .all(|d| store.contains(&ChunkKey::from_raw(*d))),
                None => false,
            },
            (None, Some(w)) => w.local.get().is_some(),
            (None, None) => false,
        }
    }

    /// Whether some span of `range` of an indexed layer is neither in the store nor being
    /// fetched (false for layers without spans or without a store: nothing to fetch
    /// ahead into).
    pub fn range_missing(&self, range: Range<u64>) -> bool {
        let (Some(spans), Some(store)) = (&self.spans, self.store.as_deref()) else {
            return false;
        };
        let map = StreamMap {
            source: self,
            spans,
            store,
        };
        spans.covering(&range).any(|k| map.is_missing(k))
    }

    /// Whether every span of `range` of an indexed layer is in the store (true for layers
    /// without spans or without a store: a read of them never waits on a span fetch that
    /// an ask could widen). A span being fetched is not local: a read of it waits.
    pub fn range_local(&self, range: Range<u64>) -> bool {
        let (Some(spans), Some(store)) = (&self.spans, self.store.as_deref()) else {
            return true;
        };
        spans
            .covering(&range)
            .all(|k| store.contains(&ChunkKey::from_raw(spans.digests[k])))
    }

    /// Makes `range` of the blob local ahead of the reads that will want it: for an
    /// indexed layer the spans covering it go into the store (shared with concurrent
    /// readers); for a passthrough layer the range is fetched and held in memory, up to
    /// [`MAX_HELD_BYTES`] (beyond that it is skipped). Returns the compressed bytes
    /// fetched from the backend.
    pub fn warm_range(&self, range: Range<u64>) -> io::Result<u64> {
        self.warm(range, None, true)
    }

    /// [`Self::warm_range`] without the spans' windows: for a caller that makes them
    /// local itself ([`Self::warm_windows`] over a longer stretch), so that the two do
    /// not race each other into separate requests for the same windows. A window still
    /// missing when a read inflates its span is fetched then.
    pub fn warm_spans(&self, range: Range<u64>) -> io::Result<u64> {
        self.warm(range, None, false)
    }

    /// [`Self::warm_spans`] of several ranges of the layer (sorted or not) at once: their
    /// missing spans in pieces of at most `max_request_bytes`, each piece one request
    /// where the backend batches ranges, however far apart the ranges lie. Prefetch's
    /// ranges of a layer lie in a few stretches with gaps between them that merging
    /// would fetch for nothing. Returns the compressed bytes fetched.
    pub fn warm_spans_many(&self, ranges: &[Range<u64>]) -> io::Result<u64> {
        let (Some(spans), Some(store)) = (&self.spans, self.store.as_deref()) else {
            let mut n = 0;
            for r in ranges {
                n += self.warm_spans(r.clone())?;
            }
            return Ok(n);
        };
        let len = self.backend.len();
        let mut ks: Vec<usize> = ranges
            .iter()
            .filter(|r| r.start < r.end && r.end <= len)
            .flat_map(|r| spans.covering(r))
            .filter(|&k| self.piece_missing(spans, store, k))
            .collect();
        ks.sort_unstable();
        ks.dedup();
        let mut fetched = Fetched::default();
        self.listed_spans_in_pieces(spans, &ks, &mut fetched)?;
        Ok(fetched.bytes)
    }

    /// Fetches the listed spans `ks` (sorted, missing), as few requests as
    /// `max_request_bytes` allows, each of several ranges.
    fn listed_spans_in_pieces(
        &self,
        spans: &Spans,
        ks: &[usize],
        fetched: &mut Fetched,
    ) -> io::Result<()> {
        let mut piece: Vec<usize> = Vec::new();
        let mut bytes = 0;
        for &k in ks {
            let n = span_len(&spans.ranges[k]);
            if !piece.is_empty() && bytes + n > self.config.max_request_bytes {
                self.listed_spans_bytes(spans, &piece, fetched)?;
                piece.clear();
                bytes = 0;
            }
            piece.push(k);
            bytes += n;
        }
        if !piece.is_empty() {
            self.listed_spans_bytes(spans, &piece, fetched)?;
        }
        Ok(())
    }

    /// Makes local the windows of the checkpoints of the spans covering `range` (the
    /// layer's compressed bytes) that are missing, each run of them in one request (of at
    /// most `max_request_bytes`). Prefetch asks for the windows of a whole stretch of
    /// its plan at once: fetched with each span fetch, they cost about one more request
    /// per span fetch (a traced pandas start: 82 requests, 36 of them for windows; with
    /// stretches, 65 and 20, for the same bytes). Returns the windows blob bytes fetched.
    pub fn warm_windows(&self, range: Range<u64>) -> io::Result<u64> {
        let (Some(spans), Some(windows), Some(store)) = (&self.spans, &self.windows, &self.store)
        else {
            return Ok(0);
        };
        if windows.backend.is_none() || range.start >= range.end {
            return Ok(0);
        }
        let ws = windows.of_checkpoints(spans.covering(&range));
        let missing = |i: usize| self.piece_missing(&windows.pieces, store, i);
        let mut fetched = Fetched::default();
        let mut i = ws.start;
        while i < ws.end {
            if !missing(i) {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < ws.end
                && missing(j)
                && windows.pieces.ranges[j].end - windows.pieces.ranges[i].start
                    <= self.config.max_request_bytes
            {
                j += 1;
            }
            self.spans_bytes(&windows.pieces, i..j, &mut fetched)?;
            i = j;
        }
        Ok(fetched.bytes)
    }

    /// Files a guess of kind `guess` names together (the modules one Python module
    /// imports, [`crate::image::imports`]): their missing spans in one request (pieces of
    /// at most `max_request_bytes`, as [`Self::warm_spans_many`]) and, at the same time,
    /// the windows of each range's first checkpoint (widened within their blocks) in
    /// another, instead of a request, or two, per file. Returns the bytes fetched.
    pub(crate) fn warm_guessed_many(&self, ranges: &[Range<u64>], guess: Guess) -> io::Result<u64> {
        let (Some(spans), Some(store)) = (&self.spans, self.store.as_deref()) else {
            let mut n = 0;
            for r in ranges {
                n += self.warm_guessed(r.clone(), guess)?;
            }
            return Ok(n);
        };
        let len = self.backend.len();
        let ranges: Vec<&Range<u64>> = ranges
            .iter()
            .filter(|r| r.start < r.end && r.end <= len)
            .collect();
        let mut ks: Vec<usize> = ranges
            .iter()
            .flat_map(|r| spans.covering(r))
            .filter(|&k| self.piece_missing(spans, store, k))
            .collect();
        ks.sort_unstable();
        ks.dedup();
        let mut ws: Vec<usize> = Vec::new();
        if let Some(windows) = self.windows.as_ref().filter(|w| w.backend.is_some()) {
            let missing = |i: usize| self.piece_missing(&windows.pieces, store, i);
            for r in &ranges {
                let first = spans.covering(r).start;
                let w = windows.of_checkpoints(first..first + 1);
                if w.clone().any(missing) {
                    ws.extend(windows.widened(w, missing).filter(|&i| missing(i)));
                }
            }
            ws.sort_unstable();
            ws.dedup();
        }
        let spans_part = || -> io::Result<u64> {
            let mut fetched = Fetched::default();
            self.listed_spans_in_pieces(spans, &ks, &mut fetched)?;
            self.note_guessed(guess, &fetched.led);
            Ok(fetched.bytes)
        };
        if ws.is_empty() {
            return spans_part();
        }
        let windows_part = || -> io::Result<u64> {
            let Some(windows) = &self.windows else {
                return Ok(0);
            };
            let mut fetched = Fetched::default();
            self.listed_spans_bytes(&windows.pieces, &ws, &mut fetched)?;
            Ok(fetched.bytes)
        };
        std::thread::scope(|scope| {
            let w = scope.spawn(windows_part);
            let s = spans_part();
            let w = w
                .join()
                .map_err(|_| io::Error::other("fetching windows panicked"))?;
            Ok(s? + w?)
        })
    }

    /// [`Self::warm_range`] for a guess of kind `guess` ([`crate::image::nearby`]): the spans
    /// it fetches count in [`MountStats::bytes_guessed`] until a read uses them.
    pub(crate) fn warm_guessed(&self, range: Range<u64>, guess: Guess) -> io::Result<u64> {
        self.warm(range, Some(guess), true)
    }

    fn warm(&self, range: Range<u64>, guess: Option<Guess>, windows: bool) -> io::Result<u64> {
        if range.start >= range.end || range.end > self.backend.len() {
            return Ok(0);
        }
        if let Some(spans) = &self.spans {
            let Range {
                start: first,
                end: last,
            } = spans.covering(&range);
            if first >= last {
                return Ok(0);
            }
            let mut fetched = Fetched::default();
            self.spans_and_windows_in_pieces(spans, first..last, &mut fetched, windows)?;
            if let Some(kind) = guess {
                self.note_guessed(kind, &fetched.led);
            }
            return Ok(fetched.bytes);
        }
        if self.whole.as_ref().is_some_and(|w| w.local.get().is_some()) {
            return Ok(0);
        }
        {
            let held = self.held.lock();
            if held.get(&range).is_some() {
                return Ok(0);
            }
            if held.bytes + (range.end - range.start) > MAX_HELD_BYTES {
                tracing::info!(
                    start = range.start,
                    end = range.end,
                    "warm-up memory bound reached; range left for on-demand reads"
                );
                return Ok(0);
            }
        }
        let data = Arc::new(self.read_shared(range.clone())?);
        let n = data.len() as u64;
        let mut held = self.held.lock();
        if held.bytes + n <= MAX_HELD_BYTES {
            held.bytes += n;
            if let Some(old) = held.ranges.insert(range.start, data) {
                held.bytes -= old.len() as u64;
            }
        }
        Ok(n)
    }

    /// Makes `range` (the compressed extent of a file a read has just started on) local
    /// as that read's own request, before the read itself runs: the spans covering it
    /// and, in a request at the same time, their checkpoints' windows, so that reads
    /// anywhere in the file later (a loader's page faults) inflate from a local window
    /// instead of waiting for one. Like a miss, it extends into the readahead window
    /// after it and counts as one read that waited. For a passthrough layer it warms the
    /// range ([`Self::warm_range`]). Returns the compressed bytes fetched.
    pub fn fetch_for_read(&self, range: Range<u64>) -> io::Result<u64> {
        if range.start >= range.end || range.end > self.backend.len() {
            return Ok(0);
        }
        let (Some(spans), Some(store)) = (&self.spans, self.store.as_deref()) else {
            return self.warm_range(range);
        };
        let demand = spans.covering(&range);
        let map = StreamMap {
            source: self,
            spans,
            store,
        };
        if demand.is_empty() || !demand.clone().any(|k| map.is_missing(k)) {
            return Ok(0);
        }
        let plan =
            self.readahead
                .lock()
                .plan(demand.clone(), true, self.config.readahead_bytes, &map);
        let end = plan.sync_end.max(demand.end);
        let mut fetched = Fetched::default();
        // A file is at most `whole_file_bytes`: one request (and its windows) in practice.
        self.spans_and_windows_in_pieces(spans, demand.start..end, &mut fetched, true)?;
        let ahead: u64 = (demand.end..end).map(|k| span_len(&spans.ranges[k])).sum();
        MountStats::add(&self.stats.bytes_readahead, ahead);
        if fetched.waited {
            self.stats.read_waited();
        }
        // All of it a guess until read: the read that asked uses its own spans at once.
        let (rest, ahead): (Vec<usize>, Vec<usize>) =
            fetched.led.iter().copied().partition(|&k| k < demand.end);
        self.note_guessed(Guess::Rest, &rest);
        self.note_guessed(Guess::Readahead, &ahead);
        if let Some(ks) = plan.background {
            self.read_ahead_in_background(ks);
        }
        Ok(fetched.bytes)
    }

    /// What background fill still has to fetch for this layer: runs of neighbouring
    /// spans missing from the store (each at most [`FetchConfig::max_request_bytes`]),
    /// or the whole blob of a passthrough layer that may be kept in the store. Empty
    /// when everything is local or nothing can be kept (no store).
    pub fn fill_work(&self) -> Vec<FillWork> {
        let Some(store) = &self.store else {
            return Vec::new();
        };
        let Some(spans) = &self.spans else {
            return match &self.whole {
                Some(w) if w.local.get().is_none() => vec![FillWork::Whole],
                _ => Vec::new(),
            };
        };
        let mut out = Vec::new();
        let mut run: Option<Range<usize>> = None;
        for k in 0..spans.ranges.len() {
            if !self.checkpoint_missing(store, spans, k) {
                if let Some(r) = run.take() {
                    out.push(FillWork::Spans(r));
                }
                continue;
            }
            run = match run.take() {
                Some(r)
                    if spans.ranges[k].end - spans.ranges[r.start].start
                        <= self.config.max_request_bytes =>
                {
                    Some(r.start..k + 1)
                }
                Some(r) => {
                    out.push(FillWork::Spans(r));
                    Some(k..k + 1)
                }
                None => Some(k..k + 1),
            };
        }
        if let Some(r) = run {
            out.push(FillWork::Spans(r));
        }
        out
    }

    /// True when span `k` or its checkpoint's window (if kept in a windows blob) is not
    /// in `store`.
    fn checkpoint_missing(&self, store: &Store, spans: &Spans, k: usize) -> bool {
        let has = |d: &[u8; 32]| store.contains(&ChunkKey::from_raw(*d));
        !has(&spans.digests[k])
            || self.windows.as_ref().is_some_and(|w| {
                w.pieces.digests[w.of_checkpoints(k..k + 1)]
                    .iter()
                    .any(|d| !has(d))
            })
    }

    /// Compressed bytes of the windows of checkpoints `ks` (0 without a windows blob).
    fn window_bytes(&self, ks: Range<usize>) -> u64 {
        match &self.windows {
            Some(w) => {
                let ws = w.of_checkpoints(ks);
                if ws.is_empty() {
                    return 0;
                }
                w.pieces.ranges[ws.end - 1].end - w.pieces.ranges[ws.start].start
            }
            None => 0,
        }
    }

    /// Compressed bytes `work` covers (spans and their windows).
    pub fn work_bytes(&self, work: &FillWork) -> u64 {
        match (work, &self.spans) {
            (FillWork::Spans(ks), Some(spans))
                if ks.start < ks.end && ks.end <= spans.ranges.len() =>
            {
                spans.ranges[ks.end - 1].end - spans.ranges[ks.start].start
                    + self.window_bytes(ks.clone())
            }
            (FillWork::Whole, None) => self.backend.len(),
            _ => 0,
        }
    }

    /// Does one piece of fill work: fetches what is still missing (spans stored since
    /// the plan was made are skipped; a span another reader is fetching is waited for,
    /// not fetched twice) and keeps it in the store. `gate` is asked before every backend
    /// request with its size and may block (throttling) or refuse (stop): a refusal ends
    /// the work with `Interrupted`. Returns the compressed bytes fetched.
    pub fn fill(&self, work: &FillWork, gate: &dyn Fn(u64) -> bool) -> io::Result<u64> {
        match (work, &self.spans) {
            (FillWork::Spans(ks), Some(spans)) => {
                if ks.start >= ks.end || ks.end > spans.ranges.len() {
                    return Ok(0);
                }
                let store = self.store.as_ref();
                let missing =
                    |k: &usize| store.is_none_or(|s| self.checkpoint_missing(s, spans, *k));
                let (Some(lo), Some(hi)) =
                    (ks.clone().find(missing), ks.clone().rev().find(missing))
                else {
                    return Ok(0);
                };
                if !gate(
                    spans.ranges[hi].end - spans.ranges[lo].start + self.window_bytes(lo..hi + 1),
                ) {
                    return Err(interrupted());
                }
                let mut fetched = Fetched::default();
                self.spans_and_windows(spans, lo..hi + 1, &mut fetched)?;
                Ok(fetched.bytes)
            }
            (FillWork::Whole, None) => self.fill_whole(gate),
            _ => Ok(0),
        }
    }

    /// Streams the whole blob into the store in requests of `max_request_bytes`; the
    /// store checks it against the layer digest before keeping it.
    fn fill_whole(&self, gate: &dyn Fn(u64) -> bool) -> io::Result<u64> {
        let (Some(whole), Some(store)) = (&self.whole, &self.store) else {
            return Ok(0);
        };
        if whole.local.get().is_some() {
            return Ok(0);
        }
        let mut reader = RangeReader {
            source: self,
            pos: 0,
            buf: Vec::new(),
            at: 0,
            gate,
            fetched: 0,
            stopped: false,
        };
        let outcome = store.put_reader(&whole.key, &mut reader);
        let fetched = reader.fetched;
        match outcome {
            Ok(_) => {}
            Err(_) if reader.stopped => return Err(interrupted()),
            Err(e) => return Err(io::Error::other(format!("whole layer not stored: {e}"))),
        }
        match store.open_chunk(&whole.key) {
            Ok(Some(chunk)) if chunk.len() == self.backend.len() => {
                let _ = whole.local.set(ChunkSource(chunk));
                *self.held.lock() = Held::default();
            }
            Ok(_) => return Err(io::Error::other("whole layer missing from the store")),
            Err(e) => return Err(io::Error::other(e.to_string())),
        }
        Ok(fetched)
    }

    /// Reads `range` of the backend once, against `deadline`, in a thread of its own so
    /// that a backend that never answers cannot hold the caller.
    fn fetch(&self, range: Range<u64>, deadline: Instant) -> io::Result<Vec<u8>> {
        self.fetch_from(&self.backend, range, deadline)
    }

    fn fetch_from(
        &self,
        backend: &Arc<dyn RangeSource>,
        range: Range<u64>,
        deadline: Instant,
    ) -> io::Result<Vec<u8>> {
        self.fetch_many_from(backend, std::slice::from_ref(&range), deadline)?
            .pop()
            .ok_or_else(|| io::Error::other("backend returned no range"))
    }

    /// `ranges` (sorted, not touching) from `backend`, in one request where it batches
    /// ranges ([`RangeSource::batches_ranges`]): one limiter turn, one deadline. When no
    /// slot is free the fetch queues, and may go out joined with others of the same blob
    /// in one request ([`limiter`]).
    fn fetch_many_from(
        &self,
        backend: &Arc<dyn RangeSource>,
        ranges: &[Range<u64>],
        deadline: Instant,
    ) -> io::Result<Vec<Vec<u8>>> {
        let windows = !Arc::ptr_eq(backend, &self.backend);
        let background = is_background();
        let started = Instant::now();
        let blob = backend
            .batches_ranges()
            .then_some(Arc::as_ptr(backend) as *const () as usize);
        let turn = self
            .limiter
            .turn(
                blob,
                is_reader(),
                ranges,
                self.config.max_request_bytes,
                deadline,
            )
            .inspect_err(|_| {
                MountStats::add(&self.stats.fetch_errors, 1);
            })?;
        let (rx, riders, asked_ranges) = match turn {
            Turn::Joined(rx) => (rx, None, 0),
            Turn::Lead { slot, riders } => {
                let (tx, rx) = mpsc::sync_channel(1);
                let asked = backend.clone();
                let own = ranges.to_vec();
                // One request's ranges: every fetch's, sorted, overlapping and touching
                // ones merged.
                let all = merge_ranges(
                    own.iter()
                        .chain(riders.iter().flat_map(|r| r.ranges.iter()))
                        .cloned()
                        .collect(),
                );
                let n = (riders.len(), all.len());
                std::thread::Builder::new()
                    .name("ferry-fetch".into())
                    .spawn(move || {
                        let _slot = slot;
                        link().begin(Instant::now());
                        let outcome = match all.as_slice() {
                            [one] => asked.read_range(one.clone()).map(|b| vec![b]),
                            many => asked.read_ranges(many),
                        };
                        let got = outcome
                            .as_ref()
                            .map_or(0, |bs| bs.iter().map(|b| b.len() as u64).sum());
                        link().end(Instant::now(), got);
                        match outcome {
                            Ok(answer) => {
                                for r in riders {
                                    let _ = r.tx.send(Ok(share_of(&all, &answer, &r.ranges)));
                                }
                                let mine = if all == own {
                                    answer
                                } else {
                                    share_of(&all, &answer, &own)
                                };
                                let _ = tx.send(Ok(mine));
                            }
                            Err(e) => {
                                for r in riders {
                                    let _ = r.tx.send(Err(copy_error(&e)));
                                }
                                let _ = tx.send(Err(e));
                            }
                        }
                    })?;
                (rx, Some(n.0), n.1)
            }
        };
        let (first, last) = match (ranges.first(), ranges.last()) {
            (Some(f), Some(l)) => (f.start, l.end),
            _ => (0, 0),
        };
        let wait = deadline.saturating_duration_since(Instant::now());
        let result = match rx.recv_timeout(wait) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(timed_out(&format!(
                "fetching bytes {first}..{last} of the layer"
            ))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(io::Error::other("fetch thread ended without an answer"))
            }
        };
        // A fetch taken along in another's request is not a request of its own.
        let requests = match riders {
            None => {
                MountStats::add(&self.stats.requests_joined, 1);
                0
            }
            Some(_) if blob.is_none() => asked_ranges as u64,
            Some(_) => 1,
        };
        MountStats::add(&self.stats.requests, requests);
        // One line per request, for where a start's round trips went (FERRY_LOG debug).
        tracing::debug!(
            start = first,
            len = ranges.iter().map(|r| r.end - r.start).sum::<u64>(),
            ranges = ranges.len(),
            windows,
            background,
            // Taken along in another fetch's request; else the fetches this one carried.
            joined = riders.is_none(),
            riders = riders.unwrap_or(0),
            thread = std::thread::current().name().unwrap_or("-"),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "backend request"
        );
        match &result {
            Ok(pieces) => {
                MountStats::add(
                    &self.stats.bytes_fetched,
                    pieces.iter().map(|b| b.len() as u64).sum(),
                );
                let short = pieces.len() != ranges.len()
                    || pieces
                        .iter()
                        .zip(ranges)
                        .any(|(b, r)| b.len() as u64 != r.end - r.start);
                if short {
                    MountStats::add(&self.stats.fetch_errors, 1);
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "backend returned a short range",
                    ));
                }
            }
            Err(e) => {
                MountStats::add(&self.stats.fetch_errors, 1);
                tracing::warn!(start = first, end = last, error = %e, "fetch failed");
            }
        }
        result
    }

    /// Claims `key`: `Ok(lead)` to lead (fetch and land it), `Err(flight)` to follow.
    fn claim(&self, key: FlightKey) -> Result<Lead, Arc<Flight>> {
        match self.flights.claim(key) {
            flight::Claim::Lead(lead) => Ok(lead),
            flight::Claim::Follow(flight) => Err(flight),
        }
    }

    fn land(lead: &mut Lead, outcome: io::Result<Arc<Vec<u8>>>) {
        lead.land(outcome.map_err(|e| (e.kind(), e.to_string())));
    }

    fn cached(&self, spans: &Spans, k: usize) -> Option<Arc<Vec<u8>>> {
        let store = self.store.as_ref()?;
        let key = ChunkKey::from_raw(spans.digests[k]);
        match store.get(&key) {
            Ok(Some(bytes)) if bytes.len() as u64 == span_len(&spans.ranges[k]) => {
                Some(Arc::new(bytes))
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, span = k, "chunk store read failed; fetching");
                None
            }
        }
    }

    /// The verified bytes of spans `ks`.
    fn spans_bytes(
        &self,
        spans: &Spans,
        ks: Range<usize>,
        fetched: &mut Fetched,
    ) -> io::Result<Vec<Arc<Vec<u8>>>> {
        self.listed_spans_bytes(spans, &ks.collect::<Vec<_>>(), fetched)
    }

    /// [`Self::spans_bytes`] of spans `ks` (sorted, distinct, not necessarily
    /// neighbours): runs of neighbours are batched into as few requests as the backend
    /// allows, whatever lies between them.
    fn listed_spans_bytes(
        &self,
        spans: &Spans,
        ks: &[usize],
        fetched: &mut Fetched,
    ) -> io::Result<Vec<Arc<Vec<u8>>>> {
        let deadline = Instant::now() + self.config.timeout;
        let mut out: Vec<Option<Arc<Vec<u8>>>> = vec![None; ks.len()];
        let slot_of = |k: usize| ks.binary_search(&k).ok();
        let mut led: Vec<(usize, Lead)> = Vec::new();
        let mut followed: Vec<(usize, Arc<Flight>)> = Vec::new();
        for (slot, k) in ks.iter().copied().enumerate() {
            if let Some(b) = self.cached(spans, k) {
                MountStats::add(&self.stats.cache_hits, 1);
                out[slot] = Some(b);
                continue;
            }
            match self.claim(FlightKey::Piece(spans.kind, k)) {
                Ok(mut f) => {
                    // Another reader may have stored it between the check and the claim.
                    if let Some(b) = self.cached(spans, k) {
                        MountStats::add(&self.stats.cache_hits, 1);
                        Self::land(&mut f, Ok(b.clone()));
                        out[slot] = Some(b);
                    } else {
                        MountStats::add(&self.stats.cache_misses, 1);
                        led.push((k, f));
                    }
                }
                Err(f) => followed.push((k, f)),
            }
        }
        if !led.is_empty() || !followed.is_empty() {
            fetched.waited = true;
        }
        // Lead: runs of neighbouring spans (each at most the request size), and the
        // runs in batches of at most the request size and MAX_RANGES_PER_REQUEST runs,
        // one request each where the backend batches ranges.
        let mut runs: Vec<Range<usize>> = Vec::new();
        let mut i = 0;
        while i < led.len() {
            let mut j = i + 1;
            while j < led.len()
                && led[j].0 == led[j - 1].0 + 1
                && spans.ranges[led[j].0].end - spans.ranges[led[i].0].start
                    <= self.config.max_request_bytes
            {
                j += 1;
            }
            runs.push(i..j);
            i = j;
        }
        let bounds: Vec<Range<u64>> = runs
            .iter()
            .map(|run| spans.ranges[led[run.start].0].start..spans.ranges[led[run.end - 1].0].end)
            .collect();
        let mut first_err: Option<io::Error> = None;
        let mut r = 0;
        while r < runs.len() {
            let mut q = r + 1;
            let mut bytes = span_len(&bounds[r]);
            while q < runs.len() && q - r < MAX_RANGES_PER_REQUEST {
                let next = &bounds[q];
                // A run cut at the request size touches the next: a request of its own.
                if bytes + span_len(next) > self.config.max_request_bytes
                    || bounds[q - 1].end >= next.start
                {
                    break;
                }
                bytes += span_len(next);
                q += 1;
            }
            let batch: Vec<(Range<usize>, Range<u64>)> = runs[r..q]
                .iter()
                .cloned()
                .zip(bounds[r..q].iter().cloned())
                .collect();
            r = q;
            // Per run of the batch: its bytes, or why there are none.
            let mut landed: Vec<Option<io::Result<Vec<u8>>>> = batch
                .iter()
                .map(|(run, _)| {
                    if first_err.is_some() {
                        Some(Err(io::Error::other(
                            "an earlier fetch of this read failed",
                        )))
                    } else {
                        self.failed_recently(spans.kind, led[run.clone()].iter().map(|(k, _)| *k))
                            .map(Err)
                    }
                })
                .collect();
            let asked: Vec<Range<u64>> = batch
                .iter()
                .zip(&landed)
                .filter(|(_, l)| l.is_none())
                .map(|((_, bound), _)| bound.clone())
                .collect();
            if !asked.is_empty() {
                let began = Instant::now();
                let outcome = self
                    .origin(spans.kind)
                    .and_then(|(backend, _)| self.fetch_many_from(backend, &asked, deadline));
                // Which thread asked (a FUSE read, readahead, nearby, prefetch, fill) and
                // how long it took: what a start's critical path is made of.
                tracing::debug!(
                    kind = spans.kind.name(),
                    first = led[batch[0].0.start].0,
                    runs = asked.len(),
                    bytes = asked.iter().map(span_len).sum::<u64>(),
                    ms = began.elapsed().as_secs_f64() * 1e3,
                    by = std::thread::current().name().unwrap_or("?"),
                    "fetched"
                );
                let mut pieces = match outcome {
                    Ok(pieces) => pieces.into_iter().map(Ok).collect::<Vec<_>>(),
                    Err(e) => asked
                        .iter()
                        .map(|_| Err(io::Error::new(e.kind(), e.to_string())))
                        .collect(),
                }
                .into_iter();
                for ((run, _), l) in batch.iter().zip(landed.iter_mut()) {
                    if l.is_none() {
                        let piece = pieces
                            .next()
                            .unwrap_or_else(|| Err(io::Error::other("a run went unanswered")));
                        if piece.is_err() {
                            self.remember_failure(
                                spans.kind,
                                led[run.clone()].iter().map(|(k, _)| *k),
                            );
                        }
                        *l = Some(piece);
                    }
                }
            }
            for ((run, bound), l) in batch.into_iter().zip(landed) {
                let start = bound.start;
                let run = &mut led[run];
                match l.unwrap_or_else(|| Err(io::Error::other("a run went unanswered"))) {
                    Ok(data) => {
                        fetched.bytes += data.len() as u64;
                        for (k, f) in run.iter_mut() {
                            let r = &spans.ranges[*k];
                            let piece = data
                                .get((r.start - start) as usize..(r.end - start) as usize)
                                .unwrap_or_default();
                            let outcome = self
                                .verify_and_store(spans, *k, piece)
                                .or_else(|e| self.refetch_from_fallback(spans, *k, deadline, e));
                            match &outcome {
                                Ok(b) => {
                                    if let Some(slot) = slot_of(*k) {
                                        out[slot] = Some(b.clone());
                                    }
                                    self.forget_failure(spans.kind, *k);
                                    if spans.kind == PieceKind::Span {
                                        fetched.led.push(*k);
                                    }
                                }
                                // Wrong bytes (from the backend and any fallback): back
                                // off like a failed fetch, so rereads do not fetch it again.
                                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                                    self.remember_failure(spans.kind, std::iter::once(*k))
                                }
                                Err(_) => {}
                            }
                            let outcome = outcome.inspect_err(|e| {
                                if first_err.is_none() {
                                    first_err = Some(io::Error::new(e.kind(), e.to_string()));
                                }
                            });
                            Self::land(f, outcome);
                        }
                    }
                    Err(e) => {
                        for (_, f) in run.iter_mut() {
                            Self::land(f, Err(io::Error::new(e.kind(), e.to_string())));
                        }
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for (k, f) in followed {
            MountStats::add(&self.stats.shared_waits, 1);
            if let Some(slot) = slot_of(k) {
                out[slot] = Some(follow(&f, deadline)?);
            }
        }
        out.into_iter()
            .map(|b| b.ok_or_else(|| io::Error::other("span missing after fetch")))
            .collect()
    }

    /// Where pieces of `kind` are fetched, and where they are fetched again when they do
    /// not verify.
    #[allow(clippy::type_complexity)]
    fn origin(
        &self,
        kind: PieceKind,
    ) -> io::Result<(&Arc<dyn RangeSource>, Option<&Arc<dyn RangeSource>>)> {
        match kind {
            PieceKind::Span => Ok((&self.backend, self.fallback.as_ref())),
            PieceKind::Window => {
                let windows = self.windows.as_ref();
                match windows.and_then(|w| w.backend.as_ref()) {
                    Some(b) => Ok((b, windows.and_then(|w| w.fallback.as_ref()))),
                    None => Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        "the layer's index keeps its windows in a windows blob this mount \
                         cannot reach",
                    )),
                }
            }
        }
    }

    /// The bytes of spans `ks` (as [`LayerSource::spans_bytes`]), making local at the
    /// same time the windows of their checkpoints that are not in the store yet (merged
    /// into as few requests as they allow): what warm-up and fill need, whose spans may
    /// be read in any order later. Windows are only fetched when there is a store to
    /// keep them in; one that cannot be fetched fails the call.
    fn spans_and_windows(
        &self,
        spans: &Spans,
        ks: Range<usize>,
        fetched: &mut Fetched,
    ) -> io::Result<Vec<Arc<Vec<u8>>>> {
        let missing_windows = match (&self.windows, &self.store) {
            (Some(w), Some(store)) if w.backend.is_some() => {
                let ws = w.of_checkpoints(ks.clone());
                let missing =
                    |i: &usize| !store.contains(&ChunkKey::from_raw(w.pieces.digests[*i]));
                match (ws.clone().find(missing), ws.rev().find(missing)) {
                    (Some(lo), Some(hi)) => Some((
                        w,
                        w.widened(lo..hi + 1, |i| self.piece_missing(&w.pieces, store, i)),
                    )),
                    _ => None,
                }
            }
            _ => None,
        };
        let Some((windows, ws)) = missing_windows else {
            return self.spans_bytes(spans, ks, fetched);
        };
        std::thread::scope(|scope| {
            let fetching = std::thread::Builder::new()
                .name("ferry-windows".into())
                .spawn_scoped(scope, || {
                    let mut f = Fetched::default();
                    self.spans_bytes(&windows.pieces, ws, &mut f).map(|_| f)
                })?;
            let spans_outcome = self.spans_bytes(spans, ks, fetched);
            let windows_outcome = fetching
                .join()
                .map_err(|_| io::Error::other("fetching windows panicked"))?;
            let spans = spans_outcome?;
            fetched.bytes += windows_outcome?.bytes;
            Ok(spans)
        })
    }

    /// Whether piece `k` of `pieces` (spans or windows) is neither in the store nor being
    /// fetched (false for a piece the table does not have).
    fn piece_missing(&self, pieces: &Spans, store: &Store, k: usize) -> bool {
        let Some(digest) = pieces.digests.get(k) else {
            return false;
        };
        !store.contains(&ChunkKey::from_raw(*digest))
            && !self.flights.contains(&FlightKey::Piece(pieces.kind, k))
    }

    /// [`Self::spans_and_windows`] for spans `ks` (without `windows`, the spans alone),
    /// in pieces of at most `max_request_bytes`, so that warming a large file never
    /// holds more than one request's bytes.
    fn spans_and_windows_in_pieces(
        &self,
        spans: &Spans,
        ks: Range<usize>,
        fetched: &mut Fetched,
        windows: bool,
    ) -> io::Result<()> {
        let mut k = ks.start;
        while k < ks.end {
            let mut l = k + 1;
            while l < ks.end
                && spans.ranges[l].end - spans.ranges[k].start <= self.config.max_request_bytes
            {
                l += 1;
            }
            if windows {
                self.spans_and_windows(spans, k..l, fetched)?;
            } else {
                self.spans_bytes(spans, k..l, fetched)?;
            }
            k = l;
        }
        Ok(())
    }

    /// Span `k` did not verify (`err`): fetch it once more from the fallback source, if
    /// there is one, and verify that.
    fn refetch_from_fallback(
        &self,
        spans: &Spans,
        k: usize,
        deadline: Instant,
        err: io::Error,
    ) -> io::Result<Arc<Vec<u8>>> {
        let Some(fallback) = self.origin(spans.kind).ok().and_then(|(_, f)| f) else {
            return Err(err);
        };
        if err.kind() != io::ErrorKind::InvalidData {
            return Err(err);
        }
        tracing::warn!(kind = spans.kind.name(), piece = k, error = %err, "piece did not verify; fetching it again from the registry");
        let piece = self.fetch_from(fallback, spans.ranges[k].clone(), deadline)?;
        self.verify_and_store(spans, k, &piece)
    }

    /// An error when one of `ks` failed (to fetch or to verify) within its failure
    /// memory (see [`FAILURE_MEMORY`]).
    fn failed_recently(
        &self,
        kind: PieceKind,
        ks: impl Iterator<Item = usize>,
    ) -> Option<io::Error> {
        let failures = self.recent_failures.lock();
        if failures.is_empty() {
            return None;
        }
        let now = Instant::now();
        for k in ks {
            if let Some(f) = failures.get(&(kind, k))
                && now.saturating_duration_since(f.at) < f.memory()
            {
                MountStats::add(&self.stats.fetch_errors, 1);
                return Some(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{} {k} failed moments ago ({} time(s) in a row); not fetched again \
                         for {} s",
                        kind.name(),
                        f.count,
                        f.memory().as_secs()
                    ),
                ));
            }
        }
        None
    }

    /// Notes that pieces `ks` failed now: each failure in a row doubles how long they
    /// are left alone. Failures older than twice [`MAX_FAILURE_MEMORY`] are forgotten.
    fn remember_failure(&self, kind: PieceKind, ks: impl Iterator<Item = usize>) {
        let mut failures = self.recent_failures.lock();
        let now = Instant::now();
        let forget = MAX_FAILURE_MEMORY.saturating_mul(2);
        failures.retain(|_, f| now.saturating_duration_since(f.at) < forget);
        for k in ks {
            let count = failures.get(&(kind, k)).map_or(0, |f| f.count);
            failures.insert(
                (kind, k),
                Failure {
                    at: now,
                    count: count.saturating_add(1),
                },
            );
        }
    }

    /// Forgets the failures of piece `k` (it just verified).
    fn forget_failure(&self, kind: PieceKind, k: usize) {
        let mut failures = self.recent_failures.lock();
        if !failures.is_empty() {
            failures.remove(&(kind, k));
        }
    }

    fn verify_and_store(&self, spans: &Spans, k: usize, piece: &[u8]) -> io::Result<Arc<Vec<u8>>> {
        let chunk = ferry_store::Hashed::new(piece);
        let actual = chunk.key().raw();
        if *actual != spans.digests[k] || piece.len() as u64 != span_len(&spans.ranges[k]) {
            MountStats::add(&self.stats.verify_failures, 1);
            MountStats::add(&self.stats.fetch_errors, 1);
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} {k}: digest mismatch (expected sha256:{}, got sha256:{})",
                    spans.kind.name(),
                    hex::encode(spans.digests[k]),
                    hex::encode(actual)
                ),
            ));
        }
        if let Some(store) = &self.store
            && let Err(e) = store.put_hashed(&chunk)
        {
            tracing::warn!(error = %e, kind = spans.kind.name(), piece = k, "could not store a verified piece; serving it anyway");
        }
        Ok(Arc::new(piece.to_vec()))
    }

    fn read_spans(&self, spans: &Spans, range: Range<u64>) -> io::Result<Vec<u8>> {
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "range too large"))?;
        let Range {
            start: first,
            end: last,
        } = spans.covering(&range);
        if first >= last {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "range outside the layer's spans",
            ));
        }
        let bytes = if is_background() {
            self.spans_bytes(spans, first..last, &mut Fetched::default())?
        } else {
            self.note_used(first..last);
            self.read_spans_ahead(spans, first..last)?
        };
        let mut out = vec![0u8; len];
        let mut covered = range.start;
        for (k, b) in (first..last).zip(bytes) {
            let r = &spans.ranges[k];
            let lo = r.start.max(range.start);
            let hi = r.end.min(range.end);
            if lo > covered {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "gap between spans",
                ));
            }
            if lo < hi {
                out[(lo - range.start) as usize..(hi - range.start) as usize]
                    .copy_from_slice(&b[(lo - r.start) as usize..(hi - r.start) as usize]);
                covered = covered.max(hi);
            }
        }
        if covered < range.end {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "range reaches past the layer's spans",
            ));
        }
        Ok(out)
    }

    /// The bytes of spans `demand` for a read, with readahead (see the module doc):
    /// a miss brings the window after it in the same request, a read reaching a window
    /// starts the next one in the background.
    fn read_spans_ahead(
        &self,
        spans: &Spans,
        demand: Range<usize>,
    ) -> io::Result<Vec<Arc<Vec<u8>>>> {
        let Some(store) = self
            .store
            .as_deref()
            .filter(|_| self.config.readahead_bytes > 0)
        else {
            let mut fetched = Fetched::default();
            let bytes = self.spans_bytes(spans, demand, &mut fetched)?;
            if fetched.waited {
                self.stats.read_waited();
            }
            return Ok(bytes);
        };
        let map = StreamMap {
            source: self,
            spans,
            store,
        };
        let missed = demand.clone().any(|k| map.is_missing(k));
        let plan =
            self.readahead
                .lock()
                .plan(demand.clone(), missed, self.config.readahead_bytes, &map);
        let mut fetched = Fetched::default();
        let bytes = if plan.sync_end > demand.end {
            let ahead: u64 = (demand.end..plan.sync_end)
                .map(|k| span_len(&spans.ranges[k]))
                .sum();
            // Spans only: the read fetches its own window, and reads moving on through
            // the spans keep the later checkpoints' windows as they inflate through them
            // (`ferry_index::inflated`), so readahead costs one request, not two.
            let mut bytes = self.spans_bytes(spans, demand.start..plan.sync_end, &mut fetched)?;
            MountStats::add(&self.stats.bytes_readahead, ahead);
            let ahead_led: Vec<usize> = fetched
                .led
                .iter()
                .copied()
                .filter(|&k| k >= demand.end)
                .collect();
            self.note_guessed(Guess::Readahead, &ahead_led);
            bytes.truncate(demand.len());
            bytes
        } else {
            self.spans_bytes(spans, demand, &mut fetched)?
        };
        if fetched.waited {
            self.stats.read_waited();
        }
        if let Some(ks) = plan.background {
            self.read_ahead_in_background(ks);
        }
        Ok(bytes)
    }

    /// Notes spans `ks`, fetched by this source itself, as guesses of `kind`: no read
    /// asked for them (yet).
    fn note_guessed(&self, kind: Guess, ks: &[usize]) {
        for &k in ks {
            if let Some(flag) = self.guessed.get(k)
                && flag
                    .compare_exchange(0, kind.flag(), Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                && let Some(r) = self.spans.as_ref().and_then(|s| s.ranges.get(k))
            {
                MountStats::add(&self.stats.bytes_guessed[kind.index()], span_len(r));
            }
        }
    }

    /// A read served from elsewhere (the small-file pack) wanted compressed `range`:
    /// the guesses among its spans were worth their bytes, as in [`Self::note_used`].
    pub(crate) fn note_used_range(&self, range: &Range<u64>) {
        if let Some(spans) = &self.spans {
            self.note_used(spans.covering(range));
        }
    }

    /// A read wants spans `ks`: the guesses among them were worth their bytes. (A load
    /// first: this runs on every read, and most spans are no pending guess.)
    fn note_used(&self, ks: Range<usize>) {
        for k in ks {
            let Some(flag) = self.guessed.get(k) else {
                continue;
            };
            if flag.load(Ordering::Relaxed) == 0 {
                continue;
            }
            if let Some(kind) = Guess::of_flag(flag.swap(0, Ordering::AcqRel))
                && let Some(r) = self.spans.as_ref().and_then(|s| s.ranges.get(k))
            {
                MountStats::add(&self.stats.bytes_guessed_used[kind.index()], span_len(r));
            }
        }
    }

    /// Fetches spans `ks` (and their windows) in a thread of its own, at most one per
    /// layer at a time; nothing when the source is not shared ([`Self::into_shared`]).
    fn read_ahead_in_background(&self, ks: Range<usize>) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        if self.readahead_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("ferry-readahead".into())
            .spawn(move || {
                if let Some(spans) = &me.spans {
                    let mut fetched = Fetched::default();
                    match me.spans_bytes(spans, ks.clone(), &mut fetched) {
                        Ok(_) => {
                            MountStats::add(&me.stats.bytes_readahead, fetched.bytes);
                            me.note_guessed(Guess::Readahead, &fetched.led);
                        }
                        Err(e) => tracing::debug!(
                            start = ks.start,
                            end = ks.end,
                            error = %e,
                            "readahead failed; the spans are fetched when read"
                        ),
                    }
                }
                me.readahead_running.store(false, Ordering::Release);
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "cannot start a readahead thread");
            self.readahead_running.store(false, Ordering::Release);
        }
    }

    fn read_shared(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        if let Some(local) = self.whole.as_ref().and_then(|w| w.local.get()) {
            return local.read_range(range);
        }
        if let Some(bytes) = self.held.lock().get(&range) {
            MountStats::add(&self.stats.cache_hits, 1);
            return Ok(bytes);
        }
        if let Some(bytes) = self.read_partly_held(&range)? {
            return Ok(bytes);
        }
        let deadline = Instant::now() + self.config.timeout;
        let key = FlightKey::Range(range.start, range.end);
        match self.claim(key) {
            Ok(mut f) => {
                let outcome = self.fetch(range.clone(), deadline).map(Arc::new);
                if let Ok(bytes) = &outcome {
                    self.hold_read(range.start, bytes);
                }
                let copy = outcome
                    .as_ref()
                    .map(|b| b.as_ref().clone())
                    .map_err(|e| io::Error::new(e.kind(), e.to_string()));
                Self::land(&mut f, outcome);
                copy
            }
            Err(f) => {
                MountStats::add(&self.stats.shared_waits, 1);
                follow(&f, deadline).map(|b| b.as_ref().clone())
            }
        }
    }
}

impl LayerSource {
    /// Serves `range` from what is held at its ends and one fetch of the middle; `None`
    /// when nothing at either end is held. A format reader asks for whole chunks, and
    /// consecutive reads of a file share their boundary chunk: without this each read
    /// fetched that chunk again (podman's zstd:chunked layers, ~50 KB chunks).
    fn read_partly_held(&self, range: &Range<u64>) -> io::Result<Option<Vec<u8>>> {
        if range.start >= range.end {
            return Ok(None);
        }
        let (mut out, (tail_start, tail)) = self.held.lock().ends(range);
        if out.is_empty() && tail.is_empty() {
            return Ok(None);
        }
        let middle = range.start + out.len() as u64..tail_start;
        if middle.start < middle.end {
            // Strictly shorter than `range`: the recursion ends.
            let got = self.read_shared(middle.clone())?;
            if got.len() as u64 != middle.end - middle.start {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("short answer for bytes {middle:?}: {} bytes", got.len()),
                ));
            }
            out.extend_from_slice(&got);
        }
        let pos = range.start + out.len() as u64;
        if pos < range.end {
            out.extend_from_slice(&tail[(pos - tail_start) as usize..]);
        }
        MountStats::add(&self.stats.cache_hits, 1);
        Ok(Some(out))
    }

    /// Keeps bytes fetched for a read of a passthrough (eStargz) layer, up to
    /// [`MAX_HELD_READ_BYTES`] per layer: its format reader fetches a whole chunk for any
    /// read inside it, and a program reads one file in many small reads, so without this
    /// every read fetched the chunk again (28 MB for a 1.6 MB layer at one start). Spans
    /// of indexed layers go to the store instead; this is for sources that cannot verify
    /// what they hold (the format reader verifies every chunk it inflates).
    fn hold_read(&self, start: u64, bytes: &Arc<Vec<u8>>) {
        let n = bytes.len() as u64;
        let mut held = self.held.lock();
        if held.bytes + n <= MAX_HELD_READ_BYTES && !held.ranges.contains_key(&start) {
            held.bytes += n;
            held.ranges.insert(start, bytes.clone());
        }
    }
}

fn interrupted() -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, "stopped")
}

/// The blob as a `Read`, fetched in pieces of `max_request_bytes`, each piece asked of
/// `gate` first.
struct RangeReader<'a> {
    source: &'a LayerSource,
    pos: u64,
    buf: Vec<u8>,
    at: usize,
    gate: &'a dyn Fn(u64) -> bool,
    fetched: u64,
    /// The gate refused: the error returned is a stop, not a failure.
    stopped: bool,
}

impl io::Read for RangeReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.at == self.buf.len() {
            let len = self.source.backend.len();
            if self.pos >= len {
                return Ok(0);
            }
            let end = (self.pos + self.source.config.max_request_bytes.max(1)).min(len);
            if !(self.gate)(end - self.pos) {
                self.stopped = true;
                // Not `Interrupted`: readers retry on that.
                return Err(io::Error::other("warm-up stopped"));
            }
            let deadline = Instant::now() + self.source.config.timeout;
            self.buf = self.source.fetch(self.pos..end, deadline)?;
            self.fetched += self.buf.len() as u64;
            self.at = 0;
            self.pos = end;
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

fn span_len(r: &Range<u64>) -> u64 {
    r.end - r.start
}

/// An indexed layer's spans as readahead sees them: missing is neither in the store
/// nor being fetched.
struct StreamMap<'a> {
    source: &'a LayerSource,
    spans: &'a Spans,
    store: &'a Store,
}

impl SpanMap for StreamMap<'_> {
    fn spans(&self) -> usize {
        self.spans.ranges.len()
    }

    fn span_bytes(&self, k: usize) -> u64 {
        self.spans.ranges.get(k).map_or(0, span_len)
    }

    fn is_missing(&self, k: usize) -> bool {
        self.source.piece_missing(self.spans, self.store, k)
    }
}

impl RangeSource for LayerSource {
    fn len(&self) -> u64 {
        self.backend.len()
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        if range.start > range.end || range.end > self.backend.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "range {}..{} is outside the blob of {} bytes",
                    range.start,
                    range.end,
                    self.backend.len()
                ),
            ));
        }
        if range.start == range.end {
            return Ok(Vec::new());
        }
        match &self.spans {
            Some(spans) => self.read_spans(spans, range),
            None => self.read_shared(range),
        }
    }

    /// An indexed layer's ranges are built from spans verified against the index they
    /// were built from ([`Self::verify_and_store`], or the store's own check of its
    /// content-addressed entries), the one the layer's reader inflates with.
    fn verifies_spans(&self) -> bool {
        self.spans.is_some()
    }
}

impl LayerSource {
    /// The chunk-store entries [`LayerSource::warm_range`] makes local for `range`, each
    /// with its size: what a mount pins as its hot set (see `crate::warm`). For an
    /// indexed layer with a store, the spans covering `range` and, when the index keeps
    /// its inflate windows in a windows blob, their checkpoints' windows (a read of a
    /// span needs both); otherwise nothing (eStargz warm-up holds bytes in memory, and a
    /// whole-blob entry is fill, not hot).
    pub fn hot_keys(&self, range: Range<u64>) -> Vec<(ChunkKey, u64)> {
        let (Some(spans), Some(_)) = (&self.spans, &self.store) else {
            return Vec::new();
        };
        if range.start >= range.end || range.end > self.backend.len() {
            return Vec::new();
        }
        let ks = spans.covering(&range);
        let pieces = |table: &Spans, ks: Range<usize>| {
            ks.map(|k| {
                (
                    ChunkKey::from_raw(table.digests[k]),
                    span_len(&table.ranges[k]),
                )
            })
            .collect::<Vec<_>>()
        };
        let mut keys = pieces(spans, ks.clone());
        if let Some(w) = &self.windows {
            keys.extend(pieces(&w.pieces, w.of_checkpoints(ks)));
        }
        keys
    }
}

impl WindowSource for LayerSource {
    /// Checkpoint `k`'s window: from the store, else fetched from the windows blob (one
    /// flight per window however many readers want it), verified and stored.
    fn window(&self, k: usize, at: &WindowRef) -> io::Result<Vec<u8>> {
        let windows = self.windows.as_ref().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "this layer's index has no windows blob",
            )
        })?;
        let w = windows.of_checkpoints(k..k + 1);
        if w.len() != 1 || windows.pieces.digests[w.start] != at.sha256 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("checkpoint {k} has no window in this layer's windows blob"),
            ));
        }
        // With its block's missing neighbours (see WINDOW_BLOCK), when they can be kept.
        let block = match &self.store {
            Some(store) => {
                windows.widened(w.clone(), |i| self.piece_missing(&windows.pieces, store, i))
            }
            None => w.clone(),
        };
        let mut fetched = Fetched::default();
        let bytes = self.spans_bytes(&windows.pieces, block.clone(), &mut fetched)?;
        // A read fetching its span too is counted there (it waits for both at once).
        if fetched.waited && self.span_is_local(k) && !is_background() {
            self.stats.read_waited();
        }
        let window = bytes
            .into_iter()
            .nth(w.start - block.start)
            .ok_or_else(|| io::Error::other("window missing after fetch"))?;
        Ok(Arc::unwrap_or_clone(window))
    }

    fn is_local(&self, _k: usize, at: &WindowRef) -> bool {
        self.store
            .as_ref()
            .is_some_and(|s| s.contains(&ChunkKey::from_raw(at.sha256)))
    }

    fn span_is_local(&self, k: usize) -> bool {
        match (&self.spans, &self.store) {
            (Some(spans), Some(store)) => spans
                .digests
                .get(k)
                .is_some_and(|d| store.contains(&ChunkKey::from_raw(*d))),
            _ => false,
        }
    }
}

/// A whole blob held in the chunk store, as a [`RangeSource`].
#[derive(Debug)]
pub struct ChunkSource(pub ferry_store::ChunkFile);

impl RangeSource for ChunkSource {
    fn len(&self) -> u64 {
        self.0.len()
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        if range.start > range.end || range.end > self.0.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "range outside the stored blob",
            ));
        }
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "range too large"))?;
        let mut buf = vec![0u8; len];
        self.0.file().read_exact_at(&mut buf, range.start)?;
        Ok(buf)
    }
}

#[cfg(test)]
#[path = "tests.rs"]
pub(crate) mod tests;
