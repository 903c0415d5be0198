//! Tests of the device and cache layers: real gzip layers indexed by ferry-index, read
//! through [`LayerSource`] over in-memory backends that count, stall, corrupt or hang.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ferry_index::ferryidx::LayerIndex;
use ferry_index::inflated::InflatedSpans;
use ferry_index::reader::{LayerFormat, LayerReader};
use ferry_index::source::{MemSource, RangeSource};
use ferry_store::{Store, StoreOptions};

use super::*;

/// Incompressible test bytes.
pub(crate) fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Test files: path and content.
pub(crate) type Files = Vec<(String, Vec<u8>)>;

/// A tar of regular files (mode 0644), in order.
pub(crate) fn tar_of<D: AsRef<[u8]>>(files: &[(&str, D)]) -> Vec<u8> {
    tar_builder_of(files).into_inner().unwrap()
}

/// [`tar_of`], not yet finished (for more entries of other kinds).
pub(crate) fn tar_builder_of<D: AsRef<[u8]>>(files: &[(&str, D)]) -> tar::Builder<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let data = data.as_ref();
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        tar.append_data(&mut h, path, data).unwrap();
    }
    tar
}

/// A passthrough source over `backend` (two fetch slots, default timeouts).
fn passthrough(backend: Arc<TestBackend>, stats: Arc<MountStats>) -> LayerSource {
    LayerSource::passthrough(backend, Limiter::new(2), FetchConfig::default(), stats)
}

/// A gzip layer of `files` (one gzip member per 64 KiB of tar, as `ferry pack` writes:
/// every member start is a checkpoint candidate, so the layer has many spans) and its
/// ferry index with 64 KiB spans.
pub(crate) fn indexed_gzip_layer(files: &[(&str, Vec<u8>)]) -> (Vec<u8>, LayerIndex) {
    let tar = tar_of(files);
    let mut blob = Vec::new();
    for piece in tar.chunks(64 << 10) {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(piece).unwrap();
        blob.extend(gz.finish().unwrap());
    }
    let index = ferry_index::indexer::index_gzip(&blob[..], 64 << 10, None).unwrap();
    (blob, index)
}

/// A gzip layer with files `a` (300 KiB), `b` (5 bytes) and `dir/c` (200 KiB), and its
/// ferry index with 64 KiB spans.
pub(crate) fn gzip_layer() -> (Vec<u8>, LayerIndex, Files) {
    let files = vec![
        ("a".to_string(), noise(300 << 10, 1)),
        ("b".to_string(), b"hello".to_vec()),
        ("dir/c".to_string(), noise(200 << 10, 2)),
    ];
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
    let (blob, index) = indexed_gzip_layer(&named);
    assert!(
        index.span_digests.len() >= 6,
        "the test needs several spans, got {}",
        index.span_digests.len()
    );
    (blob, index, files)
}

/// A backend that counts, and can be told to stall, corrupt or hang.
#[derive(Default)]
pub(crate) struct TestBackend {
    pub blob: Vec<u8>,
    pub calls: AtomicU64,
    pub bytes: AtomicU64,
    /// Flip a byte in the middle of every answer.
    pub corrupt: AtomicBool,
    /// Hold every call until `open` is set.
    pub gated: AtomicBool,
    pub open: Mutex<bool>,
    pub opened: Condvar,
    /// Never answer (until the backend is dropped by the test's end).
    pub hang: AtomicBool,
    pub hang_release: Mutex<bool>,
    pub hang_cv: Condvar,
    /// Answer several ranges in one call (as a registry answering `multipart/byteranges`);
    /// each such call counts once in `calls`.
    pub batches: AtomicBool,
    /// The ranges of each call, in order.
    pub asked: Mutex<Vec<Vec<Range<u64>>>>,
}

impl TestBackend {
    pub fn new(blob: Vec<u8>) -> Arc<TestBackend> {
        Arc::new(TestBackend {
            blob,
            ..Default::default()
        })
    }

    pub fn release(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    pub fn release_hung(&self) {
        *self.hang_release.lock().unwrap() = true;
        self.hang_cv.notify_all();
    }
}

impl RangeSource for TestBackend {
    fn len(&self) -> u64 {
        self.blob.len() as u64
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.asked.lock().unwrap().push(vec![range.clone()]);
        self.answer(range)
    }

    fn read_ranges(&self, ranges: &[Range<u64>]) -> io::Result<Vec<Vec<u8>>> {
        if !self.batches.load(Ordering::SeqCst) {
            return ranges.iter().map(|r| self.read_range(r.clone())).collect();
        }
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.asked.lock().unwrap().push(ranges.to_vec());
        ranges.iter().map(|r| self.answer(r.clone())).collect()
    }

    fn batches_ranges(&self) -> bool {
        self.batches.load(Ordering::SeqCst)
    }
}

impl TestBackend {
    fn answer(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        if self.hang.load(Ordering::SeqCst) {
            let mut released = self.hang_release.lock().unwrap();
            while !*released {
                released = self.hang_cv.wait(released).unwrap();
            }
            return Err(io::Error::other("released"));
        }
        if self.gated.load(Ordering::SeqCst) {
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
        }
        let mut out = MemSource(self.blob.clone()).read_range(range)?;
        if self.corrupt.load(Ordering::SeqCst) {
            let mid = out.len() / 2;
            out[mid] ^= 0x55;
        }
        self.bytes.fetch_add(out.len() as u64, Ordering::SeqCst);
        Ok(out)
    }
}

pub(crate) fn open_store(dir: &std::path::Path) -> Arc<Store> {
    let options = StoreOptions {
        max_bytes: Some(1 << 30),
        flush_interval: None,
        ..StoreOptions::default()
    };
    Arc::new(Store::open_with(dir, options).unwrap())
}

struct Rig {
    backend: Arc<TestBackend>,
    reader: LayerReader,
    stats: Arc<MountStats>,
    files: Files,
}

impl Rig {
    fn new(store: Option<Arc<Store>>, config: FetchConfig) -> Rig {
        let (blob, index, files) = gzip_layer();
        Self::with(TestBackend::new(blob), index, files, store, config)
    }

    fn with(
        backend: Arc<TestBackend>,
        index: LayerIndex,
        files: Files,
        store: Option<Arc<Store>>,
        config: FetchConfig,
    ) -> Rig {
        let stats = Arc::new(MountStats::default());
        let source = LayerSource::indexed(
            backend.clone(),
            &index,
            store,
            Limiter::new(config.concurrency),
            config,
            stats.clone(),
        );
        let reader = LayerReader::new(LayerFormat::Indexed(Arc::new(index)), Arc::new(source));
        Rig {
            backend,
            reader,
            stats,
            files,
        }
    }

