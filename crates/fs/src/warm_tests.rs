//! Tests of prefetch and background fill over in-memory backends that log every
//! requested range: order (trace first, as recorded), completeness (after fill nothing
//! reaches the backend), stopping on drop, single-layer mounts touching only their
//! layer, and the hot set pins (exactly the traced spans, never fill; released with the
//! handle; kept across a store restart for a mount that comes back; bounded).
#![allow(clippy::unwrap_used)]

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ferry_index::ferryidx::LayerIndex;
use ferry_index::source::{MemSource, RangeSource};
use ferry_oci::layout::descriptor;
use ferry_oci::media::{ANNOTATION_ESTARGZ_TOC, LAYER_TAR_GZIP};

use super::*;
use crate::backend::{ImageSource, LayerSpec};
use crate::device::FetchConfig;
use crate::device::tests::{
    gzip_layer, indexed_gzip_layer, noise, open_store, tar_builder_of, tar_of,
};
use crate::image::View;
use crate::trace::TraceRead;

/// A backend that logs every range asked of it and can hold calls until opened.
#[derive(Default)]
struct LogBackend {
    blob: Vec<u8>,
    log: Mutex<Vec<Range<u64>>>,
    gated: Mutex<bool>,
    cv: Condvar,
}

impl LogBackend {
    fn new(blob: Vec<u8>) -> Arc<LogBackend> {
        Arc::new(LogBackend {
            blob,
            ..Default::default()
        })
    }

    fn gated(blob: Vec<u8>) -> Arc<LogBackend> {
        let b = LogBackend::new(blob);
        *b.gated.lock().unwrap() = true;
        b
    }

    fn open(&self) {
        *self.gated.lock().unwrap() = false;
        self.cv.notify_all();
    }

    fn log(&self) -> Vec<Range<u64>> {
        self.log.lock().unwrap().clone()
    }

    fn calls(&self) -> usize {
        self.log.lock().unwrap().len()
    }
}

impl RangeSource for LogBackend {
    fn len(&self) -> u64 {
        self.blob.len() as u64
    }

    fn read_range(&self, range: Range<u64>) -> std::io::Result<Vec<u8>> {
        self.log.lock().unwrap().push(range.clone());
        let mut gated = self.gated.lock().unwrap();
        while *gated {
            gated = self.cv.wait(gated).unwrap();
        }
        drop(gated);
        MemSource(self.blob.clone()).read_range(range)
    }
}

fn spec(blob: &[u8], index: Option<LayerIndex>, backend: Arc<LogBackend>) -> LayerSpec {
    let d = descriptor(
        LAYER_TAR_GZIP,
        ferry_oci::sha256_digest(blob),
        blob.len() as u64,
        &[],
    );
    LayerSpec::new(d, index.map(Arc::new), backend)
}

fn mount(
    layers: Vec<LayerSpec>,
    store: Option<Arc<ferry_store::Store>>,
    view: &View,
    config: FetchConfig,
) -> Arc<MountedImage> {
    let source = ImageSource {
        manifest_digest: "sha256:test".into(),
        layers,
    };
    Arc::new(MountedImage::new(source, store, config, view).unwrap())
}

fn read_file(image: &MountedImage, path: &str) -> Vec<u8> {
    let ino = image.tree.resolve(path).unwrap();
    let loc = image.tree.get(ino).unwrap().data.unwrap();
    let layer = &image.image.layers()[loc.layer];
    let size = layer.entries()[loc.entry].size as usize;
    let mut buf = vec![0u8; size];
    let n = layer.read_at(loc.entry, 0, &mut buf).unwrap();
    buf.truncate(n);
    buf
}

/// [`gzip_layer`] mounted merged, without a chunk store.
fn storeless_gzip_image() -> Arc<MountedImage> {
    let (blob, index, _) = gzip_layer();
    let backend = LogBackend::new(blob.clone());
    mount(
        vec![spec(&blob, Some(index), backend)],
        None,
        &View::Merged,
        FetchConfig::default(),
    )
}

/// Where the data of the file at `path` lives.
fn data_of(image: &MountedImage, path: &str) -> ferry_index::merged::Location {
    let node = image.tree.get(image.tree.resolve(path).unwrap()).unwrap();
    node.data.unwrap()
}

fn tr(path: &str, offset: u64, len: u64) -> TraceRead {
    TraceRead {
        path: path.into(),
        offset,
        len,
    }
}

fn prefetch_only(concurrency: usize) -> WarmConfig {
    WarmConfig {
        prefetch: true,
        background_fill: false,
        concurrency,
        ..WarmConfig::default()
    }
}

/// The shipped warm-up, but fill starts right after prefetch (these tests do not read
/// the mount through FUSE, which fill waits for by default).
fn fill_at_once() -> WarmConfig {
    WarmConfig {
        fill_after_quiet_secs: 0,
        ..WarmConfig::default()
    }
}

