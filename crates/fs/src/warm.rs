//! Getting ahead of the reads: recorded startup traces, eStargz prefetch landmarks and
//! background fill of the rest of every layer.
//!
//! CONTRACT (signatures are binding for the daemon):
//! * [`Trace`]: which byte ranges of which files a workload read, in order; JSON on disk
//!   and as an OCI artifact (media type [`crate::trace::TRACE_MEDIA_TYPE`]) whose subject is the image
//!   (format, recording and publishing in [`crate::trace`]).
//! * [`start`]: begins prefetch (trace first, then eStargz landmarks) and, when enabled,
//!   throttled background fill; the returned [`WarmHandle`] stops it on drop.
//! * [`start_with_pins`]: the same for a live mount that also pins its *hot set* in the
//!   chunk store under a [`PinTarget`] owner: the store entries its prefetch makes local
//!   (trace ranges, then eStargz landmark ranges of layers that keep chunks in the
//!   store). Background fill is not hot and is never pinned. The pins are taken before
//!   prefetch fetches anything (a key pinned before it is stored is protected once
//!   stored), so a small store cannot evict the start of the hot set while its end is
//!   fetched. They are released when the handle is dropped or stopped (the mount went
//!   away), and left in the store by [`WarmHandle::keep_pins`] for a mount that outlives
//!   this process; a restarted daemon that mounts it again under the same owner name
//!   ([`mount_pin_owner`] is deterministic) re-registers them before the store's grace
//!   period for restored pins ends.
//! * [`start_with_files`]: also writes the files whose data the trace's prefetch
//!   fetches entirely (and that are big enough for the file cache) to the file cache
//!   as soon as their last piece lands, so the workload's open finds them cached.
//! * [`MountedImage::note_read`] records reads into the mount's trace recorder, if any.
//!
//! Everything here goes through the layers' device sources ([`LayerSource::warm_range`],
//! [`LayerSource::fill`]), so fetched bytes are verified, stored and shared with
//! concurrent readers exactly like on-demand reads. It must not read around them (no
//! second path to the backend) and must not slow a start: background fill begins only
//! once the mount has served a read and reads have stopped waiting for the network for
//! [`WarmConfig::fill_after_quiet_secs`], pauses again whenever one does, backs off
//! whenever a read waits for a fetch slot, and takes at most
//! [`WarmConfig::fill_link_percent`] of the link's measured throughput.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_index::merged::Location;
use ferry_index::reader::LayerFormat;
use ferry_store::{ChunkKey, Store};
use parking_lot::{Condvar, Mutex};
use sha2::{Digest as _, Sha256};

use crate::device::{FillWork, LayerSource};
use crate::filecache::FileCache;
use crate::image::MountedImage;
use crate::ranges::{merge_ranges, subtract_ranges};
use crate::stats::MountStats;
use crate::trace::Trace;

/// What to warm and how hard.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmConfig {
    /// Prefetch the recorded trace / eStargz landmark files at mount.
    pub prefetch: bool,
    /// Fetch the rest of every layer in the background after prefetch.
    pub background_fill: bool,
    /// Concurrent requests used by prefetch and fill (taken from the image's limit).
    pub concurrency: usize,
    /// Background fill bandwidth cap in bytes per second (0: no fixed cap).
    pub fill_bytes_per_sec: u64,
    /// Background fill takes at most this share (percent) of the link's measured
    /// throughput ([`crate::device::link_bytes_per_sec`]), so that it never crowds the
    /// registry link of the node; 0: no share bound (with `fill_bytes_per_sec = 0` too,
    /// fill is unlimited).
    pub fill_link_percent: u64,
    /// Background fill of a mount starts once the mount has served a read (a container
    /// uses it) and no read has waited for the network for this many seconds (the
    /// start is over), and pauses whenever one does; 0: fill right after prefetch,
    /// whether or not anything reads the mount.
    pub fill_after_quiet_secs: u64,
}

impl Default for WarmConfig {
    fn default() -> Self {
        WarmConfig {
            prefetch: true,
            background_fill: true,
            concurrency: 4,
            fill_bytes_per_sec: 0,
            fill_link_percent: DEFAULT_FILL_LINK_PERCENT,
            fill_after_quiet_secs: DEFAULT_FILL_AFTER_QUIET_SECS,
        }
    }
}

/// Default [`WarmConfig::fill_link_percent`]: half the link stays for on-demand reads
/// and other images' starts.
pub const DEFAULT_FILL_LINK_PERCENT: u64 = 50;
/// Default [`WarmConfig::fill_after_quiet_secs`]: a start's misses come in bursts well
/// under a second apart; three seconds without one means it has settled.
pub const DEFAULT_FILL_AFTER_QUIET_SECS: u64 = 3;
/// Fill's pace while the link has not been measured yet (bytes per second).
pub const FILL_UNMEASURED_BYTES_PER_SEC: u64 = 8 << 20;

/// Where a live mount pins its hot set: an owner name in a chunk store.
#[derive(Debug, Clone)]
pub struct PinTarget {
    /// The store the mount's layers keep their spans in.
    pub store: Arc<Store>,
    /// The pin owner; must stay the same for the same mount across daemon restarts
    /// (see [`mount_pin_owner`]) so restored pins are re-registered, not expired.
    pub owner: String,
}