    fn entry(&self, path: &str) -> usize {
        self.reader
            .entries()
            .iter()
            .position(|e| e.path == path)
            .unwrap()
    }

    /// [`Rig::read`] retried every 10 ms (at most 1000 times) until it succeeds: for a
    /// read whose failure is remembered for a while.
    fn read_until_ok(&self, path: &str, off: u64, len: usize) -> Vec<u8> {
        let mut tries = 0;
        loop {
            match self.read(path, off, len) {
                Ok(b) => return b,
                Err(_) if tries < 1000 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn read(&self, path: &str, off: u64, len: usize) -> ferry_index::Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        let n = self.reader.read_at(self.entry(path), off, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    fn content(&self, path: &str) -> &[u8] {
        &self.files.iter().find(|(p, _)| p == path).unwrap().1
    }
}

#[test]
fn reads_are_exact_and_the_second_read_comes_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let rig = Rig::new(Some(store.clone()), FetchConfig::default());
    let a = rig.read("a", 0, 300 << 10).unwrap();
    assert_eq!(a, rig.content("a"));
    let c = rig.read("dir/c", 1000, 5000).unwrap();
    assert_eq!(c, rig.content("dir/c")[1000..6000]);
    let fetched = rig.backend.bytes.load(Ordering::SeqCst);
    assert!(fetched > 0);
    assert!(store.stats().entries > 0, "verified spans were stored");

    // Again: nothing more is fetched.
    assert_eq!(rig.read("a", 0, 300 << 10).unwrap(), rig.content("a"));
    assert_eq!(
        rig.read("dir/c", 1000, 5000).unwrap(),
        &rig.content("dir/c")[1000..6000]
    );
    assert_eq!(rig.backend.bytes.load(Ordering::SeqCst), fetched);
    assert!(rig.stats.snapshot().cache_hits > 0);

    // Another mount of the same layer over the same store fetches nothing either.
    let (blob, index, files) = gzip_layer();
    let other = Rig::with(
        TestBackend::new(blob),
        index,
        files,
        Some(store),
        FetchConfig::default(),
    );
    assert_eq!(
        other.read("a", 4096, 100_000).unwrap(),
        &other.content("a")[4096..104_096]
    );
    assert_eq!(other.backend.calls.load(Ordering::SeqCst), 0);
    assert_eq!(other.stats.snapshot().bytes_fetched, 0);
}

#[test]
fn neighbouring_spans_are_one_request_up_to_the_request_size() {
    let rig = Rig::new(None, FetchConfig::default());
    rig.read("a", 0, 300 << 10).unwrap();
    assert_eq!(
        rig.backend.calls.load(Ordering::SeqCst),
        1,
        "one merged request"
    );

    let small = FetchConfig {
        max_request_bytes: 1,
        ..FetchConfig::default()
    };
    let rig = Rig::new(None, small);
    let spans_of_a = rig.reader.ranges_for(rig.entry("a"), 0, 300 << 10);
    assert_eq!(spans_of_a.len(), 1);
    assert_eq!(rig.read("a", 0, 300 << 10).unwrap(), rig.content("a"));
    let calls = rig.backend.calls.load(Ordering::SeqCst);
    assert!(
        calls >= 4,
        "each span alone when requests are capped ({calls})"
    );
}

#[test]
fn concurrent_reads_of_one_span_share_one_fetch() {
    let (blob, index, files) = gzip_layer();
    let backend = TestBackend::new(blob);
    backend.gated.store(true, Ordering::SeqCst);
    let rig = Arc::new(Rig::with(
        backend,
        index,
        files,
        None,
        FetchConfig::default(),
    ));
    const READERS: u64 = 8;
    let handles: Vec<_> = (0..READERS)
        .map(|_| {
            let rig = rig.clone();
            std::thread::spawn(move || rig.read("a", 100, 4000).unwrap())
        })
        .collect();
    // Wait (no time limit: the gate holds the leader) until every other reader waits on
    // the leader's fetch, then let it through.
    while rig.stats.snapshot().shared_waits < READERS - 1 {
        std::thread::yield_now();
    }
    rig.backend.release();
    for h in handles {
        assert_eq!(h.join().unwrap(), &rig.content("a")[100..4100]);
    }
    assert_eq!(rig.backend.calls.load(Ordering::SeqCst), 1);
    assert_eq!(rig.stats.snapshot().cache_misses, 1);
}

#[test]
fn reads_queued_for_a_busy_blob_go_out_together_in_one_request() {
    let (blob, index, files) = gzip_layer();
    let backend = TestBackend::new(blob);
    backend.gated.store(true, Ordering::SeqCst);
    backend.batches.store(true, Ordering::SeqCst);
    let stats = Arc::new(MountStats::default());
    // One request in flight per blob: the reads that come while it is out queue.
    let limiter = Limiter::with_per_blob(8, 1);
    let source = LayerSource::indexed(
        backend.clone(),
        &index,
        None,
        limiter.clone(),
        FetchConfig::default(),
        stats.clone(),
    );
    let reader = LayerReader::new(LayerFormat::Indexed(Arc::new(index)), Arc::new(source));
    let rig = Arc::new(Rig {
        backend,
        reader,
        stats,
        files,
    });
    let read = |path: &'static str, off: u64, len: usize| {
        let rig = rig.clone();
        std::thread::spawn(move || (path, off, rig.read(path, off, len).unwrap()))
    };
    let first = read("a", 0, 1000);
    while rig.backend.asked.lock().unwrap().is_empty() {
        std::thread::yield_now();
    }
    let later = [read("dir/c", 1000, 5000), read("a", 200 << 10, 4000)];
    while limiter.waiting() < 2 {
        std::thread::yield_now();
    }
    rig.backend.release();
    for h in std::iter::once(first).chain(later) {
        let (path, off, got) = h.join().unwrap();
        let off = off as usize;
        assert_eq!(got, &rig.content(path)[off..off + got.len()]);
        assert!(!got.is_empty());
    }
    let asked = rig.backend.asked.lock().unwrap().clone();
    assert_eq!(
        asked.len(),
        2,
        "the first read's request and one for both others: {asked:?}"
    );
    // (The two reads' spans touch here: the joined request asks for them as one range.)
    let s = rig.stats.snapshot();
    assert_eq!((s.requests, s.requests_joined), (2, 1));
}

#[test]
fn corrupt_bytes_fail_the_read_and_are_never_stored() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    // Without readahead: with it, the good neighbours in the same answer are stored.
    let no_readahead = FetchConfig {
        readahead_bytes: 0,
        ..FetchConfig::default()
    };
    let rig = Rig::new(Some(store.clone()), no_readahead);
    rig.backend.corrupt.store(true, Ordering::SeqCst);
    let err = rig.read("a", 0, 1000).unwrap_err();
    assert!(err.to_string().contains("digest mismatch"), "{err}");
    assert_eq!(store.stats().entries, 0);
    let s = rig.stats.snapshot();
    assert_eq!(s.verify_failures, 1);
    assert!(s.fetch_errors >= 1);
    // Rereads (the kernel retries every failed read) do not fetch the span again while
    // it is remembered as failed: persistent corruption cannot multiply the bytes.
    let calls = rig.backend.calls.load(Ordering::SeqCst);
    for _ in 0..20 {
        assert!(rig.read("a", 0, 1000).is_err());
    }
    assert!(rig.backend.calls.load(Ordering::SeqCst) <= calls + 1);
    assert_eq!(store.stats().entries, 0);
    // The registry heals: once the failure memory has passed, the read succeeds and is
    // stored.
    rig.backend.corrupt.store(false, Ordering::SeqCst);
    let got = rig.read_until_ok("a", 0, 1000);
    assert_eq!(got, &rig.content("a")[..1000]);
    assert!(store.stats().entries > 0);
}

#[test]
fn a_piece_that_keeps_failing_is_left_alone_longer_each_time() {
    let t0 = Instant::now();
    let f = |count| Failure { at: t0, count };
    assert_eq!(f(1).memory(), FAILURE_MEMORY);
    assert_eq!(f(2).memory(), FAILURE_MEMORY * 2);
    assert_eq!(f(3).memory(), FAILURE_MEMORY * 4);
    assert_eq!(f(40).memory(), MAX_FAILURE_MEMORY);
    assert_eq!(f(u32::MAX).memory(), MAX_FAILURE_MEMORY);
}

#[test]
fn a_span_that_does_not_verify_is_fetched_again_from_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let (blob, index, files) = gzip_layer();
    let mirror = TestBackend::new(blob.clone());
    mirror.corrupt.store(true, Ordering::SeqCst);
    let origin = TestBackend::new(blob);
    let stats = Arc::new(MountStats::default());
    let config = FetchConfig::default();
    let source = LayerSource::indexed(
        mirror.clone(),
        &index,
        Some(store.clone()),
        Limiter::new(config.concurrency),
        config,
        stats.clone(),
    )
    .with_fallback(origin.clone());
    let reader = LayerReader::new(LayerFormat::Indexed(Arc::new(index)), Arc::new(source));
    let entry = reader.entries().iter().position(|e| e.path == "a").unwrap();
    let mut buf = vec![0u8; 1000];
    let n = reader.read_at(entry, 0, &mut buf).unwrap();
    assert_eq!(&buf[..n], &files[0].1[..1000]);
    let s = stats.snapshot();
    assert!(
        s.verify_failures >= 1,
        "the mirror's bytes were checked and refused"
    );
    assert!(
        origin.calls.load(Ordering::SeqCst) >= 1,
        "the origin was asked"
    );
    assert!(
        store.stats().entries > 0,
        "the origin's verified bytes are stored"
    );
}

#[test]
fn a_span_whose_fetch_just_failed_fails_fast_then_recovers() {
    let config = FetchConfig {
        timeout: Duration::from_millis(100),
        ..FetchConfig::default()
    };
    let rig = Rig::new(None, config);
    rig.backend.hang.store(true, Ordering::SeqCst);
    let err = rig.read("dir/c", 100_000, 10).unwrap_err();
    assert!(err.to_string().contains("timed out"), "{err}");
    let calls = rig.backend.calls.load(Ordering::SeqCst);
    // The kernel's immediate retry of the same read: no second wait, no second request.
    let err = rig.read("dir/c", 100_000, 10).unwrap_err();
    assert!(err.to_string().contains("moments ago"), "{err}");
    assert_eq!(rig.backend.calls.load(Ordering::SeqCst), calls);
    rig.backend.hang.store(false, Ordering::SeqCst);
    rig.backend.release_hung();
    std::thread::sleep(FAILURE_MEMORY);
    assert_eq!(
        rig.read("dir/c", 100_000, 10).unwrap(),
        &rig.content("dir/c")[100_000..100_010]
    );
}

#[test]
fn a_backend_that_never_answers_times_out_and_cached_data_is_still_served() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let config = FetchConfig {
        timeout: Duration::from_millis(100),
        concurrency: 1,
        // (readahead would bring dir/c along with b)
        readahead_bytes: 0,
        ..FetchConfig::default()
    };
    let rig = Rig::new(Some(store), config);
    assert_eq!(rig.read("b", 0, 5).unwrap(), b"hello");
    rig.backend.hang.store(true, Ordering::SeqCst);
    // (Far from `b`, whose span is cached.)
    let err = rig.read("dir/c", 100_000, 10).unwrap_err();
    assert!(err.to_string().contains("timed out"), "{err}");
    // The hung fetch still holds the only slot: the next miss times out waiting for it.
    let err = rig.read("dir/c", 190_000, 10).unwrap_err();
    assert!(err.to_string().contains("timed out"), "{err}");
    assert_eq!(
        rig.read("b", 0, 5).unwrap(),
        b"hello",
        "cached data is served"
    );
    assert_eq!(rig.stats.snapshot().fetch_errors, 2);
    // Service resumes when the backend does.
    rig.backend.hang.store(false, Ordering::SeqCst);
    rig.backend.release_hung();
    // The released fetch frees its slot asynchronously, and the failed span is
    // remembered for FAILURE_MEMORY; retry until both have passed.
    let got = rig.read_until_ok("dir/c", 100_000, 10);
    assert_eq!(got, &rig.content("dir/c")[100_000..100_010]);
}

