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
//! Layers without span digests (eStargz, whose chunk digests are over uncompressed
//! bytes that only the format reader sees) get the same single-flight, timeout and
//! accounting per requested range, but nothing is stored: the format reader verifies.
//!
//! Failure is bounded: every fetch runs against a deadline of [`FetchConfig::timeout`]
//! (waiting for a concurrency slot included) and fails with `TimedOut` after it; a
//! backend that never answers holds one slot, never a reader.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_index::ferryidx::LayerIndex;
use ferry_index::source::RangeSource;
use ferry_store::{ChunkKey, Store};
use sha2::{Digest as _, Sha256};

use crate::stats::MountStats;

/// The knobs users tune per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchConfig {
    /// Concurrent backend requests per image.
    pub concurrency: usize,
    /// Largest merged request, in compressed bytes (a single span larger than this is
    /// still fetched whole: it cannot be verified in pieces).
    pub max_request_bytes: u64,
    /// Longest a read waits for bytes that are not cached before failing with EIO.
    pub timeout: Duration,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            concurrency: 8,
            max_request_bytes: 8 << 20,
            timeout: Duration::from_secs(30),
        }
    }
}

/// Bounds concurrent backend requests of one image. Slots are released when the fetch
/// thread finishes, so a hung backend keeps its slot and cannot pile up threads.
#[derive(Debug)]
pub struct Limiter {
    free: Mutex<usize>,
    cv: Condvar,
}

impl Limiter {
    /// A limiter with `slots` slots (at least one).
    pub fn new(slots: usize) -> Arc<Limiter> {
        Arc::new(Limiter {
            free: Mutex::new(slots.max(1)),
            cv: Condvar::new(),
        })
    }

    fn acquire(self: &Arc<Self>, deadline: Instant) -> io::Result<Slot> {
        let mut free = lock(&self.free);
        while *free == 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(timed_out("waiting for a fetch slot"));
            }
            free = self
                .cv
                .wait_timeout(free, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        *free -= 1;
        Ok(Slot(self.clone()))
    }
}

struct Slot(Arc<Limiter>);

impl Drop for Slot {
    fn drop(&mut self) {
        *lock(&self.0.free) += 1;
        self.0.cv.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("{what}: timed out"))
}

/// What a fetch ended with, shareable between the threads waiting for it.
type FlightOutcome = Result<Arc<Vec<u8>>, (io::ErrorKind, String)>;

/// One fetch in progress; followers wait for its outcome.
#[derive(Debug, Default)]
struct Flight {
    outcome: Mutex<Option<FlightOutcome>>,
    cv: Condvar,
}

impl Flight {
    fn finish(&self, outcome: FlightOutcome) {
        let mut o = lock(&self.outcome);
        if o.is_none() {
            *o = Some(outcome);
        }
        self.cv.notify_all();
    }

    fn wait(&self, deadline: Instant) -> io::Result<Arc<Vec<u8>>> {
        let mut o = lock(&self.outcome);
        loop {
            if let Some(r) = o.as_ref() {
                return r.clone().map_err(|(k, m)| io::Error::new(k, m));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(timed_out("waiting for another reader's fetch"));
            }
            o = self
                .cv
                .wait_timeout(o, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

/// Span table of an indexed layer.
#[derive(Debug)]
struct Spans {
    ranges: Vec<Range<u64>>,
    digests: Vec<[u8; 32]>,
}

/// Where a flight is filed: a span number, or an exact range for unindexed layers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum FlightKey {
    Span(usize),
    Range(u64, u64),
}

/// The [`RangeSource`] one layer's reader uses: cache first, then one verified,
/// deadline-bounded, shared fetch from the backend.
pub struct LayerSource {
    backend: Arc<dyn RangeSource>,
    spans: Option<Spans>,
    store: Option<Arc<Store>>,
    limiter: Arc<Limiter>,
    config: FetchConfig,
    stats: Arc<MountStats>,
    flights: Mutex<HashMap<FlightKey, Arc<Flight>>>,
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
            ranges,
            digests: index.span_digests.clone(),
        });
        LayerSource {
            backend,
            spans,
            store,
            limiter,
            config,
            stats,
            flights: Mutex::new(HashMap::new()),
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
            spans: None,
            store: None,
            limiter,
            config,
            stats,
            flights: Mutex::new(HashMap::new()),
        }
    }