impl PinTarget {
    /// The target of the mount at `mountpoint`: owner [`mount_pin_owner`] in `store`.
    pub fn for_mount(store: Arc<Store>, mountpoint: &Path) -> PinTarget {
        PinTarget {
            store,
            owner: mount_pin_owner(mountpoint),
        }
    }
}

/// The pin owner name of the mount at `mountpoint`: `mount:PATH`, or
/// `mount:sha256:HEX` of the path's bytes when that would not be a valid owner (too long,
/// not UTF-8). The same path always gives the same name.
pub fn mount_pin_owner(mountpoint: &Path) -> String {
    if let Some(path) = mountpoint.to_str() {
        let name = format!("mount:{path}");
        if ferry_store::valid_owner(&name) {
            return name;
        }
    }
    let digest = Sha256::digest(mountpoint.as_os_str().as_bytes());
    format!("mount:sha256:{}", hex::encode(digest))
}

/// A mount's pins once warm-up is started with a [`PinTarget`]: the worker pins the hot
/// set through it, the handle releases or keeps it. Both go through `closed` so a release
/// can never be overtaken by a late pin.
#[derive(Debug)]
struct Pins {
    target: PinTarget,
    /// Set when the pins were released or handed over: nothing is pinned afterwards.
    closed: Mutex<bool>,
}

impl Pins {
    /// Pins `keys` (also with none: that re-registers an owner restored by the store
    /// from a previous process, keeping what it pinned then). False once closed.
    fn pin(&self, keys: &[ChunkKey]) -> bool {
        let closed = self.closed.lock();
        if *closed {
            return false;
        }
        if let Err(e) = self.target.store.pin(&self.target.owner, keys) {
            // The pins hold in this process anyway; only their persistence failed.
            tracing::warn!(owner = %self.target.owner, error = %e, "persisting the mount's hot set pins failed");
        }
        true
    }

    /// Releases the owner's pins (the mount went away); idempotent.
    fn release(&self) {
        let mut closed = self.closed.lock();
        if std::mem::replace(&mut *closed, true) {
            return;
        }
        match self.target.store.unpin_owner(&self.target.owner) {
            Ok(n) => tracing::debug!(owner = %self.target.owner, keys = n, "hot set pins released"),
            Err(e) => {
                tracing::warn!(owner = %self.target.owner, error = %e, "releasing the mount's hot set pins failed")
            }
        }
    }

    /// Leaves the pins in the store and stops pinning.
    fn keep(&self) {
        *self.closed.lock() = true;
    }
}

/// Stop flag and wake-up for sleeping warm-up threads.
#[derive(Debug, Default)]
struct Control {
    stop: AtomicBool,
    finished: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Control {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _guard = self.lock.lock();
        self.cv.notify_all();
    }

    /// Sleeps `d` unless stopped first; returns false when stopped.
    fn sleep(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut guard = self.lock.lock();
        loop {
            if self.stopped() {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            self.cv.wait_for(&mut guard, deadline - now);
        }
    }
}

/// Running prefetch / fill of one mount, and its hot set pins; stops (promptly, between
/// requests) and releases the pins when dropped.
#[derive(Debug, Default)]
pub struct WarmHandle {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
    pins: Option<Arc<Pins>>,
}

impl WarmHandle {
    /// True once prefetch and fill have ended (finished or stopped).
    pub fn is_finished(&self) -> bool {
        self.thread.is_none() || self.control.finished.load(Ordering::Acquire)
    }