#[test]
fn passthrough_sources_share_and_bound_fetches() {
    let backend = TestBackend::new(noise(1000, 3));
    let stats = Arc::new(MountStats::default());
    let config = FetchConfig {
        timeout: Duration::from_millis(100),
        ..FetchConfig::default()
    };
    let source = LayerSource::passthrough(backend.clone(), Limiter::new(2), config, stats.clone());
    assert_eq!(source.read_range(10..20).unwrap(), &backend.blob[10..20]);
    assert!(source.read_range(990..1001).is_err());
    backend.hang.store(true, Ordering::SeqCst);
    let err = source.read_range(0..10).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    backend.release_hung();
    let s = stats.snapshot();
    assert_eq!((s.requests, s.bytes_fetched, s.fetch_errors), (2, 10, 1));
}

#[test]
fn fill_work_skips_stored_spans_and_fill_makes_the_layer_local() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let config = FetchConfig {
        max_request_bytes: 128 << 10,
        ..FetchConfig::default()
    };
    let (blob, index, files) = gzip_layer();
    let spans = index.span_digests.len();
    let backend = TestBackend::new(blob);
    let stats = Arc::new(MountStats::default());
    let source = LayerSource::indexed(
        backend.clone(),
        &index,
        Some(store.clone()),
        Limiter::new(2),
        config,
        stats,
    );
    let total = |work: &[FillWork]| -> usize {
        work.iter()
            .map(|w| match w {
                FillWork::Spans(r) => r.len(),
                FillWork::Whole => 0,
            })
            .sum()
    };
    let all = source.fill_work();
    assert_eq!(total(&all), spans);
    for w in &all {
        assert!(
            source.work_bytes(w) <= 128 << 10 || matches!(w, FillWork::Spans(r) if r.len() == 1)
        );
    }
    // Warm the first span: it drops out of the plan.
    let first = index.span_range(0).unwrap();
    assert_eq!(
        source.warm_range(first.clone()).unwrap(),
        first.end - first.start
    );
    let rest = source.fill_work();
    assert_eq!(total(&rest), spans - 1);
    // A refusing gate stops before any request.
    let calls = backend.calls.load(Ordering::SeqCst);
    let err = source.fill(&rest[0], &|_| false).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::Interrupted);
    assert_eq!(backend.calls.load(Ordering::SeqCst), calls);
    assert!(!source.is_local());
    for w in &rest {
        source.fill(w, &|_| true).unwrap();
    }
    assert!(source.is_local());
    assert!(source.fill_work().is_empty());
    let calls = backend.calls.load(Ordering::SeqCst);
    let reader = LayerReader::new(LayerFormat::Indexed(Arc::new(index)), Arc::new(source));
    for (path, data) in &files {
        let idx = reader
            .entries()
            .iter()
            .position(|e| &e.path == path)
            .unwrap();
        let mut buf = vec![0u8; data.len()];
        reader.read_at(idx, 0, &mut buf).unwrap();
        assert_eq!(&buf, data);
    }
    assert_eq!(backend.calls.load(Ordering::SeqCst), calls);
}

