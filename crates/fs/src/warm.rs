//! Getting ahead of the reads: recorded startup traces, eStargz prefetch landmarks and
//! background fill of the rest of every layer.
//!
//! CONTRACT (signatures are binding for the daemon):
//! * [`Trace`]: which byte ranges of which files a workload read, in order; JSON on disk
//!   and as an OCI artifact (media type [`TRACE_MEDIA_TYPE`]) whose subject is the image
//!   (format, recording and publishing in [`crate::trace`]).
//! * [`start`]: begins prefetch (trace first, then eStargz landmarks) and, when enabled,
//!   throttled background fill; the returned [`WarmHandle`] stops it on drop.
//! * [`MountedImage::note_read`] records reads into the mount's trace recorder, if any.
//!
//! Everything here goes through the layers' device sources ([`LayerSource::warm_range`],
//! [`LayerSource::fill`]), so fetched bytes are verified, stored and shared with
//! concurrent readers exactly like on-demand reads. It must not read around them (no
//! second path to the backend) and must not starve foreground reads: fill backs off
//! whenever a read waits for a fetch slot.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_index::reader::LayerFormat;

use crate::device::{FillWork, LayerSource};
use crate::image::MountedImage;
use crate::stats::MountStats;

/// Media type of a published startup trace (artifactType of its manifest).
pub const TRACE_MEDIA_TYPE: &str = "application/vnd.ferry.trace.v1+json";

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
    /// Background fill bandwidth cap in bytes per second (0: unlimited).
    pub fill_bytes_per_sec: u64,
}

impl Default for WarmConfig {
    fn default() -> Self {
        WarmConfig {
            prefetch: true,
            background_fill: true,
            concurrency: 4,
            fill_bytes_per_sec: 0,
        }
    }
}

/// A recorded startup trace.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Trace {
    /// Reads in first-touch order.
    pub reads: Vec<TraceRead>,
}

/// One recorded read: `len` bytes at `offset` of the file at `path` in the merged tree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceRead {
    /// Absolute path in the image's root filesystem.
    pub path: String,
    /// Offset of the read within the file.
    pub offset: u64,
    /// Bytes read.
    pub len: u64,
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
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }

    /// Sleeps `d` unless stopped first; returns false when stopped.
    fn sleep(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.stopped() {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            guard = self
                .cv
                .wait_timeout(guard, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

/// Running prefetch / fill; stops (promptly, between requests) when dropped.
#[derive(Debug, Default)]
pub struct WarmHandle {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

impl WarmHandle {
    /// True once prefetch and fill have ended (finished or stopped).
    pub fn is_finished(&self) -> bool {
        self.thread.is_none() || self.control.finished.load(Ordering::Acquire)
    }

    /// Waits until prefetch and fill have ended.
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops and waits for the requests in flight to end (each is bounded by the fetch
    /// timeout).
    pub fn stop(mut self) {
        self.control.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for WarmHandle {
    fn drop(&mut self) {
        // Signal only: a request in flight ends on its own (bounded by the fetch
        // timeout) and nothing new starts.
        self.control.stop();
    }
}

/// Starts warming `image` (see the module doc).
pub fn start(image: &Arc<MountedImage>, config: &WarmConfig, trace: Option<Trace>) -> WarmHandle {
    let control = Arc::new(Control::default());
    let worker = {
        let image = image.clone();
        let config = config.clone();
        let control = control.clone();
        std::thread::Builder::new()
            .name("ferry-warm".into())
            .spawn(move || {
                run(&image, &config, trace.as_ref(), &control);
                control.finished.store(true, Ordering::Release);
            })
    };
    match worker {
        Ok(t) => WarmHandle {
            control,
            thread: Some(t),
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the warm-up thread; no prefetch or fill");
            WarmHandle {
                control,
                thread: None,
            }
        }
    }
}

fn run(image: &MountedImage, config: &WarmConfig, trace: Option<&Trace>, control: &Control) {
    let stats = &image.stats;
    if config.prefetch {
        let jobs = prefetch_jobs(image, trace);
        let fetched = run_jobs(&jobs, config.concurrency, control, |(layer, range)| {
            let Some(source) = image.layer_source(*layer) else {
                return;
            };
            match source.warm_range(range.clone()) {
                Ok(n) => MountStats::add(&stats.bytes_prefetched, n),
                Err(e) => tracing::warn!(
                    layer,
                    start = range.start,
                    end = range.end,
                    error = %e,
                    "prefetch of a range failed; it will be read on demand"
                ),
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
    let throttle = Throttle::new(config.fill_bytes_per_sec);
    let gate = |limiter: &crate::device::Limiter, n: u64| -> bool {
        // Yield to foreground reads: nothing new while one waits for a fetch slot.
        while limiter.waiting() > 0 {
            if !control.sleep(Duration::from_millis(5)) {
                return false;
            }
        }
        throttle.take(n, control)
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
    jobs
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

/// Paces background fill to a byte rate: each request reserves its bytes' share of
/// time and waits for its turn.
struct Throttle {
    bytes_per_sec: u64,
    next: Mutex<Instant>,
}

impl Throttle {
    fn new(bytes_per_sec: u64) -> Throttle {
        Throttle {
            bytes_per_sec,
            next: Mutex::new(Instant::now()),
        }
    }

    /// Waits until `n` more bytes are within the rate; false when stopped meanwhile.
    fn take(&self, n: u64, control: &Control) -> bool {
        if control.stopped() {
            return false;
        }
        if self.bytes_per_sec == 0 {
            return true;
        }
        let start = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*next).max(Instant::now());
            *next = start + Duration::from_secs_f64(n as f64 / self.bytes_per_sec as f64);
            start
        };
        control.sleep(start.saturating_duration_since(Instant::now()))
    }
}

impl MountedImage {
    /// Called by the FUSE layer for every read of a regular file, before it is served.
    /// Must be cheap: the read path calls it on every request (one atomic load when no
    /// trace is being recorded).
    pub fn note_read(&self, ino: u64, offset: u64, len: u32) {
        self.recorder.note(&self.tree, ino, offset, u64::from(len));
    }
}

#[cfg(test)]
#[path = "warm_tests.rs"]
mod tests;
