//! Fetching what a start reads next from what it reads now, for an image without a
//! trace (readahead along the stream, [`crate::readahead`], covers what *follows* a miss;
//! this covers what belongs with it):
//!
//! * the first read of a file that misses brings the **rest of the file** when the file
//!   is at most [`FetchConfig::whole_file_bytes`]: a program that opens a module or a
//!   library reads nearly all of it, the loader by page faults at scattered offsets (nine
//!   misses in one 4.7 MB `libcrypto` at a pandas start);
//! * the first miss in a directory brings the directory's **other small files** (each at
//!   most [`MAX_NEARBY_FILE`]), nearest in the stream first, up to
//!   [`FetchConfig::nearby_bytes`] compressed: a package's modules are imported together,
//!   but not in the order the tar holds them, so the miss can be anywhere among them.
//!
//! Both go out at once, in parallel with the read that asked and with each other, on a
//! small process-wide pool of fetch threads, through the same single flight,
//! verification and store as every fetch ([`LayerSource::warm_range`]). They leave out
//! the read's own spans, which the read fetches itself rather than wait behind a larger
//! request. Each file and directory asks once per mount; only reads that miss ask, so a
//! start served from its trace's prefetch adds nothing.
//!
//! Planning ([`Nearby::plan`]) is pure; the pool only runs fetches. It must not read file
//! data or keep any.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use ferry_index::merged::{Location, MergedImage};

use crate::device::{FetchConfig, LayerSource};
use crate::stats::MountStats;
use crate::tree::{Ino, InodeTree, Node, NodeKind};

/// Largest file (uncompressed) fetched as a neighbour of a miss in its directory.
pub const MAX_NEARBY_FILE: u64 = 1 << 20;
/// Threads of the process-wide pool that fetches nearby files.
const POOL_THREADS: usize = 4;
/// Fetches queued for the pool at most; beyond it a hint is dropped (the reads fetch
/// what they need themselves).
const POOL_QUEUE: usize = 4096;

/// One mount's record of what has asked already.
#[derive(Debug, Default)]
pub(crate) struct Nearby {
    whole_file_bytes: u64,
    nearby_bytes: u64,
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    /// Files whose data was asked for whole (themselves, or as a neighbour).
    files: HashSet<Ino>,
    /// Directories whose small files were asked for.
    dirs: HashSet<Ino>,
}

/// One read, as [`Nearby::plan`] sees it.
pub(crate) struct Read<'a> {
    pub ino: Ino,
    pub node: &'a Node,
    pub loc: Location,
    pub offset: u64,
    pub len: u64,
}

/// What the layers look like to the planner: compressed ranges of file bytes, and which
/// are missing (neither local nor being fetched). The mount's layers, or a test's.
pub(crate) trait Layers {
    /// The compressed ranges holding `[off, off + len)` of entry `loc`.
    fn ranges(&self, loc: Location, off: u64, len: u64) -> Vec<Range<u64>>;
    /// Where entry `loc`'s data starts in its layer's uncompressed stream.
    fn stream_offset(&self, loc: Location) -> u64;
    /// Whether some of `range` of layer `layer` is missing.
    fn missing(&self, layer: usize, range: &Range<u64>) -> bool;
}

impl Nearby {
    pub(crate) fn new(config: &FetchConfig) -> Nearby {
        Nearby {
            whole_file_bytes: config.whole_file_bytes,
            nearby_bytes: config.nearby_bytes,
            seen: Mutex::default(),
        }
    }

    fn is_off(&self) -> bool {
        self.whole_file_bytes == 0 && self.nearby_bytes == 0
    }