// ---------------------------------------------------------------------------------------
// Version-2 indexes: windows in a windows blob.

/// A single-member gzip layer (so checkpoints sit at block boundaries and carry
/// windows) of files `a` (300 KiB of text-like bytes) and `b` (200 KiB), its index with
/// 64 KiB spans split into a version-2 index, and the windows blob.
fn windowed_layer() -> (Vec<u8>, LayerIndex, Vec<u8>, Files) {
    windowed_layer_of(300 << 10, 200 << 10)
}

/// [`windowed_layer`] with files `a` and `b` of `a_len` and `b_len` bytes.
fn windowed_layer_of(a_len: usize, b_len: usize) -> (Vec<u8>, LayerIndex, Vec<u8>, Files) {
    let text = |len: usize, seed: u64| -> Vec<u8> {
        noise(len, seed)
            .iter()
            .map(|b| b"abcdefgh \n"[(*b % 10) as usize])
            .collect()
    };
    let files = vec![
        ("a".to_string(), text(a_len, 3)),
        ("b".to_string(), text(b_len, 4)),
    ];
    let mut tar = tar::Builder::new(Vec::new());
    for (path, data) in &files {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        tar.append_data(&mut h, path, &data[..]).unwrap();
    }
    let tar = tar.into_inner().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&tar).unwrap();
    let blob = gz.finish().unwrap();
    let mut index = ferry_index::indexer::index_gzip(&blob[..], 64 << 10, None).unwrap();
    let windows = index.split_windows();
    let index = LayerIndex::decode(&index.encode().unwrap()).unwrap();
    assert!(
        index
            .checkpoints
            .iter()
            .filter(|c| c.window.is_some())
            .count()
            >= 4,
        "the test needs several windows"
    );
    (blob, index, windows, files)
}

/// A reader over a version-2 layer whose spans come from `spans` and windows from
/// `windows` (and, when given, `fallback` for windows that do not verify).
struct WindowRig {
    spans: Arc<TestBackend>,
    windows: Arc<TestBackend>,
    source: Arc<LayerSource>,
    reader: LayerReader,
    stats: Arc<MountStats>,
    files: Files,
    index: Arc<LayerIndex>,
}

impl WindowRig {
    fn new(store: Option<Arc<Store>>, fallback: Option<Arc<TestBackend>>) -> WindowRig {
        // These tests count windows exactly: readahead would bring its spans' windows too
        // (readahead_brings_the_windows_of_the_spans_it_fetches covers that).
        let config = FetchConfig {
            readahead_bytes: 0,
            ..FetchConfig::default()
        };
        Self::with_config(store, fallback, config)
    }

    fn with_config(
        store: Option<Arc<Store>>,
        fallback: Option<Arc<TestBackend>>,
        config: FetchConfig,
    ) -> WindowRig {
        Self::with_cache(store, fallback, config, None)
    }

    /// With `inflated`, the reader keeps spans and windows in it, as a mount's does.
    fn with_cache(
        store: Option<Arc<Store>>,
        fallback: Option<Arc<TestBackend>>,
        config: FetchConfig,
        inflated: Option<Arc<InflatedSpans>>,
    ) -> WindowRig {
        Self::of_layer(windowed_layer(), store, fallback, config, inflated)
    }

    /// A rig over a 6 MiB layer with many blocks of windows, a chunk store (in the
    /// returned directory) and no readahead, so window requests can be counted.
    fn stored_many_blocks() -> (tempfile::TempDir, WindowRig) {
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(dir.path());
        let config = FetchConfig {
            readahead_bytes: 0,
            ..FetchConfig::default()
        };
        let rig = Self::of_layer(
            windowed_layer_of(6 << 20, 200 << 10),
            Some(store),
            None,
            config,
            None,
        );
        (dir, rig)
    }

    /// A rig over `layer` (as [`windowed_layer_of`] makes them).
    fn of_layer(
        layer: (Vec<u8>, LayerIndex, Vec<u8>, Files),
        store: Option<Arc<Store>>,
        fallback: Option<Arc<TestBackend>>,
        config: FetchConfig,
        inflated: Option<Arc<InflatedSpans>>,
    ) -> WindowRig {
        let (blob, index, windows, files) = layer;
        let spans = TestBackend::new(blob);
        let windows = TestBackend::new(windows);
        let stats = Arc::new(MountStats::default());
        let source = Arc::new(
            LayerSource::indexed(
                spans.clone(),
                &index,
                store,
                Limiter::new(config.concurrency),
                config,
                stats.clone(),
            )
            .with_windows(windows.clone(), fallback.map(|f| f as Arc<dyn RangeSource>)),
        );
        let index = Arc::new(index);
        let mut reader = LayerReader::new(LayerFormat::Indexed(index.clone()), source.clone())
            .with_windows(source.clone());
        if let Some(cache) = inflated {
            reader = reader.with_inflated_cache(cache);
        }
        WindowRig {
            spans,
            windows,
            source,
            reader,
            stats,
            files,
            index,
        }
    }

