//! `ferry prewarm`: make an image's hot set (or all of it) local now, in the
//! foreground, before any container asks — the same plan a live mount's prefetch
//! follows ([`super::start_with_files`]: trace reads first, then eStargz landmark
//! files), through the same device sources (verified, stored, single-flight with any
//! concurrent reader), but without the background fill's throttle and quiet wait, with
//! progress, a stop flag, and a report of what was fetched against what was there.
//!
//! Resumable by construction: every span lands in the chunk store as soon as it is
//! verified, and the plan skips what the store holds, so a run killed halfway fetches
//! only the rest when run again, and a run over a complete store fetches nothing.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ferry_store::Store;
use serde::{Deserialize, Serialize};

use super::{
    Control, Step, Targets, batch_fetches, hot_set, materialize, mount_layers, pack_file,
    prefetch_jobs, prefetch_steps, run_jobs, with_windows,
};
use crate::device::{FillWork, LayerSource};
use crate::filecache::FileCache;
use crate::image::MountedImage;
use crate::trace::Trace;

/// What a prewarm covered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Coverage {
    /// The image's startup trace (and eStargz landmarks, if any).
    Trace,
    /// No trace: the eStargz prioritized files.
    Landmarks,
    /// No trace and no landmarks: nothing is known to be hot.
    Nothing,
    /// Every layer, whole (`--full`).
    Full,
}

impl Coverage {
    /// The name `ferry prewarm` prints and records.
    pub fn as_str(self) -> &'static str {
        match self {
            Coverage::Trace => "trace",
            Coverage::Landmarks => "landmarks",
            Coverage::Nothing => "nothing",
            Coverage::Full => "full",
        }
    }
}

/// How a prewarm went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrewarmReport {
    /// What was planned.
    pub coverage: Coverage,
    /// Compressed bytes the plan covers (hot set, or every layer with `full`).
    pub planned_bytes: u64,
    /// Of those, bytes the store held before this run.
    pub present_bytes: u64,
    /// Bytes fetched by this run.
    pub fetched_bytes: u64,
    /// Ranges that could not be fetched (logged; they stay on demand).
    pub failed: u64,
    /// Stopped before the end (the store keeps what was fetched).
    pub stopped: bool,
    /// Wall time, ms.
    pub elapsed_ms: u64,
}

/// Where a prewarm reports progress and learns it should stop.
pub trait PrewarmProgress: Sync {
    /// The plan: `planned` bytes, of which `present` are local already.
    fn planned(&self, planned: u64, present: u64);
    /// `bytes` more were fetched.
    fn fetched(&self, bytes: u64);
    /// True when the prewarm should stop (checked between requests).
    fn stop_requested(&self) -> bool {
        false
    }
}

/// No progress reporting, never stopped.
#[derive(Debug, Default)]
pub struct NoProgress;

impl PrewarmProgress for NoProgress {
    fn planned(&self, _: u64, _: u64) {}
    fn fetched(&self, _: u64) {}
}