    /// Waits until prefetch and fill have ended. The pins stay until the handle goes.
    pub fn wait(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// The owner the hot set is pinned under, when pinning.
    pub fn pin_owner(&self) -> Option<&str> {
        self.pins.as_ref().map(|p| p.target.owner.as_str())
    }

    /// Stops, waits for the requests in flight to end (each is bounded by the fetch
    /// timeout) and releases the pins.
    pub fn stop(mut self) {
        self.control.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops like a drop but leaves the hot set pinned in the store: for a mount that
    /// stays in place when this process ends (a lazy layer under running containers),
    /// whose next daemon re-registers the owner within the store's grace period.
    pub fn keep_pins(mut self) {
        if let Some(pins) = self.pins.take() {
            pins.keep();
        }
    }
}

impl Drop for WarmHandle {
    fn drop(&mut self) {
        // Signal only: a request in flight ends on its own (bounded by the fetch
        // timeout) and nothing new starts.
        self.control.stop();
        if let Some(pins) = self.pins.take() {
            pins.release();
        }
    }
}

/// Starts warming `image` (see the module doc); pins nothing.
pub fn start(image: &Arc<MountedImage>, config: &WarmConfig, trace: Option<Trace>) -> WarmHandle {
    start_with_pins(image, config, trace, None)
}

/// Starts warming `image` like [`start`] and, with `pins`, keeps the mount's hot set
/// pinned under `pins.owner` until the returned handle is dropped or stopped (see the
/// module doc).
pub fn start_with_pins(
    image: &Arc<MountedImage>,
    config: &WarmConfig,
    trace: Option<Trace>,
    pins: Option<PinTarget>,
) -> WarmHandle {
    start_with_files(image, config, trace, pins, None)
}

/// [`start_with_pins`], and with `files`: each file of at least the cache's
/// `min_file_bytes` whose data the trace's prefetch fetches entirely is written to the
/// file cache right after its last piece is fetched, in trace order. The workload's
/// open then finds it cached and the kernel serves it (passthrough) instead of every
/// read crossing FUSE and inflating spans, as on a warm node.
pub fn start_with_files(
    image: &Arc<MountedImage>,
    config: &WarmConfig,
    trace: Option<Trace>,
    pins: Option<PinTarget>,
    files: Option<Arc<FileCache>>,
) -> WarmHandle {
    let control = Arc::new(Control::default());
    let pins = pins.map(|target| {
        Arc::new(Pins {
            target,
            closed: Mutex::new(false),
        })
    });
    let worker = {
        let image = image.clone();
        let config = config.clone();
        let control = control.clone();
        let pins = pins.clone();
        std::thread::Builder::new()
            .name("ferry-warm".into())
            .spawn(move || {
                let targets = Targets {
                    pins: pins.as_deref(),
                    files: files.as_deref(),
                };
                run(&image, &config, trace.as_ref(), &control, targets);
                control.finished.store(true, Ordering::Release);
            })
    };
    match worker {
        Ok(t) => WarmHandle {
            control,
            thread: Some(t),
            pins,
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the warm-up thread; no prefetch, fill or pins");
            WarmHandle {
                control,
                thread: None,
                pins,
            }
        }
    }
}

/// Largest share of the store's bound one mount's hot set may pin (1/N): pins beyond
/// the bound would make every later put fail with "full", so a huge trace pins its
/// first part (what the workload reads first) and the rest stays evictable.
pub const HOT_SET_STORE_DIVISOR: u64 = 2;

/// The distinct store entries `jobs` make local, in job order, up to `budget` bytes;
/// with their total size, and whether the budget cut the list short.
fn hot_set(
    image: &MountedImage,
    jobs: &[(usize, Range<u64>)],
    budget: u64,
) -> (Vec<ChunkKey>, u64, bool) {
    let mut seen = HashSet::new();
    let mut keys = Vec::new();
    let mut bytes = 0u64;
    for (layer, range) in jobs {
        let Some(source) = image.layer_source(*layer) else {
            continue;
        };
        for (key, len) in source.hot_keys(range.clone()) {
            if !seen.insert(key) {
                continue;
            }
            let Some(total) = bytes.checked_add(len).filter(|t| *t <= budget) else {
                return (keys, bytes, true);
            };
            bytes = total;
            keys.push(key);
        }
    }
    (keys, bytes, false)
}

/// Pins the hot set of `jobs` through `pins` (before they are fetched).
fn pin_hot_set(image: &MountedImage, jobs: &[(usize, Range<u64>)], pins: &Pins) {
    let store = &pins.target.store;
    let (keys, bytes, cut) = hot_set(image, jobs, store.max_bytes() / HOT_SET_STORE_DIVISOR);
    if cut {
        tracing::warn!(
            owner = %pins.target.owner,
            pinned_bytes = bytes,
            max_bytes = store.max_bytes(),
            "the startup hot set is larger than its share of the chunk store; only its first part is pinned"
        );
    }
    // With no keys, pin only to re-register an owner the store restored from a previous
    // process (an empty live owner would only clutter `ferry store du`).
    if (!keys.is_empty() || !store.pinned_keys(&pins.target.owner).is_empty()) && pins.pin(&keys) {
        image.stats.hot_bytes.store(bytes, Ordering::Relaxed);
        tracing::debug!(owner = %pins.target.owner, keys = keys.len(), bytes, "hot set pinned");
    }
}

/// What warm-up keeps besides the chunk store.
#[derive(Clone, Copy)]
struct Targets<'a> {
    /// The hot set's pins.
    pins: Option<&'a Pins>,
    /// The file cache prefetch writes whole files to.
    files: Option<&'a FileCache>,
}

/// One step of prefetch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// Make a compressed range of a layer local.
    Fetch(usize, Range<u64>),
    /// Write the `size`-byte file at a location to the file cache (the fetch steps
    /// before it hold all its data).
    Materialize(Location, u64),
    /// Add the small `size`-byte file at a location to the small-file pack (the fetch
    /// steps before it hold all its data).
    Pack(Location, u64),
    /// Make local the windows of the checkpoints of a compressed range of a layer.
    Windows(usize, Range<u64>),
    /// Make several compressed ranges of a layer local, in as few requests as the
    /// backend allows (see [`batch_fetches`]).
    FetchMany(usize, Vec<Range<u64>>),
}

impl Step {
    /// The layer and ranges a fetch step makes local.
    fn fetched(&self) -> Option<(usize, &[Range<u64>])> {
        match self {
            Step::Fetch(l, r) => Some((*l, std::slice::from_ref(r))),
            Step::FetchMany(l, rs) => Some((*l, rs)),
            Step::Materialize(..) | Step::Pack(..) | Step::Windows(..) => None,
        }
    }
}

fn run(
    image: &MountedImage,
    config: &WarmConfig,
    trace: Option<&Trace>,
    control: &Control,
    targets: Targets<'_>,
) {
    let stats = &image.stats;
    if config.prefetch {
        let jobs = prefetch_jobs(image, trace);
        let min_file = targets.files.map(|f| f.config().min_file_bytes.max(1));
        let pack = targets.files.is_some_and(|f| f.pack().is_some());
        let steps = prefetch_steps(image, trace, &jobs, min_file, pack);
        let stores_windows = |l: usize| image.layer_source(l).is_some_and(|s| s.stores_windows());
        let steps = with_windows(batch_fetches(steps, stores_windows), stores_windows);
        if let Some(pins) = targets.pins {
            // Everything prefetch fetches, the pieces it adds for cached files too.
            let fetches: Vec<(usize, Range<u64>)> = steps
                .iter()
                .filter_map(Step::fetched)
                .flat_map(|(l, rs)| rs.iter().map(move |r| (l, r.clone())))
                .collect();
            pin_hot_set(image, &fetches, pins);
        }
        let fetched = run_jobs(&steps, config.concurrency, control, |step| match step {
            Step::Fetch(layer, range) => {
                let Some(source) = image.layer_source(*layer) else {
                    return;
                };
                // Windows steps bring this layer's windows (see with_windows).
                let fetched = if source.stores_windows() {
                    source.warm_spans(range.clone())
                } else {
                    source.warm_range(range.clone())
                };
                match fetched {
                    Ok(n) => MountStats::add(&stats.bytes_prefetched, n),
                    Err(e) => tracing::warn!(
                        layer,
                        start = range.start,
                        end = range.end,
                        error = %e,
                        "prefetch of a range failed; it will be read on demand"
                    ),
                }
            }
            Step::FetchMany(layer, ranges) => {
                let Some(source) = image.layer_source(*layer) else {
                    return;
                };
                match source.warm_spans_many(ranges) {
                    Ok(n) => MountStats::add(&stats.bytes_prefetched, n),
                    Err(e) => tracing::warn!(
                        layer,
                        ranges = ranges.len(),
                        error = %e,
                        "prefetch of ranges failed; they will be read on demand"
                    ),
                }
            }
            Step::Windows(layer, range) => {
                let Some(source) = image.layer_source(*layer) else {
                    return;
                };
                match source.warm_windows(range.clone()) {
                    Ok(n) => MountStats::add(&stats.bytes_prefetched, n),
                    Err(e) => tracing::debug!(
                        layer,
                        error = %e,
                        "prefetch of windows failed; each span fetch brings its own"
                    ),
                }
            }
            Step::Materialize(loc, size) => {
                if let Some(files) = targets.files {
                    materialize(image, files, *loc, *size);
                }
            }
            Step::Pack(loc, size) => {
                if let Some(files) = targets.files {
                    pack_file(image, files, *loc, *size);
                }
            }
        });
        if !fetched {
            return;
        }
        tracing::debug!(jobs = jobs.len(), "prefetch done");
    }
    stats.prefetch_done.store(true, Ordering::Release);
    if !config.background_fill {
        return;
    }
    let quiet = Quiet::new(
        Duration::from_secs(config.fill_after_quiet_secs),
        crate::stats::node_read_waits(),
        Instant::now(),
    );
    // Fill is for mounts a container uses, once its start is over.
    if !quiet.wait(stats, control) {
        return;
    }
    let layers: Vec<(usize, &Arc<LayerSource>)> = mount_layers(image)
        .filter_map(|l| image.layer_source(l).map(|s| (l, s)))
        .collect();
    let mut jobs: Vec<(&Arc<LayerSource>, FillWork)> = Vec::new();
    for (layer, source) in &layers {
        let work = source.fill_work();
        if work.is_empty() && !source.is_local() {
            tracing::info!(
                layer,
                "layer cannot be filled (no chunk store); left on demand"
            );
        }
        jobs.extend(work.into_iter().map(|w| (*source, w)));
    }
    let throttle = Throttle::new(config.fill_bytes_per_sec, config.fill_link_percent);
    let gate = |limiter: &crate::device::Limiter, n: u64| -> bool {
        // Yield to foreground reads: nothing new while one waits for a fetch slot, and
        // after a read waited for the network, nothing until reads are quiet again.
        while limiter.waiting() > 0 {
            if !control.sleep(Duration::from_millis(5)) {
                return false;
            }
        }
        quiet.wait(stats, control) && throttle.take(n, control)
    };
    // Leave foreground reads at least one slot of their own.
    let slots = layers.first().map_or(1, |(_, s)| s.limiter().slots());
    let workers = config.concurrency.min(slots.saturating_sub(1)).max(1);
    let completed = run_jobs(&jobs, workers, control, |(source, work)| {
        let gate = |n: u64| gate(source.limiter(), n);
        match source.fill(work, &gate) {
            Ok(n) => MountStats::add(&stats.bytes_filled, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => tracing::warn!(
                bytes = source.work_bytes(work),
                error = %e,
                "background fill of a range failed"
            ),
        }
    });
    if !completed {
        return;
    }
    // Layers without a device source were fetched whole at mount time.
    if layers.iter().all(|(_, s)| s.is_local()) {
        stats.fill_done.store(true, Ordering::Release);
    } else {
        tracing::info!("background fill ended with parts of the image still remote");
    }
}

/// The layers this mount shows: all, or the one of a single-layer mount.
fn mount_layers(image: &MountedImage) -> impl Iterator<Item = usize> + '_ {
    (0..image.image.layers().len()).filter(|l| image.view_layer.is_none_or(|v| v == *l))
}

/// Prefetch work in order: the trace's reads (as compressed ranges of the layer
/// holding each file's data; single-layer mounts keep only their layer's), then the
/// prioritized files of eStargz layers.
fn prefetch_jobs(image: &MountedImage, trace: Option<&Trace>) -> Vec<(usize, Range<u64>)> {
    let mut jobs = Vec::new();
    let mut seen: HashSet<(usize, u64, u64)> = HashSet::new();
    let mut push = |layer: usize, r: Range<u64>, jobs: &mut Vec<(usize, Range<u64>)>| {
        if seen.insert((layer, r.start, r.end)) {
            jobs.push((layer, r));
        }
    };
    let layers = image.image.layers();
    if let Some(trace) = trace {
        for read in &trace.reads {
            let Some(loc) = trace_location(image, &read.path) else {
                continue;
            };
            if image.layer_source(loc.layer).is_none() {
                continue;
            }
            for r in layers[loc.layer].ranges_for(loc.entry, read.offset, read.len) {
                push(loc.layer, r, &mut jobs);
            }
        }
    }
    for layer in mount_layers(image) {
        if let LayerFormat::Estargz(esgz) = layers[layer].format()
            && let Some(r) = esgz.prefetch_range()
            && r.start < r.end
        {
            push(layer, r, &mut jobs);
        }
    }
    coalesce(jobs)
}

/// Jobs taken in trace order at most this many compressed bytes at a time are merged
/// where close ([`coalesce`]).
const COALESCE_BYTES: u64 = 16 << 20;
/// Ranges of one layer in a group of jobs this close (compressed bytes) or closer are
/// fetched as one. Measured (docs/benchmarks.md, "Trace prefetch in fewer requests"):
/// against 128 KiB groups of 4 MiB, a pandas start's prefetch makes 81 requests instead
/// of 174 for 9 % more bytes, Debian's registry spends half the CPU on it, and the start
/// is 15-20 % faster at 10 ms; 2 MiB saved a few more requests for 20 % more bytes.
const COALESCE_GAP: u64 = 1 << 20;

/// Fewer, larger requests for the same bytes, in nearly the same order: consecutive jobs
/// (trace order) in groups of [`COALESCE_BYTES`], and within a group a range joins an
/// earlier one of its layer at most [`COALESCE_GAP`] away (taking that one's place). A
/// start's reads jump between files, but a group's lie in a few stretches of each
/// layer, and a registry pays per request (Debian's about 5 ms of CPU each, whatever
/// the size): measured on a gcc start's trace, 199 requests for 30 MB. The device
/// splits what is merged into requests of at most its request size.
fn coalesce(jobs: Vec<(usize, Range<u64>)>) -> Vec<(usize, Range<u64>)> {
    let mut out: Vec<(usize, Range<u64>)> = Vec::with_capacity(jobs.len());
    let mut group_start = 0;
    let mut group_bytes = 0u64;
    for (l, r) in jobs {
        group_bytes += r.end - r.start;
        // Into a range of this group it is close to (the first one's place), else last.
        let near = out[group_start..]
            .iter_mut()
            .find(|(pl, p): &&mut (usize, Range<u64>)| {
                *pl == l && r.start <= p.end + COALESCE_GAP && p.start <= r.end + COALESCE_GAP
            });
        match near {
            Some((_, p)) => *p = p.start.min(r.start)..p.end.max(r.end),
            None => out.push((l, r)),
        }
        if group_bytes >= COALESCE_BYTES {
            group_start = out.len();
            group_bytes = 0;
        }
    }
    out
}

/// Fetch steps of one layer this close (compressed bytes) or closer share one windows
/// step. The windows blob holds about a tenth of the bytes of the spans it serves, so
/// a gap costs at most ~400 KB of windows no read asks for, against one request (and a
/// round trip on the prefetch's path) per stretch.
const WINDOWS_GAP: u64 = 4 << 20;

/// `steps` with, before the first fetch step of each stretch of a layer (its fetch
/// steps merged where at most [`WINDOWS_GAP`] apart), a step that makes the stretch's
/// windows local in as few requests as they allow. Otherwise each span fetch brings
/// its own windows in a request of its own. Only for layers `has_windows` says have a
/// windows blob.
fn with_windows(steps: Vec<Step>, has_windows: impl Fn(usize) -> bool) -> Vec<Step> {
    let mut per_layer: HashMap<usize, Vec<Range<u64>>> = HashMap::new();
    for (l, rs) in steps.iter().filter_map(Step::fetched) {
        if has_windows(l) {
            let rs = rs.iter().filter(|r| r.start < r.end).cloned();
            per_layer.entry(l).or_default().extend(rs);
        }
    }
    // (layer, stretch), to go before the first fetch step overlapping it.
    let mut stretches: Vec<(usize, Range<u64>)> = Vec::new();
    for (l, mut ranges) in per_layer {
        ranges.sort_by_key(|r| r.start);
        let mut cur: Option<Range<u64>> = None;
        for r in ranges {
            match &mut cur {
                Some(c) if r.start <= c.end.saturating_add(WINDOWS_GAP) => c.end = c.end.max(r.end),
                _ => stretches.extend(cur.replace(r).map(|c| (l, c))),
            }
        }
        stretches.extend(cur.map(|c| (l, c)));
    }
    let mut out = Vec::with_capacity(steps.len() + stretches.len());
    for step in steps {
        if let Some((l, rs)) = step.fetched() {
            let mut i = 0;
            while i < stretches.len() {
                let (sl, s) = &stretches[i];
                if *sl == l && rs.iter().any(|r| s.start < r.end && r.start < s.end) {
                    let (sl, s) = stretches.swap_remove(i);
                    out.push(Step::Windows(sl, s));
                } else {
                    i += 1;
                }
            }
        }
        out.push(step);
    }
    out
}

/// A batched fetch step takes later fetch steps of its layer from at most this many
/// steps ahead: the order prefetch fetches in is the trace's (what the start reads
/// first comes first), and a batch moves its later ranges up to its own place.
const BATCH_LOOKAHEAD: usize = 64;
/// Compressed bytes of one batched fetch step: the device's default request size.
const BATCH_BYTES: u64 = 8 << 20;

/// `steps` with each fetch step of a layer `batches` accepts joined by the fetch steps
/// of the same layer that follow it closely (within [`BATCH_LOOKAHEAD`] steps, up to
/// [`BATCH_BYTES`] and [`MAX_RANGES_PER_REQUEST`](crate::device::MAX_RANGES_PER_REQUEST)
/// ranges) into one [`Step::FetchMany`], fetched in one request where the backend
/// batches ranges (`multipart/byteranges`). [`coalesce`] merged what lies close in
/// the stream; what is left of a group lies apart, and each was a request of its own
/// (a registry pays per request: Debian's 7 ms of CPU for one range, 13 ms for eight).
fn batch_fetches(steps: Vec<Step>, batches: impl Fn(usize) -> bool) -> Vec<Step> {
    let mut steps: Vec<Option<Step>> = steps.into_iter().map(Some).collect();
    let mut out = Vec::with_capacity(steps.len());
    for i in 0..steps.len() {
        let Some(step) = steps[i].take() else {
            continue;
        };
        let Step::Fetch(layer, first) = step else {
            out.push(step);
            continue;
        };
        if !batches(layer) {
            out.push(Step::Fetch(layer, first));
            continue;
        }
        let mut bytes = first.end - first.start;
        let mut ranges = vec![first];
        for later in steps.iter_mut().skip(i + 1).take(BATCH_LOOKAHEAD) {
            let Some(Step::Fetch(l, r)) = later else {
                continue;
            };
            if *l != layer {
                continue;
            }
            let n = r.end - r.start;
            if bytes + n > BATCH_BYTES || ranges.len() == crate::device::MAX_RANGES_PER_REQUEST {
                break;
            }
            bytes += n;
            ranges.push(r.clone());
            *later = None;
        }
        out.push(match ranges.len() {
            1 => Step::Fetch(layer, ranges.remove(0)),
            _ => Step::FetchMany(layer, ranges),
        });
    }
    out
}

/// The prefetch jobs as steps. With `min_file` (a file cache's smallest file), each
/// file of at least that size the trace reads, whose data lies inside the jobs' ranges
/// of its layer (all of it, or all but [`MISSING_DIVISOR`]'s share, fetched first), gets
/// a materialize step right after the last fetch step holding a piece of it: the file
/// is cached before the workload, which reads in trace order, comes to it. A file read
/// only in part (a library the loader maps and touches here and there) stays out.
fn prefetch_steps(
    image: &MountedImage,
    trace: Option<&Trace>,
    jobs: &[(usize, Range<u64>)],
    min_file: Option<u64>,
    pack: bool,
) -> Vec<Step> {
    let fetches = jobs.iter().map(|(l, r)| Step::Fetch(*l, r.clone()));
    let (Some(min_file), Some(trace)) = (min_file, trace) else {
        return fetches.collect();
    };
    let layers = image.image.layers();
    // Per layer, the jobs' ranges merged, to test containment.
    let mut covered: HashMap<usize, Vec<Range<u64>>> = HashMap::new();
    for (layer, r) in jobs {
        covered.entry(*layer).or_default().push(r.clone());
    }
    for ranges in covered.values_mut() {
        *ranges = merge_ranges(std::mem::take(ranges));
    }
    // After job i: the missing pieces of files to cache, then the files.
    let mut after: HashMap<usize, Vec<Step>> = HashMap::new();
    let mut seen: HashSet<(usize, usize)> = HashSet::new();
    for read in &trace.reads {
        let Some(loc) = trace_location(image, &read.path) else {
            continue;
        };
        let Some(entry) = layers
            .get(loc.layer)
            .and_then(|l| l.entries().get(loc.entry))
        else {
            continue;
        };
        let small = entry.size < min_file;
        if entry.size == 0 || (small && !pack) || !seen.insert((loc.layer, loc.entry)) {
            continue;
        }
        if matches!(layers[loc.layer].format(), LayerFormat::Whole { .. }) {
            continue; // held whole in memory: nothing to gain
        }
        let want = layers[loc.layer].ranges_for(loc.entry, 0, entry.size);
        let Some(have) = covered.get(&loc.layer) else {
            continue;
        };
        let wanted: u64 = want.iter().map(|w| w.end - w.start).sum();
        let missing = subtract_ranges(&want, have);
        let missing_bytes: u64 = missing.iter().map(|m| m.end - m.start).sum();
        // A small file is packed only when the trace's ranges hold all of it (a few
        // bytes; it was read whole), a large one cached when they hold most of it.
        let allowed = if small { 0 } else { wanted };
        if wanted == 0 || missing_bytes.saturating_mul(MISSING_DIVISOR) > allowed {
            continue;
        }
        let last = jobs.iter().rposition(|(l, r)| {
            *l == loc.layer && want.iter().any(|w| w.start < r.end && r.start < w.end)
        });
        if let Some(i) = last {
            let steps = after.entry(i).or_default();
            if small {
                steps.push(Step::Pack(loc, entry.size));
            } else {
                steps.extend(missing.into_iter().map(|m| Step::Fetch(loc.layer, m)));
                steps.push(Step::Materialize(loc, entry.size));
            }
        }
    }
    let mut steps = Vec::with_capacity(jobs.len() + seen.len());
    for (i, step) in fetches.enumerate() {
        steps.push(step);
        let mut then = after.remove(&i).unwrap_or_default();
        // Small files in stream order: neighbours share their inflated span, which a
        // trace's order (jumping between directories and layers) would let the bounded
        // inflated cache evict and inflate again.
        then.sort_by_key(|s| match s {
            Step::Pack(loc, _) => (1, loc.layer, loc.entry),
            _ => (0, 0, 0),
        });
        steps.extend(then);
    }
    steps
}

/// A file the trace reads most of is cached whole when the pieces of it the trace
/// leaves out are at most 1/N of its compressed bytes (they are fetched just before
/// it). The start reads such a file nearly whole anyway (an executable, a library it
/// walks through), and cached, the kernel serves all of it.
const MISSING_DIVISOR: u64 = 4;

/// Writes the file at `loc` to `files` unless it is there already. Its pieces were
/// fetched by earlier steps or are in flight (the copy then waits for them).
fn materialize(image: &MountedImage, files: &FileCache, loc: Location, size: u64) {
    let Some(key) = crate::localfiles::file_key(image, loc, size) else {
        return;
    };
    if files.contains(&key) {
        return;
    }
    let outcome = files.put(&key, size, |out| {
        crate::localfiles::copy_file_to(image, loc, out)
    });
    match outcome {
        Ok(o) => {
            tracing::debug!(key = %key.hex(), size, outcome = ?o, "prefetch cached a file")
        }
        Err(e) => {
            tracing::warn!(key = %key.hex(), error = %e, "prefetch could not cache a file; it is served through the mount")
        }
    }
}

/// Adds the small file at `loc` to the file cache's small-file pack unless it is
/// there: read through the layer (its spans were fetched by earlier steps or are in
/// flight; neighbours share the inflated span), so the workload's read is a `pread`.
fn pack_file(image: &MountedImage, files: &FileCache, loc: Location, size: u64) {
    let Some(pack) = files.pack() else {
        return;
    };
    let Some(key) = crate::localfiles::file_key(image, loc, size) else {
        return;
    };
    if pack.contains(&key) {
        return;
    }
    let Some(layer) = image.image.layers().get(loc.layer) else {
        return;
    };
    let mut buf = vec![0u8; size as usize];
    match crate::device::in_background(|| layer.read_at(loc.entry, 0, &mut buf)) {
        Ok(n) if n as u64 == size => pack.put(&key, &buf),
        Ok(n) => tracing::debug!(size, n, "prefetch read a small file short; not packed"),
        Err(e) => {
            tracing::debug!(error = %e, "prefetch could not read a small file; it is read on demand")
        }
    }
}

/// Where the data of the file a trace names lives, as this mount sees it. Resolved in
/// the mount's tree (directories a tar never listed exist there); a single-layer mount
/// skips files the merged view reads from another layer (shadowed or not its own).
fn trace_location(image: &MountedImage, path: &str) -> Option<ferry_index::merged::Location> {
    let node = image.tree.get(image.tree.resolve(path)?)?;
    let loc = node.data?;
    if let Some(view) = image.view_layer {
        let merged = image.image.table().get(path.trim_start_matches('/'))?;
        if loc.layer != view || merged.layer != view {
            return None;
        }
    }
    Some(loc)
}

/// Runs `job` over `jobs` in order with `workers` threads; false when stopped first.
fn run_jobs<T: Sync>(
    jobs: &[T],
    workers: usize,
    control: &Control,
    job: impl Fn(&T) + Sync,
) -> bool {
    let next = AtomicUsize::new(0);
    let workers = workers.clamp(1, jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while !control.stopped() {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(j) = jobs.get(i) else { break };
                    job(j);
                }
            });
        }
    });
    !control.stopped()
}