    /// The fetches a read asks for besides its own: per layer, sorted disjoint
    /// compressed ranges, without the read's own. Empty unless the read misses.
    pub(crate) fn plan(
        &self,
        tree: &InodeTree,
        layers: &dyn Layers,
        read: &Read<'_>,
    ) -> Vec<(usize, Range<u64>)> {
        if self.is_off() {
            return Vec::new();
        }
        let own = layers.ranges(read.loc, read.offset, read.len);
        if !own.iter().any(|r| layers.missing(read.loc.layer, r)) {
            return Vec::new();
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut want: Vec<(usize, Range<u64>)> = Vec::new();
        if read.node.size <= self.whole_file_bytes && seen.files.insert(read.ino) {
            want.extend(
                layers
                    .ranges(read.loc, 0, read.node.size)
                    .into_iter()
                    .map(|r| (read.loc.layer, r)),
            );
        }
        if self.nearby_bytes > 0 && seen.dirs.insert(read.node.parent) {
            want.extend(self.neighbours(tree, layers, read, &mut seen.files));
        }
        drop(seen);
        let own: Vec<(usize, Range<u64>)> = own.into_iter().map(|r| (read.loc.layer, r)).collect();
        subtract(merge(want), &merge(own))
            .into_iter()
            .filter(|(l, r)| layers.missing(*l, r))
            .collect()
    }

    /// The small files beside the read's, nearest in its layer's stream first, whose
    /// missing ranges fit in [`Self::nearby_bytes`]; marked as asked for.
    fn neighbours(
        &self,
        tree: &InodeTree,
        layers: &dyn Layers,
        read: &Read<'_>,
        asked: &mut HashSet<Ino>,
    ) -> Vec<(usize, Range<u64>)> {
        let Some(dir) = tree.get(read.node.parent) else {
            return Vec::new();
        };
        let here = layers.stream_offset(read.loc);
        let mut candidates: Vec<(u64, Ino, Location, u64)> =
            dir.children
                .iter()
                .filter(|(_, ino)| *ino != read.ino && !asked.contains(ino))
                .filter_map(|(_, ino)| {
                    let node = tree.get(*ino)?;
                    let loc = node.data?;
                    (node.kind == NodeKind::File && node.size > 0 && node.size <= MAX_NEARBY_FILE)
                        .then(|| {
                            let at = layers.stream_offset(loc);
                            let distance = if loc.layer == read.loc.layer {
                                at.abs_diff(here)
                            } else {
                                u64::MAX // other layers after this one's
                            };
                            (distance, *ino, loc, node.size)
                        })
                })
                .collect();
        candidates.sort_unstable_by_key(|c| (c.0, c.1));
        let mut counted: HashSet<(usize, u64, u64)> = HashSet::new();
        let mut bytes = 0u64;
        let mut out = Vec::new();
        for (_, ino, loc, size) in candidates {
            let ranges: Vec<Range<u64>> = layers
                .ranges(loc, 0, size)
                .into_iter()
                .filter(|r| layers.missing(loc.layer, r))
                .collect();
            let add: u64 = ranges
                .iter()
                .filter(|r| !counted.contains(&(loc.layer, r.start, r.end)))
                .map(|r| r.end - r.start)
                .sum();
            if bytes + add > self.nearby_bytes {
                break;
            }
            bytes += add;
            asked.insert(ino);
            for r in ranges {
                counted.insert((loc.layer, r.start, r.end));
                out.push((loc.layer, r));
            }
        }
        out
    }
}

/// The mount's layers as the planner sees them.
pub(crate) struct MountLayers<'a> {
    pub image: &'a MergedImage,
    pub sources: &'a [Option<Arc<LayerSource>>],
}

impl Layers for MountLayers<'_> {
    fn ranges(&self, loc: Location, off: u64, len: u64) -> Vec<Range<u64>> {
        self.image
            .layers()
            .get(loc.layer)
            .map(|l| l.ranges_for(loc.entry, off, len))
            .unwrap_or_default()
    }

    fn stream_offset(&self, loc: Location) -> u64 {
        self.image
            .layers()
            .get(loc.layer)
            .and_then(|l| l.entries().get(loc.entry))
            .map_or(0, |e| e.offset)
    }

    fn missing(&self, layer: usize, range: &Range<u64>) -> bool {
        self.sources
            .get(layer)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.range_missing(range.clone()))
    }
}

/// Sorts and merges overlapping or touching ranges, per layer.
fn merge(mut ranges: Vec<(usize, Range<u64>)>) -> Vec<(usize, Range<u64>)> {
    ranges.sort_unstable_by_key(|(l, r)| (*l, r.start, r.end));
    let mut out: Vec<(usize, Range<u64>)> = Vec::with_capacity(ranges.len());
    for (l, r) in ranges {
        match out.last_mut() {
            Some((pl, p)) if *pl == l && r.start <= p.end => p.end = p.end.max(r.end),
            _ => out.push((l, r)),
        }
    }
    out
}