/// Makes `image`'s hot set local (`trace`, else its eStargz landmarks) and with `full`
/// every layer, in `store` (the store the image's layers were wired with) and, when
/// given, the file cache; `concurrency` requests at a time. Blocks until done or
/// stopped through `progress`.
pub fn prewarm(
    image: &Arc<MountedImage>,
    store: &Store,
    trace: Option<&Trace>,
    full: bool,
    files: Option<&FileCache>,
    concurrency: usize,
    progress: &dyn PrewarmProgress,
) -> PrewarmReport {
    let started = Instant::now();
    let control = Control::default();
    let fetched = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let add = |n: u64| {
        fetched.fetch_add(n, Ordering::Relaxed);
        progress.fetched(n);
    };
    let stop_check = || {
        if progress.stop_requested() {
            control.stop();
        }
        control.stopped()
    };
    let fail = || {
        failed.fetch_add(1, Ordering::Relaxed);
    };

    // The hot set, planned like a mount's prefetch.
    let jobs = prefetch_jobs(image, trace);
    let min_file = files.map(|f| f.config().min_file_bytes.max(1));
    let pack = files.is_some_and(|f| f.pack().is_some());
    let steps = prefetch_steps(image, trace, &jobs, min_file, pack);
    let stores_windows = |l: usize| image.layer_source(l).is_some_and(|s| s.stores_windows());
    let steps = with_windows(batch_fetches(steps, stores_windows), stores_windows);
    let fetches: Vec<(usize, Range<u64>)> = steps
        .iter()
        .filter_map(Step::fetched)
        .flat_map(|(l, rs)| rs.iter().map(move |r| (l, r.clone())))
        .collect();
    let (keys, hot_bytes, _) = hot_set(image, &fetches, u64::MAX);
    let hot_present: u64 = {
        let sizes: std::collections::HashMap<_, _> = fetches
            .iter()
            .filter_map(|(l, r)| image.layer_source(*l).map(|s| s.hot_keys(r.clone())))
            .flatten()
            .collect();
        keys.iter()
            .filter(|k| store.contains(k))
            .filter_map(|k| sizes.get(k))
            .sum()
    };
    let coverage = if full {
        Coverage::Full
    } else if trace.is_some_and(|t| !t.reads.is_empty()) {
        Coverage::Trace
    } else if jobs.is_empty() {
        Coverage::Nothing
    } else {
        Coverage::Landmarks
    };

    let layers: Vec<&Arc<LayerSource>> = mount_layers(image)
        .filter_map(|l| image.layer_source(l))
        .collect();
    let (planned, present) = if full {
        let total = image.stats.bytes_total.load(Ordering::Relaxed);
        let missing: u64 = layers
            .iter()
            .flat_map(|s| s.fill_work().into_iter().map(move |w| s.work_bytes(&w)))
            .sum();
        (total, total.saturating_sub(missing))
    } else {
        (hot_bytes, hot_present)
    };
    progress.planned(planned, present);

    let targets = Targets { pins: None, files };
    let workers = concurrency.max(1);
    let hot_done = run_jobs(&steps, workers, &control, |step| {
        if stop_check() {
            return;
        }
        let source = |l: usize| image.layer_source(l);
        let result = match step {
            Step::Fetch(layer, range) => source(*layer).map(|s| {
                if s.stores_windows() {
                    s.warm_spans(range.clone())
                } else {
                    s.warm_range(range.clone())
                }
            }),
            Step::FetchMany(layer, ranges) => source(*layer).map(|s| s.warm_spans_many(ranges)),
            Step::Windows(layer, range) => source(*layer).map(|s| s.warm_windows(range.clone())),
            Step::Materialize(loc, size) => {
                if let Some(files) = targets.files {
                    materialize(image, files, *loc, *size);
                }
                None
            }
            Step::Pack(loc, size) => {
                if let Some(files) = targets.files {
                    pack_file(image, files, *loc, *size);
                }
                None
            }
        };
        match result {
            Some(Ok(n)) => add(n),
            Some(Err(e)) => {
                fail();
                tracing::warn!(error = %e, "prewarm of a range failed; it stays on demand");
            }
            None => {}
        }
    });

    if hot_done && full && !stop_check() {
        let work: Vec<(&Arc<LayerSource>, FillWork)> = layers
            .iter()
            .flat_map(|s| s.fill_work().into_iter().map(move |w| (*s, w)))
            .collect();
        let gate = |_: u64| !stop_check();
        run_jobs(&work, workers, &control, |(source, w)| {
            if stop_check() {
                return;
            }
            match source.fill(w, &gate) {
                Ok(n) => add(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    fail();
                    tracing::warn!(bytes = source.work_bytes(w), error = %e, "prewarm of a range failed; it stays on demand");
                }
            }
        });
    }
    if let Err(e) = store.flush() {
        tracing::warn!(error = %e, "flushing the store after prewarm");
    }
    PrewarmReport {
        coverage,
        planned_bytes: planned,
        present_bytes: present,
        fetched_bytes: fetched.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        stopped: control.stopped(),
        elapsed_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    }
}