/// When background fill may run: the mount has served a read, and no read (of any mount
/// of the node) has waited for the network for `quiet` (none at all: at once). Pure but
/// for [`Quiet::wait`].
#[derive(Debug)]
struct Quiet {
    quiet: Duration,
    /// The read waits last seen, and when they were first seen at that count.
    last: Mutex<(u64, Instant)>,
}

impl Quiet {
    fn new(quiet: Duration, read_waits: u64, now: Instant) -> Quiet {
        Quiet {
            quiet,
            last: Mutex::new((read_waits, now)),
        }
    }

    /// How much longer fill must wait, given the mount's counters now (`None`: fill
    /// may go on). Never read yet: wait a whole quiet period and ask again.
    fn remaining(&self, read_waits: u64, bytes_served: u64, now: Instant) -> Option<Duration> {
        if self.quiet.is_zero() {
            return None;
        }
        if bytes_served == 0 {
            return Some(self.quiet);
        }
        let mut last = self.last.lock();
        if last.0 != read_waits {
            *last = (read_waits, now);
            return Some(self.quiet);
        }
        let since = now.saturating_duration_since(last.1);
        (since < self.quiet).then(|| self.quiet - since)
    }

    /// Sleeps until fill may go on; false when stopped first. The waits counted are the
    /// node's, not only this mount's: a container's start is several layer mounts, and
    /// filling one layer while the start waits on another would compete with it
    /// (measured: a pandas start 25 ms from the registry, 124 MB fetched by its first
    /// output instead of 85, when each layer's fill watched only its own mount).
    fn wait(&self, stats: &MountStats, control: &Control) -> bool {
        loop {
            let waits = crate::stats::node_read_waits();
            let served = stats.bytes_served.load(Ordering::Relaxed);
            match self.remaining(waits, served, Instant::now()) {
                None => return !control.stopped(),
                Some(d) => {
                    if !control.sleep(d) {
                        return false;
                    }
                }
            }
        }
    }
}