    fn read(&self, path: &str, off: u64, len: usize) -> ferry_index::Result<Vec<u8>> {
        let idx = self
            .reader
            .entries()
            .iter()
            .position(|e| e.path == path)
            .unwrap();
        let mut buf = vec![0u8; len];
        let n = self.reader.read_at(idx, off, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    fn content(&self, path: &str) -> &[u8] {
        &self.files.iter().find(|(p, _)| p == path).unwrap().1
    }

    /// Puts every window but checkpoint `k`'s into `store`, so that a read needing `k`'s
    /// fetches it alone (its block has no other window missing).
    fn store_windows_but(&self, store: &Store, k: usize) {
        for (j, c) in self.index.checkpoints.iter().enumerate() {
            if let Some(w) = c.window.as_ref().filter(|_| j != k) {
                let r = w.range();
                store
                    .put(
                        &ChunkKey::from_raw(w.sha256),
                        &self.windows.blob[r.start as usize..r.end as usize],
                    )
                    .unwrap();
            }
        }
    }
}

#[test]
fn windows_are_fetched_verified_stored_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let rig = WindowRig::new(Some(store.clone()), None);
    assert!(rig.source.has_window_blob());
    let got = rig.read("a", 150_000, 4096).unwrap();
    assert_eq!(got, &rig.content("a")[150_000..154_096]);
    let span_bytes = rig.spans.bytes.load(Ordering::SeqCst);
    let window_bytes = rig.windows.bytes.load(Ordering::SeqCst);
    // One window: this layer has too few for blocks of them.
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1, "one window");
    let k = rig.index.span_for(512 + 150_000).unwrap();
    assert_eq!(
        window_bytes,
        u64::from(rig.index.window_ref(k).unwrap().len)
    );
    assert_eq!(
        rig.stats.snapshot().bytes_fetched,
        span_bytes + window_bytes,
        "window bytes count as fetched"
    );
    assert!(store.contains(&ChunkKey::from_raw(rig.index.window_ref(k).unwrap().sha256)));
    // Again: both from the store.
    assert_eq!(
        rig.read("a", 150_000, 4096).unwrap(),
        &rig.content("a")[150_000..154_096]
    );
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), 1);
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1);
    // Whole files read back exactly, across many checkpoints.
    assert_eq!(rig.read("b", 0, 200 << 10).unwrap(), rig.content("b"));
}

#[test]
fn a_window_fetch_brings_its_blocks_missing_windows_in_the_same_request() {
    let (_dir, rig) = WindowRig::stored_many_blocks();
    let windows = rig
        .index
        .checkpoints
        .iter()
        .filter(|c| c.window.is_some())
        .count();
    assert!(
        windows >= 4 * WINDOW_BLOCK,
        "the test needs blocks: {windows}"
    );
    assert_eq!(
        rig.read("a", 150_000, 4096).unwrap(),
        &rig.content("a")[150_000..154_096]
    );
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1);
    let near = rig.index.span_for(512 + 150_000).unwrap();
    assert!(
        rig.windows.bytes.load(Ordering::SeqCst)
            > u64::from(rig.index.window_ref(near).unwrap().len),
        "more than the read's own window"
    );
    // A read a few checkpoints on, in the same block, whose span is not local, finds
    // its window local: no second window request.
    let piece = |k: usize| {
        rig.index.checkpoints[..k]
            .iter()
            .filter(|c| c.window.is_some())
            .count()
    };
    let off = (150_000..2_000_000u64)
        .step_by(4096)
        .find(|&off| {
            rig.index.span_for(512 + off).is_some_and(|k| {
                k > near + 1
                    && piece(k) / WINDOW_BLOCK == piece(near) / WINDOW_BLOCK
                    && rig.index.window_ref(k).is_some()
            })
        })
        .expect("a checkpoint with a window further in the block");
    assert_eq!(
        rig.read("a", off, 4096).unwrap(),
        &rig.content("a")[off as usize..off as usize + 4096]
    );
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1);
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), 2);
}