    /// Reads `range` of the backend once, against `deadline`, in a thread of its own so
    /// that a backend that never answers cannot hold the caller.
    fn fetch(&self, range: Range<u64>, deadline: Instant) -> io::Result<Vec<u8>> {
        let slot = self.limiter.acquire(deadline).inspect_err(|_| {
            MountStats::add(&self.stats.fetch_errors, 1);
        })?;
        let (tx, rx) = mpsc::sync_channel(1);
        let backend = self.backend.clone();
        let want = range.clone();
        std::thread::Builder::new()
            .name("ferry-fetch".into())
            .spawn(move || {
                let _slot = slot;
                let _ = tx.send(backend.read_range(want));
            })?;
        let wait = deadline.saturating_duration_since(Instant::now());
        let result = match rx.recv_timeout(wait) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(timed_out(&format!(
                "fetching bytes {}..{} of the layer",
                range.start, range.end
            ))),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(io::Error::other("fetch thread ended without an answer"))
            }
        };
        MountStats::add(&self.stats.requests, 1);
        match &result {
            Ok(bytes) => {
                MountStats::add(&self.stats.bytes_fetched, bytes.len() as u64);
                if bytes.len() as u64 != range.end - range.start {
                    MountStats::add(&self.stats.fetch_errors, 1);
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "backend returned a short range",
                    ));
                }
            }
            Err(e) => {
                MountStats::add(&self.stats.fetch_errors, 1);
                tracing::warn!(start = range.start, end = range.end, error = %e, "fetch failed");
            }
        }
        result
    }

    /// Claims `key`: `Ok(flight)` to lead (fetch and finish it), `Err(flight)` to follow.
    fn claim(&self, key: FlightKey) -> Result<Arc<Flight>, Arc<Flight>> {
        let mut flights = lock(&self.flights);
        if let Some(f) = flights.get(&key) {
            return Err(f.clone());
        }
        let f = Arc::new(Flight::default());
        flights.insert(key, f.clone());
        Ok(f)
    }

    fn land(&self, key: &FlightKey, flight: &Flight, outcome: io::Result<Arc<Vec<u8>>>) {
        flight.finish(outcome.map_err(|e| (e.kind(), e.to_string())));
        lock(&self.flights).remove(key);
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
    fn spans_bytes(&self, spans: &Spans, ks: Range<usize>) -> io::Result<Vec<Arc<Vec<u8>>>> {
        let deadline = Instant::now() + self.config.timeout;
        let mut out: Vec<Option<Arc<Vec<u8>>>> = vec![None; ks.len()];
        let mut led: Vec<(usize, Arc<Flight>)> = Vec::new();
        let mut followed: Vec<(usize, Arc<Flight>)> = Vec::new();
        for (slot, k) in ks.clone().enumerate() {
            if let Some(b) = self.cached(spans, k) {
                MountStats::add(&self.stats.cache_hits, 1);
                out[slot] = Some(b);
                continue;
            }
            match self.claim(FlightKey::Span(k)) {
                Ok(f) => {
                    // Another reader may have stored it between the check and the claim.
                    if let Some(b) = self.cached(spans, k) {
                        MountStats::add(&self.stats.cache_hits, 1);
                        self.land(&FlightKey::Span(k), &f, Ok(b.clone()));
                        out[slot] = Some(b);
                    } else {
                        MountStats::add(&self.stats.cache_misses, 1);
                        led.push((k, f));
                    }
                }
                Err(f) => followed.push((k, f)),
            }
        }
        // Lead: fetch runs of neighbouring spans, each run one request.
        let mut first_err: Option<io::Error> = None;
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
            let run = &led[i..j];
            let start = spans.ranges[run[0].0].start;
            let end = spans.ranges[run[run.len() - 1].0].end;
            let fetched = if first_err.is_some() {
                Err(io::Error::other("an earlier fetch of this read failed"))
            } else {
                self.fetch(start..end, deadline)
            };
            match fetched {
                Ok(data) => {
                    for (k, f) in run {
                        let r = &spans.ranges[*k];
                        let piece = data
                            .get((r.start - start) as usize..(r.end - start) as usize)
                            .unwrap_or_default();
                        let outcome = self.verify_and_store(spans, *k, piece);
                        if let Ok(b) = &outcome {
                            out[*k - ks.start] = Some(b.clone());
                        }
                        let outcome = outcome.inspect_err(|e| {
                            if first_err.is_none() {
                                first_err = Some(io::Error::new(e.kind(), e.to_string()));
                            }
                        });
                        self.land(&FlightKey::Span(*k), f, outcome);
                    }
                }
                Err(e) => {
                    for (k, f) in run {
                        self.land(
                            &FlightKey::Span(*k),
                            f,
                            Err(io::Error::new(e.kind(), e.to_string())),
                        );
                    }
                    first_err.get_or_insert(e);
                }
            }
            i = j;
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for (k, f) in followed {
            MountStats::add(&self.stats.shared_waits, 1);
            out[k - ks.start] = Some(f.wait(deadline)?);
        }
        out.into_iter()
            .map(|b| b.ok_or_else(|| io::Error::other("span missing after fetch")))
            .collect()
    }

    fn verify_and_store(&self, spans: &Spans, k: usize, piece: &[u8]) -> io::Result<Arc<Vec<u8>>> {
        let actual: [u8; 32] = Sha256::digest(piece).into();
        if actual != spans.digests[k] || piece.len() as u64 != span_len(&spans.ranges[k]) {
            MountStats::add(&self.stats.verify_failures, 1);
            MountStats::add(&self.stats.fetch_errors, 1);
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "span {k}: digest mismatch (expected sha256:{}, got sha256:{})",
                    hex::encode(spans.digests[k]),
                    hex::encode(actual)
                ),
            ));
        }
        if let Some(store) = &self.store
            && let Err(e) = store.put(&ChunkKey::from_raw(actual), piece)
        {
            tracing::warn!(error = %e, span = k, "could not store a verified span; serving it anyway");
        }
        Ok(Arc::new(piece.to_vec()))
    }

    fn read_spans(&self, spans: &Spans, range: Range<u64>) -> io::Result<Vec<u8>> {
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "range too large"))?;
        let first = spans.ranges.partition_point(|r| r.end <= range.start);
        let last = spans.ranges.partition_point(|r| r.start < range.end);
        if first >= last {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "range outside the layer's spans",
            ));
        }
        let bytes = self.spans_bytes(spans, first..last)?;
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

    fn read_shared(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        let deadline = Instant::now() + self.config.timeout;
        let key = FlightKey::Range(range.start, range.end);
        match self.claim(key.clone()) {
            Ok(f) => {
                let outcome = self.fetch(range, deadline).map(Arc::new);
                let copy = outcome
                    .as_ref()
                    .map(|b| b.as_ref().clone())
                    .map_err(|e| io::Error::new(e.kind(), e.to_string()));
                self.land(&key, &f, outcome);
                copy
            }
            Err(f) => {
                MountStats::add(&self.stats.shared_waits, 1);
                f.wait(deadline).map(|b| b.as_ref().clone())
            }
        }
    }
}

fn span_len(r: &Range<u64>) -> u64 {
    r.end - r.start
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
#[path = "device_tests.rs"]
pub(crate) mod tests;