/// Paces background fill to a byte rate: the fixed cap or the share of the measured
/// link, whichever is lower (neither: unlimited); each request reserves its bytes'
/// share of time and waits for its turn.
struct Throttle {
    bytes_per_sec: u64,
    link_percent: u64,
    next: Mutex<Instant>,
}

impl Throttle {
    fn new(bytes_per_sec: u64, link_percent: u64) -> Throttle {
        Throttle {
            bytes_per_sec,
            link_percent,
            next: Mutex::new(Instant::now()),
        }
    }

    /// The pace now, given the link's measured throughput (0: unlimited).
    fn rate(&self, link: Option<u64>) -> u64 {
        fill_rate(self.bytes_per_sec, self.link_percent, link)
    }

    /// Waits until `n` more bytes are within the rate; false when stopped meanwhile.
    fn take(&self, n: u64, control: &Control) -> bool {
        if control.stopped() {
            return false;
        }
        let rate = self.rate(crate::device::link_bytes_per_sec());
        if rate == 0 {
            return true;
        }
        let start = {
            let mut next = self.next.lock();
            let start = (*next).max(Instant::now());
            *next = start + Duration::from_secs_f64(n as f64 / rate as f64);
            start
        };
        control.sleep(start.saturating_duration_since(Instant::now()))
    }
}