#[test]
fn warm_windows_brings_a_stretchs_missing_windows_in_one_request_and_span_fetches_none() {
    let (_dir, rig) = WindowRig::stored_many_blocks();
    let len = rig.source.backend.len();
    let stretch = len / 8..len / 2;
    let fetched = rig.source.warm_windows(stretch.clone()).unwrap();
    assert_eq!(
        rig.windows.calls.load(Ordering::SeqCst),
        1,
        "one request for the stretch's windows"
    );
    assert_eq!(fetched, rig.windows.bytes.load(Ordering::SeqCst));
    assert!(
        fetched > u64::from(WINDOW_BLOCK as u32) * 1024,
        "more than a block of windows: {fetched}"
    );
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), 0, "no span fetched");
    // Again: nothing missing, nothing asked.
    assert_eq!(rig.source.warm_windows(stretch.clone()).unwrap(), 0);
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1);
    // Warming the stretch's spans then asks for no window, and reads inflate.
    rig.source.warm_range(stretch.clone()).unwrap();
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1);
    assert!(rig.spans.calls.load(Ordering::SeqCst) >= 1);
    let off = 2_000_000u64;
    assert_eq!(
        rig.read("a", off, 4096).unwrap(),
        &rig.content("a")[off as usize..off as usize + 4096]
    );
    // A layer without a store keeps nothing: warm_windows does nothing.
    let storeless = WindowRig::new(None, None);
    assert_eq!(storeless.source.warm_windows(0..1 << 20).unwrap(), 0);
    assert_eq!(storeless.windows.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn ranges_apart_are_fetched_in_one_request_where_the_backend_batches() {
    for batches in [true, false] {
        let (_dir, rig) = WindowRig::stored_many_blocks();
        rig.spans.batches.store(batches, Ordering::SeqCst);
        let spans = rig.source.spans.as_ref().unwrap();
        assert!(spans.ranges.len() >= 16, "{} spans", spans.ranges.len());
        let r = |k: usize| spans.ranges[k].clone();
        // Three stretches apart, out of order, one of them twice.
        // (A span's inner bytes: neighbouring spans share a boundary byte.)
        let inner = |k: usize| r(k).start + 2..r(k).end - 2;
        let asked = [inner(9), inner(1).start..inner(2).end, inner(5), inner(9)];
        let fetched = rig.source.warm_spans_many(&asked).unwrap();
        // The spans covering them (neighbouring spans share a boundary byte), each once,
        // in runs of neighbours: nothing between the runs is fetched.
        let mut ks: Vec<usize> = asked.iter().flat_map(|a| spans.covering(a)).collect();
        ks.sort_unstable();
        ks.dedup();
        let mut runs: Vec<Range<u64>> = Vec::new();
        for (i, &k) in ks.iter().enumerate() {
            if i > 0 && ks[i - 1] + 1 == k {
                runs.last_mut().unwrap().end = spans.ranges[k].end;
            } else {
                runs.push(spans.ranges[k].clone());
            }
        }
        assert_eq!(runs.len(), 3, "three runs: {ks:?}");
        let want: u64 = runs.iter().map(span_len).sum();
        assert_eq!(fetched, want, "each covering span once");
        let calls = rig.spans.asked.lock().unwrap().clone();
        if batches {
            assert_eq!(calls, vec![runs.clone()], "one request");
            assert_eq!(rig.stats.requests.load(Ordering::Relaxed), 1);
        } else {
            assert_eq!(
                calls,
                runs.iter().map(|r| vec![r.clone()]).collect::<Vec<_>>()
            );
            assert_eq!(rig.stats.requests.load(Ordering::Relaxed), 3);
        }
        // All local now: reads inflate them without asking again.
        assert_eq!(rig.source.warm_spans_many(&asked).unwrap(), 0);
        assert_eq!(rig.spans.asked.lock().unwrap().len(), calls.len());
        // Spans with local ones between them: one request for both runs.
        assert!(rig.source.warm_spans(inner(14)).unwrap() > 0);
        rig.spans.asked.lock().unwrap().clear();
        rig.source
            .warm_spans(inner(13).start..inner(15).end)
            .unwrap();
        let calls = rig.spans.asked.lock().unwrap().clone();
        if batches {
            assert_eq!(calls, vec![vec![r(13), r(15)]]);
        } else {
            assert_eq!(calls, vec![vec![r(13)], vec![r(15)]]);
        }
    }
}

#[test]
fn a_window_is_fetched_once_for_concurrent_reads_and_alongside_the_span() {
    let rig = Arc::new(WindowRig::new(None, None));
    // Hold the span fetch: the window must still be asked for meanwhile.
    rig.spans.gated.store(true, Ordering::SeqCst);
    rig.windows.gated.store(true, Ordering::SeqCst);
    const READERS: usize = 6;
    let handles: Vec<_> = (0..READERS)
        .map(|_| {
            let rig = rig.clone();
            std::thread::spawn(move || rig.read("a", 200_000, 3000).unwrap())
        })
        .collect();
    // No time limit: both gates hold their leaders until released.
    while rig.spans.calls.load(Ordering::SeqCst) == 0
        || rig.windows.calls.load(Ordering::SeqCst) == 0
    {
        std::thread::yield_now();
    }
    // Both requests are in flight at once (neither waited for the other).
    while rig.stats.snapshot().shared_waits < 2 * (READERS as u64 - 1) {
        std::thread::yield_now();
    }
    rig.windows.release();
    rig.spans.release();
    for h in handles {
        assert_eq!(h.join().unwrap(), &rig.content("a")[200_000..203_000]);
    }
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), 1);
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 1);
}

#[test]
fn a_corrupt_window_fails_the_read_or_is_fetched_again_from_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let rig = WindowRig::new(Some(store.clone()), None);
    let k = rig.index.span_for(512 + 250_000).unwrap();
    rig.store_windows_but(&store, k);
    rig.windows.corrupt.store(true, Ordering::SeqCst);
    let err = rig.read("a", 250_000, 1000).unwrap_err();
    assert!(err.to_string().contains("window"), "{err}");
    assert_eq!(rig.stats.snapshot().verify_failures, 1);
    assert!(
        rig.index.window_ref(k).is_some(),
        "the read must need a window"
    );
    assert!(!store.contains(&ChunkKey::from_raw(rig.index.window_ref(k).unwrap().sha256)));

    // With an origin to fall back on, the read succeeds with the right bytes.
    let (_, _, windows, _) = windowed_layer();
    let origin = TestBackend::new(windows);
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let rig = WindowRig::new(Some(store.clone()), Some(origin.clone()));
    rig.store_windows_but(&store, k);
    rig.windows.corrupt.store(true, Ordering::SeqCst);
    assert_eq!(
        rig.read("a", 250_000, 1000).unwrap(),
        &rig.content("a")[250_000..251_000]
    );
    assert_eq!(origin.calls.load(Ordering::SeqCst), 1);
    assert_eq!(rig.stats.snapshot().verify_failures, 1);
}

#[test]
fn warm_range_and_fill_make_windows_local_in_merged_requests() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let rig = WindowRig::new(Some(store.clone()), None);
    let len = rig.spans.blob.len() as u64;
    let fetched = rig.source.warm_range(0..len / 2).unwrap();
    assert!(fetched > 0);
    assert_eq!(
        rig.windows.calls.load(Ordering::SeqCst),
        1,
        "windows merged into one request"
    );
    assert_eq!(
        fetched,
        rig.spans.bytes.load(Ordering::SeqCst) + rig.windows.bytes.load(Ordering::SeqCst)
    );
    assert!(!rig.source.is_local());
    // Fill plans the rest (spans and windows) and makes the layer local.
    let work = rig.source.fill_work();
    assert!(!work.is_empty());
    for w in &work {
        rig.source.fill(w, &|_| true).unwrap();
    }
    assert!(rig.source.is_local());
    assert!(rig.source.fill_work().is_empty());
    for cp in rig.index.checkpoints.iter().filter_map(|c| c.window) {
        assert!(store.contains(&ChunkKey::from_raw(cp.sha256)));
    }
    // Reads now touch no backend.
    let (s, w) = (
        rig.spans.calls.load(Ordering::SeqCst),
        rig.windows.calls.load(Ordering::SeqCst),
    );
    assert_eq!(rig.read("b", 0, 200 << 10).unwrap(), rig.content("b"));
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), s);
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), w);
}

#[test]
fn fill_fetches_windows_missing_behind_stored_spans() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    // Another layer's mount without a windows backend stored every span only.
    let (blob, index, windows, _) = windowed_layer();
    for k in 0..index.span_digests.len() {
        let r = index.span_range(k).unwrap();
        store
            .put(
                &ChunkKey::from_raw(index.span_digests[k]),
                &blob[r.start as usize..r.end as usize],
            )
            .unwrap();
    }
    let rig = WindowRig::new(Some(store.clone()), None);
    assert!(!rig.source.is_local());
    let work = rig.source.fill_work();
    assert!(!work.is_empty(), "windows are still missing");
    let mut fetched = 0;
    for w in &work {
        fetched += rig.source.fill(w, &|_| true).unwrap();
    }
    assert_eq!(fetched, windows.len() as u64);
    assert!(rig.source.is_local());
}