#[test]
fn trace_reads_are_prefetched_first_and_in_order() {
    // `dir/c` lies after `a` in the blob, further than prefetch merges ranges across
    // (random bytes in between compress to themselves).
    let files = vec![
        ("a", noise(300 << 10, 1)),
        ("between", noise(COALESCE_GAP as usize + (256 << 10), 3)),
        ("dir/c", noise(200 << 10, 2)),
    ];
    let (blob, index) = indexed_gzip_layer(&files);
    let backend = LogBackend::new(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let image = mount(
        vec![spec(&blob, Some(index), backend.clone())],
        Some(open_store(dir.path())),
        &View::Merged,
        FetchConfig::default(),
    );
    // dir/c lies after a in the blob: recorded order, not blob order, must win.
    let trace = Trace {
        reads: vec![
            tr("/dir/c", 0, 100_000),
            tr("/a", 0, 70_000),
            tr("/missing", 0, 10),
        ],
    };
    let layer = &image.image.layers()[0];
    let entry = |p: &str| layer.entries().iter().position(|e| e.path == p).unwrap();
    let mut want = layer.ranges_for(entry("dir/c"), 0, 100_000);
    want.extend(layer.ranges_for(entry("a"), 0, 70_000));
    assert!(want[0].start > want[want.len() - 1].start);
    start(&image, &prefetch_only(1), Some(trace)).wait();
    assert_eq!(
        backend.log(),
        want,
        "trace ranges fetched in recorded order"
    );
    let snap = image.stats.snapshot();
    assert!(snap.prefetch_done);
    assert!(!snap.fill_done);
    let fetched: u64 = want.iter().map(|r| r.end - r.start).sum();
    assert_eq!(snap.bytes_prefetched, fetched);
    // The prefetched bytes are served without the backend.
    let calls = backend.calls();
    let mut buf = vec![0u8; 100_000];
    layer.read_at(entry("dir/c"), 0, &mut buf).unwrap();
    assert_eq!(&buf[..], &files[2].1[..100_000]);
    assert_eq!(backend.calls(), calls);
}

#[test]
fn background_fill_makes_every_span_local() {
    let (blob, index, files) = gzip_layer();
    let backend = LogBackend::new(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let config = FetchConfig {
        max_request_bytes: 100 << 10, // several fill requests
        ..FetchConfig::default()
    };
    let image = mount(
        vec![spec(&blob, Some(index.clone()), backend.clone())],
        Some(open_store(dir.path())),
        &View::Merged,
        config,
    );
    let trace = Trace {
        reads: vec![tr("/b", 0, 5)],
    };
    let warm = WarmConfig {
        concurrency: 2,
        ..fill_at_once()
    };
    start(&image, &warm, Some(trace)).wait();
    let snap = image.stats.snapshot();
    assert!(snap.prefetch_done && snap.fill_done, "{snap:?}");
    assert!(image.layer_source(0).unwrap().is_local());
    let covered = index.span_range(0).unwrap().start
        ..index.span_range(index.span_digests.len() - 1).unwrap().end;
    assert_eq!(
        snap.bytes_prefetched + snap.bytes_filled,
        covered.end - covered.start,
        "every span fetched exactly once"
    );
    assert!(backend.calls() > 2);
    let calls = backend.calls();
    for (path, data) in &files {
        assert_eq!(&read_file(&image, path), data);
    }
    assert_eq!(
        backend.calls(),
        calls,
        "reads after fill never reach the backend"
    );
    // A second fill finds nothing to do.
    start(&image, &warm, None).wait();
    assert_eq!(backend.calls(), calls);
}

#[test]
fn fill_stops_when_the_handle_is_dropped() {
    let (blob, index, _) = gzip_layer();
    let backend = LogBackend::gated(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let config = FetchConfig {
        max_request_bytes: 1, // one span per request: many requests
        ..FetchConfig::default()
    };
    let image = mount(
        vec![spec(&blob, Some(index.clone()), backend.clone())],
        Some(open_store(dir.path())),
        &View::Merged,
        config,
    );
    let warm = WarmConfig {
        concurrency: 1,
        ..fill_at_once()
    };
    let handle = start(&image, &warm, None);
    while backend.calls() == 0 {
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(handle);
    backend.open();
    // The warm-up thread holds the image until it has ended.
    while Arc::strong_count(&image) > 1 {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(backend.calls(), 1, "no request started after the drop");
    assert!(index.span_digests.len() > 2);
    let snap = image.stats.snapshot();
    assert!(snap.prefetch_done);
    assert!(!snap.fill_done);
}

#[test]
fn single_layer_mount_warms_only_its_layer() {
    let (blob0, index0) = indexed_gzip_layer(&[("lower/x", noise(150 << 10, 7))]);
    let (blob1, index1) = indexed_gzip_layer(&[("upper/y", noise(150 << 10, 8))]);
    let b0 = LogBackend::new(blob0.clone());
    let b1 = LogBackend::new(blob1.clone());
    let dir = tempfile::tempdir().unwrap();
    let upper = ferry_oci::sha256_digest(&blob1).to_string();
    let image = mount(
        vec![
            spec(&blob0, Some(index0), b0.clone()),
            spec(&blob1, Some(index1), b1.clone()),
        ],
        Some(open_store(dir.path())),
        &View::Layer(upper),
        FetchConfig::default(),
    );
    assert_eq!(image.view_layer, Some(1));
    let trace = Trace {
        reads: vec![tr("/lower/x", 0, 1000), tr("/upper/y", 0, 1000)],
    };
    start(&image, &prefetch_only(2), Some(trace.clone())).wait();
    assert_eq!(b0.calls(), 0, "the other layer's files are not prefetched");
    assert_eq!(b1.calls(), 1);
    let all = WarmConfig {
        concurrency: 2,
        ..fill_at_once()
    };
    start(&image, &all, Some(trace)).wait();
    assert_eq!(b0.calls(), 0, "nor filled");
    assert!(image.layer_source(1).unwrap().is_local());
    assert!(!image.layer_source(0).unwrap().is_local());
    assert!(image.stats.snapshot().fill_done);
}

/// An eStargz layer whose prioritized file is `hot` (before the prefetch landmark),
/// followed by a large `cold` file.
fn estargz_layer() -> (Vec<u8>, String, Vec<u8>, Vec<u8>) {
    let hot = noise(120 << 10, 11);
    let cold = noise(600 << 10, 12);
    let tar = tar_of(&[("cold", &cold), ("hot", &hot)]);
    let opts = ferry_index::estargz::EstargzOptions {
        chunk_size: 64 << 10,
        priority: vec!["hot".into()],
        ..Default::default()
    };
    let mut blob = Vec::new();
    let out = ferry_index::estargz::convert(
        &mut || Ok(Box::new(std::io::Cursor::new(tar.clone()))),
        &mut blob,
        &opts,
    )
    .unwrap();
    (blob, out.toc_digest, hot, cold)
}

#[test]
fn estargz_landmark_files_are_prefetched_and_the_blob_filled() {
    let (blob, toc, hot, cold) = estargz_layer();
    let backend = LogBackend::new(blob.clone());
    let d = descriptor(
        LAYER_TAR_GZIP,
        ferry_oci::sha256_digest(&blob),
        blob.len() as u64,
        &[(ANNOTATION_ESTARGZ_TOC, toc)],
    );
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let image = mount(
        vec![LayerSpec::new(d, None, backend.clone())],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    let opened = backend.calls(); // footer and TOC
    start(&image, &prefetch_only(2), None).wait();
    assert_eq!(
        backend.calls(),
        opened + 1,
        "one request for the prioritized files"
    );
    let snap = image.stats.snapshot();
    assert!(snap.prefetch_done);
    assert!(snap.bytes_prefetched > 0);
    assert_eq!(read_file(&image, "hot"), hot);
    assert_eq!(
        backend.calls(),
        opened + 1,
        "the hot file is served from the prefetch"
    );
    // Fill: the whole blob goes into the store; nothing reaches the backend afterwards.
    start(&image, &fill_at_once(), None).wait();
    assert!(image.stats.snapshot().fill_done);
    let calls = backend.calls();
    assert_eq!(read_file(&image, "cold"), cold);
    assert_eq!(backend.calls(), calls);
    let key = ferry_store::ChunkKey::parse(ferry_oci::sha256_digest(&blob).as_ref()).unwrap();
    assert!(store.contains(&key));
}

/// A TOC gives every entry a tar offset of 0: two files of one size in an eStargz layer
/// must still have keys of their own, or the file cache and the small-file pack would
/// serve one's bytes for the other. A hard link shares its target's key.
#[test]
fn files_of_one_size_in_an_estargz_layer_have_their_own_cache_keys() {
    let (one, two) = (noise(5000, 21), noise(5000, 22));
    let mut tar = tar_builder_of(&[("one", &one), ("two", &two)]);
    let mut h = tar::Header::new_ustar();
    h.set_size(0);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Link);
    h.set_cksum();
    tar.append_link(&mut h, "also-two", "two").unwrap();
    let tar = tar.into_inner().unwrap();
    let mut blob = Vec::new();
    let out = ferry_index::estargz::convert(
        &mut || Ok(Box::new(std::io::Cursor::new(tar.clone()))),
        &mut blob,
        &ferry_index::estargz::EstargzOptions::default(),
    )
    .unwrap();
    let d = descriptor(
        LAYER_TAR_GZIP,
        ferry_oci::sha256_digest(&blob),
        blob.len() as u64,
        &[(ANNOTATION_ESTARGZ_TOC, out.toc_digest)],
    );
    let image = mount(
        vec![LayerSpec::new(d, None, LogBackend::new(blob))],
        None,
        &View::Merged,
        FetchConfig::default(),
    );
    let key = |path: &str| crate::localfiles::file_key(&image, data_of(&image, path), 5000);
    let (k1, k2) = (key("one").unwrap(), key("two").unwrap());
    assert_ne!(k1, k2, "files of one size share a key");
    assert_eq!(read_file(&image, "one"), one);
    assert_eq!(read_file(&image, "two"), two);
    assert_eq!(
        key("also-two"),
        Some(k2),
        "a hard link reads its target's bytes"
    );
}

#[test]
fn fill_without_a_store_does_nothing() {
    // No store: nothing can be kept, so fill does nothing and is not "done".
    let (blob, index, _) = gzip_layer();
    let backend = LogBackend::new(blob.clone());
    let image = mount(
        vec![spec(&blob, Some(index), backend.clone())],
        None,
        &View::Merged,
        FetchConfig::default(),
    );
    start(&image, &fill_at_once(), None).wait();
    assert_eq!(backend.calls(), 0);
    let snap = image.stats.snapshot();
    assert!(snap.prefetch_done);
    assert!(!snap.fill_done);
}

#[test]
fn note_read_records_only_while_recording() {
    let image = storeless_gzip_image();
    let a = image.tree.resolve("/a").unwrap();
    let c = image.tree.resolve("/dir/c").unwrap();
    image.note_read(a, 0, 4096);
    image.start_recording();
    image.note_read(c, 0, 4096);
    image.note_read(c, 4096, 4096);
    image.note_read(a, 0, 4096);
    let trace = image.take_trace();
    assert_eq!(trace.reads, vec![tr("/dir/c", 0, 8192), tr("/a", 0, 4096)]);
    image.note_read(a, 8192, 10);
    assert!(image.take_trace().reads.is_empty());
}

#[test]
fn throttle_paces_by_reservation_and_a_stop_ends_its_wait() {
    let control = Arc::new(Control::default());
    let unlimited = Throttle::new(0, 0);
    assert!(unlimited.take(u64::MAX, &control));
    let slow = Arc::new(Throttle::new(1, 0)); // one byte per second
    let before = *slow.next.lock();
    assert!(slow.take(0, &control));
    // 10 bytes reserve 10 s: the next taker would wait that long, unless stopped.
    let waiter = {
        let (slow, control) = (slow.clone(), control.clone());
        std::thread::spawn(move || {
            let first = slow.take(10, &control);
            let second = slow.take(1, &control);
            (first, second)
        })
    };
    while *slow.next.lock() < before + Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    control.stop();
    let (_, second) = waiter.join().unwrap();
    assert!(!second, "a stopped throttle refuses");
    assert!(!slow.take(1, &control));
}

/// The store keys (and total bytes) of the spans holding `[offset, offset + len)` of
/// `path` in layer 0 of `image`.
fn span_keys(
    image: &MountedImage,
    path: &str,
    offset: u64,
    len: u64,
) -> (Vec<ferry_store::ChunkKey>, u64) {
    let layer = &image.image.layers()[0];
    let p = path.trim_start_matches('/');
    let entry = layer.entries().iter().position(|e| e.path == p).unwrap();
    let source = image.layer_source(0).unwrap();
    let mut keys = Vec::new();
    let mut bytes = 0;
    for r in layer.ranges_for(entry, offset, len) {
        for (k, n) in source.hot_keys(r) {
            if !keys.contains(&k) {
                keys.push(k);
                bytes += n;
            }
        }
    }
    keys.sort();
    (keys, bytes)
}

fn pins_in(store: &Arc<ferry_store::Store>, owner: &str) -> Option<PinTarget> {
    Some(PinTarget {
        store: store.clone(),
        owner: owner.into(),
    })
}

#[test]
fn traced_spans_stay_pinned_while_the_mount_lives_and_fill_is_not_pinned() {
    let (blob, index, files) = gzip_layer();
    let backend = LogBackend::new(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let image = mount(
        vec![spec(&blob, Some(index.clone()), backend.clone())],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    let trace = Trace {
        reads: vec![tr("/dir/c", 0, 70_000), tr("/b", 0, 5)],
    };
    let mut hot = span_keys(&image, "/dir/c", 0, 70_000).0;
    hot.extend(span_keys(&image, "/b", 0, 5).0);
    hot.sort();
    hot.dedup();
    let hot_bytes: u64 = hot.iter().map(|k| store_size(&blob, &index, k)).sum();
    assert!(!hot.is_empty() && hot.len() < index.span_digests.len() / 2);
    let all = WarmConfig {
        concurrency: 2,
        ..fill_at_once()
    };
    let mut handle = start_with_pins(&image, &all, Some(trace), pins_in(&store, "mount:/m"));
    handle.wait();
    assert_eq!(handle.pin_owner(), Some("mount:/m"));
    assert!(
        image.stats.snapshot().fill_done,
        "every span is in the store"
    );
    assert_eq!(store.stats().entries, index.span_digests.len() as u64);
    assert_eq!(
        store.pinned_keys("mount:/m"),
        hot,
        "exactly the traced spans"
    );
    assert_eq!(image.stats.snapshot().hot_bytes, hot_bytes);
    let owner = &store.owners()[0];
    assert_eq!((owner.keys, owner.bytes), (hot.len() as u64, hot_bytes));

    // Evicting everything evictable leaves the hot set: fill-only spans go.
    let gc = store.gc_to(0).unwrap();
    assert_eq!(
        gc.evicted_entries,
        (index.span_digests.len() - hot.len()) as u64
    );
    assert_eq!(gc.pinned_bytes, hot_bytes);
    assert!(hot.iter().all(|k| store.contains(k)));
    let calls = backend.calls();
    let ino = image.tree.resolve("/dir/c").unwrap();
    let loc = image.tree.get(ino).unwrap().data.unwrap();
    let mut buf = vec![0u8; 70_000];
    image.image.layers()[loc.layer]
        .read_at(loc.entry, 0, &mut buf)
        .unwrap();
    assert_eq!(&buf[..], &files[2].1[..70_000]);
    assert_eq!(backend.calls(), calls, "the traced range is still local");

    // The mount goes away: its pins go with it and the hot set becomes evictable.
    drop(handle);
    assert!(store.owners().is_empty());
    assert_eq!(store.gc_to(0).unwrap().evicted_entries, hot.len() as u64);
    assert_eq!(store.stats().entries, 0);
}

/// The stored size of the span whose digest is `key`.
fn store_size(
    blob: &[u8],
    index: &ferry_index::ferryidx::LayerIndex,
    key: &ferry_store::ChunkKey,
) -> u64 {
    let k = index
        .span_digests
        .iter()
        .position(|d| ferry_store::ChunkKey::from_raw(*d) == *key)
        .unwrap();
    let r = index.span_range(k).unwrap();
    assert!(r.end <= blob.len() as u64);
    r.end - r.start
}

#[test]
fn stopping_releases_the_pins_and_nothing_is_pinned_after_a_release_or_keep() {
    let (blob, index, _) = gzip_layer();
    // Gated: the worker pins, then blocks in its first prefetch request.
    let backend = LogBackend::gated(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let image = mount(
        vec![spec(&blob, Some(index), backend.clone())],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    let trace = Trace {
        reads: vec![tr("/a", 0, 300 << 10)],
    };
    let handle = start_with_pins(&image, &prefetch_only(1), Some(trace), pins_in(&store, "m"));
    while backend.calls() == 0 {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!store.pinned_keys("m").is_empty(), "pinned before fetching");
    let opener = {
        let backend = backend.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            backend.open();
        })
    };
    handle.stop();
    opener.join().unwrap();
    assert!(store.owners().is_empty(), "stop releases the pins");
    // A worker that reaches pinning after the release (or after the pins were kept)
    // pins nothing; a release after keeping leaves the kept pins alone.
    let key = span_keys(&image, "/a", 0, 10).0[0];
    let pins = |owner: &str| Pins {
        target: pins_in(&store, owner).unwrap(),
        closed: parking_lot::Mutex::new(false),
    };
    let released = pins("released");
    released.release();
    assert!(!released.pin(&[key]));
    assert!(store.owners().is_empty());
    let kept = pins("kept");
    assert!(kept.pin(&[key]));
    kept.keep();
    assert!(!kept.pin(&[key]));
    kept.release();
    assert_eq!(store.pinned_keys("kept"), vec![key]);
}

#[test]
fn a_restarted_store_keeps_the_pins_of_a_mount_that_comes_back() {
    use ferry_store::{ManualClock, Store, StoreOptions};
    let (blob, index, _) = gzip_layer();
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let open = || {
        Arc::new(
            Store::open_with(
                dir.path(),
                StoreOptions {
                    max_bytes: Some(1 << 30),
                    pin_grace: Duration::from_secs(60),
                    flush_interval: None,
                    clock: clock.clone(),
                    seed: None,
                },
            )
            .unwrap(),
        )
    };
    let layer = || spec(&blob, Some(index.clone()), LogBackend::new(blob.clone()));
    let back = mount_pin_owner(std::path::Path::new("/run/ferry/layers/comes-back"));
    let gone = mount_pin_owner(std::path::Path::new("/run/ferry/layers/gone"));
    let (hot_a, hot_c);
    {
        let store = open();
        let image = mount(
            vec![layer()],
            Some(store.clone()),
            &View::Merged,
            FetchConfig::default(),
        );
        hot_a = span_keys(&image, "/a", 0, 1000).0;
        hot_c = span_keys(&image, "/dir/c", 0, 1000).0;
        let mut first = start_with_pins(
            &image,
            &prefetch_only(1),
            Some(Trace {
                reads: vec![tr("/a", 0, 1000)],
            }),
            pins_in(&store, &back),
        );
        let mut second = start_with_pins(
            &image,
            &prefetch_only(1),
            Some(Trace {
                reads: vec![tr("/dir/c", 0, 1000)],
            }),
            pins_in(&store, &gone),
        );
        first.wait();
        second.wait();
        // The daemon ends with its lazy layers left mounted for the next one.
        first.keep_pins();
        second.keep_pins();
        assert_eq!(store.owners().len(), 2);
    }
    // Every clone of the store is gone: the next open sees the persisted pins.
    let store = open();
    assert_eq!(store.open_report().restored_pins, 2);
    let image = mount(
        vec![layer()],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    // The restored mount comes back without its trace (registry unreachable now): it
    // still re-registers, keeping what it pinned.
    let again = PinTarget::for_mount(
        store.clone(),
        std::path::Path::new("/run/ferry/layers/comes-back"),
    );
    assert_eq!(again.owner, back);
    let mut handle = start_with_pins(&image, &prefetch_only(1), None, Some(again));
    handle.wait();
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.expire_restored_pins().unwrap(), vec![gone.clone()]);
    assert_eq!(store.pinned_keys(&back), hot_a);
    store.gc_to(0).unwrap();
    assert!(
        hot_a.iter().all(|k| store.contains(k)),
        "re-registered pins hold"
    );
    assert!(
        hot_c
            .iter()
            .all(|k| !store.contains(k) || hot_a.contains(k)),
        "the mount that did not come back lost its pins"
    );
    drop(handle);
    assert!(store.owners().is_empty());
}

#[test]
fn a_hot_set_larger_than_its_share_of_the_store_pins_its_first_part() {
    let (blob, index, _) = gzip_layer();
    let dir = tempfile::tempdir().unwrap();
    // Room for about four spans; a mount may pin half of it.
    let span = store_size(
        &blob,
        &index,
        &ferry_store::ChunkKey::from_raw(index.span_digests[0]),
    );
    let store = Arc::new(
        ferry_store::Store::open_with(
            dir.path(),
            ferry_store::StoreOptions {
                max_bytes: Some(span * 4 + span / 2),
                flush_interval: None,
                ..ferry_store::StoreOptions::default()
            },
        )
        .unwrap(),
    );
    let image = mount(
        vec![spec(&blob, Some(index), LogBackend::new(blob.clone()))],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    let source = image.layer_source(0).unwrap();
    let trace = Trace {
        reads: vec![tr("/a", 0, 300 << 10)],
    };
    let jobs = prefetch_jobs(&image, Some(&trace));
    let in_order: Vec<(ferry_store::ChunkKey, u64)> = jobs
        .iter()
        .flat_map(|(_, r)| source.hot_keys(r.clone()))
        .collect();
    assert!(in_order.len() > 4);
    let mut handle = start_with_pins(&image, &prefetch_only(1), Some(trace), pins_in(&store, "m"));
    handle.wait();
    let pinned_bytes = image.stats.snapshot().hot_bytes;
    assert!(pinned_bytes > 0 && pinned_bytes <= store.max_bytes() / HOT_SET_STORE_DIVISOR);
    let mut want: Vec<ferry_store::ChunkKey> = Vec::new();
    let mut sum = 0;
    for (k, n) in in_order {
        if sum + n > store.max_bytes() / HOT_SET_STORE_DIVISOR {
            break;
        }
        sum += n;
        want.push(k);
    }
    want.sort();
    assert_eq!(
        store.pinned_keys("m"),
        want,
        "the first spans the trace reads"
    );
    assert_eq!(sum, pinned_bytes);
    drop(handle);
    assert!(store.owners().is_empty());
}

#[test]
fn mount_pin_owners_are_stable_and_always_valid() {
    use std::path::Path;
    let short = mount_pin_owner(Path::new("/var/lib/ferry/snapshots/12/fs"));
    assert_eq!(short, "mount:/var/lib/ferry/snapshots/12/fs");
    let long_path = format!("/{}", "d".repeat(ferry_store::MAX_OWNER_LEN));
    let long = mount_pin_owner(Path::new(&long_path));
    assert_eq!(long, mount_pin_owner(Path::new(&long_path)));
    assert!(long.starts_with("mount:sha256:") && ferry_store::valid_owner(&long));
    assert_ne!(long, mount_pin_owner(Path::new(&format!("{long_path}x"))));
    use std::os::unix::ffi::OsStrExt;
    let not_utf8 = Path::new(std::ffi::OsStr::from_bytes(b"/mnt/\xff"));
    assert!(mount_pin_owner(not_utf8).starts_with("mount:sha256:"));
}

/// `hot_keys(range)` names exactly the entries `warm_range(range)` puts in an empty
/// store, with their sizes: what is pinned is what prefetch made local.
fn assert_hot_keys_are_what_warm_range_stores(
    source: &LayerSource,
    store: &ferry_store::Store,
    range: Range<u64>,
) {
    assert_eq!(store.stats().entries, 0, "start from an empty store");
    source.warm_range(range.clone()).unwrap();
    let mut stored: Vec<(ferry_store::ChunkKey, u64)> =
        store.list().into_iter().map(|e| (e.key, e.size)).collect();
    stored.sort();
    let mut hot = source.hot_keys(range.clone());
    hot.sort();
    assert!(!hot.is_empty(), "{range:?}");
    assert_eq!(hot, stored, "{range:?}");
    store.gc_to(0).unwrap();
}

#[test]
fn hot_keys_are_what_warm_range_makes_local() {
    let (blob, index, _) = gzip_layer();
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let image = mount(
        vec![spec(
            &blob,
            Some(index.clone()),
            LogBackend::new(blob.clone()),
        )],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    let source = image.layer_source(0).unwrap();
    let span = |k: usize| index.span_range(k).unwrap();
    let n = index.span_digests.len();
    for range in [
        span(0),
        span(1).start + 1..span(1).start + 2,
        span(1).end - 1..span(3).start + 1,
        span(n - 1),
        0..blob.len() as u64,
    ] {
        assert_hot_keys_are_what_warm_range_stores(source, &store, range);
    }
    assert!(source.hot_keys(5..5).is_empty());
    assert!(source.hot_keys(0..blob.len() as u64 + 1).is_empty());
    // Without a store nothing is kept, so nothing is hot.
    let bare = mount(
        vec![spec(
            &blob,
            Some(index.clone()),
            LogBackend::new(blob.clone()),
        )],
        None,
        &View::Merged,
        FetchConfig::default(),
    );
    assert!(bare.layer_source(0).unwrap().hot_keys(span(0)).is_empty());
}

/// The test gzip layer mounted over a store, with a file cache of files of 100 KiB and
/// more (and the small-file pack) beside it.
struct WithFileCache {
    image: Arc<MountedImage>,
    backend: Arc<LogBackend>,
    cache: Arc<FileCache>,
    files: Vec<(String, Vec<u8>)>,
    /// Owns every path.
    dir: tempfile::TempDir,
}

fn gzip_image_with_file_cache() -> WithFileCache {
    let (blob, index, files) = gzip_layer();
    let backend = LogBackend::new(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(&dir.path().join("store"));
    let image = mount(
        vec![spec(&blob, Some(index), backend.clone())],
        Some(store.clone()),
        &View::Merged,
        FetchConfig::default(),
    );
    let config = crate::filecache::FileCacheConfig {
        dir: Some(dir.path().join("files")),
        min_file_bytes: 100 << 10,
        eager_min_bytes: 0,
        ..Default::default()
    };
    let cache = Arc::new(FileCache::open(&config, Some(store)).unwrap());
    WithFileCache {
        image,
        backend,
        cache,
        files,
        dir,
    }
}

/// Prefetch writes a file to the file cache only when the trace's ranges hold all of
/// its data (here `a`, read in two halves), right after the last of them, and fetches
/// nothing more than without a file cache; a file read in part (`dir/c`) or too small
/// for the cache (`b`) stays out.
#[test]
fn prefetch_caches_files_whose_data_the_trace_fetches_entirely() {
    let WithFileCache {
        image,
        backend,
        cache,
        files,
        dir: _dir,
    } = gzip_image_with_file_cache();
    let trace = Trace {
        reads: vec![
            tr("/dir/c", 0, 70_000),
            tr("/a", 0, 150 << 10),
            tr("/b", 0, 5),
            tr("/a", 150 << 10, 150 << 10),
        ],
    };
    let layer = &image.image.layers()[0];
    let loc = |p: &str| data_of(&image, p);
    let (a, c) = (loc("/a"), loc("/dir/c"));
    let jobs = prefetch_jobs(&image, Some(&trace));
    let steps = prefetch_steps(&image, Some(&trace), &jobs, Some(100 << 10), false);
    let fetches: Vec<Step> = jobs
        .iter()
        .map(|(l, r)| Step::Fetch(*l, r.clone()))
        .collect();
    // The materialize step follows the last fetch holding a piece of `a`.
    let a_ranges = layer.ranges_for(a.entry, 0, 300 << 10);
    let last = jobs
        .iter()
        .rposition(|(_, r)| a_ranges.iter().any(|w| w.start < r.end && r.start < w.end))
        .unwrap();
    let mut want = fetches.clone();
    want.insert(last + 1, Step::Materialize(a, 300 << 10));
    assert_eq!(steps, want);
    // Without a file cache: the fetch steps alone.
    assert_eq!(
        prefetch_steps(&image, Some(&trace), &jobs, None, false),
        fetches
    );

    start_with_files(
        &image,
        &prefetch_only(2),
        Some(trace),
        None,
        Some(cache.clone()),
    )
    .wait();
    let key = |l: ferry_index::merged::Location, size: u64| {
        crate::localfiles::file_key(&image, l, size).unwrap()
    };
    let cached = cache
        .get(&key(a, 300 << 10), 300 << 10)
        .expect("a is cached");
    let mut buf = vec![0u8; 300 << 10];
    assert_eq!(cached.read_at(&mut buf, 0).unwrap(), buf.len());
    assert_eq!(buf, files[0].1);
    assert!(!cache.contains(&key(c, 200 << 10)), "c was read in part");
    assert_eq!(cache.snapshot().files, 1);
    // Caching `a` fetched nothing the trace did not.
    let fetched: u64 = backend.log().iter().map(|r| r.end - r.start).sum();
    assert_eq!(fetched, image.stats.snapshot().bytes_prefetched);
    let traced: u64 = merge_ranges(jobs.iter().map(|(_, r)| r.clone()).collect())
        .iter()
        .map(|r| r.end - r.start)
        .sum();
    assert_eq!(fetched, traced);
}

/// Small files the trace reads whole go into the small-file pack right after the fetch
/// that holds them, and nothing is fetched for them beyond the trace's ranges.
#[test]
fn prefetch_packs_small_files_the_trace_reads_whole() {
    let WithFileCache {
        image,
        backend,
        cache,
        files,
        dir: _dir,
    } = gzip_image_with_file_cache();
    let trace = Trace {
        reads: vec![tr("/b", 0, 5), tr("/dir/c", 0, 70_000)],
    };
    let b = data_of(&image, "/b");
    let jobs = prefetch_jobs(&image, Some(&trace));
    let steps = prefetch_steps(&image, Some(&trace), &jobs, Some(100 << 10), true);
    let layer = &image.image.layers()[0];
    let b_ranges = layer.ranges_for(b.entry, 0, 5);
    let last = jobs
        .iter()
        .rposition(|(_, r)| b_ranges.iter().any(|w| w.start < r.end && r.start < w.end))
        .unwrap();
    let mut want: Vec<Step> = jobs
        .iter()
        .map(|(l, r)| Step::Fetch(*l, r.clone()))
        .collect();
    want.insert(last + 1, Step::Pack(b, 5));
    assert_eq!(
        steps, want,
        "c is large and read in part: neither packed nor cached"
    );
    // Without the pack: no pack step.
    assert!(
        !prefetch_steps(&image, Some(&trace), &jobs, Some(100 << 10), false)
            .iter()
            .any(|s| matches!(s, Step::Pack(..)))
    );

    start_with_files(
        &image,
        &prefetch_only(2),
        Some(trace),
        None,
        Some(cache.clone()),
    )
    .wait();
    let pack = cache.pack().unwrap();
    let key = crate::localfiles::file_key(&image, b, 5).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(pack.read_at(&key, 0, &mut buf), Some(5));
    assert_eq!(&buf[..5], &files[1].1[..]);
    assert_eq!(pack.occupancy().0, 1);
    let fetched: u64 = backend.log().iter().map(|r| r.end - r.start).sum();
    assert_eq!(fetched, image.stats.snapshot().bytes_prefetched);
}

/// A file the trace reads most of is cached too, its missing pieces fetched just before.
#[test]
fn prefetch_fetches_the_small_rest_of_a_file_read_nearly_whole() {
    let image = storeless_gzip_image();
    let loc = |p: &str| data_of(&image, p);
    let layer = &image.image.layers()[0];
    let a = loc("/a");
    let a_all = layer.ranges_for(a.entry, 0, 300 << 10);
    let rest = |trace: &Trace| {
        let jobs = prefetch_jobs(&image, Some(trace));
        let have = merge_ranges(jobs.iter().map(|(_, r)| r.clone()).collect());
        let steps = prefetch_steps(&image, Some(trace), &jobs, Some(100 << 10), false);
        (jobs, subtract_ranges(&a_all, &have), steps)
    };
    // `a` (300 KiB over five 64 KiB spans) read but for its last span: cached, the
    // rest fetched just before.
    let (jobs, missing, steps) = rest(&Trace {
        reads: vec![tr("/a", 0, 200 << 10)],
    });
    assert!(!missing.is_empty());
    let mut want: Vec<Step> = jobs
        .iter()
        .map(|(l, r)| Step::Fetch(*l, r.clone()))
        .collect();
    want.extend(missing.iter().map(|m| Step::Fetch(0, m.clone())));
    want.push(Step::Materialize(a, 300 << 10));
    assert_eq!(steps, want);
    // Read only in its first half: left out, nothing more fetched.
    let (jobs, missing, steps) = rest(&Trace {
        reads: vec![tr("/a", 0, 120 << 10)],
    });
    let total = |rs: &[Range<u64>]| rs.iter().map(|r| r.end - r.start).sum::<u64>();
    assert!(total(&missing) * MISSING_DIVISOR > total(&a_all));
    assert_eq!(steps.len(), jobs.len());
    assert!(steps.iter().all(|s| matches!(s, Step::Fetch(..))));
}

#[test]
fn fill_waits_for_a_first_read_and_for_quiet_and_pauses_after_a_wait() {
    let t0 = Instant::now();
    let s = |n: u64| t0 + Duration::from_secs(n);
    let quiet = Quiet::new(Duration::from_secs(3), 0, t0);
    // Nothing read yet: the mount is not in use; wait and ask again.
    assert_eq!(quiet.remaining(0, 0, s(100)), Some(Duration::from_secs(3)));
    // Read, with reads waiting for the network until second 10.
    assert_eq!(
        quiet.remaining(5, 1000, s(10)),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        quiet.remaining(5, 2000, s(11)),
        Some(Duration::from_secs(2))
    );
    // Reads that hit locally (served grows, waits do not) keep it quiet.
    assert_eq!(quiet.remaining(5, 9000, s(13)), None);
    // Another start misses: pause a whole quiet period from the moment it is seen.
    assert_eq!(
        quiet.remaining(6, 9500, s(20)),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        quiet.remaining(6, 9500, s(22)),
        Some(Duration::from_secs(1))
    );
    assert_eq!(quiet.remaining(6, 9500, s(23)), None);
    // 0: at once, read or not.
    let now = Quiet::new(Duration::ZERO, 0, t0);
    assert_eq!(now.remaining(0, 0, t0), None);
    assert_eq!(now.remaining(7, 0, t0), None);
}

#[test]
fn fill_rate_is_the_lower_of_the_cap_and_the_link_share() {
    let mb = 1 << 20;
    assert_eq!(fill_rate(0, 0, Some(100 * mb)), 0, "both off: unlimited");
    assert_eq!(fill_rate(0, 50, Some(100 * mb)), (100 * mb / 100) * 50);
    assert_eq!(fill_rate(0, 50, Some(200 * mb)), (200 * mb / 100) * 50);
    assert_eq!(
        fill_rate(10 * mb, 50, Some(200 * mb)),
        10 * mb,
        "the cap is lower"
    );
    assert_eq!(fill_rate(10 * mb, 0, Some(200 * mb)), 10 * mb);
    assert_eq!(
        fill_rate(0, 50, None),
        FILL_UNMEASURED_BYTES_PER_SEC,
        "not measured yet: a modest pace"
    );
    assert_eq!(fill_rate(0, 250, Some(100)), 100, "at most the whole link");
    assert_eq!(
        fill_rate(0, 50, Some(10)),
        1,
        "a tiny link: slow, never 0 (unlimited)"
    );
}

#[test]
fn with_the_shipped_defaults_fill_waits_for_the_mount_to_be_used() {
    let (blob, index, _) = gzip_layer();
    let backend = LogBackend::new(blob.clone());
    let dir = tempfile::tempdir().unwrap();
    let image = mount(
        vec![spec(&blob, Some(index), backend.clone())],
        Some(open_store(dir.path())),
        &View::Merged,
        FetchConfig::default(),
    );
    let trace = Trace {
        reads: vec![tr("/b", 0, 5)],
    };
    let handle = start(&image, &WarmConfig::default(), Some(trace));
    while !image.stats.snapshot().prefetch_done {
        std::thread::sleep(Duration::from_millis(2));
    }
    let prefetched = backend.calls();
    assert!(prefetched > 0);
    // Nothing reads the mount: fill never starts, however long it waits.
    handle.stop();
    assert_eq!(backend.calls(), prefetched);
    let snap = image.stats.snapshot();
    assert_eq!(snap.bytes_filled, 0);
    assert!(!snap.fill_done);
}

/// A trace of another version of the image maps onto this one by path: reads past a
/// file's end here (it shrank) are clamped to it, paths gone are skipped.
#[test]
fn a_trace_of_another_version_is_clamped_to_the_files_of_this_one() {
    let image = storeless_gzip_image();
    let layer = &image.image.layers()[0];
    let a = data_of(&image, "/a");
    let size = image
        .tree
        .get(image.tree.resolve("/a").unwrap())
        .unwrap()
        .size;
    let other_version = Trace {
        reads: vec![
            tr("/a", 0, size * 4),
            tr("/a", size + 4096, 1 << 20),
            tr("/gone/in/this/version", 0, 4096),
        ],
    };
    let jobs = prefetch_jobs(&image, Some(&other_version));
    let want: Vec<(usize, Range<u64>)> = layer
        .ranges_for(a.entry, 0, size)
        .into_iter()
        .map(|r| (a.layer, r))
        .collect();
    assert!(!want.is_empty());
    assert_eq!(jobs, want);
}

#[test]
fn prefetch_merges_close_ranges_of_a_group_and_keeps_trace_order() {
    let g = COALESCE_GAP;
    let jobs = vec![
        (0, 5 * g..6 * g),
        (1, 0..g / 10),
        (0, 0..g),                  // 4 gaps before the first: stays apart
        (0, 6 * g + g / 2..7 * g),  // within the gap of the first: joins it
        (1, 5 * g..5 * g + g / 10), // far from (1, 0..g/10): stays apart
    ];
    assert_eq!(
        coalesce(jobs),
        vec![
            (0, 5 * g..7 * g),
            (1, 0..g / 10),
            (0, 0..g),
            (1, 5 * g..5 * g + g / 10)
        ]
    );
    // Groups end after COALESCE_BYTES: a close range in the next group stays apart, so a
    // late read is never pulled before earlier ones.
    let big = COALESCE_BYTES;
    let jobs = vec![(0, 0..big), (0, big + g / 8..big + g / 4)];
    assert_eq!(coalesce(jobs.clone()), jobs);
}

/// Fill of one layer mount must wait for the reads of the image's other layer mounts
/// (a container's start is all of them): a wait anywhere counts node-wide.
#[test]
fn a_read_that_waits_on_one_mount_counts_for_every_mounts_fill() {
    let (blob, index, _) = gzip_layer();
    let (dir, other_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let quiet_one = mount(
        vec![spec(
            &blob,
            Some(index.clone()),
            LogBackend::new(blob.clone()),
        )],
        Some(open_store(dir.path())),
        &View::Merged,
        FetchConfig::default(),
    );
    let busy_one = mount(
        vec![spec(&blob, Some(index), LogBackend::new(blob.clone()))],
        Some(open_store(other_dir.path())),
        &View::Merged,
        FetchConfig::default(),
    );
    let before = crate::stats::node_read_waits();
    read_file(&busy_one, "/a");
    assert!(busy_one.stats.snapshot().read_waits > 0);
    assert_eq!(quiet_one.stats.snapshot().read_waits, 0);
    assert!(
        crate::stats::node_read_waits() > before,
        "the other mount's wait was not counted node-wide"
    );
}

#[test]
fn each_stretch_of_a_layer_gets_its_windows_in_one_step_before_its_first_fetch() {
    let far = 5 << 20; // more than WINDOWS_GAP past the first stretch
    let a = data_of_location(0, 1);
    let steps = vec![
        Step::Fetch(0, 0..10),
        Step::Fetch(1, 100..200),
        Step::Pack(a, 5),
        Step::Fetch(0, far..far + 100),
        Step::Fetch(0, 20..30),
        Step::Fetch(0, 40..40),
    ];
    let got = with_windows(steps, |l| l == 0);
    assert_eq!(
        got,
        vec![
            Step::Windows(0, 0..30),
            Step::Fetch(0, 0..10),
            Step::Fetch(1, 100..200),
            Step::Pack(a, 5),
            Step::Windows(0, far..far + 100),
            Step::Fetch(0, far..far + 100),
            Step::Fetch(0, 20..30),
            Step::Fetch(0, 40..40),
        ],
        "layer 1 has no windows blob; layer 0's two stretches each come before their first fetch"
    );
    assert!(with_windows(Vec::new(), |_| true).is_empty());
}

#[test]
fn fetch_steps_of_a_layer_close_in_the_plan_become_one_batched_step() {
    let far = 5 << 20;
    let a = data_of_location(0, 1);
    let steps = vec![
        Step::Fetch(0, 0..10),
        Step::Fetch(1, 100..200),
        Step::Pack(a, 5),
        Step::Fetch(0, far..far + 100),
        Step::Fetch(1, 300..400),
        Step::Fetch(0, 20..30),
    ];
    let got = batch_fetches(steps.clone(), |l| l == 0);
    assert_eq!(
        got,
        vec![
            Step::FetchMany(0, vec![0..10, far..far + 100, 20..30]),
            Step::Fetch(1, 100..200),
            Step::Pack(a, 5),
            Step::Fetch(1, 300..400),
        ],
        "layer 0's fetches at its first one's place; layer 1 does not batch; the pack step stays after the fetches holding its file"
    );
    // With windows: the stretches' windows steps come before the batch holding them.
    let got = with_windows(got, |l| l == 0);
    assert_eq!(
        &got[..3],
        &[
            Step::Windows(0, 0..30),
            Step::Windows(0, far..far + 100),
            Step::FetchMany(0, vec![0..10, far..far + 100, 20..30]),
        ]
    );
    // A batch stops at its byte budget and its range count.
    let big = BATCH_BYTES / 2 + 1;
    let steps: Vec<Step> = (0..3u64)
        .map(|i| Step::Fetch(0, i * 2 * big..i * 2 * big + big))
        .collect();
    let got = batch_fetches(steps, |_| true);
    assert_eq!(got.len(), 3, "no two of them fit one budget: {got:?}");
    let steps: Vec<Step> = (0..100u64)
        .map(|i| Step::Fetch(0, i * 100..i * 100 + 10))
        .collect();
    let got = batch_fetches(steps, |_| true);
    assert!(got.iter().all(|s| match s {
        Step::FetchMany(_, rs) => rs.len() <= crate::device::MAX_RANGES_PER_REQUEST,
        _ => true,
    }));
    assert_eq!(
        got.iter()
            .map(|s| s.fetched().map_or(0, |(_, rs)| rs.len()))
            .sum::<usize>(),
        100,
        "every range kept once"
    );
}

fn data_of_location(layer: usize, entry: usize) -> ferry_index::merged::Location {
    ferry_index::merged::Location { layer, entry }
}