/// Fill's pace in bytes per second (0: unlimited): the lower of the fixed cap
/// (`bytes_per_sec`, 0: none) and `link_percent` of the link's measured throughput
/// (`link`; unmeasured: [`FILL_UNMEASURED_BYTES_PER_SEC`]; percent 0: no share bound).
fn fill_rate(bytes_per_sec: u64, link_percent: u64, link: Option<u64>) -> u64 {
    let share = (link_percent > 0).then(|| match link {
        Some(l) => (l / 100).saturating_mul(link_percent.min(100)).max(1),
        None => FILL_UNMEASURED_BYTES_PER_SEC,
    });
    match (bytes_per_sec, share) {
        (0, None) => 0,
        (0, Some(s)) => s,
        (cap, None) => cap,
        (cap, Some(s)) => cap.min(s),
    }
}

impl MountedImage {
    /// Called by the FUSE layer for every read of a regular file, before it is served.
    /// Must be cheap: the read path calls it on every request (one atomic load when no
    /// trace is being recorded).
    pub fn note_read(&self, ino: u64, offset: u64, len: u32) {
        self.recorder
            .note(self.recorder_view, &self.tree, ino, offset, u64::from(len));
    }

    /// True while a startup trace is being recorded (either mode).
    pub fn is_recording(&self) -> bool {
        self.recorder.is_recording()
    }

    /// True while a trace is recorded that must see every read: the FUSE layer then
    /// serves every read itself (no passthrough, no page cache kept from before the
    /// open). A passive recording ([`crate::image::recorder::Recorder::start_passive`]) leaves
    /// the read path alone.
    pub fn records_every_read(&self) -> bool {
        self.recorder.records_every_read()
    }
}

#[cfg(test)]
#[path = "warm_tests.rs"]
mod tests;

#[path = "prewarm.rs"]
pub mod prewarm;