#[test]
fn a_layer_without_a_reachable_windows_blob_fails_reads_cleanly() {
    let (blob, index, _, _) = windowed_layer();
    let stats = Arc::new(MountStats::default());
    let source = Arc::new(LayerSource::indexed(
        TestBackend::new(blob),
        &index,
        None,
        Limiter::new(1),
        FetchConfig::default(),
        stats,
    ));
    let k = index.span_for(512 + 250_000).unwrap();
    assert!(index.window_ref(k).is_some(), "the read must need a window");
    let reader = LayerReader::new(LayerFormat::Indexed(Arc::new(index)), source.clone())
        .with_windows(source);
    let mut buf = vec![0u8; 100];
    let err = reader.read_at(0, 250_000, &mut buf).unwrap_err();
    assert!(err.to_string().contains("windows blob"), "{err}");
}

#[test]
fn a_read_inside_spans_stored_by_an_earlier_pass_needs_no_window_fetch() {
    // A pass fetches only its first checkpoint's window but stores every span it read.
    // A later read starting in one of those spans must be served locally (inflating from
    // the pass's start), not by fetching that span's window: with the registry away it
    // would fail although every byte is cached.
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let rig = WindowRig::new(Some(store), None);
    assert_eq!(rig.read("a", 0, 300 << 10).unwrap(), rig.content("a"));
    let (span_calls, window_calls) = (
        rig.spans.calls.load(Ordering::SeqCst),
        rig.windows.calls.load(Ordering::SeqCst),
    );
    assert_eq!(window_calls, 0, "the first checkpoint needs no window");
    // Any fetch from now on would fail.
    rig.spans.corrupt.store(true, Ordering::SeqCst);
    rig.windows.corrupt.store(true, Ordering::SeqCst);
    let cps: Vec<(u64, bool)> = rig
        .index
        .checkpoints
        .iter()
        .map(|c| (c.out_offset, c.window.is_some()))
        .collect();
    for off in [130_000u64, 200_000, 280_000] {
        let k = rig.index.span_for(512 + off).unwrap();
        assert!(
            rig.index.window_ref(k).is_some(),
            "offset {off} must lie in a windowed span: span {k} of {cps:?}"
        );
        assert_eq!(
            rig.read("a", off, 4096).unwrap(),
            &rig.content("a")[off as usize..off as usize + 4096]
        );
    }
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), span_calls);
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), window_calls);
}

#[test]
fn a_passthrough_layer_fetches_a_range_once_for_repeated_reads_within_its_bound() {
    // eStargz: the format reader asks for a whole chunk on every read inside it; a file
    // read in many small reads must not fetch that chunk each time.
    let backend = TestBackend::new(noise(4 << 20, 9));
    let stats = Arc::new(MountStats::default());
    let source = passthrough(backend.clone(), stats.clone());
    for _ in 0..5 {
        assert_eq!(
            source.read_range(1000..901_000).unwrap(),
            &backend.blob[1000..901_000]
        );
    }
    assert_eq!(backend.calls.load(Ordering::SeqCst), 1);
    assert_eq!(stats.snapshot().cache_hits, 4);
    // Past the bound, ranges are fetched per read again (memory stays bounded).
    let big = TestBackend::new(noise((MAX_HELD_READ_BYTES + (2 << 20)) as usize, 10));
    let source = passthrough(big.clone(), Arc::new(MountStats::default()));
    let whole = 0..MAX_HELD_READ_BYTES;
    source.read_range(whole.clone()).unwrap();
    let tail = MAX_HELD_READ_BYTES..MAX_HELD_READ_BYTES + (1 << 20);
    source.read_range(tail.clone()).unwrap();
    source.read_range(tail).unwrap();
    assert_eq!(big.calls.load(Ordering::SeqCst), 3, "the tail is not held");
    source.read_range(whole).unwrap();
    assert_eq!(
        big.calls.load(Ordering::SeqCst),
        3,
        "the first range is held"
    );
}

#[test]
fn a_passthrough_layer_fetches_only_what_earlier_reads_do_not_hold() {
    // Consecutive reads of a file share their boundary chunk: the second read's range
    // starts inside the first's. Only the bytes not held are fetched, and the answer is
    // the blob's bytes whatever mix of held and fetched made it.
    let backend = TestBackend::new(noise(1 << 20, 31));
    let stats = Arc::new(MountStats::default());
    let source = passthrough(backend.clone(), stats.clone());
    let blob = |r: Range<u64>| backend.blob[r.start as usize..r.end as usize].to_vec();
    for r in [
        10_000..60_000,
        50_000..120_000,
        200_000..260_000,
        100_000..220_000,
    ] {
        assert_eq!(source.read_range(r.clone()).unwrap(), blob(r));
    }
    // Inside one, across two, the tail of one, and a little past either end.
    for r in [
        20_000..30_000,
        55_000..110_000,
        240_000..260_000,
        9_000..100_000,
        250_000..261_000,
    ] {
        assert_eq!(source.read_range(r.clone()).unwrap(), blob(r));
    }
    assert_eq!(
        *backend.asked.lock().unwrap(),
        vec![
            vec![10_000..60_000],
            vec![60_000..120_000],
            vec![200_000..260_000],
            vec![120_000..200_000],
            vec![9_000..10_000],
            vec![260_000..261_000],
        ],
        "only the bytes no earlier read holds are asked for"
    );
    assert!(stats.snapshot().cache_hits >= 5);
}

/// A layer of 48 files of 64 KiB (about one 64 KiB span each), its reader over a
/// shared source (so it reads ahead in the background too) with `readahead` bytes and a
/// store, the backend and the stats.
fn readahead_rig(
    readahead: u64,
    store: Arc<Store>,
) -> (
    LayerReader,
    Arc<TestBackend>,
    Arc<MountStats>,
    Files,
    Arc<LayerSource>,
) {
    let files: Files = (0..48)
        .map(|i| (format!("pkg/m{i:02}.py"), noise(64 << 10, 100 + i)))
        .collect();
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
    let (blob, index) = indexed_gzip_layer(&named);
    let backend = TestBackend::new(blob);
    let stats = Arc::new(MountStats::default());
    let config = FetchConfig {
        readahead_bytes: readahead,
        ..FetchConfig::default()
    };
    let source = LayerSource::indexed(
        backend.clone(),
        &index,
        Some(store),
        Limiter::new(config.concurrency),
        config,
        stats.clone(),
    )
    .into_shared();
    let reader = LayerReader::new(LayerFormat::Indexed(Arc::new(index)), source.clone());
    (reader, backend, stats, files, source)
}