/// The parts of `want` outside `have` (both as [`merge`] gives them).
fn subtract(
    want: Vec<(usize, Range<u64>)>,
    have: &[(usize, Range<u64>)],
) -> Vec<(usize, Range<u64>)> {
    let mut out = Vec::new();
    for (l, w) in want {
        let mut start = w.start;
        for (_, h) in have
            .iter()
            .filter(|(hl, h)| *hl == l && h.start < w.end && w.start < h.end)
        {
            if h.start > start {
                out.push((l, start..h.start));
            }
            start = start.max(h.end);
        }
        if start < w.end {
            out.push((l, start..w.end));
        }
    }
    out
}

/// A fetch for the pool.
struct Job {
    source: Weak<LayerSource>,
    range: Range<u64>,
    stats: Weak<MountStats>,
}

struct Pool {
    queue: SyncSender<Job>,
    /// Jobs queued or running, for [`wait_idle`].
    pending: Mutex<usize>,
    idle: Condvar,
}

static POOL: OnceLock<Option<Pool>> = OnceLock::new();

fn pool() -> Option<&'static Pool> {
    POOL.get_or_init(|| {
        let (queue, jobs) = std::sync::mpsc::sync_channel::<Job>(POOL_QUEUE);
        let jobs = Arc::new(Mutex::new(jobs));
        let mut started = 0;
        for i in 0..POOL_THREADS {
            let jobs = jobs.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("ferry-nearby-{i}"))
                .spawn(move || work(&jobs));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "cannot start a nearby-file fetch thread"),
            }
        }
        (started > 0).then(|| Pool {
            queue,
            pending: Mutex::new(0),
            idle: Condvar::new(),
        })
    })
    .as_ref()
}

fn work(jobs: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let rx = jobs.lock().unwrap_or_else(|e| e.into_inner());
            rx.recv()
        };
        let Ok(job) = job else { return };
        if let Some(source) = job.source.upgrade() {
            match source.warm_range(job.range.clone()) {
                Ok(n) => {
                    if let Some(stats) = job.stats.upgrade() {
                        MountStats::add(&stats.bytes_nearby, n);
                    }
                }
                Err(e) => tracing::debug!(
                    start = job.range.start,
                    end = job.range.end,
                    error = %e,
                    "nearby fetch failed; the bytes are fetched when read"
                ),
            }
        }
        if let Some(pool) = POOL.get().and_then(Option::as_ref) {
            let mut pending = pool.pending.lock().unwrap_or_else(|e| e.into_inner());
            *pending = pending.saturating_sub(1);
            if *pending == 0 {
                pool.idle.notify_all();
            }
        }
    }
}

/// Queues `ranges` of `sources`' layers for the pool (dropped when it is full).
pub(crate) fn submit(
    sources: &[Option<Arc<LayerSource>>],
    stats: &Arc<MountStats>,
    ranges: Vec<(usize, Range<u64>)>,
) {
    if ranges.is_empty() {
        return;
    }
    let Some(pool) = pool() else { return };
    for (layer, range) in ranges {
        let Some(source) = sources.get(layer).and_then(Option::as_ref) else {
            continue;
        };
        *pool.pending.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let job = Job {
            source: Arc::downgrade(source),
            range,
            stats: Arc::downgrade(stats),
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = pool.queue.try_send(job)
        {
            tracing::debug!("nearby-file queue full; hint dropped");
            let mut pending = pool.pending.lock().unwrap_or_else(|e| e.into_inner());
            *pending = pending.saturating_sub(1);
            if *pending == 0 {
                pool.idle.notify_all();
            }
        }
    }
}

/// Waits until no nearby fetch is queued or running, at most `timeout`; whether that
/// happened. For tests and measurements that must see the fetches done.
pub fn wait_idle(timeout: Duration) -> bool {
    let Some(pool) = POOL.get().and_then(Option::as_ref) else {
        return true;
    };
    let deadline = Instant::now() + timeout;
    let mut pending = pool.pending.lock().unwrap_or_else(|e| e.into_inner());
    while *pending > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        pending = pool
            .idle
            .wait_timeout(pending, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    true
}

#[cfg(test)]
#[path = "nearby_tests.rs"]
mod tests;