/// Reads every file whole, in stream order, checking its bytes. After each file it waits
/// for `source`'s background readahead to land: a reader slower than the link, so what
/// the counts say does not depend on how the test threads were scheduled (a read that
/// overtakes a readahead in flight joins it and counts as a wait).
fn read_all_in_order(reader: &LayerReader, files: &Files, source: &LayerSource) {
    for (path, data) in files {
        let idx = reader
            .entries()
            .iter()
            .position(|e| &e.path == path)
            .unwrap();
        let mut buf = vec![0u8; data.len()];
        assert_eq!(reader.read_at(idx, 0, &mut buf).unwrap(), data.len());
        assert_eq!(&buf, data, "{path}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while source.reading_ahead() {
            assert!(Instant::now() < deadline, "readahead never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[test]
fn readahead_takes_round_trips_off_a_reader_moving_along_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let (reader, backend, stats, files, source) = readahead_rig(0, open_store(dir.path()));
    read_all_in_order(&reader, &files, &source);
    let without = stats.snapshot();
    assert_eq!(without.bytes_readahead, 0);
    assert!(without.read_waits >= 40, "{without:?}");

    let dir = tempfile::tempdir().unwrap();
    let (reader, ra_backend, stats, files, source) = readahead_rig(1 << 20, open_store(dir.path()));
    read_all_in_order(&reader, &files, &source);
    let with = stats.snapshot();
    assert!(
        with.read_waits * 3 <= without.read_waits,
        "readahead leaves a few waits, not one per span: {with:?}"
    );
    assert!(with.bytes_readahead > 0);
    assert!(with.requests < without.requests, "fewer, larger requests");
    // Every byte fetched once: readahead and reads share flights and the store.
    let blob_len = ra_backend.blob.len() as u64;
    assert!(ra_backend.bytes.load(Ordering::SeqCst) <= blob_len);
    assert!(backend.bytes.load(Ordering::SeqCst) <= blob_len);
}

#[test]
fn a_lone_read_far_from_the_last_fetches_only_a_small_window_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let readahead = 1 << 20;
    let (reader, backend, stats, files, _source) = readahead_rig(readahead, open_store(dir.path()));
    let (path, data) = &files[30];
    let idx = reader
        .entries()
        .iter()
        .position(|e| &e.path == path)
        .unwrap();
    let mut buf = vec![0u8; 100];
    reader.read_at(idx, 0, &mut buf).unwrap();
    assert_eq!(&buf[..], &data[..100]);
    let fetched = backend.bytes.load(Ordering::SeqCst);
    // Its span (about 64 KiB, plus its neighbour when the read straddles two) and a
    // first window of readahead/8.
    assert!(
        fetched <= 2 * (66 << 10) + readahead / READAHEAD_START_DIVISOR + (66 << 10),
        "{fetched}"
    );
    assert_eq!(stats.snapshot().read_waits, 1);
}

#[test]
fn the_link_meter_counts_bytes_per_second_of_busy_time() {
    let meter = LinkMeter::default();
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    assert_eq!(meter.bytes_per_sec(), None);
    // Two overlapping fetches in 0..100 ms, 1 MB each, then idle, then one in 1000..1100.
    meter.begin(ms(0));
    meter.begin(ms(20));
    meter.end(ms(80), 1_000_000);
    meter.end(ms(100), 1_000_000);
    meter.begin(ms(1000));
    meter.end(ms(1100), 1_000_000);
    // 3 MB over 200 ms of busy time (the idle second does not count).
    assert_eq!(meter.bytes_per_sec(), Some(15_000_000));
}

#[test]
fn readahead_fetches_spans_only_and_reads_moving_on_keep_the_windows() {
    let dir = tempfile::tempdir().unwrap();
    let cache = InflatedSpans::new(16 << 20);
    let rig = WindowRig::with_cache(
        Some(open_store(dir.path())),
        None,
        FetchConfig::default(),
        Some(cache.clone()),
    );
    assert_eq!(rig.read("a", 0, 1000).unwrap(), &rig.content("a")[..1000]);
    assert_eq!(
        rig.spans.calls.load(Ordering::SeqCst),
        1,
        "the read and its readahead"
    );
    assert_eq!(
        rig.windows.calls.load(Ordering::SeqCst),
        0,
        "the first checkpoint needs none"
    );
    assert!(rig.stats.snapshot().bytes_readahead > 0);
    // A reader moving on through the spans readahead brought, across checkpoints: no
    // request at all, each read that starts a span doing so from the window the read
    // before it kept.
    for (path, data) in &rig.files {
        for off in (0..data.len()).step_by(16 << 10) {
            let len = (16 << 10).min(data.len() - off);
            assert_eq!(
                rig.read(path, off as u64, len).unwrap(),
                &data[off..off + len]
            );
        }
    }
    assert_eq!(rig.spans.calls.load(Ordering::SeqCst), 1);
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 0);
    let kept = cache.stats();
    assert!(kept.windows_kept >= 4, "{kept:?}");
    assert!(kept.window_hits > 0, "{kept:?}");
}

#[test]
fn a_reader_moving_on_across_checkpoints_fetches_no_window() {
    let config = FetchConfig {
        readahead_bytes: 0,
        ..FetchConfig::default()
    };
    // Too small to keep a span (a quarter of the bound at most), room for windows.
    let cache = InflatedSpans::new(200 << 10);
    // No store: without the windows it kept, every read below would fetch its own.
    let rig = WindowRig::with_cache(None, None, config, Some(cache.clone()));
    let bare = WindowRig::with_config(None, None, config);
    let a = rig.content("a").len();
    let windowed = rig
        .index
        .checkpoints
        .iter()
        .filter(|c| c.window.is_some() && c.out_offset < 512 + a as u64)
        .count();
    assert!(windowed >= 2, "{windowed}");
    // `a` in reads of 16 KiB, one after the other, as a process reads a file.
    for r in [&rig, &bare] {
        for off in (0..a).step_by(16 << 10) {
            let len = (16 << 10).min(a - off);
            assert_eq!(
                r.read("a", off as u64, len).unwrap(),
                &r.content("a")[off..off + len]
            );
        }
    }
    // Each read that crosses a checkpoint keeps its window for the reads after it: from
    // the layer's start (which needs none), no window is ever fetched.
    assert_eq!(rig.windows.calls.load(Ordering::SeqCst), 0);
    assert!(cache.stats().window_hits > 0);
    // Without the cache, a read starting in a span fetches that span's window.
    assert!(bare.windows.calls.load(Ordering::SeqCst) >= windowed as u64);
}
